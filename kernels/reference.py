"""Plain-torch kernels: the contract the C++ (`conveyor.kernels.cpu`) and Triton (`conveyor.kernels.triton`)
kernels match, and the CPU path where the C++ kernels cannot be built.

Layouts follow vLLM's so that kernels, model code and the block manager agree:

- packed tokens: the step's tokens of all sequences are concatenated, no padding; `num_tokens` rows.
- KV cache of one layer: `key_cache`, `value_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`.
- `slot_mapping[t] = block_id * block_size + offset` is where token `t`'s K/V is written.
- `block_tables[b, i]` is the i-th block of sequence `b` (int32, padded with 0 past its last block).
- `query_start_loc[b]:query_start_loc[b + 1]` are sequence `b`'s query rows; they are the last
  `q_len` tokens of its `seq_lens[b]` tokens of context, all of which are already in the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from conveyor.kernels import AttentionMetadata


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the step's K/V into the paged cache, in place.

    key, value: `[num_tokens, num_kv_heads, head_dim]`, same dtype as the caches.
    key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`.
    slot_mapping: `[num_tokens]` int64; a negative slot means "do not write" (vLLM's padding convention).
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k.index_copy_(0, slot_mapping, key)
    flat_v.index_copy_(0, slot_mapping, value)


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """`[B, max_blocks]` block ids -> `[B, max_seq_len, num_kv_heads, head_dim]` (positions past a
    sequence's length hold whatever its padding blocks hold; callers mask them)."""
    block_size = cache.shape[1]
    num_blocks_needed = -(-max_seq_len // block_size)
    ids = block_tables[:, :num_blocks_needed].long()
    batch = ids.shape[0]
    gathered = cache.index_select(0, ids.reshape(-1))  # [B * nb, bs, kvh, d]
    return gathered.reshape(batch, num_blocks_needed * block_size, *cache.shape[2:])[:, :max_seq_len]


@dataclass(frozen=True)
class AttentionLayout:
    """What `paged_attention` derives from a step's metadata, the same for every layer of the step.

    q_lens, starts, seq_lens: per sequence, as Python ints. decode: the sequences with one query row.
    decode_rows: `[D * kvh * ctx]` int64 rows of a cache viewed as `[num_slots * kvh, head_dim]`, ordered
    `[D, kvh, ctx]`; decode_bias: `[D, 1, 1, ctx]` float32, 0 at real positions and -inf at padding.
    """

    q_lens: list[int]
    starts: list[int]
    seq_lens: list[int]
    decode: list[int]
    decode_rows: torch.Tensor | None
    decode_bias: torch.Tensor | None
    ctx: int


def attention_layout(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_kv_heads: int,
) -> AttentionLayout:
    """The step's `AttentionLayout` (metadata as in `paged_attention`; one host sync).

    Padding positions of the decode rows repeat the sequence's last token instead of reading slots
    nobody wrote (fresh cache memory may hold NaN, and a masked NaN still poisons the softmax: NaN - inf
    is NaN, 0 * NaN is NaN), so the gathered batch needs no cleaning pass."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    starts = query_start_loc[:-1].tolist()
    lens = seq_lens.tolist()
    decode = [b for b, q_len in enumerate(q_lens) if q_len == 1]
    if not decode:
        return AttentionLayout(q_lens, starts, lens, decode, None, None, 0)
    all_decode = len(decode) == len(lens)
    tables = block_tables if all_decode else block_tables[decode]
    dlens = (seq_lens if all_decode else seq_lens[decode]).long()
    ctx = max(lens[b] for b in decode)
    device = block_tables.device
    pos = torch.arange(ctx, device=device)
    bias = torch.zeros(len(decode), 1, 1, ctx, device=device)
    bias.masked_fill_((pos[None, :] >= dlens[:, None])[:, None, None, :], float("-inf"))
    pos = torch.minimum(pos[None, :], dlens[:, None] - 1)
    slots = tables.long().gather(1, pos // block_size) * block_size + pos % block_size  # [D, ctx]
    heads = torch.arange(num_kv_heads, device=device)
    rows = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).view(-1)
    return AttentionLayout(q_lens, starts, lens, decode, rows, bias, ctx)


@dataclass(frozen=True)
class PreparedStep:
    """What the torch kernels derive from one step's metadata (`prepare_metadata`), shared by every layer.

    attention: the step's `AttentionLayout`. rope_cos, rope_sin: `[num_tokens, 1, rotary_dim / 2]` float32,
    the rotary table's rows at the step's positions (None for a model that rotates itself).
    """

    attention: AttentionLayout
    rope_cos: torch.Tensor | None
    rope_sin: torch.Tensor | None


def prepare_metadata(
    meta: AttentionMetadata,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor | None,
    block_size: int,
    num_kv_heads: int,
) -> PreparedStep:
    """Everything `paged_attention` and `rotary_embedding` derive from a step's metadata, built once per
    step by the model runner (host syncs, gather indices, masks, rotary rows) instead of once per layer.

    meta: the step's AttentionMetadata; positions: `[num_tokens]` int64; cos_sin_cache: the model's
    rotary table (`rope_cos_sin_cache`; None for a model that rotates itself, e.g. transformers' own);
    block_size, num_kv_heads: of this rank's KV cache.
    """
    layout = attention_layout(
        meta.block_tables, meta.query_start_loc, meta.seq_lens, block_size, num_kv_heads
    )
    if cos_sin_cache is None:
        return PreparedStep(layout, None, None)
    return PreparedStep(layout, *_rope_tables(positions, cos_sin_cache))


def check_window_and_soft_cap(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """Raise ValueError unless `sliding_window` is None or at least 1 and `logits_soft_cap` None or > 0."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(
            f"sliding_window must be at least 1 (the query's own position); got {sliding_window}"
        )
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive; got {logits_soft_cap}")


def soft_cap(scores: torch.Tensor, logits_soft_cap: float | None) -> torch.Tensor:
    """Gemma 2's attention soft-capping: `cap * tanh(scores / cap)` (scores already scaled), or the
    scores unchanged when `logits_soft_cap` is None."""
    if logits_soft_cap is None:
        return scores
    return torch.tanh(scores / logits_soft_cap) * logits_soft_cap


def _windowed_decode_rows(
    layout: AttentionLayout, num_kv_heads: int, sliding_window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode gather rows and bias of `layout` cut to the last `sliding_window` positions of each
    sequence (a window shorter than `layout.ctx`): `[D * kvh * sliding_window]` rows and
    `[D, 1, 1, sliding_window]` bias. Sequence `b` keeps positions `max(0, len_b - W) ..`, whose last
    index is below `ctx`; positions at or past `len_b` keep their padding rows and `-inf` bias."""
    num_decode, device = len(layout.decode), layout.decode_rows.device
    begins = torch.tensor([max(0, layout.seq_lens[b] - sliding_window) for b in layout.decode], device=device)
    index = begins[:, None] + torch.arange(sliding_window, device=device)  # [D, W]
    rows = layout.decode_rows.view(num_decode, num_kv_heads, layout.ctx)
    rows = rows.gather(2, index[:, None, :].expand(-1, num_kv_heads, -1)).reshape(-1)
    return rows, layout.decode_bias.gather(3, index[:, None, None, :])


def _decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layout: AttentionLayout,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per decode sequence over its paged K/V.

    q: `[D, kvh, g, d]` (grouped-query heads folded into the query axis, so K/V are never repeated).
    Returns `[D, kvh, g, d]` in q's dtype.

    K, then V, are gathered into padded head-major copies `[D, kvh, ctx, d]` by one `index_select`
    over `(slot, kv head)` rows of `head_dim` values (a gather of whole slots followed by a transpose
    would copy everything twice); each copy is used right after it is made, while it is still in
    cache. With a sliding window shorter than `ctx` only each sequence's last `sliding_window`
    positions are gathered. The q.k products come out of the matmul in the cache dtype (as in
    transformers' eager attention); scaling, soft-capping and masking are float32, the softmax is
    float32, and the probabilities are cast to the value dtype for the second matmul, as
    flash-attention kernels do. Two batched matmuls beat `scaled_dot_product_attention` with a mask on
    CPU by about 2x here.
    """
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    rows, bias, width = layout.decode_rows, layout.decode_bias, layout.ctx
    if sliding_window is not None and sliding_window < layout.ctx:
        rows, bias = _windowed_decode_rows(layout, num_kv_heads, sliding_window)
        width = sliding_window
    shape = (len(layout.decode), num_kv_heads, width, head_dim)

    def gather(cache: torch.Tensor) -> torch.Tensor:
        return cache.view(-1, head_dim).index_select(0, rows).view(shape)

    scores = torch.matmul(q, gather(key_cache).transpose(-1, -2))
    if logits_soft_cap is None:
        scores = torch.add(bias, scores, alpha=scale)
    else:
        scores = soft_cap(scores.float() * scale, logits_soft_cap) + bias
    probs = scores.softmax(dim=-1).to(value_cache.dtype)  # [D, kvh, g, width]
    return torch.matmul(probs, gather(value_cache))


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
    prepared: PreparedStep | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over each sequence's paged K/V, with grouped-query attention.

    query: `[num_tokens, num_heads, head_dim]`; `num_heads` is a multiple of the caches' `num_kv_heads`.
    block_tables: `[num_seqs, max_blocks_per_seq]` int32. query_start_loc: `[num_seqs + 1]` int32.
    seq_lens: `[num_seqs]` int32, context length including this step's tokens.
    max_query_len, max_seq_len: Python ints, the maxima of the per-sequence query and context lengths.
    prepared: this step's `prepare_metadata` (None: derived here, for this call only); it does not
    depend on the window, so layers with and without one share it.
    sliding_window: None, or `W >= 1`: the row at position `p` attends only to positions `k` with
    `p - W < k <= p` (W keys including its own; transformers' `sliding_window_overlay`,
    `kv_idx > q_idx - sliding_window`, on top of the causal mask). Blocks wholly before a row's window
    are not read.
    logits_soft_cap: None, or `cap > 0`: each score `s = scale * q.k` becomes `cap * tanh(s / cap)`
    before the mask and the softmax (Gemma 2; transformers' `gemma2.eager_attention_forward`).
    Returns `[num_tokens, num_heads, head_dim]` in the query's dtype.
    Raises ValueError for a window below 1 or a cap that is not positive.

    Query row `i` of sequence `b` sits at absolute position `p = seq_lens[b] - q_len + i` and attends to
    positions `0 ..= p`, or `max(0, p - W + 1) ..= p` with a window (decode: `q_len == 1`; prefill and
    chunked prefill: `q_len > 1`). Decode rows are computed as one padded batch; sequences with
    `q_len > 1` one at a time, so a mixed step pays no padding for its long prefills.
    """
    check_window_and_soft_cap(sliding_window, logits_soft_cap)
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    groups = num_heads // num_kv_heads
    if prepared is None:
        layout = attention_layout(block_tables, query_start_loc, seq_lens, block_size, num_kv_heads)
    else:
        layout = prepared.attention
    q_lens, starts, lens, decode = layout.q_lens, layout.starts, layout.seq_lens, layout.decode
    out = torch.empty_like(query)

    if decode:
        all_decode = len(decode) == len(lens)
        q = query if all_decode else query[[starts[b] for b in decode]]
        q = q.view(len(decode), num_kv_heads, groups, -1)  # [D, kvh, g, d]
        o = _decode_attention(q, key_cache, value_cache, layout, scale, sliding_window, logits_soft_cap)
        o = o.reshape(len(decode), num_heads, -1)
        if all_decode:
            return o
        out[[starts[b] for b in decode]] = o

    prefill_attention(
        out, query, key_cache, value_cache, block_tables, q_lens, starts, lens, scale,
        sliding_window, logits_soft_cap,
    )  # fmt: skip
    return out


def prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_lens: list[int],
    starts: list[int],
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """The rows of sequences with `q_len > 1` (prefill, chunked prefill) of `paged_attention`, written
    into `out` in place, one sequence at a time with torch's flash-attention kernel for CPU (or, with a
    soft cap, which it cannot apply, two matmuls and a float32 softmax); rows of decode sequences are
    left as they are. The `torch` backend's, and the `cpu` backend's with a sliding window or a soft cap
    (`csrc/attention.cpp` runs the others).

    out, query: `[num_tokens, num_heads, head_dim]`. q_lens, starts, seq_lens: per sequence, Python ints
    (query rows `starts[b] : starts[b] + q_lens[b]`, `seq_lens[b]` tokens of context). sliding_window,
    logits_soft_cap: as in `paged_attention`; the blocks before the first row's window are not gathered.
    """
    block_size = key_cache.shape[1]
    for b, q_len in enumerate(q_lens):
        if q_len == 1:
            continue
        seq_len = seq_lens[b]
        first = seq_len - q_len  # position of the chunk's first row
        # Whole blocks before the first row's window are seen by no row of the chunk.
        skip = 0 if sliding_window is None else max(0, first - sliding_window + 1) // block_size
        table = block_tables[b : b + 1, skip:]
        k = _gather_kv(key_cache, table, seq_len - skip * block_size)[0]  # [n, kvh, d]
        v = _gather_kv(value_cache, table, seq_len - skip * block_size)[0]
        q = query[starts[b] : starts[b] + q_len]  # [q_len, h, d]
        q = q.transpose(0, 1)  # [h, q_len, d]
        k = k.transpose(0, 1)  # [kvh, n, d]
        v = v.transpose(0, 1)
        if q_len == seq_len and sliding_window is None and logits_soft_cap is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Row i at position first + i sees key k (absolute) when k <= first + i, and within the window.
            pos = torch.arange(first, seq_len, device=query.device)[:, None]
            keys = torch.arange(skip * block_size, seq_len, device=query.device)[None, :]
            mask = keys <= pos
            if sliding_window is not None:
                mask &= keys > pos - sliding_window
            if logits_soft_cap is None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            else:
                o = _soft_capped_attention(q, k, v, mask, scale, logits_soft_cap)
        out[starts[b] : starts[b] + q_len] = o.transpose(0, 1)


def _soft_capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    logits_soft_cap: float,
) -> torch.Tensor:
    """Grouped-query attention with soft-capped scores: q.k in float32 (as the flash-attention kernel
    of the uncapped path accumulates it), then scale, soft cap, mask and softmax in float32; the
    probabilities are cast to the value dtype for the second matmul.

    q: `[h, q_len, d]`; k, v: `[kvh, n, d]`; mask: `[q_len, n]` bool, True where a row may attend (every
    row attends somewhere). Returns `[h, q_len, d]` in q's dtype.
    """
    num_heads, q_len, head_dim = q.shape
    num_kv_heads, n = k.shape[0], k.shape[1]
    # Query head h reads KV head h // groups: fold each group's heads into the row axis.
    scores = torch.matmul(q.reshape(num_kv_heads, -1, head_dim).float(), k.float().transpose(-1, -2))
    scores = soft_cap(scores * scale, logits_soft_cap).view(num_heads, q_len, n)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs.view(num_kv_heads, -1, n), v).view(num_heads, q_len, head_dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) as in Llama: computed in float32, cast back.

    x: `[num_tokens, hidden_size]`; weight: `[hidden_size]`. Returns x's shape and dtype.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual = x + residual; return rms_norm(residual), residual`.

    x, residual: `[num_tokens, hidden_size]`; weight: `[hidden_size]`.
    Returns (normalized, new residual), both `[num_tokens, hidden_size]` in x's dtype.
    """
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rope_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Rotary-embedding table `[max_position, rotary_dim]`: cos in the first half, sin in the second.

    rotary_dim: the rotated width of a head (head_dim, or head_dim x `partial_rotary_factor`).
    rope_scaling: a Hugging Face `rope_scaling` dict or None; its kinds are `rope_inv_freq`'s. For the
    two whose angles depend on the sequence's length, `seq_len` picks the table: LongRoPE's long factors
    when it exceeds `original_max_position_embeddings` (else the short ones), dynamic NTK's base for a
    sequence of that length (None: `max_position`, the unscaled base).
    """
    # float32 throughout, as transformers computes it, so greedy outputs match it token for token.
    inv_freq, attention_factor = rope_inv_freq(rotary_dim, base, rope_scaling, max_position, seq_len)
    positions = torch.arange(max_position, dtype=torch.float32)
    if rope_kind(rope_scaling) == "linear":
        positions = positions / rope_scaling["factor"]
    return rope_rows(positions, inv_freq, attention_factor).to(dtype)


def rope_rows(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0) -> torch.Tensor:
    """Rows of a rotary table: positions `[n]` float32, inv_freq `[rotary_dim / 2]` float32 -> `[n,
    rotary_dim]` float32 (cos of each angle `position * inv_freq`, then sin, both times the
    attention factor)."""
    freqs = torch.outer(positions, inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat([cos, sin], dim=-1)


def rope_kind(rope_scaling: dict | None) -> str:
    """A `rope_scaling` dict's `rope_type` (or the older `type`); `default` for None."""
    return (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))


# Rope kinds whose angles depend on the length of the sequence, not only on the position.
LENGTH_DEPENDENT_ROPE = ("longrope", "dynamic")


def rope_inv_freq(
    rotary_dim: int,
    base: float,
    rope_scaling: dict | None,
    max_position: int,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies `[rotary_dim / 2]` float32, attention factor) of a rope kind, computed as
    transformers' `ROPE_INIT_FUNCTIONS` do so that tokens match it:

    - `default` and `linear` (whose positions the caller divides by `factor`);
    - `llama3` (Llama 3.1): wavelengths above `original_max_position_embeddings / low_freq_factor` are
      divided by `factor`, below `... / high_freq_factor` kept, smoothly interpolated between;
    - `yarn` (`_yarn_inv_freq`);
    - `longrope` (Phi-3/4, arXiv:2402.13753): `inv_freq / short_factor` for sequences up to
      `original_max_position_embeddings` tokens, `/ long_factor` past it (`seq_len`); attention factor
      `sqrt(1 + ln(factor) / ln(original))`, factor `max_position / original` unless given;
    - `dynamic` NTK: base x `(factor * seq_len / max_position - (factor - 1)) ** (d / (d - 2))` for a
      sequence of `seq_len > max_position` tokens, else the base unchanged.

    max_position: the config's `max_position_embeddings`. Raises ValueError for another kind.
    """
    rope_type = rope_kind(rope_scaling)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if rope_type == "dynamic" and seq_len is not None and seq_len > max_position:
        length = torch.tensor(seq_len)
        factor = rope_scaling["factor"]
        # As transformers: the scaled base is a float32 tensor (its arithmetic in float32).
        base = base * ((factor * length / max_position) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    inv_freq = 1.0 / (base**exponents)
    if rope_type in ("default", "linear", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "llama3":
        factor = rope_scaling["factor"]
        low = rope_scaling.get("low_freq_factor", 1.0)
        high = rope_scaling.get("high_freq_factor", 4.0)
        old_len = rope_scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(middle, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, base, rope_scaling, max_position)
    if rope_type == "longrope":
        original = rope_scaling["original_max_position_embeddings"]
        factor = rope_scaling.get("factor") or max_position / original
        attention_factor = rope_scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        long = seq_len is not None and seq_len > original
        ext = torch.tensor(rope_scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        if ext.shape != (rotary_dim // 2,):
            raise ValueError(
                f"rope_scaling {'long_factor' if long else 'short_factor'} has {ext.numel()} numbers; "
                f"the rotated width {rotary_dim} needs {rotary_dim // 2}"
            )
        return 1.0 / (ext * base**exponents), float(attention_factor)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported")


def _yarn_inv_freq(
    head_dim: int, base: float, rope_scaling: dict, max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, arXiv:2309.00071): per dimension, interpolated frequencies (divided by
    `factor`) below the `beta_slow` rotations, original ones above `beta_fast`, a linear ramp between
    (the correction range over `original_max_position_embeddings`); cos and sin scaled by the attention
    factor (0.1 ln(factor) + 1, or mscale / mscale_all_dim's ratio). Computed as transformers'
    `_compute_yarn_parameters` does, so tokens match it."""
    original = rope_scaling.get("original_max_position_embeddings") or max_position
    factor = rope_scaling.get("factor") or max_position / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _rope_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each token's position: `[num_tokens, 1, rotary_dim / 2]` float32 each."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    return cos[:, None, :], sin[:, None, :]


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    prepared: PreparedStep | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embedding (Su et al. 2021) in the GPT-NeoX layout Llama uses: the first and
    second halves of the rotated width are the rotated pairs.

    positions: `[num_tokens]` int64. query: `[num_tokens, num_heads, head_dim]`;
    key: `[num_tokens, num_kv_heads, head_dim]`. cos_sin_cache: `[max_position, rotary_dim]` float32
    (see `rope_cos_sin_cache`), rotary_dim even and at most head_dim: the first rotary_dim dims of each
    head are rotated, the rest pass unchanged (`partial_rotary_factor`, as Phi-4-mini). prepared: this
    step's `prepare_metadata`, whose rotary rows are used (None: looked up here). Returns rotated
    (query, key) in their dtypes.
    """
    if prepared is None:
        cos, sin = _rope_tables(positions, cos_sin_cache)
    else:
        cos, sin = prepared.rope_cos, prepared.rope_sin
    rotary_dim = 2 * cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :rotary_dim].float().chunk(2, dim=-1)
        rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        return torch.cat([*rotated, x[..., rotary_dim:].float()], dim=-1).to(x.dtype)

    return rotate(query), rotate(key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: `silu(x[:, :I]) * x[:, I:]`. x: `[num_tokens, 2 * I]` -> `[num_tokens, I]`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's gate with tanh GELU (Gemma's `gelu_pytorch_tanh`): `gelu_tanh(x[:, :I]) * x[:, I:]`.
    x: `[num_tokens, 2 * I]` -> `[num_tokens, I]`."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """A mixture-of-experts MLP over the experts the router chose: for each token t,
    `sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))` with `e = topk_ids[t, j]`
    (vLLM's `fused_moe` contract; SwiGLU experts as Qwen-MoE, Mixtral and OLMoE have them).

    The (token, choice) pairs are sorted by expert, so each expert the step uses runs one matmul over
    all its tokens, in expert order (the order transformers' eager experts add them up); experts no
    token chose are not read. hidden: `[num_tokens, hidden_size]`; w13: `[num_experts,
    2 * intermediate_size, hidden_size]`, gate rows then up rows; w2: `[num_experts, hidden_size,
    intermediate_size]`; topk_weights: `[num_tokens, top_k]` float32; topk_ids: `[num_tokens, top_k]`
    int64 in [0, num_experts). Returns `[num_tokens, hidden_size]` in hidden's dtype, the weighted sum
    accumulated in float32.
    """
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order].float()
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        expert_out = F.linear(silu_and_mul(F.linear(hidden[rows], w13[expert])), w2[expert])
        out.index_add_(0, rows, expert_out.float() * weights[start : start + count, None])
        start += count
    return out.to(hidden.dtype)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    indices: torch.Tensor,
    output_slices: tuple[int, ...] | None = None,
    slot_ranks: list[int] | None = None,
) -> torch.Tensor:
    """The LoRA deltas of many adapters in one batch (Hu et al. 2021): for each token row t with
    `i = indices[t] >= 0`, `y[t] += B_i (A_i x[t])`; rows with `indices[t] < 0` (the base model's) are
    left as they are.

    A projection fused from S slices (q/k/v, gate/up) has one A and one B per slice: `output_slices`
    gives the slices' widths (summing to `out_features`; None: one slice). lora_a stacks the slices'
    A matrices, `[num_slots, S * R, in_features]`, so one shrink gives every slice's `mid = A x`;
    lora_b holds every B transposed side by side, `[num_slots, R, out_features]`, so output column c of
    slice s is `sum_r mid[s * R + r] * lora_b[i, r, c]` (no zero blocks, and the expand reads B along
    its output columns). The LoRA scaling (`lora_alpha / r`) is folded into lora_b by the caller; an
    adapter of rank below R has zeros past its rank, which `slot_ranks` (each slot's rank, 0 for a slot
    whose adapter does not adapt this projection; None: R each) lets a backend skip: the sum is the same.

    The rows are sorted by adapter, so each adapter the step uses runs one shrink and one expand over
    all its rows (the segmented form of Punica's SGMV, Chen et al. 2023). y: `[num_tokens,
    out_features]`, updated in place and returned; x: `[num_tokens, in_features]`; lora_a, lora_b in
    y's dtype; indices: `[num_tokens]` int64 in [-1, num_slots). The delta is computed in float32 and
    added in float32 before one rounding to y's dtype.
    """
    slices = output_slices or (y.shape[1],)
    rank = lora_b.shape[1]
    flat = indices.to(torch.long)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat + 1, minlength=lora_a.shape[0] + 1).tolist()
    start = counts[0]  # rows without an adapter sort first
    for slot, count in enumerate(counts[1:]):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        if slot_ranks is not None and slot_ranks[slot] == 0:
            continue
        mid = F.linear(x[rows].float(), lora_a[slot].float())  # [rows, S * R]
        b = lora_b[slot].float()
        delta = torch.cat(
            [mid[:, s * rank : (s + 1) * rank] @ part for s, part in enumerate(b.split(list(slices), dim=1))],
            dim=1,
        )
        y[rows] = (y[rows].float() + delta).to(y.dtype)
    return y
