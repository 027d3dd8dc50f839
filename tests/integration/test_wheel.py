"""The package as a non-editable install sees it: the wheel `pip` builds from the checkout (what the
server image installs) holds every module and every C++ source and header the kernels compile."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"server": "conveyor/server", "kernels": "conveyor/kernels", "operator": "conveyor/operator",
            "benchmarks": "conveyor/benchmarks"}  # fmt: skip


def _source_copy(dest: Path) -> Path:
    """The checkout's files (tracked, and new ones git does not ignore) copied to `dest`, so no build
    folder left by an earlier build can fill in what the package configuration leaves out."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    for name in listed:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def test_wheel_holds_every_module_and_kernel_source(tmp_path: Path) -> None:
    source = _source_copy(tmp_path / "src")
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels)]
    subprocess.run([*pip, str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("conveyor-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"{target}/{path.relative_to(ROOT / folder)}"
        for folder, target in PACKAGES.items()
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".py", ".cpp", ".h"} and "__pycache__" not in path.parts
    }
    assert "conveyor/kernels/csrc/cpu_kernels.h" in expected
    assert sorted(expected - names) == []
