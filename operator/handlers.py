"""kopf handlers: reconcile each InferenceService into its Deployment, Service, PDB and ServiceMonitor.

One `reconcile` does everything and is safe to run any number of times: read the resource, plan its
capacity, render the children (pure), server-side apply them (a no-op when nothing changed, and a
forced apply undoes manual edits), then write `.status` if it changed. It runs when an InferenceService
is created, changed or found at start-up, and whenever one of its children changes (so status follows
the pods and drift is corrected at once).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any

import kopf
from kubernetes import client, config, dynamic
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError
from pydantic import ValidationError

from conveyor.operator.plan import PlanningError, SpecPlan, plan_for_spec
from conveyor.operator.render import (
    FIELD_MANAGER,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    Owner,
    render_all,
)
from conveyor.operator.spec import GROUP, PLURAL, VERSION, InferenceServiceSpec, parse_spec
from conveyor.operator.status import build_status, capacity_message

# How long the answer to "does the monitoring.coreos.com API exist?" is trusted, in seconds.
DISCOVERY_TTL_SECONDS = 60.0

# Condition reasons for specs that cannot be planned, by exception class name.
FAILURE_REASONS = {
    "InsufficientGPUMemoryError": "InsufficientGPUMemory",
    "KVCacheTooSmallError": "InsufficientGPUMemory",
    "UnknownModelError": "UnknownModel",
    "UnknownGPUTypeError": "UnknownGPUType",
    "MaxModelLenTooLongError": "MaxModelLenTooLong",
}


class Cluster:
    """The Kubernetes API calls the reconciler makes (the only I/O in the operator)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.dynamic = dynamic.DynamicClient(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._monitoring_checked_at = -DISCOVERY_TTL_SECONDS
        self._monitoring = False
        # The discovery cache is shared by every reconcile thread and rebuilt on a miss.
        self._discovery_lock = threading.Lock()

    def get_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The InferenceService as a dict, or None if it is gone."""
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def has_service_monitor_api(self) -> bool:
        """Whether `monitoring.coreos.com/v1` ServiceMonitor is served (cached for a minute)."""
        with self._discovery_lock:
            now = time.monotonic()
            if now - self._monitoring_checked_at >= DISCOVERY_TTL_SECONDS:
                try:
                    # A miss re-reads discovery, so a CRD installed later is found within the TTL.
                    self.dynamic.resources.get(api_version="monitoring.coreos.com/v1", kind="ServiceMonitor")
                    self._monitoring = True
                except ResourceNotFoundError:
                    self._monitoring = False
                self._monitoring_checked_at = now
            return self._monitoring

    def _resource(self, api_version: str, kind: str) -> Any:
        with self._discovery_lock:
            return self.dynamic.resources.get(api_version=api_version, kind=kind)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One object as a dict, or None when it does not exist."""
        resource = self._resource(api_version, kind)
        try:
            return resource.get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def apply(self, obj: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Server-side apply `obj` as the operator's field manager, taking over conflicting fields.

        Returns ("created" | "updated" | "unchanged", the object now stored).
        """
        meta = obj["metadata"]
        before = self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        after = self.dynamic.server_side_apply(
            self._resource(obj["apiVersion"], obj["kind"]),
            body=obj,
            name=meta["name"],
            namespace=meta["namespace"],
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        ).to_dict()
        if before is None:
            return "created", after
        changed = before["metadata"]["resourceVersion"] != after["metadata"]["resourceVersion"]
        return ("updated" if changed else "unchanged"), after

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch the status subresource (None values delete fields)."""
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}
        )


_cluster: Cluster | None = None
_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _get_cluster() -> Cluster:
    global _cluster
    if _cluster is None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        _cluster = Cluster(client.ApiClient())
    return _cluster


def _lock_for(namespace: str, name: str) -> threading.Lock:
    """One lock per InferenceService: handlers for it run in several threads and must not interleave."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def _desired_replicas(spec: InferenceServiceSpec, deployment: dict[str, Any] | None) -> int:
    """Replicas to apply: the spec's, or under autoscaling the Deployment's current count kept
    within [minReplicas, maxReplicas] (the autoscaler changes it; reconciling must not undo that)."""
    if spec.autoscaling is None or deployment is None:
        return spec.desired_replicas
    current = deployment.get("spec", {}).get("replicas", spec.desired_replicas)
    return min(max(current, spec.autoscaling.min_replicas), spec.autoscaling.max_replicas)


def reconcile(namespace: str, name: str, logger: logging.Logger | logging.LoggerAdapter) -> None:
    """Bring one InferenceService's children and status in line with its spec."""
    with _lock_for(namespace, name):
        _reconcile(_get_cluster(), namespace, name, logger)


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
    try:
        spec = parse_spec(body.get("spec") or {})
        plan = plan_for_spec(spec)
    except ValidationError as exc:
        failure = ("InvalidSpec", str(exc))
    except PlanningError as exc:
        failure = (FAILURE_REASONS.get(type(exc).__name__, "PlanningFailed"), str(exc))

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
        objects = render_all(owner, spec, plan, replicas, service_monitor=cluster.has_service_monitor_api())
        for obj in objects:
            action, stored = cluster.apply(obj)
            if action != "unchanged":
                message = f"{action} {obj['kind']} {namespace}/{name}"
                kopf.event(body, type="Normal", reason=action.capitalize(), message=message)
                logger.info(message)
            if obj["kind"] == "Deployment":
                deployment = stored

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
    )
    if _without_none(status) != _without_none({k: previous.get(k) for k in status}):
        cluster.patch_status(namespace, name, status)


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
    # Resource watches that never time out can go silently stale behind load balancers.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    _get_cluster()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def on_inference_service(namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
    """Any change to an InferenceService's spec, metadata labels/annotations, or an operator restart."""
    reconcile(namespace, name, logger)


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("v1", "services", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
def on_child(namespace: str, labels: dict[str, str], logger: logging.Logger, **_: Any) -> None:
    """A child changed (status, a manual edit, a deletion): refresh status and undo drift."""
    owner_name = labels.get(LABEL_INSTANCE)
    if owner_name:
        reconcile(namespace, owner_name, logger)
