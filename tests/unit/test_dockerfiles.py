"""The Dockerfiles (images/) copy only what exists and what .dockerignore lets into the build context."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO / "images").glob("*.Dockerfile"))


def _ignored(path: str) -> bool:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return any(
        fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") or path == p for p in patterns
    )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copy_source_exists_in_the_build_context(dockerfile: Path) -> None:
    sources = [
        source
        for line in dockerfile.read_text().splitlines()
        if (match := re.match(r"^COPY\s+(?!--from)(.+)\s+\S+$", line))
        for source in match.group(1).split()
    ]
    assert sources, "no COPY found"
    for source in sources:
        assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source}: no such file"
        assert not _ignored(source), f"{dockerfile.name}: COPY {source} is excluded by .dockerignore"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_the_non_root_user_the_pods_expect(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    assert "USER 10001:10001" in text  # operator/render.py RUN_AS_USER, the chart's podSecurityContext
    assert re.search(r"^ARG BASE=", text, re.M) and "FROM ${BASE}" in text


def test_the_packages_the_images_copy_are_the_packages_pyproject_installs() -> None:
    import tomllib

    package_dirs = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    )
    for dockerfile in DOCKERFILES:
        copied = set(re.findall(r"^COPY (\w+) /src/\1$", dockerfile.read_text(), re.M))
        assert copied == package_dirs, dockerfile.name
