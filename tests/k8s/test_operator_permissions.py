"""The operator under the real API server's RBAC: an identity missing a permission is refused at start,
in seconds and in words; a permission taken away while it runs becomes a condition and an event on the
resource it stopped, and the operator keeps serving the others.

The identities are service accounts bound to ClusterRoles built from operator/permissions.py, the
list the chart's ClusterRole is generated from (tests/unit/test_permissions.py checks the chart)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conveyor.operator.permissions import RULES
from tests.k8s.cluster import LocalCluster
from tests.k8s.operator_env import CRD_PATH, Env, Operator, SilentServer, account_kubeconfig, isvc

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def crd(k8s: LocalCluster) -> None:
    k8s.kubectl("apply", "--server-side", "-f", str(CRD_PATH))
    k8s.wait_established("inferenceservices.serving.conveyor.dev")


def _rules(
    without: set[tuple[str, str]] = frozenset(), skip_resources: set[str] = frozenset()
) -> list[dict[str, Any]]:
    """The operator's rules as RBAC objects, less the (verb, resource) pairs in `without` and every
    rule on `skip_resources`."""
    rules = []
    for rule in RULES:
        for resource in rule.resources:
            if resource in skip_resources:
                continue
            verbs = [v for v in rule.verbs if (v, resource) not in without]
            if verbs:
                rules.append({"apiGroups": list(rule.api_groups), "resources": [resource], "verbs": verbs})
    return rules


def _apply(k8s: LocalCluster, *objects: dict[str, Any]) -> None:
    k8s.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
    )


def _identity(k8s: LocalCluster, namespace: str, rules: list[dict[str, Any]], tmp_path: Path) -> Path:
    """A service account in `namespace` bound cluster-wide to `rules`; its kubeconfig."""
    name = f"{namespace}-operator"
    _apply(
        k8s,
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "operator", "namespace": namespace},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": namespace}],
        },
    )
    return account_kubeconfig(k8s, namespace, "operator", tmp_path / f"{name}.kubeconfig")


def _exits(operator: Operator, within: float) -> tuple[int, str]:
    """(exit status, log) of an operator that must exit within `within` seconds."""
    try:
        code = operator.process.wait(timeout=within)
    except subprocess.TimeoutExpired:
        operator.stop()
        pytest.fail(f"the operator still ran after {within:.0f} s:\n{operator.log_tail()}")
    operator.stop()
    return code, operator.log_path.read_text()


def test_a_hung_api_server_fails_the_start_in_bounded_time(k8s: LocalCluster, tmp_path: Path) -> None:
    hung = SilentServer()
    config = json.loads(k8s.kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{hung.port}"
    kubeconfig = tmp_path / "hung.kubeconfig"
    kubeconfig.write_text(json.dumps(config))
    try:
        operator = Operator(k8s, "default", tmp_path / "operator.log", kubeconfig=kubeconfig)
        code, log = _exits(operator, 60)
    finally:
        hung.close()
    assert code == 1, log
    assert "cannot reach the Kubernetes API server to check the operator's permissions" in log, log
    # One line, not a WARNING per retry of each of the checks.
    assert "Traceback" not in log and "Retrying" not in log and len(log.splitlines()) <= 2, log


def test_a_metrics_port_in_use_is_one_line_not_a_traceback(k8s: LocalCluster, tmp_path: Path) -> None:
    taken = socket.create_server(("0.0.0.0", 0))
    port = taken.getsockname()[1]
    try:
        argv = ["--standalone", "--namespace", "default", "--metrics-port", str(port)]
        code, log = _exits(Operator(k8s, "default", tmp_path / "operator.log", argv=argv), 30)
    finally:
        taken.close()
    assert code == 1, log
    assert f"cannot serve the operator's metrics on port {port} (Address already in use)" in log, log
    assert "Traceback" not in log, log


def test_an_identity_without_watch_is_refused_at_start_naming_it(k8s: LocalCluster, tmp_path: Path) -> None:
    namespace = k8s.create_namespace("no-watch")
    kubeconfig = _identity(k8s, namespace, _rules(without={("watch", "inferenceservices")}), tmp_path)
    # A resource that exists already is not reconciled once and then left looking managed.
    k8s.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(isvc("waiting")))
    started = time.monotonic()
    operator = Operator(k8s, namespace, tmp_path / "operator.log", kubeconfig=kubeconfig)
    try:
        code = operator.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        operator.stop()
        pytest.fail(f"the operator still ran after 30 s:\n{operator.log_tail()}")
    finally:
        operator.stop()
    elapsed = time.monotonic() - started
    log = operator.log_path.read_text()
    assert code == 1, log
    assert f"  - watch inferenceservices.serving.conveyor.dev in namespace {namespace}" in log.splitlines()
    assert f"system:serviceaccount:{namespace}:operator" in log
    assert "rbac.create=true" in log
    # Only the missing verb is named, and no traceback is printed.
    assert "  - get inferenceservices" not in log and "Traceback" not in log, log
    assert len(log.splitlines()) <= 8, log
    assert k8s.kubectl("-n", namespace, "get", "deployments", "-o", "name").stdout.strip() == ""
    assert elapsed < 30
    k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture
def two_namespaces(k8s: LocalCluster, tmp_path: Path) -> Iterator[tuple[Env, Env]]:
    """An operator watching two namespaces, with every permission cluster-wide except those on
    PodDisruptionBudgets, which a Role grants in each namespace."""
    first, second = k8s.create_namespace("forbid-a"), k8s.create_namespace("forbid-b")
    kubeconfig = _identity(k8s, first, _rules(skip_resources={"poddisruptionbudgets"}), tmp_path)
    for namespace in (first, second):
        _apply(
            k8s,
            _pdb_role(namespace),
            _pdb_binding(namespace, first),
        )
    argv = ["--standalone", "--namespace", first, "--namespace", second, "--metrics-port", "0"]
    operator = Operator(k8s, first, tmp_path / "operator.log", kubeconfig=kubeconfig, argv=argv)
    envs = Env(k8s, first, operator), Env(k8s, second, operator)
    try:
        yield envs
    finally:
        operator.stop()
        for namespace in (first, second):
            k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def _pdb_role(namespace: str, without: str | None = None) -> dict[str, Any]:
    """The operator's PodDisruptionBudget verbs in one namespace, less `without`."""
    (rule,) = [r for r in RULES if "poddisruptionbudgets" in r.resources]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "operator-pdb", "namespace": namespace},
        "rules": [
            {
                "apiGroups": list(rule.api_groups),
                "resources": ["poddisruptionbudgets"],
                "verbs": [v for v in rule.verbs if v != without],
            }
        ],
    }


def _pdb_binding(namespace: str, account_namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "operator-pdb", "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "operator-pdb"},
        "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": account_namespace}],
    }


def test_a_permission_lost_while_running_is_a_condition_and_an_event(
    k8s: LocalCluster, two_namespaces: tuple[Env, Env]
) -> None:
    lost, kept = two_namespaces
    for env in (lost, kept):
        env.apply(isvc("svc", model={"name": "smollm2-135m", "maxModelLen": 2048}))
    for env in (lost, kept):
        env.wait_ready("svc")
    # `get` goes (list and watch stay, so kopf's watch of the children is untouched).
    _apply(k8s, _pdb_role(lost.namespace, without="get"))
    for env in (lost, kept):
        env.kubectl("patch", "inferenceservice", "svc", "--type=merge", "-p", '{"spec":{"replicas":2}}')

    ready = lost.eventually(
        lambda: (c := lost.condition("svc", "Ready")) and c["reason"] == "Forbidden" and c,
        "Ready=False Forbidden",
    )
    assert ready["status"] == "False"
    assert (
        f'cannot get resource "poddisruptionbudgets" in API group "policy" in the namespace "{lost.namespace}"'
        in ready["message"]
    )
    events = lost.eventually(
        lambda: [e for e in lost.events("svc") if e["reason"] == "Forbidden"], "the Forbidden event"
    )
    assert events[0]["type"] == "Warning" and events[0]["message"] == ready["message"]
    # The other namespace is served as before.
    kept.wait_ready("svc", replicas=2)
    # The permission back: kopf's retry reconciles it.
    _apply(k8s, _pdb_role(lost.namespace))
    lost.wait_ready("svc", replicas=2, timeout=90)
    assert "Traceback" not in lost.operator.log_path.read_text()
