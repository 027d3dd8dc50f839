"""Kernels for the model's hot paths. Three backends with identical signatures:

- `torch`: `conveyor.kernels.reference`, plain torch; the contract, and the CPU path when the C++
  kernels cannot be built.
- `cpu`: `conveyor.kernels.cpu`, C++ kernels for CPUs compiled on first use (needs a C++ compiler).
- `triton`: `conveyor.kernels.triton`, Triton kernels for CUDA (on CPU only under `TRITON_INTERPRET=1`).

The model runner builds each step's `AttentionMetadata` once and has the backend's `prepare_metadata`
derive from it what the kernels need on the host (splits, gather indices, rotary rows); every layer then
passes that one object back to `paged_attention` and `rotary_embedding`.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

KERNEL_NAMES = (
    "prepare_metadata",
    "reshape_and_cache",
    "paged_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "fused_moe",
    "add_lora",
)
BACKENDS = {
    "torch": "conveyor.kernels.reference",
    "cpu": "conveyor.kernels.cpu",
    "triton": "conveyor.kernels.triton",
}


@dataclass(frozen=True)
class AttentionMetadata:
    """Where one step's tokens sit in the paged KV cache (layouts in `conveyor.kernels.reference`),
    built by the model runner once per step and read by every layer.

    slot_mapping: `[num_tokens]` int64; block_tables: `[num_seqs, max_blocks]` int32;
    query_start_loc: `[num_seqs + 1]` int32; seq_lens: `[num_seqs]` int32; max_query_len and
    max_seq_len: Python ints. prepared: what the kernel backend derives from these once per step
    (`KernelBackend.prepare_metadata`: host-side splits, gather indices, masks, rotary tables), passed
    back to its kernels by every layer, as vLLM's attention-metadata builders do; None makes each kernel
    call derive what it needs itself. window: where a model's sliding layers keep their K/V in blocks
    of their own (`KVCacheManager`'s window pool), their slot mapping and block tables (the same
    sequences and lengths), which those layers read instead; None: every layer reads these.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    prepared: Any = None
    window: AttentionMetadata | None = None


class KernelBackend(Protocol):
    """What every backend module provides; `conveyor.kernels.reference` documents shapes and dtypes.

    `paged_attention`'s `sliding_window` (attend to the last W positions only) and `logits_soft_cap`
    (scores become `cap * tanh(score / cap)`) are per layer, so they are arguments of the call, not of
    `prepare_metadata`, whose result every layer of a step shares.
    """

    def prepare_metadata(
        self,
        meta: AttentionMetadata,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor | None,
        block_size: int,
        num_kv_heads: int,
    ) -> Any: ...

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        max_query_len: int,
        max_seq_len: int,
        prepared: Any = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        prepared: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def fused_moe(
        self,
        hidden: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor: ...

    def add_lora(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        indices: torch.Tensor,
        output_slices: tuple[int, ...] | None = None,
        slot_ranks: list[int] | None = None,
    ) -> torch.Tensor: ...


def default_backend(device_type: str) -> str:
    """`triton` on CUDA; on CPU `cpu` when its C++ kernels build here (first call compiles them, about
    15 s once per machine), else `torch` (the reason is logged)."""
    if device_type == "cuda":
        return "triton"
    from conveyor.kernels import cpu

    return "cpu" if cpu.is_available() else "torch"


def load_backend(name: str) -> KernelBackend:
    """The module providing every name in KERNEL_NAMES for backend `name` (`torch`, `cpu` or `triton`).

    Raises ValueError for an unknown name; `cpu.CPUKernelBuildError` when the C++ kernels cannot be built.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {sorted(BACKENDS)}")
    module = importlib.import_module(BACKENDS[name])
    if name == "cpu":
        module.load_library()
    return cast(KernelBackend, module)


def select_backend(name: str, device_type: str) -> tuple[str, KernelBackend]:
    """The one place a backend is chosen and checked: `--attention-backend name` (`auto` resolves with
    `default_backend`) on `device_type` (`cpu` or `cuda`). Returns (resolved name, backend).

    Raises ValueError naming the flag when the backend cannot run on the device (triton without CUDA,
    unless `TRITON_INTERPRET=1`; cpu on CUDA tensors) or the C++ kernels cannot be built.
    """
    from conveyor.kernels.cpu import CPUKernelBuildError

    resolved = default_backend(device_type) if name == "auto" else name
    if resolved == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "--attention-backend triton needs CUDA; on CPU it runs only under Triton's interpreter "
            "(set TRITON_INTERPRET=1 before starting)"
        )
    if resolved == "cpu" and device_type != "cpu":
        raise ValueError("--attention-backend cpu runs on CPU tensors; use triton or torch on CUDA")
    try:
        return resolved, load_backend(resolved)
    except CPUKernelBuildError as exc:
        raise ValueError(f"--attention-backend cpu: {exc}; or use --attention-backend torch") from exc


def pack_weights(
    model: torch.nn.Module, backend: KernelBackend, dtype: torch.dtype, device: torch.device
) -> str:
    """Lay out `model`'s linear weights once for the matmuls that will run them, in place, after the
    weights are final (loaded, cast, sharded). Returns what was done, for the start-up log.

    On a CPU in float32 or bfloat16 each layer gets the kernels `selection.select_linear_kernels`
    measured fastest for its shape at each row count (the C++ panel kernel only with the C++ backend),
    and with the C++ backend each mixture-of-experts layer its `fused_moe` likewise
    (`selection.select_moe_kernels`), and the prefill attention its kernel per query row count
    (`selection.select_prefill_attention`).
    Elsewhere (CUDA, float16) the weights stay as they are. Raises `cpu.CPUKernelBuildError` when the
    C++ kernels cannot be built; ValueError for a bad `CONVEYOR_CPU_KERNELS`.
    """
    from conveyor.kernels import cpu, selection

    name = str(dtype).removeprefix("torch.")
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return f"matmuls: {name} weights as loaded"
    tables = selection.select_linear_kernels(model, dtype, panel=backend is cpu)
    used = sorted({kernel for table in tables.values() for kernel in table.names()})
    experts = selection.select_moe_kernels(model) if backend is cpu else {}
    used += sorted({kernel for table in experts.values() for kernel in table.names()})
    shapes = f"{len(tables)} layer shapes" + (f" and {len(experts)} expert shapes" if experts else "")
    attention = selection.select_prefill_attention(model, dtype) if backend is cpu else None
    prefill = f"; prefill attention: {attention}" if attention else ""
    return (
        f"CPU matmuls ({name}): {shapes}, each with its fastest kernel per row count ({', '.join(used)})"
        + prefill
    )
