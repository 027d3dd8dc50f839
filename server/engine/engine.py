"""The engine: admits requests (`make_request` checks them, with `validation`) and runs steps:
schedule -> execute -> update -> outputs (`output` detokenizes and decides every finish; `stats`
carries what metrics read). `builder.build_engine` assembles it from an EngineConfig.

Synchronous and single-threaded; `AsyncEngine` runs it in its own thread beside the asyncio server.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from conveyor.server.config import EngineConfig
from conveyor.server.engine.kv_cache import KVCacheManager
from conveyor.server.engine.lora import LoRARegistry
from conveyor.server.engine.output import OutputProcessor
from conveyor.server.engine.request import Request
from conveyor.server.engine.scheduler import SchedulerOutput, make_scheduler
from conveyor.server.engine.speculative import Drafter
from conveyor.server.engine.stats import StatsObserver
from conveyor.server.engine.structured_output import StructuredOutputManager
from conveyor.server.engine.validation import InvalidRequestError, validate_request
from conveyor.server.messages import EngineLimits, EngineRequest, FinishReason, RequestOutput, SamplingParams
from conveyor.server.model.lora import LoRAError
from conveyor.server.model.runner import ModelRunner


@dataclass
class StepRecord:
    """One engine step: (request id, tokens computed) per scheduled request, and preemptions."""

    scheduled: tuple[tuple[str, int], ...]
    num_preempted: int


@dataclass
class EngineStats:
    num_steps: int = 0
    max_num_seqs_in_step: int = 0
    recent_steps: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=4096))


class LLMEngine:
    """Serves requests step by step over a model runner whose KV cache is allocated (`build_engine`
    makes one).

    limits: the KV pool and scheduler limits settled at start; kv_pool_bytes: the pool's bytes
    (`num_kv_blocks` blocks of `block_size` tokens, `kv_bytes_per_token` bytes each); observer: told of
    every step, new token and finished request (the Prometheus metrics), or None; lora: the served
    LoRA adapters (`--enable-lora`; the runner then holds `limits.max_loras` slots), or None; drafter:
    proposes draft tokens each step (`--speculative-config`), or None.
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer,
        runner: ModelRunner,
        limits: EngineLimits,
        *,
        served_model_name: str,
        kv_pool_bytes: int,
        kv_bytes_per_token: int,
        observer: StatsObserver | None = None,
        lora: LoRARegistry | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.config = config
        self.lora = lora
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.runner = runner
        self.limits = limits
        self.served_model_name = served_model_name
        self.kv_pool_bytes = kv_pool_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.observer = observer
        self.runner.take_expert_tokens()  # start-up forwards (warm-up, profiling) are not traffic
        self.vocab_size = runner.model.shape.vocab_size
        self.eos_token_id = tokenizer.eos_token_id
        self.max_model_len = limits.max_model_len
        self.num_kv_blocks = limits.num_kv_blocks
        self.kv_cache = KVCacheManager(
            limits.num_kv_blocks,
            limits.block_size,
            config.cache.enable_prefix_caching,
            limits.sliding_window,
            limits.num_window_blocks or None,
        )
        self.scheduler = make_scheduler(
            config.scheduler, self.kv_cache, limits.max_num_seqs, limits.max_loras
        )
        self.structured_output = StructuredOutputManager(tokenizer, self.vocab_size)
        self.output_processor = OutputProcessor(
            tokenizer, self.structured_output, self.max_model_len, observer
        )
        self.global_generator = torch.Generator().manual_seed(config.model.seed)
        self.stats = EngineStats()

    @property
    def model(self):
        """The model the runner runs (`LlamaForCausalLM`)."""
        return self.runner.model

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step after this), and the
        `--lora-modules-file` watch."""
        if self.lora is not None:
            self.lora.close()
        if self.runner.workers is not None:
            self.runner.workers.shutdown()

    # -- requests ---------------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> EngineRequest:
        """Check a request against this engine and return it ready to queue (`add_request`), under the
        LoRA adapter `lora_name` (None: the base model). Raises InvalidRequestError naming the field.
        Thread-safe; may compile a structured-output grammar (cached) or read an adapter's files, so
        callers on an event loop run it in a worker thread."""
        validate_request(
            prompt_token_ids, params, self.vocab_size, self.max_model_len, self.structured_output
        )
        return EngineRequest(
            request_id,
            tuple(prompt_token_ids),
            params,
            arrival_time if arrival_time is not None else time.monotonic(),
            priority,
            self._adapter(lora_name),
        )

    def _adapter(self, name: str | None):
        """The LoRA adapter served as `name` (None for None). Raises InvalidRequestError naming `model`."""
        if name is None:
            return None
        if self.lora is None:
            raise InvalidRequestError(f"The model `{name}` does not exist (LoRA is off).", "model")
        try:
            return self.lora.get(name)
        except LoRAError as exc:
            raise InvalidRequestError(str(exc), "model") from None

    def add_request(self, new: EngineRequest) -> Request:
        """Queue a request `make_request` returned. Raises ValueError for a request id already queued
        or running."""
        params = new.params
        request = Request(
            request_id=new.request_id,
            prompt_token_ids=list(new.prompt_token_ids),
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=new.arrival_time,
            priority=new.priority,
            lora=new.lora,
        )
        shape = self.model.shape
        if shape.rope_by_length:
            request.rope_length = prompt_len = len(request.prompt_token_ids)
            request.rope_key = shape.rope_cache_key(prompt_len)
            after = shape.rope_recompute_after(prompt_len)
            request.rope_recompute = None if after is None else (after, shape.rope_cache_key(after + 1))
        if request.generator is None:
            request.generator = self.global_generator
        if params.structured_output is not None:
            request.grammar = self.structured_output.matcher(params.structured_output)
        self.scheduler.add_request(request)
        self.output_processor.add_request(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a queued or running request; its blocks are free when this returns."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        return self.output_processor.final_output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_request(self, request_id: str) -> bool:
        """True while the request is queued or running."""
        return request_id in self.scheduler.requests

    @property
    def num_waiting_requests(self) -> int:
        """Requests queued for a slot in the running batch (preempted ones included)."""
        return len(self.scheduler.waiting)

    # -- the step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: draft (with speculative decoding) -> schedule -> execute (forward, sample and
        verify drafts) -> update (the scheduler appends the tokens) -> outputs (detokenize, stop checks,
        finish). Returns per-request outputs."""
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running, len(self.scheduler.waiting), self.max_model_len)
        schedule = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        expert_tokens = None
        if not schedule.is_empty:
            try:
                if self.drafter is not None:
                    self.drafter.fill(schedule.scheduled)  # a draft model's tokens, now that blocks are held
                start = time.perf_counter()
                result = self.runner.execute(schedule)
                seconds = time.perf_counter() - start
            except Exception:
                # A failed forward (the draft's or the model's) must not leave requests holding blocks:
                # abort the step's requests.
                for sched in schedule.scheduled:
                    self.scheduler.finish_request(sched.request, FinishReason.ABORT)
                    self.output_processor.discard(sched.request.request_id)
                raise
            self._record_step(schedule)
            sampled = dict(zip(result.request_ids, result.token_ids, strict=True))
            if self.drafter is not None:
                self.drafter.verified(schedule.scheduled, sampled, seconds)
            updated = self.scheduler.update_from_output(schedule, sampled, self.max_model_len)
            logprobs = dict(zip(result.request_ids, result.logprobs, strict=True))
            outputs = self.output_processor.process(updated, logprobs, self.scheduler.finish_request)
            if self.drafter is not None:
                for request, _, _ in updated:
                    if request.is_finished:
                        self.drafter.finished(request)
            expert_tokens = self.runner.take_expert_tokens()
        if self.observer is not None:
            stats = self.scheduler.make_stats(schedule)
            spec = self.drafter.take_stats() if self.drafter is not None else None
            if expert_tokens or spec:
                stats = replace(stats, expert_tokens=expert_tokens, spec_decoding=spec)
            self.observer.on_step(stats)
        return outputs

    def _record_step(self, schedule: SchedulerOutput) -> None:
        self.stats.num_steps += 1
        n = len(schedule.scheduled)
        self.stats.max_num_seqs_in_step = max(self.stats.max_num_seqs_in_step, n)
        self.stats.recent_steps.append(
            StepRecord(
                tuple((s.request.request_id, s.num_new_tokens) for s in schedule.scheduled),
                len(schedule.preempted),
            )
        )
