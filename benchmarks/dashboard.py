"""Render a Grafana dashboard's JSON (charts/conveyor/dashboards/conveyor.json) without Grafana: each
panel's queries over Prometheus' `query_range` API, drawn with matplotlib in the dashboard's grid.

This is how the Helm guide's picture of the dashboard is made, and how tests/e2e/test_dashboard.py checks that
every panel finds the series a real server exports. Grafana's variables are substituted textually:
`$__rate_interval` by `rate_interval`, `$name` by `variables[name]`, and legends' `{{label}}` by the
series' labels.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "conveyor" / "dashboards" / "conveyor.json"
# Grafana's grid: 24 columns, rows of 30 px.
GRID_COLUMNS = 24


@dataclass
class Series:
    """One line of a panel: its legend and (unix seconds, value) points (NaN points dropped)."""

    legend: str
    points: list[tuple[float, float]] = field(default_factory=list)


def substitute(expr: str, variables: Mapping[str, str], rate_interval: str) -> str:
    """A panel query with Grafana's variables replaced (longest names first, so `$namespace` never
    eats a prefix of another)."""
    expr = expr.replace("$__rate_interval", rate_interval)
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(f"${name}", variables[name])
    return expr


def _legend(template: str, labels: Mapping[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template) or "value"


def panel_series(
    prometheus_url: str,
    panel: Mapping[str, Any],
    start: float,
    end: float,
    step: float,
    variables: Mapping[str, str],
    rate_interval: str,
) -> list[Series]:
    """Every series of a panel's queries between `start` and `end` (unix seconds).

    Raises httpx.HTTPError when Prometheus is unreachable and ValueError when it refuses a query (the
    PromQL error names it)."""
    lines: list[Series] = []
    for target in panel["targets"]:
        query = substitute(target["expr"], variables, rate_interval)
        body = httpx.get(
            f"{prometheus_url}/api/v1/query_range",
            params={"query": query, "start": start, "end": end, "step": step},
            timeout=30,
        ).json()
        if body.get("status") != "success":
            raise ValueError(f"panel {panel['title']!r}: {body.get('error')}: {query}")
        for result in body["data"]["result"]:
            points = [(float(t), float(v)) for t, v in result["values"] if not math.isnan(float(v))]
            lines.append(Series(_legend(target.get("legendFormat", ""), result["metric"]), points))
    return lines


def render(
    dashboard: Mapping[str, Any],
    prometheus_url: str,
    start: float,
    end: float,
    path: str | Path,
    variables: Mapping[str, str],
    rate_interval: str = "1m",
    step: float = 5.0,
) -> dict[str, list[Series]]:
    """Draw every panel into one PNG at `path`, laid out as the dashboard's gridPos; returns the series
    of each panel by title (a panel with no data says so)."""
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(16, rows * 0.42))
    grid = fig.add_gridspec(rows, GRID_COLUMNS, hspace=2.0, wspace=1.5, top=0.95)
    drawn: dict[str, list[Series]] = {}
    for panel in panels:
        pos = panel["gridPos"]
        ax = fig.add_subplot(grid[pos["y"] : pos["y"] + pos["h"] - 1, pos["x"] : pos["x"] + pos["w"]])
        series = panel_series(prometheus_url, panel, start, end, step, variables, rate_interval)
        drawn[panel["title"]] = series
        for line in series:
            if line.points:
                ax.plot([t - start for t, _ in line.points], [v for _, v in line.points], label=line.legend)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.set_title(panel["title"], fontsize=10, loc="left")
        ax.set_xlabel("seconds", fontsize=8)
        ax.set_ylabel({"s": "seconds", "percentunit": "share", "ops": "per second"}.get(unit, ""), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if any(line.points for line in series):
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
    fig.suptitle(dashboard["title"], fontsize=12, x=0.01, y=0.985, ha="left")
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return drawn


def load(path: str | Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
