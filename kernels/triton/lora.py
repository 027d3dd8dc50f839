"""LoRA deltas of many adapters in one batch in Triton: Punica's BGMV form (Chen et al., 2023), one
program per (token row, tile of output columns), each reading its row's adapter index.

Same contract as `conveyor.kernels.reference.add_lora`. Two kernels: the shrink (`mid[t] = A[i] @ x[t]`,
float32, `[num_tokens, S * R]` over the S slices' stacked A), then the expand (`y[t, c] += sum_r
mid[t, slice(c) * R + r] * B[i, r, c]`, added in float32 and rounded once to y's dtype). Rows whose index is negative are masked out of every load and store, so the base model's
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
    x_ptr,
    a_ptr,
    mid_ptr,
    index_ptr,
    rank,
    k,
    stride_x,
    stride_as,
    stride_ar,
    BLOCK_R: tl.constexpr,
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
    mid_ptr,
    b_ptr,
    y_ptr,
    index_ptr,
    col_slice_ptr,
    rank,
    stacked,
    n,
    stride_y,
    stride_bs,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One (token row, BLOCK_N output columns): y[t, c] += sum_r mid[t, slice(c) * R + r] * B[i, r, c]."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(index_ptr + row)
    cols = tl.where(slot >= 0, n, 0)  # a base-model row reads and writes nothing
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < cols
    first = tl.load(col_slice_ptr + offs_n, mask=offs_n < n, other=0) * rank  # the slice's first mid
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        ok = (offs_r[:, None] < rank) & col_ok[None, :]
        mid = tl.load(mid_ptr + row * stacked + first[None, :] + offs_r[:, None], mask=ok, other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * n + offs_n[None, :], mask=ok, other=0.0)
        acc += tl.sum(b.to(tl.float32) * mid, axis=0)
    y = tl.load(y_ptr + row * stride_y + offs_n, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs_n, (y + acc).to(y_ptr.dtype.element_ty), mask=col_ok)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
    output_slices: tuple[int, ...] | None = None,
    slot_ranks: list[int] | None = None,
) -> torch.Tensor:
    """See `conveyor.kernels.reference.add_lora` (same shapes; y updated in place and returned). Reads
    every slot to R (`slot_ranks` is not used: the rows past a slot's rank are zero).

    Raises ValueError when y's or x's rows are strided, or the shapes do not match."""
    num_tokens, k = x.shape
    n = y.shape[1]
    slices = tuple(output_slices or (n,))
    slots, stacked, _ = lora_a.shape
    rank = lora_b.shape[1]
    if (
        y.stride(-1) != 1
        or x.stride(-1) != 1
        or lora_b.shape != (slots, rank, n)
        or lora_a.shape[2] != k
        or stacked != len(slices) * rank
        or sum(slices) != n
    ):
        raise ValueError(
            f"add_lora: y {tuple(y.shape)}, x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)}, lora_b "
            f"{tuple(lora_b.shape)} and output_slices {slices} must be [T, out], [T, in], [L, S * R, in], "
            "[L, R, out] and S widths summing to out, with contiguous rows"
        )
    check_device(_shrink_kernel, y)
    if num_tokens == 0 or rank == 0:
        return y
    a, b = lora_a.contiguous(), lora_b.contiguous()
    index = indices.to(device=y.device, dtype=torch.int64).contiguous()
    col_slice = torch.repeat_interleave(
        torch.arange(len(slices), dtype=torch.int32), torch.tensor(slices)
    ).to(y.device)
    mid = torch.zeros(num_tokens, stacked, dtype=torch.float32, device=y.device)
    _shrink_kernel[(num_tokens, triton.cdiv(stacked, _BLOCK_R))](
        x,
        a,
        mid,
        index,
        stacked,
        k,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        BLOCK_R=_BLOCK_R,
        BLOCK_K=_BLOCK_K,
    )
    _expand_kernel[(num_tokens, triton.cdiv(n, _BLOCK_N))](
        mid,
        b,
        y,
        index,
        col_slice,
        rank,
        stacked,
        n,
        y.stride(0),
        b.stride(0),
        BLOCK_N=_BLOCK_N,
        BLOCK_R=_BLOCK_R,
    )
    return y
