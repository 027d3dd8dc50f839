"""The C++ mixture-of-experts kernel (`kernels/csrc/moe.cpp`) against the torch reference
(`kernels.reference.fused_moe`): the machine's own build (`-march=native`, through the `cpu` backend)
and, under other op namespaces, an AVX2 build and one without vector instructions, on even and skewed
routing (every token to one expert, experts no token chose holding NaN), widths that are not whole
vectors, one token and many, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from torch.utils import cpp_extension

from conveyor.kernels import cpu
from conveyor.kernels import reference as ref

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="no C++ compiler")

BUILDS = {
    "avx2": ["-O3", "-mavx2", "-mfma", "-mno-avx512f"],
    "scalar": ["-O3", "-mno-avx", "-mno-avx2"],
}


@pytest.fixture(scope="module", params=["native", *BUILDS])
def fused_moe(request: pytest.FixtureRequest):
    """One build's `fused_moe` (the native one through the `cpu` backend; the others compiled on first
    use, cached like the server's)."""
    if request.param == "native":
        cpu.load_library()
        return cpu.fused_moe
    namespace = f"conveyor_moe_{request.param}"
    cpp_extension.load(
        name=f"{namespace}_{cpu._build_name()}",
        sources=[str(cpu.CSRC / "moe.cpp")],
        extra_cflags=[*BUILDS[request.param], "-fopenmp", f"-DCONVEYOR_MOE_NAMESPACE={namespace}"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )
    return getattr(torch.ops, namespace).fused_moe


# (tokens, hidden, intermediate, experts, top_k, routing)
CASES = [
    (1, 64, 32, 8, 2, "even"),
    (37, 40, 20, 8, 2, "even"),  # widths that are not whole vectors
    (19, 64, 48, 16, 4, "even"),
    (23, 32, 24, 8, 1, "one-expert"),  # every token to expert 3; the other experts hold NaN
    (12, 48, 16, 8, 2, "skewed"),  # experts 0 and 5 only; the rest hold NaN
]


def _case(tokens, hidden, width, experts, top_k, routing, dtype):
    g = torch.Generator().manual_seed(tokens * 31 + hidden)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * width, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, width, generator=g) / width**0.5
    weights = torch.rand(tokens, top_k, generator=g)
    if routing == "even":
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    elif routing == "one-expert":
        ids = torch.full((tokens, top_k), 3)
    else:
        ids = torch.tensor([[0, 5] if t % 3 else [5, 0] for t in range(tokens)])
    unused = [e for e in range(experts) if e not in set(ids.flatten().tolist())]
    w13[unused] = float("nan")
    w2[unused] = float("nan")
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}-E{c[3]}-top{c[4]}-{c[5]}" for c in CASES])
def test_fused_moe_matches_the_reference(fused_moe, case, dtype):
    x, w13, w2, weights, ids = _case(*case, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    # The reference in float32 on the same (rounded) values: the kernel accumulates in float32.
    expected = ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), expected, **tol)


def test_fused_moe_refuses_an_expert_id_outside_the_experts(fused_moe):
    x, w13, w2, weights, ids = _case(*CASES[0], torch.float32)
    with pytest.raises(RuntimeError, match="expert id 8 outside"):
        fused_moe(x, w13, w2, weights, torch.full_like(ids, 8))
