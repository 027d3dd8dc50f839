"""The mixture-of-experts MLP in Triton: a grouped GEMM over blocks of tokens sorted by expert.

Same contract as `conveyor.kernels.reference.fused_moe`. The (token, choice) pairs are sorted by expert
on the device and each expert's run is padded to whole blocks of BLOCK_M pairs (the layout of vLLM's
`moe_align_block_size`), so every program of the grouped GEMM multiplies BLOCK_M pairs of one expert
by a BLOCK_N-column tile of that expert's weights. Two GEMMs, the first gathering the pairs' hidden rows
(`x @ w13[e].T -> [pairs, 2I]`), then `silu_and_mul`, then the second with each pair's routing weight
applied to its output row (`act @ w2[e].T * w -> [pairs, H]`); each token's top-k rows are summed in
float32. Experts no pair chose get no block, so their weights are not read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton.device import check_device
from conveyor.kernels.triton.silu_and_mul import silu_and_mul

_BLOCK_M = 16  # pairs per block (tl.dot needs at least 16)
_BLOCK_N = 32
_BLOCK_K = 32


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    pair_ids_ptr,
    block_experts_ptr,
    routing_ptr,
    num_pairs,
    n,
    k,
    a_row_divisor,
    stride_a,
    stride_we,
    stride_wn,
    stride_c,
    APPLY_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[pair, cols] = A[pair // a_row_divisor] @ W[expert, cols].T (x routing[pair]) for one block of
    BLOCK_M sorted pairs (padding slots hold num_pairs) and one tile of BLOCK_N columns."""
    block = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    a_rows = (pairs // a_row_divisor).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < k),
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
            mask=(cols[None, :] < n) & (ks[:, None] < k),
            other=0.0,
        )
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
    if APPLY_WEIGHT:
        acc = acc * tl.load(routing_ptr + pairs, mask=valid, other=0.0)[:, None]
    out = c_ptr + pairs.to(tl.int64)[:, None] * stride_c + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < n))


def _align(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids sorted by expert with each expert's run padded to whole blocks of _BLOCK_M, padding
    = the number of pairs; the expert of each block), on topk_ids' device."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = (counts + _BLOCK_M - 1) // _BLOCK_M
    block_experts = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), blocks)
    padded_start = (torch.cumsum(blocks, 0) - blocks) * _BLOCK_M  # each expert's first padded slot
    start = torch.cumsum(counts, 0) - counts  # each expert's first pair in `order`
    sorted_experts = flat[order]
    slots = padded_start[sorted_experts] + torch.arange(num_pairs, device=flat.device) - start[sorted_experts]
    pair_ids = torch.full((int(blocks.sum()) * _BLOCK_M,), num_pairs, dtype=torch.int64, device=flat.device)
    pair_ids[slots] = order
    return pair_ids, block_experts


def _grouped_gemm(a, w, pair_ids, block_experts, num_pairs, a_row_divisor, routing, out_dtype):
    n, k = w.shape[1], w.shape[2]
    c = torch.empty(num_pairs, n, dtype=out_dtype, device=a.device)
    grid = (block_experts.numel(), triton.cdiv(n, _BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, w, c, pair_ids, block_experts, routing if routing is not None else a,
        num_pairs, n, k, a_row_divisor, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        APPLY_WEIGHT=routing is not None, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )  # fmt: skip
    return c


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """See `conveyor.kernels.reference.fused_moe` (shapes, dtypes). The gate/up products are kept in
    hidden's dtype before `silu_and_mul`, as the reference's matmul returns them; the weighted expert
    outputs are float32 and summed per token in float32."""
    check_device(_grouped_gemm_kernel, hidden)
    num_tokens, top_k = topk_ids.shape
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    num_pairs = num_tokens * top_k
    pair_ids, block_experts = _align(topk_ids, w13.shape[0])
    gate_up = _grouped_gemm(hidden, w13, pair_ids, block_experts, num_pairs, top_k, None, hidden.dtype)
    act = silu_and_mul(gate_up)
    routing = topk_weights.reshape(-1).float().contiguous()
    out = _grouped_gemm(act, w2, pair_ids, block_experts, num_pairs, 1, routing, torch.float32)
    return out.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)
