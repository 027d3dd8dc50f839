"""Every Kubernetes API call the operator makes: `ClusterAPI`, the one I/O seam reconcile and the
autoscaler's step go through, and `Cluster`, its implementation over the API server
(tests/unit/test_handlers.py has an in-memory one); `AccessReview`, the start-up permission check."""

from __future__ import annotations

import fnmatch
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from kubernetes import client, config, dynamic
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic.exceptions import DynamicApiError, NotFoundError, ResourceNotFoundError

from conveyor.operator.permissions import Check
from conveyor.operator.render import FIELD_MANAGER, GPU_PRODUCT_LABEL, GPU_RESOURCE, selector_string
from conveyor.operator.spec import GROUP, PLURAL, VERSION

SERVICE_MONITOR = ("monitoring.coreos.com/v1", "ServiceMonitor")
HPA = ("autoscaling/v2", "HorizontalPodAutoscaler")
SCALED_OBJECT = ("keda.sh/v1alpha1", "ScaledObject")
INFERENCE_POOL = ("inference.networking.k8s.io/v1", "InferencePool")
NETWORK_POLICY = ("networking.k8s.io/v1", "NetworkPolicy")

# The field manager of replicas written by the builtin autoscaler (scale subresource).
AUTOSCALER_FIELD_MANAGER = "conveyor-autoscaler"
# How long API discovery ("is ServiceMonitor served?") is trusted before it is read again, in seconds.
DISCOVERY_TTL_SECONDS = 60.0
# Metadata the API server maintains; two objects that differ only there hold the same configuration.
_SERVER_METADATA = ("resourceVersion", "managedFields", "generation", "creationTimestamp", "uid", "selfLink")


class ApplyError(Exception):
    """The API server refused an object: `kind`, `name`, HTTP `status` and the server's `message`."""

    def __init__(self, kind: str, name: str, status: int, message: str) -> None:
        super().__init__(f"{kind} {name}: {message}")
        self.kind, self.name, self.status, self.message = kind, name, status, message


def _api_error(obj: dict[str, Any], exc: DynamicApiError) -> ApplyError:
    try:
        message = exc.summary()
    except ValueError:  # a body that says it is JSON and is not
        message = str(exc.body)
    return ApplyError(obj["kind"], obj["metadata"]["name"], exc.status or 0, str(message))


# Annotations controllers maintain on our children (the Deployment controller's rollout revision).
_CONTROLLER_ANNOTATIONS = ("deployment.kubernetes.io/revision",)


def configuration(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` without its status, the metadata the API server maintains and annotations controllers
    maintain."""
    meta = {k: v for k, v in obj.get("metadata", {}).items() if k not in _SERVER_METADATA}
    annotations = {
        k: v for k, v in (meta.get("annotations") or {}).items() if k not in _CONTROLLER_ANNOTATIONS
    }
    meta["annotations"] = annotations or None
    return {**{k: v for k, v in obj.items() if k != "status"}, "metadata": meta}


logger = logging.getLogger(__name__)


def load_api_client() -> client.ApiClient:
    """An API client with the pod's service account in a cluster, else the kubeconfig ($KUBECONFIG or
    ~/.kube/config). Raises kubernetes.config.ConfigException when neither exists."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def api_message(exc: ApiException) -> str:
    """The API server's own message in an error (`deployments.apps "x" is forbidden: User "..." cannot
    get resource "deployments" in API group "apps" in the namespace "ns"`), else the HTTP reason."""
    try:
        message = json.loads(exc.body or "").get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message or f"HTTP {exc.status} {exc.reason}")


def _quantity_int(value: str) -> int:
    """A GPU count as a node reports it (a whole number); 0 when it is not one."""
    try:
        return int(value)
    except ValueError:
        return 0


class ClusterAPI(Protocol):
    """What the operator needs of the Kubernetes API; `Cluster` documents each call."""

    def get_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def inference_services(self, namespaces: list[str]) -> list[tuple[str, str]]: ...

    def has_api(self, api_version: str, kind: str) -> bool: ...

    def refresh_discovery(self) -> None: ...

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    def apply(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]: ...

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool: ...

    def pods(self, namespace: str, name: str, selector: str | None = None) -> tuple[list[str], list[str]]: ...

    def unschedulable(self, namespace: str, name: str) -> tuple[int, str] | None: ...

    def largest_gpu_node(self, product_label: str | None) -> int | None: ...

    def remove_env(
        self, namespace: str, name: str, container: str, names: list[str], env_from: bool
    ) -> None: ...

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None: ...

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None: ...


class Cluster:
    """`ClusterAPI` over the API server (the only I/O in the operator's reconciling)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.dynamic = dynamic.DynamicClient(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self._apis: dict[tuple[str, str], bool] = {}
        # The dynamic client keeps discovery in a file under /tmp and trusts it across restarts:
        # start from the server's answer, and read it again every DISCOVERY_TTL_SECONDS.
        self.dynamic.resources.invalidate_cache()
        self._discovered_at = time.monotonic()
        # The discovery cache is shared by every reconcile thread.
        self._discovery_lock = threading.Lock()

    def get_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The InferenceService as a dict, or None if it is gone."""
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def inference_services(self, namespaces: list[str]) -> list[tuple[str, str]]:
        """(namespace, name) of every InferenceService in namespaces matching the glob patterns
        (all namespaces when empty)."""
        items = self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
        found = [(i["metadata"]["namespace"], i["metadata"]["name"]) for i in items]
        return [
            (ns, n) for ns, n in found if not namespaces or any(fnmatch.fnmatch(ns, p) for p in namespaces)
        ]

    def has_api(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves `kind` in `api_version`. Discovery is read again at most a
        minute after the last read (a CRD installed or removed is seen within that time), and at
        once after `refresh_discovery()`."""
        with self._discovery_lock:
            if time.monotonic() - self._discovered_at >= DISCOVERY_TTL_SECONDS:
                self._refresh_locked()
            if (api_version, kind) not in self._apis:
                try:
                    self.dynamic.resources.get(api_version=api_version, kind=kind)
                    self._apis[(api_version, kind)] = True
                except ResourceNotFoundError:
                    self._apis[(api_version, kind)] = False
            return self._apis[(api_version, kind)]

    def refresh_discovery(self) -> None:
        """Forget what discovery said (an object's API answered 404: its CRD may be gone)."""
        with self._discovery_lock:
            self._refresh_locked()

    def _refresh_locked(self) -> None:
        self.dynamic.resources.invalidate_cache()
        self._apis.clear()
        self._discovered_at = time.monotonic()

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

    def apply(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply `obj` as the operator's field manager, taking over conflicting fields;
        with `dry_run`, only validated and defaulted by the API server (nothing is stored).

        Returns the object as stored (or as it would be). Raises ApplyError when the API server
        refuses it (invalid, forbidden, its API not served).
        """
        meta = obj["metadata"]
        try:
            return self.dynamic.server_side_apply(
                self._resource(obj["apiVersion"], obj["kind"]),
                body=obj,
                name=meta["name"],
                namespace=meta["namespace"],
                field_manager=FIELD_MANAGER,
                force_conflicts=True,
                **({"dry_run": "All"} if dry_run else {}),
            ).to_dict()
        except DynamicApiError as exc:
            raise _api_error(obj, exc) from None
        except ResourceNotFoundError as exc:
            raise ApplyError(
                obj["kind"], meta["name"], 404, f"{obj['apiVersion']} is not served: {exc}"
            ) from None

    def pods(self, namespace: str, name: str, selector: str | None = None) -> tuple[list[str], list[str]]:
        """(Ready pods, all pods not being deleted) of one InferenceService's servers (or of the
        label `selector`, e.g. its router's), by name."""
        pods = self.core.list_namespaced_pod(
            namespace, label_selector=selector or selector_string(name)
        ).items
        live = [p for p in pods if p.metadata.deletion_timestamp is None]
        ready = [
            p.metadata.name
            for p in live
            if any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))
        ]
        return ready, [p.metadata.name for p in live]

    def unschedulable(self, namespace: str, name: str) -> tuple[int, str] | None:
        """(how many, the scheduler's message of one) for pods of one InferenceService the scheduler
        cannot place (PodScheduled=False, reason Unschedulable), or None when there are none."""
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector_string(name)).items
        messages = [
            c.message or "no reason given"
            for p in pods
            if p.metadata.deletion_timestamp is None
            for c in (p.status.conditions or [])
            if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
        ]
        return (len(messages), messages[0]) if messages else None

    def largest_gpu_node(self, product_label: str | None) -> int | None:
        """The most `nvidia.com/gpu` one node can give a pod (allocatable) among the nodes labelled
        `nvidia.com/gpu.product=product_label` (every node with GPUs when None); None when there is no
        such node (a cluster autoscaler may add one) or nodes cannot be listed (RBAC), logged."""
        selector = f"{GPU_PRODUCT_LABEL}={product_label}" if product_label else None
        try:
            nodes = self.core.list_node(label_selector=selector).items
        except ApiException as exc:
            logger.warning("cannot list nodes to check replica sizes (%s %s)", exc.status, exc.reason)
            return None
        sizes = [_quantity_int((n.status.allocatable or {}).get(GPU_RESOURCE, "0")) for n in nodes]
        sizes = [size for size in sizes if size > 0]
        return max(sizes) if sizes else None

    def remove_env(self, namespace: str, name: str, container: str, names: list[str], env_from: bool) -> None:
        """Delete environment variables (and, with `env_from`, the whole envFrom list) from one
        container of a Deployment: a strategic-merge patch, since server-side apply leaves what other
        field managers added."""
        patched: dict[str, Any] = {"name": container}
        if names:
            patched["env"] = [{"name": n, "$patch": "delete"} for n in names]
        if env_from:
            patched["envFrom"] = None
        patch = {"spec": {"template": {"spec": {"containers": [patched]}}}}
        self.apps.patch_namespaced_deployment(name, namespace, patch)

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        """Write the Deployment's replicas through its scale subresource (nothing when it was deleted
        meanwhile)."""
        try:
            self.apps.patch_namespaced_deployment_scale(
                name, namespace, {"spec": {"replicas": replicas}}, field_manager=AUTOSCALER_FIELD_MANAGER
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch the status subresource (None values delete fields); nothing when the resource
        was deleted meanwhile (a race, not an error)."""
        try:
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": status}
            )
        except ApiException as exc:
            if exc.status != 404:
                raise


class AccessReview:
    """What the operator asks the API server before it starts (run.py): who it is, whether it may do
    each thing it needs, whether kopf's peering CRDs exist. Every call is bounded by `timeout_seconds`
    (a hung API server fails the start instead of hanging it); errors are the client's
    (ApiException, urllib3's HTTPError)."""

    def __init__(self, api_client: client.ApiClient, timeout_seconds: float = 10.0) -> None:
        self.authorization = client.AuthorizationV1Api(api_client)
        self.authentication = client.AuthenticationV1Api(api_client)
        self.extensions = client.ApiextensionsV1Api(api_client)
        self.timeout = timeout_seconds

    def identity(self) -> str | None:
        """The user name the API server knows these credentials by (SelfSubjectReview), or None when
        it cannot say."""
        try:
            review = self.authentication.create_self_subject_review(
                client.V1SelfSubjectReview(), _request_timeout=self.timeout
            )
        except ApiException:
            return None
        return review.status.user_info.username if review.status and review.status.user_info else None

    def has_crd(self, name: str) -> bool:
        """Whether the CustomResourceDefinition `name` (e.g. kopfpeerings.kopf.dev) is installed."""
        try:
            self.extensions.read_custom_resource_definition(name, _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def missing_permissions(self, checks: list[Check]) -> list[Check]:
        """The checks the API server denies these credentials, asked as SelfSubjectAccessReviews (every
        authenticated identity may ask about itself), a few at a time."""

        def allowed(check: Check) -> bool:
            resource, _, subresource = check.resource.partition("/")
            review = client.V1SelfSubjectAccessReview(
                spec=client.V1SelfSubjectAccessReviewSpec(
                    resource_attributes=client.V1ResourceAttributes(
                        verb=check.verb,
                        group=check.group,
                        resource=resource,
                        subresource=subresource or None,
                        namespace=check.namespace or None,
                    )
                )
            )
            answer = self.authorization.create_self_subject_access_review(
                review, _request_timeout=self.timeout
            )
            return bool(answer.status.allowed)

        with ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(pool.map(allowed, checks))
        return [check for check, ok in zip(checks, answers, strict=True) if not ok]
