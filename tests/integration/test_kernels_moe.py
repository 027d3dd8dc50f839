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
from tests.integration.test_kernels_backends import MOE_CASES, MOE_IDS, moe_case

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", MOE_CASES, ids=MOE_IDS)
def test_fused_moe_matches_the_reference(fused_moe, case, dtype):
    x, w13, w2, weights, ids = moe_case(*case, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    # The reference in float32 on the same (rounded) values: the kernel accumulates in float32.
    expected = ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), expected, **tol)


def test_fused_moe_refuses_an_expert_id_outside_the_experts(fused_moe):
    x, w13, w2, weights, ids = moe_case(*MOE_CASES[0], torch.float32)
    with pytest.raises(RuntimeError, match="expert id 8 outside"):
        fused_moe(x, w13, w2, weights, torch.full_like(ids, 8))
