"""The engine: builds the serving system (model, KV cache, scheduler, runner) from an EngineConfig,
admits requests (checked by `validation`), and runs steps: schedule -> execute -> update -> outputs
(`output` detokenizes and decides every finish; `stats` carries what metrics read).

Synchronous and single-threaded; `AsyncEngine` runs it in its own thread beside the asyncio server.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from conveyor.kernels import onednn, select_backend
from conveyor.server import capacity
from conveyor.server.config import EngineConfig, GiB, check_prompt_fits_step
from conveyor.server.engine.kv_cache import KVCacheManager
from conveyor.server.engine.output import OutputProcessor
from conveyor.server.engine.request import Request
from conveyor.server.engine.scheduler import SchedulerOutput, make_scheduler
from conveyor.server.engine.stats import StatsObserver
from conveyor.server.engine.structured_output import StructuredOutputManager
from conveyor.server.engine.validation import validate_request
from conveyor.server.messages import EngineLimits, FinishReason, RequestOutput, SamplingParams
from conveyor.server.model import loader
from conveyor.server.model.models.llama import ModelShape
from conveyor.server.model.parallel import partition
from conveyor.server.model.runner import ModelRunner
from conveyor.server.model.worker import Workers

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 4 * GiB
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def pick_dtype(name: str, device: torch.device, hf_config=None) -> tuple[torch.dtype, str]:
    """The weight and activation dtype for `--dtype name`, with the reason (logged at start).

    `auto` (DESIGN.md): on CUDA the model's configured half type (bfloat16 when it names none); on a
    CPU bfloat16 only where oneDNN computes it natively (AVX512_BF16 or AMX), float32 elsewhere: on
    AVX2 bfloat16 matmuls are emulated and about 2.5x slower than float32.
    """
    if name != "auto":
        return _DTYPES[name], f"--dtype {name}"
    if device.type == "cpu":
        if onednn.cpu_bf16_native():
            return torch.bfloat16, "auto: this CPU computes bfloat16 natively"
        return torch.float32, "auto: this CPU has no native bfloat16 (AVX512_BF16 or AMX)"
    configured = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if configured in (torch.float16, torch.bfloat16):
        return configured, "auto: the model's configured dtype"
    return torch.bfloat16, "auto: the model names no half dtype"


class LLMEngine:
    """Loads the model, sizes the KV cache, and serves requests step by step.

    After construction `kv_pool_bytes` and `num_kv_blocks` give the KV pool chosen at start (bytes,
    blocks of `block_size` tokens): measured free memory on CUDA, `--kv-cache-memory` on CPU.
    """

    def __init__(self, config: EngineConfig, observer: StatsObserver | None = None) -> None:
        self.config = config
        mc, dc = config.model, config.device
        device_type = dc.device if dc.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if device_type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch finds no CUDA device")
        self.device = torch.device(device_type)
        source = loader.converted(loader.resolve_model(mc.model))
        self.served_model_name = mc.served_model_name or source.default_name
        hf_config = loader.load_config(source)
        self.dtype, why = pick_dtype(mc.dtype, self.device, hf_config)
        backend, ops = select_backend(dc.attention_backend, device_type)
        logger.info("device %s, dtype %s (%s), kernel backend %s", self.device, self.dtype, why, backend)
        self.tokenizer = loader.load_tokenizer(source, mc.load_format)
        self.workers = self._start_workers(source, hf_config, backend, device_type)
        try:
            self._build(config, source, hf_config, ops, observer)
        except BaseException:
            self.close()
            raise

    def _start_workers(self, source, hf_config, backend: str, device_type: str) -> Workers | None:
        """The other ranks of a tensor-parallel replica (None at --tensor-parallel-size 1), started
        after checking that the size splits the model. Raises ValueError naming both numbers."""
        size = self.config.parallel.tensor_parallel_size
        if size == 1:
            return None
        shape = ModelShape.from_hf_config(hf_config)
        partition(shape.num_heads, shape.num_kv_heads, shape.intermediate_size, shape.vocab_size, 0, size)
        if device_type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"--tensor-parallel-size {size} needs {size} CUDA devices; torch finds "
                f"{torch.cuda.device_count()}"
            )
        rank_config = {
            "source": source,
            "dtype": self.dtype,
            "device_type": device_type,
            "backend": backend,
            "load_format": self.config.model.load_format,
            "block_size": self.config.cache.block_size,
        }
        return Workers(rank_config, size, self.device)

    def _build(self, config: EngineConfig, source, hf_config, ops, observer: StatsObserver | None) -> None:
        mc, cc = config.model, config.cache
        tp = self.workers.tp if self.workers is not None else None
        self.model = loader.load_model(source, hf_config, self.dtype, self.device, ops, mc.load_format, tp)
        shape = self.model.shape
        self.vocab_size = shape.vocab_size
        self.eos_token_id = self.tokenizer.eos_token_id
        self.max_model_len = mc.max_model_len or shape.max_position_embeddings
        if self.max_model_len > shape.max_position_embeddings:
            raise ValueError(
                f"--max-model-len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{shape.max_position_embeddings}"
            )
        dtype_name = str(self.dtype).removeprefix("torch.")
        self.kv_bytes_per_token = capacity.kv_bytes_per_token(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype_name, tp.size if tp else 1
        )
        pool_bytes = self._kv_pool_bytes(ops)
        num_blocks = capacity.num_kv_blocks_for_pool(pool_bytes, self.kv_bytes_per_token, cc.block_size)
        self.kv_pool_bytes, self.num_kv_blocks = pool_bytes, num_blocks
        pool_tokens = num_blocks * cc.block_size
        if pool_tokens < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {pool_tokens} tokens ({pool_bytes} bytes at {self.kv_bytes_per_token} "
                f"bytes/token), fewer than max_model_len {self.max_model_len}: raise --kv-cache-memory "
                f"(or --gpu-memory-utilization) or lower --max-model-len"
            )
        sc = config.scheduler
        check_prompt_fits_step(sc, self.max_model_len)  # max_model_len may be the model's own here
        fits = capacity.max_num_seqs_for_blocks(num_blocks, cc.block_size, self.max_model_len)
        max_num_seqs = config.scheduler.max_num_seqs or fits
        if max_num_seqs > fits:
            logger.warning(
                "--max-num-seqs %d is more than the %d sequences of max_model_len %d the KV cache holds; "
                "long sequences will be preempted",
                max_num_seqs,
                fits,
                self.max_model_len,
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %d bytes/token); maximum concurrency at "
            "max_model_len %d: %.2fx; max_num_seqs %d",
            num_blocks,
            cc.block_size,
            pool_bytes / GiB,
            self.kv_bytes_per_token,
            self.max_model_len,
            pool_tokens / self.max_model_len,
            max_num_seqs,
        )
        self.kv_cache = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = make_scheduler(config.scheduler, self.kv_cache, max_num_seqs)
        self.limits = EngineLimits(
            cc.block_size, num_blocks, max_num_seqs, sc.max_num_batched_tokens, self.max_model_len
        )
        self.runner = ModelRunner(
            self.model, ops, num_blocks, cc.block_size, self.dtype, self.device, self.workers
        )
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size)
        self.output_processor = OutputProcessor(
            self.tokenizer, self.structured_output, self.max_model_len, observer
        )
        self.global_generator = torch.Generator().manual_seed(mc.seed)
        self.stats = EngineStats()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step after this)."""
        if self.workers is not None:
            self.workers.shutdown()

    @property
    def observer(self) -> StatsObserver | None:
        """Told of every step, new token and finished request (the Prometheus metrics); settable."""
        return self.output_processor.observer

    @observer.setter
    def observer(self, observer: StatsObserver | None) -> None:
        self.output_processor.observer = observer

    def _kv_pool_bytes(self, ops) -> int:
        cc = self.config.cache
        if self.device.type != "cuda":
            return cc.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
        if cc.kv_cache_memory:
            return cc.kv_cache_memory
        # Profile the peak of a step at the full token budget, then give the KV cache what remains of
        # gpu_memory_utilization (vLLM's method).
        torch.cuda.reset_peak_memory_stats()
        num_tokens = self.config.scheduler.max_num_batched_tokens
        probe_blocks = -(-num_tokens // cc.block_size)
        probe = ModelRunner(
            self.model, ops, probe_blocks, cc.block_size, self.dtype, self.device, self.workers
        )
        probe.profile(num_tokens)
        peak = torch.cuda.max_memory_allocated()
        del probe
        torch.cuda.empty_cache()
        total = torch.cuda.mem_get_info()[1]
        pool = int(total * cc.gpu_memory_utilization) - peak
        if pool <= 0:
            raise capacity.InsufficientGPUMemoryError(peak, int(total * cc.gpu_memory_utilization))
        return pool

    # -- requests ---------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError (naming the field) for a request this engine cannot serve."""
        validate_request(
            prompt_token_ids, params, self.vocab_size, self.max_model_len, self.structured_output
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        validated: bool = False,
    ) -> Request:
        """Validate (unless the caller has: `validated`) and queue a request. Raises
        InvalidRequestError."""
        if not validated:
            self.validate(prompt_token_ids, params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            priority=priority,
        )
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

    # -- the step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> execute (forward and sample) -> update (the scheduler appends the
        tokens) -> outputs (detokenize, stop checks, finish). Returns per-request outputs."""
        schedule = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        if not schedule.is_empty:
            try:
                sampled_ids, samples = self.runner.execute(schedule)
            except Exception:
                # A failed forward must not leave requests holding blocks: abort the step's requests.
                for sched in schedule.scheduled:
                    self.scheduler.finish_request(sched.request, FinishReason.ABORT)
                    self.output_processor.discard(sched.request.request_id)
                raise
            self._record_step(schedule)
            sampled = dict(zip(sampled_ids, samples.token_ids, strict=True))
            updated = self.scheduler.update_from_output(schedule, sampled, self.max_model_len)
            logprobs = dict(zip(sampled_ids, samples.logprobs, strict=True))
            outputs = self.output_processor.process(updated, logprobs, self.scheduler.finish_request)
        if self.observer is not None:
            self.observer.on_step(self.scheduler.make_stats(schedule))
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
