"""Target checks and markdown tables of the benchmark report."""

from dataclasses import asdict

import pytest

from conveyor.benchmarks.metrics import ModelFlops, RequestRecord, bandwidth_share, compute_metrics, run_entry
from conveyor.benchmarks.report import bucket_table, runs_table, sweep_table, target_checks, targets_table


def _run(system, scenario, output_tokens, ttft_s, duration_s=10.0):
    records = [RequestRecord(prompt_len=600, output_len=output_tokens, ttft_s=ttft_s, latency_s=ttft_s + 1.0)]
    metrics = compute_metrics(records, duration_s)
    return {
        "system": system,
        "scenario": scenario,
        "metrics": asdict(metrics),
        "mfu": 0.125,
        "bandwidth_share": 0.5,
    }


def test_target_checks_compute_the_three_ratios():
    runs = [
        _run("conveyor continuous", "offline", 300, 1.0),  # 30 tok/s
        _run("conveyor static", "offline", 150, 1.0),  # 15 tok/s
        _run("transformers continuous batching", "offline", 100, 1.0),  # 10 tok/s
        _run("conveyor continuous", "online 90%", 10, 0.5),
        _run("conveyor static", "online 90%", 10, 4.0),
    ]
    checks = target_checks(runs)
    assert [(c["measured"], c["met"]) for c in checks] == [(3.0, True), (2.0, True), (0.125, True)]
    assert [c["goal"] for c in checks] == [">= 2", ">= 1.5", "<= 0.2"]


def test_target_checks_report_missing_runs_and_misses():
    checks = target_checks(
        [_run("conveyor continuous", "offline", 100, 1.0), _run("conveyor static", "offline", 90, 1.0)]
    )
    assert checks[0]["measured"] is None and checks[0]["met"] is None
    assert checks[1]["measured"] == 100 / 90 and checks[1]["met"] is False
    table = targets_table(checks)
    assert "| 1.11 | no |" in table
    assert "not measured" in table


def test_tables_have_one_row_per_run():
    runs = [_run("conveyor continuous", "offline", 300, 1.0)]
    table = runs_table(runs)
    assert table.splitlines()[2].startswith(
        "| conveyor continuous | offline | 0.100 | 30.0 | 90.0 | 12.50% | 50% | 1,000 / 1,000 |"
    )
    buckets = bucket_table(runs)
    assert buckets.splitlines()[2] == "| conveyor continuous | offline | - | 1, 1,000, n/a | - |"


def test_sweep_table_orders_by_token_budget_and_shows_the_itl_maximum():
    small = {**_run("conveyor continuous", "sweep 512", 10, 1.0), "chunk_tokens": 512}
    large = {**_run("conveyor continuous", "sweep 4096", 10, 2.0), "chunk_tokens": 4096}
    small["metrics"]["itl_ms"]["max"] = 1200.0
    large["metrics"]["itl_ms"]["max"] = 3100.0
    rows = sweep_table([large, small]).splitlines()[2:]
    assert rows[0].startswith("| 512 | 1,000 / 1,000 | n/a / n/a / 1,200 |")
    assert rows[1].startswith("| 4096 | 2,000 / 2,000 | n/a / n/a / 3,100 |")


def test_bandwidth_share_is_the_weights_read_per_token_over_the_copy_bandwidth():
    """A step reads every weight once and yields one token per sequence: 100 MB per TPOT p50 of
    1/299 s (300 tokens in the second after the first) is 29.9 GB/s, 1.495x a 20 GB/s copy bandwidth;
    no share without a TPOT (one-token outputs) or without the bandwidth."""
    records = [RequestRecord(prompt_len=600, output_len=300, ttft_s=1.0, latency_s=2.0)]
    metrics = compute_metrics(records, 10.0)
    run = run_entry("conveyor", "offline", [], [], metrics, None, weight_bytes=1e8, bandwidth=20e9)
    assert run["bandwidth_share"] == pytest.approx(1e8 * 299 / 20e9)
    assert run_entry("conveyor", "offline", [], [], metrics, None)["bandwidth_share"] is None
    single = compute_metrics([RequestRecord(prompt_len=600, output_len=1, ttft_s=1.0, latency_s=1.0)], 10.0)
    assert bandwidth_share(1e8, single.tpot_ms["median"], 20e9) is None
    assert ModelFlops(134_515_008, 49_152 * 576).weight_bytes(2) == 134_515_008 * 2
