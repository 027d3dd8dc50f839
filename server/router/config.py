"""Router settings (pydantic): the one source of `conveyor router`'s flags and of what the operator renders.

`--weight-prefix` for `weight_prefix`, as `conveyor serve`'s flags are generated from the engine's configs.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Policy = Literal["prefix-aware", "least-load", "round-robin"]


def is_base_url(url: str) -> bool:
    """Whether `url` is a replica base URL: http(s), a host, a valid port if any, no path."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not parts.path.strip("/")


class RouterConfig(BaseModel):
    """Where the replicas are and how a request picks one."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind")
    endpoint: list[str] = Field(
        default_factory=list, description="replica base URLs (http://HOST:PORT), a static list"
    )
    service: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="NAMESPACE/NAME of a Kubernetes Service: replicas are the ready addresses of its "
        "EndpointSlices, followed as they change",
    )
    service_port_name: str = Field("http", description="the EndpointSlice port used with --service")
    endpoint_file: str | None = Field(
        None,
        min_length=1,
        description="a file of replica base URLs, one per line (# comments), re-read within a second of "
        "every change: replicas another tool keeps track of",
    )
    policy: Policy = Field(
        "prefix-aware",
        description="prefix-aware = weighted queue, KV-use and prefix-affinity scores; least-load = queue "
        "and KV-use scores only; round-robin = in turn",
    )
    weight_queue: float = Field(1.0, ge=0, description="weight of the queue-depth score")
    weight_kv: float = Field(1.0, ge=0, description="weight of the KV-cache-usage score")
    weight_prefix: float = Field(2.0, ge=0, description="weight of the prefix-affinity score")
    weight_lora: float = Field(
        1.0,
        ge=0,
        description="weight of the LoRA-affinity score: a request naming an adapter prefers replicas where "
        "it is resident, then those with a free adapter slot",
    )
    load_gate: int = Field(
        8,
        ge=0,
        description="prefix affinity is ignored for a replica whose load (waiting + running requests) is "
        "more than this above the least-loaded replica's",
    )
    prefix_mode: Literal["auto", "exact", "approximate"] = Field(
        "auto",
        description="exact = follow each replica's KV block stored/evicted events (/v1/kv_events); "
        "approximate = remember the blocks routed to each replica (LRU sized to its KV block count); "
        "auto = exact where a replica publishes events",
    )
    tokenizer: str | None = Field(
        None,
        description="the model source the replicas serve (directory, .gguf file or hub id), for its "
        "tokenizer and chat template; default: the embedded SmolLM2-135M-Instruct",
    )
    served_model_name: str | None = Field(
        None, description="the `model_name` label of the router's metrics; default: the tokenizer's model"
    )
    block_size: int = Field(
        16, ge=1, description="the replicas' KV block size, until a replica reports its own"
    )
    queue_timeout: float = Field(
        60.0,
        gt=0,
        description="seconds a request waits in the router when no replica is ready (scale from zero), "
        "then 503",
    )
    max_waiting_per_endpoint: int = Field(
        64,
        ge=1,
        description="a replica with this many waiting requests is saturated; with every replica "
        "saturated a request gets 429",
    )
    scrape_interval: float = Field(
        0.5, gt=0, description="seconds between reads of each replica's /health and /metrics"
    )

    @field_validator("endpoint")
    @classmethod
    def _base_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not is_base_url(url):
                raise ValueError(f"{url!r} is not a replica base URL like http://10.0.0.7:8000")
        return urls

    @model_validator(mode="after")
    def _one_source(self) -> RouterConfig:
        if sum((bool(self.endpoint), self.service is not None, self.endpoint_file is not None)) != 1:
            raise ValueError(
                "give the replicas in one way: --endpoint URL ..., --service NAMESPACE/NAME or --endpoint-file FILE"
            )
        return self
