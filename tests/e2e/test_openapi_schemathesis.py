"""A schemathesis run over a real server's /openapi.json: the schema tells the truth about what the
server accepts and answers (status codes, error bodies, SSE, response shapes), and schema-valid requests
are served.

A few schema-valid requests are refused on purpose, for rules a JSON Schema cannot state (an integer
written as `1.0`, rules across fields, a grammar that does not compile); `schemathesis_hooks.py` lists
them and lets such a refusal through only when the server's own message names the rule.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import start_serve
from tests.e2e.schemathesis_hooks import refused_on_purpose
from tests.prometheus import stop_process

pytestmark = pytest.mark.slow

CHECKS = [
    "not_a_server_error",
    "response_schema_conformance",
    "status_code_conformance",
    "content_type_conformance",
    "negative_data_rejection",
    "positive_data_acceptance",
]
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")


def _integer(schema: dict, components: dict, field: str) -> dict:
    props = components[schema["$ref"].rsplit("/", 1)[1]]["properties"][field]
    return next(s for s in (props, *props.get("anyOf", ())) if s.get("type") == "integer")


def test_schemathesis_finds_the_schema_honest(tmp_path) -> None:
    # A short context and few choices per request keep every generated request quick to serve.
    server = start_serve(
        tmp_path / "serve.log", "--max-model-len", "64", "--max-waiting-requests", "2"
    )  # fmt: skip
    try:
        schema = httpx.get(f"{server.base_url}/openapi.json").json()
        components = schema["components"]["schemas"]
        body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
        # Limits known only at start are in the schema, so generated requests stay inside them.
        assert _integer(body["schema"], components, "max_tokens")["maximum"] == 63
        assert _integer(body["schema"], components, "n")["maximum"] == 2
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
            env={**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)},
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        assert "No issues found" in run.stdout
    finally:
        stop_process(server.proc)


def test_only_the_listed_rules_are_let_through() -> None:
    """The hook's allow-list is narrow: the server's message must name the rule."""
    assert refused_on_purpose({"n": 1.0}, {"param": "n", "message": "n: Input should be a valid integer"})
    assert not refused_on_purpose({"n": "1"}, {"param": "n", "message": "n: Input should be a valid integer"})
    assert refused_on_purpose(
        {}, {"param": "min_tokens", "message": "min_tokens (5) must not exceed max_tokens (4)"}
    )
    assert refused_on_purpose({}, {"param": "guided_regex", "message": "guided_regex: regex parse error"})
    assert not refused_on_purpose(
        {}, {"param": "guided_regex", "message": "guided_regex.0: Input should be a string"}
    )
    assert not refused_on_purpose({}, {"param": "prompt", "message": "prompt must not be empty"})
    seed_bound = {"param": "seed", "message": f"seed: Input should be less than or equal to {2**63 - 1}"}
    assert refused_on_purpose({"seed": 2**63 + 192}, seed_bound)
    assert not refused_on_purpose({"seed": 2**63 - 1}, seed_bound)
    assert not refused_on_purpose(
        {}, {"param": "temperature", "message": "temperature: Input should be <= 2"}
    )
