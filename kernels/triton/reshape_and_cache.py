"""KV cache write in Triton: copy each token's K/V rows into its slot of the paged cache.

Same contract as `conveyor.kernels.reference.reshape_and_cache`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels.triton.device import check_device


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One token: all its KV heads, K and V."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    row = token.to(tl.int64)
    k = tl.load(key_ptr + row * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + row * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = key_cache_ptr + block * stride_kcb + offset * stride_kcs
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(k_dst + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(v_dst + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the step's K/V into the paged cache, in place.

    key, value: `[num_tokens, num_kv_heads, head_dim]`, same dtype as the caches (rows may be strided,
    head_dim must be contiguous). key_cache, value_cache: `[num_blocks, block_size, num_kv_heads,
    head_dim]`. slot_mapping: `[num_tokens]` integer; a negative slot means "do not write".
    Raises ValueError on a dtype mismatch or a strided head_dim.
    """
    if key.dtype != key_cache.dtype or value.dtype != value_cache.dtype:
        raise ValueError(f"K/V dtype {key.dtype}/{value.dtype} != cache dtype {key_cache.dtype}")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim; got strides {t.stride()}")
    check_device(_reshape_and_cache_kernel, key)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
    )
