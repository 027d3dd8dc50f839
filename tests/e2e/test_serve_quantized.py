"""Quantized weights through a real `conveyor serve` process and the `openai` client: `--quantization
int8` (any checkpoint quantized at load) and `--quantization gguf` (the file's own blocks) answer like the
float server, `/metrics` says what the weights are, and a flag that cannot be served stops the start with
a message naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import start_serve
from tests.prometheus import stop_process

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def weights_info(base_url: str) -> str:
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith("conveyor:model_weights_info{"):
            return line
    raise AssertionError("no conveyor:model_weights_info series")


@pytest.mark.parametrize(("quantization", "weights"), [("int8", "INT8"), ("gguf", "Q4_1+Q8_0")])
def test_a_quantized_server_answers_the_openai_client(tmp_path, quantization, weights):
    server = start_serve(tmp_path / "serve.log", "--quantization", quantization)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        # The kernels are chosen by measurement, and the int8 ones move greedy text (quality bounds:
        # test_quantization_quality.py), so the words are not asserted here, only a whole answer.
        assert reply.choices[0].message.content.strip()
        assert reply.usage.completion_tokens == 16 or reply.choices[0].finish_reason == "stop"
        info = weights_info(server.base_url)
        assert f'quantization="{quantization}"' in info and f'weights="{weights}"' in info, info
        log = Path(server.log).read_text()
        assert f"weights: quantized ({weights.split('+')[0]} x" in log
    finally:
        stop_process(server.proc)


def test_a_block_format_without_dummy_weights_stops_the_start_naming_the_flag(tmp_path):
    exe = Path(sys.executable).with_name("conveyor")
    done = subprocess.run(
        [str(exe), "serve", "--quantization", "q4_0"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "--quantization q4_0 makes random weights in that format for --load-format dummy" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_memory_benchmark_weighs_a_quantized_server(tmp_path, capsys):
    """`python -m conveyor.benchmarks.memory --quantization gguf`: a real server's resident set against
    its weights (the file's blocks), KV pool and runtime, all measured in the run."""
    import json

    from conveyor.benchmarks import memory

    out = tmp_path / "memory.json"
    assert memory.main(["--quantization", "gguf", "--json", str(out)]) == 0
    assert "| gguf | 92 |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["weight_bytes"] < 100 << 20 and result["runtime_bytes"] > 100 << 20
    assert row["must_hold_bytes"] == row["weight_bytes"] + result["kv_cache_memory"] + result["runtime_bytes"]
    assert row["peak_rss_bytes"] >= row["rss_bytes"] > row["weight_bytes"] + result["kv_cache_memory"]
