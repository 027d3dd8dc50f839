"""The documentation site: it builds strictly, its generated reference pages match the code, its map
names every module, and README's links lead somewhere."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "kernels", "operator", "benchmarks")


def _reference_module():
    spec = importlib.util.spec_from_file_location("docs_reference", REPO / "hack" / "docs_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_reference_pages_match_the_code() -> None:
    assert _reference_module().stale_pages() == [], "stale: run `make generate`"


def test_the_flags_page_names_every_serve_flag() -> None:
    from conveyor.server.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = [o for a in serve._actions for o in a.option_strings if o.startswith("--")]
    page = (REPO / "docs" / "reference" / "cli.md").read_text()
    assert len(flags) > 20
    assert [f for f in flags if f"`{f}`" not in page] == []


def test_the_architecture_page_names_every_module() -> None:
    page = (REPO / "docs" / "design" / "architecture.md").read_text()
    modules = [
        str(path.relative_to(REPO))
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    ]
    assert len(modules) > 60
    assert [m for m in modules if f"`{m}`" not in page] == []
    named = set(re.findall(r"`((?:server|kernels|operator|benchmarks)/[\w/]+\.py)`", page))
    assert [m for m in sorted(named) if not (REPO / m).exists()] == []


def test_readme_is_a_front_door_whose_links_resolve() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert len(local) > 15
    assert [link for link in local if not (REPO / link).exists()] == []


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """`make docs`: a broken link, a missing page or a docstring reference that cannot be read fails."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONSAFEPATH": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    api = (tmp_path / "site" / "reference" / "python-api" / "index.html").read_text()
    assert "LLMEngine" in api and "max_num_seqs" in api
    assert (tmp_path / "site" / "results" / "2026-12-05" / "throughput.png").exists()
