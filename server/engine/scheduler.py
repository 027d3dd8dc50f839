"""The scheduler: each step, which requests run and how many tokens each computes. No tensors here.

Iteration-level scheduling (Orca, Yu et al., OSDI 2022) with chunked prefill (Sarathi-Serve, Agrawal et
al., OSDI 2024), as vLLM's unified scheduler does it: every request has `num_computed_tokens` and
`num_tokens`; a step gives each scheduled request `num_new_tokens` to compute. Running requests (mostly
decodes, one token each) are served first, then waiting prompts fill what is left of the token budget,
in chunks when chunked prefill is on. When KV blocks run out, the most recently arrived running request
is preempted: its blocks are freed, it keeps its generated tokens and goes back to the waiting queue to
be recomputed (vLLM's recompute preemption). Finished and aborted requests free their blocks at once.
With speculative decoding, a running request in decode also computes its draft tokens
(`Request.spec_token_ids`, set by `speculative.Drafter`), within the step's token budget and only where
KV blocks are free without preempting anyone. With LoRA, the running requests use at most `max_loras` adapters (the slots the model runner holds): a
waiting request of another adapter waits while requests behind it that fit are admitted (vLLM's rule).

`StaticScheduler` is the request-level baseline the benchmarks compare against: a batch is admitted only
when the previous one has ended, and its finished members keep computing padding tokens until it does.
`make_scheduler` picks the class from `SchedulerConfig.scheduling`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from conveyor.server.config import SchedulerConfig
from conveyor.server.engine.kv_cache import KVCacheManager
from conveyor.server.engine.request import Request, RequestStatus
from conveyor.server.messages import FinishReason, SchedulerStats


@dataclass
class ScheduledRequest:
    """`num_new_tokens` tokens of `request`, starting at its `num_computed_tokens`, run this step; the
    last `len(spec_token_ids)` of them are draft tokens to verify (speculative decoding), past the
    request's known tokens."""

    request: Request
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last known token, so a new token is sampled."""
        request = self.request
        return (
            request.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == request.num_tokens
        )


@dataclass
class SchedulerOutput:
    """One step's plan. `num_batched_tokens` is the sum of `num_new_tokens`."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides who runs each step (continuous batching). Pure bookkeeping over `Request`s and the KV
    cache manager.

    max_model_len: requests never grow past it (the engine validates prompts against it). max_loras:
    LoRA adapters the running requests may use at once (0: no LoRA).
    """

    scheduling = "continuous"

    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager, max_num_seqs: int, max_loras: int = 0
    ) -> None:
        if config.scheduling != self.scheduling:
            raise ValueError(f"{type(self).__name__} schedules {self.scheduling!r}; use make_scheduler")
        self.config = config
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def _order_key(self, request: Request) -> tuple[int, float]:
        if self.config.scheduling_policy == "priority":
            return (request.priority, request.arrival_time)
        return (0, request.arrival_time)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request: Request, reason: FinishReason) -> None:
        """Stop a request (finished or aborted) and free its blocks now."""
        if request.is_finished:
            return
        was_running = request.status is RequestStatus.RUNNING
        if was_running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = time.monotonic()
        del self.requests[request.request_id]
        self._release(request, was_running)

    def _release(self, request: Request, was_running: bool) -> None:
        """Give back a request's blocks once it has finished."""
        self.kv_cache.free(request)

    def make_stats(self, schedule: SchedulerOutput) -> SchedulerStats:
        """Stats of the step `schedule` planned, taken after its outputs were applied."""
        prefix = self.kv_cache.make_prefix_cache_stats()
        return SchedulerStats(
            len(self.running),
            len(self.waiting),
            self.kv_cache.usage,
            schedule.num_batched_tokens,
            len(schedule.preempted),
            prefix.queries,
            prefix.hits,
            # Walks every waiting request: only where adapters can be running at all.
            running_lora_adapters=_adapter_names(self.running) if self.max_loras else (),
            waiting_lora_adapters=_adapter_names(self.waiting) if self.max_loras else (),
        )

    def abort_request(self, request_id: str) -> Request | None:
        """Abort by id; returns the request, or None when it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, FinishReason.ABORT)
        return request

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.draft_state = None  # a draft model's K/V went with the blocks
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(request)

    def _recompute_rope_if_grown(self, request: Request) -> None:
        """Where `request` has grown past the length where its rotary table changes
        (`Request.rope_recompute`): its blocks go back (those already full stay in the prefix cache
        under the old table's key) and its whole sequence is computed again with the new table, from
        this step on; a running request keeps its place in the running batch."""
        if request.rope_recompute is None or request.num_tokens <= request.rope_recompute[0]:
            return
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.block_hashes = []
        request.spec_token_ids = []
        request.draft_state = None  # a draft model's K/V went with the blocks
        request.rope_length = request.num_tokens
        request.rope_key = request.rope_recompute[1]
        request.rope_recompute = None

    @property
    def _chunked(self) -> bool:
        return self.config.enable_chunked_prefill

    def _admits(self, out: SchedulerOutput) -> bool:
        """Whether waiting requests may join this step: not in a step that had to preempt."""
        return not out.preempted

    def _schedule_padding(self, out: SchedulerOutput, budget: int) -> int:
        """Rows a subclass adds after the running requests; returns the budget left."""
        return budget

    def schedule(self) -> SchedulerOutput:
        """Plan one step: at most `max_num_batched_tokens` tokens and `max_num_seqs` running requests."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunked = self._chunked
        self.running.sort(key=self._order_key)

        # Running requests first, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            self._recompute_rope_if_grown(request)
            num_new = request.num_tokens - request.num_computed_tokens
            if not chunked and num_new > budget:
                i += 1
                continue
            num_new = min(num_new, budget)
            drafts = request.spec_token_ids[: budget - num_new]  # drafts only fill what the budget leaves
            num_new += len(drafts)
            while not self.kv_cache.allocate_slots(request, num_new, []):
                if drafts:  # drafts never cost another request its place: drop them first
                    num_new, drafts = num_new - len(drafts), []
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            out.scheduled.append(ScheduledRequest(request, num_new, drafts))
            budget -= num_new
            i += 1

        budget = self._schedule_padding(out, budget)

        # Then waiting requests.
        admit = self._admits(out)
        self.waiting.sort(key=self._order_key)
        adapters = {r.lora.uid for r in self.running if r.lora is not None}
        position = 0  # waiting requests before it wait for an adapter slot
        while admit and position < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[position]
            lora = request.lora
            if lora is not None and lora.uid not in adapters and len(adapters) >= self.max_loras:
                position += 1
                continue
            self._recompute_rope_if_grown(request)  # preempted after it grew, before it was recomputed
            computed = self.kv_cache.get_computed_blocks(request)
            num_computed = len(computed) * self.kv_cache.block_size
            num_new = request.num_tokens - num_computed
            if not chunked and num_new > budget:
                break
            num_new = min(num_new, budget)
            request.num_computed_tokens = num_computed
            if not self.kv_cache.allocate_slots(request, num_new, computed):
                request.num_computed_tokens = 0
                break
            self.waiting.pop(position)
            if lora is not None:
                adapters.add(lora.uid)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, list[int]], max_model_len: int
    ) -> list[tuple[Request, int, float | None]]:
        """Advance the step's requests and append their new tokens (`sampled_token_ids`, by request id:
        the accepted draft tokens, then the one the model sampled). A draft's rejected positions are
        not computed: their K/V lies past `num_computed_tokens` and is overwritten by later steps,
        before any block holding them is full and enters the prefix cache. Returns the requests that got
        tokens, each with how many and the time of its previous token (None for a first token); whether
        one ends the request is the output processor's decision. max_model_len: context length in
        tokens (the static baseline's padding rows stop there).
        """
        updated: list[tuple[Request, int, float | None]] = []
        now = time.monotonic()
        for sched in output.scheduled:
            request = sched.request
            token_ids = sampled_token_ids.get(request.request_id)
            num_rejected = len(sched.spec_token_ids) + 1 - len(token_ids) if token_ids else 0
            request.num_computed_tokens += sched.num_new_tokens - num_rejected
            if token_ids:
                request.append_output_tokens(token_ids)
            self.kv_cache.cache_full_blocks(request)
            if not token_ids:
                continue
            request.last_token_time, previous = now, request.last_token_time
            if request.first_token_time is None:
                request.first_token_time = now
            updated.append((request, len(token_ids), previous))
        return updated


def _adapter_names(requests: list[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))


class StaticScheduler(Scheduler):
    """Request-level (static) batching, the baseline continuous batching is measured against: a batch is
    admitted only when the previous one has ended, prompts are never chunked, and a finished member of an
    unfinished batch keeps its slot, computing one discarded token per step until the batch's longest
    member ends, as a padded batch does (DESIGN.md, "Benchmarks")."""

    scheduling = "static"

    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager, max_num_seqs: int, max_loras: int = 0
    ) -> None:
        super().__init__(config, kv_cache, max_num_seqs, max_loras)
        # Finished members of the current batch, still computing padding tokens.
        self.padding: list[Request] = []

    @property
    def _chunked(self) -> bool:
        return False

    def _admits(self, out: SchedulerOutput) -> bool:
        return not out.preempted and not self.running

    def _release(self, request: Request, was_running: bool) -> None:
        if was_running and request.finish_reason is not FinishReason.ABORT and self.running:
            self.padding.append(request)
        else:
            self.kv_cache.free(request)
        if not self.running:
            for padded in self.padding:
                self.kv_cache.free(padded)
            self.padding.clear()

    def _schedule_padding(self, out: SchedulerOutput, budget: int) -> int:
        """One wasted token for each padding row, as a padded batch computes them."""
        for request in list(self.padding):
            if budget <= 0:
                break
            if not self.kv_cache.allocate_slots(request, 1, []):
                self.padding.remove(request)
                self.kv_cache.free(request)
                continue
            out.scheduled.append(ScheduledRequest(request, 1))
            budget -= 1
        return budget

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, list[int]], max_model_len: int
    ) -> list[tuple[Request, int, float | None]]:
        """As `Scheduler.update_from_output`; a padding row's token is computed and thrown away."""
        live = []
        for sched in output.scheduled:
            request = sched.request
            if not request.is_finished:
                live.append(sched)
                continue
            request.num_computed_tokens += sched.num_new_tokens
            request.all_token_ids += sampled_token_ids[request.request_id]
            if request.num_tokens >= max_model_len and request in self.padding:
                self.padding.remove(request)
                self.kv_cache.free(request)
        return super().update_from_output(
            SchedulerOutput(live, output.num_batched_tokens, output.preempted),
            sampled_token_ids,
            max_model_len,
        )


def make_scheduler(
    config: SchedulerConfig, kv_cache: KVCacheManager, max_num_seqs: int, max_loras: int = 0
) -> Scheduler:
    """The scheduler `config.scheduling` names: `continuous` (Scheduler) or `static` (StaticScheduler)."""
    cls = StaticScheduler if config.scheduling == "static" else Scheduler
    return cls(config, kv_cache, max_num_seqs, max_loras)
