"""The C++ layer loop (`kernels/csrc/decoder.cpp`, `conveyor.kernels.cpu.DecoderLayers`) against the
model's Python layers on the same C++ kernels: same hidden states and same KV cache writes, for a step
that mixes a prefill, a chunk of a longer context and decodes, and for a step of decodes only; with plain,
oneDNN-packed and panel-packed linear layers, and both chosen by row count (`kernels.selection`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conveyor.kernels import AttentionMetadata, cpu, onednn, selection
from conveyor.server.model.models.llama import LlamaForCausalLM
from conveyor.server.model.runner import fused_layer_loop
from tests.tiny_llama import HEAD_DIM, NUM_KV_HEADS, tiny_llama

BLOCK_SIZE, NUM_BLOCKS = 4, 16


def _mixed_step() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Sequence 0 prefills 6 tokens; sequence 1 decodes at context 9; sequence 2 computes tokens 5-11 of
    its prompt (a chunk after 5 cached ones); sequence 3 decodes at context 3."""
    q_lens, seq_lens = [6, 1, 7, 1], [6, 9, 12, 3]
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]], dtype=torch.int32)
    positions, slots = [], []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for pos in range(seq_len - q_len, seq_len):
            positions.append(pos)
            slots.append(int(tables[b, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    ids = torch.randint(0, 300, (len(slots),), generator=torch.Generator().manual_seed(2))
    return ids, torch.tensor(positions), meta


def _long_prefill_step() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Sequence 0 prefills 20 tokens (more rows than the decode kernel takes); sequence 1 decodes at
    context 9."""
    tables = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 0, 0]], dtype=torch.int32)
    positions = [*range(20), 8]
    rows = [0] * 20 + [1]
    slots = [
        int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
        for b, p in zip(rows, positions, strict=True)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        query_start_loc=torch.tensor([0, 20, 21], dtype=torch.int32),
        seq_lens=torch.tensor([20, 9], dtype=torch.int32),
        max_query_len=20,
        max_seq_len=20,
    )
    ids = torch.randint(0, 300, (len(slots),), generator=torch.Generator().manual_seed(4))
    return ids, torch.tensor(positions), meta


def _decode_step() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Three decodes at contexts 5, 12 and 1."""
    seq_lens = [5, 12, 1]
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=torch.int32)
    positions = [n - 1 for n in seq_lens]
    slots = [int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for b, p in enumerate(positions)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )
    ids = torch.randint(0, 300, (len(slots),), generator=torch.Generator().manual_seed(3))
    return ids, torch.tensor(positions), meta


def _caches(model: LlamaForCausalLM, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random cached keys and values (the context the decodes and the chunk attend to)."""
    generator = torch.Generator().manual_seed(4)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return [
        (torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))
        for _ in model.layers
    ]


# `CONVEYOR_CPU_KERNELS` per case: one kernel, or the panel kernel for decode steps (3 rows) and
# oneDNN for the mixed step (15 rows), switching within the step's layer list.
KERNELS = {"panel": "panel", "onednn": "onednn", "selected": "panel,onednn@8"}


# The decoder's features, as the families switch them on (2 layers; the window is shorter than the
# contexts of the steps below, and only the first layer slides where the family alternates).
FAMILIES = {
    "llama": {},
    "qwen3": {"qk_norm": True, "attention_bias": False},
    "granite": {"residual_multiplier": 0.22, "attention_multiplier": 0.0078125, "o_proj_bias": True},
    "mistral-window": {"sliding_window": 4, "sliding_layers": (True, True)},
    "gemma2": {
        "activation": "gelu_tanh",
        "sandwich_norms": True,
        "attn_logit_softcap": 5.0,
        "attention_multiplier": 0.2,
        "sliding_window": 4,
        "sliding_layers": (True, False),
    },
    "gemma3": {
        "activation": "gelu_tanh",
        "sandwich_norms": True,
        "qk_norm": True,
        "sliding_window": 5,
        "sliding_layers": (True, False),
        "local_rope_theta": 1000.0,
    },
}
# Gemma 3 with a window longer than every step's sequences (its 512 tokens on short prompts): the
# window cuts nothing, so the loop runs its prefill steps too.
FAMILIES["gemma3-wide-window"] = {**FAMILIES["gemma3"], "sliding_window": 64}


def _model(dtype: torch.dtype, linears: str, family: str = "llama") -> LlamaForCausalLM:
    model = tiny_llama(tie=False, dtype=dtype, ops=cpu, **FAMILIES[family])
    with torch.no_grad():  # norms away from 1 so a norm applied twice or skipped shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.linspace(-0.5, 0.5, param.numel()).view_as(param).to(dtype))
    if linears in KERNELS:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(selection.OVERRIDE_ENV, KERNELS[linears])
            selection.select_linear_kernels(model, dtype, panel=True)
    return model


def _fused_forward(loop, model: LlamaForCausalLM, ids, positions, caches, meta) -> torch.Tensor:
    """The model's forward pass through the C++ layer loop, as the runner calls it."""
    return loop(model.embed(ids), positions, model.cos_sin_cache, caches, meta)


CASES = [
    (torch.float32, "plain"),
    (torch.float32, "panel"),
    (torch.float32, "onednn"),
    (torch.float32, "selected"),
    (torch.bfloat16, "plain"),
    (torch.bfloat16, "panel"),
    (torch.bfloat16, "onednn"),
    (torch.bfloat16, "selected"),
]


@pytest.fixture(scope="module", autouse=True)
def _library() -> None:
    cpu.load_library()


@pytest.mark.parametrize("step", [_mixed_step, _decode_step], ids=["mixed", "decode"])
@pytest.mark.parametrize(("dtype", "linears"), CASES, ids=[f"{str(d)[6:]}-{k}" for d, k in CASES])
def test_layer_loop_equals_the_python_layers(dtype: torch.dtype, linears: str, step) -> None:
    if linears in ("onednn", "selected") and not onednn.packing_supported(dtype, torch.device("cpu")):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU")
    if linears in ("panel", "selected") and dtype == torch.bfloat16 and not cpu.bf16_matmul_supported():
        pytest.skip("the panel kernel runs bfloat16 only with AVX512_BF16")
    model = _model(dtype, linears)
    ids, positions, meta = step()
    python_caches, fused_caches = _caches(model, dtype), _caches(model, dtype)
    with torch.inference_mode():
        expected = model(ids, positions, python_caches, meta)
        fused = _fused_forward(
            fused_layer_loop(model, cpu, torch.device("cpu")), model, ids, positions, fused_caches, meta
        )
    assert fused.dtype == dtype and fused.shape == expected.shape
    # The same kernels in the same order: the same values, bit for bit.
    assert torch.equal(fused, expected)
    for (k1, v1), (k2, v2) in zip(python_caches, fused_caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize(
    "step", [_mixed_step, _decode_step, _long_prefill_step], ids=["mixed", "decode", "long-prefill"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_layer_loop_equals_the_python_layers_of_every_family(family: str, dtype: torch.dtype, step) -> None:
    """Each family's features in the loop, windows and soft caps included in steps whose multi-row
    sequences are short (draft tokens, short chunks: the decode kernel's, row by row); a step with a
    longer prefill of a model with sliding windows or soft caps is the Python layers' to run, and the
    loop says so."""
    model = _model(
        dtype, "selected" if onednn.packing_supported(dtype, torch.device("cpu")) else "plain", family
    )
    ids, positions, meta = step()
    loop = fused_layer_loop(model, cpu, torch.device("cpu"))
    window = model.shape.sliding_window
    decode_only = (
        window is not None and window < meta.max_seq_len
    ) or model.shape.attn_logit_softcap is not None
    if step is _long_prefill_step and decode_only:
        assert not loop.runs(meta.max_query_len, meta.max_seq_len)
        with torch.inference_mode(), pytest.raises(RuntimeError, match="runs the Python layers"):
            _fused_forward(loop, model, ids, positions, _caches(model, dtype), meta)
        return
    assert loop.runs(meta.max_query_len, meta.max_seq_len)
    python_caches, fused_caches = _caches(model, dtype), _caches(model, dtype)
    with torch.inference_mode():
        expected = model(ids, positions, python_caches, meta)
        fused = _fused_forward(loop, model, ids, positions, fused_caches, meta)
    assert torch.equal(fused, expected)
    for (k1, v1), (k2, v2) in zip(python_caches, fused_caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def _with_window_blocks(meta: AttentionMetadata) -> AttentionMetadata:
    """`meta` with the sliding layers' own blocks (`AttentionMetadata.window`): the same positions in
    other blocks (block b becomes NUM_BLOCKS - 1 - b)."""
    tables = NUM_BLOCKS - 1 - meta.block_tables
    blocks = meta.slot_mapping // BLOCK_SIZE
    slots = (NUM_BLOCKS - 1 - blocks) * BLOCK_SIZE + meta.slot_mapping % BLOCK_SIZE
    return dataclasses.replace(
        meta, window=dataclasses.replace(meta, slot_mapping=slots, block_tables=tables)
    )


@pytest.mark.parametrize("step", [_mixed_step, _decode_step], ids=["mixed", "decode"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gemma3-wide-window"])
def test_sliding_layers_with_blocks_of_their_own_read_and_write_them(family: str, step) -> None:
    """Where the sliding layers keep their K/V apart (Gemma 2/3 under the KV cache's window pool), they
    write and read it through the window's slots and tables, in the loop as in the Python layers: the
    sliding layer's keys land at the window slots (the same keys a step without a window pool writes at
    the main ones), and both paths agree bit for bit."""
    model = _model(torch.float32, "plain", family)
    ids, positions, meta = step()
    windowed = _with_window_blocks(meta)
    python_caches, fused_caches, plain_caches = (_caches(model, torch.float32) for _ in range(3))
    loop = fused_layer_loop(model, cpu, torch.device("cpu"))
    with torch.inference_mode():
        expected = model(ids, positions, python_caches, windowed)
        model(ids, positions, plain_caches, meta)
        if loop.runs(meta.max_query_len, meta.max_seq_len):
            fused = _fused_forward(loop, model, ids, positions, fused_caches, windowed)
            assert torch.equal(fused, expected)
            for (k1, v1), (k2, v2) in zip(python_caches, fused_caches, strict=True):
                assert torch.equal(k1, k2) and torch.equal(v1, v2)
    sliding = model.shape.sliding_layers.index(True)

    def keys(caches, slots):
        return caches[sliding][0].view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]

    assert torch.equal(
        keys(python_caches, windowed.window.slot_mapping), keys(plain_caches, meta.slot_mapping)
    )
    assert not torch.equal(keys(python_caches, meta.slot_mapping), keys(plain_caches, meta.slot_mapping))


def test_layer_loop_refuses_a_layer_it_cannot_call() -> None:
    spec = _model(torch.float32, "plain").decoder_spec()
    linears = list(spec.linears)
    linears[1] = torch.nn.Identity()
    with pytest.raises(TypeError, match="cannot call a Identity as a linear layer"):
        cpu.DecoderLayers(dataclasses.replace(spec, linears=linears))
    with pytest.raises(ValueError, match="not 'relu'"):
        cpu.DecoderLayers(dataclasses.replace(spec, activation="relu"))


def test_a_position_outside_the_rotary_table_is_an_error_not_a_crash() -> None:
    model = _model(torch.float32, "plain")
    loop = cpu.DecoderLayers(model.decoder_spec())
    ids, positions, meta = _decode_step()
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside the rotary table"):
        _fused_forward(loop, model, ids, positions + 1000, _caches(model, torch.float32), meta)
