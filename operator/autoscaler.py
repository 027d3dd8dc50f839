"""Autoscaling decisions: observed TTFT and queue depth -> desired replicas (pure, no I/O).

The algorithm is the Horizontal Pod Autoscaler's (DESIGN.md, "Operator contract"; mirrored from
kubernetes `pkg/controller/podautoscaler/horizontal.go`) over two signals of the Ready pods:

    ratio   = max(ttft_p90 / targetTTFTSeconds, (queue_depth / ready) / targetQueueDepth,
                  (requests_per_second / ready) / targetRequestsPerSecond)   over the targets set
    raw     = ceil(ready * ratio)             unless |ratio - 1| <= tolerance (then raw = current)
    raw     = current  if ready < raw <= current (pods still starting are supply already)
    raw     = clamp(raw, minReplicas, maxReplicas)

then stabilized as the HPA's `behavior` does (a scale-up goes to the *lowest* recommendation of the
scale-up window, a scale-down to the *highest* of the scale-down window) and rate-limited by the
behavior's policies (at most `value` pods, or percent of the replicas at the period's start, per
sliding `periodSeconds`; `selectPolicy: Max` takes the policy that allows the most change).

Missing data is never read as zero: a TTFT that is unknown (no series, NaN) while requests arrive,
or a queue depth without series, is "unknown". All targeted signals unknown -> hold the current
count (reason `MetricsUnavailable`); some unknown -> only scale-up is allowed, on the known ones. No
TTFT samples at all in the window (request rate 0) is known idleness, not an unknown. With no replica
at all, waiting requests wake one (`max(minReplicas, 1)`): those the router holds while no replica is
Ready (`conveyor:router_requests_waiting`, reason `RouterRequestsWaiting`; without a replica the server
has no queue to read), or a server queue; pods still starting are waited for.

`current` is the Deployment's `spec.replicas`, `ready` its pods that are Ready now. Times are
seconds on one clock (the operator uses Unix time, so the history survives a restart in status).
Fetching the metrics from Prometheus and writing the Deployment belong to the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.operator.spec import AutoscalingSpec, ScalingRules


@dataclass(frozen=True)
class Observation:
    """Metrics of one InferenceService's Ready pods at one time; None where Prometheus has no data.

    ttft_p90_seconds: p90 of `conveyor:time_to_first_token_seconds` over the rate window (seconds).
    request_rate: TTFT samples per second over the same window: requests started per second (0 = idle;
    a signal when targetRequestsPerSecond is set).
    queue_depth: sum of `conveyor:num_requests_waiting` (requests).
    running_requests, kv_cache_usage: `conveyor:num_requests_running` summed and mean
    `conveyor:kv_cache_usage_perc`, context for status only.
    router_waiting: sum of `conveyor:router_requests_waiting` over the router pods (requests held
    because no replica is Ready: demand while scaled to zero); None without a router or without data.
    """

    ttft_p90_seconds: float | None
    queue_depth: float | None
    request_rate: float | None = None
    running_requests: float | None = None
    kv_cache_usage: float | None = None
    router_waiting: float | None = None


@dataclass(frozen=True)
class Recommendation:
    """A clamped, unstabilized replica recommendation and when it was made (seconds)."""

    at_seconds: float
    replicas: int


@dataclass(frozen=True)
class ScaleEvent:
    """A change the autoscaler made: `change` replicas (negative: removed) at `at_seconds`."""

    at_seconds: float
    change: int


@dataclass(frozen=True)
class History:
    """What one decision needs from the earlier ones, oldest first."""

    recommendations: tuple[Recommendation, ...] = ()
    scale_events: tuple[ScaleEvent, ...] = ()


@dataclass(frozen=True)
class Decision:
    """The outcome of one autoscaling step.

    replicas: what `spec.replicas` should be; recommended: the clamped, unstabilized value.
    ratio: the metric ratio that drove it (None without metrics). reason: a CamelCase word for the
    Scaling condition and the Event; message: one line with the numbers. metrics_available: False
    when every targeted signal was unknown.
    """

    replicas: int
    recommended: int
    ratio: float | None
    reason: str
    message: str
    metrics_available: bool = True


def _signals(
    spec: AutoscalingSpec, ready: int, observation: Observation
) -> tuple[dict[str, float], list[str], str]:
    """({signal: ratio} of the known targeted signals, [unknown targeted signals], a description).

    Queue depth and request rate are per Ready replica, so they have no ratio while none is Ready.
    """
    known: dict[str, float] = {}
    unknown: list[str] = []
    parts: list[str] = []

    def finite(value: float | None) -> bool:
        return value is not None and math.isfinite(value)

    def per_replica(name: str, value: float | None, target: float, text: str, fmt: str) -> None:
        if not finite(value):
            unknown.append(name)
            parts.append(f"{text} unknown")
            return
        assert value is not None
        per = f" = {value / ready:{fmt}}/replica" if ready else ""
        parts.append(f"{text} {value:g} over {ready} ready{per} vs target {target:g}")
        if ready > 0:
            known[name] = value / ready / target

    if spec.target_ttft_seconds is not None:
        ttft = observation.ttft_p90_seconds
        if finite(ttft):
            assert ttft is not None
            known["ttft"] = ttft / spec.target_ttft_seconds
            parts.append(f"p90 TTFT {ttft:.3f}s vs target {spec.target_ttft_seconds:g}s")
        elif observation.request_rate == 0:
            known["ttft"] = 0.0  # No request in the window: no latency pressure.
            parts.append("no requests")
        else:
            unknown.append("ttft")
            parts.append("p90 TTFT unknown")
    if spec.target_queue_depth is not None:
        per_replica("queue", observation.queue_depth, spec.target_queue_depth, "queue depth", ".1f")
    if spec.target_requests_per_second is not None:
        rate = observation.request_rate
        rounded = round(rate, 2) if finite(rate) else rate
        per_replica("rate", rounded, spec.target_requests_per_second, "requests/s", ".2f")
    if finite(observation.router_waiting):
        parts.append(f"{observation.router_waiting:g} waiting in the router")
    return known, unknown, "; ".join(parts)


def _scale_up_limit(current: int, events: tuple[ScaleEvent, ...], rules: ScalingRules, now: float) -> int:
    """The most replicas the scale-up policies allow now (HPA `calculateScaleUpLimitWithScalingRules`)."""
    limits = []
    for policy in rules.policies or ():
        added = sum(e.change for e in events if e.change > 0 and now - e.at_seconds < policy.period_seconds)
        start = current - added
        if policy.type == "Pods":
            limits.append(start + policy.value)
        else:
            limits.append(math.ceil(start * (1 + policy.value / 100)))
    if not limits:
        return current
    return max(limits) if rules.select_policy == "Max" else min(limits)


def _scale_down_limit(current: int, events: tuple[ScaleEvent, ...], rules: ScalingRules, now: float) -> int:
    """The fewest replicas the scale-down policies allow now (HPA `calculateScaleDownLimit...`)."""
    limits = []
    for policy in rules.policies or ():
        removed = -sum(
            e.change for e in events if e.change < 0 and now - e.at_seconds < policy.period_seconds
        )
        start = current + removed
        if policy.type == "Pods":
            limits.append(start - policy.value)
        else:
            limits.append(math.floor(start * (1 - policy.value / 100)))
    if not limits:
        return current
    return min(limits) if rules.select_policy == "Max" else max(limits)


def recommend(
    spec: AutoscalingSpec, current: int, ready: int, observation: Observation
) -> tuple[int, float | None, str | None, bool]:
    """(clamped recommendation, ratio, reason that overrides the default one, metrics available)."""
    low, high = spec.min_replicas, spec.max_replicas
    known, unknown, _ = _signals(spec, ready, observation)
    if ready == 0:
        waiting = observation.queue_depth
        held = observation.router_waiting
        if current == 0:
            # Requests the router holds are demand a scaled-to-zero service cannot report itself.
            if held is not None and held > 0:
                return min(max(low, 1), high), None, "RouterRequestsWaiting", True
            if waiting is not None and waiting > 0:
                return min(max(low, 1), high), None, "ScaleFromZero", True
            return min(max(current, low), high), None, None, waiting is not None or held is not None
        # Pods exist but none is Ready yet: wait for them, whatever the metrics say.
        return min(max(current, low), high), None, "WaitingForReadyReplicas", not unknown or bool(known)
    if not known:
        return min(max(current, low), high), None, "MetricsUnavailable", False
    ratio = max(known.values())
    if abs(ratio - 1.0) <= spec.tolerance:
        return min(max(current, low), high), ratio, "WithinTolerance", True
    raw = math.ceil(ready * ratio)
    reason = None
    if ready < raw <= current:
        raw, reason = current, "WaitingForPendingReplicas"
    if unknown and raw < current:
        # A signal we cannot see might be high: never scale down on half the picture.
        raw, reason = current, "PartialMetrics"
    return min(max(raw, low), high), ratio, reason, True


def _limited(change: int, rules: str) -> str:
    """The decision message's note on a rate limit: `limited to +2 by ...`, or `held by ...` when the
    rules allow no change now."""
    return f"; held by {rules}" if change == 0 else f"; limited to {change:+d} by {rules}"


def _reason(
    spec: AutoscalingSpec,
    current: int,
    replicas: int,
    recommended: int,
    stabilized: int,
    ratio: float | None,
    special: str | None,
) -> str:
    """The CamelCase reason of a decision."""
    if replicas > current:
        return special if special in ("ScaleFromZero", "RouterRequestsWaiting") else "ScaleUp"
    if replicas < current:
        return "ScaleDown"
    if special is not None:
        return special
    if recommended < current:
        return "ScaleDownStabilizing" if stabilized == current else "ScaleDownLimited"
    if recommended > current:
        return "ScaleUpStabilizing" if stabilized == current else "ScaleUpLimited"
    if ratio is not None and ratio > 1 and current >= spec.max_replicas:
        return "AtMaxReplicas"
    if ratio is not None and ratio < 1 and current <= spec.min_replicas:
        return "AtMinReplicas"
    return "Steady"


def decide(
    spec: AutoscalingSpec,
    current: int,
    ready: int,
    observation: Observation,
    history: History,
    now_seconds: float,
) -> tuple[Decision, History]:
    """One autoscaling step: the decision and the history to keep for the next step.

    current: the Deployment's `spec.replicas`; ready: its Ready pods. Entries older than every window
    and period are dropped from the returned history.
    """
    up_rules, down_rules = spec.scale_up, spec.scale_down
    recommended, ratio, reason, available = recommend(spec, current, ready, observation)
    if not spec.min_replicas <= current <= spec.max_replicas:
        # As the HPA does: bounds that moved apply at once, without windows or rate limits.
        replicas = min(max(current, spec.min_replicas), spec.max_replicas)
        message = f"{current} -> {replicas} replicas (outside [{spec.min_replicas}, {spec.max_replicas}])"
        reason = "ScaleUp" if replicas > current else "ScaleDown"
        events = (*history.scale_events, ScaleEvent(now_seconds, replicas - current))
        return Decision(replicas, replicas, None, reason, message, available), History(
            history.recommendations, events
        )

    up_window = up_rules.stabilization_window_seconds or 0
    down_window = down_rules.stabilization_window_seconds or 0
    recommendations = [
        r for r in history.recommendations if now_seconds - r.at_seconds <= max(up_window, down_window)
    ]
    # A hold for lack of data is not a recommendation: it must not stretch the windows.
    if available:
        recommendations.append(Recommendation(now_seconds, recommended))
    up = min([r.replicas for r in recommendations if now_seconds - r.at_seconds <= up_window] + [recommended])
    down = max(
        [r.replicas for r in recommendations if now_seconds - r.at_seconds <= down_window] + [recommended]
    )
    stabilized = current
    if stabilized < up:
        stabilized = up
    if stabilized > down:
        stabilized = down

    replicas = stabilized
    limited = ""
    if replicas > current:
        limit = (
            current
            if up_rules.select_policy == "Disabled"
            else max(_scale_up_limit(current, history.scale_events, up_rules, now_seconds), current)
        )
        if replicas > limit:
            replicas, limited = limit, _limited(limit - current, "behavior.scaleUp")
    elif replicas < current:
        limit = (
            current
            if down_rules.select_policy == "Disabled"
            else min(_scale_down_limit(current, history.scale_events, down_rules, now_seconds), current)
        )
        limit = max(limit, spec.min_replicas)
        if replicas < limit:
            replicas, limited = limit, _limited(limit - current, "behavior.scaleDown")

    reason = _reason(spec, current, replicas, recommended, stabilized, ratio, reason)
    ratio_text = f", ratio {ratio:.2f}" if ratio is not None else ""
    message = (
        f"{current} -> {replicas} replicas ({_signals(spec, ready, observation)[2]}{ratio_text}; "
        f"recommended {recommended}{limited})"
    )

    keep = max(
        [up_window, down_window]
        + [p.period_seconds for rules in (up_rules, down_rules) for p in rules.policies or ()]
    )
    events = [e for e in history.scale_events if now_seconds - e.at_seconds <= keep]
    if replicas != current:
        events.append(ScaleEvent(now_seconds, replicas - current))
    decision = Decision(replicas, recommended, ratio, reason, message, available)
    return decision, History(tuple(recommendations), tuple(events))
