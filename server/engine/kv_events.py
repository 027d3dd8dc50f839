"""The KV-event hub: streams the prefix cache's changes to subscribers on asyncio event loops.

A subscriber first gets a snapshot of the cached block hashes taken by the engine's loop thread between
steps, then the block manager's events of every step after it, so snapshot plus events always equal the
engine's prefix cache. Recording is on only while someone subscribes. Each subscriber has a bounded
queue: one that falls `queue_size` step batches behind is dropped, its unread events discarded, and its
stream ends with a `cleared` event; it reconnects for a fresh snapshot.

Threads: `KVEventHub`'s methods run on the loop thread (the engine's owner); `offer` runs on the
subscriber's event loop; `stream` is the subscriber's async iterator.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from conveyor.server.engine.kv_cache import KVCacheManager
from conveyor.server.messages import KVCacheEvent, KVCacheSnapshot


@dataclass(frozen=True)
class KVEventsEnd:
    """Queued to a subscriber: no more events (`overflowed`: because it fell behind)."""

    overflowed: bool


KVItem = KVCacheSnapshot | list[KVCacheEvent] | KVEventsEnd


@dataclass(eq=False)
class KVEventSubscriber:
    """One subscriber: its queue (snapshot, then one list of events per step) and its event loop."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    ended: bool = False  # set on the subscriber's loop once the end is queued


async def stream(sub: KVEventSubscriber) -> AsyncIterator[KVCacheSnapshot | KVCacheEvent]:
    """The subscriber's items as events: the snapshot, each step's events in order, a final `cleared`
    event when it was dropped for falling behind; ends when its end is queued."""
    while True:
        item = await sub.queue.get()
        if isinstance(item, KVEventsEnd):
            if item.overflowed:
                yield KVCacheEvent("cleared")
            return
        if isinstance(item, KVCacheSnapshot):
            yield item
            continue
        for event in item:
            yield event


class KVEventHub:
    """The subscribers of one engine's KV cache, kept by the loop thread.

    queue_size: step batches a subscriber may have unread before it is dropped; drop: called (on the
    subscriber's event loop) with a subscriber that overflowed, to have the loop thread `unsubscribe` it.
    """

    def __init__(
        self, kv_cache: KVCacheManager, queue_size: int, drop: Callable[[KVEventSubscriber], None]
    ) -> None:
        self.kv_cache = kv_cache
        self.queue_size = queue_size
        self.drop = drop
        self.subscribers: list[KVEventSubscriber] = []

    def subscribe(self, sub: KVEventSubscriber) -> None:
        """Send `sub` a snapshot and from then on every event."""
        # Whatever is pending belongs to the streams of the existing subscribers, before the snapshot.
        self.publish()
        self.kv_cache.set_event_recording(True)
        self.subscribers.append(sub)
        self._send(sub, self.kv_cache.snapshot())

    def unsubscribe(self, sub: KVEventSubscriber) -> None:
        if sub in self.subscribers:
            self.subscribers.remove(sub)
            if not self.subscribers:
                self.kv_cache.set_event_recording(False)

    def publish(self) -> None:
        """Send the block manager's events since the last call to every subscriber, as one batch."""
        if not self.subscribers:
            return
        events = self.kv_cache.take_events()
        if events:
            for sub in list(self.subscribers):
                self._send(sub, events)

    def end_all(self) -> None:
        """End every subscriber's stream (they may subscribe again)."""
        for sub in list(self.subscribers):
            self._send(sub, KVEventsEnd(overflowed=False))
        if self.subscribers:
            self.subscribers = []
            self.kv_cache.set_event_recording(False)

    def _send(self, sub: KVEventSubscriber, item: KVItem) -> None:
        try:
            sub.loop.call_soon_threadsafe(self.offer, sub, item)
        except RuntimeError:  # the subscriber's event loop is closed: nobody is reading
            self.unsubscribe(sub)

    def offer(self, sub: KVEventSubscriber, item: KVItem) -> None:
        """Queue an item for a subscriber; runs on the subscriber's event loop."""
        if sub.ended:
            return
        if isinstance(item, KVEventsEnd):
            sub.ended = True
        elif sub.queue.qsize() >= self.queue_size:
            # Too far behind: its unread events are useless without the ones it would miss. Drop them,
            # end its stream with `cleared` and send it nothing more.
            sub.ended = True
            while not sub.queue.empty():
                sub.queue.get_nowait()
            item = KVEventsEnd(overflowed=True)
            self.drop(sub)
        sub.queue.put_nowait(item)
