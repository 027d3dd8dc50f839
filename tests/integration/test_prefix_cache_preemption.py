"""Regression: recompute preemption must not read as prefix-cache hits (the real model, a tiny KV pool).

16 unique prompts with 12 preemptions once showed a 43 % hit rate: each re-prefill counted the prompt
as a new query and its own still-cached blocks as hits. Unique prompts share no block: the rate is 0.
"""

from __future__ import annotations

import random

import pytest

from conveyor.server.config import SchedulerConfig
from conveyor.server.engine.kv_cache import KVCacheManager
from conveyor.server.engine.scheduler import make_scheduler
from conveyor.server.messages import SamplingParams

pytestmark = pytest.mark.slow


def test_sixteen_unique_prompts_under_preemption_have_no_prefix_hits(engine):
    assert not engine.has_unfinished_requests()
    saved = engine.kv_cache, engine.scheduler
    # 16 requests of 40 prompt + 16 output tokens need 64 blocks of 16 at once; 20 force preemptions.
    engine.kv_cache = KVCacheManager(20, engine.runner.block_size, enable_prefix_caching=True)
    engine.scheduler = make_scheduler(SchedulerConfig(), engine.kv_cache, max_num_seqs=16)
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(1000, 40000) for _ in range(40)] for _ in range(16)]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(engine.make_request(f"unique-{i}", prompt, params))
        while engine.has_unfinished_requests():
            engine.step()
        kv = engine.kv_cache
        assert engine.scheduler.num_preemptions > 0
        assert kv.prefix_cache_queries == 16 * 40
        assert kv.prefix_cache_hits / kv.prefix_cache_queries < 0.05
        assert kv.prefix_cache_hits == 0
    finally:
        engine.kv_cache, engine.scheduler = saved
        engine.kv_cache.reset_prefix_cache()  # the small pool's run overwrote blocks the saved one caches
