"""An InferenceService's `.status` from its plan and its Deployment's status (pure functions).

Conditions follow metav1.Condition: `lastTransitionTime` moves only when a condition's status changes,
so re-running a reconcile with nothing new produces an identical status and no write. Reconcile's
conditions are decided together, as one set (`build_status`); Ready is KServe's living condition over
what it depends on. The builtin autoscaler writes Scaling and MetricsAvailable (`autoscaler_status`),
each in place by type.
"""

from __future__ import annotations

import datetime
from typing import Any, NamedTuple

from conveyor.operator.autoscaler import Decision, History, Recommendation, ScaleEvent
from conveyor.operator.catalog import GiB
from conveyor.operator.metrics import Reading
from conveyor.operator.plan import SpecPlan
from conveyor.operator.render import router_name, selector_string, service_url
from conveyor.operator.spec import InferenceServiceSpec

CAPACITY_PLANNED = "CapacityPlanned"
READY = "Ready"
SCALING = "Scaling"
METRICS_AVAILABLE = "MetricsAvailable"
ADAPTERS_READY = "AdaptersReady"  # model.lora's (adapters.py)
ADAPTER_LOAD_FAILED = "AdapterLoadFailed"

# Ready=False reasons for children the API server refuses, by HTTP status (409: the name is taken by
# an object another controller owns, e.g. the server Deployment of an InferenceService `x-router` and
# the router Deployment of `x`), and for any other refusal.
APPLY_FAILURE_REASONS = {403: "ApplyForbidden", 409: "NameConflict"}
APPLY_FAILURE_REASON = "ApplyFailed"
# The reason of a condition whose step a missing permission stopped (a 403 outside an apply).
FORBIDDEN = "Forbidden"
KEDA_NOT_INSTALLED = "KEDANotInstalled"
PODS_UNSCHEDULABLE = "PodsUnschedulable"


class Verdict(NamedTuple):
    """A condition's status, reason and message, before `make_condition` dates it."""

    status: bool
    reason: str
    message: str


def rfc3339(unix_seconds: float) -> str:
    """A status timestamp: RFC 3339 in UTC, to the second."""
    return datetime.datetime.fromtimestamp(unix_seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_condition(
    type_: str,
    status: bool,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: str,
    previous: list[dict[str, Any]],
) -> dict[str, Any]:
    """A condition dict; keeps the previous `lastTransitionTime` when the status did not change."""
    value = "True" if status else "False"
    old = next((c for c in previous if c.get("type") == type_), None)
    since = (
        old["lastTransitionTime"]
        if old and old.get("status") == value and "lastTransitionTime" in old
        else now
    )
    condition: dict[str, Any] = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition


def with_conditions(conditions: list[dict[str, Any]], *updates: dict[str, Any]) -> list[dict[str, Any]]:
    """`conditions` with each of `updates` in place of the condition of its type (appended when there
    is none); the others as they were, in their order."""
    owned = {c["type"]: c for c in updates}
    return [owned.pop(c["type"], c) for c in conditions] + list(owned.values())


def capacity_status(plan: SpecPlan) -> dict[str, Any]:
    """`status.capacity`: the plan's numbers (bytes, sequences, ranks)."""
    cap = plan.capacity
    return {
        "tensorParallelSize": plan.tensor_parallel_size,
        "kvBytesPerToken": cap.kv_bytes_per_token,
        "kvPoolBytes": cap.kv_pool_bytes,
        "numKvBlocks": cap.num_kv_blocks,
        "maxNumSeqs": plan.max_num_seqs,
        "maxConcurrencyAtMaxModelLen": round(cap.max_concurrency, 2),
    }


def capacity_message(plan: SpecPlan) -> str:
    """The arithmetic behind `max_num_seqs`, for the CapacityPlanned condition and the event."""
    cap = plan.capacity
    per_replica = cap.kv_bytes_per_token * plan.tensor_parallel_size
    window = (
        f", sliding layers counting their {cap.sliding_window}-token window" if cap.sliding_window else ""
    )
    message = (
        f"max_num_seqs {cap.max_num_seqs}: KV pool {cap.kv_pool_bytes / GiB:.2f} GiB "
        f"({plan.num_gpus} x {plan.gpu_memory_bytes / GiB:.2f} GiB x {plan.gpu_memory_utilization} "
        f"- {plan.weight_bytes / GiB:.2f} GiB weights - {plan.activation_reserve_bytes / GiB:.2f} GiB "
        f"reserve) / ({per_replica} bytes/token x {cap.max_model_len} tokens{window})"
    )
    if plan.max_num_seqs != cap.max_num_seqs:
        message += f"; engine.maxNumSeqs overrides it with {plan.max_num_seqs}"
    return message


def _replica_counts(deployment: dict[str, Any] | None) -> tuple[int, int, int, int, bool]:
    """(desired, current, ready, updated, observed) replicas of a Deployment object."""
    if deployment is None:
        return 0, 0, 0, 0, True
    desired = deployment.get("spec", {}).get("replicas", 1)
    status = deployment.get("status") or {}
    generation = deployment.get("metadata", {}).get("generation")
    observed = generation is None or status.get("observedGeneration", 0) >= generation
    return (
        desired,
        status.get("replicas", 0),
        status.get("readyReplicas", 0),
        status.get("updatedReplicas", 0),
        observed,
    )


def living(*dependents: Verdict) -> Verdict:
    """KServe's living condition set (knative.dev/pkg/apis/condition_set.go): the happy condition is
    True when every dependent is, with the last dependent's reason and message; otherwise it is False
    with the reason and message of the first dependent that is not."""
    return next((d for d in dependents if not d.status), dependents[-1])


def available(
    spec: InferenceServiceSpec | None,
    deployment: dict[str, Any] | None,
    unschedulable: tuple[int, str] | None = None,
    router: dict[str, Any] | None = None,
) -> Verdict:
    """Whether the replicas answer, from the Deployment's status; `unschedulable` is (pods, the
    scheduler's message) for pods that cannot be placed, which it then names. With the router enabled,
    `router` is its Deployment (None: not created yet), which must be rolled out too (requests reach
    the replicas through it)."""
    desired, current, ready, updated, observed = _replica_counts(deployment)
    if deployment is None:
        verdict = Verdict(False, "DeploymentMissing", "the server Deployment does not exist yet")
    elif desired == 0:
        verdict = Verdict(False, "ScaledToZero", "replicas is 0")
    elif not observed:
        verdict = Verdict(False, "RolloutPending", "the Deployment controller has not seen the new spec yet")
    elif ready >= desired and updated >= desired and (current == desired or updated == current):
        # updated == current > desired: a scale-down whose extra pods are still counted, no old pods
        verdict = Verdict(True, "ReplicasReady", f"{ready}/{desired} replicas ready")
    elif unschedulable is not None:
        count, why = unschedulable
        verdict = Verdict(
            False,
            PODS_UNSCHEDULABLE,
            f"{ready}/{desired} replicas ready; {count} pod(s) cannot be scheduled: {why}",
        )
    else:
        verdict = Verdict(False, "ReplicasNotReady", f"{ready}/{desired} replicas ready, {updated} updated")
    if verdict.status and spec is not None and spec.router_enabled:
        r_desired, r_current, r_ready, r_updated, r_observed = _replica_counts(router)
        if router is None or not (
            r_observed and r_ready >= r_desired and r_updated >= r_desired and r_current == r_desired
        ):
            verdict = Verdict(
                False,
                "RouterNotReady",
                f"{ready}/{desired} replicas ready; router {r_ready}/{r_desired} ready, {r_updated} updated",
            )
    return verdict


def rollout(spec: InferenceServiceSpec, deployment: dict[str, Any] | None) -> Verdict:
    """The Scaling condition from the Deployment alone: scaling up or down, rolling out, or stable."""
    desired, current, _, updated, observed = _replica_counts(deployment)
    bounds = ""
    if spec.autoscaling is not None:
        bounds = f" (autoscaling between {spec.autoscaling.min_replicas} and {spec.autoscaling.max_replicas})"
    if deployment is not None and current < desired:
        return Verdict(True, "ScalingUp", f"{current} -> {desired} replicas{bounds}")
    if deployment is not None and current > desired:
        return Verdict(True, "ScalingDown", f"{current} -> {desired} replicas{bounds}")
    if deployment is not None and (updated < desired or not observed):
        return Verdict(True, "RollingOut", f"{updated}/{desired} replicas updated{bounds}")
    return Verdict(False, "Stable", f"{desired} replicas{bounds}")


def build_status(
    *,
    name: str,
    namespace: str,
    generation: int | None,
    spec: InferenceServiceSpec | None,
    plan: SpecPlan | None,
    failure: tuple[str, str] | None,
    deployment: dict[str, Any] | None,
    previous: dict[str, Any],
    now: str,
    scaling_problem: tuple[str, str] | None = None,
    apply_failure: tuple[str, str] | None = None,
    unschedulable: tuple[int, str] | None = None,
    router: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The full `.status` object.

    Either `plan` is set (capacity planned) or `failure` is `(reason, message)` for a spec that cannot
    be planned; `deployment` is the live Deployment object or None. `previous` is the current status.
    `unschedulable` is (pods, the scheduler's message) when pods cannot be placed. `router` is the
    live router Deployment when `spec.router` is enabled (None: not created yet). `scaling_problem`
    is `(reason, message)` when the configured autoscaler cannot run (its API is missing);
    `apply_failure` is `(reason, message)` when the API server refused a child.

    The conditions are decided together, each once, in this order:

    CapacityPlanned   the plan, or `failure`.
    Ready             living(Applied, Planned, Available): the children were applied (else
                      `apply_failure`), a plan runs (the new one, or the earlier one whose Deployment
                      still serves an unplannable edit), and `available` says the replicas answer.
    Scaling           the builtin autoscaler's, as it wrote it, once it has decided; else
                      `scaling_problem`; else the Deployment's rollout.
    MetricsAvailable  the builtin autoscaler's, as it wrote it (absent under any other engine).
    AdaptersReady     the adapters' timer's, as it wrote it (absent without model.lora).
    """
    before = previous.get("conditions") or []

    def stamped(type_: str, verdict: Verdict) -> dict[str, Any]:
        return make_condition(type_, *verdict, generation=generation, now=now, previous=before)

    invalid = Verdict(False, "InvalidSpec", "the spec cannot be used: see CapacityPlanned")
    planned = (
        Verdict(True, "Planned", capacity_message(plan))
        if plan is not None
        else Verdict(False, *(failure or ("Unknown", "")))
    )
    applied = Verdict(False, *apply_failure) if apply_failure is not None else Verdict(True, "Applied", "")
    if plan is None and deployment is None:
        runs_a_plan = Verdict(
            False, "CapacityNotPlanned", "no Deployment is created until the capacity plan succeeds"
        )
    else:
        runs_a_plan = invalid if spec is None else Verdict(True, "Planned", "")
    ready_condition = living(applied, runs_a_plan, available(spec, deployment, unschedulable, router))

    builtin = spec is not None and spec.autoscaling is not None and spec.autoscaling.engine == "builtin"
    decided = builtin and bool(previous.get("autoscaler"))
    kept_scaling = next((c for c in before if c.get("type") == SCALING), None) if decided else None
    if kept_scaling is not None:
        scaling = kept_scaling
    elif scaling_problem is not None:
        scaling = stamped(SCALING, Verdict(False, *scaling_problem))
    else:
        scaling = stamped(SCALING, invalid if spec is None else rollout(spec, deployment))
    metrics = [c for c in before if c.get("type") == METRICS_AVAILABLE] if builtin else []
    # model.lora's, as the adapters' timer wrote them (adapters.py); cleared once it is gone.
    lora = spec is not None and spec.model.lora is not None
    adapters = [c for c in before if c.get("type") == ADAPTERS_READY] if lora else []

    desired, current, ready, _, _ = _replica_counts(deployment)
    if builtin:
        desired = previous.get("desiredReplicas", desired)
    return {
        "observedGeneration": generation,
        "conditions": [
            stamped(CAPACITY_PLANNED, planned),
            stamped(READY, ready_condition),
            scaling,
            *metrics,
            *adapters,
        ],
        "desiredReplicas": desired if deployment is not None else None,
        # The autoscaler's own fields; cleared once the builtin autoscaler no longer runs.
        "lastScaleTime": previous.get("lastScaleTime") if builtin else None,
        "autoscaler": previous.get("autoscaler") if builtin else None,
        # An unplannable edit leaves the running Deployment as it was: keep the plan it runs with.
        "capacity": (
            capacity_status(plan)
            if plan is not None
            else (previous.get("capacity") if deployment is not None else None)
        ),
        "replicas": current,
        "readyReplicas": ready,
        "url": _url(name, namespace, spec, ready, router) if apply_failure is None else None,
        "selector": selector_string(name),
        "loraAdapters": previous.get("loraAdapters") if lora else None,
    }


def _url(
    name: str, namespace: str, spec: InferenceServiceSpec | None, ready: int, router: dict[str, Any] | None
) -> str | None:
    """`status.url`, only where a request can be answered: the server Service with a Ready replica;
    with the router enabled the router Service once a router pod is Ready, and a server replica is
    Ready or the builtin autoscaler (Active) wakes one for the requests the router holds."""
    if spec is None or not spec.router_enabled:
        return service_url(name, namespace) if ready > 0 else None
    auto = spec.autoscaling
    wakes = auto is not None and auto.engine == "builtin" and auto.mode == "Active"
    router_ready = ((router or {}).get("status") or {}).get("readyReplicas", 0)
    return service_url(router_name(name), namespace) if router_ready > 0 and (ready > 0 or wakes) else None


# Decisions kept in `status.autoscaler.decisions`.
DECISIONS_KEPT = 5


def history_from_status(status: dict[str, Any]) -> History:
    """The autoscaler's history as stored in `status.autoscaler` (empty when there is none)."""
    stored = status.get("autoscaler") or {}
    return History(
        recommendations=tuple(
            Recommendation(float(r["at"]), int(r["replicas"])) for r in stored.get("recommendations") or []
        ),
        scale_events=tuple(
            ScaleEvent(float(e["at"]), int(e["change"])) for e in stored.get("scaleEvents") or []
        ),
    )


# The status field of each signal, by the query's name (metrics.py), so that an error is named as the
# value it stands in for; other errors (pods, prometheus) keep their names.
SIGNAL_FIELDS = {
    "ttft_p90": "ttftP90Seconds",
    "request_rate": "requestRate",
    "queue": "queueDepth",
    "running": "runningRequests",
    "kv_usage": "kvCacheUsage",
    "router_waiting": "routerRequestsWaiting",
}


def status_errors(reading: Reading) -> dict[str, str]:
    """The reading's errors keyed by the status field of the signal each concerns."""
    return {SIGNAL_FIELDS.get(k, k): v for k, v in reading.errors.items()}


def _metrics_status(
    reading: Reading, ready: int, now: str, *, usable: bool, previous: dict[str, Any]
) -> dict[str, Any]:
    """`status.autoscaler.metrics` as a merge patch, current or absent field by field: a signal this
    step could not read is None (the patch deletes the value an earlier step wrote, so no number
    outlives its reading), `errors` is None once every signal was read, and `lastSuccessfulReadTime`
    is `now` when the reading was usable (MetricsAvailable=True), else what `previous` (the stored
    metrics) says: how old the last good reading is."""
    o = reading.observation
    values = {
        "ttftP90Seconds": o.ttft_p90_seconds,
        "requestRate": o.request_rate,
        "queueDepth": o.queue_depth,
        "runningRequests": o.running_requests,
        "kvCacheUsage": o.kv_cache_usage,
        "routerRequestsWaiting": o.router_waiting,
    }
    return {
        "time": now,
        "readyPods": ready,
        **{k: None if v is None else round(v, 4) for k, v in values.items()},
        # A merge patch merges maps key by key: None clears an earlier step's error for a signal
        # that now reads (None for the whole map removes it once every signal reads).
        "errors": {**dict.fromkeys(previous.get("errors") or {}), **status_errors(reading)}
        if reading.errors
        else None,
        "lastSuccessfulReadTime": now if usable else previous.get("lastSuccessfulReadTime"),
    }


def autoscaler_status(
    *,
    previous: dict[str, Any],
    decision: Decision,
    reading: Reading,
    history: History,
    current: int,
    ready: int,
    acted: bool,
    generation: int | None,
    now: str,
) -> dict[str, Any]:
    """The status fields one autoscaling step writes (a merge patch over `previous`).

    `acted` is False under `mode: Advisory` (the decision is recorded, not applied). Conditions not
    owned by the autoscaler are carried over unchanged.
    """
    stored = previous.get("autoscaler") or {}
    decisions = list(stored.get("decisions") or [])
    changed = decision.replicas != current
    last = decisions[-1] if decisions else None
    if (
        changed
        or last is None
        or (last.get("reason"), last.get("to")) != (decision.reason, decision.replicas)
    ):
        decisions.append(
            {
                "time": now,
                "from": current,
                "to": decision.replicas,
                "reason": decision.reason,
                "message": decision.message,
            }
        )
    conditions_before = previous.get("conditions") or []
    converging = changed or ready != current
    prefix = "" if acted else "Advisory (replicas not written): "
    scaling = make_condition(
        SCALING,
        converging,
        decision.reason,
        prefix + decision.message,
        generation=generation,
        now=now,
        previous=conditions_before,
    )
    details = "; ".join(f"{k}: {v}" for k, v in sorted(status_errors(reading).items()))
    if decision.metrics_available and not reading.errors:
        read = Verdict(True, "PrometheusQueried", "every targeted signal was read")
    elif decision.metrics_available:
        read = Verdict(True, "PartialMetrics", details)
    else:
        read = Verdict(False, "MetricsUnavailable", f"holding {current} replicas: {details or 'no data'}")
    metrics_condition = make_condition(
        METRICS_AVAILABLE, *read, generation=generation, now=now, previous=conditions_before
    )
    # Only the autoscaler's two conditions change; reconcile's stay as it wrote them.
    conditions = with_conditions(conditions_before, scaling, metrics_condition)
    patch: dict[str, Any] = {
        "conditions": conditions,
        "desiredReplicas": decision.replicas,
        "autoscaler": {
            "metrics": _metrics_status(
                reading,
                ready,
                now,
                usable=decision.metrics_available,
                previous=stored.get("metrics") or {},
            ),
            "decisions": decisions[-DECISIONS_KEPT:],
            "recommendations": [
                {"at": r.at_seconds, "replicas": r.replicas} for r in history.recommendations
            ],
            "scaleEvents": [{"at": e.at_seconds, "change": e.change} for e in history.scale_events],
        },
    }
    if changed and acted:
        patch["lastScaleTime"] = now
    return patch
