"""The engine on the real embedded model: greedy output equals transformers', whatever the batching."""

from __future__ import annotations

import pytest

from conveyor.server.messages import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
    "Translate to French: I like apples.",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at a temperature of",
]


def run_to_completion(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Add all requests at once, step until done; returns generated token ids per request id."""
    for request_id, (prompt_ids, params) in requests.items():
        engine.add_request(engine.make_request(request_id, prompt_ids, params))
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def test_greedy_equals_transformers_with_shared_batches(engine, hf_greedy):
    tok = engine.tokenizer
    prompts = {f"p{i}": tok(p)["input_ids"] for i, p in enumerate(PROMPTS)}
    steps_before = engine.stats.num_steps
    ours = run_to_completion(
        engine, {rid: (ids, SamplingParams(temperature=0.0, max_tokens=24)) for rid, ids in prompts.items()}
    )
    records = list(engine.stats.recent_steps)[-(engine.stats.num_steps - steps_before) :]
    assert max(len(r.scheduled) for r in records) == len(PROMPTS), "the prompts did not share a step"
    for rid, ids in prompts.items():
        assert ours[rid] == hf_greedy(ids, 24), f"{rid}: {PROMPTS[int(rid[1:])]!r}"
    assert engine.kv_cache.usage == 0.0


def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    tok = engine.tokenizer
    prompt = tok("Write a short poem about the sea.")["input_ids"]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)
    alone = run_to_completion(engine, {"alone": (prompt, params)})["alone"]
    crowd = {
        f"other{i}": (tok(p)["input_ids"], SamplingParams(temperature=1.0, max_tokens=16))
        for i, p in enumerate(PROMPTS)
    }
    crowd["seeded"] = (prompt, SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16))
    assert run_to_completion(engine, crowd)["seeded"] == alone


def test_a_queued_request_whose_client_left_is_never_prefilled(engine, monkeypatch):
    import asyncio

    from conveyor.server.engine.async_engine import AsyncEngine

    # The loop thread is not started: the test plays its part, so the order of events is exact.
    monkeypatch.setattr(AsyncEngine, "is_running", property(lambda self: True))
    async_engine = AsyncEngine(engine)
    prompt = engine.tokenizer("A request nobody waits for")["input_ids"]

    async def client_leaves() -> None:
        stream = async_engine.generate(engine.make_request("gone", prompt, SamplingParams(max_tokens=4)))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(anext(stream), timeout=0.05)  # queued, then the client goes away

    asyncio.run(client_leaves())
    async_engine._drain(None)  # what the loop does before every step: its commands, in order
    steps_before = engine.stats.num_steps
    engine.step()
    assert engine.stats.num_steps == steps_before  # nothing was scheduled: "gone" never ran
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
