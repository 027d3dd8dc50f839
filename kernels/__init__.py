"""Kernels for the model's hot paths. Three backends with identical signatures:

- `torch`: `conveyor.kernels.reference`, plain torch; the contract, and the CPU path when the C++
  kernels cannot be built.
- `cpu`: `conveyor.kernels.cpu`, C++ kernels for CPUs compiled on first use (needs a C++ compiler).
- `triton`: `conveyor.kernels.triton`, Triton kernels for CUDA (on CPU only under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

KERNEL_NAMES = (
    "reshape_and_cache",
    "paged_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
)
BACKENDS = {
    "torch": "conveyor.kernels.reference",
    "cpu": "conveyor.kernels.cpu",
    "triton": "conveyor.kernels.triton",
}


def default_backend(device_type: str) -> str:
    """`triton` on CUDA; on CPU `cpu` when its C++ kernels build here (first call compiles them, about
    15 s once per machine), else `torch` (the reason is logged)."""
    if device_type == "cuda":
        return "triton"
    from conveyor.kernels import cpu

    return "cpu" if cpu.is_available() else "torch"


def load_backend(name: str) -> ModuleType:
    """The module providing every name in KERNEL_NAMES for backend `name` (`torch`, `cpu` or `triton`).

    Raises ValueError for an unknown name; `cpu.CPUKernelBuildError` when the C++ kernels cannot be built.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {sorted(BACKENDS)}")
    module = importlib.import_module(BACKENDS[name])
    if name == "cpu":
        module.load_library()
    return module
