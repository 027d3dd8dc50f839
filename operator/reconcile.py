"""One InferenceService reconciled, with no kopf: its spec parsed and planned (`parse`), its children
rendered and applied through the cluster seam (`children.py`), and its status and Events returned as a
value (`reconcile`). handlers.py reads the resource, calls these and writes what they return.

A reconcile is safe to run any number of times: the children are server-side applied (a no-op when
nothing changed, and a forced apply undoes manual edits), the status is returned only when it changed,
and Events only for writes and for conditions that changed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from conveyor.operator.children import Children
from conveyor.operator.cluster import INFERENCE_POOL, SCALED_OBJECT, SERVICE_MONITOR, ApplyError, ClusterAPI
from conveyor.operator.events import Event, transitions
from conveyor.operator.memo import OperatorSettings
from conveyor.operator.plan import PlanningError, SpecPlan, check_architecture, plan_for_spec
from conveyor.operator.render import Owner, render_all, router_name, server_args
from conveyor.operator.spec import (
    DNS1035_LABEL,
    NAME_RULE_MESSAGE,
    InferenceServiceSpec,
    parse_spec,
    validation_message,
)
from conveyor.operator.status import (
    APPLY_FAILURE_REASON,
    APPLY_FAILURE_REASONS,
    CAPACITY_PLANNED,
    FORBIDDEN,
    KEDA_NOT_INSTALLED,
    READY,
    SCALING,
    build_status,
    make_condition,
    with_conditions,
)
from conveyor.server.cli import ServeArgsError, parse_serve_argv

# Condition reasons for specs that cannot be planned, by exception class name.
FAILURE_REASONS = {
    "InsufficientGPUMemoryError": "InsufficientGPUMemory",
    "KVCacheTooSmallError": "InsufficientGPUMemory",
    "UnknownModelError": "UnknownModel",
    "UnknownGPUTypeError": "UnknownGPUType",
    "MaxModelLenTooLongError": "MaxModelLenTooLong",
    "TensorParallelSizeError": "InvalidTensorParallelSize",
    "UnsupportedArchitectureError": "UnsupportedArchitecture",
}


@dataclass(frozen=True)
class Resource:
    """An InferenceService as read: its `owner` identity, `generation` and stored `status`, its `spec`
    (None: invalid) and capacity `plan` (None: `failure`, the CapacityPlanned reason and message)."""

    owner: Owner
    generation: int | None
    status: dict[str, Any]
    spec: InferenceServiceSpec | None
    plan: SpecPlan | None
    failure: tuple[str, str] | None


@dataclass(frozen=True)
class Reconciled:
    """What a reconcile decided, for the handler to write: the `status` (None: the stored one says it
    already) and the `events` to post, in order. `failure` is the message of a child the API server
    refused (status and an Event say so; kopf retries). `error` is the API error that stopped the
    reconcile part-way: `events` are those of the writes made before it, and the handler raises it
    once they are posted."""

    status: dict[str, Any] | None
    events: list[Event] = field(default_factory=list)
    failure: str | None = None
    error: ApiException | None = None


def parse(body: dict[str, Any], server_image: str) -> Resource:
    """Validate and plan an InferenceService (`server_image` where its spec sets none); a spec that
    cannot be used is a `failure`, never an exception."""
    meta = body["metadata"]
    owner = Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    spec: InferenceServiceSpec | None = None
    plan: SpecPlan | None = None
    failure: tuple[str, str] | None = None
    try:
        if not re.match(DNS1035_LABEL, owner.name):  # created before the CRD said so
            failure = ("InvalidName", NAME_RULE_MESSAGE)
        else:
            spec = parse_spec(body.get("spec") or {}, server_image)
            planned = plan_for_spec(spec)
            args = server_args(spec, planned)  # what the pods would start with, checked as the server will
            check_architecture(spec, parse_serve_argv(args[1:]).engine.model.model_impl)
            plan = planned
    except ValidationError as exc:
        failure = ("InvalidSpec", validation_message(exc))
    except PlanningError as exc:
        failure = (FAILURE_REASONS.get(type(exc).__name__, "PlanningFailed"), str(exc))
    except ServeArgsError as exc:
        failure = ("ServerArgsRejected", f"conveyor serve would refuse the arguments it gets: {exc}")
    return Resource(owner, meta.get("generation"), body.get("status") or {}, spec, plan, failure)


def reconcile(resource: Resource, cluster: ClusterAPI, settings: OperatorSettings, now: str) -> Reconciled:
    """Bring `resource`'s children in line with its spec through `cluster`, and return its status as
    of `now` (RFC 3339) with the Events to post: CapacityPlanned's and Scaling's changes, each child
    written, then Ready's changes."""
    children = Children(cluster, resource.owner)
    try:
        status, apply_failure = _converge(resource, cluster, settings, now, children)
    except ApiException as exc:
        return Reconciled(None, children.events, error=exc)
    before = resource.status.get("conditions") or []
    events = [
        *transitions(before, status["conditions"], (CAPACITY_PLANNED, SCALING)),
        *children.events,
        *transitions(before, status["conditions"], (READY,)),
    ]
    unchanged = _without_none(status) == _without_none({k: resource.status.get(k) for k in status})
    return Reconciled(None if unchanged else status, events, apply_failure[1] if apply_failure else None)


def forbidden(body: dict[str, Any], condition_type: str, message: str, now: str) -> Reconciled:
    """A call the API server refused for want of a permission (RBAC changed under the running
    operator): `condition_type` (Ready for reconcile, Scaling for the autoscaler) turns False with
    reason Forbidden and the server's `message`, which names the verb and the resource, with one
    Warning Event; nothing once the condition says so."""
    before = (body.get("status") or {}).get("conditions") or []
    condition = make_condition(
        condition_type,
        False,
        FORBIDDEN,
        message,
        generation=body["metadata"].get("generation"),
        now=now,
        previous=before,
    )
    events = transitions(before, [condition])
    return Reconciled({"conditions": with_conditions(before, condition)} if events else None, events)


def desired_replicas(spec: InferenceServiceSpec, deployment: dict[str, Any] | None) -> int | None:
    """Replicas to apply: the spec's; under the builtin autoscaler the Deployment's current count
    kept within [minReplicas, maxReplicas] (the autoscaler writes it; reconciling must not undo
    that); None (left out) when an HPA or KEDA owns the field."""
    if spec.autoscaling is not None and spec.autoscaling.engine != "builtin":
        return None
    if spec.autoscaling is None or deployment is None:
        return spec.desired_replicas
    current = deployment.get("spec", {}).get("replicas", spec.desired_replicas)
    return min(max(current, spec.autoscaling.min_replicas), spec.autoscaling.max_replicas)


def _converge(
    resource: Resource, cluster: ClusterAPI, settings: OperatorSettings, now: str, children: Children
) -> tuple[dict[str, Any], tuple[str, str] | None]:
    """Apply the children a plannable spec renders; (the status, the apply failure if any)."""
    owner, spec, plan, failure = resource.owner, resource.spec, resource.plan, resource.failure
    deployment = cluster.get("apps/v1", "Deployment", owner.namespace, owner.name)
    if plan is not None:
        failure = _replica_exceeds_node(cluster, plan)
        plan = plan if failure is None else None
    scaling_problem: tuple[str, str] | None = None
    apply_failure: tuple[str, str] | None = None
    router: dict[str, Any] | None = None
    if plan is not None:
        assert spec is not None
        replicas = desired_replicas(spec, deployment)
        engine = spec.autoscaling.engine if spec.autoscaling is not None else None
        has_keda = engine == "keda" and cluster.has_api(*SCALED_OBJECT)
        if engine == "keda" and not has_keda:
            scaling_problem = (
                KEDA_NOT_INSTALLED,
                "autoscaling.engine is keda but the keda.sh/v1alpha1 ScaledObject API is not served; "
                "replicas stay as they are until KEDA is installed",
            )
        for attempt in range(2):
            objects = render_all(
                owner,
                spec,
                plan,
                replicas,
                service_monitor=cluster.has_api(*SERVICE_MONITOR),
                scaled_object=has_keda,
                keda=settings.keda,
                service_monitor_labels=settings.service_monitor_labels,
                inference_pool=spec.router_enabled and cluster.has_api(*INFERENCE_POOL),
                network_policy_from=settings.network_policy_from,
            )
            try:
                children.prune(objects, router_enabled=spec.router_enabled)
                stored = children.apply(objects)
            except ApplyError as exc:
                if exc.status == 404 and attempt == 0:
                    cluster.refresh_discovery()  # an optional CRD (ServiceMonitor ...) may be gone
                    has_keda = engine == "keda" and cluster.has_api(*SCALED_OBJECT)
                    continue
                apply_failure = (APPLY_FAILURE_REASONS.get(exc.status, APPLY_FAILURE_REASON), str(exc))
                break
            deployment = stored.get(("Deployment", owner.name)) or deployment
            router = stored.get(("Deployment", router_name(owner.name)))
            break
    if spec is not None and spec.router_enabled and plan is None:
        router = cluster.get("apps/v1", "Deployment", owner.namespace, router_name(owner.name))

    desired = (deployment or {}).get("spec", {}).get("replicas", 0)
    ready = ((deployment or {}).get("status") or {}).get("readyReplicas", 0)
    unschedulable = cluster.unschedulable(owner.namespace, owner.name) if ready < desired else None
    status = build_status(
        name=owner.name,
        namespace=owner.namespace,
        generation=resource.generation,
        spec=spec,
        plan=plan,
        failure=failure,
        deployment=deployment,
        previous=resource.status,
        now=now,
        scaling_problem=scaling_problem,
        apply_failure=apply_failure,
        unschedulable=unschedulable,
        router=router,
    )
    return status, apply_failure


def _replica_exceeds_node(cluster: ClusterAPI, plan: SpecPlan) -> tuple[str, str] | None:
    """A `ReplicaExceedsNode` failure when nodes with the replica's GPU exist and none has as many GPUs as
    one replica needs (its ranks must share a node); None otherwise."""
    largest = cluster.largest_gpu_node(plan.gpu_product_label)
    if largest is None or largest >= plan.num_gpus:
        return None
    which = f"{plan.gpu_type} ({plan.gpu_product_label})" if plan.gpu_product_label else "GPU"
    return (
        "ReplicaExceedsNode",
        f"a replica needs {plan.num_gpus} GPUs on one node (tensor parallel {plan.tensor_parallel_size}) "
        f"but the largest {which} node has {largest} allocatable: lower resources.gpusPerReplica; "
        "replicas spanning nodes are not supported yet",
    )


def _without_none(value: Any) -> Any:
    """`value` without the None fields a merge patch deletes (what the stored status lacks)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value
