"""RMSNorm and fused residual-add + RMSNorm in Triton, one program per token row.

Same contracts as `conveyor.kernels.reference.rms_norm` and `fused_add_rms_norm`, rounding at the same
points as the reference (normalise in float32, cast to the input dtype, then multiply by the weight)
so both backends agree to the last bit in most rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton.device import check_device


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    hidden_size,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    """One row: optionally `residual_out = x + residual`, then `out = weight * rms_norm(that)`."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # Round the sum to the activation dtype, as `x + residual` does in torch.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / hidden_size
    normed = (xf * tl.rsqrt(mean_sq + eps)).to(x.dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [num_tokens, hidden_size] with contiguous rows; got {tuple(x.shape)}")
    check_device(_rms_norm_kernel, x)
    num_tokens, hidden_size = x.shape
    # torch's promotion rule for `weight * x`, as in the reference.
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        out if residual_out is None else residual_out,
        eps,
        hidden_size,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        0 if residual_out is None else residual_out.stride(0),
        BLOCK=block,
        ADD_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as in Llama. x: `[num_tokens, hidden_size]`; weight: `[hidden_size]`.

    Returns `[num_tokens, hidden_size]` in torch.promote_types(weight.dtype, x.dtype).
    """
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual = x + residual; return rms_norm(residual), residual`, in one pass over memory.

    x, residual: `[num_tokens, hidden_size]`, same dtype; weight: `[hidden_size]`. Inputs are not
    modified. Returns (normalized, new residual), both `[num_tokens, hidden_size]`.
    """
    if residual.dtype != x.dtype or residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)} {x.dtype}"
        )
    out, residual_out = _launch(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out
