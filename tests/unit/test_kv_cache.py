"""The KV cache block manager: allocation, freeing, prefix-cache hits and LRU eviction."""

from __future__ import annotations

from conveyor.server.engine.kv_cache import KVCacheManager
from conveyor.server.engine.request import Request, SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), eos_token_id=None)


def admit(kv: KVCacheManager, request: Request) -> bool:
    computed = kv.get_computed_blocks(request)
    request.num_computed_tokens = len(computed) * kv.block_size
    ok = kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens, computed)
    if ok:
        request.num_computed_tokens = request.num_tokens
        kv.cache_full_blocks(request)
    return ok


def test_allocates_ceil_blocks_and_frees_them():
    kv = KVCacheManager(num_blocks=10, block_size=16)
    r = make_request("a", list(range(33)))
    assert admit(kv, r)
    assert len(r.block_table) == 3 and kv.num_free_blocks == 7
    assert kv.usage == 0.3
    kv.free(r)
    assert r.block_table == [] and kv.num_free_blocks == 10 and kv.usage == 0.0


def test_refuses_without_changing_anything():
    kv = KVCacheManager(num_blocks=2, block_size=16, enable_prefix_caching=False)
    r = make_request("a", list(range(40)))
    assert not admit(kv, r)
    assert r.block_table == [] and kv.num_free_blocks == 2


def test_full_prompt_blocks_are_shared_and_last_token_is_recomputed():
    kv = KVCacheManager(num_blocks=10, block_size=16)
    a = make_request("a", list(range(32)))
    assert admit(kv, a)
    b = make_request("b", list(range(32)))
    computed = kv.get_computed_blocks(b)
    # 32 tokens = 2 full blocks, but the last token must be computed: only the first block is a hit.
    assert computed == a.block_table[:1]
    assert admit(kv, b)
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert kv.ref_counts[a.block_table[0]] == 2
    assert kv.prefix_cache_queries == 64 and kv.prefix_cache_hits == 16


def test_shared_prefix_with_different_tails():
    kv = KVCacheManager(num_blocks=20, block_size=16)
    prefix = list(range(100, 148))  # 3 full blocks
    a = make_request("a", prefix + [1, 2, 3])
    b = make_request("b", prefix + [4, 5])
    assert admit(kv, a) and admit(kv, b)
    assert b.block_table[:3] == a.block_table[:3]
    assert b.num_cached_tokens == 0  # the scheduler records it, not the block manager
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 20


def test_freed_cached_blocks_are_reused_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5])  # blocks: [1 2 3 4] cached, [5]
    assert admit(kv, a)
    kv.free(a)
    again = make_request("again", [1, 2, 3, 4, 9])
    assert kv.get_computed_blocks(again) == a_blocks_first(kv, [1, 2, 3, 4])
    # Fill the pool with other content: the cached block is the oldest free one and gets evicted.
    filler = make_request("filler", list(range(50, 66)))
    assert admit(kv, filler)
    kv.free(filler)
    assert kv.get_computed_blocks(make_request("late", [1, 2, 3, 4, 9])) == []


def a_blocks_first(kv: KVCacheManager, tokens: list[int]) -> list[int]:
    from conveyor.server.engine.kv_cache import hash_block

    return [kv.cached_blocks[hash_block(None, tokens)]]


def test_no_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    assert admit(kv, a)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == []
    assert kv.prefix_cache_queries == 0
