"""Kernels for the model's hot paths. Two backends with identical signatures:

- `torch`: `conveyor.kernels.reference`, plain torch; the contract and the CPU path.
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
BACKENDS = {"torch": "conveyor.kernels.reference", "triton": "conveyor.kernels.triton"}


def default_backend(device_type: str) -> str:
    """`triton` on CUDA, `torch` elsewhere."""
    return "triton" if device_type == "cuda" else "torch"


def load_backend(name: str) -> ModuleType:
    """The module providing every name in KERNEL_NAMES for backend `name` (`torch` or `triton`).

    Raises ValueError for an unknown name.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {sorted(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])
