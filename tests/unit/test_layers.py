"""The layers of the code: what may be imported without the engine. The router, the operator (its chart
model and its handlers) and the API's request models load neither torch nor any engine, model or kernel
module (a router or an operator image must not need them, and an import of the engine costs seconds)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "conveyor.server.engine", "conveyor.server.model", "conveyor.kernels")


@pytest.mark.parametrize(
    "module",
    [
        "conveyor.server.router.app",
        "conveyor.operator.chart",
        "conveyor.operator.handlers",
        "conveyor.operator.run",
        "conveyor.server.api.protocol",
        "conveyor.server.api.metrics",
        "conveyor.server.messages",
        "conveyor.server.block_hash",
    ],
)
def test_imports_no_torch_and_no_engine(module: str) -> None:
    probe = (
        f"import importlib, sys; importlib.import_module({module!r}); "
        f"print(sorted(m for m in sys.modules if m.startswith({HEAVY!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert result.stdout.strip() == "[]", f"{module} loads {result.stdout.strip()}"
