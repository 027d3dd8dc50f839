"""Runs the engine's step loop in its own thread and streams outputs to asyncio callers.

The loop thread owns the engine. Everything else reaches it as commands on one queue (llama.cpp's
`server_queue`, vLLM's input queue): add a request, abort one, subscribe to or leave the KV event
stream, end every KV event stream. The loop drains the queue between steps, in the order the commands
were sent, so an abort frees its blocks before the next step is scheduled and a queued request whose
client left is never prefilled; when the engine is idle the loop sleeps on the queue. What callers read
of the loop's state (the number of waiting requests) the loop publishes as a value after each drain and
step. torch releases the GIL inside its kernels, so the asyncio server keeps serving while a step runs.

KV events: `kv_events.KVEventHub` (snapshot, then every step's events; see there).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from conveyor.server.engine import kv_events
from conveyor.server.engine.engine import LLMEngine
from conveyor.server.engine.kv_events import KVEventHub, KVEventSubscriber
from conveyor.server.engine.lora import AdapterState
from conveyor.server.engine.tuning import freeze_startup_heap, release_openmp_threads
from conveyor.server.messages import (
    EngineRequest,
    KVCacheEvent,
    KVCacheSnapshot,
    RequestOutput,
)

logger = logging.getLogger(__name__)

# Seconds the idle loop sleeps on its queue before stepping again (the idle step lets observers see
# gauges at 0).
IDLE_WAIT = 1.0


class EngineDeadError(RuntimeError):
    """The step loop is not running (stopped, or never started)."""


class StepFailedError(RuntimeError):
    """A model step failed; the requests in that step were aborted and the loop goes on."""


@dataclass(eq=False)
class _Stream:
    """Where one request's outputs go: its caller's queue and event loop."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


# The commands (sent by any thread, applied by the loop thread between steps).


@dataclass(frozen=True)
class _Add:
    request: EngineRequest
    stream: _Stream


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Subscribe:
    sub: KVEventSubscriber


@dataclass(frozen=True)
class _Unsubscribe:
    sub: KVEventSubscriber


@dataclass(frozen=True)
class _EndKVStreams:
    """End every KV event stream now and any opened later."""


_Command = _Add | _Abort | _Subscribe | _Unsubscribe | _EndKVStreams | None  # None: wake up (stop)


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    """On a caller's event loop: put each item in its queue."""
    for q, item in puts:
        q.put_nowait(item)


class AsyncEngine:
    """Thread-backed front of an LLMEngine. Use `start()` once, `generate()` per request, `stop()` at exit.

    kv_events_queue_size: step batches of KV events a subscriber may have unread before it is dropped.
    """

    def __init__(self, engine: LLMEngine, kv_events_queue_size: int = 1024) -> None:
        self.engine = engine
        # `LLMEngine.make_request`: the checked request, or InvalidRequestError naming the field. Safe
        # from any thread; may compile a structured-output grammar, so event loops call it in a worker.
        self.make_request = engine.make_request
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the three counts below
        self._reserved = 0  # admitted (`reserve`) but not yet handed to `generate`
        self._queued = 0  # handed to `generate`, its command not yet applied by the loop
        self._waiting = 0  # waiting in the scheduler, as the loop last published it
        self._streams: dict[str, _Stream] = {}  # the loop thread's own
        self._kv = KVEventHub(engine.kv_cache, kv_events_queue_size, drop=self._drop_kv_subscriber)
        self._kv_streams_ended = False  # the loop thread's own
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
        self._commands.put(None)
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

    # LoRA adapters (`LoRARegistry`, thread-safe): read and changed from the API's worker threads.

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora is not None

    def lora_adapters(self) -> dict[str, str]:
        """Served adapter names -> their directories, in the order they were loaded ({} without LoRA)."""
        registry = self.engine.lora
        if registry is None:
            return {}
        return {name: path for name in registry.names if (path := registry.path(name)) is not None}

    def lora_states(self) -> list[AdapterState]:
        """Every adapter named to the server, served or failed ([] without LoRA)."""
        registry = self.engine.lora
        return registry.states() if registry is not None else []

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Read and serve an adapter (blocking: call it from a worker thread). Raises LoRAError."""
        self.engine.lora.add(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving `name`; its running requests finish with it. Raises UnknownAdapterError."""
        self.engine.lora.remove(name)

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot: admitted (`reserve`), handed in but not yet taken by the loop,
        or waiting in the scheduler when the loop last looked."""
        return self._reserved + self._queued + self._waiting

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
        return len(self._kv.subscribers)

    # -- asyncio side ---------------------------------------------------------------------------------

    async def generate(self, request: EngineRequest, reserved: bool = False) -> AsyncIterator[RequestOutput]:
        """Queue a request (`make_request` checked it) and yield its outputs until it finishes.
        `reserved`: the request was admitted with `reserve`. Leaving the iterator early (client gone,
        task cancelled) aborts the request. Raises EngineDeadError when the loop is not running."""
        running = self.is_running
        with self._lock:
            if reserved:
                self._reserved -= 1
            if running:
                self._queued += 1
        if not running:
            raise EngineDeadError("the engine loop is not running")
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        self._commands.put(_Add(request, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; applied by the loop before its next step."""
        self._commands.put(_Abort(request_id))

    def end_kv_event_streams(self) -> None:
        """End every KV event stream, and any opened later, as if the engine stopped (thread-safe).

        The server calls it when its graceful shutdown begins: the streams never end by themselves, and
        the HTTP server waits for every open response before it exits.
        """
        self._commands.put(_EndKVStreams())

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
        sub = KVEventSubscriber(asyncio.Queue(), asyncio.get_running_loop())
        self._commands.put(_Subscribe(sub))
        try:
            async for item in kv_events.stream(sub):
                yield item
        finally:
            self._commands.put(_Unsubscribe(sub))

    def _drop_kv_subscriber(self, sub: KVEventSubscriber) -> None:
        self._commands.put(_Unsubscribe(sub))

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

    def _drain(self, wait: float | None) -> None:
        """Apply every queued command, in order; first sleep up to `wait` seconds for one when given.
        Then publish the waiting count."""
        commands: list[_Command] = []
        with contextlib.suppress(queue.Empty):
            if wait is not None:
                commands.append(self._commands.get(timeout=wait))
            while True:
                commands.append(self._commands.get_nowait())
        num_added = 0
        for command in commands:
            if isinstance(command, _Add):
                num_added += 1
                self._add(command)
            elif isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                self._streams.pop(command.request_id, None)
            elif isinstance(command, _Subscribe):
                self._kv.subscribe(command.sub)
                if self._kv_streams_ended:
                    self._kv.end_all()
            elif isinstance(command, _Unsubscribe):
                self._kv.unsubscribe(command.sub)
            elif isinstance(command, _EndKVStreams):
                self._kv_streams_ended = True
                self._kv.end_all()
        self._publish_waiting(num_added)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request)
        except Exception as exc:  # checked already; a duplicate id is the remaining case
            with contextlib.suppress(RuntimeError):
                command.stream.loop.call_soon_threadsafe(command.stream.queue.put_nowait, exc)
            return
        self._streams[command.request.request_id] = command.stream

    def _publish_waiting(self, num_taken: int = 0) -> None:
        """Move `num_taken` requests from queued to the scheduler's count in one step (never counted
        as neither, so admission never overshoots)."""
        with self._lock:
            self._queued -= num_taken
            self._waiting = self.engine.num_waiting_requests

    def _run(self) -> None:
        engine = self.engine
        idle = False
        while not self._stopped.is_set():
            self._drain(IDLE_WAIT if idle else None)
            if self._stopped.is_set():
                break
            if not engine.has_unfinished_requests():
                engine.step()  # lets observers see the idle state (gauges back to 0)
                self._kv.publish()
                idle = True
                continue
            idle = False
            try:
                outputs = engine.step()
            except Exception as exc:
                logger.exception("engine step failed; aborting the requests of that step")
                self._kv.publish()  # blocks evicted before the failure stay evicted
                error = StepFailedError(f"engine step failed: {exc}")
                failed = [r for r in self._streams if not engine.has_request(r)]
                self._deliver([(request_id, error) for request_id in failed])
                continue
            self._kv.publish()
            self._deliver([(out.request_id, out) for out in outputs])
        # Stopping: wake every caller still waiting, and end every KV event stream.
        dead = EngineDeadError("the engine is shutting down")
        self._deliver([(request_id, dead) for request_id in list(self._streams)])
        with contextlib.suppress(queue.Empty):
            while True:
                command = self._commands.get_nowait()
                if isinstance(command, _Subscribe):
                    self._kv.subscribers.append(command.sub)
                elif isinstance(command, _Add):
                    self._streams[command.request.request_id] = command.stream
                    self._deliver([(command.request.request_id, dead)])
        self._kv.end_all()
