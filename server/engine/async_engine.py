"""Runs the engine's step loop in its own thread and streams outputs to asyncio callers.

The loop thread owns the engine: requests and aborts reach it through a lock-protected inbox and are
applied between steps, so an abort frees its blocks before the next step is scheduled and a queued
request whose client left is never prefilled. torch releases the GIL inside its kernels, so the
asyncio server keeps serving while a step runs.

KV events (`kv_events()`): a subscriber first gets a snapshot of the cached block hashes taken by the
loop between steps, then the block manager's events of every step after it, so snapshot plus events
always equal the engine's prefix cache. Recording is on only while someone subscribes. Each subscriber
has a bounded queue: one that falls `kv_events_queue_size` step batches behind is dropped, its unread
events discarded, and its stream ends with a `cleared` event; it reconnects for a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from conveyor.server.engine.engine import LLMEngine
from conveyor.server.messages import KVCacheEvent, KVCacheSnapshot, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t's omp_pause_soft (OpenMP 5.0)


class EngineDeadError(RuntimeError):
    """The step loop is not running (stopped, or never started)."""


class StepFailedError(RuntimeError):
    """A model step failed; the requests in that step were aborted and the loop goes on."""


@dataclass
class _NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class _KVEventsEnd:
    """Queued to a KV event subscriber: no more events (`overflowed`: because it fell behind)."""

    overflowed: bool


@dataclass(eq=False)
class _KVEventSubscriber:
    """One `kv_events()` caller: its queue (snapshot, then one list of events per step; AsyncEngine
    bounds it) and its event loop."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    ended: bool = False  # set on the subscriber's loop once the end is queued


def release_openmp_threads() -> None:
    """End the calling thread's idle OpenMP worker threads (OpenMP 5.0 `omp_pause_resource_all`,
    soft pause; they start again if this thread runs a parallel region later). No-op where the
    process has no OpenMP runtime exporting it.

    Why: every thread that runs a parallel region keeps its own team of OpenMP workers. Once the
    threads libgomp manages outnumber the CPUs, it cuts its spin-wait between parallel regions to
    almost nothing (its "throttled" spin count), so every op of the engine thread waits for its
    workers to wake from a futex. On 2 cores the idle team left by the thread that loaded the
    model made the loop thread's decode step 20 % slower (76 against 63 ms, SmolLM2 float32, batch
    16) than the same engine stepped on the thread that built it.
    """
    pause = getattr(ctypes.CDLL(None), "omp_pause_resource_all", None)
    if pause is None:
        logger.debug("no omp_pause_resource_all in this process; OpenMP threads left as they are")
        return
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    if pause(OMP_PAUSE_SOFT) != 0:
        logger.debug("omp_pause_resource_all refused; OpenMP threads left as they are")


def freeze_startup_heap() -> None:
    """Collect garbage once, then move every live object into the collector's permanent generation
    (`gc.freeze`; `gc.unfreeze` moves them back).

    Why: the start-up heap (torch, transformers, the tokenizer, the model: millions of objects) lives
    as long as the server, yet every oldest-generation collection that serving triggers walks all of
    it. Frozen, served float32 on 2 cores went from 221 to 254 output tok/s (SmolLM2, 64 requests at
    once). vLLM's engine core freezes its start-up heap the same way.
    """
    gc.collect()
    gc.freeze()


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    """On a caller's event loop: put each item in its queue."""
    for queue, item in puts:
        queue.put_nowait(item)


class AsyncEngine:
    """Thread-backed front of an LLMEngine. Use `start()` once, `generate()` per request, `stop()` at exit.

    kv_events_queue_size: step batches of KV events a subscriber may have unread before it is dropped.
    """

    def __init__(self, engine: LLMEngine, kv_events_queue_size: int = 1024) -> None:
        self.engine = engine
        self.kv_events_queue_size = kv_events_queue_size
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._inbox: list[_NewRequest] = []
        self._reserved = 0  # admitted (`reserve`) but not yet in the inbox
        self._aborts: list[str] = []
        self._streams: dict[str, _NewRequest] = {}
        self._kv_subscribes: list[_KVEventSubscriber] = []
        self._kv_unsubscribes: list[_KVEventSubscriber] = []
        self._kv_subscribers: list[_KVEventSubscriber] = []  # the loop thread's own
        self._kv_streams_ended = False
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread. The thread that built the engine (loading and packing weights ran
        OpenMP regions there) hands its OpenMP threads back first: see `release_openmp_threads`. The
        heap built so far is frozen for the garbage collector until `stop`: see `freeze_startup_heap`."""
        release_openmp_threads()
        freeze_startup_heap()
        self._thread = threading.Thread(target=self._run, name="conveyor-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        gc.unfreeze()
        self._stopped.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped.is_set()

    # What the API reads of the engine (constant after start; the API never reaches into LLMEngine).

    @property
    def tokenizer(self):
        """The model's transformers tokenizer (thread-safe for encoding and decoding)."""
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError (naming the field) for a request the engine cannot serve.
        Thread-safe; may compile a structured-output grammar, so callers on an event loop run it in a
        worker thread."""
        self.engine.validate(prompt_token_ids, params)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot: admitted (`reserve`), handed in but not yet taken by the loop,
        or waiting in the scheduler (a momentary count)."""
        return self._reserved + len(self._inbox) + len(self.engine.scheduler.waiting)

    def reserve(self, num_requests: int, limit: int) -> bool:
        """Admit `num_requests` more waiting requests if the waiting queue then holds at most `limit`;
        False (nothing admitted) otherwise. Atomic, so requests arriving at once cannot all pass the
        check before any is queued; each admitted request must then be handed to `generate(...,
        reserved=True)`, which turns its reservation into a queued request."""
        with self._lock:
            if self.num_waiting + num_requests > limit:
                return False
            self._reserved += num_requests
            return True

    def release(self, num_requests: int) -> None:
        """Give back reservations of admitted requests that will never reach `generate`."""
        with self._lock:
            self._reserved -= num_requests

    @property
    def num_kv_event_subscribers(self) -> int:
        """KV event subscribers the loop is sending to (a subscription counts once the loop took it)."""
        return len(self._kv_subscribers)

    # -- asyncio side ---------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        validated: bool = False,
        reserved: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until it finishes. Validation errors
        (InvalidRequestError) are raised before anything is queued, unless the caller has run
        `validate` itself (`validated=True`): each request is validated once. `reserved`: the request
        was admitted with `reserve`. Leaving the iterator early (client gone, task cancelled) aborts
        the request."""
        try:
            if not self.is_running:
                raise EngineDeadError("the engine loop is not running")
            if not validated:
                self.engine.validate(prompt_token_ids, params)
        except BaseException:
            if reserved:
                with self._lock:
                    self._reserved -= 1
            raise
        new = _NewRequest(
            request_id,
            prompt_token_ids,
            params,
            arrival_time if arrival_time is not None else time.monotonic(),
            priority,
            asyncio.Queue(),
            asyncio.get_running_loop(),
        )
        with self._lock:
            self._inbox.append(new)
            if reserved:
                self._reserved -= 1
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await new.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; applied by the loop before its next step."""
        with self._lock:
            self._aborts.append(request_id)
        self._wakeup.set()

    def end_kv_event_streams(self) -> None:
        """End every KV event stream, and any opened later, as if the engine stopped (thread-safe).

        The server calls it when its graceful shutdown begins: the streams never end by themselves, and
        the HTTP server waits for every open response before it exits.
        """
        with self._lock:
            self._kv_streams_ended = True
        self._wakeup.set()

    async def kv_events(self) -> AsyncIterator[KVCacheSnapshot | KVCacheEvent]:
        """Yield a snapshot of the prefix cache, then every change to it, as they happen.

        The snapshot is taken between steps, and the events follow on from it exactly. The iterator
        ends when the engine stops or `end_kv_event_streams()` is called, or, after a final `cleared`
        event, when this subscriber has fallen `kv_events_queue_size` steps behind (subscribe again for
        a new snapshot). Leaving it early unsubscribes. Raises EngineDeadError when the loop is not
        running.
        """
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        sub = _KVEventSubscriber(asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            self._kv_subscribes.append(sub)
        self._wakeup.set()
        try:
            while True:
                item = await sub.queue.get()
                if isinstance(item, _KVEventsEnd):
                    if item.overflowed:
                        yield KVCacheEvent("cleared")
                    return
                if isinstance(item, KVCacheSnapshot):
                    yield item
                    continue
                for event in item:
                    yield event
        finally:
            with self._lock:
                self._kv_unsubscribes.append(sub)
            self._wakeup.set()

    def _offer_kv(
        self, sub: _KVEventSubscriber, item: KVCacheSnapshot | list[KVCacheEvent] | _KVEventsEnd
    ) -> None:
        """Queue an item for a subscriber; runs on the subscriber's event loop."""
        if sub.ended:
            return
        if isinstance(item, _KVEventsEnd):
            sub.ended = True
        elif sub.queue.qsize() >= self.kv_events_queue_size:
            # Too far behind: its unread events are useless without the ones it would miss. Drop them,
            # end its stream with `cleared` (see kv_events) and send it nothing more.
            sub.ended = True
            while not sub.queue.empty():
                sub.queue.get_nowait()
            item = _KVEventsEnd(overflowed=True)
            with self._lock:
                self._kv_unsubscribes.append(sub)
            self._wakeup.set()
        sub.queue.put_nowait(item)

    # -- loop thread ----------------------------------------------------------------------------------

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Queue each (request id, output or error) to its caller: one wake-up per event loop for the
        whole list (a step's outputs), not one per request, so the API thread is woken once a step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]
            by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, puts in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's event loop may be closed already
                loop.call_soon_threadsafe(_put_all, puts)

    def _send_kv(
        self, sub: _KVEventSubscriber, item: KVCacheSnapshot | list[KVCacheEvent] | _KVEventsEnd
    ) -> None:
        try:
            sub.loop.call_soon_threadsafe(self._offer_kv, sub, item)
        except RuntimeError:  # the subscriber's event loop is closed: nobody is reading
            self._remove_kv_subscriber(sub)

    def _remove_kv_subscriber(self, sub: _KVEventSubscriber) -> None:
        if sub in self._kv_subscribers:
            self._kv_subscribers.remove(sub)
            if not self._kv_subscribers:
                self.engine.kv_cache.set_event_recording(False)

    def _publish_kv_events(self) -> None:
        """Send the block manager's events since the last call to every subscriber, as one batch."""
        if not self._kv_subscribers:
            return
        events = self.engine.kv_cache.take_events()
        if events:
            for sub in list(self._kv_subscribers):
                self._send_kv(sub, events)

    def _drain_kv_subscriptions(
        self, subscribes: list[_KVEventSubscriber], unsubscribes: list[_KVEventSubscriber]
    ) -> None:
        kv = self.engine.kv_cache
        if subscribes:
            # Whatever is pending belongs to the streams of the existing subscribers, before the snapshot.
            self._publish_kv_events()
            kv.set_event_recording(True)
            snapshot = kv.snapshot()
            for sub in subscribes:
                self._kv_subscribers.append(sub)
                self._send_kv(sub, snapshot)
        for sub in unsubscribes:
            self._remove_kv_subscriber(sub)

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            subscribes, self._kv_subscribes = self._kv_subscribes, []
            unsubscribes, self._kv_unsubscribes = self._kv_unsubscribes, []
            streams_ended = self._kv_streams_ended
        self._drain_kv_subscriptions(subscribes, unsubscribes)
        if streams_ended:
            self._end_kv_streams()
        for new in inbox:
            try:
                self.engine.add_request(
                    new.request_id,
                    new.prompt_token_ids,
                    new.params,
                    new.arrival_time,
                    new.priority,
                    validated=True,
                )
            except Exception as exc:  # validated already; a duplicate id is the remaining case
                new.loop.call_soon_threadsafe(new.queue.put_nowait, exc)
                continue
            self._streams[new.request_id] = new
        for request_id in aborts:
            self.engine.abort_request(request_id)
            self._streams.pop(request_id, None)

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped.is_set():
            self._drain_inbox()
            if not engine.has_unfinished_requests():
                engine.step()  # lets observers see the idle state (gauges back to 0)
                self._publish_kv_events()
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                logger.exception("engine step failed; aborting the requests of that step")
                self._publish_kv_events()  # blocks evicted before the failure stay evicted
                error = StepFailedError(f"engine step failed: {exc}")
                failed = [r for r in self._streams if r not in engine.scheduler.requests]
                self._deliver([(request_id, error) for request_id in failed])
                continue
            self._publish_kv_events()
            self._deliver([(out.request_id, out) for out in outputs])
        # Stopping: wake every caller still waiting.
        dead = EngineDeadError("the engine is shutting down")
        self._deliver([(request_id, dead) for request_id in list(self._streams)])
        with self._lock:
            waiting, self._kv_subscribes = self._kv_subscribes, []
        self._kv_subscribers += waiting
        self._end_kv_streams()

    def _end_kv_streams(self) -> None:
        for sub in list(self._kv_subscribers):
            self._send_kv(sub, _KVEventsEnd(overflowed=False))
        if self._kv_subscribers:
            self._kv_subscribers = []
            self.engine.kv_cache.set_event_recording(False)
