"""Rotary position embedding in Triton (GPT-NeoX layout: the halves of each head are rotated pairs).

Same contract as `conveyor.kernels.reference.rotary_embedding`; rotation in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton.device import check_device


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    row,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    cos,
    sin,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate `num_heads` heads of one token row from src to dst; cos, sin: `[1, BLOCK_HALF]` float32."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    src = src_ptr + row * stride_st + offs_h[:, None] * stride_sh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    dst = dst_ptr + row * stride_dt + offs_h[:, None] * stride_dh + offs_d[None, :]
    tl.store(dst, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(dst + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One token: rotate all its query and key heads by the angles of its position."""
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[
        None, :
    ]
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        row,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        cos,
        sin,
        NUM_HEADS,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        row,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        cos,
        sin,
        NUM_KV_HEADS,
        HALF,
        BLOCK_KH,
        BLOCK_HALF,
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    prepared: None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embedding (Su et al. 2021) to query and key; inputs are not modified.

    positions: `[num_tokens]` integer. query: `[num_tokens, num_heads, head_dim]`; key:
    `[num_tokens, num_kv_heads, head_dim]` (head_dim contiguous). cos_sin_cache: `[max_position,
    rotary_dim]`, cos in the first half, sin in the second (`rope_cos_sin_cache`); the first rotary_dim
    dims of each head are rotated, the rest copied (partial rotary). prepared: unused (the kernel indexes
    the table itself).
    Returns rotated (query, key), contiguous, in their dtypes. Raises ValueError for widths that do
    not fit (naming them).
    """
    head_dim, rotary_dim = query.shape[-1], cos_sin_cache.shape[-1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim or key.shape[-1] != head_dim:
        raise ValueError(
            f"head_dim mismatch: query {head_dim}, key {key.shape[-1]}, cos_sin_cache {rotary_dim} (even, "
            "at most head_dim)"
        )
    for name, t in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim; got strides {t.stride()}")
    check_device(_rotary_kernel, query)
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if rotary_dim < head_dim:  # the dims past the rotated width pass unchanged
        q_out[..., rotary_dim:] = query[..., rotary_dim:]
        k_out[..., rotary_dim:] = key[..., rotary_dim:]
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return q_out, k_out
    half = rotary_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        q_out,
        k_out,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        NUM_HEADS=query.shape[1],
        NUM_KV_HEADS=key.shape[1],
        HALF=half,
        BLOCK_H=triton.next_power_of_2(query.shape[1]),
        BLOCK_KH=triton.next_power_of_2(key.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q_out, k_out
