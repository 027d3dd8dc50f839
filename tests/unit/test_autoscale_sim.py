"""The autoscaling simulator's models (benchmarks/autoscale_sim.py) against hand-computed values."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.benchmarks.autoscale_sim import (
    Arrival,
    SimConfig,
    StepModel,
    histogram_quantile,
    poisson_arrivals,
    simulate,
)
from conveyor.operator.spec import AutoscalingSpec
from conveyor.server.api.metrics import LATENCY_BUCKETS

# Step = 20 ms + 1 ms per decode sequence, or 20 ms + 0.5 ms per prefill token.
MODEL = StepModel(
    decode_s=((1, 0.021), (8, 0.028)),
    prefill_s=((64, 0.052), (512, 0.276)),
    max_num_seqs=8,
    max_num_batched_tokens=512,
)


def test_step_model_interpolates_and_adds_prefill_at_the_marginal_cost() -> None:
    assert MODEL.step_s(4, 0) == pytest.approx(0.024)
    assert MODEL.step_s(0, 256) == pytest.approx(0.02 + 256 * 0.0005)
    assert MODEL.step_s(4, 100) == pytest.approx(0.024 + 100 * 0.0005)
    assert MODEL.step_s(16, 0) == pytest.approx(0.036)  # extended past the last point
    assert MODEL.largest_batch_within(0.030) == 10


def test_histogram_quantile_interpolates_inside_the_bucket_as_prometheus() -> None:
    # 10 samples: 5 in (0.08, 0.1], 5 in (0.1, 0.25]. Rank 9 lies 4/5 into the second bucket.
    increases = [0.0] * (len(LATENCY_BUCKETS) + 1)
    for i, bound in enumerate(LATENCY_BUCKETS):
        increases[i] = 0 if bound < 0.1 else (5 if bound == 0.1 else 10)
    increases[-1] = 10
    assert histogram_quantile(0.9, increases) == pytest.approx(0.1 + 0.15 * 4 / 5)
    assert math.isnan(histogram_quantile(0.9, [0.0] * (len(LATENCY_BUCKETS) + 1)))


def test_one_request_alone_sees_the_unloaded_ttft_and_tpot() -> None:
    config = SimConfig(MODEL, time_to_ready_s=5)
    result = simulate(config, [Arrival(1.0, 700, 11)], 10.0, None, static_replicas=1)
    (request,) = result.requests
    ttft, tpot = MODEL.unloaded(700, 11)
    # 700 prompt tokens: chunks of 512 and 188, then 10 decode steps.
    assert ttft == pytest.approx(2 * 0.02 + 700 * 0.0005)
    assert request.ttft_s == pytest.approx(ttft)
    assert request.tpot_s == pytest.approx(tpot)
    assert result.avg_replicas == pytest.approx(1.0)


def test_overload_misses_the_slo_and_the_autoscaler_adds_replicas() -> None:
    config = SimConfig(MODEL, time_to_ready_s=10, scrape_interval_s=5, interval_s=5)
    arrivals = poisson_arrivals([(300, 20.0)], 128, 32, seed=3)
    ttft0, tpot0 = MODEL.unloaded(128, 32)
    slo = (10 * ttft0, 10 * tpot0)
    static = simulate(config, arrivals, 300, None, static_replicas=1)
    assert static.attainment(*slo) < 0.5
    spec = AutoscalingSpec.model_validate({"minReplicas": 1, "maxReplicas": 8, "targetQueueDepth": 2})
    auto = simulate(config, arrivals, 300, spec)
    ups = [d for d in auto.decisions if d[2] > d[1]]
    assert ups and ups[0][3] == "ScaleUp"
    assert auto.attainment(*slo) > static.attainment(*slo)
    assert 1 < auto.avg_replicas <= 8


def test_an_outage_holds_the_replicas() -> None:
    config = SimConfig(MODEL, time_to_ready_s=10, scrape_interval_s=5, interval_s=5, outages=((100, 200),))
    arrivals = poisson_arrivals([(100, 20.0), (200, 0.1)], 128, 32, seed=4)
    spec = AutoscalingSpec.model_validate(
        {
            "minReplicas": 1,
            "maxReplicas": 8,
            "targetQueueDepth": 2,
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}},
        }
    )
    result = simulate(config, arrivals, 300, spec)
    during = [d for d in result.decisions if 100 <= d[0] < 200]
    assert during and all(d[3] == "MetricsUnavailable" and d[1] == d[2] for d in during)
    after = [d for d in result.decisions if d[0] >= 200]
    assert any(d[3] == "ScaleDown" for d in after)


def test_bench_autoscale_quick_run_prints_the_ramp_line(tmp_path: Path) -> None:
    """The command end to end with a given calibration (no engine run): table, JSON, PNG, last line."""
    calibration = {
        "decode_s": [[1, 0.02], [32, 0.05]],
        "prefill_s": [[64, 0.04], [2048, 0.64]],
        "max_num_batched_tokens": 2048,
        "time_to_ready_s": 3.0,
        "num_steps": 0,
        "cpu": "test",
        "measured_at": "2026-01-01T00:00:00+00:00",
    }
    (tmp_path / "calibration.json").write_text(json.dumps(calibration))
    out = subprocess.run(
        [sys.executable, "-m", "conveyor.benchmarks.autoscale", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    last = out.strip().splitlines()[-1]
    assert last.startswith("ramp: attainment=") and "avg_replicas=" in last and "static_replicas=" in last
    report = json.loads((tmp_path / "autoscale.json").read_text())
    assert report["traces"][0]["name"] == "ramp"
    assert (tmp_path / "autoscale_ramp.png").stat().st_size > 0
