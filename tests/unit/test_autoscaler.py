"""The autoscaling decision (HPA algorithm over TTFT and queue depth), without Prometheus or a cluster."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.operator.autoscaler import History, Observation, Recommendation, ScaleEvent, decide, recommend
from conveyor.operator.spec import AutoscalingSpec


def spec(**kwargs: object) -> AutoscalingSpec:
    values: dict[str, object] = {
        "minReplicas": 1,
        "maxReplicas": 10,
        "targetTTFTSeconds": 0.5,
        "targetQueueDepth": 4,
    }
    values.update(kwargs)
    return AutoscalingSpec.model_validate(values)


def step(
    s: AutoscalingSpec,
    current: int,
    obs: Observation,
    history: History | None = None,
    now: float = 0.0,
    ready: int | None = None,
):
    return decide(s, current, current if ready is None else ready, obs, history or History(), now)


def test_defaults_are_the_hpa_behavior_with_one_pod_down_per_period() -> None:
    s = spec()
    assert s.tolerance == 0.1
    assert s.scale_up.stabilization_window_seconds == 0
    assert s.scale_down.stabilization_window_seconds == 300
    assert [(p.type, p.value, p.period_seconds) for p in s.scale_up.policies or []] == [
        ("Percent", 100, 15),
        ("Pods", 4, 15),
    ]
    assert [(p.type, p.value, p.period_seconds) for p in s.scale_down.policies or []] == [("Pods", 1, 15)]
    # Setting one field of a direction keeps that direction's other defaults.
    s = spec(behavior={"scaleDown": {"stabilizationWindowSeconds": 60}})
    assert s.scale_down.stabilization_window_seconds == 60
    assert s.scale_down.policies == spec().scale_down.policies


@pytest.mark.parametrize(
    ("current", "ready", "observation", "expected", "reason"),
    [
        (2, 2, Observation(1.0, 0, 1.0), 4, None),  # TTFT twice the target: double
        (3, 3, Observation(0.25, 36, 1.0), 9, None),  # 36 waiting / 3 = 12 per replica, 3x target 4
        (2, 2, Observation(0.52, 0, 1.0), 2, "WithinTolerance"),
        (4, 4, Observation(0.1, 0, 1.0), 1, None),  # ceil(4 x 0.2) = 1
        (8, 8, Observation(5.0, 0, 1.0), 10, None),  # clamped to maxReplicas
        (3, 3, Observation(None, None), 3, "MetricsUnavailable"),
        (4, 4, Observation(None, 0, 0.0), 1, None),  # no request in the window: idle, not unknown
        (4, 4, Observation(None, 0, 2.0), 4, "PartialMetrics"),  # requests but no p90: no scale-down
        (4, 4, Observation(None, 40, 2.0), 10, None),  # ... but the known queue may still scale up
        (4, 2, Observation(0.75, 0, 1.0), 4, "WaitingForPendingReplicas"),  # ceil(2 x 1.5) = 3 <= 4
        (4, 2, Observation(1.5, 0, 1.0), 6, None),  # ceil(2 x 3) = 6 > 4 pending: add
        (3, 0, Observation(None, 5), 3, "WaitingForReadyReplicas"),
    ],
)
def test_recommend(
    current: int, ready: int, observation: Observation, expected: int, reason: str | None
) -> None:
    replicas, _, got_reason, _ = recommend(spec(), current, ready, observation)
    assert (replicas, got_reason) == (expected, reason)


def test_ready_zero_with_waiting_requests_wakes_one() -> None:
    zero_ok = spec(minReplicas=0)
    decision, _ = step(zero_ok, 0, Observation(None, 0))
    assert decision.replicas == 0
    decision, _ = step(zero_ok, 0, Observation(None, 3))
    assert (decision.replicas, decision.reason) == (1, "ScaleFromZero")
    decision, _ = step(spec(minReplicas=2), 0, Observation(None, 3))
    assert decision.replicas == 2


def test_unknown_metrics_hold_and_say_so() -> None:
    decision, history = step(spec(), 5, Observation(None, None), now=10)
    assert (decision.replicas, decision.reason, decision.metrics_available) == (
        5,
        "MetricsUnavailable",
        False,
    )
    assert "unknown" in decision.message
    # A hold is not a recommendation: it does not fill the stabilization window.
    assert history.recommendations == ()


def test_scale_up_is_immediate_and_scale_down_waits_for_the_window() -> None:
    s = spec()
    decision, history = step(s, 2, Observation(1.0, 0, 1.0), now=0)
    assert (decision.replicas, decision.reason) == (4, "ScaleUp")
    assert "p90 TTFT 1.000s" in decision.message

    # Load drops right away: the scale-down window still remembers the recommendation of 4.
    decision, history = step(s, 4, Observation(0.1, 0, 1.0), history, now=30)
    assert decision.recommended == 1
    assert (decision.replicas, decision.reason) == (4, "ScaleDownStabilizing")

    # After the 300 s window only low recommendations remain; one pod goes per 15 s period.
    decision, history = step(s, 4, Observation(0.1, 0, 1.0), history, now=331)
    assert (decision.replicas, decision.reason) == (3, "ScaleDown")
    assert "limited to -1 by behavior.scaleDown" in decision.message
    decision, history = step(s, 3, Observation(0.1, 0, 1.0), history, now=340)
    assert (decision.replicas, decision.reason) == (3, "ScaleDownLimited")
    assert "held by behavior.scaleDown" in decision.message  # not "limited to -0"
    decision, history = step(s, 3, Observation(0.1, 0, 1.0), history, now=347)
    assert decision.replicas == 2
    assert all(347 - r.at_seconds <= 300 for r in history.recommendations)


def test_scale_up_window_takes_the_lowest_recent_recommendation() -> None:
    s = spec(behavior={"scaleUp": {"stabilizationWindowSeconds": 60}})
    history = History(recommendations=(Recommendation(0, 3), Recommendation(30, 6)))
    decision, _ = step(s, 2, Observation(1.0, 0, 1.0), history, now=50)
    assert decision.recommended == 4
    assert decision.replicas == 3


def test_scale_up_rate_is_max_of_100_percent_and_4_pods_per_period() -> None:
    s = spec(maxReplicas=100)
    # From 2: +100 % is 4, +4 pods is 6: the larger wins.
    decision, history = step(s, 2, Observation(10.0, 0, 1.0), now=0)
    assert decision.replicas == 6
    # Within the same 15 s period the 4 added pods count against the limit (start of period: 2).
    decision, history = step(s, 6, Observation(10.0, 0, 1.0), history, now=5, ready=6)
    assert (decision.replicas, decision.reason) == (6, "ScaleUpLimited")
    # A new period starts from 6: +100 % = 12.
    decision, _ = step(s, 6, Observation(10.0, 0, 1.0), history, now=16, ready=6)
    assert decision.replicas == 12


def test_disabled_direction_never_moves() -> None:
    s = spec(behavior={"scaleDown": {"selectPolicy": "Disabled", "stabilizationWindowSeconds": 0}})
    decision, _ = step(s, 5, Observation(0.05, 0, 1.0))
    assert decision.replicas == 5


def test_noisy_constant_load_does_not_oscillate() -> None:
    """A load that needs 4 replicas, measured with +-8 % noise, scaled every 15 s for an hour."""
    import random

    rng = random.Random(7)
    s = spec()
    current, history, changes = 4, History(), 0
    for tick in range(240):
        ttft = 0.5 * (1 + rng.uniform(-0.08, 0.08))
        decision, history = step(s, current, Observation(ttft, 0, 3.0), history, now=tick * 15.0)
        changes += decision.replicas != current
        current = decision.replicas
    assert changes == 0


def test_a_spike_then_quiet_scales_down_only_after_the_window_and_by_the_rate_limit() -> None:
    s = spec()
    current, history, timeline = 2, History(), []
    for tick in range(60):
        now = tick * 15.0
        obs = Observation(3.0, 0, 1.0) if tick == 0 else Observation(0.05, 0, 1.0)
        decision, history = step(s, current, obs, history, now=now)
        timeline.append((now, current, decision.replicas))
        current = decision.replicas
    downs = [(t, a, b) for t, a, b in timeline if b < a]
    assert timeline[0][2] == 6  # 2 -> 6 at once (+4 pods beats +100 %)
    assert downs and downs[0][0] > 300  # nothing goes before the 300 s window has passed
    assert all(a - b == 1 for _, a, b in downs)  # one pod per period
    assert current == 1


@settings(max_examples=300, deadline=None)
@given(
    current=st.integers(0, 20),
    ready_frac=st.floats(0, 1),
    ttft=st.one_of(st.none(), st.floats(0, 100)),
    queue=st.one_of(st.none(), st.floats(0, 1000)),
    rate=st.one_of(st.none(), st.floats(0, 10)),
    low=st.integers(0, 5),
    extra=st.integers(0, 10),
    past=st.lists(st.tuples(st.floats(0, 600), st.integers(0, 20)), max_size=10),
    events=st.lists(st.tuples(st.floats(0, 600), st.integers(-5, 5)), max_size=5),
)
def test_decision_stays_within_bounds_and_holds_without_metrics(
    current: int,
    ready_frac: float,
    ttft: float | None,
    queue: float | None,
    rate: float | None,
    low: int,
    extra: int,
    past: list[tuple[float, int]],
    events: list[tuple[float, int]],
) -> None:
    s = spec(minReplicas=low, maxReplicas=max(low, 1) + extra)
    ready = int(current * ready_frac)
    history = History(
        tuple(Recommendation(t, min(max(r, s.min_replicas), s.max_replicas)) for t, r in sorted(past)),
        tuple(ScaleEvent(t, c) for t, c in sorted(events)),
    )
    decision, _ = decide(s, current, ready, Observation(ttft, queue, rate), history, 600.0)
    assert s.min_replicas <= decision.replicas <= s.max_replicas
    if not decision.metrics_available and s.min_replicas <= current <= s.max_replicas:
        assert decision.replicas == current
    if decision.replicas != current:
        assert decision.reason in ("ScaleUp", "ScaleDown", "ScaleFromZero")


@given(current=st.integers(1, 20), ratio=st.floats(0.91, 1.09))
def test_inside_tolerance_nothing_changes(current: int, ratio: float) -> None:
    s = spec(maxReplicas=20, targetQueueDepth=None)
    decision, _ = step(s, current, Observation(0.5 * ratio, None, 1.0))
    assert decision.replicas == current


def test_requests_per_second_target_sizes_the_pool_from_the_arrival_rate() -> None:
    s = spec(targetTTFTSeconds=None, targetQueueDepth=None, targetRequestsPerSecond=1.5)
    # 9 requests/s over 3 Ready replicas = 3/replica, twice the target: 6 replicas.
    decision, _ = step(s, 3, Observation(None, None, request_rate=9.0))
    assert (decision.replicas, decision.reason) == (6, "ScaleUp")
    assert "requests/s 9 over 3 ready = 3.00/replica vs target 1.5" in decision.message
    # Unknown rate: hold.
    decision, _ = step(s, 3, Observation(None, None, request_rate=None))
    assert (decision.replicas, decision.reason) == (3, "MetricsUnavailable")


def test_requests_held_by_the_router_wake_a_service_scaled_to_zero() -> None:
    """At zero replicas the server has no queue to read; the router's held requests are the demand."""
    zero_ok = spec(minReplicas=0)
    decision, _ = step(zero_ok, 0, Observation(None, None, router_waiting=3))
    assert (decision.replicas, decision.reason, decision.metrics_available) == (
        1,
        "RouterRequestsWaiting",
        True,
    )
    assert decision.message == (
        "0 -> 1 replicas (p90 TTFT unknown; queue depth unknown; 3 waiting in the router; recommended 1)"
    )
    # max(minReplicas, 1), within maxReplicas.
    decision, _ = step(spec(minReplicas=0, maxReplicas=1), 0, Observation(None, None, router_waiting=40))
    assert decision.replicas == 1


def test_an_idle_router_holds_zero_replicas_and_counts_as_data() -> None:
    decision, history = step(spec(minReplicas=0), 0, Observation(None, None, router_waiting=0))
    assert (decision.replicas, decision.reason, decision.metrics_available) == (0, "Steady", True)
    assert history.recommendations == (Recommendation(0.0, 0),)
    # Without the router's reading (a failed query) nothing is known: hold, MetricsUnavailable.
    decision, _ = step(spec(minReplicas=0), 0, Observation(None, None, router_waiting=None))
    assert (decision.replicas, decision.metrics_available) == (0, False)


@pytest.mark.parametrize(
    ("current", "ready", "expected", "reason"),
    [
        (2, 0, 2, "WaitingForReadyReplicas"),  # pods starting: the router's requests wait for them
        (2, 2, 1, None),  # replicas Ready: their own queues count, not the router's
    ],
)
def test_router_waiting_only_counts_with_no_replica(
    current: int, ready: int, expected: int, reason: str | None
) -> None:
    observation = Observation(0.1, 0, 1.0, router_waiting=50)
    replicas, _, got_reason, _ = recommend(spec(), current, ready, observation)
    assert (replicas, got_reason) == (expected, reason)


class _FakePrometheus:
    """PrometheusSource.query answered from a table of PromQL -> vector (anything else: no data)."""

    def __init__(self, answers: dict[str, list[tuple[dict[str, str], float]]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def __call__(self, promql: str) -> list[tuple[dict[str, str], float]]:
        self.asked.append(promql)
        return self.answers.get(promql, [])


def test_observe_reads_the_router_pods_even_with_no_server_pod() -> None:
    from conveyor.operator.metrics import PrometheusSource

    held = 'sum(conveyor:router_requests_waiting{namespace="serving",pod=~"llama-router-5d8f-abcde"})'
    source = PrometheusSource("http://prometheus:9090")
    source.query = _FakePrometheus({held: [({}, 2.0)]})  # type: ignore[method-assign]
    reading = source.observe("serving", [], 60, router_pods=["llama-router-5d8f-abcde"])
    assert source.query.asked == [held]  # type: ignore[attr-defined]
    assert reading.observation == Observation(None, None, router_waiting=2.0)
    assert reading.errors == {"pods": "no Ready pods"}
    # No router pod yet: unknown, never 0.
    reading = source.observe("serving", [], 60, router_pods=[])
    assert reading.observation.router_waiting is None
    assert reading.errors == {"pods": "no Ready pods", "router_waiting": "no router pods"}
    # No router (router_pods None): the router's series is not asked for.
    source.query = _FakePrometheus({})  # type: ignore[method-assign]
    reading = source.observe("serving", ["llama-5d8f-abcde"], 60)
    assert not any("router" in q for q in source.query.asked)  # type: ignore[attr-defined]
    assert "router_waiting" not in reading.errors
    source.close()


def _merge_patch(target: object, patch: object) -> object:
    """RFC 7386 JSON merge patch, as the API server applies a status patch."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = _merge_patch(merged.get(key), value)
    return merged


def test_status_after_an_outage_holds_no_old_number_and_after_recovery_no_old_error() -> None:
    """status.autoscaler.metrics is current or absent, field by field, as stored after each step."""
    from conveyor.operator.metrics import Reading
    from conveyor.operator.status import autoscaler_status

    s = spec(minReplicas=2)

    def record(stored: dict, reading: Reading, now: float) -> dict:
        decision, history = decide(s, 2, 2, reading.observation, History(), now)
        patch = autoscaler_status(
            previous=stored,
            decision=decision,
            reading=reading,
            history=history,
            current=2,
            ready=2,
            acted=True,
            generation=1,
            now=f"t{now:g}",
        )
        return _merge_patch(stored, patch)  # type: ignore[return-value]

    good = Reading(Observation(2.125, 8.0, request_rate=0.3613, running_requests=4.0, kv_cache_usage=0.5), {})
    down = "ConnectError: [Errno 111] Connection refused"
    outage = Reading(Observation(None, None), {q: down for q in ("ttft_p90", "queue", "request_rate")})
    stored = record({}, good, 1)
    assert stored["autoscaler"]["metrics"] == {
        "time": "t1",
        "readyPods": 2,
        "ttftP90Seconds": 2.125,
        "requestRate": 0.3613,
        "queueDepth": 8.0,
        "runningRequests": 4.0,
        "kvCacheUsage": 0.5,
        "lastSuccessfulReadTime": "t1",
    }
    stored = record(stored, outage, 2)
    assert stored["autoscaler"]["metrics"] == {
        "time": "t2",
        "readyPods": 2,
        "errors": {"queueDepth": down, "requestRate": down, "ttftP90Seconds": down},
        "lastSuccessfulReadTime": "t1",
    }
    available = next(c for c in stored["conditions"] if c["type"] == "MetricsAvailable")
    assert available["status"] == "False"
    # Part of it back: the signals that read return, their errors go, the others stay as errors.
    partly = Reading(Observation(None, 3.0, running_requests=1.0), {"ttft_p90": "no data"})
    stored = record(stored, partly, 3)
    assert stored["autoscaler"]["metrics"] == {
        "time": "t3",
        "readyPods": 2,
        "queueDepth": 3.0,
        "runningRequests": 1.0,
        "errors": {"ttftP90Seconds": "no data"},
        "lastSuccessfulReadTime": "t3",
    }
    stored = record(stored, good, 4)
    assert "errors" not in stored["autoscaler"]["metrics"]
    assert stored["autoscaler"]["metrics"]["lastSuccessfulReadTime"] == "t4"
    available = next(c for c in stored["conditions"] if c["type"] == "MetricsAvailable")
    assert (available["status"], available["message"]) == ("True", "every targeted signal was read")


def test_a_hung_prometheus_costs_one_deadline_for_all_queries() -> None:
    """A loopback server that accepts connections and never answers: the five queries run at once and
    each ends as a timeout within the one deadline (asked one after another they took five)."""
    import socket
    import threading
    import time

    from conveyor.operator.metrics import PrometheusSource

    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    source = PrometheusSource(f"http://127.0.0.1:{listener.getsockname()[1]}", deadline_seconds=1.0)
    try:
        started = time.monotonic()
        reading = source.observe("serving", ["llama-0"], 60)
        elapsed = time.monotonic() - started
    finally:
        source.close()
        listener.close()
        for conn in held:
            conn.close()
    assert reading.observation == Observation(None, None)
    assert set(reading.errors) == {"ttft_p90", "request_rate", "queue", "running", "kv_usage"}
    assert set(reading.errors.values()) == {"no answer within 1 s"}  # however the wait ended
    assert elapsed < 4.0  # one deadline (1 s), not five
