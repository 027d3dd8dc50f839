"""The scheduler with a fake model: budgets, chunked prefill, preemption, static batching, and
invariants over random workloads (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.server.config import SchedulerConfig
from conveyor.server.engine import scheduler as scheduling
from conveyor.server.engine.kv_cache import KVCacheManager
from conveyor.server.engine.output import stop_reason
from conveyor.server.engine.request import Request
from conveyor.server.engine.scheduler import Scheduler
from conveyor.server.messages import FinishReason, SamplingParams

MAX_MODEL_LEN = 4096
_clock = itertools.count()


def make_request(rid: str, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    return Request(
        rid,
        [7] * prompt_len,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_id=0,
        arrival_time=float(next(_clock)),
        priority=priority,
    )


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, caching=False, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return scheduling.make_scheduler(SchedulerConfig(**config), kv, max_num_seqs)


def step(scheduler: Scheduler):
    """One step with a fake model that samples token 1 for every request that reaches its end."""
    out = scheduler.schedule()
    sampled = {s.request.request_id: [1] for s in out.scheduled if s.samples}
    for request, _, _ in scheduler.update_from_output(out, sampled, MAX_MODEL_LEN):
        reason = stop_reason(request, len(request.output_token_ids), MAX_MODEL_LEN)
        if reason is not None:
            scheduler.finish_request(request, reason)
    return out


def test_decodes_first_then_prefill_chunks_fill_the_budget():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_request("old", 3, 10))
    step(s)  # prefill "old" (3 tokens) and sample its first token
    s.add_request(make_request("long", 20, 2))
    plans = [[(x.request.request_id, x.num_new_tokens) for x in step(s).scheduled] for _ in range(3)]
    assert plans == [[("old", 1), ("long", 7)], [("old", 1), ("long", 7)], [("old", 1), ("long", 6)]]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_fits():
    s = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    s.add_request(make_request("a", 10, 5))
    s.add_request(make_request("b", 10, 5))
    first = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in first.scheduled] == [("a", 10)]
    second = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in second.scheduled] == [("a", 1), ("b", 10)]


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 2, 3))
    out = step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 2


def test_preemption_recomputes_the_newest_and_keeps_its_tokens():
    s = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64)
    s.add_request(make_request("first", 4, 8))
    s.add_request(make_request("second", 4, 8))
    step(s)  # both prefilled: one block each
    out = step(s)  # both need a second block for token 5, one is left: the newest is preempted
    assert [r.request_id for r in out.preempted] == ["second"]
    second = next(r for r in s.waiting if r.request_id == "second")
    assert second.output_token_ids == [1] and second.num_computed_tokens == 0
    assert s.num_preemptions == 1
    while s.num_unfinished:
        step(s)
    assert s.kv_cache.num_free_blocks == 3
    assert second.output_token_ids == [1] * 8


def test_preemptions_do_not_count_as_prefix_cache_queries_or_hits():
    # Regression: a preempted request re-prefilled from its own still-cached blocks was counted again
    # (16 unique prompts, 12 preemptions read as a 43 % hit rate). Unique prompts share nothing: 0 hits.
    s = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=16, caching=True, max_num_batched_tokens=256)
    prompts = [[1000 * i + t for t in range(10)] for i in range(16)]
    for i, prompt in enumerate(prompts):
        s.add_request(
            Request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=12, ignore_eos=True),
                eos_token_id=0,
                arrival_time=float(next(_clock)),
            )
        )
    stats = []
    while s.num_unfinished:
        stats.append(s.make_stats(step(s)))
    assert s.num_preemptions > 0
    assert s.kv_cache.prefix_cache_queries == 16 * 10
    assert s.kv_cache.prefix_cache_hits == 0
    # What metrics read: each step's own share, adding up to the totals.
    assert sum(x.num_preempted for x in stats) == s.num_preemptions
    assert sum(x.prefix_cache_queries for x in stats) == 16 * 10
    assert sum(x.prefix_cache_hits for x in stats) == 0
    assert stats[-1].num_running == stats[-1].num_waiting == 0 and stats[-1].kv_cache_usage == 0


def test_step_stats_count_prefix_hits_once_and_show_the_queues():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=1, caching=True)
    s.add_request(make_request("a", 9, 1))
    first = s.make_stats(step(s))
    assert (first.prefix_cache_queries, first.prefix_cache_hits, first.num_running) == (9, 0, 0)
    s.add_request(make_request("b", 9, 2))  # the same 9 tokens: two full blocks are cached
    s.add_request(make_request("c", 3, 2))
    second = s.make_stats(step(s))
    assert (second.prefix_cache_queries, second.prefix_cache_hits) == (9, 8)
    assert (second.num_running, second.num_waiting, second.num_batched_tokens) == (1, 1, 1)
    assert s.make_stats(step(s)).prefix_cache_queries == 0  # "b" decodes: nothing is looked up


def test_the_scheduling_mode_picks_the_class():
    assert type(make_scheduler()) is Scheduler
    assert type(make_scheduler(scheduling="static")) is scheduling.StaticScheduler
    kv = KVCacheManager(8, 4)
    with pytest.raises(ValueError, match="use make_scheduler"):
        Scheduler(SchedulerConfig(scheduling="static"), kv, 4)


def test_static_batching_admits_only_when_the_batch_is_done():
    s = make_scheduler(scheduling="static", max_num_batched_tokens=64)
    s.add_request(make_request("a", 2, 1))
    s.add_request(make_request("b", 2, 4))
    step(s)  # a and b prefill; a is done after one token
    s.add_request(make_request("c", 2, 1))
    ids = [[x.request.request_id for x in step(s).scheduled] for _ in range(3)]
    # "a" is done but, as in a padded batch, its slot computes a wasted token until "b" ends.
    assert ids == [["b", "a"], ["b", "a"], ["b", "a"]]
    # "b" finished in the last of those steps: the batch and its padding are gone, every block is free.
    assert s.padding == [] and s.kv_cache.num_free_blocks == 64
    assert [x.request.request_id for x in step(s).scheduled] == ["c"]


def test_priority_policy_runs_lower_priority_value_first():
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    s.add_request(make_request("low", 2, 1, priority=5))
    s.add_request(make_request("high", 2, 1, priority=-1))
    assert [x.request.request_id for x in step(s).scheduled] == ["high"]


def test_abort_frees_blocks_at_once():
    s = make_scheduler()
    s.add_request(make_request("a", 9, 100))
    step(s)
    assert s.kv_cache.num_free_blocks < 64
    request = s.abort_request("a")
    assert request.finish_reason is FinishReason.ABORT
    assert s.kv_cache.num_free_blocks == 64 and s.num_unfinished == 0


workloads = st.lists(
    st.tuples(
        st.integers(1, 40),  # prompt length
        st.integers(1, 12),  # max_tokens
        st.integers(0, 6),  # arrives before step k
        st.one_of(st.none(), st.integers(0, 10)),  # aborted before step k, if any
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(
    workload=workloads,
    budget=st.integers(8, 64),
    max_num_seqs=st.integers(1, 6),
    num_blocks=st.integers(13, 40),
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    scheduling=st.sampled_from(["continuous", "static"]),
)
def test_invariants_over_random_workloads(
    workload, budget, max_num_seqs, num_blocks, caching, policy, scheduling
):
    if scheduling == "static":
        budget = max(
            budget, 52
        )  # without chunking, the longest request must fit one step (the engine checks)
    s = make_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=max_num_seqs,
        caching=caching,
        max_num_batched_tokens=budget,
        scheduling_policy=policy,
        scheduling=scheduling,
        enable_chunked_prefill=scheduling == "continuous",
    )
    requests = [make_request(f"r{i}", p, m, priority=i % 3) for i, (p, m, _, _) in enumerate(workload)]
    for i in range(300):
        for req, (_, _, arrive, abort) in zip(requests, workload, strict=True):
            if arrive == i:
                s.add_request(req)
            if abort is not None and abort == i and arrive <= i:
                s.abort_request(req.request_id)
        out = step(s)
        assert out.num_batched_tokens <= budget
        assert len(s.running) <= max_num_seqs
        owners = [b for r in s.running for b in r.block_table]
        shared = [b for b in owners if s.kv_cache.ref_counts[b] > 1]
        assert len(set(owners) - set(shared)) == len(owners) - len(shared), "a block has two owners"
        assert all(s.kv_cache.ref_counts[b] >= 1 for b in owners)
        assert not (set(owners) & set(s.kv_cache.free_blocks))
        if i > 6 and not s.num_unfinished:
            break
    assert s.num_unfinished == 0, "a request never finished"
    assert s.kv_cache.num_free_blocks == num_blocks, "blocks leaked"
    for req, (_, max_tokens, _, _) in zip(requests, workload, strict=True):
        if req.finish_reason is not FinishReason.ABORT:
            assert len(req.output_token_ids) == max_tokens
