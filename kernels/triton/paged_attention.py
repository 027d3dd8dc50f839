"""Paged attention in Triton: a flash-decoding kernel for decode rows and a flash-attention kernel for
prefill and chunked-prefill rows, both reading K/V through block tables.

Same contract as `conveyor.kernels.reference.paged_attention`. A step with only decode rows
(`max_query_len == 1`) launches the decode kernels only; a mixed step launches both, and each kernel
skips the sequences of the other kind on the device, so the host never reads query lengths back.

Decode (Dao et al., "Flash-Decoding for long-context inference", 2023): each program handles one
(sequence, KV head, context split) and all query heads of that KV head, writing a partial output
normalised by its own softmax sum plus its log-sum-exp; a second kernel combines the splits. Splitting
the context lets a batch of a few long sequences still occupy every SM.

All softmax arithmetic is float32 (scores are kept in the log2 domain so `exp2` can be used) whatever
the input dtype; K/V slots past a sequence's length are never loaded. With a sliding window every
program starts its KV loop at the first key any of its rows can see: the decode splits divide the
window, not the whole context, and a prefill tile starts at its first row's window, so blocks wholly
before the window are never loaded.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from conveyor.kernels.reference import check_window_and_soft_cap
from conveyor.kernels.triton.device import check_device

_LOG2E = 1.4426950408889634
# The window passed to the kernels when there is none: wider than any context, so no key is cut.
_NO_WINDOW = 1 << 30

# Decode tiling: tokens of context per loop iteration, and bounds for the number of context splits.
_DECODE_BLOCK_N = 64
_DECODE_BLOCK_N_FP32 = 32
_MAX_KV_SPLITS = 64
# A split shorter than this spends more on its partial write and the reduce than it saves.
_MIN_TOKENS_PER_SPLIT = 256
# Prefill tiling. float32 K/V tiles are twice as large: halve BLOCK_N (here and for decode) so two
# pipeline stages of K and V stay within ~100 KiB of shared memory at head_dim 128.
_PREFILL_BLOCK_M = 64
_PREFILL_BLOCK_N = 64
_PREFILL_BLOCK_N_FP32 = 32
_NUM_STAGES = 2


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """`a @ b` accumulated in float32. UPCAST multiplies in float32: Triton's interpreter multiplies
    bfloat16 operands as their raw 16-bit patterns, so CPU runs take this path for bfloat16."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _soft_cap(s, cap):
    """`cap * tanh(s / cap)` elementwise, s and cap in the same units (log2 here); tanh through exp2,
    `sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|))`, which neither overflows nor needs libdevice."""
    e = tl.exp2(tl.abs(s) * (-2.0 * 1.4426950408889634 / cap))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -t, t) * cap


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    scale_log2,
    soft_cap_log2,
    window,
    split_size,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_po_s,
    stride_po_h,
    stride_po_k,
    stride_pl_s,
    stride_pl_h,
    stride_ot,
    stride_oh,
    GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    """One (sequence, KV head, split): partial attention of the sequence's single query row, for the
    GROUPS query heads sharing the KV head, over context positions [win_start + split * split_size, ...),
    win_start = max(0, seq_len - window) being the window's first key (0 without a window). Scores are
    soft-capped at soft_cap_log2 (the cap in log2 units) when SOFT_CAP.
    With SINGLE_SPLIT the partial result is the final one: written to out, no reduce needed."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    split_start = tl.maximum(seq_len - window, 0) + split * split_size
    # Prefill rows belong to the other kernel; splits past the end have nothing to do (the reduce
    # kernel derives the number of live splits from seq_len and the window and never reads theirs).
    if q_len != 1 or split_start >= seq_len:
        return
    split_end = tl.minimum(split_start + split_size, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUPS
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUPS + offs_g
    q = tl.load(
        q_ptr + q_start.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(split_start, split_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < split_end
        block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr
            + (block_ids * stride_kb + in_block * stride_ks + kv_head * stride_kh)[None, :]
            + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        s = _dot(q, k, DOT_PRECISION, UPCAST_DOT) * scale_log2  # [BLOCK_G, BLOCK_N]
        if SOFT_CAP:
            s = _soft_cap(s, soft_cap_log2)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr
            + (block_ids * stride_vb + in_block * stride_vs + kv_head * stride_vh)[:, None]
            + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    out = acc / l_i[:, None]
    if SINGLE_SPLIT:
        tl.store(
            out_ptr + q_start.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_g[:, None] & mask_d[None, :],
        )
        return
    po = partial_out_ptr + seq.to(tl.int64) * stride_po_s + split * stride_po_k
    tl.store(po + heads[:, None] * stride_po_h + offs_d[None, :], out, mask=mask_g[:, None] & mask_d[None, :])
    lse = m_i + tl.log2(l_i)
    tl.store(partial_lse_ptr + seq.to(tl.int64) * stride_pl_s + split + heads * stride_pl_h, lse, mask=mask_g)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    window,
    split_size,
    stride_ot,
    stride_oh,
    stride_po_s,
    stride_po_h,
    stride_po_k,
    stride_pl_s,
    stride_pl_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One (sequence, query head): combine the live splits' partial outputs weighted by their
    softmax mass, `sum_k 2^(lse_k - max) * out_k / sum_k 2^(lse_k - max)`."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    live_splits = tl.cdiv(seq_len - tl.maximum(seq_len - window, 0), split_size)

    offs_k = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_k = offs_k < live_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(
        partial_lse_ptr + seq.to(tl.int64) * stride_pl_s + head * stride_pl_h + offs_k,
        mask=mask_k,
        other=float("-inf"),
    )
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    weights = tl.where(mask_k, weights, 0.0)
    partial = tl.load(
        partial_out_ptr
        + seq.to(tl.int64) * stride_po_s
        + head * stride_po_h
        + offs_k[:, None] * stride_po_k
        + offs_d[None, :],
        mask=mask_k[:, None] & mask_d[None, :],
        other=0.0,
    )  # [NUM_SPLITS, BLOCK_D]
    out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    soft_cap_log2,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    """One (sequence, query head, tile of BLOCK_M query rows): causal flash attention over the
    sequence's paged context. Row i of a sequence with q_len rows and seq_len tokens sits at position
    p = seq_len - q_len + i and attends to positions max(0, p - window + 1) ..= p. Scores are
    soft-capped at soft_cap_log2 (the cap in log2 units) when SOFT_CAP."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    if SKIP_DECODE and q_len == 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // GROUPS

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    positions = seq_len - q_len + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The tile's last row sees positions up to seq_len - q_len + its index, its first row none before
    # its window's first key; nothing outside is loaded.
    kv_end = tl.minimum(seq_len, seq_len - q_len + (m_block + 1) * BLOCK_M)
    kv_begin = tl.maximum(seq_len - q_len + m_block * BLOCK_M - window + 1, 0)
    for start in range(kv_begin, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr
            + (block_ids * stride_kb + in_block * stride_ks + kv_head * stride_kh)[None, :]
            + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        s = _dot(q, k, DOT_PRECISION, UPCAST_DOT) * scale_log2  # [BLOCK_M, BLOCK_N]
        if SOFT_CAP:
            s = _soft_cap(s, soft_cap_log2)
        visible = (
            mask_n[None, :]
            & (offs_n[None, :] <= positions[:, None])
            & (offs_n[None, :] > positions[:, None] - window)
        )
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row whose window starts past this tile has seen nothing yet (m_new = -inf): subtracting 0
        # instead keeps its alpha and p at 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr
            + (block_ids * stride_vb + in_block * stride_vs + kv_head * stride_vh)[:, None]
            + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    # Padding rows past q_len (never stored) may see no key under a window: divide them by 1, not 0.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


@functools.cache
def _cuda_sm_count(index: int) -> int:
    # Asked once per device, not once per layer and step.
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_programs_target(device: torch.device) -> int:
    """How many decode programs keep the device busy: two per SM on CUDA; a small fixed number
    elsewhere (the interpreter)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return 2 * _cuda_sm_count(index)
    return 8


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Context splits for the decode kernel: a power of two (so few reduce-kernel variants compile),
    enough that num_seqs * num_kv_heads * splits programs fill the device, but no split shorter than
    _MIN_TOKENS_PER_SPLIT tokens and at most _MAX_KV_SPLITS."""
    wanted = -(-_device_programs_target(device) // max(1, num_seqs * num_kv_heads))
    by_length = max(1, max_seq_len // _MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(wanted, by_length, _MAX_KV_SPLITS))
    return 1 << (splits.bit_length() - 1)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs must not be silently rounded to TF32 by tl.dot: the contract is float32 accuracy.
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast_dot(query: torch.Tensor) -> bool:
    # Off CUDA the kernels run in Triton's interpreter, whose tl.dot is wrong for bfloat16 (see _dot).
    return query.dtype == torch.bfloat16 and query.device.type != "cuda"


def _check_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if query.shape[1] % key_cache.shape[2] != 0:
        raise ValueError(f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {key_cache.shape[2]}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} != value_cache {tuple(value_cache.shape)}")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim; got strides {t.stride()}")


def paged_attention_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Write into `out` the attention of every sequence whose query length is 1; other rows untouched.

    Shapes, sliding_window and logits_soft_cap as in `paged_attention`; `out` is
    `[num_tokens, num_heads, head_dim]`. num_splits: splits of the keys a row reads (its window, or the
    whole context) per sequence, a power of two, default `num_kv_splits(...)` on the window's length.
    """
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    groups = num_heads // num_kv_heads
    # The most keys a decode row reads: its window, or its whole context.
    keys_read = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
    if num_splits is None:
        num_splits = num_kv_splits(num_seqs, num_kv_heads, keys_read, query.device)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    # Round split boundaries to whole tiles so only a sequence's last tile is partial.
    split_size = -(-max(1, keys_read) // num_splits)
    block_n = _DECODE_BLOCK_N_FP32 if query.dtype == torch.float32 else _DECODE_BLOCK_N
    split_size = -(-split_size // block_n) * block_n
    # With one split the kernel writes `out` directly and these stay unused.
    partial_out = torch.empty(
        num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
    )
    partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    block_d = triton.next_power_of_2(head_dim)
    window = _NO_WINDOW if sliding_window is None else sliding_window
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        partial_out,
        partial_lse,
        out,
        scale * _LOG2E,
        (logits_soft_cap or 1.0) * _LOG2E,
        window,
        split_size,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        out.stride(0),
        out.stride(1),
        GROUPS=groups,
        # tl.dot needs at least 16 rows; the padding rows are masked and cost no memory traffic.
        BLOCK_G=max(16, triton.next_power_of_2(groups)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(query.dtype),
        UPCAST_DOT=_upcast_dot(query),
        SINGLE_SPLIT=num_splits == 1,
        SOFT_CAP=logits_soft_cap is not None,
        num_warps=4,
        num_stages=_NUM_STAGES,
    )
    if num_splits == 1:
        return
    _decode_reduce_kernel[(num_seqs, num_heads)](
        out,
        query_start_loc,
        seq_lens,
        partial_out,
        partial_lse,
        window,
        split_size,
        out.stride(0),
        out.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
    )


def paged_attention_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    skip_decode: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Write into `out` the causal attention of every sequence with more than one query row (and of
    single-row sequences too when `skip_decode` is False). Shapes, sliding_window and logits_soft_cap
    as in `paged_attention`."""
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, _PREFILL_BLOCK_M))
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * _LOG2E,
        (logits_soft_cap or 1.0) * _LOG2E,
        _NO_WINDOW if sliding_window is None else sliding_window,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUPS=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=_PREFILL_BLOCK_M,
        BLOCK_N=_PREFILL_BLOCK_N_FP32 if query.dtype == torch.float32 else _PREFILL_BLOCK_N,
        SKIP_DECODE=skip_decode,
        DOT_PRECISION=_dot_precision(query.dtype),
        UPCAST_DOT=_upcast_dot(query),
        SOFT_CAP=logits_soft_cap is not None,
        num_warps=4,
        num_stages=_NUM_STAGES,
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    prepared: None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over each sequence's paged K/V, with grouped-query attention.

    query: `[num_tokens, num_heads, head_dim]` (float32, float16 or bfloat16); key_cache, value_cache:
    `[num_blocks, block_size, num_kv_heads, head_dim]`, same dtype; block_tables: `[num_seqs, max_blocks]`
    int32; query_start_loc: `[num_seqs + 1]` int32; seq_lens: `[num_seqs]` int32. prepared: unused (the
    kernels read the metadata on the device; `prepare_metadata` gives None). sliding_window: attend to
    the last W positions only; logits_soft_cap: scores become `cap * tanh(score / cap)`.
    Returns `[num_tokens, num_heads, head_dim]` in the query's dtype. See the reference for semantics.
    Raises ValueError when num_heads is not a multiple of num_kv_heads, head_dim is strided, the window
    is below 1 or the cap is not positive.
    """
    _check_inputs(query, key_cache, value_cache)
    check_window_and_soft_cap(sliding_window, logits_soft_cap)
    check_device(_prefill_kernel, query)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0:
        return out
    metadata = (block_tables, query_start_loc, seq_lens, scale)
    options = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
    paged_attention_decode(out, query, key_cache, value_cache, *metadata, max_seq_len, **options)
    if max_query_len > 1:
        paged_attention_prefill(out, query, key_cache, value_cache, *metadata, max_query_len, **options)
    return out
