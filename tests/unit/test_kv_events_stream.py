"""AsyncEngine.kv_events: snapshot then events from the loop thread, unsubscribe, overflow, stop.

The engine is a stand-in without a model: each step prefills its new requests into a real
KVCacheManager (blocks cached, then freed) and finishes them.
"""

from __future__ import annotations

import asyncio

from conveyor.server.block_hash import hash_block
from conveyor.server.engine.async_engine import AsyncEngine
from conveyor.server.engine.kv_cache import KVCacheManager
from conveyor.server.engine.request import Request
from conveyor.server.messages import (
    EngineRequest,
    FinishReason,
    KVCacheEvent,
    KVCacheSnapshot,
    RequestOutput,
    SamplingParams,
)

BLOCK = 4


class PrefillOnlyEngine:
    """What AsyncEngine needs of an LLMEngine; a request is prefilled and finished in one step."""

    def __init__(self, num_blocks: int = 64, enable_prefix_caching: bool = True) -> None:
        self.kv_cache = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching)
        self.new: list[Request] = []

    num_waiting_requests = 0

    def make_request(
        self, request_id, prompt_token_ids, params, arrival_time=None, priority=0
    ) -> EngineRequest:
        return EngineRequest(request_id, tuple(prompt_token_ids), params, 0.0, priority)

    def add_request(self, new: EngineRequest) -> None:
        self.new.append(Request(new.request_id, list(new.prompt_token_ids), new.params, eos_token_id=None))

    def abort_request(self, request_id: str) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return bool(self.new)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for r in self.new:
            computed = self.kv_cache.get_computed_blocks(r)
            r.num_computed_tokens = len(computed) * BLOCK
            assert self.kv_cache.allocate_slots(r, r.num_tokens - r.num_computed_tokens, computed)
            r.num_computed_tokens = r.num_tokens
            self.kv_cache.cache_full_blocks(r)
            self.kv_cache.free(r)
            outputs.append(
                RequestOutput(r.request_id, [], "", [], True, FinishReason.STOP, r.num_prompt_tokens, 0)
            )
        self.new = []
        return outputs


def chain(tokens: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(tokens) // BLOCK):
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * BLOCK : (i + 1) * BLOCK]))
    return hashes


async def prefill(engine: AsyncEngine, rid: str, tokens: list[int]) -> None:
    async for _ in engine.generate(engine.make_request(rid, tokens, SamplingParams(max_tokens=1))):
        pass


async def next_item(stream) -> KVCacheSnapshot | KVCacheEvent:
    return await asyncio.wait_for(anext(stream), timeout=30)


def run_with(fake: PrefillOnlyEngine, body, **kwargs) -> None:
    engine = AsyncEngine(fake, **kwargs)
    engine.start()
    try:
        asyncio.run(body(engine))
    finally:
        engine.stop()


def test_snapshot_then_the_events_of_every_step_and_unsubscribe_stops_recording():
    fake = PrefillOnlyEngine()
    a, b, c = list(range(9)), list(range(100, 112)), list(range(200, 208))

    async def body(engine: AsyncEngine) -> None:
        await prefill(engine, "a", a)
        first = engine.kv_events()
        snapshot = await next_item(first)
        assert snapshot == KVCacheSnapshot(BLOCK, 64, chain(a))
        await prefill(engine, "b", b)
        assert await next_item(first) == KVCacheEvent("stored", chain(b))
        second = engine.kv_events()
        assert (await next_item(second)).block_hashes == chain(a) + chain(b)
        await first.aclose()
        await prefill(engine, "c", c)
        assert await next_item(second) == KVCacheEvent("stored", chain(c))
        await second.aclose()
        await prefill(engine, "d", list(range(300, 308)))  # both left before this step: not recorded

    run_with(fake, body)
    assert fake.kv_cache.take_events() == []


def test_a_subscriber_that_falls_behind_gets_cleared_and_its_stream_ends():
    fake = PrefillOnlyEngine()

    async def body(engine: AsyncEngine) -> None:
        slow = engine.kv_events()
        assert (await next_item(slow)).block_hashes == []
        for i in range(4):  # one batch per step; the third finds 2 unread and overflows the queue
            await prefill(engine, f"r{i}", list(range(10 * i, 10 * i + 4)))
        assert await next_item(slow) == KVCacheEvent("cleared")
        assert await anext(slow, None) is None
        again = engine.kv_events()
        snapshot = await next_item(again)
        assert snapshot.block_hashes == [chain(list(range(10 * i, 10 * i + 4)))[0] for i in range(4)]
        await again.aclose()

    run_with(fake, body, kv_events_queue_size=2)


def test_without_prefix_caching_an_empty_snapshot_and_no_events_until_stop():
    fake = PrefillOnlyEngine(enable_prefix_caching=False)
    engine = AsyncEngine(fake)
    engine.start()

    async def body() -> list:
        stream = engine.kv_events()
        items = [await next_item(stream)]
        await prefill(engine, "a", list(range(12)))
        engine.stop()  # ends the stream
        items += [item async for item in stream]
        return items

    try:
        assert asyncio.run(body()) == [KVCacheSnapshot(BLOCK, 64, [])]
    finally:
        engine.stop()


def test_ending_the_streams_at_server_shutdown_ends_current_and_later_subscribers():
    fake = PrefillOnlyEngine()

    async def body(engine: AsyncEngine) -> None:
        early = engine.kv_events()
        await next_item(early)
        engine.end_kv_event_streams()
        assert await asyncio.wait_for(anext(early, None), timeout=30) is None
        late = engine.kv_events()
        assert isinstance(await next_item(late), KVCacheSnapshot)
        assert await asyncio.wait_for(anext(late, None), timeout=30) is None
        await prefill(engine, "a", list(range(8)))  # the engine itself goes on serving

    run_with(fake, body)
    assert fake.kv_cache.take_events() == []  # nobody subscribed: nothing recorded


def test_the_heap_is_frozen_for_the_garbage_collector_while_serving():
    """`start` freezes the start-up heap (`gc.freeze`, see `freeze_startup_heap`); `stop` hands it
    back to the collector, so a process that starts and stops engines leaks nothing."""
    import gc

    engine = AsyncEngine(PrefillOnlyEngine())
    assert gc.get_freeze_count() == 0
    engine.start()
    try:
        assert gc.get_freeze_count() > 0
    finally:
        engine.stop()
    assert gc.get_freeze_count() == 0
