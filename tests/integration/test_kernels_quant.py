"""The C++ kernels on GGUF blocks (`kernels/csrc/quant.cpp`, `conveyor.kernels.quant`) against gguf-py's own
dequantization, for every block format and conveyor's per-channel INT8, in the machine's own build and in an AVX2 and a scalar build of the same
source (compiled here under other op namespaces, so an AVX-512 machine checks the paths an AVX2 one runs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from conveyor.kernels import cpu
from conveyor.kernels.quant import (
    BLOCK_TYPES,
    Int8Format,
    QuantizedLinear,
    QuantizedWeight,
    quantize_int8,
    random_weight,
)
from tests.integration.conftest import cpu_build_ops

BUILDS = {
    "native": None,
    "avx2": ("conveyor_quant_avx2", ["-O3", "-mavx2", "-mfma", "-mf16c", "-mno-avx512f"]),
    "scalar": ("conveyor_quant_scalar", ["-O3", "-mno-avx", "-mno-avx2", "-mno-f16c"]),
}
TYPES = [*sorted(BLOCK_TYPES), Int8Format.INT8]
NUM_TOKENS = [1, 2, 3, 5, 8, 17, 64]


@pytest.fixture(autouse=True)
def _seeded():
    """Fixed activations: every run checks the same inputs."""
    torch.manual_seed(0)


@pytest.fixture(scope="module", params=list(BUILDS))
def ops(request: pytest.FixtureRequest):
    """The `conveyor_quant` ops of one build (compiled on first use, cached like the server's)."""
    return cpu_build_ops("quant.cpp", "CONVEYOR_QUANT_NAMESPACE", BUILDS[request.param], "conveyor_quant")


def weight(qtype, rows: int, in_features: int, seed: int = 0) -> QuantizedWeight:
    """Random blocks (every bit random, float16 scales random) with values within about ±0.1; INT8 from
    a random float weight quantized per row, one row all zeros."""
    if qtype == Int8Format.INT8:
        dense = torch.from_numpy(np.random.default_rng(seed).uniform(-0.1, 0.1, (rows, in_features)))
        dense[rows // 2] = 0.0
        return quantize_int8(dense)
    return random_weight(qtype, rows, in_features, np.random.default_rng(seed), value_range=0.1)


def block_values(qtype) -> int:
    return 32 if qtype == Int8Format.INT8 else GGML_QUANT_SIZES[qtype][0]


def pack(ops, w: QuantizedWeight) -> torch.Tensor:
    return ops.pack([int(t) for t, _ in w.segments], [b for _, b in w.segments], w.in_features)


def test_each_build_runs_its_own_instruction_set(ops, request: pytest.FixtureRequest):
    build = request.node.callspec.params["ops"]
    native = "avx512" if torch.cpu._is_avx512_supported() else "avx2"
    assert ops.isa() == (native if build == "native" else build)
    assert ops.int8_dot() == (build != "scalar")


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantization_equals_gguf_bit_for_bit(ops, qtype):
    w = weight(qtype, 37, 512, seed=int(qtype))
    assert torch.equal(ops.dequantize(pack(ops, w)), w.dequantize())
    ids = torch.tensor([36, 0, 5, 5, 17])
    assert torch.equal(ops.embedding(pack(ops, w), ids), w.dequantize()[ids])


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_linear_matches_a_float64_matmul_by_both_methods(ops, qtype):
    in_features = 768 if block_values(qtype) == 256 else 96  # 3 blocks either way
    w = weight(qtype, 41, in_features, seed=int(qtype) + 100)
    dense = w.dequantize().double()
    packed = pack(ops, w)
    bias = torch.randn(41)
    scale = dense.abs().max().item()
    for num_tokens in NUM_TOKENS:
        x = torch.randn(num_tokens, in_features)
        truth = F.linear(x.double(), dense, bias.double())
        for method in (0, 1):
            out = ops.linear(x, packed, bias, method)
            assert out.shape == (num_tokens, 41) and out.dtype == torch.float32
            torch.testing.assert_close(out.double(), truth, rtol=1e-5, atol=1e-5 * in_features**0.5 * scale)
        # bfloat16 activations: the same float32 sums, rounded once.
        out = ops.linear(x.bfloat16(), packed, None, 0)
        assert out.dtype == torch.bfloat16
        truth = F.linear(x.bfloat16().double(), dense)
        torch.testing.assert_close(out.double(), truth, rtol=1e-2, atol=1e-2 * scale)


def quantize_x_like_llama_cpp(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 method sees it: each 32 values rounded to int8 steps of max|x| / 127 (to nearest
    even), back in float32."""
    blocks = x.reshape(-1, 32)
    top = blocks.abs().amax(dim=1, keepdim=True)
    inverse = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    return (torch.round(blocks * inverse) * (top / 127.0)).reshape(x.shape)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_the_int8_method_equals_a_matmul_on_rounded_activations(ops, qtype):
    """int8 dot products are exact integer sums: the result is the float64 matmul of the weight with x
    rounded to int8 per 32 values, up to float32 rounding of the per-block scales and sums, and up to
    one step of a value whose scaled x sits within float32 rounding of a tie (torch's division and the
    kernel's may land on either side: about one output in 10,000)."""
    in_features = 768 if block_values(qtype) == 256 else 192
    w = weight(qtype, 23, in_features, seed=int(qtype) + 200)
    packed = pack(ops, w)
    if not ops.int8_dot():
        with pytest.raises(RuntimeError, match="the int8 method needs AVX2"):
            ops.linear(torch.randn(1, in_features), packed, None, 2)
        return
    dense = w.dequantize().double()
    bias = torch.randn(23)
    scale = dense.abs().max().item()
    for num_tokens in NUM_TOKENS:
        x = torch.randn(num_tokens, in_features)
        x[0, :32] = 0.0  # an all-zero block
        out = ops.linear(x, packed, bias, 2)
        truth = F.linear(quantize_x_like_llama_cpp(x).double(), dense, bias.double())
        one_step = scale * x.abs().max().item() / 127
        torch.testing.assert_close(
            out.double(), truth, rtol=1e-5, atol=1e-5 * in_features**0.5 * scale + one_step
        )
        rounding = (out.double() - F.linear(x.double(), dense, bias.double())).norm() / truth.norm()
        assert rounding < 0.02  # what rounding x to 8 bits costs


def test_a_fused_layer_mixes_formats_row_by_row(ops):
    """A Q4_K_M file's q/k/v: Q4_K rows, then Q6_K rows, then Q4_K again, one packed weight."""
    q = weight(GGMLQuantizationType.Q4_K, 10, 256, seed=1)
    k = weight(GGMLQuantizationType.Q6_K, 3, 256, seed=2)
    v = weight(GGMLQuantizationType.Q4_K, 5, 256, seed=3)
    fused = QuantizedWeight.cat([q, k, v])
    assert fused.shape == (18, 256) and fused.type_names() == "Q4_K+Q6_K"
    dense = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    assert torch.equal(ops.dequantize(pack(ops, fused)), dense)
    x = torch.randn(4, 256)
    torch.testing.assert_close(
        ops.linear(x, pack(ops, fused), None, 0).double(), x.double() @ dense.double().T, rtol=1e-5, atol=1e-3
    )
    # Slicing and splitting keep the rows' bytes.
    parts = fused.split([10, 3, 5])
    assert [p.type_names() for p in parts] == ["Q4_K", "Q6_K", "Q4_K"]
    assert torch.equal(parts[1].dequantize(), k.dequantize())
    assert torch.equal(fused.rows(8, 4).dequantize(), dense[8:12])


def test_bad_input_is_refused_with_the_reason(ops):
    w = weight(GGMLQuantizationType.Q4_0, 4, 64)
    packed = pack(ops, w)
    with pytest.raises(RuntimeError, match=r"x must be \[num_tokens, 64\]"):
        ops.linear(torch.randn(2, 32), packed, None, 0)
    with pytest.raises(RuntimeError, match="packed quantized weight"):
        ops.linear(torch.randn(2, 64), torch.zeros(64, dtype=torch.uint8), None, 0)
    with pytest.raises(RuntimeError, match="token id 4 is outside the table's 4 rows"):
        ops.embedding(packed, torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match="not a whole number of 32-value blocks"):
        ops.pack([int(GGMLQuantizationType.Q4_0)], [torch.zeros(4, 18, dtype=torch.uint8)], 40)
    with pytest.raises(ValueError, match="Q4_0 rows of 64 values are 36 bytes"):
        QuantizedWeight(((GGMLQuantizationType.Q4_0, torch.zeros(4, 18, dtype=torch.uint8)),), 64)
    with pytest.raises(ValueError, match="not a block format"):
        QuantizedWeight(((GGMLQuantizationType.IQ2_XS, torch.zeros(1, 1, dtype=torch.uint8)),), 256)


def test_the_dequant_method_takes_a_large_weight_in_chunks_of_rows(ops):
    """A weight over the 8 MiB float32 chunk (3000 x 1024 rows: 2048 rows, then 952) gives the same
    outputs and bias as a whole matmul."""
    w = weight(GGMLQuantizationType.Q8_0, 3000, 1024, seed=7)
    x, bias = torch.randn(12, 1024), torch.randn(3000)
    truth = F.linear(x.double(), w.dequantize().double(), bias.double())
    out = ops.linear(x, pack(ops, w), bias, 1)
    torch.testing.assert_close(out.double(), truth, rtol=1e-5, atol=1e-4)


def test_int8_quantization_rounds_each_row_to_its_own_scale():
    """`quantize_int8`: per row d = max|w| / 127, |w - q * d| <= d / 2, the largest value exact up to
    float32 rounding; rows of other widths are refused."""
    dense = torch.randn(5, 64, dtype=torch.float64) * torch.tensor([[1e-3], [1.0], [30.0], [0.0], [2.0]])
    w = quantize_int8(dense.bfloat16())
    assert w.type_names() == "INT8" and w.nbytes == 5 * (4 + 64)
    step = dense.bfloat16().double().abs().amax(dim=1, keepdim=True) / 127
    error = (w.dequantize().double() - dense.bfloat16().double()).abs()
    assert (error <= step / 2 * (1 + 1e-6) + 1e-12).all()
    assert torch.equal(w.dequantize()[3], torch.zeros(64))
    with pytest.raises(ValueError, match="not a whole number of INT8 blocks of 32"):
        quantize_int8(torch.randn(2, 40))


def test_the_layer_modules_share_one_packed_weight():
    cpu.load_library()
    w = weight(GGMLQuantizationType.Q8_0, 6, 64)
    layer = QuantizedLinear(w, torch.randn(6))
    other = layer.with_method("dequant")
    assert other.packed.data_ptr() == layer.packed.data_ptr()
    assert other.bias.data_ptr() == layer.bias.data_ptr()
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), other(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="method must be one of"):
        layer.with_method("fast")
