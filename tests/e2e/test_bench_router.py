"""`make bench-router` end to end on a small run: every workload through a real router over real replicas,
and the single-replica reference, produce the table, the JSON and the target ratios."""

from __future__ import annotations

import json

import pytest

from conveyor.benchmarks.router import main

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_bench_router_small_run(tmp_path, capsys) -> None:
    argv = [
        "--out", str(tmp_path), "--replicas", "1", "--num-prompts", "6", "--conversations", "2", "--turns", "2",
        "--rate", "4", "--policies", "prefix-aware",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((tmp_path / "router.json").read_text())
    rows = {(r["workload"], r["policy"]): r for r in report["results"]}
    assert set(rows) == {
        *((w, "prefix-aware") for w in ("prefix-shared", "multi-turn", "uniform")),
        ("prefix-shared", "single-replica"),
    }
    assert all(r["failed"] == 0 and r["completed"] > 0 for r in rows.values())
    assert rows[("multi-turn", "prefix-aware")]["completed"] == 4
    # Random prompts share no prefix: the replicas' own counters say so.
    assert rows[("uniform", "prefix-aware")]["hit_rate"] == pytest.approx(0.0, abs=0.05)
    assert rows[("prefix-shared", "prefix-aware")]["ttft_p90_ms"] > 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("router: prefix_shared_p90_ttft_vs_round_robin=-")
    assert (tmp_path / "router.md").read_text().startswith("| workload | policy |")
