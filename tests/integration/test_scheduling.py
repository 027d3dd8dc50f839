"""Chunked prefill, preemption and prefix caching on the real model: every output equals the same
prompt run alone with all of them off (float32, greedy)."""

from __future__ import annotations

import pytest

from conveyor.server.config import SchedulerConfig
from conveyor.server.engine.kv_cache import KVCacheManager
from conveyor.server.engine.scheduler import make_scheduler
from conveyor.server.messages import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def configure(engine, num_blocks: int | None = None, caching: bool = True, **scheduler) -> None:
    """Give the (idle) engine a fresh block manager and scheduler; the model and KV tensors stay."""
    assert not engine.has_unfinished_requests()
    blocks = num_blocks or engine.runner.kv_caches[0][0].shape[0]
    engine.kv_cache = KVCacheManager(blocks, engine.runner.block_size, enable_prefix_caching=caching)
    engine.scheduler = make_scheduler(SchedulerConfig(**scheduler), engine.kv_cache, max_num_seqs=16)


def run(engine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    for rid, ids in prompts.items():
        engine.add_request(engine.make_request(rid, ids, params))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return out


def alone(engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each prompt by itself, caching and chunking off."""
    configure(engine, caching=False, enable_chunked_prefill=False, max_num_batched_tokens=4096)
    return {rid: run(engine, {rid: ids})[rid] for rid, ids in prompts.items()}


@pytest.fixture(scope="module")
def texts(engine):
    tok = engine.tokenizer
    story = "In the heart of the old city there was a library that never closed, and every night "
    return {
        "long": tok(story * 4)["input_ids"][:50],
        "a": tok("The history of the printing press begins")["input_ids"],
        "b": tok("Photosynthesis is the process by which plants")["input_ids"],
        "c": tok("A good cup of coffee needs")["input_ids"],
        "d": tok("The rules of chess say that")["input_ids"],
        "prefix": tok(story * 4)["input_ids"][:48],
    }


@pytest.fixture(scope="module", autouse=True)
def restore(engine):
    yield
    configure(engine)


def test_a_50_token_prompt_in_16_token_chunks(engine, texts):
    expected = alone(engine, {"long": texts["long"]})
    configure(engine, max_num_batched_tokens=16)
    steps_before = engine.stats.num_steps
    assert run(engine, {"long": texts["long"]}) == expected
    chunks = [
        r.scheduled[0][1] for r in list(engine.stats.recent_steps)[-(engine.stats.num_steps - steps_before) :]
    ]
    assert chunks[:4] == [16, 16, 16, 2]


def test_preemption_when_the_pool_is_too_small(engine, texts):
    prompts = {k: texts[k] for k in "abcd"}
    expected = alone(engine, prompts)
    # 4 sequences of ~10 prompt + 12 output tokens need 8 blocks of 16; give them 5.
    configure(engine, num_blocks=5)
    preemptions = engine.scheduler.num_preemptions
    assert run(engine, prompts) == expected
    assert engine.scheduler.num_preemptions > preemptions


def test_the_same_32_token_prompt_twice_hits_the_cache(engine, texts):
    prompt = texts["long"][:32]
    expected = alone(engine, {"p": prompt})
    configure(engine)
    first = run(engine, {"first": prompt})
    hits = engine.kv_cache.prefix_cache_hits
    second = run(engine, {"second": prompt})
    # Both blocks are cached; the last token is always recomputed, so the first block is reused.
    assert engine.kv_cache.prefix_cache_hits - hits == 16
    assert first["first"] == second["second"] == expected["p"]


@pytest.mark.parametrize("caching", [True, False])
def test_two_prompts_sharing_a_48_token_prefix(engine, texts, caching):
    assert len(texts["prefix"]) == 48
    prompts = {"x": texts["prefix"] + texts["a"], "y": texts["prefix"] + texts["b"]}
    expected = alone(engine, prompts)
    configure(engine, caching=caching)
    assert run(engine, {"x": prompts["x"]}) == {"x": expected["x"]}
    hits = engine.kv_cache.prefix_cache_hits
    assert run(engine, {"y": prompts["y"]}) == {"y": expected["y"]}
    assert engine.kv_cache.prefix_cache_hits - hits == (48 if caching else 0)


def test_chunked_prefill_keeps_decodes_going(engine, texts):
    configure(engine, max_num_batched_tokens=16)
    engine.add_request(
        engine.make_request(
            "decode", texts["a"], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        )
    )
    engine.step()  # prefill the short prompt
    engine.add_request(
        engine.make_request(
            "long", texts["long"], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        )
    )
    start = engine.stats.num_steps
    while engine.has_unfinished_requests():
        engine.step()
    steps = list(engine.stats.recent_steps)[-(engine.stats.num_steps - start) :]
    with_long = [dict(r.scheduled) for r in steps if "long" in dict(r.scheduled)]
    assert len(with_long) >= 4  # the 50-token prompt needed several chunks
    assert all(s.get("decode") == 1 for s in with_long[:4])  # the decode got a token in every one of them


def test_static_batching_pads_until_the_longest_member_ends(engine, texts):
    prompts = {k: texts[k] for k in "abcd"}
    expected = alone(engine, prompts)
    configure(engine, scheduling="static", enable_chunked_prefill=False, max_num_batched_tokens=4096)
    lengths = {"a": 2, "b": 4, "c": 8, "d": 12}
    for rid, ids in prompts.items():
        engine.add_request(
            engine.make_request(
                rid, ids, SamplingParams(temperature=0.0, max_tokens=lengths[rid], ignore_eos=True)
            )
        )
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    start = engine.stats.num_steps
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert out == {rid: expected[rid][: lengths[rid]] for rid in prompts}
    steps = list(engine.stats.recent_steps)[-(engine.stats.num_steps - start) :]
    # Every step of the batch computes all four slots: finished members are padding until "d" ends.
    assert [len(r.scheduled) for r in steps] == [4] * 12
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
