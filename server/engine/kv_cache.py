"""The KV cache block manager: which physical blocks each request owns, and the prefix cache.

Bookkeeping only; the tensors live in the model runner. Design as in vLLM (PagedAttention, Kwon et al.,
SOSP 2023; automatic prefix caching): fixed-size blocks, a block table per request, reference counts
so identical full prompt blocks are shared, a block identified by hash(parent block hash, its token
ids), and free blocks reused least-recently-freed first so cached content survives as long as possible.

With a sliding window on every layer (Mistral v0.1, Mixtral), a request's blocks that lie wholly before
the window of its next token are given back as it grows, so a sequence holds about its window, not its
length (vLLM's sliding-window manager, `remove_skipped_blocks`). Their block-table entries stay, as
`SKIPPED_BLOCK`, which no kernel reads: attention skips the blocks before a window.

Where only some layers slide (Gemma 2/3: sliding layers between global ones), those layers keep their
K/V in a pool of their own (`num_window_blocks` blocks, `Request.window_block_table`), managed as above,
while the global layers keep every block: a sequence costs its length in the global layers and about
its window in the sliding ones, as vLLM's hybrid KV cache manager has it (there one pool serves groups
of layers; here each kind has its pool, sized by `capacity.split_kv_pool`). A prefix-cache hit then
needs the global layers' blocks of the prefix and the sliding layers' blocks of its last window.

While event recording is on, every change to the set of cached block hashes is recorded as a
`KVCacheEvent` (vLLM's KV events: BlockStored / BlockRemoved / AllBlocksCleared), so a router can
track which prefix blocks a replica holds; `snapshot()` gives the set itself to start from.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

from conveyor.server.block_hash import hash_block
from conveyor.server.engine.request import Request
from conveyor.server.messages import KVCacheEvent, KVCacheSnapshot, PrefixCacheStats

# The block id left in a block table for a block given back (any id in range: it is never read).
SKIPPED_BLOCK = 0


class KVCacheManager:
    """Allocates KV cache blocks to requests.

    num_blocks: blocks in the pool; block_size: tokens per block; sliding_window: the positions the
    sliding layers attend to (None: no layer slides); num_window_blocks: where only some layers slide, the
    blocks of their own pool (None: every layer slides, or none does, and all share `num_blocks`). A
    request's blocks are `request.block_table` (its first `request.num_skipped_blocks` given back; with
    `num_window_blocks`, the global layers' blocks, none given back) and `request.window_block_table`;
    only this class changes them. Pending KV events (of `block_table`'s pool) are written only by this
    class and drained by one consumer (`take_events`); they are recorded only while
    `set_event_recording(True)` is in force, so nobody pays for them when nobody listens.

    Raises ValueError for an empty pool, a window below 1, or `num_window_blocks` without a window.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        num_window_blocks: int | None = None,
        *,
        _window_table: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        if num_window_blocks is not None and sliding_window is None:
            raise ValueError("num_window_blocks is the sliding layers' pool: it needs a sliding_window")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # The sliding layers' own pool (a KVCacheManager over `request.window_block_table`), if any;
        # this one then serves the global layers and gives nothing back.
        self.window: KVCacheManager | None = None
        if num_window_blocks is not None:
            self.window = KVCacheManager(
                num_window_blocks, block_size, enable_prefix_caching, sliding_window, _window_table=True
            )
            sliding_window = None
        self.sliding_window = sliding_window
        self._is_window = _window_table
        self._table_field = "window_block_table" if _window_table else "block_table"
        self._skipped_field = "num_skipped_window_blocks" if _window_table else "num_skipped_blocks"
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Blocks with ref count 0, oldest-freed first (the LRU eviction order).
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up at first admission (not after preemption)
        self.prefix_cache_hits = 0  # of which found cached
        self._step_prefix_stats = PrefixCacheStats()  # the same since make_prefix_cache_stats
        self._record_events = False
        self._events: list[KVCacheEvent] = []
        self._num_pending_hashes = 0
        # A consumer that stopped draining loses the events (they are replaced by a resync) rather than
        # growing this list: one step changes at most 2 * num_blocks hashes, so a draining consumer
        # never comes near the cap.
        self.max_pending_hashes = max(4 * num_blocks, 1024)
        self._events_overflowed = False

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache tokens looked up and hit since the last call (vLLM's `make_prefix_cache_stats`)."""
        stats, self._step_prefix_stats = self._step_prefix_stats, PrefixCacheStats()
        return stats

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0-1); cached blocks nobody holds count as free. With the
        sliding layers' own pool, the fuller of the two (the one that preempts first)."""
        used = (self.num_blocks - len(self.free_blocks)) / self.num_blocks
        return used if self.window is None else max(used, self.window.usage)

    def _table(self, request: Request) -> list[int]:
        return getattr(request, self._table_field)

    def _skipped(self, request: Request) -> int:
        return getattr(request, self._skipped_field)

    # -- KV events --------------------------------------------------------------------------------------

    def set_event_recording(self, enabled: bool) -> None:
        """Start or stop recording KV events; stopping drops the pending ones."""
        self._record_events = enabled
        if not enabled:
            self._events = []
            self._num_pending_hashes = 0
            self._events_overflowed = False

    def snapshot(self) -> KVCacheSnapshot:
        """The hashes cached now (every key of `cached_blocks`), oldest registered first."""
        return KVCacheSnapshot(self.block_size, self.num_blocks, list(self.cached_blocks))

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first, merged into one event per run of
        the same kind. After an overflow (more than `max_pending_hashes` pending) they are replaced
        by `cleared` then `stored` of every cached hash: the same set, reached without the history."""
        if self._events_overflowed:
            events = [KVCacheEvent("cleared")]
            if self.cached_blocks:
                events.append(KVCacheEvent("stored", list(self.cached_blocks)))
        else:
            events = self._events
        self._events = []
        self._num_pending_hashes = 0
        self._events_overflowed = False
        return events

    def _record(self, kind: Literal["stored", "evicted", "cleared"], block_hash: bytes | None = None) -> None:
        if self._events_overflowed:
            return
        if self._num_pending_hashes >= self.max_pending_hashes:
            self._events_overflowed = True
            self._events = []
            return
        if kind == "cleared":
            # Everything before a clear is moot for the consumer.
            self._events = [KVCacheEvent("cleared")]
            self._num_pending_hashes = 0
            return
        if not self._events or self._events[-1].kind != kind:
            self._events.append(KVCacheEvent(kind))
        self._events[-1].block_hashes.append(block_hash)
        self._num_pending_hashes += 1

    # -- blocks -----------------------------------------------------------------------------------------

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend `request.block_hashes` to cover every full block within its first `num_tokens` tokens."""
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(request.block_hashes), num_tokens // bs):
            parent = request.block_hashes[i - 1] if i else request.hash_root
            request.block_hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks holding a prefix of the request's tokens (longest run of hits).

        At least the last token is always left to compute, so the model produces its logits.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_blocks * self.block_size)
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if self.window is not None:  # and the sliding layers' blocks of the prefix's last window
            while hits and self.window._window_hits(request, len(hits)) is None:
                hits.pop()
        return hits

    def _window_hits(self, request: Request, num_blocks: int) -> tuple[int, list[int]] | None:
        """For a prefix of `num_blocks` full blocks found cached: (the blocks before its next token's
        window, this pool's cached blocks from there to the prefix's end), or None when one is missing.
        Needs `request.block_hashes` to cover the prefix."""
        first = max(0, num_blocks * self.block_size - self.sliding_window + 1) // self.block_size
        hits = [self.cached_blocks.get(h) for h in request.block_hashes[first:num_blocks]]
        return None if None in hits else (first, hits)

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int]) -> bool:
        """Give the request blocks for `computed_blocks` plus `num_new_tokens` more tokens.

        `computed_blocks` (from get_computed_blocks, only for a request holding no blocks) are shared;
        the request's `num_computed_tokens` must already count them. Returns False, changing nothing
        but blocks that fell out of the window, when a pool cannot supply the blocks.
        """
        window = self.window
        first, window_computed = 0, []
        if window is not None and computed_blocks:
            first, window_computed = window._window_hits(request, len(computed_blocks))
        num_new = self._num_new_blocks(request, num_new_tokens, computed_blocks)
        if num_new is None:
            return False
        if window is not None:
            num_window_new = window._num_new_blocks(request, num_new_tokens, window_computed, first)
            if num_window_new is None:
                return False
            window._take(request, window_computed, num_window_new, first)
        self._take(request, computed_blocks, num_new)
        return True

    def _num_new_blocks(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int], num_skipped: int = 0
    ) -> int | None:
        """The free blocks `_take` needs to hold `computed_blocks` (after `num_skipped` blocks wholly
        before the window) and `num_new_tokens` more tokens, or None when the free list lacks them.
        Blocks that fell out of the window are given back first."""
        if self.sliding_window is not None and self._table(request):
            self._skip_blocks_before_window(request)
        total_tokens = request.num_computed_tokens + num_new_tokens
        blocks_needed = -(-total_tokens // self.block_size)
        num_new = max(0, blocks_needed - len(self._table(request)) - num_skipped - len(computed_blocks))
        # Cached blocks nobody holds are in the free list: reusing them takes them out of it.
        num_reused_free = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        return num_new if num_new + num_reused_free <= len(self.free_blocks) else None

    def _take(self, request: Request, computed_blocks: list[int], num_new: int, num_skipped: int = 0) -> None:
        """Hold `computed_blocks` (after `num_skipped` entries left as `SKIPPED_BLOCK`) and take
        `num_new` blocks off the free list."""
        table = self._table(request)
        # Count a request's first admission only: after a recompute preemption the block table is empty
        # again, and its own blocks, still cached, would count as hits (vLLM keeps those apart too).
        if self.enable_prefix_caching and not table and request.num_preemptions == 0 and not self._is_window:
            hits = len(computed_blocks) * self.block_size
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hits
            self._step_prefix_stats.queries += request.num_tokens
            self._step_prefix_stats.hits += hits
        if num_skipped:
            table.extend([SKIPPED_BLOCK] * num_skipped)
            setattr(request, self._skipped_field, num_skipped)
        for block_id in computed_blocks:
            if self.ref_counts[block_id] == 0:
                del self.free_blocks[block_id]
            self.ref_counts[block_id] += 1
            table.append(block_id)
        for _ in range(num_new):
            block_id, _ = self.free_blocks.popitem(last=False)
            old_hash = self.block_hash[block_id]
            if old_hash is not None:
                # Evict: the block's old content is about to be overwritten.
                if self.cached_blocks.get(old_hash) == block_id:
                    del self.cached_blocks[old_hash]
                    if self._record_events:
                        self._record("evicted", old_hash)
                self.block_hash[block_id] = None
            self.ref_counts[block_id] = 1
            table.append(block_id)

    def cache_full_blocks(self, request: Request) -> None:
        """After a step: register the request's blocks that are now full of computed tokens in the
        prefix cache, then give back those that fell out of the window (so a request that waits holds
        its window only)."""
        if self.window is not None:
            self.window.cache_full_blocks(request)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request)
        if self.sliding_window is not None and self._table(request):
            self._skip_blocks_before_window(request)

    def _cache_full_blocks(self, request: Request) -> None:
        num_full = request.num_computed_tokens // self.block_size
        self._update_block_hashes(request, num_full * self.block_size)
        table = self._table(request)
        for i in range(self._skipped(request), num_full):
            block_id = table[i]
            if self.block_hash[block_id] is not None:
                continue
            block_hash = request.block_hashes[i]
            self.block_hash[block_id] = block_hash
            if block_hash not in self.cached_blocks:
                self.cached_blocks[block_hash] = block_id
                if self._record_events:
                    self._record("stored", block_hash)

    def free(self, request: Request) -> None:
        """Release the request's blocks. Tail blocks go first into the free list, so they are evicted
        before the prefix blocks other requests are likelier to share."""
        for block_id in reversed(self._table(request)[self._skipped(request) :]):
            self._release(block_id)
        setattr(request, self._table_field, [])
        setattr(request, self._skipped_field, 0)
        if self.window is not None:
            self.window.free(request)

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_blocks[block_id] = None

    def _skip_blocks_before_window(self, request: Request) -> None:
        """Give back the request's blocks wholly before the window of its next token: that token, at
        position `num_computed_tokens`, and every later one attend to positions from
        `num_computed_tokens - sliding_window + 1` on. A block in the prefix cache stays there (free and
        evictable), as any freed block does."""
        table = self._table(request)
        first_needed = request.num_computed_tokens - self.sliding_window + 1
        skipped = min(max(0, first_needed) // self.block_size, len(table))
        already = self._skipped(request)
        for i in range(already, skipped):
            self._release(table[i])
            table[i] = SKIPPED_BLOCK
        setattr(request, self._skipped_field, max(already, skipped))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (blocks in use keep their content)."""
        self.cached_blocks.clear()
        self.block_hash = [None] * self.num_blocks
        if self._record_events:
            self._record("cleared")
        if self.window is not None:
            self.window.reset_prefix_cache()
