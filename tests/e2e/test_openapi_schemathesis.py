"""A schemathesis run over a real server's /openapi.json: the schema tells the truth about what the
server accepts and answers (status codes, error bodies, SSE, response shapes).

`positive_data_acceptance` is not among the checks: two kinds of schema-valid request are refused on
purpose. JSON Schema counts `1.0` as an integer, while the API takes only JSON integers for integer
fields (OpenAI's strict types); and rules across fields or the model (prompt plus max_tokens within
max_model_len, min_tokens <= max_tokens, one structured-output constraint, a grammar that compiles) are
400s that a JSON schema cannot state. Both are documented 400s with OpenAI's error body.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import start_serve
from tests.prometheus import stop_process

pytestmark = pytest.mark.slow

CHECKS = [
    "not_a_server_error",
    "response_schema_conformance",
    "status_code_conformance",
    "content_type_conformance",
    "negative_data_rejection",
]


def test_schemathesis_finds_the_schema_honest(tmp_path) -> None:
    # A short context keeps every generated request quick to serve.
    server = start_serve(tmp_path / "serve.log", "--max-model-len", "128")
    try:
        st = Path(sys.executable).with_name("st")
        run = subprocess.run(
            [
                str(st), "run", f"{server.base_url}/openapi.json",
                "--checks", ",".join(CHECKS),
                "--max-examples", "2",
                "--generation-deterministic",
                "--request-timeout", "60",
            ],
            capture_output=True, text=True, timeout=1200, cwd=tmp_path,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        assert "No issues found" in run.stdout
    finally:
        stop_process(server.proc)
