"""`--dtype auto`: bfloat16 on a CPU only where oneDNN computes it natively, float32 elsewhere.

The probe's other answer is reached by replacing `onednn.cpu_bf16_native` (a CPU feature this machine may
lack is a boundary a test cannot cross); the real probe is checked against the kernel's CPU flags."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conveyor.kernels import onednn
from conveyor.server.engine import builder

CPU = torch.device("cpu")


@pytest.mark.parametrize(("native", "dtype"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_cpu_follows_native_bfloat16(monkeypatch, native, dtype) -> None:
    monkeypatch.setattr(onednn, "cpu_bf16_native", lambda: native)
    picked, why = builder.pick_dtype("auto", CPU)
    assert picked == dtype
    assert ("natively" in why) if native else ("no native bfloat16" in why)
    # Pre-packing follows the same answer.
    assert onednn.packing_supported(torch.bfloat16, CPU) is native


def test_an_explicit_dtype_wins_and_cuda_takes_the_models_half_type(monkeypatch) -> None:
    monkeypatch.setattr(onednn, "cpu_bf16_native", lambda: False)
    assert builder.pick_dtype("bfloat16", CPU) == (torch.bfloat16, "--dtype bfloat16")
    cuda = torch.device("cuda")
    assert builder.pick_dtype("auto", cuda, SimpleNamespace(dtype=torch.float16))[0] == torch.float16
    assert builder.pick_dtype("auto", cuda, SimpleNamespace(dtype=torch.float32))[0] == torch.bfloat16


def test_the_probe_agrees_with_the_cpu_flags() -> None:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert onednn.cpu_bf16_native() == bool(flags & {"avx512_bf16", "amx_bf16"})
