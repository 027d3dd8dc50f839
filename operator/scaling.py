"""The builtin autoscaler's step for one InferenceService, around the pure `autoscaler.decide`.

`observe` reads the Ready pods' metrics from Prometheus (`metrics.py`); the handler calls it without
the resource's lock, so a slow or hung Prometheus never delays a reconcile. `step`, under the lock,
reads the resource and its Deployment again, decides, writes the Deployment's replicas through its
scale subresource (mode Active) and returns the decision's record (status, Events) for the handler to
write. It is the only writer of replicas under `engine: builtin`; reconcile applies the count it finds,
so it never reverts one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from conveyor.operator.autoscaler import Decision, History, Observation, decide
from conveyor.operator.cluster import SCALED_OBJECT, ClusterAPI
from conveyor.operator.events import Event, transitions
from conveyor.operator.metrics import PROMETHEUS_DEADLINE_SECONDS, PrometheusSource, Reading
from conveyor.operator.render import router_selector_string
from conveyor.operator.spec import InferenceServiceSpec, parse_spec
from conveyor.operator.status import METRICS_AVAILABLE, autoscaler_status, history_from_status, rfc3339


@dataclass(frozen=True)
class Step:
    """One step's record: the resource as read (`body`, the Events' object), the `decision`, the
    `status` merge patch, the `events` to post, the `history` to keep for the next step, and whether
    the metrics were available."""

    body: dict[str, Any]
    decision: Decision
    status: dict[str, Any]
    events: list[Event]
    history: History
    metrics_available: bool


def prometheus_source(url: str | None, interval_seconds: float) -> PrometheusSource | None:
    """The Prometheus the steps read (None without a URL: they record `MetricsAvailable=False`, never
    guess). A step's queries share one deadline shorter than the interval
    (PROMETHEUS_DEADLINE_SECONDS at most), so a hung Prometheus never makes steps pile up."""
    deadline = min(PROMETHEUS_DEADLINE_SECONDS, 0.8 * interval_seconds)
    return PrometheusSource(url, deadline) if url else None


def autoscaled_spec(body: dict[str, Any] | None, server_image: str) -> InferenceServiceSpec | None:
    """The spec of a live InferenceService, None when it is gone, being deleted or invalid (reconcile
    reports that)."""
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    try:
        return parse_spec(body.get("spec") or {}, server_image)
    except ValidationError:
        return None


def builtin(spec: InferenceServiceSpec) -> bool:
    """Whether the builtin autoscaler scales `spec`'s replicas."""
    return spec.autoscaling is not None and spec.autoscaling.engine == "builtin"


def keda_pending(cluster: ClusterAPI, namespace: str, name: str, spec: InferenceServiceSpec) -> bool:
    """Whether KEDA scales `spec` and its API is served, but the ScaledObject is missing: KEDA was
    installed after the last reconcile, and nothing else would trigger one."""
    auto = spec.autoscaling
    keda = auto is not None and auto.engine == "keda" and cluster.has_api(*SCALED_OBJECT)
    return keda and cluster.get(*SCALED_OBJECT, namespace, name) is None


def observe(
    cluster: ClusterAPI,
    source: PrometheusSource | None,
    namespace: str,
    name: str,
    spec: InferenceServiceSpec,
) -> tuple[Reading, int]:
    """(the reading of the Ready pods' metrics, and of the router's with `spec.router`; how many
    server pods are Ready)."""
    assert spec.autoscaling is not None
    ready_pods, live_pods = cluster.pods(namespace, name)
    router_pods = None
    if spec.router_enabled:
        # Requests the router holds are the only demand a service scaled to zero shows.
        ready_routers, live_routers = cluster.pods(namespace, name, router_selector_string(name))
        router_pods = ready_routers or live_routers
    if source is None:
        reading = Reading(
            Observation(None, None), {"prometheus": "the operator runs without --prometheus-url"}
        )
    else:
        window = spec.autoscaling.ttft_window_seconds
        reading = source.observe(namespace, ready_pods or live_pods, window, router_pods)
    return reading, len(ready_pods)


def step(
    cluster: ClusterAPI,
    namespace: str,
    name: str,
    reading: Reading,
    ready: int,
    *,
    history: History | None,
    was_available: bool | None,
    server_image: str,
    now_seconds: float,
    logger: logging.Logger | logging.LoggerAdapter,
) -> Step | None:
    """Decide on `reading` with the spec, replicas and status as they are now, and write replicas
    (mode Active). `history` is the one this process kept (None: read back from status, as after a
    restart); `was_available` whether the metrics were at its last step (None: none yet), so the log
    tells an outage once. None when there is nothing to decide: the resource is gone, its autoscaling
    changed while Prometheus answered, or its Deployment is not created yet."""
    body = cluster.get_inference_service(namespace, name)
    spec = autoscaled_spec(body, server_image)
    if body is None or spec is None or spec.autoscaling is None or not builtin(spec):
        return None
    auto = spec.autoscaling
    deployment = cluster.get("apps/v1", "Deployment", namespace, name)
    if deployment is None:
        return None  # reconcile creates it first
    current = int(deployment.get("spec", {}).get("replicas", 1))
    previous = body.get("status") or {}
    history = history or history_from_status(previous)
    decision, new_history = decide(auto, current, ready, reading.observation, history, now_seconds)
    acted = auto.mode == "Active"
    if not acted:
        new_history = History(new_history.recommendations, history.scale_events)
    changed = decision.replicas != current
    if changed and acted:
        cluster.scale_deployment(namespace, name, decision.replicas)
        logger.info("scaled %s/%s: %s", namespace, name, decision.message)

    patch = autoscaler_status(
        previous=previous,
        decision=decision,
        reading=reading,
        history=new_history,
        current=current,
        ready=ready,
        acted=acted,
        generation=body["metadata"].get("generation"),
        now=rfc3339(now_seconds),
    )
    events = []
    before = (previous.get("autoscaler") or {}).get("decisions") or []
    recorded = patch["autoscaler"]["decisions"] != before
    if changed and (acted or recorded):
        reason = decision.reason if acted else f"Advisory{decision.reason}"
        events.append(Event("Normal", reason, decision.message))
    events += transitions(previous.get("conditions") or [], patch["conditions"], (METRICS_AVAILABLE,))
    metrics = next(c for c in patch["conditions"] if c["type"] == METRICS_AVAILABLE)
    available = metrics["status"] == "True"
    # The Event tells an outage once, when the condition turns False; the log once per operator
    # process (a restarted operator logs an outage still going on).
    if not available and was_available is not False:
        logger.warning("%s/%s: metrics unavailable: %s", namespace, name, metrics["message"])
    elif available and was_available is False:
        logger.info("%s/%s: metrics available again: %s", namespace, name, metrics["message"])
    return Step(body, decision, patch, events, new_history, available)
