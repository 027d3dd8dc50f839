"""`conveyor serve DIR --load-format dummy`: a catalog shape written by `conveyor plan --write-config`
(config.json only, no weights, no tokenizer) starts, answers over HTTP, and sizes its KV pool with
the same arithmetic as `conveyor plan`."""

from __future__ import annotations

import json
import re

import pytest
from openai import OpenAI

from conveyor.benchmarks.server_process import ConveyorServer
from conveyor.operator import plan
from conveyor.server import capacity

pytestmark = pytest.mark.slow

MiB = 1 << 20


def _planned_kv_bytes_per_token(model: str, dtype: str, capsys) -> int:
    argv = ["--model", model, "--gpu", "l4", "--max-model-len", "512", "--dtype", dtype, "--json"]
    assert plan.main(argv) == 0
    return json.loads(capsys.readouterr().out)["capacity"]["kv_bytes_per_token"]


def test_dummy_weights_server_answers_and_sizes_kv_like_the_plan(tmp_path, capsys):
    model_dir = tmp_path / "smollm2-135m"
    assert plan.main(["--model", "smollm2-135m", "--write-config", str(model_dir)]) == 0
    assert [p.name for p in model_dir.iterdir()] == ["config.json"]
    capsys.readouterr()
    bytes_per_token = _planned_kv_bytes_per_token("smollm2-135m", "float32", capsys)
    assert bytes_per_token == 2 * 30 * 3 * 64 * 4
    pool = 64 * MiB
    args = [str(model_dir), "--load-format", "dummy", "--dtype", "float32", "--max-model-len", "512"]
    args += ["--kv-cache-memory", str(pool), "--served-model-name", "dummy"]
    with ConveyorServer(args, tmp_path / "server.log", threads=2) as server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        chat = client.chat.completions.create(
            model="dummy",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert chat.usage.completion_tokens == 5
        assert chat.choices[0].finish_reason == "length"
        log = server.log_tail(20000)
    assert "has no tokenizer: using the embedded SmolLM2-135M-Instruct tokenizer" in log
    assert "dummy weights: 0.13 B random parameters (float32)" in log
    blocks = capacity.num_kv_blocks_for_pool(pool, bytes_per_token, 16)
    match = re.search(r"KV cache: (\d+) blocks of 16 tokens \([0-9.]+ GiB, (\d+) bytes/token\)", log)
    assert match is not None, log
    assert (int(match[1]), int(match[2])) == (blocks, bytes_per_token)


def test_dummy_weights_need_a_config(tmp_path):
    from conveyor.server.cli import main

    (tmp_path / "empty").mkdir()
    assert main(["serve", str(tmp_path / "empty"), "--load-format", "dummy"]) == 1
