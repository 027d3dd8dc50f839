"""kopf handlers: reconcile each InferenceService into its Deployment, Service, PDB, ServiceMonitor and
(`spec.router`) its router's objects.

One `reconcile` does everything and is safe to run any number of times: read the resource, plan its
capacity, render the children (pure), server-side apply them (a no-op when nothing changed, and a
forced apply undoes manual edits), then write `.status` if it changed. It runs when an InferenceService
is created, changed or found at start-up, and whenever one of its children changes (so status follows
the pods and drift is corrected at once).

`autoscale` is the builtin autoscaler's step, run by a kopf timer per autoscaled InferenceService:
read the Ready pods' metrics from Prometheus (`metrics.py`), decide (`autoscaler.py`), write the
Deployment's replicas through its scale subresource, and record the decision (status, Event, the
operator's own metrics). It is the only writer of replicas under `engine: builtin`; reconcile applies
the count it finds, so it never reverts one.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import re
import threading
import time
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from conveyor.operator import metrics
from conveyor.operator.autoscaler import History, Observation, decide
from conveyor.operator.cluster import (
    HPA,
    INFERENCE_POOL,
    NETWORK_POLICY,
    SCALED_OBJECT,
    SERVICE_MONITOR,
    ApplyError,
    Cluster,
    api_message,
    configuration,
    load_api_client,
)
from conveyor.operator.metrics import PROMETHEUS_DEADLINE_SECONDS, PrometheusSource, Reading
from conveyor.operator.plan import PlanningError, SpecPlan, plan_for_spec
from conveyor.operator.render import (
    FIELD_MANAGER,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    KedaSettings,
    Owner,
    render_all,
    router_name,
    router_selector_string,
    server_args,
)
from conveyor.operator.spec import (
    DEFAULT_IMAGE,
    DNS1035_LABEL,
    GROUP,
    NAME_RULE_MESSAGE,
    PLURAL,
    VERSION,
    InferenceServiceSpec,
    parse_spec,
    validation_message,
)
from conveyor.operator.status import (
    METRICS_AVAILABLE,
    READY,
    SCALING,
    autoscaler_status,
    build_status,
    capacity_message,
    history_from_status,
    make_condition,
    with_conditions,
)
from conveyor.server.cli import ServeArgsError

# kopf memo keys of an InferenceService: its autoscaler history, whether its metrics were available
# at this process's last step (for the log).
HISTORY_MEMO_KEY = "autoscaler_history"
METRICS_MEMO_KEY = "metrics_available"

# Condition reasons for specs that cannot be planned, by exception class name.
FAILURE_REASONS = {
    "InsufficientGPUMemoryError": "InsufficientGPUMemory",
    "KVCacheTooSmallError": "InsufficientGPUMemory",
    "UnknownModelError": "UnknownModel",
    "UnknownGPUTypeError": "UnknownGPUType",
    "MaxModelLenTooLongError": "MaxModelLenTooLong",
    "TensorParallelSizeError": "InvalidTensorParallelSize",
}
# Ready=False reasons for children the API server refuses, by HTTP status (409: the name is taken by
# an object another controller owns, e.g. the server Deployment of an InferenceService `x-router` and
# the router Deployment of `x`).
APPLY_FAILURE_REASONS = {403: "ApplyForbidden", 409: "NameConflict"}
APPLY_FAILURE_REASON = "ApplyFailed"
# The reason of a condition whose step a missing permission stopped (a 403 outside an apply).
FORBIDDEN = "Forbidden"
# kopf's retry delay after an apply failure: doubling from 10 s up to 5 minutes.
RETRY_DELAYS = (10, 300)


class ReconcileFailed(Exception):
    """The API server refused a child; `.status` says why (Ready=False, ApplyFailed)."""


_cluster: Cluster | None = None
_prometheus: PrometheusSource | None = None
# Operator settings (configure_scope): the namespaces watched (glob patterns; empty = all) and the
# extra labels of every ServiceMonitor.
_namespaces: list[str] = []
_service_monitor_labels: dict[str, str] = {}
# (configure_children) the server image of resources without one, and the peers a NetworkPolicy admits.
_server_image: str = DEFAULT_IMAGE
_network_policy_from: list[dict[str, Any]] | None = None
_keda = KedaSettings()
# CRDs of optional APIs: installing or removing one changes what every InferenceService renders.
OPTIONAL_CRDS = {
    "servicemonitors.monitoring.coreos.com",
    "scaledobjects.keda.sh",
    "inferencepools.inference.networking.k8s.io",
}
_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _get_cluster() -> Cluster:
    global _cluster
    if _cluster is None:
        _cluster = Cluster(load_api_client())
    return _cluster


def _lock_for(namespace: str, name: str) -> threading.Lock:
    """One lock per InferenceService: handlers for it run in several threads and must not interleave."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def _now() -> str:
    return _rfc3339(time.time())


def _rfc3339(unix_seconds: float) -> str:
    return datetime.datetime.fromtimestamp(unix_seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def _desired_replicas(spec: InferenceServiceSpec, deployment: dict[str, Any] | None) -> int | None:
    """Replicas to apply: the spec's; under the builtin autoscaler the Deployment's current count
    kept within [minReplicas, maxReplicas] (the autoscaler writes it; reconciling must not undo
    that); None (left out) when an HPA or KEDA owns the field."""
    if spec.autoscaling is not None and spec.autoscaling.engine != "builtin":
        return None
    if spec.autoscaling is None or deployment is None:
        return spec.desired_replicas
    current = deployment.get("spec", {}).get("replicas", spec.desired_replicas)
    return min(max(current, spec.autoscaling.min_replicas), spec.autoscaling.max_replicas)


def reconcile(namespace: str, name: str, logger: logging.Logger | logging.LoggerAdapter) -> None:
    """Bring one InferenceService's children and status in line with its spec. Raises
    ReconcileFailed when the API server refused a child (status and an Event already say so)."""
    with _lock_for(namespace, name):
        cluster = _get_cluster()
        try:
            _reconcile(cluster, namespace, name, logger)
        except ApiException as exc:
            if exc.status != 403:
                raise
            message = api_message(exc)
            _report_forbidden(cluster, namespace, name, READY, message, logger)
            raise ReconcileFailed(message) from None


def _report_forbidden(
    cluster: Cluster,
    namespace: str,
    name: str,
    condition_type: str,
    message: str,
    logger: logging.Logger | logging.LoggerAdapter,
) -> None:
    """A call the API server refused for want of a permission (RBAC changed under the running
    operator): `condition_type` (Ready for reconcile, Scaling for the autoscaler) turns False with
    reason Forbidden and the server's message, which names the verb and the resource, and one Warning
    event and log line say so, once per message. Call with the resource's lock held."""
    try:
        body = cluster.get_inference_service(namespace, name)
    except ApiException as exc:
        logger.error(
            "%s; reading %s/%s to report it failed too: %s", message, namespace, name, api_message(exc)
        )
        return
    if body is None:
        return
    conditions = (body.get("status") or {}).get("conditions") or []
    was = next((c for c in conditions if c.get("type") == condition_type), {})
    if (was.get("status"), was.get("reason"), was.get("message")) == ("False", FORBIDDEN, message):
        return
    logger.warning("%s: %s", FORBIDDEN, message)
    kopf.event(body, type="Warning", reason=FORBIDDEN, message=message)
    condition = make_condition(
        condition_type,
        False,
        FORBIDDEN,
        message,
        generation=body["metadata"].get("generation"),
        now=_now(),
        previous=conditions,
    )
    try:
        cluster.patch_status(namespace, name, {"conditions": with_conditions(conditions, condition)})
    except ApiException as exc:
        logger.error("cannot write the Forbidden condition of %s/%s: %s", namespace, name, api_message(exc))


def _apply_children(
    cluster: Cluster, body: dict[str, Any], objects: list[dict[str, Any]], logger: Any
) -> dict[tuple[str, str], dict[str, Any] | None]:
    """Apply the rendered children, all or none: each is first applied as a dry run (validated and
    defaulted by the API server) and nothing is written unless all pass; then only those whose
    configuration would change are applied, and only those get a "created"/"updated" Event (a
    status write by a controller is not an update). Returns each object as stored, by (kind, name).
    Raises ApplyError naming the first object refused, or (409) one whose name an object controlled
    by someone else already has.

    One exception to "none": a new Role is created during the checks. RBAC's escalation check of a
    RoleBinding reads the Role it names, which a dry run of the Role does not store, so the
    RoleBinding's dry run would be refused; a Role alone grants nothing until it is bound."""
    uid = body["metadata"]["uid"]
    found = []
    for obj in objects:
        meta = obj["metadata"]
        live = cluster.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        other = next(
            (
                ref
                for ref in (live or {}).get("metadata", {}).get("ownerReferences") or []
                if ref.get("controller") and ref.get("uid") != uid
            ),
            None,
        )
        if other is not None:
            raise ApplyError(
                obj["kind"],
                meta["name"],
                409,
                f"{meta['namespace']}/{meta['name']} already exists, controlled by {other.get('kind')} "
                f"{other.get('name')}: rename one of them",
            )
        found.append((obj, live))
    checked = []
    for obj, live in found:
        if obj["kind"] == "Role" and live is None:
            stored = cluster.apply(obj)
            _post_applied(body, logger, "created", obj)
            checked.append((obj, stored, stored))
        else:
            checked.append((obj, live, cluster.apply(obj, dry_run=True)))
    stored_objects: dict[tuple[str, str], dict[str, Any] | None] = {}
    for obj, live, would_be in checked:
        stored = live
        meta = obj["metadata"]
        container, foreign_env, foreign_env_from = (
            _foreign_env(obj, would_be) if obj["kind"] == "Deployment" else ("", [], False)
        )
        foreign = foreign_env or foreign_env_from
        if live is None or configuration(live) != configuration(would_be) or foreign:
            stored = cluster.apply(obj)
            note = ""
            if foreign:
                cluster.remove_env(meta["namespace"], meta["name"], container, foreign_env, foreign_env_from)
                stored = cluster.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
                removed = [f"env {', '.join(foreign_env)}"] if foreign_env else []
                removed += ["envFrom"] if foreign_env_from else []
                note = f" (removed {' and '.join(removed)}: not in the spec)"
            # Only a write that changed something is an update (the live object may have moved on
            # between the read and the dry run, e.g. a controller's status write).
            if live is None or foreign or configuration(live) != configuration(stored or {}):
                _post_applied(body, logger, "created" if live is None else "updated", obj, note)
        stored_objects[(obj["kind"], meta["name"])] = stored
    return stored_objects


def _post_applied(
    body: dict[str, Any], logger: Any, action: str, obj: dict[str, Any], note: str = ""
) -> None:
    """The "created"/"updated" Event and log line of one applied child."""
    meta = obj["metadata"]
    message = f"{action} {obj['kind']} {meta['namespace']}/{meta['name']}{note}"
    kopf.event(body, type="Normal", reason=action.capitalize(), message=message)
    logger.info(message)


def _foreign_env(rendered: dict[str, Any], would_be: dict[str, Any]) -> tuple[str, list[str], bool]:
    """(container, its environment variables, whether an envFrom list) that someone else added to
    the rendered Deployment's container (the server's or the router's) with `kubectl set env` or a
    patch: server-side apply keeps them, so drift correction removes them explicitly. An envFrom
    the spec renders is ours and replaced whole by the apply."""
    name = rendered["spec"]["template"]["spec"]["containers"][0]["name"]

    def container(obj: dict[str, Any]) -> dict[str, Any]:
        containers = obj["spec"]["template"]["spec"].get("containers") or []
        return next((c for c in containers if c["name"] == name), {})

    ours, theirs = container(rendered), container(would_be)
    names = {e["name"] for e in ours.get("env") or []}
    env = [e["name"] for e in theirs.get("env") or [] if e["name"] not in names]
    return name, env, bool(theirs.get("envFrom")) and not ours.get("envFrom")


def _replica_exceeds_node(cluster: Cluster, plan: SpecPlan) -> tuple[str, str] | None:
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


def _reconcile(
    cluster: Cluster, namespace: str, name: str, logger: logging.Logger | logging.LoggerAdapter
) -> None:
    body = cluster.get_inference_service(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return  # Garbage collection removes the children through their owner references.
    meta = body["metadata"]
    generation = meta.get("generation")
    previous = body.get("status") or {}
    owner = Owner(name=name, namespace=namespace, uid=meta["uid"])
    deployment = cluster.get("apps/v1", "Deployment", namespace, name)

    spec: InferenceServiceSpec | None = None
    plan: SpecPlan | None = None
    failure: tuple[str, str] | None = None
    scaling_problem: tuple[str, str] | None = None
    apply_failure: tuple[str, str] | None = None
    router: dict[str, Any] | None = None
    try:
        if not re.match(DNS1035_LABEL, name):  # created before the CRD said so
            failure = ("InvalidName", NAME_RULE_MESSAGE)
        else:
            spec = parse_spec(body.get("spec") or {}, _server_image)
            planned = plan_for_spec(spec)
            server_args(spec, planned)  # what the pods would start with, checked as the server will
            failure = _replica_exceeds_node(cluster, planned)
            plan = planned if failure is None else None
    except ValidationError as exc:
        failure = ("InvalidSpec", validation_message(exc))
    except PlanningError as exc:
        failure = (FAILURE_REASONS.get(type(exc).__name__, "PlanningFailed"), str(exc))
    except ServeArgsError as exc:
        failure = ("ServerArgsRejected", f"conveyor serve would refuse the arguments it gets: {exc}")

    previous_planned = next(
        (c for c in previous.get("conditions") or [] if c.get("type") == "CapacityPlanned"), None
    )
    if plan is None:
        assert failure is not None
        # An existing Deployment from an earlier, plannable spec keeps serving; nothing new starts.
        is_new = previous_planned is None or previous_planned.get("message") != failure[1]
        if is_new:
            kopf.event(body, type="Warning", reason=failure[0], message=failure[1])
            logger.info("capacity not planned: %s", failure[1])
    else:
        assert spec is not None
        if (
            previous_planned is None
            or previous_planned.get("status") != "True"
            or (previous_planned.get("message") != capacity_message(plan))
        ):
            kopf.event(body, type="Normal", reason="CapacityPlanned", message=capacity_message(plan))
        replicas = _desired_replicas(spec, deployment)
        engine = spec.autoscaling.engine if spec.autoscaling is not None else None
        has_keda = engine == "keda" and cluster.has_api(*SCALED_OBJECT)
        if engine == "keda" and not has_keda:
            scaling_problem = (
                "KEDANotInstalled",
                "autoscaling.engine is keda but the keda.sh/v1alpha1 ScaledObject API is not served; "
                "replicas stay as they are until KEDA is installed",
            )
            previous_scaling = next(
                (c for c in previous.get("conditions") or [] if c.get("type") == "Scaling"), {}
            )
            if previous_scaling.get("reason") != scaling_problem[0]:
                kopf.event(body, type="Warning", reason=scaling_problem[0], message=scaling_problem[1])
                logger.warning(scaling_problem[1])
        for attempt in range(2):
            try:
                stored = _apply_children(
                    cluster,
                    body,
                    _children(cluster, body, owner, spec, plan, replicas, has_keda, logger),
                    logger,
                )
            except ApplyError as exc:
                if exc.status == 404 and attempt == 0:
                    cluster.refresh_discovery()  # an optional CRD (ServiceMonitor ...) may be gone
                    has_keda = engine == "keda" and cluster.has_api(*SCALED_OBJECT)
                    continue
                apply_failure = (APPLY_FAILURE_REASONS.get(exc.status, APPLY_FAILURE_REASON), str(exc))
                break
            deployment = stored.get(("Deployment", name)) or deployment
            router = stored.get(("Deployment", router_name(name)))
            break
    if spec is not None and spec.router_enabled and plan is None:
        router = cluster.get("apps/v1", "Deployment", namespace, router_name(name))

    desired = (deployment or {}).get("spec", {}).get("replicas", 0)
    ready = ((deployment or {}).get("status") or {}).get("readyReplicas", 0)
    unschedulable = cluster.unschedulable(namespace, name) if ready < desired else None
    status = build_status(
        name=name,
        namespace=namespace,
        generation=generation,
        spec=spec,
        plan=plan,
        failure=failure,
        deployment=deployment,
        previous=previous,
        now=_now(),
        scaling_problem=scaling_problem,
        apply_failure=apply_failure,
        unschedulable=unschedulable,
        router=router,
    )
    if _without_none(status) != _without_none({k: previous.get(k) for k in status}):
        cluster.patch_status(namespace, name, status)
    if unschedulable is not None:
        was = next((c for c in previous.get("conditions") or [] if c.get("type") == "Ready"), {})
        now_ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        if now_ready["reason"] == "PodsUnschedulable" and was.get("reason") != "PodsUnschedulable":
            kopf.event(body, type="Warning", reason="PodsUnschedulable", message=now_ready["message"])
            logger.warning(now_ready["message"])
    if apply_failure is not None:
        was = next((c for c in previous.get("conditions") or [] if c.get("type") == "Ready"), {})
        if (was.get("reason"), was.get("message")) != apply_failure:
            kopf.event(body, type="Warning", reason=apply_failure[0], message=apply_failure[1])
            logger.warning("%s: %s", apply_failure[0], apply_failure[1])
        raise ReconcileFailed(apply_failure[1])


def _children(
    cluster: Cluster,
    body: dict[str, Any],
    owner: Owner,
    spec: InferenceServiceSpec,
    plan: SpecPlan,
    replicas: int | None,
    has_keda: bool,
    logger: Any,
) -> list[dict[str, Any]]:
    """The children to apply, for the APIs served now; deletes an HPA or ScaledObject this resource
    rendered before its autoscaling engine changed, its NetworkPolicy once the operator renders none,
    and the router's objects once `router.enabled` is false (never someone else's)."""
    objects = render_all(
        owner,
        spec,
        plan,
        replicas,
        service_monitor=cluster.has_api(*SERVICE_MONITOR),
        scaled_object=has_keda,
        keda=_keda,
        service_monitor_labels=_service_monitor_labels,
        inference_pool=spec.router_enabled and cluster.has_api(*INFERENCE_POOL),
        network_policy_from=_network_policy_from,
    )
    rendered = {(o["apiVersion"], o["kind"]) for o in objects}
    for api in (HPA, SCALED_OBJECT, NETWORK_POLICY):
        if api in rendered or (api == SCALED_OBJECT and not cluster.has_api(*api)):
            continue
        _delete_owned(cluster, body, owner, api, owner.name, logger)
    if not spec.router_enabled:
        _delete_router(cluster, body, owner, logger)
    return objects


def _owned(obj: dict[str, Any] | None, owner: Owner) -> bool:
    return any(
        ref.get("uid") == owner.uid for ref in (obj or {}).get("metadata", {}).get("ownerReferences") or []
    )


def _delete_owned(
    cluster: Cluster, body: dict[str, Any], owner: Owner, api: tuple[str, str], name: str, logger: Any
) -> None:
    """Delete one object if this InferenceService owns it, with an Event."""
    if _owned(cluster.get(*api, owner.namespace, name), owner):
        cluster.delete(*api, owner.namespace, name)
        message = f"deleted {api[1]} {owner.namespace}/{name}"
        kopf.event(body, type="Normal", reason="Deleted", message=message)
        logger.info(message)


# The router's objects, in deletion order: the ServiceAccount, applied first, is deleted last, so
# while it exists the others may, and once it is gone none is left (one read when the router is off).
_ROUTER_SERVICE_ACCOUNT = ("v1", "ServiceAccount")
_ROUTER_APIS = [
    SERVICE_MONITOR,
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    _ROUTER_SERVICE_ACCOUNT,
]


def _delete_router(cluster: Cluster, body: dict[str, Any], owner: Owner, logger: Any) -> None:
    """Delete what `router.enabled` rendered (and the InferencePool that came with it)."""
    if not _owned(cluster.get(*_ROUTER_SERVICE_ACCOUNT, owner.namespace, router_name(owner.name)), owner):
        return
    if cluster.has_api(*INFERENCE_POOL):
        _delete_owned(cluster, body, owner, INFERENCE_POOL, owner.name, logger)
    for api in _ROUTER_APIS:
        if api != SERVICE_MONITOR or cluster.has_api(*api):
            _delete_owned(cluster, body, owner, api, router_name(owner.name), logger)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations (our status schema is strict) and post only our events.

    `kopf.event` ignores `posting.level`, so raising it to WARNING silences kopf's per-handler chatter
    ("Handler 'on_child' succeeded" on every Deployment status change) but not our events.
    """
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    # Deleting an autoscaled InferenceService waits for its timer to stop (kopf's finalizer). A step
    # caught mid-run (a few Prometheus queries) exits within a second; kopf's default would re-check
    # only after 60 s.
    settings.background.instant_exit_timeout = 0.5
    settings.background.cancellation_polling = 1.0
    # Resource watches that never time out can go silently stale behind load balancers.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    _get_cluster()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def on_inference_service(namespace: str, name: str, retry: int, logger: logging.Logger, **_: Any) -> None:
    """Any change to an InferenceService's spec, metadata labels/annotations, or an operator restart.
    A refused child is retried by kopf with a doubling delay (no traceback: status says why)."""
    try:
        reconcile(namespace, name, logger)
    except ReconcileFailed as exc:
        low, high = RETRY_DELAYS
        raise kopf.TemporaryError(str(exc), delay=min(low * 2**retry, high)) from None


@kopf.on.event("monitoring.coreos.com", "v1", "servicemonitors", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event(
    "inference.networking.k8s.io", "v1", "inferencepools", labels={LABEL_MANAGED_BY: FIELD_MANAGER}
)
@kopf.on.event("v1", "serviceaccounts", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("rbac.authorization.k8s.io", "v1", "roles", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("rbac.authorization.k8s.io", "v1", "rolebindings", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("apps", "v1", "deployments", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("v1", "services", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
def on_child(namespace: str, labels: dict[str, str], logger: logging.Logger, **_: Any) -> None:
    """A child changed (status, a manual edit, a deletion): refresh status and undo drift."""
    owner_name = labels.get(LABEL_INSTANCE)
    if owner_name:
        with contextlib.suppress(ReconcileFailed):  # status says why; the resource's handler retries
            reconcile(namespace, owner_name, logger)


@kopf.on.event("v1", "pods", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
def on_pod(
    namespace: str, labels: dict[str, str], body: dict[str, Any], logger: logging.Logger, **_: Any
) -> None:
    """A server pod's scheduling changed. Ready names pods the scheduler cannot place (their
    Deployment's status does not say why), and stops naming them once they are placed."""
    scheduled = next(
        (c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"), {}
    )
    owner_name = labels.get(LABEL_INSTANCE)
    if not owner_name or not scheduled:
        return
    if scheduled.get("status") == "True":
        resource = _get_cluster().get_inference_service(namespace, owner_name) or {}
        conditions = (resource.get("status") or {}).get("conditions") or []
        if not any(c.get("type") == "Ready" and c.get("reason") == "PodsUnschedulable" for c in conditions):
            return
    on_child(namespace=namespace, labels=labels, logger=logger)


@kopf.on.event(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", when=lambda name, **_: name in OPTIONAL_CRDS
)
def on_optional_crd(name: str, type: str | None, logger: logging.Logger, **_: Any) -> None:
    """A ServiceMonitor, ScaledObject or InferencePool CRD was installed, became Established or was
    removed: read discovery again and reconcile every InferenceService in scope, so idle ones get (or
    stop rendering) the object at once rather than at their next change."""
    if type is None:
        return  # the listing at start-up: the resume handlers reconcile everything anyway
    cluster = _get_cluster()
    cluster.refresh_discovery()
    for namespace, isvc_name in cluster.inference_services(_namespaces):
        with contextlib.suppress(ReconcileFailed):  # status says why
            reconcile(namespace, isvc_name, logger)


def configure_scope(namespaces: list[str], service_monitor_labels: dict[str, str]) -> None:
    """The namespaces the operator watches (glob patterns, empty = all) and extra ServiceMonitor labels."""
    global _namespaces, _service_monitor_labels
    _namespaces, _service_monitor_labels = list(namespaces), dict(service_monitor_labels)


def configure_children(
    server_image: str, network_policy_from: list[dict[str, Any]] | None, keda: KedaSettings
) -> None:
    """The server image of resources without `spec.image`, the extra NetworkPolicyPeers let into the
    server pods (None: no NetworkPolicy), and the ScaledObjects' settings."""
    global _server_image, _network_policy_from, _keda
    _server_image, _network_policy_from, _keda = server_image, network_policy_from, keda


def configure_autoscaler(prometheus_url: str | None, interval_seconds: float) -> None:
    """Point the builtin autoscaler at Prometheus and register its timer (every `interval_seconds`).

    Without a URL the timer still runs and records `MetricsAvailable=False` (it never guesses). A
    step's queries share one deadline shorter than the interval (PROMETHEUS_DEADLINE_SECONDS at most),
    so a hung Prometheus never makes steps pile up.
    """
    global _prometheus
    deadline = min(PROMETHEUS_DEADLINE_SECONDS, 0.8 * interval_seconds)
    _prometheus = PrometheusSource(prometheus_url, deadline) if prometheus_url else None
    # Only autoscaled resources get the timer, and with it kopf's finalizer (kopf stops a timer before
    # its resource goes, so deleting an autoscaled InferenceService waits for a running operator).
    kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        interval=interval_seconds,
        id="autoscale",
        field="spec.autoscaling",
        value=kopf.PRESENT,
    )(on_autoscale_timer)


def on_autoscale_timer(namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """One builtin-autoscaler step for one InferenceService: read, decide, write replicas, record."""
    lock = _lock_for(namespace, name)
    cluster = _get_cluster()
    try:
        autoscale(cluster, _prometheus, namespace, name, memo, logger, time.time(), lock=lock)
    except ApiException as exc:
        if exc.status != 403:
            raise
        with lock:
            _report_forbidden(cluster, namespace, name, SCALING, api_message(exc), logger)


def _reading_without_source() -> Reading:
    return Reading(Observation(None, None), {"prometheus": "the operator runs without --prometheus-url"})


def autoscale(
    cluster: Cluster,
    source: PrometheusSource | None,
    namespace: str,
    name: str,
    memo: Any,
    logger: logging.Logger | logging.LoggerAdapter,
    now_seconds: float,
    *,
    lock: threading.Lock | None = None,
) -> None:
    """Read the Ready pods' metrics, decide, write the Deployment's replicas (mode Active), and record
    the decision in status, an Event and the operator's metrics. `memo` holds the history between
    steps; after a restart it is read back from status.

    `lock` is the resource's reconcile lock. Prometheus is read without it, so a slow or hung
    Prometheus never delays a reconcile; the resource and its Deployment are read again, and the
    decision written, while holding it.
    """
    lock = lock or threading.Lock()
    body = cluster.get_inference_service(namespace, name)
    spec = _autoscaled_spec(body)
    if body is None or spec is None:
        return
    auto = spec.autoscaling
    keda_pending = auto is not None and auto.engine == "keda" and cluster.has_api(*SCALED_OBJECT)
    if keda_pending and cluster.get(*SCALED_OBJECT, namespace, name) is None:
        # KEDA was installed after the last reconcile: nothing else would trigger one.
        with lock, contextlib.suppress(ReconcileFailed):  # status says why
            _reconcile(cluster, namespace, name, logger)
    if auto is None or auto.engine != "builtin":
        memo.pop(HISTORY_MEMO_KEY, None)
        return
    ready_pods, live_pods = cluster.pods(namespace, name)
    router_pods = None
    if spec.router_enabled:
        # Requests the router holds are the only demand a service scaled to zero shows.
        ready_routers, live_routers = cluster.pods(namespace, name, router_selector_string(name))
        router_pods = ready_routers or live_routers
    reading = (
        _reading_without_source()
        if source is None
        else source.observe(namespace, ready_pods or live_pods, auto.ttft_window_seconds, router_pods)
    )
    with lock:
        _decide_and_record(cluster, namespace, name, memo, logger, now_seconds, reading, len(ready_pods))


def _autoscaled_spec(body: dict[str, Any] | None) -> InferenceServiceSpec | None:
    """The spec of a live InferenceService, None when it is gone, being deleted or invalid (reconcile
    reports that)."""
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    try:
        return parse_spec(body.get("spec") or {}, _server_image)
    except ValidationError:
        return None


def _decide_and_record(
    cluster: Cluster,
    namespace: str,
    name: str,
    memo: Any,
    logger: logging.Logger | logging.LoggerAdapter,
    now_seconds: float,
    reading: Reading,
    ready: int,
) -> None:
    """The autoscaling step's second half, under the resource's lock: decide on `reading` with the
    spec, replicas and status as they are now, write replicas and record the decision."""
    body = cluster.get_inference_service(namespace, name)
    spec = _autoscaled_spec(body)
    if body is None or spec is None or spec.autoscaling is None or spec.autoscaling.engine != "builtin":
        return  # deleted, or autoscaling changed while Prometheus answered
    auto = spec.autoscaling
    deployment = cluster.get("apps/v1", "Deployment", namespace, name)
    if deployment is None:
        return  # reconcile creates it first
    current = int(deployment.get("spec", {}).get("replicas", 1))
    previous = body.get("status") or {}
    history: History = memo.get(HISTORY_MEMO_KEY) or history_from_status(previous)
    decision, new_history = decide(auto, current, ready, reading.observation, history, now_seconds)
    acted = auto.mode == "Active"
    if not acted:
        new_history = History(new_history.recommendations, history.scale_events)
    changed = decision.replicas != current
    if changed and acted:
        cluster.scale_deployment(namespace, name, decision.replicas)
        logger.info("scaled %s/%s: %s", namespace, name, decision.message)
    memo[HISTORY_MEMO_KEY] = new_history

    now = _rfc3339(now_seconds)
    patch = autoscaler_status(
        previous=previous,
        decision=decision,
        reading=reading,
        history=new_history,
        current=current,
        ready=ready,
        acted=acted,
        generation=body["metadata"].get("generation"),
        now=now,
    )
    before = (previous.get("autoscaler") or {}).get("decisions") or []
    recorded = patch["autoscaler"]["decisions"] != before
    if changed and (acted or recorded):
        reason = decision.reason if acted else f"Advisory{decision.reason}"
        kopf.event(body, type="Normal", reason=reason, message=decision.message)
    was = next((c for c in previous.get("conditions") or [] if c.get("type") == METRICS_AVAILABLE), None)
    now_available = next(c for c in patch["conditions"] if c["type"] == METRICS_AVAILABLE)
    # Told once per outage, not every step: the Event when the condition turns False; the log when
    # this operator process sees the change (a restarted operator logs an outage still going on).
    available = now_available["status"] == "True"
    if not available and (was or {}).get("status") != "False":
        kopf.event(body, type="Warning", reason="MetricsUnavailable", message=now_available["message"])
    if not available and memo.get(METRICS_MEMO_KEY) is not False:
        logger.warning("%s/%s: metrics unavailable: %s", namespace, name, now_available["message"])
    elif available and memo.get(METRICS_MEMO_KEY) is False:
        logger.info("%s/%s: metrics available again: %s", namespace, name, now_available["message"])
    memo[METRICS_MEMO_KEY] = available
    cluster.patch_status(namespace, name, patch)

    metrics.DECISIONS.labels(namespace, name, decision.reason).inc()
    metrics.LAST_DECISION.labels(namespace, name).set(now_seconds)
    metrics.DESIRED.labels(namespace, name).set(decision.replicas)
    for query in reading.errors:
        metrics.QUERY_ERRORS.labels(namespace, name, query).inc()
