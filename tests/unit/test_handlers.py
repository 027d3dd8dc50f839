"""The reconcile loop's decisions against an in-memory stand-in for the API (the real API server is in
tests/k8s/test_operator.py): what is applied, which events are posted, when status is written.
`reconcile` runs without kopf; the handlers' own work (locks, the Forbidden report) is tested through
them with kopf's event poster replaced."""

import copy
import inspect
import json
import logging
from typing import Any

import pytest

from conveyor.operator import handlers
from conveyor.operator.cluster import ApplyError, Cluster, ClusterAPI, configuration
from conveyor.operator.memo import OperatorMemo, OperatorSettings
from conveyor.operator.reconcile import Reconciled, desired_replicas, parse
from conveyor.operator.reconcile import reconcile as reconcile_resource
from conveyor.operator.spec import parse_spec

NAMESPACE, NAME = "serving", "llama"


class FakeCluster:
    """Stores objects by (kind, name); apply bumps resourceVersion only when the object changes;
    kinds in `refuse` are refused as the API server would ({kind: (HTTP status, message)})."""

    def __init__(
        self, spec: dict[str, Any], service_monitor: bool = False, inference_pool: bool = False
    ) -> None:
        self.isvc: dict[str, Any] | None = {
            "apiVersion": "serving.conveyor.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": NAMESPACE, "uid": "uid-1", "generation": 1},
            "spec": copy.deepcopy(spec),
        }
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.status_patches: list[dict[str, Any]] = []
        self.service_monitor = service_monitor
        self.inference_pool = inference_pool
        self.applied: list[tuple[str, str, bool]] = []  # (kind, name, dry_run)
        self.refuse: dict[str, tuple[int, str]] = {}
        self.discovery_refreshes = 0
        self.pending: tuple[int, str] | None = None
        self.gpu_node_size: int | None = None  # largest_gpu_node's answer
        self.ready_pods: list[str] = []
        self._version = 0

    def get_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.isvc)

    def inference_services(self, namespaces: list[str]) -> list[tuple[str, str]]:
        return [(NAMESPACE, self.isvc["metadata"]["name"])] if self.isvc is not None else []

    def has_api(self, api_version: str, kind: str) -> bool:
        return (kind == "ServiceMonitor" and self.service_monitor) or (
            kind == "InferencePool" and self.inference_pool
        )

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        return self.objects.pop((kind, name), None) is not None

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((kind, name)))

    def apply(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        if obj["kind"] in self.refuse:
            status, message = self.refuse[obj["kind"]]
            raise ApplyError(obj["kind"], obj["metadata"]["name"], status, message)
        key = (obj["kind"], obj["metadata"]["name"])
        self.applied.append((*key, dry_run))
        before = self.objects.get(key)
        desired = {k: v for k, v in obj.items() if k != "status"}
        if before is not None and configuration(before) == configuration(desired):
            return copy.deepcopy(before)
        stored = copy.deepcopy(desired)
        stored["metadata"]["resourceVersion"] = str(self._version + 1)
        stored["status"] = (before or {}).get("status", {})
        if not dry_run:
            self._version += 1
            self.objects[key] = stored
        return copy.deepcopy(stored)

    def pods(self, namespace: str, name: str, selector: str | None = None) -> tuple[list[str], list[str]]:
        return list(self.ready_pods), list(self.ready_pods)

    def unschedulable(self, namespace: str, name: str) -> tuple[int, str] | None:
        return self.pending

    def largest_gpu_node(self, product_label: str | None) -> int | None:
        return self.gpu_node_size

    def refresh_discovery(self) -> None:
        self.discovery_refreshes += 1

    def remove_env(self, namespace: str, name: str, container: str, names: list[str], env_from: bool) -> None:
        raise AssertionError("no test adds environment variables by hand")

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        self.objects[("Deployment", name)]["spec"]["replicas"] = replicas

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        assert self.isvc is not None
        self.status_patches.append(status)
        self.isvc["status"] = {k: v for k, v in status.items() if v is not None}


@pytest.fixture
def events() -> list[tuple[str, str, str]]:
    """The (type, reason, message) of every Event `reconcile` returned, in order."""
    return []


SETTINGS = OperatorSettings()
NOW = "2026-12-01T12:00:00Z"


def reconcile(cluster: FakeCluster, events: list[tuple[str, str, str]]) -> Reconciled:
    """One reconcile without kopf, its Events and status written as the handler writes them."""
    body = cluster.get_inference_service(NAMESPACE, NAME)
    assert body is not None
    reconciled = reconcile_resource(parse(body, SETTINGS.server_image), cluster, SETTINGS, NOW)
    events += [(e.type, e.reason, e.message) for e in reconciled.events]
    assert reconciled.error is None
    if reconciled.status is not None:
        cluster.patch_status(NAMESPACE, NAME, reconciled.status)
    return reconciled


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    """The Events the handlers post through kopf."""
    posted: list[tuple[str, str, str]] = []

    def record(body: dict[str, Any], *, type: str, reason: str, message: str) -> None:
        posted.append((type, reason, message))

    monkeypatch.setattr(handlers.kopf, "event", record)
    return posted


LLAMA = {"model": {"name": "llama-3-8b", "maxModelLen": 4096}, "resources": {"gpuType": "a100-80gb"}}
TOO_BIG = {"model": {"name": "llama-3-70b", "maxModelLen": 4096}, "resources": {"gpuType": "a100-80gb"}}


def test_first_reconcile_creates_children_and_reports(events: list[tuple[str, str, str]]) -> None:
    cluster = FakeCluster(LLAMA, service_monitor=True)
    reconcile(cluster, events)
    assert sorted(kind for kind, _ in cluster.objects) == [
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "ServiceMonitor",
    ]
    assert [(t, r) for t, r, _ in events] == [("Normal", "CapacityPlanned")] + [("Normal", "Created")] * 4
    (status,) = cluster.status_patches
    assert status["capacity"]["maxNumSeqs"] == 112
    assert status["observedGeneration"] == 1


def test_second_reconcile_changes_nothing(events: list[tuple[str, str, str]]) -> None:
    cluster = FakeCluster(LLAMA)
    reconcile(cluster, events)
    versions = {key: obj["metadata"]["resourceVersion"] for key, obj in cluster.objects.items()}
    events.clear()
    reconcile(cluster, events)
    assert events == []
    assert len(cluster.status_patches) == 1
    assert {key: obj["metadata"]["resourceVersion"] for key, obj in cluster.objects.items()} == versions


def test_deployment_status_change_updates_only_status(events: list[tuple[str, str, str]]) -> None:
    cluster = FakeCluster(LLAMA)
    reconcile(cluster, events)
    deployment = cluster.objects[("Deployment", NAME)]
    deployment["metadata"]["generation"] = 1
    deployment["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}
    events.clear()
    reconcile(cluster, events)
    assert events == []
    ready = next(c for c in cluster.status_patches[-1]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "ReplicasReady")
    assert cluster.status_patches[-1]["readyReplicas"] == 1


def test_a_refused_child_creates_nothing_and_says_why_once(events: list[tuple[str, str, str]]) -> None:
    cluster = FakeCluster(LLAMA)
    cluster.refuse["Service"] = (422, 'Service "llama" is invalid: metadata.name: Invalid value')
    assert reconcile(cluster, events).failure == (
        'Service llama: Service "llama" is invalid: metadata.name: Invalid value'
    )
    assert cluster.objects == {}  # the Deployment is not created without its Service
    ready = next(c for c in cluster.status_patches[-1]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ApplyFailed")
    assert ready["message"] == 'Service llama: Service "llama" is invalid: metadata.name: Invalid value'
    assert [(t, r) for t, r, _ in events] == [("Normal", "CapacityPlanned"), ("Warning", "ApplyFailed")]
    events.clear()
    assert reconcile(cluster, events).failure is not None
    assert events == []  # the same failure again: no new Event, no status write
    assert len(cluster.status_patches) == 1
    cluster.refuse.clear()
    reconcile(cluster, events)
    assert [(t, r) for t, r, _ in events] == [("Normal", "Created")] * 3


def test_forbidden_and_missing_apis(events: list[tuple[str, str, str]]) -> None:
    cluster = FakeCluster(LLAMA)
    cluster.refuse["PodDisruptionBudget"] = (403, "poddisruptionbudgets is forbidden")
    assert reconcile(cluster, events).failure is not None
    ready = next(c for c in cluster.status_patches[-1]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "ApplyForbidden"
    assert cluster.discovery_refreshes == 0
    cluster.refuse = {"PodDisruptionBudget": (404, "the server could not find the requested resource")}
    assert reconcile(cluster, events).failure is not None
    assert cluster.discovery_refreshes == 1  # a 404 re-reads discovery and renders again once


def test_a_name_that_cannot_name_a_service_is_reported(events: list[tuple[str, str, str]]) -> None:
    cluster = FakeCluster(LLAMA)
    assert cluster.isvc is not None
    cluster.isvc["metadata"]["name"] = "3b-model"
    reconcile(cluster, events)
    assert cluster.objects == {}
    planned = next(c for c in cluster.status_patches[-1]["conditions"] if c["type"] == "CapacityPlanned")
    assert planned["reason"] == "InvalidName" and "DNS-1035" in planned["message"]


def test_too_big_model_creates_nothing_then_recovers(events: list[tuple[str, str, str]]) -> None:
    cluster = FakeCluster(TOO_BIG)
    reconcile(cluster, events)
    assert cluster.objects == {}
    ((kind, reason, message),) = events
    assert (kind, reason) == ("Warning", "InsufficientGPUMemory")
    assert "short by 60.42 GiB" in message
    planned = cluster.status_patches[-1]["conditions"][0]
    assert (planned["type"], planned["status"], planned["reason"]) == (
        "CapacityPlanned",
        "False",
        "InsufficientGPUMemory",
    )
    # The same failure again posts no second event.
    reconcile(cluster, events)
    assert len(events) == 1

    assert cluster.isvc is not None
    cluster.isvc["spec"]["resources"]["gpusPerReplica"] = 4
    cluster.isvc["metadata"]["generation"] = 2
    reconcile(cluster, events)
    deployment = cluster.objects[("Deployment", NAME)]
    assert (
        deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        == "4"
    )
    assert cluster.status_patches[-1]["conditions"][0]["status"] == "True"


def test_a_replica_larger_than_any_node_is_refused_naming_the_node_size(
    events: list[tuple[str, str, str]],
) -> None:
    """70B on 16 GPUs per replica where the A100 nodes have 8: CapacityPlanned=False, reason
    ReplicaExceedsNode, nothing created; on nodes of 16 it is created."""
    spec = copy.deepcopy(TOO_BIG)
    spec["resources"]["gpusPerReplica"] = 16
    cluster = FakeCluster(spec)
    cluster.gpu_node_size = 8
    reconcile(cluster, events)
    assert cluster.objects == {}
    planned = cluster.status_patches[-1]["conditions"][0]
    assert (planned["type"], planned["status"], planned["reason"]) == (
        "CapacityPlanned",
        "False",
        "ReplicaExceedsNode",
    )
    assert planned["message"] == (
        "a replica needs 16 GPUs on one node (tensor parallel 16) but the largest a100-80gb "
        "(NVIDIA-A100-SXM4-80GB) node has 8 allocatable: lower resources.gpusPerReplica; replicas "
        "spanning nodes are not supported yet"
    )
    assert [(t, r) for t, r, _ in events] == [("Warning", "ReplicaExceedsNode")]
    cluster.gpu_node_size = 16
    cluster.isvc["metadata"]["generation"] = 2
    reconcile(cluster, events)
    assert ("Deployment", NAME) in cluster.objects


def test_an_impossible_edit_keeps_the_running_deployment(events: list[tuple[str, str, str]]) -> None:
    cluster = FakeCluster(LLAMA)
    reconcile(cluster, events)
    before = copy.deepcopy(cluster.objects[("Deployment", NAME)])
    assert cluster.isvc is not None
    cluster.isvc["spec"] = copy.deepcopy(TOO_BIG)
    reconcile(cluster, events)
    assert cluster.objects[("Deployment", NAME)] == before
    # status.capacity still describes what runs (--max-num-seqs 112), beside CapacityPlanned=False.
    assert cluster.status_patches[-1]["capacity"]["maxNumSeqs"] == 112
    planned = next(c for c in cluster.status_patches[-1]["conditions"] if c["type"] == "CapacityPlanned")
    assert (planned["status"], planned["reason"]) == ("False", "InsufficientGPUMemory")


def test_unknown_model_is_a_status_error_not_a_guess(events: list[tuple[str, str, str]]) -> None:
    cluster = FakeCluster({**LLAMA, "model": {"name": "my-finetune", "maxModelLen": 4096}})
    reconcile(cluster, events)
    assert cluster.objects == {}
    planned = cluster.status_patches[-1]["conditions"][0]
    assert planned["reason"] == "UnknownModel"
    assert "model.layers" in planned["message"]


def test_spec_edit_updates_the_deployment(events: list[tuple[str, str, str]]) -> None:
    cluster = FakeCluster(LLAMA)
    reconcile(cluster, events)
    assert cluster.isvc is not None
    cluster.isvc["spec"]["model"]["maxModelLen"] = 8192
    events.clear()
    reconcile(cluster, events)
    args = cluster.objects[("Deployment", NAME)]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "56"
    assert ("Normal", "Updated", f"updated Deployment {NAMESPACE}/{NAME}") in events


def test_deleted_resource_is_left_to_garbage_collection_and_its_lock_dropped(
    posted: list[tuple[str, str, str]],
) -> None:
    cluster = FakeCluster(LLAMA)
    memo = OperatorMemo(cluster=cluster)
    handlers.reconcile_service(memo, NAMESPACE, NAME, logging.getLogger("test"))
    assert len(cluster.objects) == 3 and len(memo.locks) == 1
    cluster.isvc, cluster.objects, cluster.status_patches = None, {}, []
    posted.clear()
    handlers.reconcile_service(memo, NAMESPACE, NAME, logging.getLogger("test"))
    assert cluster.objects == {} and cluster.status_patches == [] and posted == []
    handlers.on_deleted(namespace=NAMESPACE, name=NAME, memo=memo)
    assert len(memo.locks) == 0


@pytest.mark.parametrize("implementation", [Cluster, FakeCluster])
def test_the_real_and_the_fake_cluster_implement_the_seam(implementation: type) -> None:
    """Every call reconcile and the autoscaler make (ClusterAPI), with the same signature."""
    for name, member in vars(ClusterAPI).items():
        if callable(member) and not name.startswith("_"):
            actual = inspect.signature(getattr(implementation, name), eval_str=True)
            assert actual == inspect.signature(member, eval_str=True), name


@pytest.mark.parametrize(("current", "expected"), [(None, 2), (1, 2), (3, 3), (9, 5)])
def test_autoscaled_replicas_stay_within_bounds(current: int | None, expected: int) -> None:
    spec = parse_spec({**LLAMA, "autoscaling": {"minReplicas": 2, "maxReplicas": 5}})
    deployment = None if current is None else {"spec": {"replicas": current}}
    assert desired_replicas(spec, deployment) == expected


def test_the_operator_does_not_import_the_server_stack() -> None:
    """DESIGN.md: the operator image must not need torch (nor the rest of conveyor[server])."""
    import subprocess
    import sys

    code = (
        "import sys, conveyor.operator.run, conveyor.operator.handlers, conveyor.operator.plan, "
        "conveyor.operator.crd; print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'transformers', 'triton', 'numpy', 'fastapi', 'uvicorn'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONSAFEPATH": "1"}
    )
    assert result.stdout.strip() == "[]"


ROUTED = {**LLAMA, "router": {"enabled": True}}
ROUTER_OBJECTS = [
    ("ServiceAccount", "llama-router"),
    ("Role", "llama-router"),
    ("RoleBinding", "llama-router"),
    ("Deployment", "llama-router"),
    ("Service", "llama-router"),
    ("ServiceMonitor", "llama-router"),
    ("InferencePool", "llama"),
]


def _ready(cluster: FakeCluster, name: str) -> None:
    deployment = cluster.objects[("Deployment", name)]
    deployment["metadata"]["generation"] = 1
    deployment["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}


def test_router_children_come_and_go_with_router_enabled(events: list[tuple[str, str, str]]) -> None:
    cluster = FakeCluster(ROUTED, service_monitor=True, inference_pool=True)
    reconcile(cluster, events)
    assert set(ROUTER_OBJECTS) <= set(cluster.objects)
    _ready(cluster, NAME)
    reconcile(cluster, events)
    ready = next(c for c in cluster.status_patches[-1]["conditions"] if c["type"] == "Ready")
    assert (ready["reason"], cluster.status_patches[-1]["url"]) == ("RouterNotReady", None)
    _ready(cluster, "llama-router")
    reconcile(cluster, events)
    assert cluster.status_patches[-1]["url"] == f"http://llama-router.{NAMESPACE}.svc.cluster.local"

    assert cluster.isvc is not None
    cluster.isvc["spec"]["router"]["enabled"] = False
    events.clear()
    reconcile(cluster, events)
    assert not set(ROUTER_OBJECTS) & set(cluster.objects)
    assert sorted(cluster.objects) == [
        ("Deployment", NAME),
        ("PodDisruptionBudget", NAME),
        ("Service", NAME),
        ("ServiceMonitor", NAME),
    ]
    deleted = [m for t, r, m in events if r == "Deleted"]
    # The ServiceAccount goes last: while it exists, a later reconcile finishes the job.
    assert deleted[-1] == f"deleted ServiceAccount {NAMESPACE}/llama-router" and len(deleted) == 7
    assert cluster.status_patches[-1]["url"] == f"http://{NAME}.{NAMESPACE}.svc.cluster.local"
    events.clear()
    reconcile(cluster, events)
    assert events == []


def test_a_new_role_is_stored_before_its_binding_is_checked(events: list[tuple[str, str, str]]) -> None:
    """RBAC checks a RoleBinding against the Role it names: a dry-run Role is not there to be read."""
    cluster = FakeCluster(ROUTED)
    cluster.refuse["RoleBinding"] = (403, "user cannot bind")
    assert reconcile(cluster, events).failure is not None
    assert list(cluster.objects) == [("Role", "llama-router")]  # grants nothing until bound
    assert ("Role", "llama-router", False) in cluster.applied
    assert ("ServiceAccount", "llama-router", True) in cluster.applied
    cluster.refuse.clear()
    cluster.applied.clear()
    reconcile(cluster, events)
    assert ("Role", "llama-router", True) in cluster.applied  # existing now: checked as a dry run
    assert ("Normal", "Created", f"created Role {NAMESPACE}/llama-router") in events


def test_a_name_another_controller_owns_is_not_taken_over(events: list[tuple[str, str, str]]) -> None:
    """The router Deployment of `llama` and the server Deployment of an InferenceService named
    `llama-router` share a name; the first to exist keeps it."""
    cluster = FakeCluster(ROUTED)
    other = {
        "apiVersion": "serving.conveyor.dev/v1alpha1",
        "kind": "InferenceService",
        "name": "llama-router",
    }
    cluster.objects[("Deployment", "llama-router")] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "llama-router",
            "namespace": NAMESPACE,
            "ownerReferences": [{**other, "uid": "uid-2", "controller": True}],
        },
        "spec": {"replicas": 1},
    }
    assert reconcile(cluster, events).failure is not None
    assert set(cluster.objects) == {("Deployment", "llama-router")}
    assert cluster.objects[("Deployment", "llama-router")]["metadata"]["ownerReferences"][0]["uid"] == "uid-2"
    ready = next(c for c in cluster.status_patches[-1]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NameConflict")
    assert ready["message"] == (
        f"Deployment llama-router: {NAMESPACE}/llama-router already exists, controlled by "
        "InferenceService llama-router: rename one of them"
    )


def test_a_tensor_parallel_size_the_server_would_refuse_is_a_condition_not_a_crash_loop(
    events: list[tuple[str, str, str]],
) -> None:
    """Llama-3-8B has 32 attention heads: 3 GPUs at tensor parallel 3 cannot split them, and the server
    would exit at start on every pod; the operator says so instead of creating them."""
    cluster = FakeCluster({**LLAMA, "resources": {"gpuType": "a100-80gb", "gpusPerReplica": 3}})
    reconcile(cluster, events)
    assert cluster.objects == {}
    planned = cluster.status_patches[-1]["conditions"][0]
    assert (planned["status"], planned["reason"]) == ("False", "InvalidTensorParallelSize")
    assert planned["message"] == "tensorParallelSize 3 does not divide llama-3-8b's 32 attention heads"


@pytest.mark.parametrize(
    ("spec", "reason", "message"),
    [
        # argparse's --help prints and exits: it must be refused, not end the operator.
        (
            {**LLAMA, "engine": {"extraArgs": ["--help"]}},
            "InvalidSpec",
            "-h/--help prints the help and exits: it is not an argument to serve with",
        ),
        # Accepted flag by flag, refused together by the server's config (4096-token prompts, 2048/step).
        (
            {**LLAMA, "engine": {"extraArgs": ["--scheduling", "static"]}},
            "ServerArgsRejected",
            "without chunked prefill a prompt must fit one step",
        ),
        (
            {**LLAMA, "engine": {"enableChunkedPrefill": False}},
            "ServerArgsRejected",
            "--max-num-batched-tokens 2048 is less than --max-model-len 4096",
        ),
        # One rank per GPU: four GPUs at TP 2 would be planned for memory two ranks never use.
        (
            {**LLAMA, "resources": {"gpuType": "a100-80gb", "gpusPerReplica": 4, "tensorParallelSize": 2}},
            "InvalidTensorParallelSize",
            "tensorParallelSize 2 with gpusPerReplica 4",
        ),
        # The catalog knows gpt-oss's model type; the native decoder does not run it.
        (
            {
                "model": {"name": "openai/gpt-oss-20b", "maxModelLen": 4096},
                "resources": {"gpuType": "a100-80gb"},
                "engine": {"extraArgs": ["--model-impl", "native"]},
            },
            "UnsupportedArchitecture",
            "gpt-oss-20b: model type 'gpt_oss' is not supported natively (--model-impl native runs gemma,",
        ),
    ],
)
def test_specs_whose_pods_could_not_start_are_conditions(
    events: list[tuple[str, str, str]], spec: dict[str, Any], reason: str, message: str
) -> None:
    cluster = FakeCluster(spec)
    reconcile(cluster, events)
    assert cluster.objects == {}
    planned = cluster.status_patches[-1]["conditions"][0]
    assert (planned["status"], planned["reason"]) == ("False", reason)
    assert message in planned["message"]


def test_a_permission_lost_while_running_is_a_condition_and_one_event(
    events: list[tuple[str, str, str]], posted: list[tuple[str, str, str]]
) -> None:
    """A 403 outside an apply (here reading the PodDisruptionBudget) turns Ready False with reason
    Forbidden and the API server's message, once, and kopf retries (ReconcileFailed)."""
    from kubernetes.client.exceptions import ApiException

    cluster = FakeCluster(LLAMA)
    reconcile(cluster, events)
    message = (
        'poddisruptionbudgets.policy "llama" is forbidden: User "system:serviceaccount:ops:conveyor" '
        'cannot get resource "poddisruptionbudgets" in API group "policy" in the namespace "serving"'
    )
    forbidden = ApiException(status=403, reason="Forbidden")
    forbidden.body = json.dumps({"kind": "Status", "message": message})
    real_get = cluster.get

    def get(api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if kind == "PodDisruptionBudget":
            raise forbidden
        return real_get(api_version, kind, namespace, name)

    cluster.get = get  # type: ignore[method-assign]
    memo = OperatorMemo(cluster=cluster)
    for _ in range(2):
        with pytest.raises(handlers.ReconcileFailed, match="cannot get resource"):
            handlers.reconcile_service(memo, NAMESPACE, NAME, logging.getLogger("test"))
    assert posted == [("Warning", "Forbidden", message)]
    assert cluster.isvc is not None
    conditions = {c["type"]: c for c in cluster.isvc["status"]["conditions"]}
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("False", "Forbidden")
    assert conditions["Ready"]["message"] == message
    assert conditions["CapacityPlanned"]["status"] == "True"  # the other conditions stay as they were
    # The permission back: the next reconcile writes Ready from the Deployment again.
    cluster.get = real_get  # type: ignore[method-assign]
    handlers.reconcile_service(memo, NAMESPACE, NAME, logging.getLogger("test"))
    ready = next(c for c in cluster.isvc["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] != "Forbidden"


def test_the_writes_before_an_api_error_are_still_told(posted: list[tuple[str, str, str]]) -> None:
    """A reconcile stopped part-way by an API error (here listing pods) returns the Events of the
    children it created; the handler posts them, then lets kopf see the error."""
    from kubernetes.client.exceptions import ApiException

    cluster = FakeCluster(LLAMA)
    cluster.pending = (1, "no nodes")

    def unschedulable(namespace: str, name: str) -> tuple[int, str] | None:
        raise ApiException(status=500, reason="Internal Server Error")

    cluster.unschedulable = unschedulable  # type: ignore[method-assign]
    with pytest.raises(ApiException):
        handlers.reconcile_service(OperatorMemo(cluster=cluster), NAMESPACE, NAME, logging.getLogger("test"))
    assert [r for _, r, _ in posted] == ["Created"] * 3
    assert cluster.status_patches == []


def test_an_autoscaling_step_without_prometheus_holds_replicas_and_says_so_once(
    events: list[tuple[str, str, str]], posted: list[tuple[str, str, str]]
) -> None:
    """Without --prometheus-url the builtin autoscaler never guesses: MetricsAvailable=False, one
    Warning, replicas held; the history stays in the resource's memo between steps."""
    cluster = FakeCluster({**LLAMA, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}})
    reconcile(cluster, events)
    cluster.ready_pods = [f"{NAME}-0"]
    memo = OperatorMemo(cluster=cluster)
    for step in range(2):
        handlers.autoscale(memo, NAMESPACE, NAME, logging.getLogger("test"), 1_000.0 + 15 * step)
    assert posted == [
        (
            "Warning",
            "MetricsUnavailable",
            "holding 1 replicas: prometheus: the operator runs without --prometheus-url",
        )
    ]
    assert cluster.isvc is not None
    conditions = {c["type"]: c for c in cluster.isvc["status"]["conditions"]}
    assert (conditions["MetricsAvailable"]["status"], conditions["MetricsAvailable"]["reason"]) == (
        "False",
        "MetricsUnavailable",
    )
    assert cluster.objects[("Deployment", NAME)]["spec"]["replicas"] == 1
    assert memo.metrics_available is False and memo.autoscaler_history is not None


def test_the_adapters_timer_reports_a_lost_permission_on_its_condition(
    events: list[tuple[str, str, str]], posted: list[tuple[str, str, str]]
) -> None:
    """A 403 in the adapters' status step (here listing the pods) turns AdaptersReady False with reason
    Forbidden and the API server's message, with one Warning Event, as the autoscaler's timer does for
    Scaling; the handler itself does not raise."""
    from kubernetes.client.exceptions import ApiException

    lora = {"adapters": [{"name": "sql", "uri": "hf://org/sql-lora"}]}
    cluster = FakeCluster({**LLAMA, "model": {**LLAMA["model"], "lora": lora}})
    reconcile(cluster, events)
    message = 'pods is forbidden: User "system:serviceaccount:ops:conveyor" cannot list resource "pods"'
    forbidden = ApiException(status=403, reason="Forbidden")
    forbidden.body = json.dumps({"kind": "Status", "message": message})

    def pods(namespace: str, name: str, selector: str | None = None) -> tuple[list[str], list[str]]:
        raise forbidden

    cluster.pods = pods  # type: ignore[method-assign]
    memo = OperatorMemo(cluster=cluster)
    for _ in range(2):
        handlers.on_adapter_timer(namespace=NAMESPACE, name=NAME, memo=memo, logger=logging.getLogger("test"))
    assert posted == [("Warning", "Forbidden", message)]
    assert cluster.isvc is not None
    adapters_ready = next(c for c in cluster.isvc["status"]["conditions"] if c["type"] == "AdaptersReady")
    assert (adapters_ready["status"], adapters_ready["reason"], adapters_ready["message"]) == (
        "False",
        "Forbidden",
        message,
    )
