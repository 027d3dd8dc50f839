"""Building and running the images (images/*.Dockerfile) here: buildah with chroot isolation on a Debian
base made by debootstrap (hack/images/), as `make images LOCAL_BASE=1` does. Needs root (or sudo) and
Debian's buildah and debootstrap (`make image-tools`, which `make test` runs first).

The base and the built images stay in buildah's storage between runs (like the k8s tools' cache), under
the test registry name, so they never replace a user's `make images` tags.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REGISTRY = "localhost/conveyor-test"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
ENV = {**os.environ, "STORAGE_DRIVER": os.environ.get("STORAGE_DRIVER", "vfs")}
MISSING = "buildah and debootstrap are needed (make image-tools: apt-get install buildah debootstrap)"


def build(image: str, timeout: float) -> tuple[str, str]:
    """Build `image` (operator, server-cpu) with hack/images/build.sh; returns (name:tag, build log)."""
    assert shutil.which("buildah") and shutil.which("debootstrap"), MISSING
    result = subprocess.run(
        ["bash", str(REPO / "hack" / "images" / "build.sh")],
        env={**ENV, "IMAGES": image, "REGISTRY": REGISTRY, "LOCAL_BASE": "1", "CPU_TORCH_INDEX": ""},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, (
        f"building {image} failed:\n{result.stdout[-6000:]}\n{result.stderr[-4000:]}"
    )
    name = {"operator": "conveyor-operator", "server-cpu": "conveyor-server"}[image]
    tag = VERSION + ("-cpu" if image == "server-cpu" else "")
    return f"{REGISTRY}/{name}:{tag}", result.stdout


class Container:
    """A working container of an image; `run` executes a command inside it as the image's user."""

    def __init__(self, image: str) -> None:
        self.id = buildah("from", image).stdout.strip()

    def run(
        self, *command: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return buildah("run", "--isolation", "chroot", self.id, "--", *command, check=check, timeout=timeout)

    def popen(self, *command: str, log: Path) -> subprocess.Popen:
        """`command` in the container in the background (chroot isolation shares the host's network)."""
        with log.open("wb") as out:
            return subprocess.Popen(
                ["buildah", "run", "--isolation", "chroot", self.id, "--", *command],
                env=ENV,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def config(self, template: str) -> str:
        return buildah("inspect", "--format", template, self.id).stdout.strip()

    def remove(self) -> None:
        buildah("rm", self.id, check=False)


def buildah(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["buildah", *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"buildah {' '.join(args)}: {result.stdout}\n{result.stderr}"
    return result
