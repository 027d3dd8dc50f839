"""oneDNN pre-packed linear layers (the CPU bfloat16 matmul path without AVX512_BF16 or without the C++
backend) against `torch.nn.functional.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import onednn
from tests.tiny_llama import forward_logits, tiny_llama

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


@needs_bf16_onednn
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_onednn_layers_keep_the_model_output(tie: bool, monkeypatch):
    """The kernel selection with oneDNN named for every layer (`CONVEYOR_CPU_KERNELS`) packs each linear
    layer, the LM head included, and the logits stay those of the plain layers."""
    from conveyor.kernels import selection

    monkeypatch.setenv(selection.OVERRIDE_ENV, "onednn")
    model = tiny_llama(tie, torch.bfloat16)
    packed = tiny_llama(tie, torch.bfloat16)  # same seed, same weights
    selection.select_linear_kernels(packed, torch.bfloat16, panel=False)
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    assert sum(isinstance(m, onednn.PackedLinear) for m in packed.modules()) == 4 * 2 + 1
    assert packed.embed_tokens.weight.dtype == torch.bfloat16  # lookups keep the plain table
    torch.testing.assert_close(forward_logits(packed, torch.bfloat16), forward_logits(model, torch.bfloat16))
