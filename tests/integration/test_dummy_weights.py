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


def test_a_mixture_of_experts_config_serves_with_dummy_weights_and_reports_expert_load(tmp_path):
    """A Qwen3-MoE config (16 experts, top-2, one dense layer of four) without weights serves over HTTP
    with the C++ expert kernels, and /metrics counts what the router did: every computed token passes
    each of the 3 sparse layers and picks 2 experts there, so the routed assignments are 6x the tokens
    the steps computed, per layer and expert with --enable-expert-load-metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    model_dir = tmp_path / "tiny-moe"
    model_dir.mkdir()
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    args = [str(model_dir), "--load-format", "dummy", "--max-model-len", "512", "--served-model-name", "moe"]
    args += ["--kv-cache-memory", str(16 * MiB), "--enable-expert-load-metrics"]
    with ConveyorServer(args, tmp_path / "server.log", threads=2) as server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        chat = client.chat.completions.create(
            model="moe",
            messages=[{"role": "user", "content": "Hello, experts"}],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert chat.usage.completion_tokens == 6
        text = httpx.get(server.base_url + "/metrics").text
        log = server.log_tail(20000)
    assert "experts 16x256x128x2" in log, log
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    model = ("model_name", "moe")
    computed = samples[("conveyor:iteration_tokens_total_sum", (model,))]
    assert computed == chat.usage.prompt_tokens + chat.usage.completion_tokens - 1
    assert samples[("conveyor:moe_routed_tokens_total", (model,))] == 6 * computed
    per_layer = {}
    for (name, labels), value in samples.items():
        if name == "conveyor:moe_expert_tokens_total":
            per_layer[dict(labels)["layer"]] = per_layer.get(dict(labels)["layer"], 0) + value
    assert per_layer == {"0": 2 * computed, "2": 2 * computed, "3": 2 * computed}
    assert samples[("conveyor:moe_expert_load_imbalance_count", (model,))] >= 3  # the prompt's step
