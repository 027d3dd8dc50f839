"""The local cluster's pod runner (tests/k8s/local_pods.py) against the real API server: probes.

A router pod (the lightest process the runner starts: a tokenizer and a proxy) is created directly,
with probes short enough to wait for; SIGSTOP hangs its process as a deadlocked server would hang.
The rules themselves are unit-tested in tests/unit/test_local_pods.py; this checks that the runner
acts on them: the pod's status, the Event and the restart are what the API shows.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.cluster import LocalCluster, NodePool
from tests.k8s.local_pods import LABEL_ROUTER, LocalPods
from tests.k8s.operator_env import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

HEALTH = {"httpGet": {"path": "/health", "port": "http"}}


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


def test_a_hung_process_fails_liveness_and_is_restarted(tmp_path: Path) -> None:
    with LocalCluster(
        [NodePool(product="NVIDIA-L4", count=1, gpus_per_node=1)], process_pods=True
    ) as cluster:
        pods = LocalPods(cluster, tmp_path).start()
        try:
            namespace = cluster.create_namespace("probes")
            cluster.kubectl("apply", "-f", "-", input=json.dumps(router_pod(namespace, "hung")))

            def pod() -> dict[str, Any]:
                return json.loads(cluster.kubectl("-n", namespace, "get", "pod", "hung", "-o", "json").stdout)

            def ready() -> bool:
                conditions = pod()["status"].get("conditions", [])
                return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

            eventually(ready, timeout=120, what="the router pod Ready")
            hung = pods.pids()[f"{namespace}/hung"]
            os.kill(hung, signal.SIGSTOP)

            def restarted() -> dict[str, Any] | None:
                status = (pod()["status"].get("containerStatuses") or [{}])[0]
                return status if status.get("restartCount", 0) >= 1 else None

            status = eventually(restarted, timeout=30, what="the hung process killed and counted")
            assert status["lastState"]["terminated"]["exitCode"] == 137, status
            events = json.loads(
                cluster.kubectl(
                    "-n",
                    namespace,
                    "get",
                    "events",
                    "--field-selector",
                    "involvedObject.name=hung",
                    "-o",
                    "json",
                ).stdout
            )["items"]
            unhealthy = [e for e in events if e["reason"] == "Unhealthy"]
            assert unhealthy and unhealthy[0]["type"] == "Warning", events
            assert "Liveness probe failed 2 times in a row" in unhealthy[0]["message"]
            eventually(ready, timeout=120, what="the restarted router Ready again")
            assert pods.pids()[f"{namespace}/hung"] != hung
            with pytest.raises(ProcessLookupError):
                os.killpg(hung, 0)
        finally:
            pods.stop()
