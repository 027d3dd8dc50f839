"""Gated MLP activations in Triton: SwiGLU's `silu(x[:, :I]) * x[:, I:]` and GeGLU's
`gelu_tanh(x[:, :I]) * x[:, I:]`.

Same contracts as `conveyor.kernels.reference.silu_and_mul` and `gelu_tanh_and_mul`, rounding where
torch does (the activation is cast to the input dtype before the product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton.device import check_device

_BLOCK = 1024


@triton.jit
def _gated_kernel(
    x_ptr, out_ptr, intermediate_size, stride_x, stride_o, GELU: tl.constexpr, BLOCK: tl.constexpr
):
    """One (row, chunk of BLOCK output columns); SiLU, or tanh GELU with GELU."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < intermediate_size
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + intermediate_size + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    z = g
    if (
        GELU
    ):  # gelu_tanh(g) = g * sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3)): (1 + tanh(t)) / 2 = sigmoid(2 t)
        z = g * 1.5957691216057308 * (1.0 + 0.044715 * g * g)
    act = (g / (1.0 + tl.exp(-z))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _gated(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    if x.dim() != 2 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [num_tokens, 2 * I] with contiguous rows; got {tuple(x.shape)}")
    check_device(_gated_kernel, x)
    num_tokens, width = x.shape
    intermediate_size = width // 2
    out = torch.empty(num_tokens, intermediate_size, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(intermediate_size))
    grid = (num_tokens, triton.cdiv(intermediate_size, block))
    _gated_kernel[grid](x, out, intermediate_size, x.stride(0), out.stride(0), GELU=gelu, BLOCK=block)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: `[num_tokens, 2 * I]` (last dim contiguous) -> `[num_tokens, I]` in x's dtype.

    Raises ValueError when the last dim is odd or strided.
    """
    return _gated(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: `[num_tokens, 2 * I]` (last dim contiguous) -> `[num_tokens, I]` in x's dtype; tanh GELU in
    its sigmoid form. Raises ValueError when the last dim is odd or strided."""
    return _gated(x, gelu=True)
