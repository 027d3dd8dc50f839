"""The streaming client against canned SSE responses (no server)."""

import asyncio
import json
import time

import httpx
import pytest

from conveyor.benchmarks.client import CHAT_COMPLETIONS, RequestSettings, build_payload, send_request
from conveyor.benchmarks.datasets import SampleRequest


def _sse(*events: dict | str) -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode()


def _run(handler, sample, settings=None):
    settings = settings or RequestSettings(model="m")

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, "http://test", sample, settings, time.perf_counter())

    return asyncio.run(go())


def test_payload_asks_for_exact_output_length():
    payload = build_payload(SampleRequest([5, 6, 7], 3, 12), RequestSettings(model="smol"))
    assert payload == {
        "model": "smol",
        "prompt": [5, 6, 7],
        "max_tokens": 12,
        "min_tokens": 12,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_chat_payload_needs_text():
    settings = RequestSettings(model="smol", endpoint=CHAT_COMPLETIONS, exact_output=False)
    payload = build_payload(SampleRequest("hi", 1, 2), settings)
    assert payload["messages"] == [{"role": "user", "content": "hi"}]
    assert "ignore_eos" not in payload
    with pytest.raises(ValueError):
        build_payload(SampleRequest([1], 1, 2), settings)


def test_stream_is_timed_per_chunk_and_counted_from_usage():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = json.loads(request.content)
        seen["path"] = request.url.path
        body = _sse(
            {"choices": [{"index": 0, "text": "a"}]},
            {"choices": [{"index": 0, "text": "b"}]},
            {"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}},
            "[DONE]",
        )
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    record = _run(handler, SampleRequest([1, 2, 3], 3, 4))
    assert seen["path"] == "/v1/completions"
    assert seen["body"]["prompt"] == [1, 2, 3]
    assert record.success
    assert record.output_len == 4  # usage wins over the 3 chunks
    assert record.prompt_len == 3
    assert len(record.itl_s) == 2
    assert record.latency_s >= record.ttft_s >= 0


def test_http_error_is_a_failed_record():
    record = _run(lambda r: httpx.Response(400, json={"error": {"message": "bad"}}), SampleRequest([1], 1, 2))
    assert not record.success
    assert record.error.startswith("HTTP 400")


def test_stream_without_tokens_fails():
    record = _run(lambda r: httpx.Response(200, content=_sse("[DONE]")), SampleRequest([1], 1, 2))
    assert not record.success
    assert "without a token" in record.error


def test_extra_body_is_merged_into_the_payload():
    settings = RequestSettings(model="m", extra_body={"logit_bias": {"2": -100}, "temperature": 0.5})
    payload = build_payload(SampleRequest([1], 1, 3), settings)
    assert payload["logit_bias"] == {"2": -100}
    assert payload["temperature"] == 0.5


def test_a_sample_may_name_its_own_model():
    settings = RequestSettings(model="base")
    assert build_payload(SampleRequest([1], 1, 3), settings)["model"] == "base"
    assert build_payload(SampleRequest([1], 1, 3, model="lora-3"), settings)["model"] == "lora-3"


def test_without_usage_text_chunks_are_counted_and_a_closing_chunk_is_not_a_token():
    body = _sse(
        {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "b", "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "c"}}]},
        {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
        "[DONE]",
    )
    record = _run(lambda r: httpx.Response(200, content=body), SampleRequest([1, 2], 2, 3))
    assert record.success
    assert record.output_len == 3
    assert len(record.itl_s) == 2


def test_bench_without_a_server_is_a_one_line_error(capsys):
    from conveyor.benchmarks.serve import main

    assert (
        main(
            [
                "--base-url",
                "http://127.0.0.1:1",
                "--num-prompts",
                "1",
                "--input-len",
                "4",
                "--output-len",
                "2",
            ]
        )
        == 1
    )
    assert "cannot reach http://127.0.0.1:1" in capsys.readouterr().err
