"""The C++ layer loop (`kernels/csrc/decoder.cpp`, `conveyor.kernels.cpu.DecoderLayers`) against the
model's Python layers on the same C++ kernels: same hidden states and same KV cache writes, for a step
that mixes a prefill, a chunk of a longer context and decodes, and for a step of decodes only; with plain,
oneDNN-packed and panel-packed linear layers."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels import AttentionMetadata, cpu, onednn
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


def _model(dtype: torch.dtype, linears: str) -> LlamaForCausalLM:
    model = tiny_llama(tie=False, dtype=dtype, ops=cpu)
    if linears == "panel":
        cpu.pack_linear_layers(model)
    elif linears == "onednn":
        onednn.pack_linear_layers(model)
    return model


def _fused_forward(loop, model: LlamaForCausalLM, ids, positions, caches, meta) -> torch.Tensor:
    """The model's forward pass through the C++ layer loop, as the runner calls it."""
    return loop(
        model.embed(ids),
        positions,
        model.cos_sin_cache,
        caches,
        meta.slot_mapping,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
    )


CASES = [
    (torch.float32, "plain"),
    (torch.float32, "panel"),
    (torch.float32, "onednn"),
    (torch.bfloat16, "plain"),
    (torch.bfloat16, "panel"),
    (torch.bfloat16, "onednn"),
]


@pytest.fixture(scope="module", autouse=True)
def _library() -> None:
    cpu.load_library()


@pytest.mark.parametrize("step", [_mixed_step, _decode_step], ids=["mixed", "decode"])
@pytest.mark.parametrize(("dtype", "linears"), CASES, ids=[f"{str(d)[6:]}-{k}" for d, k in CASES])
def test_layer_loop_equals_the_python_layers(dtype: torch.dtype, linears: str, step) -> None:
    if linears == "onednn" and not onednn.packing_supported(dtype, torch.device("cpu")):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU")
    if linears == "panel" and dtype == torch.bfloat16 and not cpu.bf16_matmul_supported():
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


def test_layer_loop_refuses_a_layer_it_cannot_call() -> None:
    model = _model(torch.float32, "plain")
    norms, layers = model.layer_parts()
    layers[1] = torch.nn.Identity()
    with pytest.raises(TypeError, match="cannot call a Identity as a linear layer"):
        cpu.DecoderLayers(norms, layers, 4, NUM_KV_HEADS, 1e-5, HEAD_DIM**-0.5)


def test_a_position_outside_the_rotary_table_is_an_error_not_a_crash() -> None:
    model = _model(torch.float32, "plain")
    norms, layers = model.layer_parts()
    loop = cpu.DecoderLayers(norms, layers, 4, NUM_KV_HEADS, 1e-5, HEAD_DIM**-0.5)
    ids, positions, meta = _decode_step()
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside the rotary table"):
        _fused_forward(loop, model, ids, positions + 1000, _caches(model, torch.float32), meta)
