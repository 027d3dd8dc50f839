"""The C++ CPU kernels (`kernels/csrc/cpu_kernels.cpp`) built for AVX2 and without vector instructions,
against the torch reference: the server compiles with `-march=native`, so an AVX-512 machine runs only
its AVX-512 paths; these builds (under other op namespaces) check the paths an AVX2 machine, or one
with neither, runs. The machine's own build is checked in test_kernels_backends.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from conveyor.kernels import cpu
from conveyor.kernels import reference as ref
from tests.integration.test_kernels_backends import (
    DECODE_BATCH,
    DTYPES,
    LAYOUT_IDS,
    LAYOUTS,
    MIXED_BATCH,
    PagedBatch,
    _tol,
)

BUILDS = {
    "avx2": ["-O3", "-mavx2", "-mfma", "-mno-avx512f"],
    "scalar": ["-O3", "-mno-avx", "-mno-avx2"],
}


@pytest.fixture(scope="module", params=list(BUILDS))
def ops(request: pytest.FixtureRequest):
    """The `conveyor_cpu` ops of one build (compiled on first use, cached like the server's)."""
    namespace = f"conveyor_cpu_{request.param}"
    cpp_extension.load(
        name=f"{namespace}_{cpu._build_name()}",
        sources=[str(cpu.CSRC / "cpu_kernels.cpp")],
        extra_cflags=[*BUILDS[request.param], "-fopenmp", f"-DCONVEYOR_CPU_NAMESPACE={namespace}"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )
    return getattr(torch.ops, namespace)


# (sliding_window, logits_soft_cap): none, a window within a block, a soft cap, both.
OPTIONS = [(None, None), (5, None), (None, 1.5), (17, 2.0)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(("sliding_window", "logits_soft_cap"), OPTIONS)
def test_decode_attention(ops, layout, dtype, sliding_window, logits_soft_cap) -> None:
    """With a window, the blocks before it hold NaN: the walk must start at the window."""
    batch = PagedBatch(DECODE_BATCH, layout, dtype, seed=21)
    batch.query = batch.query * 3  # scores of a few units, which the caps bend
    truth = batch.truth(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    batch.poison_blocks_before_window(sliding_window or 10**6)
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_decode_attention(out, batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                               batch.seq_lens, None, None, batch.scale, sliding_window,
                               logits_soft_cap)  # fmt: skip
    torch.testing.assert_close(out.float(), truth, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(("sliding_window", "logits_soft_cap"), OPTIONS)
def test_decode_rows_of_a_mixed_step(ops, layout, dtype, sliding_window, logits_soft_cap) -> None:
    """Only the decode rows are written (the prefill rows keep their NaN)."""
    batch = PagedBatch(MIXED_BATCH, layout, dtype, seed=22)
    rows = batch.decode_rows()
    seqs = [b for b, q in enumerate(batch.q_lens) if q == 1]
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_decode_attention(out, batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                               batch.seq_lens, torch.tensor(seqs), torch.tensor(rows), batch.scale,
                               sliding_window, logits_soft_cap)  # fmt: skip
    truth = batch.truth(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    torch.testing.assert_close(out[rows].float(), truth[rows], **_tol(dtype))
    others = [r for r in range(out.shape[0]) if r not in rows]
    assert out[others].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norms_rotary_and_silu(ops, dtype) -> None:
    g = torch.Generator().manual_seed(23)
    x, residual = (torch.randn(13, 576, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=g).to(dtype)
    tol = _tol(dtype)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5), **tol)
    for got, want in zip(
        ops.fused_add_rms_norm(x, residual, weight, 1e-5),
        ref.fused_add_rms_norm(x, residual, weight, 1e-5),
        strict=True,
    ):
        torch.testing.assert_close(got, want, **tol)
    query = torch.randn(13, 9, 64, generator=g).to(dtype)
    key = torch.randn(13, 3, 64, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (13,), generator=g)
    for rotary_dim in (64, 48):  # the whole head, and 3/4 of it (partial rotary)
        table = ref.rope_cos_sin_cache(rotary_dim, 4096, 10000.0, None)
        for got, want in zip(
            ops.rotary_embedding(positions, query, key, table),
            ref.rotary_embedding(positions, query, key, table),
            strict=True,
        ):
            torch.testing.assert_close(got, want, **tol)
    gate_up = torch.randn(13, 2 * 1536 + 2, generator=g).to(dtype)[:, :-2]  # a strided view
    torch.testing.assert_close(ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **tol)
    torch.testing.assert_close(ops.gelu_tanh_and_mul(gate_up), ref.gelu_tanh_and_mul(gate_up), **tol)


def test_compile_flags_follow_disable_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, disabled in (("", False), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(cpu.DISABLE_AVX512_ENV, value)
        assert cpu.avx512_disabled() is disabled
        assert ("-mno-avx512f" in cpu.compile_flags()) is disabled
        assert cpu._build_name().endswith("_noavx512") is disabled


def test_server_library_without_avx512() -> None:
    """CONVEYOR_CPU_DISABLE_AVX512 (as vLLM's VLLM_CPU_DISABLE_AVX512): the server's whole library built
    without AVX-512 under its own cache name runs the AVX2 paths (the scalar ones on a CPU without AVX2)
    and agrees with torch. In a subprocess: one process loads one build of the op namespaces."""
    script = (
        "import torch\n"
        "from conveyor.kernels import cpu\n"
        "cpu.load_library()\n"
        "g = torch.Generator().manual_seed(24)\n"
        "x, w = torch.randn(5, 576, generator=g), torch.randn(960, 576, generator=g)\n"
        "y = torch.ops.conveyor_linear.linear(x, torch.ops.conveyor_linear.pack_weight(w, False), None, 960)\n"
        "torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4)\n"
        "print(cpu._build_name(), torch.ops.conveyor_linear.isa())\n"
    )
    env = dict(os.environ, **{cpu.DISABLE_AVX512_ENV: "1", "PYTHONSAFEPATH": "1"})
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            timeout=900, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    name, isa = result.stdout.split()[-2:]
    flags = Path("/proc/cpuinfo").read_text().split()
    assert name.endswith("_noavx512")
    assert isa == ("avx2" if "avx2" in flags and "fma" in flags else "scalar")
