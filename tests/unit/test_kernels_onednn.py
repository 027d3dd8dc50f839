"""oneDNN pre-packed linear layers (the CPU bfloat16 matmul path) against `torch.nn.functional.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import onednn
from conveyor.kernels import reference as ref
from conveyor.server.model.models.llama import AttentionMetadata, LlamaForCausalLM, ModelShape

CPU = torch.device("cpu")
needs_bf16_onednn = pytest.mark.skipif(
    not onednn.packing_supported(torch.bfloat16, CPU), reason="this CPU has no oneDNN bfloat16 support"
)


def test_packing_for_float32_and_native_bfloat16_on_cpu():
    assert onednn.packing_supported(torch.float32, CPU)
    assert onednn.packing_supported(torch.bfloat16, CPU) is onednn.cpu_bf16_native()
    assert not onednn.packing_supported(torch.float16, CPU)
    assert not onednn.packing_supported(torch.bfloat16, torch.device("cuda"))
    assert not onednn.packing_supported(torch.float32, torch.device("cuda"))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 16, 300])
def test_packed_float32_linear_matches_linear_to_rounding(num_tokens: int, bias: bool):
    torch.manual_seed(num_tokens)
    linear = nn.Linear(576, 960, bias=bias)
    x = torch.randn(num_tokens, 576)
    out = onednn.PackedLinear(linear)(x)
    assert out.shape == (num_tokens, 960) and out.dtype == torch.float32
    truth = F.linear(
        x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double()
    )
    torch.testing.assert_close(out.double(), truth, atol=1e-5, rtol=1e-5)


@needs_bf16_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 16, 300])
def test_packed_linear_matches_linear(num_tokens: int, bias: bool):
    torch.manual_seed(num_tokens)
    linear = nn.Linear(576, 960, bias=bias).to(torch.bfloat16)
    x = torch.randn(num_tokens, 576, dtype=torch.bfloat16)
    packed = onednn.PackedLinear(linear)
    out = packed(x)
    assert out.shape == (num_tokens, 960) and out.dtype == torch.bfloat16
    truth = F.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
    # bfloat16 output rounding only: both round the same float32 accumulation.
    torch.testing.assert_close(out.float(), truth, atol=0.05, rtol=0.01)
    torch.testing.assert_close(out, linear(x))


def _tiny_llama(tie: bool) -> LlamaForCausalLM:
    shape = ModelShape(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attention_bias=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(shape, ref)
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return model.eval()


@needs_bf16_onednn
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_pack_linear_layers_keeps_the_model_output(tie: bool):
    model = _tiny_llama(tie)
    packed = _tiny_llama(tie)  # same seed, same weights
    assert onednn.pack_linear_layers(packed) == 4 * 2 + 1  # qkv, o, gate_up, down per layer + LM head
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    assert packed.embed_tokens.weight.dtype == torch.bfloat16  # lookups keep the plain table

    num_tokens, block_size = 10, 16
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )
    ids = torch.randint(0, 300, (num_tokens,))
    logits = []
    for m in (model, packed):
        cache_shape = (1, block_size, 2, 16)
        caches = [
            (torch.zeros(cache_shape, dtype=torch.bfloat16), torch.zeros(cache_shape, dtype=torch.bfloat16))
            for _ in range(2)
        ]
        with torch.inference_mode():
            logits.append(m.compute_logits(m(ids, torch.arange(num_tokens), caches, meta)).float())
    torch.testing.assert_close(logits[1], logits[0])
