"""What the engine reports per request as it runs: the events of `StatsObserver` (the metrics implement
it). Per step it hands out `SchedulerStats` values (server/messages.py); nobody reads the scheduler's or
the KV cache's internals."""

from __future__ import annotations

from typing import Protocol

from conveyor.server.engine.request import Request
from conveyor.server.messages import SchedulerStats


class StatsObserver(Protocol):
    """Receives engine events (the Prometheus metrics implement it). Times in seconds (time.monotonic)."""

    def on_step(self, stats: SchedulerStats) -> None: ...
    def on_new_tokens(
        self, request: Request, num_new_tokens: int, now: float, previous_token_time: float | None
    ) -> None: ...
    def on_finished(self, request: Request) -> None: ...
