"""The router's Prometheus series (prefix `conveyor:router_`), every one carrying `model_name`.

`router_requests_waiting` is what wakes a service scaled to zero: with no replica there is no replica
metric, but the router still counts the requests it holds (the operator's autoscaler reads it).
`router_prefix_hit_tokens_total / router_prompt_tokens_total` is the router's estimate of the prefix
cache hit rate, to compare with the replicas' measured `prefix_cache_hits_total / prefix_cache_queries_total`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from conveyor.server.api.metrics import LATENCY_BUCKETS


class RouterMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.waiting = Gauge(
            "conveyor:router_requests_waiting",
            "Requests held in the router because no replica is ready.",
            m,
            registry=r,
        )
        self.requests = Counter(
            "conveyor:router_requests",
            "Requests sent to a replica, by the picker's reason (prefix, adapter, gated, load, round-robin).",
            ["model_name", "endpoint", "decision"],
            registry=r,
        )
        self.retries = Counter(
            "conveyor:router_retries",
            "Requests sent again elsewhere because their replica failed before the first byte.",
            ["model_name", "endpoint"],
            registry=r,
        )
        self.rejected = Counter(
            "conveyor:router_rejected",
            "Requests answered by the router itself: queue_timeout (503), saturated (429), failed (502).",
            ["model_name", "reason"],
            registry=r,
        )
        self.queue_time = Histogram(
            "conveyor:router_queue_time_seconds",
            "Arrival at the router to sending to a replica (seconds).",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "conveyor:router_prompt_tokens", "Prompt tokens of routed requests.", m, registry=r
        )
        self.prefix_hit_tokens = Counter(
            "conveyor:router_prefix_hit_tokens",
            "Prompt tokens the chosen replica was believed to hold in its prefix cache.",
            m,
            registry=r,
        )
        self.endpoints = Gauge(
            "conveyor:router_endpoints",
            "Replicas known to the router, by state.",
            ["model_name", "state"],
            registry=r,
        )
        self.in_flight = Gauge(
            "conveyor:router_in_flight",
            "Requests at each replica now.",
            ["model_name", "endpoint"],
            registry=r,
        )
        # Series exist at zero from the start, so "no traffic" and "no data" differ.
        for series in (self.waiting, self.prompt_tokens, self.prefix_hit_tokens):
            series.labels(model_name)
        self.queue_time.labels(model_name)
        for state in ("ready", "not_ready"):
            self.endpoints.labels(model_name, state)
        for reason in ("queue_timeout", "saturated", "failed"):
            self.rejected.labels(model_name, reason)
