"""The chart's values model (operator/chart.py) against the files generated from it and values.yaml."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from conveyor.operator.chart import (
    CHART,
    DEPLOYMENT_PATH,
    SCHEMA_PATH,
    ChartValues,
    deployment_with_flags,
    schema_text,
)
from conveyor.operator.run import build_parser

REGENERATE = "stale: run `make generate`"


def test_values_schema_json_is_generated_from_the_model() -> None:
    assert SCHEMA_PATH.read_text() == schema_text(), REGENERATE


def test_deployment_flags_are_generated_from_the_values() -> None:
    template = DEPLOYMENT_PATH.read_text()
    assert deployment_with_flags(template) == template, REGENERATE


def test_the_chart_passes_every_operator_flag() -> None:
    """A flag added to `conveyor operator` is given a value (OperatorFlag) or passed by the template."""
    template = DEPLOYMENT_PATH.read_text()
    flags = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
    assert sorted(f for f in flags if not re.search(rf"(?<![-\w]){f}(?![-\w])", template)) == []


def test_values_yaml_holds_exactly_the_models_defaults() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert ChartValues.model_validate(values) == ChartValues()
    assert (
        ChartValues.model_validate(values).model_dump(by_alias=True, exclude={"global_"}).keys()
        == values.keys()
    )


@pytest.mark.parametrize("path", sorted((CHART / "ci").glob("*.yaml")), ids=lambda p: p.name)
def test_every_ci_values_file_validates(path: Path) -> None:
    ChartValues.model_validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"replicaCount": "two"}, "replicaCount"),
        ({"replicaCount": 0}, "replicaCount"),
        ({"metrics": {"prot": 8081}}, "metrics.prot"),
        ({"prometheusRule": {"ttftSeconds": 0.3}}, "prometheusRule.ttftSeconds"),
        ({"autoscaler": {"prometheusUrl": "prometheus:9090"}}, "autoscaler.prometheusUrl"),
        ({"helmTest": {"inferenceService": "smollm2"}}, "helmTest.inferenceService"),
    ],
)
def test_bad_values_are_refused_naming_the_value(values: dict, where: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChartValues.model_validate(values)
    locations = {".".join(str(p) for p in e["loc"]) for e in info.value.errors()}
    assert any(loc.startswith(where) for loc in locations), locations


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool comes with `make prometheus`")
def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """Each panel's query, with Grafana's variables substituted, parses as PromQL (`promtool check rules`)."""
    dashboard = json.loads((CHART / "dashboards" / "conveyor.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 8
    substituted = [
        e.replace("$__rate_interval", "1m").replace("$namespace", "llm").replace("$inferenceservice", "x")
        for e in exprs
    ]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"panel:{i}", "expr": e} for i, e in enumerate(substituted)],
            }
        ]
    }
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    series = " ".join(exprs)
    for metric in (
        "conveyor:time_to_first_token_seconds_bucket",
        "conveyor:request_time_per_output_token_seconds_bucket",
        "conveyor:num_requests_waiting",
        "conveyor:kv_cache_usage_perc",
        "conveyor:num_preemptions_total",
        "conveyor:prefix_cache_hits_total",
        "conveyor_operator_autoscaler_desired_replicas",
        "conveyor_operator_autoscaler_decisions_total",
    ):
        assert metric in series, metric
