"""`spec.router` against the real API server: the router's Deployment, Service, ServiceAccount, Role and
RoleBinding are accepted, the real InferencePool CRD accepts the InferencePool, and turning the router
off removes them all.

The operator runs with the Helm chart's ClusterRole (a service-account token, not the admin
certificate), so RBAC's escalation check of the router's Role and RoleBinding is the real one. kwok
runs the pods (no containers start).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.operator.render import Owner, router_args
from conveyor.operator.spec import parse_spec
from tests.k8s.cluster import LocalCluster, go_module_file
from tests.k8s.operator_env import (
    CRD_PATH,
    ISVC_LABEL,
    RESTRICTED,
    SERVICE_MONITOR_CRD,
    Env,
    Operator,
    account_kubeconfig,
    container_args,
    isvc,
)
from tests.k8s.test_chart import rendered

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

INFERENCE_EXTENSION_MODULE = "sigs.k8s.io/gateway-api-inference-extension@v1.5.0"
INFERENCE_POOL_CRD = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
ROUTER_LABEL = "serving.conveyor.dev/router"
OPERATOR_ACCOUNT = "conveyor-operator"


def inference_pool_crd() -> Path:
    """The extension's InferencePool CRD from its Go module (the Go module proxy serves it; cached)."""
    return go_module_file(INFERENCE_EXTENSION_MODULE, INFERENCE_POOL_CRD)


def operator_kubeconfig(k8s: LocalCluster, namespace: str, tmp_path: Path) -> tuple[Path, str]:
    """A kubeconfig for a service account bound to the chart's ClusterRole; (path, ClusterRole name)."""
    (cluster_role,) = rendered(tmp_path, "--show-only", "templates/rbac.yaml")["ClusterRole"]
    role_name = f"conveyor-operator-{namespace}"
    cluster_role["metadata"] = {"name": role_name}
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": role_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_ACCOUNT, "namespace": namespace}],
    }
    k8s.kubectl("-n", namespace, "create", "serviceaccount", OPERATOR_ACCOUNT)
    for obj in (cluster_role, binding):
        k8s.kubectl("apply", "-f", "-", input=json.dumps(obj))
    return account_kubeconfig(k8s, namespace, OPERATOR_ACCOUNT, tmp_path / "operator.kubeconfig"), role_name


@pytest.fixture(scope="module")
def env(k8s: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    k8s.kubectl("apply", "--server-side", "-f", str(CRD_PATH))
    k8s.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(SERVICE_MONITOR_CRD))
    k8s.kubectl("apply", "--server-side", "-f", str(inference_pool_crd()))
    for crd in (
        "inferenceservices.serving.conveyor.dev",
        "servicemonitors.monitoring.coreos.com",
        "inferencepools.inference.networking.k8s.io",
    ):
        k8s.wait_established(crd)
    namespace = k8s.create_namespace("router", labels=RESTRICTED)
    tmp_path = tmp_path_factory.mktemp("router")
    kubeconfig, role_name = operator_kubeconfig(k8s, namespace, tmp_path)
    operator = Operator(k8s, namespace, tmp_path / "operator.log", kubeconfig=kubeconfig)
    try:
        yield Env(k8s, namespace, operator)
    finally:
        operator.stop()
        k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        for kind in ("clusterrolebinding", "clusterrole"):
            k8s.kubectl("delete", kind, role_name, "--ignore-not-found", check=False)
        k8s.kubectl(
            "delete", "crd", "inferencepools.inference.networking.k8s.io", "--wait=false", check=False
        )


ROUTER_CHILDREN = ["serviceaccount", "role", "rolebinding", "deployment", "service", "servicemonitor"]


def test_router_children_are_accepted_then_removed_when_disabled(env: Env) -> None:
    manifest = isvc(
        "routed",
        router={"enabled": True, "policy": "least-load", "weights": {"kv": 0.5}, "queueTimeoutSeconds": 30},
    )
    env.apply(manifest)
    try:
        resource = env.wait_ready("routed")
        ns = env.namespace
        # The namespace enforces the `restricted` Pod Security profile: router pods are admitted.
        env.eventually(lambda: env.items("pods", f"{ROUTER_LABEL}=routed"), "the router's pods")
        assert resource["status"]["url"] == f"http://routed-router.{ns}.svc.cluster.local"
        for kind in ROUTER_CHILDREN:
            obj = env.get(kind, "routed-router")
            assert obj is not None, kind
            assert obj["metadata"]["labels"][ROUTER_LABEL] == "routed", kind
            (ref,) = obj["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["name"], ref["uid"]) == (
                "InferenceService",
                "routed",
                resource["metadata"]["uid"],
            )

        deployment = env.get("deployment", "routed-router")
        assert deployment is not None
        owner = Owner("routed", ns, resource["metadata"]["uid"])
        assert container_args(deployment) == router_args(owner, parse_spec(manifest["spec"]))
        assert deployment["spec"]["selector"] == {"matchLabels": {ROUTER_LABEL: "routed"}}
        # The router's pods run, Ready, and are not the server's.
        router_pods = env.items("pods", f"{ROUTER_LABEL}=routed")
        assert len(router_pods) == 1 and router_pods[0]["spec"]["serviceAccountName"] == "routed-router"
        assert all(p["metadata"]["name"].startswith("routed-router-") for p in router_pods)
        assert [p["metadata"]["labels"].get(ISVC_LABEL) for p in router_pods] == [None]
        server_pods = env.pods("routed")
        assert len(server_pods) == 1 and ROUTER_LABEL not in server_pods[0]["metadata"]["labels"]
        assert resource["status"]["readyReplicas"] == 1

        # The router reads the server Service's EndpointSlices, port `http`, with its own account.
        router_account = f"system:serviceaccount:{ns}:routed-router"
        slices = env.eventually(
            lambda: (
                env.kubectl(
                    "get",
                    "endpointslices",
                    "-l",
                    "kubernetes.io/service-name=routed",
                    "-o",
                    "json",
                    f"--as={router_account}",
                ).stdout
            ),
            "the router's account to list the EndpointSlices",
        )
        (endpoint_slice,) = json.loads(slices)["items"]
        assert [p["name"] for p in endpoint_slice["ports"]] == ["http"]
        assert [p["port"] for p in endpoint_slice["ports"]] == [8000]
        denied = env.kubectl("auth", "can-i", "list", "secrets", f"--as={router_account}", check=False)
        assert denied.stdout.strip() == "no"

        # The real InferencePool CRD accepted the pool of the server pods.
        pool = env.eventually(lambda: env.get("inferencepool", "routed"), "the InferencePool")
        assert pool["spec"]["selector"] == {"matchLabels": {ISVC_LABEL: "routed"}}
        assert pool["spec"]["targetPorts"] == [{"number": 8000}]
        assert pool["spec"]["endpointPickerRef"] == {
            "group": "",
            "kind": "Service",
            "name": "routed-epp",
            "port": {"number": 9002},
            "failureMode": "FailOpen",
        }
        copy = {k: pool[k] for k in ("apiVersion", "kind", "spec")}
        copy["metadata"] = {"name": "routed-copy"}
        env.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(copy))

        # A deleted Role comes back (drift), and the router account can read again.
        env.kubectl("delete", "role", "routed-router")
        env.eventually(lambda: env.get("role", "routed-router"), "the Role to be restored")

        env.kubectl(
            "patch",
            "inferenceservice",
            "routed",
            "--type=merge",
            "-p",
            '{"spec":{"router":{"enabled":false}}}',
        )
        for kind in ROUTER_CHILDREN:
            env.eventually(lambda kind=kind: env.get(kind, "routed-router") is None, f"{kind} deleted")
        env.eventually(lambda: env.get("inferencepool", "routed") is None, "the InferencePool deleted")
        env.eventually(
            lambda: (
                (env.get("inferenceservice", "routed") or {}).get("status", {}).get("url")
                == f"http://routed.{ns}.svc.cluster.local"
            ),
            "status.url back on the server Service",
        )
        assert env.get("deployment", "routed") is not None
        deleted = [e["message"] for e in env.events("routed") if e["reason"] == "Deleted"]
        assert f"deleted ServiceAccount {ns}/routed-router" in deleted, deleted
    finally:
        env.delete("routed")


def test_a_name_too_long_for_the_router_service_is_refused(env: Env) -> None:
    """The router's Service is <name>-router, a DNS-1035 label: at most 63 characters."""
    for name, accepted in (("r" * 56, True), ("r" * 57, False)):
        result = env.kubectl(
            "apply",
            "--dry-run=server",
            "-f",
            "-",
            input=json.dumps(isvc(name, router={"enabled": True})),
            check=False,
        )
        assert (result.returncode == 0) is accepted, result.stderr
        if not accepted:
            assert "with router.enabled metadata.name must be at most 56 characters" in result.stderr
    result = env.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=json.dumps(isvc("r" * 57)), check=False
    )
    assert result.returncode == 0, result.stderr  # without the router the name is fine


def test_the_routers_endpointslice_watch_follows_scaling(env: Env, tmp_path: Path, monkeypatch) -> None:
    """The router's discovery (`EndpointSliceWatch`, as `conveyor router --service` runs it) with the
    router's own service account: the replica URLs follow the server Deployment from 1 to 3 to 1 pods
    (kwok gives the pods IPs; the control plane's EndpointSlice controller lists them)."""
    from conveyor.server.router.endpoints import EndpointSliceWatch

    env.apply(isvc("watched", replicas=1, router={"enabled": True}))
    try:
        env.wait_ready("watched")
        env.eventually(lambda: env.get("serviceaccount", "watched-router"), "the router's account")
        env.eventually(lambda: env.get("rolebinding", "watched-router"), "the router's RoleBinding")
        kubeconfig = account_kubeconfig(
            env.cluster, env.namespace, "watched-router", tmp_path / "router.kubeconfig"
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        seen: list[list[str]] = []
        watch = EndpointSliceWatch(env.namespace, "watched", "http", seen.append)
        watch.start()
        try:

            def urls(count: int) -> list[str] | None:
                ips = sorted(p["status"].get("podIP", "") for p in env.pods("watched"))
                want = sorted(f"http://{ip}:8000" for ip in ips if ip)
                return want if len(want) == count and seen and seen[-1] == want else None

            env.eventually(lambda: urls(1), "one replica URL")
            for replicas in (3, 1):
                env.kubectl(
                    "patch",
                    "inferenceservice",
                    "watched",
                    "--type=merge",
                    "-p",
                    json.dumps({"spec": {"replicas": replicas}}),
                )
                env.eventually(lambda n=replicas: urls(n), f"{replicas} replica URLs", timeout=90)
        finally:
            watch.stop()
    finally:
        env.delete("watched")
