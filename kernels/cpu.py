"""C++ kernels for CPUs: the `cpu` backend, with the signatures of `conveyor.kernels.reference`.

The reference is many small torch ops per kernel; at decode batch sizes each costs microseconds of
dispatch plus an intermediate tensor, and its paged decode attention copies every sequence's K and V
before reading them. `csrc/cpu_kernels.cpp` does each kernel in one pass: RMSNorm (with the residual
add fused), rotary embedding, SiLU-and-mul, the KV cache write, and paged decode attention that reads
K/V straight from the blocks with float32 scores and softmax (as vLLM's CPU and CUDA paged-attention
kernels). Rows of prefill and chunked-prefill sequences go through `csrc/attention.cpp`: a
flash-attention kernel on AVX512_BF16's dot products in bfloat16, torch's flash-attention kernel for
CPU otherwise (and the reference's `prefill_attention` with a sliding window or a soft cap).

The library is compiled with the machine's C++ compiler the first time it is needed (20-70 s on
2 cores; `torch.utils.cpp_extension`, `-O3 -march=native`) and cached under `TORCH_EXTENSIONS_DIR`
(default `~/.cache/torch_extensions`); later starts load the cached build in well under a second.
Results match the reference to the dtype's rounding: intermediates are rounded to the tensor dtype
where the reference rounds them, and the attention accumulates in float32.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, reference
from conveyor.kernels.reference import check_window_and_soft_cap, prefill_attention

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / name
    for name in (
        "cpu_kernels.cpp",
        "linear.cpp",
        "quant.cpp",
        "decoder.cpp",
        "moe.cpp",
        "lora.cpp",
        "attention.cpp",
    )
)
EXTENSION_NAME = "conveyor_cpu_kernels"
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp")
# Set (to anything but "" or "0") to build the kernels without AVX-512 on a CPU that has it, as vLLM's
# VLLM_CPU_DISABLE_AVX512 does for its CPU build: the AVX2 path, measured on an AVX-512 machine.
DISABLE_AVX512_ENV = "CONVEYOR_CPU_DISABLE_AVX512"


def avx512_disabled() -> bool:
    """True when CONVEYOR_CPU_DISABLE_AVX512 asks for the kernels' AVX2 build."""
    return os.environ.get(DISABLE_AVX512_ENV, "") not in ("", "0")


def compile_flags() -> list[str]:
    """The compiler flags of this process's build: COMPILE_FLAGS, with every AVX-512 extension turned
    off (`-mno-avx512f`) when CONVEYOR_CPU_DISABLE_AVX512 is set."""
    return [*COMPILE_FLAGS, *(["-mno-avx512f"] if avx512_disabled() else [])]


class CPUKernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded (no C++ compiler, no ninja, a compiler error)."""


_lock = threading.Lock()
_loaded = False
_error: CPUKernelBuildError | None = None


def _build_name() -> str:
    """The extension's name, one per CPU type and ISA choice: `-march=native` code built on one CPU may
    not run on another, so a `~/.cache` shared by different machines keeps one build for each, and the
    AVX2 build of an AVX-512 machine (CONVEYOR_CPU_DISABLE_AVX512) has its own."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), flags)
    except OSError:
        pass
    suffix = "_noavx512" if avx512_disabled() else ""
    return f"{EXTENSION_NAME}_{hashlib.sha256(flags.encode()).hexdigest()[:10]}{suffix}"


def _build_failure(exc: BaseException) -> str:
    """The compiler's own words from a failed build. ninja echoes each compiler command (after `[i/n]`,
    and again after `FAILED: target`); the message is what follows the failed command's echo."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    failed = [i for i, line in enumerate(lines) if line.startswith("FAILED:")]
    if failed:
        lines = lines[failed[-1] + 2 :]
    lines = [line for line in lines if not line.startswith("[")]
    return " | ".join(lines[-6:])


def load_library() -> None:
    """Compile (first time on a machine) and load the kernels; idempotent and thread-safe.

    Raises CPUKernelBuildError naming the cause (no C++ compiler, the compiler's message) when the
    build fails, also on later calls, without retrying.
    """
    global _loaded, _error
    with _lock:
        if _loaded:
            return
        if _error is not None:
            raise _error
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            _error = CPUKernelBuildError(
                f"no C++ compiler to build the CPU kernels: {compiler!r} was not found "
                "(install g++, or set CXX)"
            )
            raise _error
        from torch.utils import cpp_extension

        # The `ninja` wheel puts its binary next to this interpreter, which need not be on PATH.
        scripts = sysconfig.get_path("scripts")
        if shutil.which("ninja") is None and os.path.exists(os.path.join(scripts, "ninja")):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
        logger.info(
            "loading the C++ CPU kernels (the first start on a machine compiles them, 20-70 s on 2 cores)"
        )
        start = time.perf_counter()
        try:
            cpp_extension.load(
                name=_build_name(),
                sources=[str(source) for source in SOURCES],
                extra_cflags=compile_flags(),
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as exc:
            names = ", ".join(source.name for source in SOURCES)
            _error = CPUKernelBuildError(
                f"building the C++ CPU kernels ({names}) failed: {_build_failure(exc)}"
            )
            raise _error from exc
        isa = torch.ops.conveyor_linear.isa()
        why = f" ({DISABLE_AVX512_ENV} is set)" if avx512_disabled() else ""
        logger.info("C++ CPU kernels ready in %.1f s, vector ISA %s%s", time.perf_counter() - start, isa, why)
        _loaded = True


def is_available() -> bool:
    """True when the kernels are built and loaded (builds them on first call); logs why not otherwise."""
    try:
        load_library()
    except CPUKernelBuildError as exc:
        logger.warning("%s; using the torch reference kernels on CPU", exc)
        return False
    return True


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See `conveyor.kernels.reference.reshape_and_cache`. Raises RuntimeError for a slot past the cache."""
    torch.ops.conveyor_cpu.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


# Sequences with at most this many query rows (draft tokens being verified, a short chunk) run through
# the decode kernel, one row at a time against the keys before it: gathering a long context's K/V into a
# contiguous copy per sequence and layer, as `prefill_attention` does, cost 2.7x the step time at 16
# sequences verifying one draft token each.
MAX_DECODE_KERNEL_QUERY_LEN = 16


@dataclass(frozen=True)
class MixedStep:
    """The host-side split of a step with prefill rows (`prepare_metadata`), the same for every layer.

    decode_rows: `[D]` int64 the query rows the decode kernel computes: every row of the sequences with
    at most MAX_DECODE_KERNEL_QUERY_LEN; decode_tables: `[D, max_blocks]` int32 each row's sequence's
    block table; decode_lens: `[D]` int32 the keys each row sees (its position + 1). q_lens, starts,
    seq_lens: per sequence, Python ints, for `prefill_attention`, with the sequences the decode kernel
    computes given q_len 1 (which it skips).
    """

    decode_rows: torch.Tensor
    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    q_lens: list[int]
    starts: list[int]
    seq_lens: list[int]


def prepare_metadata(
    meta: AttentionMetadata,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor | None,
    block_size: int,
    num_kv_heads: int,
) -> MixedStep | None:
    """See `conveyor.kernels.reference.prepare_metadata`. A step of decodes only needs nothing (None):
    the C++ kernels read the metadata tensors directly; a step with prefill rows gets its `MixedStep`
    (the one host sync of the step)."""
    if meta.max_query_len == 1:
        return None
    return _mixed_step(meta.query_start_loc, meta.seq_lens, meta.block_tables)


def _mixed_step(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor
) -> MixedStep:
    starts = query_start_loc[:-1].tolist()
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    lens = seq_lens.tolist()
    seqs, rows, row_lens = [], [], []
    for b, (start, q_len, seq_len) in enumerate(zip(starts, q_lens, lens, strict=True)):
        if q_len <= MAX_DECODE_KERNEL_QUERY_LEN:
            seqs += [b] * q_len
            rows += range(start, start + q_len)
            row_lens += range(seq_len - q_len + 1, seq_len + 1)
    short = [1 if q <= MAX_DECODE_KERNEL_QUERY_LEN else q for q in q_lens]
    return MixedStep(
        torch.tensor(rows, dtype=torch.long),
        block_tables[seqs],
        torch.tensor(row_lens, dtype=torch.int32),
        short,
        starts,
        lens,
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    prepared: MixedStep | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """See `conveyor.kernels.reference.paged_attention`: same arguments, layouts and result.

    Decode rows (one query token), and each row of a sequence with at most MAX_DECODE_KERNEL_QUERY_LEN
    (draft tokens, a short chunk) against the keys up to its own position, use the C++ kernel, which
    with a sliding window starts its walk at the window's first key; a step of decodes only needs no
    host sync. Longer prefill rows run `csrc/attention.cpp`: in bfloat16 with AVX512_BF16 (and a
    head_dim that is a multiple of 32) a flash-attention kernel on `vdpbf16ps`, the same on AMX tiles,
    or torch's flash-attention kernel for CPU per sequence, whichever was measured fastest at the
    sequence's query rows (`selection.select_prefill_attention`), otherwise torch's. 9 query heads over
    3 KV heads of head_dim 64, causal, one sequence: on a 2-core AVX512_BF16 EPYC 3.8 ms a layer at
    1,024 tokens against torch's 10.0 (320 against 120 GFLOP/s), 61.7 ms at 4,096 against 121.0; on a
    2-core Xeon with AMX the AMX kernel 2.0 ms at 1,024 and 26.4 at 4,096, torch's 3.6 and 40.6 (it
    reaches AMX through oneDNN), the `vdpbf16ps` kernel 10.4 and 150. With a sliding window or a soft cap they run the
    reference's `prefill_attention`, which gathers no block before the chunk's first window; a window at
    least `max_seq_len` long cuts nothing and is dropped first (Gemma 3's 512-token local layers on
    shorter sequences take the fast kernels).
    """
    check_window_and_soft_cap(sliding_window, logits_soft_cap)
    if sliding_window is not None and sliding_window >= max_seq_len:
        sliding_window = None
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    options = (scale, sliding_window, logits_soft_cap)
    if max_query_len == 1:
        torch.ops.conveyor_cpu.paged_decode_attention(
            out, query, key_cache, value_cache, block_tables, seq_lens, None, None, *options
        )
        return out
    step = prepared if prepared is not None else _mixed_step(query_start_loc, seq_lens, block_tables)
    if step.decode_rows.numel():
        rows = step.decode_rows
        torch.ops.conveyor_cpu.paged_decode_attention(
            out, query, key_cache, value_cache, step.decode_tables, step.decode_lens,
            torch.arange(len(rows)), rows, *options,
        )  # fmt: skip
    if sliding_window is None and logits_soft_cap is None:
        torch.ops.conveyor_attention.prefill_attention(
            out, query, key_cache, value_cache, block_tables, step.q_lens, step.starts, step.seq_lens, scale
        )
    else:
        prefill_attention(
            out,
            query,
            key_cache,
            value_cache,
            block_tables,
            step.q_lens,
            step.starts,
            step.seq_lens,
            *options,
        )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See `conveyor.kernels.reference.rms_norm`."""
    return torch.ops.conveyor_cpu.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `conveyor.kernels.reference.fused_add_rms_norm`."""
    return torch.ops.conveyor_cpu.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    prepared: MixedStep | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `conveyor.kernels.reference.rotary_embedding` (`prepared` is not needed: the kernel indexes
    the table itself). Raises RuntimeError for a position outside the table."""
    return torch.ops.conveyor_cpu.rotary_embedding(positions, query, key, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See `conveyor.kernels.reference.silu_and_mul`."""
    return torch.ops.conveyor_cpu.silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See `conveyor.kernels.reference.gelu_tanh_and_mul`."""
    return torch.ops.conveyor_cpu.gelu_tanh_and_mul(x)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """See `conveyor.kernels.reference.fused_moe`: `csrc/moe.cpp` (pairs sorted by expert, each active
    expert's weights streamed once for its tokens, threads over experts and rows) for float32 and
    bfloat16; the reference for other dtypes."""
    if hidden.dtype not in (torch.float32, torch.bfloat16):
        return reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    return torch.ops.conveyor_moe.fused_moe(hidden, w13, w2, topk_weights, topk_ids)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
    output_slices: tuple[int, ...] | None = None,
    slot_ranks: list[int] | None = None,
) -> torch.Tensor:
    """See `conveyor.kernels.reference.add_lora`: `csrc/lora.cpp` (rows sorted by adapter, each active
    adapter's A and B streamed once for its rows up to its slot's rank, threads over adapters and rows or
    columns) for float32 and bfloat16; the reference for other dtypes."""
    if y.dtype not in (torch.float32, torch.bfloat16) or not y.is_contiguous():
        return reference.add_lora(y, x, lora_a, lora_b, indices, output_slices, slot_ranks)
    slices = list(output_slices or (y.shape[1],))
    return torch.ops.conveyor_lora.add_lora(y, x, lora_a, lora_b, indices, slices, list(slot_ranks or ()))


class CPULinear(nn.Module):
    """`y = x @ weight.T + bias` through the C++ backend's panel kernel (`csrc/linear.cpp`).

    A float32 weight is laid out once in panels of 32 columns (16 without AVX-512), in float32, or in
    bfloat16 when bfloat16 holds every value exactly (`bf16_exact`; a checkpoint saved in bfloat16):
    the same values at half the bytes a decode step reads; x: `[num_tokens, in_features]` float32 ->
    `[num_tokens, out_features]` float32. A bfloat16 weight (a model held in bfloat16) is laid out in
    panels of row pairs for AVX512_BF16's dot product (`bf16_matmul_supported`); x and the result are
    bfloat16, each output rounded once from float32 sums, as oneDNN's bfloat16 matmul. Only the order
    of the sums differs from a BLAS. The packed weight has no `state_dict` entry; build the module
    after the weights are final (see `conveyor.kernels.selection`). Raises RuntimeError for other dtypes.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.activation_dtype = weight.dtype
        if weight.dtype == torch.bfloat16:
            self.weight_dtype = torch.bfloat16
            self.packed_weight = torch.ops.conveyor_linear.pack_weight_bf16(weight)
        else:
            self.weight_dtype = torch.bfloat16 if bf16_exact(weight) else torch.float32
            self.packed_weight = torch.ops.conveyor_linear.pack_weight(
                weight, self.weight_dtype == torch.bfloat16
            )
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.conveyor_linear.linear(x, self.packed_weight, self.bias, self.out_features)

    def extra_repr(self) -> str:
        weight = str(self.weight_dtype).removeprefix("torch.")
        x = str(self.activation_dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={weight}, x={x}"


def bf16_exact(weight: torch.Tensor) -> bool:
    """True when every value of a float32 `weight` is a bfloat16 value (a round trip changes nothing)."""
    return weight.dtype == torch.float32 and torch.equal(weight, weight.to(torch.bfloat16).float())


def bf16_matmul_supported() -> bool:
    """True when the library was built with AVX512_BF16's dot product, so bfloat16 matmuls run in its
    panel kernel (elsewhere oneDNN's packed layers do them). Raises CPUKernelBuildError when the library
    cannot be built."""
    load_library()
    return bool(torch.ops.conveyor_linear.bf16_dot())


# The kinds of linear layer the layer loop calls (csrc/decoder.cpp's LinearKind); a quantized layer's
# kind is LINEAR_QUANT + its method (csrc/quant.cpp's Method).
LINEAR_PLAIN, LINEAR_ONEDNN, LINEAR_PANEL, LINEAR_QUANT = 0, 1, 2, 3


def linear_kind(module: nn.Module, rows: int) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """(weight, bias, kind, out_features) of a linear layer as `decoder_layers` takes it for a step of
    `rows` rows: an `nn.Linear`, a oneDNN `PackedLinear`, a `CPULinear`, a `quant.QuantizedLinear`, or
    the one of those a `selection.SelectedLinear` runs at that row count. Raises TypeError for anything
    else."""
    from conveyor.kernels.onednn import PackedLinear
    from conveyor.kernels.quant import METHODS, QuantizedLinear
    from conveyor.kernels.selection import SelectedLinear

    if isinstance(module, SelectedLinear):
        module = module.kernel_for(rows)
    if isinstance(module, QuantizedLinear):
        bias = None if module.bias is None else module.bias.detach()
        return module.packed, bias, LINEAR_QUANT + METHODS[module.method], module.out_features
    if isinstance(module, CPULinear):
        return module.packed_weight, module.bias, LINEAR_PANEL, module.out_features
    if isinstance(module, PackedLinear):
        return module.packed_weight, module.bias, LINEAR_ONEDNN, module.out_features
    if type(module) is nn.Linear:
        bias = None if module.bias is None else module.bias.detach()
        return module.weight.detach(), bias, LINEAR_PLAIN, module.out_features
    raise TypeError(f"the layer loop cannot call a {type(module).__name__} as a linear layer")


@dataclass(frozen=True)
class DecoderSpec:
    """A decoder as the C++ layer loop takes it (a model's `decoder_spec()`), weights by reference.

    norm_weights: per layer the input and post-attention RMSNorm weights, and with `norms_per_layer` 4
    (Gemma 2/3's sandwich norms) the pre- and post-feedforward ones, then the final norm's
    (`norms_per_layer * num_layers + 1`; Gemma's `1 + w` folded in at load). qk_norm_weights: per layer
    the per-head q and k norms (Qwen3, Gemma 3), or empty. linears: per layer q/k/v, o, gate/up and
    down (`4 * num_layers`, see `linear_kind`). scale: the attention scale. sliding_windows: per layer
    the tokens it attends to, 0 for all; sliding layers rotate with `local_cos_sin_cache` where there is
    one. logits_soft_cap: attention scores become `cap * tanh(s / cap)`. residual_multiplier: Granite's
    factor on each branch. activation: the gated MLP's, `silu` or `gelu_tanh`.
    """

    norm_weights: list[torch.Tensor]
    norms_per_layer: int
    qk_norm_weights: list[torch.Tensor]
    linears: list[nn.Module]
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float
    sliding_windows: list[int]
    local_cos_sin_cache: torch.Tensor | None = None
    logits_soft_cap: float | None = None
    residual_multiplier: float = 1.0
    activation: str = "silu"


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # csrc/decoder.cpp's Activation


class DecoderLayers:
    """A decoder's whole layer loop for one step as one C++ call (`csrc/decoder.cpp`): the same kernels
    in the same order as the model's Python layers, without a Python dispatch per op.

    Built once from a `DecoderSpec` after the weights are final (packed); holds references, not copies.
    Where a layer's kernel depends on the step's row count (`selection.SelectedLinear`), each range of
    row counts gets its own list of kernels, made on first use. Steps with prefill rows of a model with
    sliding windows or soft caps are not its to run (`runs`). Raises TypeError for a linear layer it
    cannot call, ValueError for an activation it does not compute.
    """

    def __init__(self, spec: DecoderSpec) -> None:
        from conveyor.kernels.selection import SelectedLinear

        load_library()
        if spec.activation not in ACTIVATIONS:
            raise ValueError(f"the layer loop computes {sorted(ACTIVATIONS)}, not {spec.activation!r}")
        self.spec = spec
        self.linears = spec.linears
        self.norm_weights = [w.detach() for w in spec.norm_weights]
        self.qk_norm_weights = [w.detach() for w in spec.qk_norm_weights]
        # Masked and soft-capped prefill attention is the reference's; the C++ loop runs such models'
        # steps whose rows all go through the decode kernel (decodes, draft tokens, short chunks), and
        # with windows but no soft cap the steps whose sequences are all within the narrowest window.
        self.min_window = min((w for w in spec.sliding_windows if w), default=None)
        # Row counts where some layer changes kernel: the steps between two of them share one list.
        self._bounds = sorted(
            {first for m in spec.linears if isinstance(m, SelectedLinear) for first, _ in m.dispatch.ranges}
            | {1}
        )
        self._parts: dict[int, tuple[list, list, list, list]] = {}
        self._linears_for(1)  # a layer the loop cannot call is refused here, not at the first step

    def runs(self, max_query_len: int, max_seq_len: int) -> bool:
        """True when a step whose longest query has `max_query_len` rows and longest sequence
        `max_seq_len` tokens runs here (else the Python layers run it): a window at least that long
        cuts nothing."""
        if max_query_len <= MAX_DECODE_KERNEL_QUERY_LEN:
            return True
        if self.spec.logits_soft_cap is not None:
            return False
        return self.min_window is None or max_seq_len <= self.min_window

    def _linears_for(self, rows: int) -> tuple[list, list, list, list]:
        """(weights, biases, kinds, out_features) of every linear layer for a step of `rows` rows."""
        first = self._bounds[max(0, bisect.bisect_right(self._bounds, rows) - 1)]
        if first not in self._parts:
            parts = [linear_kind(module, first) for module in self.linears]
            self._parts[first] = tuple([p[i] for p in parts] for i in range(4))  # type: ignore[assignment]
        return self._parts[first]

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora: tuple[list[torch.Tensor], list[torch.Tensor], list[int], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """hidden: `[num_tokens, hidden_size]` embedded tokens -> the final norm's output, same shape and
        dtype. meta: the step's `AttentionMetadata` (its `window`, if any, for the sliding layers' own
        blocks; `prepared` unused). lora: (lora_a, lora_b, slot ranks,
        indices) of the step's adapters: per layer the slots of q/k/v, o, gate/up and down (`add_lora`'s
        layouts), every projection's slot ranks one after another (0: not adapted), and each token's slot
        (-1: the base model); None when no token has an adapter."""
        weights, biases, kinds, out_features = self._linears_for(hidden.shape[0])
        spec = self.spec
        return torch.ops.conveyor_decoder.decoder_layers(
            hidden,
            positions,
            cos_sin_cache,
            spec.local_cos_sin_cache,
            self.norm_weights,
            spec.norms_per_layer,
            self.qk_norm_weights,
            weights,
            biases,
            kinds,
            out_features,
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            meta.slot_mapping,
            meta.block_tables,
            None if meta.window is None else meta.window.slot_mapping,
            None if meta.window is None else meta.window.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            spec.num_heads,
            spec.num_kv_heads,
            spec.eps,
            spec.scale,
            spec.sliding_windows,
            spec.logits_soft_cap,
            spec.residual_multiplier,
            ACTIVATIONS[spec.activation],
            *(lora or ([], [], [], None)),
        )
