"""The torch reference kernels against independent formulations: `paged_attention` against
`scaled_dot_product_attention` over contiguous K/V, the rest against their textbook definitions and
transformers' own implementations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels import AttentionMetadata
from conveyor.kernels import reference as ref

# (num_heads, num_kv_heads, head_dim, block_size)
LAYOUTS = [(9, 3, 64, 16), (32, 8, 128, 32), (4, 4, 64, 16)]


def _scatter_to_paged(
    keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place each sequence's contiguous `[seq_len, kvh, d]` K/V into randomly chosen blocks of a fresh
    cache whose never-written slots hold NaN. Returns (key_cache, value_cache, block_tables)."""
    kvh, d = keys[0].shape[1:]
    blocks_per_seq = [-(-k.shape[0] // block_size) for k in keys]
    num_blocks = sum(blocks_per_seq) + 2  # spare blocks stay NaN
    perm = torch.randperm(num_blocks, generator=generator)
    key_cache = torch.full((num_blocks, block_size, kvh, d), float("nan"), dtype=keys[0].dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    block_tables = torch.zeros(len(keys), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        ids = perm[used : used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        block_tables[b, : len(ids)] = ids.int()
        for pos in range(k.shape[0]):
            key_cache[ids[pos // block_size], pos % block_size] = k[pos]
            value_cache[ids[pos // block_size], pos % block_size] = v[pos]
    # Padding entries point at block 0, whose unused slots are NaN too when block 0 is not fully used.
    return key_cache, value_cache, block_tables


def _sdpa_truth(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Full causal attention over all seq_len positions, keeping the last q_len rows: what the query
    rows of a chunk must see. q: `[q_len, h, d]`, k, v: `[seq_len, kvh, d]` -> `[q_len, h, d]`."""
    q_len, h, _ = q.shape
    seq_len, kvh, _ = k.shape
    # Queries for the positions before the chunk are placeholders; their rows are dropped.
    full_q = torch.cat([torch.zeros(seq_len - q_len, h, q.shape[2], dtype=q.dtype), q])
    k = k.repeat_interleave(h // kvh, dim=1)
    v = v.repeat_interleave(h // kvh, dim=1)
    out = F.scaled_dot_product_attention(
        full_q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)[seq_len - q_len :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "h{}_kv{}_d{}_bs{}".format(*x))
def test_paged_attention_matches_sdpa_on_contiguous_kv(layout: tuple[int, int, int, int], dtype: torch.dtype):
    num_heads, num_kv_heads, head_dim, block_size = layout
    g = torch.Generator().manual_seed(hash(layout) % 2**31)
    # (seq_len, q_len): decodes at 1, 15, 16, 17 and a few hundred tokens; a full prefill; chunks.
    shape = [(1, 1), (15, 1), (16, 1), (17, 1), (300, 1), (15, 15), (17, 5), (33, 33), (260, 40), (16, 16)]
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype) for s, _ in shape]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype) for s, _ in shape]
    queries = [torch.randn(q, num_heads, head_dim, generator=g).to(dtype) for _, q in shape]
    key_cache, value_cache, block_tables = _scatter_to_paged(keys, values, block_size, g)
    q_lens = torch.tensor([q for _, q in shape])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int()
    seq_lens = torch.tensor([s for s, _ in shape], dtype=torch.int32)
    scale = head_dim**-0.5

    out = ref.paged_attention(
        torch.cat(queries), key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        int(q_lens.max()), int(seq_lens.max()),
    )  # fmt: skip

    assert out.dtype == dtype and out.shape == (int(q_lens.sum()), num_heads, head_dim)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in range(len(shape)):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        truth = _sdpa_truth(queries[b].float(), keys[b].float(), values[b].float(), scale)
        torch.testing.assert_close(out[start:end].float(), truth, atol=tol, rtol=tol)


def test_paged_attention_decode_ignores_nan_in_unwritten_slots():
    """Regression: the decode path pads every sequence to the batch's longest context; slots past a
    shorter sequence's length (fresh cache memory, possibly NaN) used to turn its output into NaN."""
    g = torch.Generator().manual_seed(0)
    key_cache = torch.randn(6, 16, 2, 64, generator=g)
    value_cache = torch.randn(6, 16, 2, 64, generator=g)
    key_cache[2, 4:] = value_cache[2, 4:] = float("nan")  # past seq 0's 20 tokens, same block
    key_cache[0] = value_cache[0] = float("nan")  # the padding block of seq 0's table
    block_tables = torch.tensor([[1, 2, 0], [3, 4, 5]], dtype=torch.int32)
    query = torch.randn(2, 4, 64, generator=g)
    out = ref.paged_attention(
        query, key_cache, value_cache, block_tables, torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([20, 40], dtype=torch.int32), 0.125, 1, 40,
    )  # fmt: skip
    assert not out.isnan().any()
    k = torch.cat([key_cache[1], key_cache[2, :4]])
    v = torch.cat([value_cache[1], value_cache[2, :4]])
    torch.testing.assert_close(out[:1], _sdpa_truth(query[:1], k, v, 0.125))


def test_prepared_metadata_serves_every_layer_and_matches_deriving_it_per_call():
    """`prepare_metadata` derives the step's layout and rotary rows once; every layer (each with its own
    caches) gets the same attention and rotation from it as from deriving them in the call."""
    g = torch.Generator().manual_seed(2)
    caches = [
        (torch.randn(4, 16, 2, 64, generator=g), torch.randn(4, 16, 2, 64, generator=g)) for _ in range(2)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([29, 48]),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([30, 17], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=30,
    )
    positions = torch.tensor([29, 16])
    table = ref.rope_cos_sin_cache(64, 64, 10000.0)
    prepared = ref.prepare_metadata(meta, positions, table, 16, 2)
    assert prepared.attention.decode == [0, 1] and prepared.attention.seq_lens == [30, 17]
    query = torch.randn(2, 4, 64, generator=g)
    key = torch.randn(2, 2, 64, generator=g)

    def truth(key_cache, value_cache):
        rows = []
        for b, seq_len in enumerate([30, 17]):
            blocks = meta.block_tables[b].long()
            k = key_cache[blocks].reshape(-1, 2, 64)[:seq_len]
            v = value_cache[blocks].reshape(-1, 2, 64)[:seq_len]
            rows.append(_sdpa_truth(query[b : b + 1], k, v, 0.125))
        return torch.cat(rows)

    args = (meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125, 1, 30)
    for key_cache, value_cache in caches:  # two "layers", one prepared step
        out = ref.paged_attention(query, key_cache, value_cache, *args, prepared)
        torch.testing.assert_close(out, truth(key_cache, value_cache))
        torch.testing.assert_close(out, ref.paged_attention(query, key_cache, value_cache, *args))
        rotated = ref.rotary_embedding(positions, query, key, table, prepared)
        for got, want in zip(rotated, ref.rotary_embedding(positions, query, key, table), strict=True):
            torch.testing.assert_close(got, want)


def _dense_truth(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> torch.Tensor:
    """The attention of a chunk's rows straight from the definition, in float64: row i sits at position
    `p = seq_len - q_len + i`; its scores `s = scale * q.k` become `cap * tanh(s / cap)` (transformers'
    gemma2 eager attention) and it attends to keys `j <= p` with `j > p - W` (transformers'
    `sliding_window_overlay`). q: `[q_len, h, d]`, k, v: `[seq_len, kvh, d]` -> `[q_len, h, d]`."""
    q_len, h, _ = q.shape
    seq_len, kvh, _ = k.shape
    k = k.double().repeat_interleave(h // kvh, dim=1)
    v = v.double().repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    keys = torch.arange(seq_len)[None, :]
    visible = keys <= pos
    if sliding_window is not None:
        visible &= keys > pos - sliding_window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("sliding_window", "logits_soft_cap"),
    [
        (1, None),
        (5, None),
        (16, None),
        (40, None),
        (1000, None),
        (None, 1.5),
        (None, 50.0),
        (7, 2.0),
        (16, 1.0),
    ],
)
def test_paged_attention_window_and_soft_cap_match_the_definition(
    sliding_window: int | None, logits_soft_cap: float | None, dtype: torch.dtype
):
    """Sliding windows of 1, less than a block, exactly a block (16), more than a block and more than any
    context, soft caps, and both, over decodes, full prefills and chunks crossing the window's edge, in
    one mixed step and again as a step of decodes only; also with `prepare_metadata`'s layout, which
    knows no window."""
    g = torch.Generator().manual_seed(7 + (sliding_window or 0))
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 16
    shape = [(1, 1), (15, 1), (16, 1), (17, 1), (300, 1), (15, 15), (17, 5), (50, 50), (260, 40), (33, 2)]
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype) for s, _ in shape]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype) for s, _ in shape]
    # Scores of a few units, so that a cap of 1.5 or 2 bends most of them.
    queries = [(3 * torch.randn(q, num_heads, head_dim, generator=g)).to(dtype) for _, q in shape]
    key_cache, value_cache, block_tables = _scatter_to_paged(keys, values, block_size, g)
    scale = head_dim**-0.5
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    options = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
    decodes = [b for b, (_, q) in enumerate(shape) if q == 1]
    for seqs in (list(range(len(shape))), decodes):
        q_lens = torch.tensor([shape[b][1] for b in seqs])
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(int(q_lens.sum()), dtype=torch.long),
            block_tables=block_tables[seqs],
            query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int(),
            seq_lens=torch.tensor([shape[b][0] for b in seqs], dtype=torch.int32),
            max_query_len=int(q_lens.max()),
            max_seq_len=max(shape[b][0] for b in seqs),
        )
        args = (meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, meta.max_query_len)
        prepared = ref.prepare_metadata(meta, torch.zeros(0, dtype=torch.long), torch.zeros(1, 64), 16, 2)
        query = torch.cat([queries[b] for b in seqs])
        for step in (None, prepared):
            out = ref.paged_attention(query, key_cache, value_cache, *args, meta.max_seq_len, step, **options)
            assert out.dtype == dtype
            for i, b in enumerate(seqs):
                start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
                truth = _dense_truth(queries[b], keys[b], values[b], scale, sliding_window, logits_soft_cap)
                torch.testing.assert_close(out[start:end].float(), truth, atol=tol, rtol=tol)


def test_paged_attention_refuses_an_empty_window_or_a_cap_that_is_not_positive():
    args = (
        torch.randn(1, 2, 64), torch.randn(2, 16, 1, 64), torch.randn(2, 16, 1, 64),
        torch.tensor([[1]], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32), 0.125, 1, 3,
    )  # fmt: skip
    with pytest.raises(ValueError, match="sliding_window must be at least 1"):
        ref.paged_attention(*args, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap must be positive"):
        ref.paged_attention(*args, logits_soft_cap=0.0)


def test_reshape_and_cache_writes_only_mapped_slots():
    g = torch.Generator().manual_seed(1)
    key = torch.randn(5, 2, 8, generator=g)
    value = torch.randn(5, 2, 8, generator=g)
    key_cache = torch.full((3, 4, 2, 8), float("nan"))
    value_cache = torch.full((3, 4, 2, 8), float("nan"))
    slots = torch.tensor([9, 0, -1, 5, 11])
    ref.reshape_and_cache(key, value, key_cache, value_cache, slots)
    flat_k = key_cache.view(12, 2, 8)
    flat_v = value_cache.view(12, 2, 8)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[t]) and torch.equal(flat_v[slot], value[t])
    untouched = [s for s in range(12) if s not in (9, 0, 5, 11)]
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def test_rms_norm_matches_definition_and_fused_add():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 576, generator=g)
    residual = torch.randn(3, 576, generator=g)
    weight = torch.randn(576, generator=g)
    expected = weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(ref.rms_norm(x, weight, 1e-5), expected)
    normed, new_residual = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, ref.rms_norm(x + residual, weight, 1e-5))


def test_silu_and_mul_matches_definition():
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(3))
    gate, up = x[:, :5], x[:, 5:]
    torch.testing.assert_close(ref.silu_and_mul(x), gate * torch.sigmoid(gate) * up)


def test_gelu_tanh_and_mul_matches_definition_and_its_sigmoid_form():
    """0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) * up, and the sigmoid form the cpu and triton
    kernels compute, in float64."""
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4
    gate, up = x[:, :5], x[:, 5:]
    inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    torch.testing.assert_close(ref.gelu_tanh_and_mul(x), 0.5 * gate * (1 + torch.tanh(inner)) * up)
    torch.testing.assert_close(ref.gelu_tanh_and_mul(x), gate * torch.sigmoid(2 * inner) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_the_per_token_definition(dtype: torch.dtype):
    """Each token's output is the routing-weighted sum of its chosen experts' SwiGLU MLPs; experts no
    token chose (7 of 16 here) may hold anything (NaN) without touching the result."""
    g = torch.Generator().manual_seed(5)
    tokens, hidden, width, experts, top_k = 9, 32, 24, 16, 2
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * width, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, width, generator=g) / width**0.5).to(dtype)
    ids = torch.stack([torch.randperm(9, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    w13[9:] = float("nan")
    w2[9:] = float("nan")
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(top_k):
            e = ids[t, j]
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            expected[t] += weights[t, j] * (w2[e].float() @ (F.silu(gate) * up))
    out = ref.fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.float(), expected, **tol)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
    ids=["default", "linear", "llama3"],
)
def test_rope_cache_and_rotation_match_transformers(rope_scaling: dict | None):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, base, max_pos = 128, 500000.0, 9000
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        rope_theta=base,
        rope_scaling=rope_scaling,
    )
    cache = ref.rope_cos_sin_cache(head_dim, max_pos, base, rope_scaling)
    g = torch.Generator().manual_seed(4)
    positions = torch.tensor([0, 1, 17, 4095, 8191, 8999])
    q = torch.randn(len(positions), 4, head_dim, generator=g)
    k = torch.randn(len(positions), 2, head_dim, generator=g)
    rq, rk = ref.rotary_embedding(positions, q, k, cache)

    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])  # [1, T, d]
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    # transformers computes the angles in float32 (position * inv_freq), the reference in float64:
    # at position ~9000 the float32 angle is off by up to ~1e-3 rad.
    torch.testing.assert_close(rq, hq[0].transpose(0, 1), atol=5e-3, rtol=0)
    torch.testing.assert_close(rk, hk[0].transpose(0, 1), atol=5e-3, rtol=0)
    # Exactness where float32 angles are exact enough: small positions.
    torch.testing.assert_close(rq[:3], hq[0].transpose(0, 1)[:3], atol=1e-5, rtol=1e-5)


def test_rope_cache_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="rope_scaling type 'ntk-by-parts' is not supported"):
        ref.rope_cos_sin_cache(64, 16, 10000.0, {"rope_type": "ntk-by-parts", "factor": 4.0})


@pytest.mark.parametrize("seq_len", [None, 100, 4096, 4097, 20000])
def test_length_dependent_rope_frequencies_equal_transformers(seq_len):
    """LongRoPE (short factors up to the original context, long past it; partial rotary) and dynamic
    NTK (the base scaled for sequences past max_position_embeddings): the inverse frequencies and the
    attention factor equal transformers' `ROPE_INIT_FUNCTIONS` bit for bit at each length."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, rotary_dim = 64, 48  # partial_rotary_factor 0.75, as Phi-4-mini
    longrope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(rotary_dim // 2)],
        "long_factor": [1.5 + 0.5 * i for i in range(rotary_dim // 2)],
        "partial_rotary_factor": 0.75,
    }
    phi3 = transformers.Phi3Config(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        partial_rotary_factor=0.75,
        rope_parameters=longrope,
    )
    expected, factor = ROPE_INIT_FUNCTIONS["longrope"](phi3, "cpu", seq_len=seq_len)
    inv_freq, attention = ref.rope_inv_freq(
        rotary_dim, 10000.0, {**longrope, "original_max_position_embeddings": 4096}, 131072, seq_len
    )
    assert torch.equal(inv_freq, expected) and attention == factor
    assert attention == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)

    dynamic = {"rope_type": "dynamic", "factor": 4.0}
    llama = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        rope_scaling=dynamic,
    )
    length = None if seq_len is None else torch.tensor(seq_len)  # as transformers passes it
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](llama, "cpu", seq_len=length)
    inv_freq, attention = ref.rope_inv_freq(head_dim, 500000.0, dynamic, 4096, seq_len)
    assert torch.equal(inv_freq, expected) and attention == 1.0
    assert ref.rope_cos_sin_cache(head_dim, 8, 500000.0, dynamic, seq_len=seq_len).shape == (8, head_dim)


def test_rotary_embedding_rotates_only_the_rotary_width():
    """A table narrower than the head (partial rotary): the first rotary_dim dims rotate as a head of
    that width would, the rest pass unchanged."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 3, 64, generator=g), torch.randn(5, 1, 64, generator=g)
    positions = torch.tensor([0, 3, 7, 8, 30])
    table = ref.rope_cos_sin_cache(48, 32, 10000.0)
    rq, rk = ref.rotary_embedding(positions, q, k, table)
    full_q, full_k = ref.rotary_embedding(
        positions, q[..., :48].contiguous(), k[..., :48].contiguous(), table
    )
    assert torch.equal(rq[..., :48], full_q) and torch.equal(rk[..., :48], full_k)
    assert torch.equal(rq[..., 48:], q[..., 48:]) and torch.equal(rk[..., 48:], k[..., 48:])


def test_rope_cache_layout():
    cache = ref.rope_cos_sin_cache(8, 5, 10000.0)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2) / 8)
    angle = 3 * inv_freq
    torch.testing.assert_close(cache[3], torch.cat([angle.cos(), angle.sin()]))
    assert math.isclose(float(cache[0, 0]), 1.0)
