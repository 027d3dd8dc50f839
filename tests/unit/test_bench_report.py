"""Target checks and markdown tables of the benchmark report."""

from dataclasses import asdict

from conveyor.benchmarks.metrics import RequestRecord, compute_metrics
from conveyor.benchmarks.report import bucket_table, runs_table, sweep_table, target_checks, targets_table


def _run(system, scenario, output_tokens, ttft_s, duration_s=10.0):
    records = [RequestRecord(prompt_len=600, output_len=output_tokens, ttft_s=ttft_s, latency_s=ttft_s + 1.0)]
    metrics = compute_metrics(records, duration_s)
    return {"system": system, "scenario": scenario, "metrics": asdict(metrics), "mfu": 0.125}


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
        "| conveyor continuous | offline | 0.100 | 30.0 | 90.0 | 12.50% | 1,000 / 1,000 |"
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
