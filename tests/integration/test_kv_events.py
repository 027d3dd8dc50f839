"""GET /v1/kv_events on a real server: the block hashes a router tracks equal the prompt's hash chain."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from conveyor.server.block_hash import hash_block

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# Used by no other test, so none of its blocks is cached before this one sends it.
PROMPT = (
    "Kv events test: the lighthouse keeper counted ships every evening, wrote their names in a blue "
    "ledger, and compared the flags against a chart his grandfather had drawn by hand decades ago. On "
    "stormy nights he lit a second lamp, listened for the foghorn of the ferry from the northern island, "
    "and when it was late he walked down to the harbour to count the boats that had come home."
)


def events(response: httpx.Response):
    """The JSON of each server-sent event: one `data: <json>` line and a blank line per event."""
    lines = response.iter_lines()
    for line in lines:
        assert line.startswith("data: "), line
        assert next(lines) == ""
        yield json.loads(line.removeprefix("data: "))


def hash_chain(token_ids: list[int], block_size: int) -> list[str]:
    hashes: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block(hashes[-1] if hashes else None, block))
    return [h.hex() for h in hashes]


def subscribers(server) -> int:
    return server.app.state.engine.num_kv_event_subscribers


def wait_for_subscribers(server, count: int) -> None:
    deadline = time.monotonic() + 30
    while (n := subscribers(server)) != count:
        assert time.monotonic() < deadline, f"{n} KV event subscribers, not {count}"
        time.sleep(0.05)


def test_stored_hashes_are_the_prompt_chain_and_a_new_subscriber_sees_them(server):
    llm = server.llm_engine
    token_ids = llm.tokenizer(PROMPT)["input_ids"]  # as the server tokenizes a completion's prompt
    assert len(token_ids) > 3 * 16
    chain = hash_chain(token_ids, 16)
    timeout = httpx.Timeout(30.0)
    with (
        httpx.Client(base_url=server.base_url, timeout=timeout) as client,
        client.stream("GET", "/v1/kv_events") as first,
    ):
        assert first.status_code == 200
        assert first.headers["content-type"].startswith("text/event-stream")
        stream = events(first)
        snapshot = next(stream)
        assert snapshot.keys() == {"type", "block_size", "num_blocks", "hashes"}
        assert (snapshot["type"], snapshot["block_size"]) == ("snapshot", 16)
        assert snapshot["num_blocks"] == llm.num_kv_blocks
        assert not set(chain) & set(snapshot["hashes"])
        reply = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        )
        assert reply.status_code == 200
        assert reply.json()["usage"]["prompt_tokens"] == len(token_ids)
        stored: list[str] = []
        while len(stored) < len(chain):
            event = next(stream)
            assert event["type"] == "stored", event  # nothing else happens on this idle server
            assert event.keys() == {"type", "hashes"}
            stored += event["hashes"]
        assert stored == chain
        assert all(len(h) == 32 for h in stored)

        with client.stream("GET", "/v1/kv_events") as second:
            second_events = events(second)  # held: dropping the iterator would close the connection
            later = next(second_events)
            assert later["type"] == "snapshot"
            assert set(chain) <= set(later["hashes"])
            wait_for_subscribers(server, 2)
    wait_for_subscribers(server, 0)  # both clients gone: unsubscribed


def test_config_info_gives_block_size_block_count_and_max_num_seqs(server):
    llm = server.llm_engine
    text = httpx.get(server.base_url + "/metrics").text
    expected = (
        f'conveyor:cache_config_info{{block_size="16",model_name="{MODEL}",'
        f'num_gpu_blocks="{llm.num_kv_blocks}"}} 1.0'
    )
    assert expected in text.splitlines()
    limits = (
        f'conveyor:scheduler_config_info{{max_num_batched_tokens="2048",max_num_seqs="{llm.scheduler.max_num_seqs}",'
        f'model_name="{MODEL}"}} 1.0'
    )
    assert limits in text.splitlines()
