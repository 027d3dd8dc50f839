"""Assembles an engine from an EngineConfig (vLLM's `EngineCore.__init__`, nano-vllm's
`ModelRunner.__init__`), in order: device -> model source and config -> dtype -> kernel backend ->
tokenizer -> tensor-parallel workers -> weights (loaded, then packed for the backend) -> model runner
(with LoRA slots, and the `--lora-modules` adapters read) -> a speculative draft model's runner -> KV
pool (measured on CUDA, `--kv-cache-memory` on CPU) -> limits (`max_model_len`, `max_num_seqs`) ->
drafter -> the engine. Every choice made here is logged once; every refusal is a ValueError naming the flag.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable

import torch

from conveyor.kernels import onednn, pack_weights, select_backend
from conveyor.server import capacity
from conveyor.server.config import EngineConfig, GiB, check_prompt_fits_step
from conveyor.server.engine.draft_model import DraftModel
from conveyor.server.engine.engine import LLMEngine
from conveyor.server.engine.lora import SOURCE_FLAG, LoRARegistry
from conveyor.server.engine.speculative import Drafter, measure_step_cost
from conveyor.server.engine.stats import StatsObserver
from conveyor.server.messages import EngineLimits
from conveyor.server.model import loader
from conveyor.server.model.models.llama import ModelShape, check_expert_split
from conveyor.server.model.models.transformers_impl import GenericShape, TransformersForCausalLM
from conveyor.server.model.parallel import partition
from conveyor.server.model.runner import ModelRunner
from conveyor.server.model.worker import Workers

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 4 * GiB
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Makes the engine's observer once the served name and limits are known (`EngineMetrics` fits).
ObserverFactory = Callable[[str, EngineLimits], StatsObserver]


def pick_dtype(name: str, device: torch.device, hf_config=None) -> tuple[torch.dtype, str]:
    """The weight and activation dtype for `--dtype name`, with the reason (logged at start).

    `auto`: on CUDA the model's configured half type (bfloat16 when it names none); on a CPU bfloat16
    only where oneDNN computes it natively (AVX512_BF16 or AMX), float32 elsewhere: on AVX2 bfloat16
    matmuls are emulated and about 2.5x slower than float32.
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


def pick_device(name: str) -> torch.device:
    """`--device name` (`auto`: CUDA when torch finds a device). Raises ValueError for `cuda` without one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch finds no CUDA device")
    return torch.device(name)


def build_engine(config: EngineConfig, make_observer: ObserverFactory | None = None) -> LLMEngine:
    """Load the model `config` names and assemble an engine ready to step.

    make_observer: called with the served model name and the engine's limits, returns the observer
    told of every step, token and finished request (the server passes `EngineMetrics`).

    Raises ValueError (a bad flag, a model that does not fit the KV pool or the parallel size),
    ModelNotFoundError / OSError (a missing model), capacity.InsufficientGPUMemoryError.
    """
    mc, cc, sc = config.model, config.cache, config.scheduler
    device = pick_device(config.device.device)
    # A start that reads a GGUF's blocks (or makes random ones) needs only its config and tokenizer converted.
    source = loader.converted(loader.resolve_model(mc.model), weights=mc.quantization in (None, "int8"))
    hf_config = loader.load_config(source)
    draft = _draft_source(config)  # a missing draft fails before the target loads
    impl = loader.choose_impl(mc.model_impl, hf_config)
    shape = (
        ModelShape.from_hf_config(hf_config) if impl == "native" else GenericShape.from_hf_config(hf_config)
    )
    # What the config and flags decide is checked before anything heavy loads.
    max_model_len = _max_model_len(mc.max_model_len, shape)
    check_prompt_fits_step(sc, max_model_len)  # max_model_len may be the model's own here
    dtype, why = pick_dtype(mc.dtype, device, hf_config)
    backend, ops = select_backend(config.device.attention_backend, device.type)
    logger.info(
        "device %s, dtype %s (%s), kernel backend %s, model implementation %s (--model-impl %s)",
        device,
        dtype,
        why,
        backend,
        impl,
        mc.model_impl,
    )
    loader.check_quantization(
        mc.quantization, source, device, backend, config.parallel.tensor_parallel_size, mc.load_format
    )
    if mc.quantization and impl != "native":
        raise ValueError(
            f"--quantization {mc.quantization} runs conveyor's own decoder: use --model-impl native or auto"
        )
    if impl == "transformers" and config.parallel.tensor_parallel_size > 1:
        raise ValueError("--model-impl transformers runs on one rank: use --tensor-parallel-size 1")
    tokenizer = loader.load_tokenizer(source, mc.load_format, mc.chat_template)
    workers = _start_workers(config, source, shape, dtype, backend, device)
    try:
        tp = workers.tp if workers is not None else None
        if impl == "native":
            model = loader.load_model(
                source,
                hf_config,
                dtype,
                device,
                ops,
                mc.load_format,
                tp,
                mc.quantization,
                config.parallel.enable_expert_parallel,
            )
            weights, weight_bytes = loader.weights_info(model)  # before packing adds kernel layouts
            reuse_large_buffers()  # after the load's big temporaries, before the kernels are timed
            logger.info("%s", pack_weights(model, ops, dtype, device))
        else:  # transformers' linear layers stay as they are (they take batched 3-D inputs)
            dummy = mc.load_format == "dummy"
            model = TransformersForCausalLM.load(source.path, hf_config, dtype, device, ops, dummy)
            weights, weight_bytes = loader.weights_info(model)
            reuse_large_buffers()
        runner = ModelRunner(model, ops, cc.block_size, dtype, device, workers)
        served_model_name = mc.served_model_name or source.default_name
        lora = _lora_registry(config, runner, shape, served_model_name)
        draft_runner = _draft_runner(
            config, draft, shape, tokenizer, max_model_len, dtype, device, backend, ops
        )
        # A draft model's K/V sits in the target's blocks: a pooled token holds both.
        kv_shapes = [shape] + ([draft_runner.model.shape] if draft_runner else [])
        dtype_name, ranks = str(dtype).removeprefix("torch."), tp.size if tp else 1
        kv_parts = [
            capacity.kv_bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, dtype_name, ranks)
            for s in kv_shapes
        ]
        kv_bytes_per_token = sum(kv_parts)
        if cc.kv_cache_memory:
            pool_bytes = cc.kv_cache_memory
        elif device.type == "cuda":
            pool_bytes = runner.profile_kv_pool_bytes(sc.max_num_batched_tokens, cc.gpu_memory_utilization)
        else:
            pool_bytes = DEFAULT_CPU_KV_CACHE_MEMORY
        window, num_sliding = _kv_window_layers(model.shape, draft_runner is not None)
        num_window_blocks = None  # the sliding layers' own pool, where only some layers slide
        if num_sliding and num_sliding < shape.num_layers:
            window_bytes = capacity.kv_bytes_per_token(
                num_sliding, shape.num_kv_heads, shape.head_dim, dtype_name, ranks
            )
            split = (pool_bytes, kv_bytes_per_token - window_bytes, window_bytes, cc.block_size, window)
            fits = capacity.max_num_seqs_for_split_pool(*split, max_model_len, sc.max_num_batched_tokens)
            max_num_seqs = sc.max_num_seqs or fits
            num_blocks, num_window_blocks = capacity.split_kv_pool(
                *split, max_num_seqs, sc.max_num_batched_tokens
            )
        else:
            num_blocks = capacity.num_kv_blocks_for_pool(pool_bytes, kv_bytes_per_token, cc.block_size)
            fits = capacity.max_num_seqs_for_blocks(
                num_blocks, cc.block_size, max_model_len, window, sc.max_num_batched_tokens
            )
            max_num_seqs = sc.max_num_seqs or fits
        pool_tokens = num_blocks * cc.block_size
        if pool_tokens < max_model_len:
            raise ValueError(
                f"the KV cache holds {pool_tokens} tokens ({pool_bytes} bytes at {kv_bytes_per_token} "
                f"bytes/token), fewer than max_model_len {max_model_len}: raise --kv-cache-memory "
                f"(or --gpu-memory-utilization) or lower --max-model-len"
            )
        if max_num_seqs > fits:
            logger.warning(
                "--max-num-seqs %d is more than the %d sequences of max_model_len %d the KV cache holds; "
                "long sequences will be preempted",
                max_num_seqs,
                fits,
                max_model_len,
            )
        logger.info(
            "KV cache: %d blocks of %d tokens%s (%.2f GiB, %d bytes/token%s); %d sequences of "
            "max_model_len %d fit; max_num_seqs %d",
            num_blocks,
            cc.block_size,
            f" for the global layers, {num_window_blocks} for the {num_sliding} sliding layers "
            f"(window {window})"
            if num_window_blocks is not None
            else (f", given back behind every layer's window of {window}" if window else ""),
            pool_bytes / GiB,
            kv_bytes_per_token,
            f": {kv_parts[0]} the model's + {kv_parts[1]} the draft model's" if draft_runner else "",
            fits,
            max_model_len,
            max_num_seqs,
        )
        runner.allocate_kv_cache(num_blocks, num_window_blocks)
        drafter = _drafter(config, runner, draft_runner, num_blocks)
        limits = EngineLimits(
            cc.block_size,
            num_blocks,
            max_num_seqs,
            sc.max_num_batched_tokens,
            max_model_len,
            mc.quantization or "none",
            weights,
            weight_bytes,
            *_experts(model),
            max_loras=config.lora.max_loras if lora is not None else 0,
            num_speculative_tokens=drafter.num_speculative_tokens if drafter is not None else 0,
            sliding_window=window,
            num_window_blocks=num_window_blocks or 0,
        )
        release_freed_memory()
        return LLMEngine(
            config,
            tokenizer,
            runner,
            limits,
            served_model_name=served_model_name,
            kv_pool_bytes=pool_bytes,
            kv_bytes_per_token=kv_bytes_per_token,
            observer=make_observer(served_model_name, limits) if make_observer is not None else None,
            lora=lora,
            drafter=drafter,
        )
    except BaseException:
        if workers is not None:
            workers.shutdown()
        raise


def _lora_registry(config: EngineConfig, runner: ModelRunner, shape, base_name: str) -> LoRARegistry | None:
    """With --enable-lora: the runner's adapter slots, and the registry with the `--lora-modules`
    adapters read and `--lora-modules-file`'s loaded and watched (None without it); no adapter may
    take `base_name`, the served model's name. Raises ValueError (LoRAError) naming the adapter that cannot be
    served, or the flag where LoRA does not run."""
    lc = config.lora
    if not lc.enable_lora:
        return None
    slots = runner.enable_lora(lc.max_loras, lc.max_lora_rank)
    logger.info(
        "LoRA: --max-loras %d slots of --max-lora-rank %d (%.1f MiB); --max-cpu-loras %d",
        lc.max_loras,
        lc.max_lora_rank,
        slots.num_bytes / (1 << 20),
        lc.cpu_loras,
    )
    registry = LoRARegistry(lc, shape, base_name)
    for module in lc.modules:
        registry.add(module.name, module.path, SOURCE_FLAG)
    if lc.lora_modules_file:
        registry.watch(lc.lora_modules_file)
    return registry


def _draft_source(config: EngineConfig) -> tuple[loader.ModelSource, object] | None:
    """The draft model `--speculative-config` names, found (converted from a GGUF as `--model` is), and
    its transformers config; None without one. Raises ModelNotFoundError naming the key."""
    method = config.speculative.method
    if method is None or method.method != "draft_model":
        return None
    try:
        source = loader.converted(
            loader.resolve_model(method.model), weights=method.quantization in (None, "int8")
        )
        hf_config = loader.load_config(source)
    except OSError as exc:  # ModelNotFoundError, or a hub id that cannot be fetched
        raise loader.ModelNotFoundError(f"--speculative-config model: {exc}") from None
    return source, hf_config


def _draft_runner(
    config: EngineConfig,
    draft: tuple[loader.ModelSource, object] | None,
    shape: ModelShape | GenericShape,
    tokenizer,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: str,
    ops,
) -> ModelRunner | None:
    """With `--speculative-config` naming a draft model: its runner (weights loaded with the target's
    dtype, kernel backend and `--load-format`, quantized as its `quantization` key says, no KV cache
    yet); None otherwise. Raises ValueError naming the key when the draft cannot serve this target: not
    conveyor's own decoder, another vocabulary, fewer positions than max_model_len, or a quantization
    this start cannot serve."""
    method = config.speculative.method
    if draft is None:
        return None
    source, hf_config = draft
    mc = config.model
    try:
        loader.check_quantization(method.quantization, source, device, backend, 1, mc.load_format)
    except ValueError as exc:
        raise ValueError(f"--speculative-config quantization: {exc}") from None
    try:
        loader.choose_impl("native", hf_config)
    except ValueError as exc:
        raise ValueError(f"--speculative-config model: {exc}") from None
    draft_shape = ModelShape.from_hf_config(hf_config)
    draft_vocab = loader.load_tokenizer(source, mc.load_format).get_vocab()
    if draft_shape.vocab_size != shape.vocab_size or draft_vocab != tokenizer.get_vocab():
        raise ValueError(
            f"--speculative-config model {method.model!r} has another vocabulary than the target "
            f"({draft_shape.vocab_size} vs {shape.vocab_size} ids, or other tokens): a draft model must "
            "share the target's tokenizer"
        )
    if draft_shape.position_limit < max_model_len:
        raise ValueError(
            f"--speculative-config model {method.model!r} has {draft_shape.position_limit} "
            f"positions, fewer than max_model_len {max_model_len}: lower --max-model-len"
        )
    draft = loader.load_model(
        source, hf_config, dtype, device, ops, mc.load_format, None, method.quantization
    )
    _, weight_bytes = loader.weights_info(draft)
    logger.info(
        "draft model %s: %.1f MiB of weights; %s",
        method.model,
        weight_bytes / (1 << 20),
        pack_weights(draft, ops, dtype, device),
    )
    return ModelRunner(draft, ops, config.cache.block_size, dtype, device)


def _drafter(
    config: EngineConfig, runner: ModelRunner, draft_runner: ModelRunner | None, num_blocks: int
) -> Drafter | None:
    """With --speculative-config: the drafter, with the step costs it sizes drafts by measured on this
    machine (a few forwards over the just-allocated KV cache) unless `disable_by_batch_size` is set.
    A draft model's KV cache is allocated here (`num_blocks`, the target's) and its forwards timed."""
    method = config.speculative.method
    if method is None:
        return None
    num_tokens = min(64, num_blocks * config.cache.block_size)
    draft_model = None
    if draft_runner is not None:
        draft_runner.allocate_kv_cache(num_blocks)
        draft_model = DraftModel(draft_runner, measure_step_cost(draft_runner.profile, num_tokens=num_tokens))
    step_cost = None
    if method.disable_by_batch_size is None:
        step_cost = measure_step_cost(runner.profile, num_tokens=num_tokens)
    costs = f"drafts while at most {method.disable_by_batch_size} requests run or wait"
    if step_cost is not None:
        costs = f"a step costs {step_cost.fixed * 1e3:.2f} ms + {step_cost.per_token * 1e3:.3f} ms per token"
        if draft_model is not None:
            cost = draft_model.cost
            costs += f"; a draft forward {cost.fixed * 1e3:.2f} ms + {cost.per_token * 1e3:.3f} ms per token"
    logger.info(
        "speculative decoding: %s, up to %d draft tokens; %s",
        method.method,
        method.num_speculative_tokens,
        costs,
    )
    return Drafter(method, step_cost, draft_model)


# glibc's mallopt parameters (malloc.h) and the sizes conveyor sets them to.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_ALLOCATION_LIMIT = 1 << 30


def reuse_large_buffers() -> None:
    """Let glibc's malloc serve allocations of up to 1 GiB from its heap, and keep up to 1 GiB of freed
    heap instead of handing it back (`mallopt` M_MMAP_THRESHOLD and M_TRIM_THRESHOLD). By default an
    allocation over 32 MiB is a fresh `mmap` whose pages the kernel zeroes on first touch, every time:
    a step's logits of a 262k-token vocabulary at 64 rows (64 MiB in float32, allocated twice a step)
    cost about 25 ms each that way, 3 ms from reused memory, and Gemma 3 270M's decode step at 64
    sequences went from 213 to 151 ms on a 2-core AVX-512 machine. vLLM's CPU guide preloads tcmalloc
    for the same reason. Set once the model is loaded: while it loads, a freed temporary over 32 MiB
    (a layer's float values on their way to int8 blocks) goes straight back to the OS, where the heap
    would keep it and grow (an int8 Llama-3.2-1B with dummy weights peaked at 4.6 GB resident with the
    heap's limits from the start, 2.2 GB without). Process-wide; does nothing where libc has no `mallopt`."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, HEAP_ALLOCATION_LIMIT)
        libc.mallopt(_M_TRIM_THRESHOLD, HEAP_ALLOCATION_LIMIT)


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`). Loading frees a lot in
    pieces glibc keeps: the float layers a quantized model replaced, a GGUF conversion's buffers, the
    kernel selection's timing tensors (about 280 MB for the embedded model with `--quantization gguf`),
    which would otherwise stay in the resident set. Does nothing where libc has no `malloc_trim`."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _kv_window_layers(shape: ModelShape | GenericShape, draft_model: bool) -> tuple[int | None, int]:
    """(the window the KV cache gives blocks back behind, how many layers slide): the model's, for a
    native decoder with sliding layers; (None, 0) otherwise (transformers' own model, and a draft model,
    which reads the same blocks, keep all)."""
    sliding = getattr(shape, "sliding_layers", ())
    if not any(sliding) or draft_model:
        return None, 0
    return shape.sliding_window, sum(sliding)


def _max_model_len(flag: int | None, shape: ModelShape | GenericShape) -> int:
    """`--max-model-len` checked against the model's positions, or the model's own limit when not
    given. Raises ValueError naming the flag."""
    limit = shape.position_limit
    if flag is not None and flag > limit:
        raise ValueError(
            f"--max-model-len {flag} exceeds the model's {limit} positions (max_position_embeddings "
            f"{shape.max_position_embeddings}, times the factor of dynamic rope scaling)"
            if limit != shape.max_position_embeddings
            else f"--max-model-len {flag} exceeds the model's max_position_embeddings {limit}"
        )
    return flag or limit


def _start_workers(
    config: EngineConfig, source, shape: ModelShape, dtype: torch.dtype, backend: str, device: torch.device
) -> Workers | None:
    """The other ranks of a tensor-parallel replica (None at --tensor-parallel-size 1), started after
    checking that the size splits the model. Raises ValueError naming both numbers."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return None
    partition(shape.num_heads, shape.num_kv_heads, shape.intermediate_size, shape.vocab_size, 0, size)
    check_expert_split(shape, size, config.parallel.enable_expert_parallel)
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"--tensor-parallel-size {size} needs {size} CUDA devices; torch finds {torch.cuda.device_count()}"
        )
    rank_config = {
        "source": source,
        "dtype": dtype,
        "device_type": device.type,
        "backend": backend,
        "load_format": config.model.load_format,
        "block_size": config.cache.block_size,
        "expert_parallel": config.parallel.enable_expert_parallel,
    }
    return Workers(rank_config, size, device)


def _experts(model) -> tuple[int, tuple[int, ...]]:
    """(experts per sparse layer, indexes of the sparse layers) of a mixture-of-experts model; (0, ())
    otherwise."""
    shape = model.shape
    if not getattr(shape, "num_experts", 0):
        return 0, ()
    return shape.num_experts, tuple(i for i, sparse in enumerate(shape.moe_layers) if sparse)
