"""Every Kubernetes API call the operator makes (the one I/O seam; tests/unit/test_handlers.py has a
stand-in with the same methods)."""

from __future__ import annotations

import threading
import time
from typing import Any

from kubernetes import client, dynamic
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

from conveyor.operator.render import FIELD_MANAGER, selector_string
from conveyor.operator.spec import GROUP, PLURAL, VERSION

SERVICE_MONITOR = ("monitoring.coreos.com/v1", "ServiceMonitor")
HPA = ("autoscaling/v2", "HorizontalPodAutoscaler")
SCALED_OBJECT = ("keda.sh/v1alpha1", "ScaledObject")

# The field manager of replicas written by the builtin autoscaler (scale subresource).
AUTOSCALER_FIELD_MANAGER = "conveyor-autoscaler"
# How long an answer of API discovery ("is ServiceMonitor served?") is trusted, in seconds.
DISCOVERY_TTL_SECONDS = 60.0


class Cluster:
    """The Kubernetes API calls the reconciler makes (the only I/O in the operator)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.dynamic = dynamic.DynamicClient(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self._apis: dict[tuple[str, str], tuple[float, bool]] = {}
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

    def has_api(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves `kind` in `api_version` (each answer cached for a minute, so
        a CRD installed later is found within that time)."""
        with self._discovery_lock:
            now = time.monotonic()
            checked_at, found = self._apis.get((api_version, kind), (-DISCOVERY_TTL_SECONDS, False))
            if now - checked_at >= DISCOVERY_TTL_SECONDS:
                try:
                    # A miss re-reads discovery.
                    self.dynamic.resources.get(api_version=api_version, kind=kind)
                    found = True
                except ResourceNotFoundError:
                    found = False
                self._apis[(api_version, kind)] = (now, found)
            return found

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete one object; False when it did not exist."""
        try:
            self._resource(api_version, kind).delete(name=name, namespace=namespace)
        except NotFoundError:
            return False
        return True

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

    def pods(self, namespace: str, name: str) -> tuple[list[str], list[str]]:
        """(Ready pods, all pods not being deleted) of one InferenceService, by name."""
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector_string(name)).items
        live = [p for p in pods if p.metadata.deletion_timestamp is None]
        ready = [
            p.metadata.name
            for p in live
            if any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))
        ]
        return ready, [p.metadata.name for p in live]

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        """Write the Deployment's replicas through its scale subresource."""
        self.apps.patch_namespaced_deployment_scale(
            name, namespace, {"spec": {"replicas": replicas}}, field_manager=AUTOSCALER_FIELD_MANAGER
        )

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch the status subresource (None values delete fields)."""
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}
        )
