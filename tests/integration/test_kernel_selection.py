"""Linear kernels chosen per row count (`conveyor.kernels.selection`) on a real model: every layer runs
the kernel its table names at each row count and the model's output stays the plain model's; a real
measurement on this CPU is cached and read back. The rule itself is in tests/unit/test_kernel_selection.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from conveyor.kernels import cpu, onednn, selection
from tests.tiny_llama import forward_logits, tiny_llama


@pytest.fixture(scope="module", autouse=True)
def _library() -> None:
    cpu.load_library()  # before the cache moves: torch keeps its build cache under XDG_CACHE_HOME too


@pytest.fixture(autouse=True)
def _isolated_cache(_library, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(selection.OVERRIDE_ENV, raising=False)


def test_each_layer_runs_the_kernel_its_table_names_for_the_rows(monkeypatch):
    """Made-up timings: the panel kernel wins up to 4 rows, oneDNN from 5 on."""
    buckets = [1, 2, 4, 8, 16]
    fake = {
        b: {"panel": 1.0 if b <= 4 else 2.0, "onednn": 2.0 if b <= 4 else 1.0, "torch": 3.0} for b in buckets
    }
    monkeypatch.setattr(selection, "measure", lambda linear, candidates, dtype: fake)
    model, selected = tiny_llama(False, torch.float32), tiny_llama(False, torch.float32)
    tables = selection.select_linear_kernels(selected, torch.float32, panel=True)
    assert {str(t) for t in tables.values()} == {"panel 1-4, onednn 5+"}
    layers = [m for m in selected.modules() if isinstance(m, selection.SelectedLinear)]
    assert len(layers) == 4 * 2 + 1 and not any(type(m) is nn.Linear for m in selected.modules())
    for rows, kind in (
        (1, cpu.CPULinear),
        (4, cpu.CPULinear),
        (5, onednn.PackedLinear),
        (300, onednn.PackedLinear),
    ):
        assert all(isinstance(layer.kernel_for(rows), kind) for layer in layers)
    for num_tokens in (3, 10):  # one step through each kernel
        torch.testing.assert_close(
            forward_logits(selected, torch.float32, num_tokens),
            forward_logits(model, torch.float32, num_tokens),
            atol=1e-5,
            rtol=1e-5,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_real_measurement_is_cached_and_keeps_the_output(dtype, caplog):
    model, selected = tiny_llama(False, dtype), tiny_llama(False, dtype)
    with caplog.at_level(logging.INFO, logger="conveyor.kernels.selection"):
        tables = selection.select_linear_kernels(selected, dtype, panel=True)
    name = str(dtype).removeprefix("torch.")
    shapes = {(m.in_features, m.out_features, name) for m in model.modules() if isinstance(m, nn.Linear)}
    assert set(tables) == shapes
    available = selection.candidate_factories(dtype, panel=True)
    assert all(set(table.names()) <= set(available) for table in tables.values())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(shapes) and all(line.startswith("linear ") for line in lines), lines
    if len(available) > 1:
        assert all("(measured in" in line for line in lines), lines
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="conveyor.kernels.selection"):
            again = selection.select_linear_kernels(tiny_llama(False, dtype), dtype, panel=True)
        assert again == tables and all(r.getMessage().endswith("(cached)") for r in caplog.records)
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    for num_tokens in (1, 10):
        torch.testing.assert_close(
            forward_logits(selected, dtype, num_tokens).float(),
            forward_logits(model, dtype, num_tokens).float(),
            atol=tolerance,
            rtol=tolerance,
        )


def test_the_override_skips_the_measurement(monkeypatch):
    monkeypatch.setenv(selection.OVERRIDE_ENV, "torch,onednn@64")
    monkeypatch.setattr(selection, "measure", lambda *args: pytest.fail("measured despite the override"))
    model = tiny_llama(False, torch.float32)
    tables = selection.select_linear_kernels(model, torch.float32, panel=True)
    assert {str(t) for t in tables.values()} == {"torch 1-63, onednn 64+"}


def test_experts_run_the_kernel_their_table_names_and_a_real_measurement_is_cached(monkeypatch, caplog):
    """A mixture-of-experts layer (`SparseMoE`): made-up timings split the two candidates at 4 tokens
    and each call runs the named one; then a real measurement on this CPU is cached, read back, and
    the layer's output stays the reference's."""
    from conveyor.kernels import reference
    from conveyor.server.model.models.llama import SparseMoE
    from conveyor.server.model.parallel import TensorParallel

    shape = tiny_llama(False, torch.float32).shape
    shape.num_experts, shape.num_experts_per_tok, shape.moe_intermediate_size = 8, 2, 24
    torch.manual_seed(0)
    moe = SparseMoE(shape, cpu, None, TensorParallel())  # one rank; no shared expert, so no partition
    for param in moe.parameters():
        nn.init.normal_(param, std=0.2)
    x = torch.randn(6, shape.hidden_size)
    expected = reference.fused_moe(x, moe.w13, moe.w2, *moe.route(x))

    real = {"measure_moe": selection.measure_moe, "moe_candidates": selection.moe_candidates}
    calls: list[str] = []
    fake = {b: {"moe-cpp": 1.0 if b <= 4 else 2.0, "moe-torch": 2.0 if b <= 4 else 1.0} for b in (1, 2, 4, 8)}
    monkeypatch.setattr(selection, "measure_moe", lambda *args: fake)
    monkeypatch.setattr(
        selection,
        "moe_candidates",
        lambda: {
            name: (lambda *a, name=name, fn=fn: calls.append(name) or fn(*a))
            for name, fn in {"moe-cpp": cpu.fused_moe, "moe-torch": reference.fused_moe}.items()
        },
    )
    tables = selection.select_moe_kernels(moe)
    assert [str(t) for t in tables.values()] == ["moe-cpp 1-4, moe-torch 5+"]
    moe(x[:3])
    moe(x)
    assert calls == ["moe-cpp", "moe-torch"]

    for name, fn in real.items():
        monkeypatch.setattr(selection, name, fn)
    monkeypatch.setenv("XDG_CACHE_HOME", str(Path(os.environ["XDG_CACHE_HOME"]) / "real"))
    with caplog.at_level(logging.INFO, logger="conveyor.kernels.selection"):
        first = selection.select_moe_kernels(moe)
        assert selection.select_moe_kernels(moe) == first
    assert "measured in" in caplog.text and "(cached)" in caplog.text
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)


class _Attention(nn.Module):
    """What `selection.attention_shape` reads off a model's attention layer."""

    num_heads, num_kv_heads, head_dim = 9, 3, 64


def test_prefill_attention_gets_its_measured_kernel_per_query_rows(monkeypatch, caplog):
    """Made-up timings (flash faster up to 256 query rows, torch's kernel from 512 on) give that split;
    then a real measurement on this CPU is cached and read back, and the override skips it. float32 has
    only torch's kernel: nothing is measured."""
    model = nn.Sequential(_Attention())
    assert selection.select_prefill_attention(model, torch.float32) is None
    if not torch.ops.conveyor_attention.flash_supported(torch.zeros(1, 1, 64, dtype=torch.bfloat16)):
        pytest.skip("this CPU has no AVX512_BF16: torch's prefill kernel is the only one")
    fake = {b: {"flash": 1.0 if b <= 256 else 2.0, "sdpa": 2.0 if b <= 256 else 1.0} for b in (32, 256, 512)}
    real = selection.measure_prefill_attention
    monkeypatch.setattr(selection, "measure_prefill_attention", lambda shape, dtype, candidates: fake)
    try:
        table = selection.select_prefill_attention(model, torch.bfloat16)
        assert str(table) == "flash 1-256, sdpa 257+"
        monkeypatch.setattr(selection, "measure_prefill_attention", real)
        monkeypatch.setenv("XDG_CACHE_HOME", str(Path(os.environ["XDG_CACHE_HOME"]) / "real"))
        with caplog.at_level(logging.INFO, logger="conveyor.kernels.selection"):
            first = selection.select_prefill_attention(model, torch.bfloat16)
            assert selection.select_prefill_attention(model, torch.bfloat16) == first
        assert set(first.names()) <= set(selection.prefill_candidates(64, torch.bfloat16))
        assert "prefill attention 9x3x64" in caplog.text and "measured in" in caplog.text
        assert caplog.records[-1].getMessage().endswith("(cached)")
        monkeypatch.setenv(selection.OVERRIDE_ENV, "flash,sdpa@128")
        monkeypatch.setattr(selection, "measure_prefill_attention", lambda *a: pytest.fail("measured"))
        assert str(selection.select_prefill_attention(model, torch.bfloat16)) == "flash 1-127, sdpa 128+"
        # the linear layers' selection accepts a value that names only these kernels
        assert selection.select_linear_kernels(tiny_llama(False, torch.float32), torch.float32, panel=True)
    finally:
        torch.ops.conveyor_attention.set_prefill_kernels(9, 3, 64, [1], ["flash"])
