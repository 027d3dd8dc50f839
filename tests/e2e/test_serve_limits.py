"""Load shedding and shutdown of a real `conveyor serve` process: a bounded waiting queue answers 429
with Retry-After, an oversized body 413, and SIGTERM drains running streams before the process exits."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.conftest import ServeProcess, start_serve
from tests.prometheus import stop_process

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> Iterator[ServeProcess]:
    """One running sequence at a time, two more may wait, bodies up to 4 KiB."""
    server = start_serve(
        tmp_path_factory.mktemp("limits") / "serve.log",
        "--max-num-seqs", "1",
        "--max-waiting-requests", "2",
        "--max-request-body-bytes", "4096",
    )  # fmt: skip
    try:
        yield server
    finally:
        stop_process(server.proc)


async def _gauge(http: httpx.AsyncClient, name: str) -> float:
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith(f"conveyor:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _until(http: httpx.AsyncClient, name: str, value: float) -> None:
    deadline = time.monotonic() + 120
    while await _gauge(http, name) < value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        await asyncio.sleep(0.05)


def test_a_full_waiting_queue_answers_429_and_loses_nothing(limited) -> None:
    async def main():
        client = openai.AsyncOpenAI(base_url=limited.base_url + "/v1", api_key="unused", max_retries=0)
        long = dict(model=MODEL, prompt="Once upon a time", max_tokens=120, temperature=0,
                    extra_body={"ignore_eos": True})  # fmt: skip
        async with httpx.AsyncClient(base_url=limited.base_url) as http:
            # One at a time, so that no request is shed while an earlier one still sits in the queue.
            queued = [asyncio.create_task(client.completions.create(**long))]
            await _until(http, "num_requests_running", 1)
            queued += [asyncio.create_task(client.completions.create(**long)) for _ in range(2)]
            await _until(http, "num_requests_waiting", 2)  # one runs, two wait
        with pytest.raises(openai.RateLimitError) as shed:
            await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        done = await asyncio.gather(*queued)
        return shed.value, done

    shed, done = asyncio.run(main())
    assert shed.response.headers["retry-after"] == "1"
    assert shed.code == "too_many_requests" and "--max-waiting-requests 2" in shed.message
    assert [d.usage.completion_tokens for d in done] == [120, 120, 120]
    # With the queue drained, requests are admitted again.
    ok = httpx.post(limited.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_requests_arriving_at_once_never_overfill_the_queue(limited) -> None:
    """Admission is atomic: eight requests sent together while one runs can fill the two waiting
    places and no more (the rest get 429), whatever the order their checks run in."""

    async def main():
        client = openai.AsyncOpenAI(base_url=limited.base_url + "/v1", api_key="unused", max_retries=0)
        long = dict(model=MODEL, prompt="Once upon a time", max_tokens=60, temperature=0,
                    extra_body={"ignore_eos": True})  # fmt: skip
        async with httpx.AsyncClient(base_url=limited.base_url) as http:
            running = asyncio.create_task(client.completions.create(**{**long, "max_tokens": 200}))
            await _until(http, "num_requests_running", 1)
            burst = await asyncio.gather(
                *(client.completions.create(**long) for _ in range(8)), return_exceptions=True
            )
            await running
        return burst

    burst = asyncio.run(main())
    served = [b for b in burst if not isinstance(b, BaseException)]
    shed = [b for b in burst if isinstance(b, openai.RateLimitError)]
    assert len(served) <= 2 and len(served) + len(shed) == 8, burst
    assert all(s.usage.completion_tokens == 60 for s in served)


def test_an_oversized_body_is_413_declared_or_chunked(limited) -> None:
    big = {"prompt": "x" * 5000, "max_tokens": 1}
    declared = httpx.post(limited.base_url + "/v1/completions", json=big)
    assert declared.status_code == 413
    assert "--max-request-body-bytes (4096 bytes)" in declared.json()["error"]["message"]

    def chunks():
        body = json.dumps(big).encode()
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    chunked = httpx.post(limited.base_url + "/v1/completions", content=chunks())
    assert chunked.status_code == 413 and chunked.json()["error"]["type"] == "invalid_request_error"
    small = httpx.post(
        limited.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60
    )
    assert small.status_code == 200


def test_sigterm_finishes_running_streams_then_exits(tmp_path) -> None:
    server = start_serve(tmp_path / "serve.log", "--shutdown-grace-period", "60")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=80,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        first = next(chunks)  # the stream is running
        server.proc.send_signal(signal.SIGTERM)
        # While draining: readiness fails on a connection already open, or new connections are refused.
        probe: dict[str, object] = {}

        def check_health() -> None:
            time.sleep(0.5)
            try:
                probe["status"] = httpx.get(server.base_url + "/health", timeout=5).status_code
            except httpx.TransportError as exc:
                probe["status"] = type(exc).__name__

        checker = threading.Thread(target=check_health)
        checker.start()
        rest = list(chunks)
        checker.join()
        text = (first.choices[0].delta.content or "") + "".join(
            c.choices[0].delta.content or "" for c in rest if c.choices
        )
        assert rest[-1].usage.completion_tokens == 80 and text
        assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
        assert probe["status"] in (503, "ConnectError"), probe
        assert server.proc.wait(timeout=30) == 0
    finally:
        stop_process(server.proc)


def test_sigterm_past_the_grace_period_aborts_and_exits(tmp_path) -> None:
    server = start_serve(tmp_path / "serve.log", "--shutdown-grace-period", "1")
    try:
        with httpx.stream(
            "POST",
            server.base_url + "/v1/completions",
            json={"prompt": "Once", "max_tokens": 900, "ignore_eos": True, "stream": True},
            timeout=60,
        ) as reply:
            lines = reply.iter_lines()
            next(lines)
            sent = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            with pytest.raises(httpx.HTTPError):  # cut off when the grace period ends
                for _ in lines:
                    pass
        assert server.proc.wait(timeout=30) == 0
        assert time.monotonic() - sent < 15
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not exit after its grace period")
    finally:
        stop_process(server.proc)
