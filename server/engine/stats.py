"""What the engine reports as it runs, as values handed out (metrics consume them; nobody reads the
scheduler's or the KV cache's internals): per step `SchedulerStats`, per request the events of
`StatsObserver`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from conveyor.server.engine.request import Request


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups over some steps, in tokens: `queries` looked up, `hits` found cached."""

    queries: int = 0
    hits: int = 0


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler after one step, what metrics read (vLLM's `SchedulerStats`).

    num_running, num_waiting: requests. kv_cache_usage: fraction of KV blocks held (0-1).
    num_batched_tokens: tokens computed in the step; num_preempted: requests it preempted.
    prefix_cache_queries, prefix_cache_hits: tokens looked up in and found in the prefix cache in the
    step (first admissions only: see `KVCacheManager.allocate_slots`).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_batched_tokens: int = 0
    num_preempted: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class StatsObserver(Protocol):
    """Receives engine events (the Prometheus metrics implement it). Times in seconds (time.monotonic)."""

    def on_step(self, stats: SchedulerStats) -> None: ...
    def on_new_tokens(
        self, request: Request, num_new_tokens: int, now: float, previous_token_time: float | None
    ) -> None: ...
    def on_finished(self, request: Request) -> None: ...
