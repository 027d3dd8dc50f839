"""Markdown tables and target checks from a ``make bench`` summary (pure: dicts in, text out).

A summary run entry is ``{"name", "system", "scenario", "request_rate", "metrics", "mfu", ...}`` where
``metrics`` is ``dataclasses.asdict(BenchmarkMetrics)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Run = Mapping[str, Any]


def find_run(runs: Sequence[Run], system: str, scenario: str) -> Run | None:
    """The run of ``system`` in ``scenario``, or None."""
    return next((r for r in runs if r["system"] == system and r["scenario"] == scenario), None)


def _fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def runs_table(runs: Sequence[Run]) -> str:
    """One markdown row per run: throughputs, MFU, share of the memory bandwidth (`metrics.bandwidth_share`),
    TTFT / TPOT / ITL / E2E percentiles (ms), goodput."""
    header = (
        "| system | scenario | req/s | output tok/s | total tok/s | MFU | % of bandwidth | TTFT p50 / p99 (ms) "
        "| TPOT p50 / p99 (ms) | ITL p99 (ms) | E2E p99 (ms) | goodput (req/s) |"
    )
    lines = [header, "|" + "---|" * 12]
    for run in runs:
        m = run["metrics"]
        mfu, share = run.get("mfu"), run.get("bandwidth_share")
        lines.append(
            f"| {run['system']} | {run['scenario']} | {m['request_throughput']:.3f} "
            f"| {m['output_throughput']:.1f} | {m['total_token_throughput']:.1f} "
            f"| {'n/a' if mfu is None else f'{mfu:.2%}'} | {'n/a' if share is None else f'{share:.0%}'} "
            f"| {_fmt(m['ttft_ms']['median'])} / {_fmt(m['ttft_ms']['p99'])} "
            f"| {_fmt(m['tpot_ms']['median'], 1)} / {_fmt(m['tpot_ms']['p99'], 1)} "
            f"| {_fmt(m['itl_ms']['p99'], 1)} | {_fmt(m['e2el_ms']['p99'])} "
            f"| {_fmt(m.get('goodput'), 3)} |"
        )
    return "\n".join(lines)


def bucket_table(runs: Sequence[Run]) -> str:
    """p99 TTFT and ITL (ms) per input-length bucket, one row per run; ``-`` where a bucket is empty."""
    buckets = ("0-512", "512-2048", "2048+")
    lines = [
        "| system | scenario | " + " | ".join(f"{b}: n, TTFT p99, ITL p99" for b in buckets) + " |",
        "|" + "---|" * (2 + len(buckets)),
    ]
    for run in runs:
        cells = []
        for bucket in buckets:
            values = run["metrics"]["p99_by_bucket_ms"][bucket]
            if not values["count"]:
                cells.append("-")
            else:
                cells.append(f"{values['count']}, {_fmt(values['ttft'])}, {_fmt(values['itl'], 1)}")
        lines.append(f"| {run['system']} | {run['scenario']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def target_checks(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """The issue's targets as ``{"target", "measured", "goal", "met"}`` (``measured`` None if a run is missing).

    - offline output throughput: conveyor continuous / transformers continuous batching >= 2
    - offline output throughput: conveyor continuous / conveyor static >= 1.5
    - online at 90 % of static capacity: conveyor continuous p99 TTFT / conveyor static p99 TTFT <= 0.2
    """

    def metric(system: str, scenario: str, *path: str) -> float | None:
        run = find_run(runs, system, scenario)
        if run is None:
            return None
        value: Any = run["metrics"]
        for key in path:
            value = value[key]
        return value

    checks = []
    for label, num, den, goal, higher in (
        (
            "offline throughput, conveyor continuous / transformers continuous batching",
            metric("conveyor continuous", "offline", "output_throughput"),
            metric("transformers continuous batching", "offline", "output_throughput"),
            2.0,
            True,
        ),
        (
            "offline throughput, conveyor continuous / conveyor static",
            metric("conveyor continuous", "offline", "output_throughput"),
            metric("conveyor static", "offline", "output_throughput"),
            1.5,
            True,
        ),
        (
            "online 90 % of static capacity, p99 TTFT conveyor continuous / conveyor static",
            metric("conveyor continuous", "online 90%", "ttft_ms", "p99"),
            metric("conveyor static", "online 90%", "ttft_ms", "p99"),
            0.2,
            False,
        ),
    ):
        measured = _ratio(num, den)
        met = None if measured is None else (measured >= goal if higher else measured <= goal)
        checks.append(
            {
                "target": label,
                "measured": measured,
                "goal": f"{'>=' if higher else '<='} {goal:g}",
                "met": met,
            }
        )
    return checks


def targets_table(checks: Sequence[Mapping[str, Any]]) -> str:
    """The target checks as a markdown table."""
    lines = ["| target | goal | measured | met |", "|---|---|---|---|"]
    for check in checks:
        met = {True: "yes", False: "no", None: "not measured"}[check["met"]]
        lines.append(f"| {check['target']} | {check['goal']} | {_fmt(check['measured'], 2)} | {met} |")
    return "\n".join(lines)


def sweep_table(runs: Sequence[Run]) -> str:
    """Chunked-prefill sweep: TTFT and ITL (p50, p99, max; ms) per ``chunk_tokens``, smallest budget first."""
    lines = [
        "| --max-num-batched-tokens | TTFT p50 / p99 (ms) | ITL p50 / p99 / max (ms) | TPOT p99 (ms) | E2E p99 (ms) |",
        "|---|---|---|---|---|",
    ]
    for run in sorted(runs, key=lambda r: r["chunk_tokens"]):
        m = run["metrics"]
        ttft, itl = m["ttft_ms"], m["itl_ms"]
        lines.append(
            f"| {run['chunk_tokens']} | {_fmt(ttft['median'])} / {_fmt(ttft['p99'])} "
            f"| {_fmt(itl['median'])} / {_fmt(itl['p99'])} / {_fmt(itl.get('max'))} "
            f"| {_fmt(m['tpot_ms']['p99'])} | {_fmt(m['e2el_ms']['p99'])} |"
        )
    return "\n".join(lines)
