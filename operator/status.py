"""An InferenceService's `.status` from its plan and its Deployment's status (pure functions).

Conditions follow metav1.Condition: `lastTransitionTime` moves only when a condition's status changes,
so re-running a reconcile with nothing new produces an identical status and no write.
"""

from __future__ import annotations

from typing import Any

from conveyor.operator.catalog import GiB
from conveyor.operator.plan import SpecPlan
from conveyor.operator.render import selector_string, service_url
from conveyor.operator.spec import InferenceServiceSpec

CAPACITY_PLANNED = "CapacityPlanned"
READY = "Ready"
SCALING = "Scaling"


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


def capacity_status(plan: SpecPlan) -> dict[str, Any]:
    """`status.capacity`: the plan's numbers (bytes, sequences)."""
    cap = plan.capacity
    return {
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
    message = (
        f"max_num_seqs {cap.max_num_seqs}: KV pool {cap.kv_pool_bytes / GiB:.2f} GiB "
        f"({plan.num_gpus} x {plan.gpu_memory_bytes / GiB:.2f} GiB x {plan.gpu_memory_utilization} "
        f"- {plan.weight_bytes / GiB:.2f} GiB weights - {plan.activation_reserve_bytes / GiB:.2f} GiB "
        f"reserve) / ({per_replica} bytes/token x {cap.max_model_len} tokens)"
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


def workload_conditions(
    spec: InferenceServiceSpec,
    deployment: dict[str, Any] | None,
    *,
    generation: int | None,
    now: str,
    previous: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The Ready and Scaling conditions from the Deployment's status."""
    desired, current, ready, updated, observed = _replica_counts(deployment)
    if deployment is None:
        ready_cond = (False, "DeploymentMissing", "the server Deployment does not exist yet")
    elif desired == 0:
        ready_cond = (False, "ScaledToZero", "replicas is 0")
    elif not observed:
        ready_cond = (False, "RolloutPending", "the Deployment controller has not seen the new spec yet")
    elif ready >= desired and updated >= desired and current == desired:
        ready_cond = (True, "ReplicasReady", f"{ready}/{desired} replicas ready")
    else:
        ready_cond = (False, "ReplicasNotReady", f"{ready}/{desired} replicas ready, {updated} updated")

    bounds = ""
    if spec.autoscaling is not None:
        bounds = f" (autoscaling between {spec.autoscaling.min_replicas} and {spec.autoscaling.max_replicas})"
    if deployment is not None and current < desired:
        scaling_cond = (True, "ScalingUp", f"{current} -> {desired} replicas{bounds}")
    elif deployment is not None and current > desired:
        scaling_cond = (True, "ScalingDown", f"{current} -> {desired} replicas{bounds}")
    elif deployment is not None and (updated < desired or not observed):
        scaling_cond = (True, "RollingOut", f"{updated}/{desired} replicas updated{bounds}")
    else:
        scaling_cond = (False, "Stable", f"{desired} replicas{bounds}")

    return [
        make_condition(READY, *ready_cond, generation=generation, now=now, previous=previous),
        make_condition(SCALING, *scaling_cond, generation=generation, now=now, previous=previous),
    ]


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
) -> dict[str, Any]:
    """The full `.status` object.

    Either `plan` is set (capacity planned) or `failure` is `(reason, message)` for a spec that cannot
    be planned; `deployment` is the live Deployment object or None. `previous` is the current status.
    """
    conditions_before = previous.get("conditions") or []
    if plan is not None:
        planned = make_condition(
            CAPACITY_PLANNED,
            True,
            "Planned",
            capacity_message(plan),
            generation=generation,
            now=now,
            previous=conditions_before,
        )
    else:
        reason, message = failure or ("Unknown", "")
        planned = make_condition(
            CAPACITY_PLANNED,
            False,
            reason,
            message,
            generation=generation,
            now=now,
            previous=conditions_before,
        )
    if spec is not None:
        workload = workload_conditions(
            spec, deployment, generation=generation, now=now, previous=conditions_before
        )
    else:
        workload = [
            make_condition(
                t, False, "InvalidSpec", "", generation=generation, now=now, previous=conditions_before
            )
            for t in (READY, SCALING)
        ]
    if plan is None and deployment is None:
        # Nothing runs, so Ready says why: the capacity plan failed.
        workload[0] = make_condition(
            READY,
            False,
            "CapacityNotPlanned",
            "no Deployment is created until the capacity plan succeeds",
            generation=generation,
            now=now,
            previous=conditions_before,
        )
    _, current, ready, _, _ = _replica_counts(deployment)
    return {
        "observedGeneration": generation,
        "conditions": [planned, *workload],
        "capacity": capacity_status(plan) if plan is not None else None,
        "replicas": current,
        "readyReplicas": ready,
        "url": service_url(name, namespace) if deployment is not None else None,
        "selector": selector_string(name),
    }
