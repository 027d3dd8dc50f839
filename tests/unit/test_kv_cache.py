"""The KV cache block manager: allocation, freeing, prefix-cache hits and LRU eviction."""

from __future__ import annotations

from conveyor.server.engine.kv_cache import KVCacheManager
from conveyor.server.engine.request import Request
from conveyor.server.messages import SamplingParams


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
    from conveyor.server.block_hash import hash_block

    return [kv.cached_blocks[hash_block(None, tokens)]]


def test_no_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    assert admit(kv, a)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == []
    assert kv.prefix_cache_queries == 0


def hash_chain(tokens: list[int], block_size: int) -> list[bytes]:
    from conveyor.server.block_hash import hash_block

    hashes: list[bytes] = []
    for i in range(len(tokens) // block_size):
        hashes.append(
            hash_block(hashes[-1] if hashes else None, tokens[i * block_size : (i + 1) * block_size])
        )
    return hashes


def events(kv: KVCacheManager) -> list[tuple[str, list[bytes]]]:
    return [(e.kind, e.block_hashes) for e in kv.take_events()]


def test_nothing_is_recorded_without_a_subscriber():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    for i, rid in enumerate("abc"):  # each stores 2 blocks, and evicts the previous one's
        r = make_request(rid, list(range(10 * i, 10 * i + 9)))
        assert admit(kv, r)
        kv.free(r)
        if rid == "b":
            kv.set_event_recording(True)
    kv.set_event_recording(False)  # the last subscriber left: c's pending events go too
    kv.reset_prefix_cache()
    assert kv.take_events() == []


def test_stored_events_are_the_hash_chain_of_newly_cached_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.set_event_recording(True)
    prompt = list(range(100, 110))  # 2 full blocks and 2 tokens
    a = make_request("a", prompt)
    assert admit(kv, a)
    assert events(kv) == [("stored", hash_chain(prompt, 4))]
    # The same prompt again shares the first block and computes the second into a new one: its hash
    # is already cached, so nothing changes in the set and nothing is stored.
    assert admit(kv, make_request("b", prompt))
    assert kv.take_events() == []
    # Output tokens filling a block store it too.
    a.append_output_tokens([1])
    a.append_output_tokens([2])
    a.num_computed_tokens = a.num_tokens
    assert kv.allocate_slots(a, 0, [])
    kv.cache_full_blocks(a)
    assert events(kv) == [("stored", [hash_chain(prompt + [1, 2], 4)[2]])]


def test_evicted_events_name_the_hashes_whose_blocks_are_reused():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.set_event_recording(True)
    old = list(range(8))  # 2 full blocks
    a = make_request("a", old + [99])
    assert admit(kv, a)
    kv.free(a)
    kv.take_events()
    # 12 new tokens need every block: the tail block (uncached) and both cached ones are reused.
    new = list(range(50, 62))
    assert admit(kv, make_request("b", new))
    old_hashes, new_hashes = hash_chain(old, 4), hash_chain(new, 4)
    got = events(kv)
    assert got[0][0] == "evicted" and sorted(got[0][1]) == sorted(old_hashes)
    assert got[1:] == [("stored", new_hashes[:3])]
    assert kv.snapshot().block_hashes == new_hashes[:3]


def test_reset_prefix_cache_records_cleared_and_empties_the_snapshot():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.set_event_recording(True)
    assert admit(kv, make_request("a", list(range(9))))
    kv.reset_prefix_cache()
    assert events(kv) == [("cleared", [])]  # what came before a clear is moot
    assert kv.snapshot().block_hashes == []


def test_snapshot_lists_every_cached_hash_with_the_pool_shape():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a, b = list(range(12)), list(range(30, 39))
    assert admit(kv, make_request("a", a)) and admit(kv, make_request("b", b))
    snap = kv.snapshot()
    assert (snap.block_size, snap.num_blocks) == (4, 16)
    assert snap.block_hashes == hash_chain(a, 4) + hash_chain(b, 4)
    assert [h.hex() for h in snap.block_hashes] == [h.hex() for h in kv.cached_blocks]
    assert all(len(h.hex()) == 32 for h in snap.block_hashes)


def test_pending_events_are_bounded_and_resync_when_nobody_drains():
    kv = KVCacheManager(num_blocks=4, block_size=1)
    kv.max_pending_hashes = 5
    kv.set_event_recording(True)
    for i in range(20):  # 20 blocks stored and most evicted again, never drained
        r = make_request(f"r{i}", [i, 1000 + i])
        assert admit(kv, r)
        kv.free(r)
    assert kv._num_pending_hashes <= 5
    snapshot = kv.snapshot().block_hashes
    assert events(kv) == [("cleared", []), ("stored", snapshot)]
    assert kv.take_events() == []


def test_prefix_cache_queries_count_only_the_first_admission():
    # A request preempted (blocks freed, recomputed from 0) finds its own blocks still cached; that
    # must not count as a hit, nor its prompt as a second query.
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request("a", list(range(10)))
    assert admit(kv, r)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)
    kv.free(r)
    r.num_computed_tokens = 0
    r.num_preemptions += 1  # as Scheduler._preempt does
    assert admit(kv, r)
    assert len(r.block_table) == 3  # the cached blocks are still reused
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)


def _step(kv: KVCacheManager, request: Request, new_tokens: list[int]) -> None:
    """One decode step of `request`: its next token's slot, then the token counted as computed."""
    assert kv.allocate_slots(request, 1, [])
    request.num_computed_tokens += 1
    kv.cache_full_blocks(request)
    request.append_output_tokens(new_tokens)


def test_a_sliding_window_on_every_layer_bounds_the_blocks_a_growing_sequence_holds():
    """Window 20, 4-token blocks: the next token reads positions from `computed - 19` on, so a sequence
    holds at most ceil(20 / 4) + 1 blocks however long it grows; positions keep their block-table index
    (given-back entries are SKIPPED_BLOCK), and freeing returns exactly the blocks still held."""
    from conveyor.server.engine.kv_cache import SKIPPED_BLOCK

    kv = KVCacheManager(num_blocks=12, block_size=4, sliding_window=20)
    r = make_request("a", list(range(10)))
    assert admit(kv, r)
    held = []
    for token in range(200):
        _step(kv, r, [1000 + token])
        live = r.block_table[r.num_skipped_blocks :]
        held.append(len(live))
        assert len(r.block_table) == -(-r.num_computed_tokens // 4) or len(r.block_table) == -(
            -(r.num_computed_tokens + 1) // 4
        )
        assert all(b == SKIPPED_BLOCK for b in r.block_table[: r.num_skipped_blocks])
        assert kv.num_free_blocks == 12 - len(live)
    assert max(held) <= 6 and r.num_skipped_blocks > 40  # 210 tokens in 12 blocks of 4
    kv.free(r)
    assert kv.num_free_blocks == 12 and r.block_table == [] and r.num_skipped_blocks == 0
    assert all(count == 0 for count in kv.ref_counts)


def test_blocks_given_back_behind_a_window_stay_in_the_prefix_cache_and_shared_ones_stay_held():
    """Two requests share a cached 8-token prefix; both give back its first block as their prefill step
    ends (their next token sees positions 4..9), one grows past its window and gives its share of the
    second back (the other still holds it); a third request with the same prefix still hits both."""
    from conveyor.server.engine.kv_cache import SKIPPED_BLOCK

    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=6)
    prefix = list(range(8))
    a, b = make_request("a", prefix + [50]), make_request("b", prefix + [60])
    assert admit(kv, a)
    shared = [kv.cached_blocks[h] for h in a.block_hashes[:2]]
    assert admit(kv, b)
    assert a.block_table[0] == b.block_table[0] == SKIPPED_BLOCK and kv.ref_counts[shared[0]] == 0
    assert b.block_table[1] == shared[1] and kv.ref_counts[shared[1]] == 2
    for token in range(8):
        _step(kv, a, [100 + token])
    assert a.num_skipped_blocks >= 2 and kv.ref_counts[shared[0]] == 0 and kv.ref_counts[shared[1]] == 1
    kv.free(b)
    assert all(kv.ref_counts[x] == 0 for x in shared)
    c = make_request("c", prefix + [70])
    assert kv.get_computed_blocks(c) == shared
    kv.free(a)
    assert kv.num_free_blocks == 16


def test_sliding_layers_with_a_pool_of_their_own_hold_their_window_and_global_layers_everything():
    """Gemma-style: global layers keep every block of a growing sequence in the main pool while the
    sliding layers' pool (window 20, 4-token blocks) holds at most ceil(19 / 4) + 2 blocks per
    sequence; block-table indexes stay positions in both; freeing returns every block of both pools."""
    from conveyor.server.engine.kv_cache import SKIPPED_BLOCK

    kv = KVCacheManager(num_blocks=64, block_size=4, sliding_window=20, num_window_blocks=7)
    assert kv.sliding_window is None and kv.window.sliding_window == 20
    r = make_request("a", list(range(10)))
    assert admit(kv, r)
    held = []
    for token in range(200):
        _step(kv, r, [1000 + token])
        held.append(len(r.window_block_table) - r.num_skipped_window_blocks)
        assert len(r.window_block_table) == len(r.block_table) and r.num_skipped_blocks == 0
        assert all(b == SKIPPED_BLOCK for b in r.window_block_table[: r.num_skipped_window_blocks])
        assert kv.window.num_free_blocks == 7 - held[-1]
    assert max(held) <= 7 and len(r.block_table) == 53 and kv.num_free_blocks == 64 - 53
    assert kv.usage == max(53 / 64, held[-1] / 7)  # the fuller pool
    kv.free(r)
    assert (kv.num_free_blocks, kv.window.num_free_blocks) == (64, 7)
    assert r.block_table == r.window_block_table == [] and r.num_skipped_window_blocks == 0


def test_a_full_window_pool_refuses_the_step_without_taking_global_blocks():
    kv = KVCacheManager(num_blocks=64, block_size=4, sliding_window=8, num_window_blocks=3)
    a, b = make_request("a", list(range(12))), make_request("b", list(range(100, 112)))
    assert admit(kv, a)  # 3 window blocks while it writes 12 tokens, then 2 (positions 5..11)
    assert kv.window.num_free_blocks == 1 and kv.num_free_blocks == 61
    assert not admit(kv, b)
    assert kv.num_free_blocks == 61 and b.block_table == b.window_block_table == []


def test_a_prefix_hit_needs_the_sliding_layers_blocks_of_its_last_window():
    """A 16-token prefix cached in both pools is a hit of 16 tokens, with the blocks before the next
    token's window (positions < 16 - 6 + 1) left out of the window table; once the sliding pool has
    evicted the prefix's last window block, the hit shrinks to where a window is still whole."""
    from conveyor.server.engine.kv_cache import SKIPPED_BLOCK

    kv = KVCacheManager(num_blocks=32, block_size=4, sliding_window=6, num_window_blocks=6)
    prefix = list(range(16))
    a = make_request("a", prefix + [50])
    assert admit(kv, a)
    kv.free(a)
    b = make_request("b", prefix + [60])
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 4
    assert admit(kv, b)
    assert b.num_computed_tokens == 17 and kv.prefix_cache_hits == 16
    assert b.window_block_table[:2] == [SKIPPED_BLOCK] * 2 and b.num_skipped_window_blocks >= 2
    kv.free(b)
    # Evict the prefix's last block (positions 12-15) from the sliding layers' pool only.
    kv.window.cached_blocks.pop(b.block_hashes[3])
    c = make_request("c", prefix + [70])
    assert len(kv.get_computed_blocks(c)) == 3  # blocks 1-2 still hold the window of position 12
