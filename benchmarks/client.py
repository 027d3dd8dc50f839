"""Streaming OpenAI-compatible HTTP client that times each request (the I/O shell of the benchmark).

One request = one SSE stream. Every chunk that carries generated text is a timestamp (a closing chunk with
only a ``finish_reason`` is not); the final usage chunk (``stream_options.include_usage``) gives the exact
token counts, and without it the text chunks are counted.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from conveyor.benchmarks.datasets import SampleRequest
from conveyor.benchmarks.metrics import RequestRecord

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass(frozen=True)
class RequestSettings:
    """Request fields shared by every request of a run.

    Attributes:
        model: the ``model`` field sent.
        endpoint: ``/v1/completions`` or ``/v1/chat/completions``.
        exact_output: send ``ignore_eos`` and ``min_tokens = max_tokens = output_len`` so every system
            generates exactly the requested number of tokens.
        temperature: sampling temperature (0 = greedy).
        extra_body: more JSON fields merged into every request (server-specific options).
    """

    model: str
    endpoint: str = COMPLETIONS
    exact_output: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_payload(sample: SampleRequest, settings: RequestSettings) -> dict[str, Any]:
    """The JSON body for one streamed request (`model`: the sample's, e.g. a LoRA adapter, else the run's)."""
    payload: dict[str, Any] = {
        "model": sample.model or settings.model,
        "max_tokens": sample.output_len,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.exact_output:
        payload["ignore_eos"] = True
        payload["min_tokens"] = sample.output_len
    if settings.endpoint == CHAT_COMPLETIONS:
        if not isinstance(sample.prompt, str):
            raise ValueError("the chat endpoint needs text prompts (use --prompt-format text)")
        payload["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        payload["prompt"] = sample.prompt
    payload.update(settings.extra_body)
    return payload


async def send_request(
    client: httpx.AsyncClient, base_url: str, sample: SampleRequest, settings: RequestSettings, t0: float
) -> RequestRecord:
    """Send one streamed request and time it; ``t0`` is the run's start (``time.perf_counter`` seconds).

    Never raises for a server or transport error: the record then has ``success=False`` and the error text.
    """
    payload = build_payload(sample, settings)
    start = time.perf_counter()
    ttft = 0.0
    last = start
    itl: list[float] = []
    chunks = 0
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", base_url + settings.endpoint, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                return _failed(sample, start - t0, f"HTTP {response.status_code}: {body[:500]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    return _failed(sample, start - t0, json.dumps(chunk["error"])[:500])
                now = time.perf_counter()
                if _has_text(chunk):
                    if chunks == 0:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return _failed(sample, start - t0, f"{type(err).__name__}: {err}")
    if chunks == 0:
        return _failed(sample, start - t0, "stream ended without a token")
    output_len = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else chunks
    prompt_len = int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else sample.prompt_len
    return RequestRecord(
        prompt_len=prompt_len,
        output_len=output_len,
        ttft_s=ttft,
        latency_s=last - start,
        itl_s=tuple(itl),
        start_s=start - t0,
    )


def _has_text(chunk: dict[str, Any]) -> bool:
    """Whether a stream chunk carries generated text (completions ``text`` or chat ``delta.content``)."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


def _failed(sample: SampleRequest, start_s: float, error: str) -> RequestRecord:
    return RequestRecord(
        prompt_len=sample.prompt_len,
        output_len=0,
        ttft_s=0.0,
        latency_s=0.0,
        start_s=start_s,
        success=False,
        error=error,
    )


async def first_model_id(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id listed by ``GET /v1/models``; raises httpx.HTTPError or LookupError."""
    response = await client.get(base_url + "/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise LookupError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


async def served_model_id(base_url: str) -> str:
    """`first_model_id` over a client of its own (30 s timeout)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
        return await first_model_id(client, base_url)
