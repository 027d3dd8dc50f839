"""LoRA deltas of many adapters in one batch in Triton: Punica's BGMV form (Chen et al., 2023), one
program per (token row, tile of output columns), each reading its row's adapter index.

Same contract as `conveyor.kernels.reference.add_lora`. Two kernels: the shrink (`mid[t] = A[i] @ x[t]`,
float32, `[num_tokens, R]`), then the expand (`y[t] += B[i] @ mid[t]`, added in float32 and rounded once
to y's dtype). Rows whose index is negative are masked out of every load and store, so the base model's
rows cost no weight reads. Decode batches (one row per sequence, adapters mixed) are the case this
layout serves; the rank is small, so the sums are reductions over register tiles, not `tl.dot`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton.device import check_device

_BLOCK_R = 16
_BLOCK_K = 64
_BLOCK_N = 64


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, mid_ptr, index_ptr, rank, k, stride_x, stride_as, stride_ar, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One (token row, BLOCK_R ranks): mid[t, r] = sum_k A[i, r, k] * x[t, k]."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(index_ptr + row)
    # A base-model row (slot < 0) reads and writes nothing: its bounds become 0.
    rows = tl.where(slot >= 0, rank, 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + offs_k, mask=offs_k < k, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
            mask=(offs_r[:, None] < rows) & (offs_k[None, :] < k),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(mid_ptr + row * rank + offs_r, acc, mask=offs_r < rows)


@triton.jit
def _expand_kernel(
    mid_ptr, b_ptr, y_ptr, index_ptr, rank, n, stride_y, stride_bs, stride_bn, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One (token row, BLOCK_N output columns): y[t, o] += sum_r B[i, o, r] * mid[t, r]."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(index_ptr + row)
    cols = tl.where(slot >= 0, n, 0)  # a base-model row reads and writes nothing
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mid = tl.load(mid_ptr + row * rank + offs_r, mask=offs_r < rank, other=0.0)
        b = tl.load(
            b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
            mask=(offs_n[:, None] < cols) & (offs_r[None, :] < rank),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(b * mid[None, :], axis=1)
    mask = offs_n < cols
    y = tl.load(y_ptr + row * stride_y + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs_n, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
) -> torch.Tensor:
    """See `conveyor.kernels.reference.add_lora` (same shapes; y updated in place and returned).

    Raises ValueError when y's or x's rows are strided, or the shapes do not match."""
    num_tokens, k = x.shape
    slots, rank, _ = lora_a.shape
    n = y.shape[1]
    if y.stride(-1) != 1 or x.stride(-1) != 1 or lora_b.shape != (slots, n, rank) or lora_a.shape[2] != k:
        raise ValueError(
            f"add_lora: y {tuple(y.shape)}, x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)} and lora_b "
            f"{tuple(lora_b.shape)} must be [T, out], [T, in], [L, R, in], [L, out, R] with contiguous rows"
        )
    check_device(_shrink_kernel, y)
    if num_tokens == 0 or rank == 0:
        return y
    a, b = lora_a.contiguous(), lora_b.contiguous()
    index = indices.to(device=y.device, dtype=torch.int64).contiguous()
    mid = torch.zeros(num_tokens, rank, dtype=torch.float32, device=y.device)
    _shrink_kernel[(num_tokens, triton.cdiv(rank, _BLOCK_R))](
        x, a, mid, index, rank, k, x.stride(0), a.stride(0), a.stride(1), BLOCK_R=_BLOCK_R, BLOCK_K=_BLOCK_K
    )
    _expand_kernel[(num_tokens, triton.cdiv(n, _BLOCK_N))](
        mid, b, y, index, rank, n, y.stride(0), b.stride(0), b.stride(1), BLOCK_N=_BLOCK_N, BLOCK_R=_BLOCK_R
    )
    return y
