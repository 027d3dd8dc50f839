"""The Helm chart (charts/conveyor): `helm lint`, `helm template`, and an install on the local cluster
whose RBAC covers every call the operator makes.

helm comes with the test-bed binaries (hack/k8s-tools/build.sh), hence the `k8s` marker.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from conveyor.operator.render import ROUTER_RULES
from conveyor.operator.run import build_parser
from tests.k8s.cluster import LocalCluster, ensure_binaries

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "conveyor"
CRD_PATH = REPO / "crds" / "serving.conveyor.dev_inferenceservices.yaml"


def helm(tmp_path: Path, *args: str, kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run helm offline with a scratch HOME (no repositories, no cache outside tmp_path)."""
    env = {
        "HOME": str(tmp_path),
        "PATH": os.environ.get("PATH", ""),
        "HELM_CACHE_HOME": str(tmp_path / "cache"),
        "HELM_CONFIG_HOME": str(tmp_path / "config"),
        "HELM_DATA_HOME": str(tmp_path / "data"),
    }
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    result = subprocess.run(
        [str(ensure_binaries() / "helm"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def rendered(tmp_path: Path, *args: str) -> dict[str, list[dict[str, Any]]]:
    """`helm template` output grouped by kind."""
    out = helm(tmp_path, "template", "conveyor", str(CHART), "--namespace", "conveyor-system", *args).stdout
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in yaml.safe_load_all(out):
        if doc:
            by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def operator_args(objects: dict[str, list[dict[str, Any]]]) -> list[str]:
    (deployment,) = objects["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["conveyor"]
    return container["args"]


def test_helm_lint(tmp_path: Path) -> None:
    result = helm(tmp_path, "lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in result.stdout


def test_chart_crd_is_the_generated_crd() -> None:
    assert (CHART / "crds" / CRD_PATH.name).read_text() == CRD_PATH.read_text()


def test_template_defaults(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "--include-crds")
    assert {
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
    } <= set(objects)
    (crd,) = objects["CustomResourceDefinition"]
    assert crd == yaml.safe_load(CRD_PATH.read_text())
    args = operator_args(objects)
    assert args[0] == "operator"
    assert "--standalone" in args and "--all-namespaces" in args
    assert "--liveness=http://0.0.0.0:8080/healthz" in args
    assert "--autoscale-interval=15" in args and "--metrics-port=8081" in args
    assert not any(a.startswith("--prometheus-url") for a in args)
    (deployment,) = objects["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "conveyor"
    assert pod["containers"][0]["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    (binding,) = objects["ClusterRoleBinding"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "conveyor", "namespace": "conveyor-system"}
    ]


def test_template_namespaces_and_peering(tmp_path: Path) -> None:
    args = operator_args(
        rendered(tmp_path, "--set", "watchNamespaces={llm,batch}", "--set", "peering=conveyor")
    )
    assert "--namespace=llm" in args and "--namespace=batch" in args
    assert "--all-namespaces" not in args
    assert "--peering=conveyor" in args and "--standalone" not in args
    args = operator_args(rendered(tmp_path, "--set", "autoscaler.prometheusUrl=http://prom:9090"))
    assert "--prometheus-url=http://prom:9090" in args
    args = operator_args(rendered(tmp_path, "--set", "serviceMonitorLabels.release=kube-prometheus-stack"))
    assert "--service-monitor-label=release=kube-prometheus-stack" in args
    assert build_parser().parse_args(args[1:]).service_monitor_label == [("release", "kube-prometheus-stack")]


# Every (verb, group, resource) the operator and kopf use. Checked with SubjectAccessReviews, which need
# no discovery, so permissions for APIs not installed here (ServiceMonitor) are checked as well.
_CHILDREN = [
    ("apps", "deployments"),
    ("", "services"),
    ("policy", "poddisruptionbudgets"),
    # spec.router
    ("", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "roles"),
    ("rbac.authorization.k8s.io", "rolebindings"),
    ("inference.networking.k8s.io", "inferencepools"),
]
OPERATOR_PERMISSIONS: list[tuple[str, str, str]] = [
    *[(verb, "serving.conveyor.dev", "inferenceservices") for verb in ("get", "list", "watch", "patch")],
    ("patch", "serving.conveyor.dev", "inferenceservices/status"),
    *[
        (verb, group, resource)
        for group, resource in [*_CHILDREN, ("monitoring.coreos.com", "servicemonitors")]
        for verb in ("get", "list", "watch", "create", "patch")
    ],
    # The router's children are deleted when router.enabled turns false.
    *[
        ("delete", group, resource)
        for group, resource in [
            ("apps", "deployments"),
            ("", "services"),
            ("", "serviceaccounts"),
            ("rbac.authorization.k8s.io", "roles"),
            ("rbac.authorization.k8s.io", "rolebindings"),
            ("monitoring.coreos.com", "servicemonitors"),
            ("inference.networking.k8s.io", "inferencepools"),
        ]
    ],
    # What the router's Role grants: RBAC refuses the Role unless the operator holds it too.
    *[
        (verb, group, resource)
        for rule in ROUTER_RULES
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    ],
    *[
        (verb, group, resource)
        for group, resource in [("autoscaling", "horizontalpodautoscalers"), ("keda.sh", "scaledobjects")]
        for verb in ("get", "create", "patch", "delete")
    ],
    ("list", "", "pods"),
    ("watch", "", "pods"),
    ("list", "", "nodes"),
    ("list", "serving.conveyor.dev", "inferenceservices"),
    ("watch", "apiextensions.k8s.io", "customresourcedefinitions"),
    ("patch", "apps", "deployments/scale"),
    ("create", "", "events"),
    ("list", "apiextensions.k8s.io", "customresourcedefinitions"),
    ("watch", "", "namespaces"),
]


def test_helm_install_rbac_covers_the_operator(k8s: LocalCluster, tmp_path: Path) -> None:
    namespace = k8s.create_namespace("chart")
    release = "conveyor-rbac"
    helm(
        tmp_path,
        "install",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--wait=false",
        kubeconfig=k8s.kubeconfig,
    )
    try:
        k8s.kubectl("wait", "--for=condition=Established", "crd/inferenceservices.serving.conveyor.dev")
        service_account = f"system:serviceaccount:{namespace}:{release}"
        authorization = client.AuthorizationV1Api(k8s.api_client)
        denied = []
        for verb, group, resource in OPERATOR_PERMISSIONS:
            name, _, subresource = resource.partition("/")
            review = client.V1SubjectAccessReview(
                spec=client.V1SubjectAccessReviewSpec(
                    user=service_account,
                    groups=["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
                    resource_attributes=client.V1ResourceAttributes(
                        verb=verb,
                        group=group,
                        resource=name,
                        subresource=subresource or None,
                        namespace="default",
                    ),
                )
            )
            if not authorization.create_subject_access_review(review).status.allowed:
                denied.append(f"{verb} {resource}.{group}")
        assert denied == []
        deployment = k8s.kubectl("get", "deployment", release, "-n", namespace, "-o", "name").stdout.strip()
        assert deployment == f"deployment.apps/{release}"
    finally:
        helm(tmp_path, "uninstall", release, "--namespace", namespace, kubeconfig=k8s.kubeconfig)
        k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
