"""Runs the engine's step loop in its own thread and streams outputs to asyncio callers.

The loop thread owns the engine: requests and aborts reach it through a lock-protected inbox and are
applied between steps, so an abort frees its blocks before the next step is scheduled and a queued
request whose client left is never prefilled. torch releases the GIL inside its kernels, so the
asyncio server keeps serving while a step runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from conveyor.server.engine.engine import LLMEngine, RequestOutput
from conveyor.server.engine.request import SamplingParams

logger = logging.getLogger(__name__)


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


class AsyncEngine:
    """Thread-backed front of an LLMEngine. Use `start()` once, `generate()` per request, `stop()` at exit."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._inbox: list[_NewRequest] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _NewRequest] = {}
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="conveyor-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped.is_set()

    # -- asyncio side ---------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until it finishes. Validation errors
        (InvalidRequestError) are raised before anything is queued. Leaving the iterator early
        (client gone, task cancelled) aborts the request."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        self.engine.validate(prompt_token_ids, params)
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

    # -- loop thread ----------------------------------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]
        with contextlib.suppress(RuntimeError):  # the caller's event loop may be closed already
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for new in inbox:
            try:
                self.engine.add_request(
                    new.request_id, new.prompt_token_ids, new.params, new.arrival_time, new.priority
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
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                logger.exception("engine step failed; aborting the requests of that step")
                error = StepFailedError(f"engine step failed: {exc}")
                for request_id in [r for r in self._streams if r not in engine.scheduler.requests]:
                    self._deliver(request_id, error)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
        # Stopping: wake every caller still waiting.
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError("the engine is shutting down"))
