"""The autoscaling decision (HPA algorithm over TTFT and queue depth), without Prometheus or a cluster."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.operator.autoscaler import Observation, Recommendation, decide, metric_ratio, recommend
from conveyor.operator.spec import AutoscalingSpec


def spec(**kwargs: object) -> AutoscalingSpec:
    values = {
        "minReplicas": 1,
        "maxReplicas": 10,
        "targetTTFTSeconds": 0.5,
        "targetQueueDepth": 4,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 300,
    }
    values.update(kwargs)
    return AutoscalingSpec.model_validate(values)


def test_ratio_is_the_worse_of_ttft_and_queue_per_replica() -> None:
    # TTFT at 2x target; 24 waiting over 3 replicas is 8 per replica, 2x the target of 4.
    assert metric_ratio(spec(), 3, Observation(ttft_p90_seconds=1.0, queue_depth=24)) == pytest.approx(2.0)
    assert metric_ratio(spec(), 3, Observation(ttft_p90_seconds=0.25, queue_depth=36)) == pytest.approx(3.0)
    assert metric_ratio(spec(targetQueueDepth=None), 3, Observation(0.25, 36)) == pytest.approx(0.5)
    assert metric_ratio(spec(), 3, Observation(None, None)) is None


@pytest.mark.parametrize(
    ("current", "observation", "expected"),
    [
        (2, Observation(1.0, 0), 4),  # TTFT twice the target: double
        (2, Observation(0.52, 0), 2),  # within the 10% tolerance: stay
        (4, Observation(0.1, 0), 1),  # far below target: ceil(4 x 0.2) = 1
        (8, Observation(5.0, 0), 10),  # clamped to maxReplicas
        (3, Observation(None, None), 3),  # no metrics: stay
    ],
)
def test_recommend(current: int, observation: Observation, expected: int) -> None:
    assert recommend(spec(), current, observation)[0] == expected


def test_scaled_to_zero_wakes_on_waiting_requests() -> None:
    zero_ok = spec(minReplicas=0)
    assert recommend(zero_ok, 0, Observation(None, 0))[0] == 0
    assert recommend(zero_ok, 0, Observation(None, 3))[0] == 1


def test_scale_up_is_immediate_and_scale_down_waits_for_the_window() -> None:
    s = spec()
    decision, history = decide(s, 2, Observation(1.0, 0), [], now_seconds=0)
    assert (decision.replicas, decision.reason) == (4, "ScaleUp")

    # Load drops right away: the scale-down window still remembers the recommendation of 4.
    decision, history = decide(s, 4, Observation(0.1, 0), history, now_seconds=30)
    assert decision.recommended == 1
    assert (decision.replicas, decision.reason) == (4, "Stabilizing")

    # After the 300 s window only low recommendations remain.
    decision, history = decide(s, 4, Observation(0.1, 0), history, now_seconds=331)
    assert (decision.replicas, decision.reason) == (1, "ScaleDown")
    assert all(331 - r.at_seconds <= 300 for r in history)


def test_scale_up_window_takes_the_lowest_recent_recommendation() -> None:
    s = spec(scaleUpStabilizationSeconds=60)
    history = [Recommendation(0, 3), Recommendation(30, 6)]
    decision, _ = decide(s, 2, Observation(1.0, 0), history, now_seconds=50)
    assert decision.recommended == 4
    assert decision.replicas == 3


@given(
    current=st.integers(1, 20),
    ttft=st.one_of(st.none(), st.floats(0, 100)),
    queue=st.one_of(st.none(), st.floats(0, 1000)),
    low=st.integers(0, 5),
    extra=st.integers(0, 10),
)
def test_recommendation_stays_within_bounds(
    current: int, ttft: float | None, queue: float | None, low: int, extra: int
) -> None:
    s = spec(minReplicas=low, maxReplicas=max(low, 1) + extra)
    replicas, _ = recommend(s, current, Observation(ttft, queue))
    assert s.min_replicas <= replicas <= s.max_replicas
