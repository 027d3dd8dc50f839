"""The local cluster's pod runner (tests/k8s/local_pods.py) against the real API server: probes, env.

Router pods (the lightest process the runner starts: a tokenizer and a proxy) are created directly,
with probes short enough to wait for; SIGSTOP hangs a process as a deadlocked server would hang. The
rules themselves are unit-tested in tests/unit/test_local_pods.py; this checks that the runner acts on
them: the pod's status, the Event, the restart and the process's environment are what the API shows.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.cluster import LocalCluster, NodePool
from tests.k8s.local_pods import LABEL_ROUTER, LocalPods
from tests.k8s.operator_env import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

HEALTH = {"httpGet": {"path": "/health", "port": "http"}}


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, LocalPods, str]]:
    """(cluster, its pod runner, a namespace) on a cluster of its own with process-backed pods."""
    with LocalCluster(
        [NodePool(product="NVIDIA-L4", count=1, gpus_per_node=1)], process_pods=True
    ) as cluster:
        pods = LocalPods(cluster, tmp_path_factory.mktemp("local-pods")).start()
        try:
            yield cluster, pods, cluster.create_namespace("local-pods")
        finally:
            pods.stop()


def get_pod(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("-n", namespace, "get", "pod", name, "-o", "json").stdout)


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def router_pod(namespace: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {LABEL_ROUTER: name}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "tolerations": [{"operator": "Exists"}],
            "containers": [
                {
                    "name": "router",
                    "image": "conveyor-server:local",
                    "command": ["conveyor"],
                    "args": ["router", "--service", f"{namespace}/{name}"],
                    "ports": [{"name": "http", "containerPort": 8000}],
                    "startupProbe": {**HEALTH, "periodSeconds": 5, "failureThreshold": 24},
                    "readinessProbe": {**HEALTH, "periodSeconds": 1, "failureThreshold": 1},
                    "livenessProbe": {
                        **HEALTH,
                        "periodSeconds": 1,
                        "timeoutSeconds": 1,
                        "failureThreshold": 2,
                    },
                }
            ],
        },
    }


def test_a_hung_process_fails_liveness_and_is_restarted(runner: tuple[LocalCluster, LocalPods, str]) -> None:
    cluster, pods, namespace = runner
    cluster.kubectl("apply", "-f", "-", input=json.dumps(router_pod(namespace, "hung")))
    eventually(
        lambda: pod_ready(get_pod(cluster, namespace, "hung")), timeout=120, what="the router pod Ready"
    )
    hung = pods.pids()[f"{namespace}/hung"]
    os.kill(hung, signal.SIGSTOP)

    def restarted() -> dict[str, Any] | None:
        status = (get_pod(cluster, namespace, "hung")["status"].get("containerStatuses") or [{}])[0]
        return status if status.get("restartCount", 0) >= 1 else None

    status = eventually(restarted, timeout=30, what="the hung process killed and counted")
    assert status["lastState"]["terminated"]["exitCode"] == 137, status
    selector = "involvedObject.name=hung"
    events = json.loads(
        cluster.kubectl("-n", namespace, "get", "events", "--field-selector", selector, "-o", "json").stdout
    )["items"]
    unhealthy = [e for e in events if e["reason"] == "Unhealthy"]
    assert unhealthy and unhealthy[0]["type"] == "Warning", events
    assert "Liveness probe failed 2 times in a row" in unhealthy[0]["message"]
    eventually(lambda: pod_ready(get_pod(cluster, namespace, "hung")), timeout=120, what="Ready again")
    assert pods.pids()[f"{namespace}/hung"] != hung
    with pytest.raises(ProcessLookupError):
        os.killpg(hung, 0)


def test_env_from_a_secret_waits_for_it_then_reaches_the_process(
    runner: tuple[LocalCluster, LocalPods, str],
) -> None:
    cluster, pods, namespace = runner
    manifest = router_pod(namespace, "secretive")
    manifest["spec"]["containers"][0]["env"] = [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))

    def waiting() -> dict[str, Any] | None:
        status = (get_pod(cluster, namespace, "secretive")["status"].get("containerStatuses") or [{}])[0]
        return status.get("state", {}).get("waiting")

    state = eventually(
        lambda: (w := waiting()) and w["reason"] == "CreateContainerConfigError" and w,
        timeout=30,
        what="CreateContainerConfigError while the Secret is missing",
    )
    assert state["message"] == 'secret "hf" not found'
    assert get_pod(cluster, namespace, "secretive")["status"]["phase"] == "Pending"
    assert f"{namespace}/secretive" not in pods.pids()
    cluster.kubectl("-n", namespace, "create", "secret", "generic", "hf", "--from-literal=token=hf_local")
    pid = eventually(
        lambda: pods.pids().get(f"{namespace}/secretive"), timeout=30, what="the process started"
    )
    environ = dict(
        item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
    )
    assert environ["HF_TOKEN"] == "hf_local"
    assert environ["POD_NAME"] == "secretive"
    eventually(lambda: pod_ready(get_pod(cluster, namespace, "secretive")), timeout=120, what="Ready")
