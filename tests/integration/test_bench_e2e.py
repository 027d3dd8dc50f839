"""`conveyor bench` against a live server: 4 streamed requests with exact output lengths."""

import json

import pytest

from conveyor.benchmarks.serve import main

pytestmark = pytest.mark.slow


def test_bench_four_requests_against_live_server(server, tmp_path, capsys):
    result_file = tmp_path / "result.json"
    argv = [
        "--base-url",
        server.base_url,
        "--dataset-name",
        "random",
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "6",
        "--range-ratio",
        "0.5",
        "--goodput",
        "ttft:600000",
        "--result-file",
        str(result_file),
        "--disable-tqdm",
    ]
    assert main(argv) == 0

    result = json.loads(result_file.read_text())
    metrics = result["metrics"]
    assert metrics["completed"] == 4
    assert metrics["failed"] == 0
    assert result["output_len_mismatches"] == 0
    records = result["records"]
    # The server counts exactly the token-id prompt sent and generates exactly the lengths asked for.
    from conveyor.benchmarks.datasets import random_dataset

    samples = random_dataset(4, input_len=16, output_len=6, range_ratio=0.5)
    assert [r["prompt_len"] for r in records] == [s.prompt_len for s in samples]
    assert [r["output_len"] for r in records] == [s.output_len for s in samples]
    assert metrics["total_output_tokens"] == sum(s.output_len for s in samples)
    assert all(0 < r["ttft_s"] <= r["latency_s"] for r in records)
    assert metrics["goodput"] == pytest.approx(metrics["request_throughput"])
    assert "Successful requests:" in capsys.readouterr().out
