"""`python -m conveyor.benchmarks.offline` (the engine part of `make gpu-check`) on CPU with a tiny
random-weight shape: every batch runs to its exact output length and the report's arithmetic holds."""

from __future__ import annotations

import json

import pytest

from conveyor.benchmarks import offline
from conveyor.server import capacity

pytestmark = pytest.mark.slow

MiB = 1 << 20
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_offline_batches_on_a_tiny_dummy_shape(tmp_path, capsys):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY))
    argv = [str(tmp_path / "tiny"), "--load-format", "dummy", "--dtype", "float32", "--device", "cpu"]
    argv += ["--batch-sizes", "1,4", "--input-len", "40", "--output-len", "6"]
    argv += ["--kv-cache-memory", str(16 * MiB), "--json", str(tmp_path / "report.json")]
    argv += ["--plan-model", "smollm2-135m", "--plan-gpu", "l4"]
    assert offline.main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    per_token = capacity.kv_bytes_per_token(2, 2, 16, "float32")
    assert report["kv_bytes_per_token"] == per_token
    assert report["kv_pool_bytes"] == 16 * MiB
    assert report["num_kv_blocks"] == capacity.num_kv_blocks_for_pool(16 * MiB, per_token, 16)
    # Weights read per step: 2 layers of (qkv 64x(64+2x32), o 64x64, gate/up 64x256, down 128x64,
    # 2 norms) + final norm + untied LM head 49152x64; the untied input embedding is not counted.
    layer = 64 * 128 + 64 * 64 + 64 * 256 + 128 * 64 + 2 * 64
    assert report["weight_bytes"] == (2 * layer + 64 + 49152 * 64) * 4
    assert [b["batch"] for b in report["batches"]] == [1, 4]
    for b in report["batches"]:
        # The first token comes from the prefill step, then one decode step per further token.
        assert b["output_tokens"] == b["batch"] * 6
        assert b["num_decode_steps"] == 5
        floor = report["weight_bytes"] + b["batch"] * (40 + 3) * per_token
        assert b["floor_bytes"] == pytest.approx(floor)
        assert b["floor_tok_s"] == pytest.approx(b["batch"] / b["floor_step_s"])
    assert "| 4 |" in out and "`conveyor plan`" in out


def test_structured_output_bench_keeps_each_mode_to_its_constraint(tmp_path, capsys):
    """`python -m conveyor.benchmarks.structured` on the embedded model: every mode runs, the ratios
    are against the free mode of the same run, and the constrained outputs obey their constraint."""
    import re

    from conveyor.benchmarks import structured

    assert (
        structured.main(
            ["--batch", "2", "--output-len", "6", "--dtype", "float32", "--json", str(tmp_path / "r.json")]
        )
        == 0
    )
    results = {r["mode"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert list(results) == ["free", "regex", "json_schema"] and results["free"]["tok_s_vs_free"] == 1.0
    assert all(r["output_tokens"] > 0 and r["median_step_s"] > 0 for r in results.values())
    assert all(re.fullmatch(r"[A-Za-z ,.]*", text) for text in results["regex"]["texts"])
    assert all(text.startswith('{"name": "') for text in results["json_schema"]["texts"])
    assert "json_schema" in capsys.readouterr().out


def test_step_profile_splits_each_step_into_stages_and_ops(tmp_path, capsys):
    """`python -m conveyor.benchmarks.step_profile` on the embedded model and a 3-request token-id
    workload: the stages add up to the step, the forward's parts to the forward, and the matmuls and
    attention the model runs are found by the profiler."""
    from conveyor.benchmarks import step_profile

    workload = tmp_path / "w.jsonl"
    rows = [{"prompt": list(range(10 + 7 * i, 30 + 9 * i)), "output_len": 4 + i} for i in range(3)]
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_json = tmp_path / "p.json"
    argv = ["--workload", str(workload), "--dtype", "float32", "--max-num-seqs", "2", "--json", str(out_json)]
    assert step_profile.main(argv) == 0
    report = json.loads(out_json.read_text())
    assert report["output_tokens"] == 4 + 5 + 6
    assert sum(report["stages_ms"].values()) == pytest.approx(report["step_ms"], rel=0.02)
    assert sum(report["forward_ms"].values()) == pytest.approx(report["stages_ms"]["forward"], rel=1e-6)
    assert report["forward_ms"]["matmul"] > 0 and report["forward_ms"]["attention"] > 0
    assert "| - forward: matmul |" in capsys.readouterr().out


def test_quantized_benchmark_reports_each_format_against_the_measured_bandwidth(tmp_path, capsys):
    """`python -m conveyor.benchmarks.quantized` on the embedded model's shape with random float32 and
    Q8_0 weights: one row per format with its bytes, step times and share of the copy bandwidth."""
    from conveyor.benchmarks import quantized

    out = tmp_path / "quantized.json"
    argv = ["--model", "smollm2-135m", "--formats", "float32", "q8_0", "--tokens", "3", "--json", str(out)]
    assert quantized.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("copy bandwidth ") and "| q8_0 | " in printed and "| float32 | " in printed
    result = json.loads(out.read_text())
    assert result["copy_bandwidth_bytes_per_s"] > 1e8
    rows = {r["format"]: r for r in result["rows"]}
    # SmolLM2-135M: every parameter but the 61 norms (the tied table counted once, as the LM head).
    assert rows["float32"]["weight_bytes_per_step"] == (134_515_008 - 61 * 576) * 4
    assert rows["q8_0"]["weight_bytes_per_step"] * 32 == rows["float32"]["weight_bytes_per_step"] // 4 * 34
    for row in rows.values():
        assert row["step_ms_1"] > 0 and row["tokens_per_s_16"] > 0 and row["bandwidth_share_1"] > 0
