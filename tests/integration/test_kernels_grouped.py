"""The C++ kernels that run one small GEMM per group of token rows (`kernels/csrc/grouped.h`): the
mixture-of-experts MLP (`moe.cpp`, groups by expert) and the LoRA deltas (`lora.cpp`, groups by
adapter), against the torch references (`kernels.reference.fused_moe`, `add_lora`). Each in the
machine's own build (`-march=native`, the server's library) and, under other op namespaces, an AVX2
build and one without vector instructions; even and skewed routing (experts or adapter slots no row
uses hold NaN), widths that are not whole vectors, one row and many, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels import cpu
from conveyor.kernels import reference as ref
from tests.integration.conftest import cpu_build_ops
from tests.integration.test_kernels_backends import (
    LORA_CASES,
    LORA_IDS,
    MOE_CASES,
    MOE_IDS,
    lora_case,
    moe_case,
)

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="no C++ compiler")

FLAGS = {
    "native": None,
    "avx2": ["-O3", "-mavx2", "-mfma", "-mno-avx512f"],
    "scalar": ["-O3", "-mno-avx", "-mno-avx2"],
}
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict:
    """Both kernels accumulate in float32: the reference in float32 on the same (rounded) values."""
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


def _build(source: str, macro: str, native: str, name: str):
    flags = FLAGS[name]
    return cpu_build_ops(source, macro, None if flags is None else (f"{native}_{name}", flags), native)


@pytest.fixture(scope="module", params=list(FLAGS))
def fused_moe(request: pytest.FixtureRequest):
    return _build("moe.cpp", "CONVEYOR_MOE_NAMESPACE", "conveyor_moe", request.param).fused_moe


@pytest.fixture(scope="module", params=list(FLAGS))
def add_lora(request: pytest.FixtureRequest):
    return _build("lora.cpp", "CONVEYOR_LORA_NAMESPACE", "conveyor_lora", request.param).add_lora


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MOE_CASES, ids=MOE_IDS)
def test_fused_moe_matches_the_reference(fused_moe, case, dtype):
    x, w13, w2, weights, ids = moe_case(*case, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    expected = ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(out.float(), expected, **_tol(dtype))


def test_fused_moe_refuses_an_expert_id_outside_the_experts(fused_moe):
    x, w13, w2, weights, ids = moe_case(*MOE_CASES[0], torch.float32)
    with pytest.raises(RuntimeError, match="expert id 8 outside"):
        fused_moe(x, w13, w2, weights, torch.full_like(ids, 8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LORA_CASES, ids=LORA_IDS)
def test_add_lora_matches_the_reference(add_lora, case, dtype):
    y, x, lora_a, lora_b, indices, slices = lora_case(*case, dtype)
    expected = ref.add_lora(y.float().clone(), x.float(), lora_a.float(), lora_b.float(), indices, slices)
    out = add_lora(y, x, lora_a, lora_b, indices, list(slices), [])
    assert out.data_ptr() == y.data_ptr()
    torch.testing.assert_close(out.float(), expected, **_tol(dtype))


def test_add_lora_refuses_a_slot_outside_the_slots(add_lora):
    y, x, lora_a, lora_b, indices, slices = lora_case(*LORA_CASES[0], torch.float32)
    with pytest.raises(RuntimeError, match="adapter index 4 outside"):
        add_lora(y, x, lora_a, lora_b, torch.full_like(indices, 4), list(slices), [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_lora_reads_no_row_past_a_slots_rank(add_lora, dtype):
    """Slots of ranks 16, 5, 0 (an adapter that does not adapt this projection) and 1 in R = 16: rows
    past each rank hold NaN, which the result would show if they were read."""
    y, x, lora_a, lora_b, indices, slices = lora_case(*LORA_CASES[0], dtype)
    ranks, rank = [16, 5, 0, 1], lora_b.shape[1]
    for slot, r in enumerate(ranks):
        for s in range(len(slices)):
            lora_a[slot, s * rank + r : (s + 1) * rank] = float("nan")
        lora_b[slot, r:] = float("nan")
    zeroed_a, zeroed_b = lora_a.float().nan_to_num(0.0), lora_b.float().nan_to_num(0.0)
    base_rows = (indices < 0) | (indices == 2)
    expected = ref.add_lora(y.float().clone(), x.float(), zeroed_a, zeroed_b, indices, slices)
    before = y.clone()
    out = add_lora(y, x, lora_a, lora_b, indices, list(slices), ranks)
    assert torch.equal(out[base_rows], before[base_rows])
    torch.testing.assert_close(out.float(), expected, **_tol(dtype))
    assert torch.equal(
        ref.add_lora(before.clone(), x, lora_a, lora_b, indices, slices, ranks)[indices == 2],
        before[indices == 2],
    )
