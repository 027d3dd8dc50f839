"""`conveyor.kernels.select_backend`: the one place `--attention-backend` is resolved and checked."""

from __future__ import annotations

import pytest

from conveyor.kernels import KERNEL_NAMES, cpu, reference, select_backend


def test_auto_on_cpu_is_the_cpp_kernels_when_they_build_else_torch():
    name, backend = select_backend("auto", "cpu")
    assert name == ("cpu" if cpu.is_available() else "torch")
    assert all(callable(getattr(backend, kernel)) for kernel in KERNEL_NAMES)


def test_torch_is_the_reference_module():
    assert select_backend("torch", "cpu") == ("torch", reference)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--attention-backend triton needs CUDA.*TRITON_INTERPRET=1"):
        select_backend("triton", "cpu")


def test_cpu_kernels_refuse_cuda_tensors():
    with pytest.raises(ValueError, match="--attention-backend cpu runs on CPU tensors"):
        select_backend("cpu", "cuda")


def test_a_cpp_build_failure_names_the_flag_and_the_way_out(monkeypatch: pytest.MonkeyPatch):
    def fail() -> None:
        raise cpu.CPUKernelBuildError("no C++ compiler (g++) on PATH")

    monkeypatch.setattr(cpu, "load_library", fail)
    with pytest.raises(
        ValueError, match="--attention-backend cpu: no C\\+\\+ compiler.*--attention-backend torch"
    ):
        select_backend("cpu", "cpu")


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown attention backend 'metal'"):
        select_backend("metal", "cpu")
