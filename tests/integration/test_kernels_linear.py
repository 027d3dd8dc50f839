"""The C++ backend's linear kernels (`kernels/csrc/linear.cpp`, `conveyor.kernels.cpu.CPULinear`), float32
and bfloat16, against float64 matmuls, in the machine's own build and in an AVX2 and a scalar build of the same source
(compiled here under other op namespaces, so an AVX-512 machine checks the paths an AVX2 one runs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import cpu, selection
from tests.integration.conftest import cpu_build_ops
from tests.tiny_llama import forward_logits, tiny_llama

# (op namespace, compiler flags) of each build; "native" is the library the server loads.
BUILDS = {
    "native": None,
    "avx2": ("conveyor_linear_avx2", ["-O3", "-mavx2", "-mfma", "-mno-avx512f"]),
    "scalar": ("conveyor_linear_scalar", ["-O3", "-mno-avx", "-mno-avx2"]),
}
# 1536 and 1001 span several chunks of K (csrc/linear.cpp), 1001 with an odd last one.
SHAPES = [(576, 960), (1536, 576), (1001, 40), (100, 37), (64, 33), (7, 1)]  # (in_features, out_features)
NUM_TOKENS = [1, 3, 8, 13, 16, 17, 300]


@pytest.fixture(scope="module", params=list(BUILDS))
def ops(request: pytest.FixtureRequest):
    """The `conveyor_linear` ops of one build (compiled on first use, cached like the server's)."""
    return cpu_build_ops("linear.cpp", "CONVEYOR_LINEAR_NAMESPACE", BUILDS[request.param], "conveyor_linear")


def test_each_build_runs_its_own_instruction_set(ops, request: pytest.FixtureRequest):
    build = request.node.callspec.params["ops"]
    native = "avx512" if torch.cpu._is_avx512_supported() else "avx2"
    isa = ops.isa()
    assert isa == (native if build == "native" else build)
    assert ops.pack_weight(torch.zeros(5, 3), False).shape[2] == (32 if isa == "avx512" else 16)
    # AVX512_BF16's dot product only where the compiler was told the CPU has it.
    assert ops.bf16_dot() == (build == "native" and torch.cpu._is_avx512_bf16_supported())


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{k}x{n}" for k, n in SHAPES])
def test_linear_matches_a_float64_matmul(ops, shape, bf16: bool):
    in_features, out_features = shape
    torch.manual_seed(in_features * out_features)
    weight = torch.randn(out_features, in_features)
    if bf16:
        weight = weight.to(torch.bfloat16).float()  # the values a bfloat16 checkpoint holds
    bias = torch.randn(out_features)
    packed = ops.pack_weight(weight, bf16)
    assert packed.dtype == (torch.bfloat16 if bf16 else torch.float32)
    for num_tokens in NUM_TOKENS:
        x = torch.randn(num_tokens, in_features)
        for b in (None, bias):
            out = ops.linear(x, packed, b, out_features)
            truth = F.linear(x.double(), weight.double(), None if b is None else b.double())
            assert out.shape == (num_tokens, out_features) and out.dtype == torch.float32
            torch.testing.assert_close(out.double(), truth, atol=1e-5 * in_features**0.5, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{k}x{n}" for k, n in SHAPES])
def test_bfloat16_linear_matches_a_float64_matmul(ops, shape):
    """bfloat16 x and weight: float32 sums (an odd in_features pairs its last value with a zero), one
    rounding to bfloat16 per output."""
    in_features, out_features = shape
    torch.manual_seed(in_features * out_features + 1)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    packed = ops.pack_weight_bf16(weight)
    assert packed.dtype == torch.bfloat16 and packed.shape[1:] == ((in_features + 1) // 2, packed.shape[2], 2)
    for num_tokens in NUM_TOKENS:
        x = torch.randn(num_tokens, in_features, dtype=torch.bfloat16)
        for b in (None, bias):
            out = ops.linear(x, packed, b, out_features)
            truth = F.linear(x.double(), weight.double(), None if b is None else b.double())
            assert out.shape == (num_tokens, out_features) and out.dtype == torch.bfloat16
            torch.testing.assert_close(out.double(), truth, atol=1e-5 * in_features**0.5, rtol=2**-8)


def test_linear_takes_a_strided_input_and_no_rows(ops):
    weight = torch.randn(40, 24)
    packed = ops.pack_weight(weight, False)
    wide = torch.randn(5, 48)
    torch.testing.assert_close(ops.linear(wide[:, ::2], packed, None, 40), F.linear(wide[:, ::2], weight))
    assert ops.linear(torch.empty(0, 24), packed, None, 40).shape == (0, 40)
    weight = weight.bfloat16()
    packed = ops.pack_weight_bf16(weight)
    wide = wide.bfloat16()
    torch.testing.assert_close(
        ops.linear(wide[:, ::2], packed, None, 40).double(),
        F.linear(wide[:, ::2].double(), weight.double()),
        atol=1e-4,
        rtol=2**-8,
    )
    assert ops.linear(torch.empty(0, 24, dtype=torch.bfloat16), packed, None, 40).shape == (0, 40)


def test_bad_input_is_a_clear_error(ops):
    packed = ops.pack_weight(torch.randn(40, 24), False)
    with pytest.raises(RuntimeError, match="x has 23 features, the weight 24"):
        ops.linear(torch.randn(2, 23), packed, None, 40)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.linear(torch.randn(2, 24, dtype=torch.float64), packed, None, 40)
    with pytest.raises(RuntimeError, match="out_features 70 does not match"):
        ops.linear(torch.randn(2, 24), packed, None, 70)
    with pytest.raises(RuntimeError, match=r"bias must be \[40\]"):
        ops.linear(torch.randn(2, 24), packed, torch.randn(39), 40)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.pack_weight(torch.randn(40, 24, dtype=torch.float64), False)
    with pytest.raises(
        RuntimeError, match="a bfloat16 x needs a weight from this library's pack_weight_bf16"
    ):
        ops.linear(torch.randn(2, 24, dtype=torch.bfloat16), packed, None, 40)
    with pytest.raises(RuntimeError, match="a float32 x needs a weight from this library's pack_weight "):
        ops.linear(torch.randn(2, 24), ops.pack_weight_bf16(torch.randn(40, 24).bfloat16()), None, 40)
    with pytest.raises(RuntimeError, match="weight must be .* bfloat16"):
        ops.pack_weight_bf16(torch.randn(40, 24))


def test_cpu_linear_holds_bfloat16_only_where_that_is_exact():
    exact = nn.Linear(64, 48)
    exact.weight.data = exact.weight.data.to(torch.bfloat16).float()
    inexact = nn.Linear(64, 48)
    inexact.weight.data[0, 0] = 1 + 2**-12  # one value bfloat16 cannot hold
    x = torch.randn(6, 64)
    for linear, weight_dtype in ((exact, torch.bfloat16), (inexact, torch.float32)):
        module = cpu.CPULinear(linear)
        assert module.weight_dtype == weight_dtype
        torch.testing.assert_close(module(x), linear(x).detach(), atol=1e-5, rtol=1e-5)


def _select(model: nn.Module, dtype: torch.dtype, kernels: str) -> None:
    """The server's selection with its measurement overridden (`CONVEYOR_CPU_KERNELS=kernels`)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(selection.OVERRIDE_ENV, kernels)
        selection.select_linear_kernels(model, dtype, panel=True)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("exact", [True, False], ids=["bfloat16-checkpoint", "float32-checkpoint"])
def test_panel_layers_keep_the_model_output(exact: bool, tie: bool):
    dtype = torch.float32
    model, packed = (tiny_llama(tie, torch.bfloat16 if exact else dtype).to(dtype) for _ in range(2))
    _select(packed, dtype, "panel")
    panels = [m for m in packed.modules() if isinstance(m, cpu.CPULinear)]
    assert len(panels) == 4 * 2 + 1  # 4 per layer + the LM head
    assert {m.weight_dtype for m in panels} == {torch.bfloat16 if exact else torch.float32}
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    assert packed.embed_tokens.weight.dtype == dtype  # lookups keep the plain table
    torch.testing.assert_close(
        forward_logits(packed, dtype), forward_logits(model, dtype), atol=1e-5, rtol=1e-5
    )


def test_a_bfloat16_model_in_the_panel_kernel_keeps_its_output():
    """A model held in bfloat16: its linears run in the panel kernel where the CPU has AVX512_BF16's dot
    product (elsewhere the panel kernel is not offered), with the plain model's logits up to bfloat16
    rounding."""
    dtype = torch.bfloat16
    model, packed = (tiny_llama(False, dtype) for _ in range(2))
    if not cpu.bf16_matmul_supported():
        with pytest.raises(ValueError, match="'panel' is not a kernel this model can use here"):
            _select(packed, dtype, "panel")
        return
    _select(packed, dtype, "panel")
    assert sum(isinstance(m, cpu.CPULinear) for m in packed.modules()) == 4 * 2 + 1
    torch.testing.assert_close(
        forward_logits(packed, dtype).float(), forward_logits(model, dtype).float(), atol=0.05, rtol=0.05
    )
