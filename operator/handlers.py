"""kopf handlers: the wiring between kopf's events and the operator's plain modules.

An InferenceService is reconciled (reconcile.py) when it is created, changed or found at start-up,
and whenever one of its children changes (so status follows the pods and drift is corrected at once).
The builtin autoscaler's step (scaling.py) runs on a kopf timer per autoscaled InferenceService. Each
handler reads the resource under its lock, calls into those modules and writes what they return:
the status, and the Events (`kopf.event`). The operator's state comes in kopf's `memo` (memo.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from conveyor.operator import adapters, metrics, scaling
from conveyor.operator.cluster import Cluster, api_message, load_api_client
from conveyor.operator.events import Event, transitions
from conveyor.operator.memo import OperatorMemo
from conveyor.operator.reconcile import forbidden, parse, reconcile
from conveyor.operator.render import FIELD_MANAGER, LABEL_INSTANCE, LABEL_MANAGED_BY
from conveyor.operator.spec import GROUP, PLURAL, VERSION
from conveyor.operator.status import ADAPTERS_READY, PODS_UNSCHEDULABLE, READY, SCALING, rfc3339

Logger = logging.Logger | logging.LoggerAdapter
# kopf's retry delay after an apply failure: doubling from 10 s up to 5 minutes.
RETRY_DELAYS = (10, 300)
# CRDs of optional APIs: installing or removing one changes what every InferenceService renders.
OPTIONAL_CRDS = frozenset(
    {
        "servicemonitors.monitoring.coreos.com",
        "scaledobjects.keda.sh",
        "inferencepools.inference.networking.k8s.io",
    }
)


class ReconcileFailed(Exception):
    """The API server refused a child, or a permission is missing; `.status` says why."""


@kopf.on.startup()
def on_startup(settings: kopf.OperatorSettings, memo: OperatorMemo, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations (our status schema is strict), post only our events, and
    connect to the cluster (kopf retries a failed start-up handler).

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
    if memo.cluster is None:
        memo.cluster = Cluster(load_api_client())


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def on_inference_service(
    namespace: str, name: str, retry: int, memo: OperatorMemo, logger: Logger, **_: Any
) -> None:
    """Any change to an InferenceService's spec, metadata labels/annotations, or an operator restart.
    A refused child is retried by kopf with a doubling delay (no traceback: status says why)."""
    try:
        reconcile_service(memo, namespace, name, logger)
    except ReconcileFailed as exc:
        low, high = RETRY_DELAYS
        raise kopf.TemporaryError(str(exc), delay=min(low * 2**retry, high)) from None


@kopf.on.event(GROUP, VERSION, PLURAL, when=lambda type, **_: type == "DELETED")
def on_deleted(namespace: str, name: str, memo: OperatorMemo, **_: Any) -> None:
    """An InferenceService is gone (its children go by garbage collection): drop its lock."""
    memo.locks.prune(namespace, name)


@kopf.on.event("monitoring.coreos.com", "v1", "servicemonitors", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event(
    "inference.networking.k8s.io", "v1", "inferencepools", labels={LABEL_MANAGED_BY: FIELD_MANAGER}
)
@kopf.on.event("v1", "serviceaccounts", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("rbac.authorization.k8s.io", "v1", "roles", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("rbac.authorization.k8s.io", "v1", "rolebindings", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("apps", "v1", "deployments", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("v1", "services", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("v1", "configmaps", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
def on_child(namespace: str, labels: dict[str, str], memo: OperatorMemo, logger: Logger, **_: Any) -> None:
    """A child changed (status, a manual edit, a deletion): refresh status and undo drift."""
    owner_name = labels.get(LABEL_INSTANCE)
    if owner_name:
        with contextlib.suppress(ReconcileFailed):  # status says why; the resource's handler retries
            reconcile_service(memo, namespace, owner_name, logger)


@kopf.on.event("v1", "pods", labels={LABEL_MANAGED_BY: FIELD_MANAGER})
def on_pod(
    namespace: str, labels: dict[str, str], body: dict[str, Any], memo: OperatorMemo, logger: Logger, **_: Any
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
        resource = memo.api.get_inference_service(namespace, owner_name) or {}
        conditions = (resource.get("status") or {}).get("conditions") or []
        if not any(c.get("type") == READY and c.get("reason") == PODS_UNSCHEDULABLE for c in conditions):
            return
    on_child(namespace=namespace, labels=labels, memo=memo, logger=logger)


@kopf.on.event(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", when=lambda name, **_: name in OPTIONAL_CRDS
)
def on_optional_crd(name: str, type: str | None, memo: OperatorMemo, logger: Logger, **_: Any) -> None:
    """A ServiceMonitor, ScaledObject or InferencePool CRD was installed, became Established or was
    removed: read discovery again and reconcile every InferenceService in scope, so idle ones get (or
    stop rendering) the object at once rather than at their next change."""
    if type is None:
        return  # the listing at start-up: the resume handlers reconcile everything anyway
    memo.api.refresh_discovery()
    for namespace, isvc_name in memo.api.inference_services(list(memo.settings.namespaces)):
        with contextlib.suppress(ReconcileFailed):  # status says why
            reconcile_service(memo, namespace, isvc_name, logger)


def register_autoscale_timer(interval_seconds: float) -> None:
    """Register the builtin autoscaler's timer: a step every `interval_seconds` (a flag, so registered
    by run.py rather than by a decorator at import), and the LoRA adapters' status timer at the same
    interval."""
    # Only autoscaled resources get the timer, and with it kopf's finalizer (kopf stops a timer before
    # its resource goes, so deleting an autoscaled InferenceService waits for a running operator).
    timers = (
        ("autoscale", "spec.autoscaling", on_autoscale_timer),
        ("lora-status", "spec.model.lora", on_adapter_timer),
    )
    for id_, field, handler in timers:
        kopf.timer(
            GROUP, VERSION, PLURAL, interval=interval_seconds, id=id_, field=field, value=kopf.PRESENT
        )(handler)


def reconcile_service(memo: OperatorMemo, namespace: str, name: str, logger: Logger) -> None:
    """Reconcile one InferenceService under its lock. Raises ReconcileFailed when the API server
    refused a child or a permission is missing (status and an Event already say so)."""
    with memo.locks.get(namespace, name):
        try:
            _reconcile_locked(memo, namespace, name, logger)
        except ApiException as exc:
            if exc.status != 403:
                raise
            message = api_message(exc)
            _report_forbidden(memo, namespace, name, READY, message, logger)
            raise ReconcileFailed(message) from None


def autoscale(memo: OperatorMemo, namespace: str, name: str, logger: Logger, now_seconds: float) -> None:
    """The builtin autoscaler's step (scaling.py) at `now_seconds` (Unix time): Prometheus is read
    without the resource's lock, the decision made and written while holding it."""
    cluster = memo.api
    spec = scaling.autoscaled_spec(cluster.get_inference_service(namespace, name), memo.settings.server_image)
    if spec is None:
        return
    if scaling.keda_pending(cluster, namespace, name, spec):
        with memo.locks.get(namespace, name), contextlib.suppress(ReconcileFailed):  # status says why
            _reconcile_locked(memo, namespace, name, logger)
    if not scaling.builtin(spec):
        memo.autoscaler_history = None
        return
    reading, ready = scaling.observe(cluster, memo.prometheus, namespace, name, spec)
    with memo.locks.get(namespace, name):
        step = scaling.step(
            cluster,
            namespace,
            name,
            reading,
            ready,
            history=memo.autoscaler_history,
            was_available=memo.metrics_available,
            server_image=memo.settings.server_image,
            now_seconds=now_seconds,
            logger=logger,
        )
        if step is None:
            return
        memo.autoscaler_history, memo.metrics_available = step.history, step.metrics_available
        _post(step.body, step.events, logger)
        cluster.patch_status(namespace, name, step.status)
        metrics.record_decision(namespace, name, step.decision, reading, now_seconds)


def _reconcile_locked(memo: OperatorMemo, namespace: str, name: str, logger: Logger) -> None:
    """Read, reconcile and write one InferenceService; the caller holds its lock. Raises
    ReconcileFailed for a refused child, and the API's errors."""
    body = memo.api.get_inference_service(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return  # Garbage collection removes the children through their owner references.
    resource = parse(body, memo.settings.server_image)
    reconciled = reconcile(resource, memo.api, memo.settings, rfc3339(time.time()))
    _post(body, reconciled.events, logger)
    if reconciled.error is not None:
        raise reconciled.error
    if reconciled.status is not None:
        memo.api.patch_status(namespace, name, reconciled.status)
    if reconciled.failure is not None:
        raise ReconcileFailed(reconciled.failure)


def _report_forbidden(
    memo: OperatorMemo, namespace: str, name: str, condition_type: str, message: str, logger: Logger
) -> None:
    """Write what `reconcile.forbidden` decides for a refused call (the caller holds the lock); a
    failure to read or write is logged, never raised."""
    try:
        body = memo.api.get_inference_service(namespace, name)
    except ApiException as exc:
        logger.error(
            "%s; reading %s/%s to report it failed too: %s", message, namespace, name, api_message(exc)
        )
        return
    if body is None:
        return
    reported = forbidden(body, condition_type, message, rfc3339(time.time()))
    _post(body, reported.events, logger)
    if reported.status is None:
        return
    try:
        memo.api.patch_status(namespace, name, reported.status)
    except ApiException as exc:
        logger.error("cannot write the Forbidden condition of %s/%s: %s", namespace, name, api_message(exc))


def _post(body: dict[str, Any], events: list[Event], logger: Logger) -> None:
    """Post `events` on the InferenceService `body` and log the lines they carry."""
    for event in events:
        if event.log is not None:
            logger.log(event.level, "%s", event.log)
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


def adapter_step(memo: OperatorMemo, namespace: str, name: str, logger: Logger, now_seconds: float) -> None:
    """One adapters' status step (adapters.py), refreshing `status.loraAdapters` and AdaptersReady from
    the Ready pods' adapter series: Prometheus is read without the resource's lock, the
    status written holding it, for the spec as it is then; an AdaptersReady change is an Event."""
    cluster = memo.api
    ready_pods, _ = cluster.pods(namespace, name)
    reading = adapters.observe(memo.prometheus, namespace, ready_pods)
    with memo.locks.get(namespace, name):
        body = cluster.get_inference_service(namespace, name)
        spec = scaling.autoscaled_spec(body, memo.settings.server_image)
        if body is None or spec is None or spec.model.lora is None:
            return
        previous = body.get("status") or {}
        declared = [a.name for a in spec.model.lora.adapters]
        patch = adapters.adapter_status(
            declared,
            reading,
            previous=previous,
            generation=body["metadata"].get("generation"),
            now=rfc3339(now_seconds),
        )
        events = transitions(previous.get("conditions") or [], patch["conditions"], (ADAPTERS_READY,))
        if patch["loraAdapters"] != previous.get("loraAdapters") or patch["conditions"] != previous.get(
            "conditions"
        ):
            _post(body, events, logger)
            cluster.patch_status(namespace, name, patch)


def _timer(
    step: Callable[[OperatorMemo, str, str, Logger, float], None], condition_type: str
) -> Callable[..., None]:
    """A kopf timer handler running `step` for one InferenceService now; a call the API server refuses
    for want of a permission turns `condition_type` False with reason Forbidden (`_report_forbidden`)."""

    def on_timer(namespace: str, name: str, memo: OperatorMemo, logger: Logger, **_: Any) -> None:
        try:
            step(memo, namespace, name, logger, time.time())
        except ApiException as exc:
            if exc.status != 403:
                raise
            with memo.locks.get(namespace, name):
                _report_forbidden(memo, namespace, name, condition_type, api_message(exc), logger)

    return on_timer


# The timers' handlers (`register_autoscale_timer`): the builtin autoscaler's step, and the adapters'.
on_autoscale_timer = _timer(autoscale, SCALING)
on_adapter_timer = _timer(adapter_step, ADAPTERS_READY)
