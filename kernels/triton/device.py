"""Where the Triton kernels can run: on CUDA tensors, or on CPU tensors under Triton's interpreter."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


class TritonUnavailableError(RuntimeError):
    """A Triton kernel was called on tensors it cannot run on (CPU tensors, interpreter off)."""


def check_device(kernel: object, tensor: torch.Tensor) -> None:
    """Raise TritonUnavailableError, naming the fix, unless `kernel` can run on `tensor`'s device.

    Without this, Triton fails on CPU tensors with "0 active drivers", which names neither cause.
    """
    if tensor.device.type == "cuda" or isinstance(kernel, InterpretedFunction):
        return
    raise TritonUnavailableError(
        f"Triton kernels need CUDA tensors; got a tensor on {tensor.device}. On CPU they run only in "
        "Triton's interpreter: set TRITON_INTERPRET=1 before triton is first imported, or use the "
        "torch backend (--attention-backend torch)"
    )
