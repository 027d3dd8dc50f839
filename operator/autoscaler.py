"""Autoscaling decisions: observed TTFT and queue depth -> desired replicas (pure, no I/O).

The algorithm is the Horizontal Pod Autoscaler's (DESIGN.md, "Operator contract"):

    ratio   = max(ttft_p90 / targetTTFTSeconds, (queue_depth / current) / targetQueueDepth)
    raw     = ceil(current * ratio)           unless |ratio - 1| <= tolerance (then raw = current)
    raw     = clamp(raw, minReplicas, maxReplicas)

then stabilized as the HPA's `behavior` does: a scale-up goes to the *lowest* recommendation of the
last `scaleUpStabilizationSeconds`, a scale-down to the *highest* of the last
`scaleDownStabilizationSeconds`, so one noisy sample never moves the replica count. Fetching the
metrics from Prometheus and patching the Deployment belong to the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.operator.spec import AutoscalingSpec

# The HPA's default: ratios within 10% of 1 leave the replica count alone.
DEFAULT_TOLERANCE = 0.1


@dataclass(frozen=True)
class Observation:
    """Metrics of one InferenceService's pods at one time.

    ttft_p90_seconds: p90 of `conveyor:time_to_first_token_seconds` over the scrape window.
    queue_depth: sum of `conveyor:num_requests_waiting` over the pods (requests).
    Either is None when Prometheus has no data for it.
    """

    ttft_p90_seconds: float | None
    queue_depth: float | None


@dataclass(frozen=True)
class Recommendation:
    """An unstabilized replica recommendation and when it was made (monotonic seconds)."""

    at_seconds: float
    replicas: int


@dataclass(frozen=True)
class Decision:
    """The outcome of one autoscaling step.

    `replicas` is what to set; `recommended` the clamped, unstabilized value; `ratio` the metric ratio
    (None without metrics); `reason` a CamelCase word for the Scaling condition and the event.
    """

    replicas: int
    recommended: int
    ratio: float | None
    reason: str
    message: str


def metric_ratio(spec: AutoscalingSpec, current: int, observation: Observation) -> float | None:
    """max(observed / target) over the metrics that have both a target and a value; None if none do."""
    ratios: list[float] = []
    if spec.target_ttft_seconds is not None and observation.ttft_p90_seconds is not None:
        ratios.append(observation.ttft_p90_seconds / spec.target_ttft_seconds)
    if spec.target_queue_depth is not None and observation.queue_depth is not None and current > 0:
        ratios.append(observation.queue_depth / current / spec.target_queue_depth)
    return max(ratios) if ratios else None


def recommend(
    spec: AutoscalingSpec, current: int, observation: Observation, tolerance: float = DEFAULT_TOLERANCE
) -> tuple[int, float | None]:
    """(replicas within [minReplicas, maxReplicas], ratio) before stabilization."""
    low, high = spec.min_replicas, spec.max_replicas
    if current == 0:
        # Scaled to zero there is no TTFT to read; waiting requests (if any) wake one replica.
        waiting = observation.queue_depth or 0
        return min(max(low, 1 if waiting > 0 else 0), high), None
    ratio = metric_ratio(spec, current, observation)
    if ratio is None or abs(ratio - 1.0) <= tolerance:
        return min(max(current, low), high), ratio
    return min(max(math.ceil(current * ratio), low), high), ratio


def stabilize(spec: AutoscalingSpec, current: int, history: list[Recommendation], now_seconds: float) -> int:
    """The HPA's stabilization over `history` (which includes the newest recommendation).

    Scale up only to the minimum recommended over the scale-up window, down only to the maximum over
    the scale-down window; otherwise stay.
    """
    up_window = [
        r.replicas for r in history if now_seconds - r.at_seconds <= spec.scale_up_stabilization_seconds
    ]
    down_window = [
        r.replicas for r in history if now_seconds - r.at_seconds <= spec.scale_down_stabilization_seconds
    ]
    up = min(up_window) if up_window else current
    down = max(down_window) if down_window else current
    if up > current:
        return up
    if down < current:
        return down
    return current


def decide(
    spec: AutoscalingSpec,
    current: int,
    observation: Observation,
    history: list[Recommendation],
    now_seconds: float,
    tolerance: float = DEFAULT_TOLERANCE,
) -> tuple[Decision, list[Recommendation]]:
    """One autoscaling step: the decision and the recommendation history to keep for the next step.

    `history` holds earlier recommendations (oldest first); entries older than both windows are
    dropped from the returned history.
    """
    recommended, ratio = recommend(spec, current, observation, tolerance)
    keep = max(spec.scale_up_stabilization_seconds, spec.scale_down_stabilization_seconds)
    new_history = [r for r in history if now_seconds - r.at_seconds <= keep]
    new_history.append(Recommendation(now_seconds, recommended))
    replicas = stabilize(spec, current, new_history, now_seconds)

    observed = []
    if observation.ttft_p90_seconds is not None:
        observed.append(f"p90 TTFT {observation.ttft_p90_seconds:.3f}s")
    if observation.queue_depth is not None:
        observed.append(f"{observation.queue_depth:g} waiting")
    seen = ", ".join(observed) or "no metrics"
    if replicas > current:
        reason = "ScaleUp"
    elif replicas < current:
        reason = "ScaleDown"
    elif recommended != current:
        reason = "Stabilizing"
    else:
        reason = "WithinTarget"
    message = f"{current} -> {replicas} replicas ({seen}; recommended {recommended})"
    return Decision(replicas, recommended, ratio, reason, message), new_history
