"""The autoscaling loop closed on loopback: real `conveyor serve` processes under load, a real
Prometheus scraping them, the operator (a real process) reading that Prometheus and scaling the
Deployment in the local control plane.

kwok's pods run no containers, so two `conveyor serve` processes stand in for two of the
InferenceService's pods: Prometheus scrapes each with that pod's `namespace` and `pod` labels
(file-based targets), as a ServiceMonitor would. Pods added by a scale-up have no server behind them
(the operator extrapolates the queue of the Ready pods that report over those that do not); when a
scale-down removes a pod with a server, the server stands in for a surviving pod.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import ServeProcess, start_serve
from tests.k8s.cluster import LocalCluster
from tests.k8s.operator_env import CRD_PATH, Env, Operator, isvc
from tests.prometheus import PrometheusServer, stop_process

pytestmark = [pytest.mark.e2e, pytest.mark.k8s, pytest.mark.slow]

NAME = "e2e"
AUTOSCALING = {
    "minReplicas": 2,
    "maxReplicas": 4,
    "targetQueueDepth": 2,
    # A shortened scale-down window (the default is 300 s) and one pod per 2 s.
    "behavior": {
        "scaleDown": {
            "stabilizationWindowSeconds": 10,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 2}],
        }
    },
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServeProcess]]:
    """Two servers that admit 2 sequences per step, so a concurrency of 8 keeps 6 waiting on each."""
    logs = tmp_path_factory.mktemp("serve")
    started = [start_serve(logs / f"serve-{i}.log", "--max-num-seqs", "2") for i in range(2)]
    try:
        yield started
    finally:
        for server in started:
            stop_process(server.proc)


def bench(server: ServeProcess, log: Path) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("conveyor")
    args = [
        str(exe),
        "bench",
        "--base-url",
        server.base_url,
        "--dataset-name",
        "random",
        "--num-prompts",
        "24",
        "--input-len",
        "32",
        "--output-len",
        "48",
        "--max-concurrency",
        "8",
        "--disable-tqdm",
    ]
    with log.open("w") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)


class PodServers:
    """Keeps each server standing in for one live pod and Prometheus's targets in step with that."""

    def __init__(self, env: Env, servers: list[ServeProcess], prometheus: PrometheusServer) -> None:
        self.env, self.servers, self.prometheus = env, servers, prometheus
        self.assigned: dict[str, ServeProcess] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sync(self) -> None:
        live = sorted(
            (p["metadata"]["creationTimestamp"], p["metadata"]["name"])
            for p in self.env.pods(NAME)
            if not p["metadata"].get("deletionTimestamp")
        )
        names = [name for _, name in live]
        changed = False
        for pod in [p for p in self.assigned if p not in names]:
            del self.assigned[pod]
            changed = True
        free = [s for s in self.servers if s not in self.assigned.values()]
        for pod in names:
            if free and pod not in self.assigned:
                self.assigned[pod] = free.pop(0)
                changed = True
        if changed:
            self.prometheus.set_targets(
                [
                    (f"127.0.0.1:{s.port}", {"namespace": self.env.namespace, "pod": pod})
                    for pod, s in sorted(self.assigned.items())
                ]
            )

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(subprocess.SubprocessError, json.JSONDecodeError, AssertionError):
                self.sync()

    def start(self) -> None:
        self.sync()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def test_load_scales_up_quiet_scales_down_outage_holds(
    k8s: LocalCluster, servers: list[ServeProcess], tmp_path: Path
) -> None:
    k8s.kubectl("apply", "--server-side", "-f", str(CRD_PATH))
    k8s.kubectl("wait", "--for=condition=Established", "crd/inferenceservices.serving.conveyor.dev")
    (tmp_path / "prometheus").mkdir()
    prometheus = PrometheusServer(tmp_path / "prometheus")
    prometheus.start()
    namespace = k8s.create_namespace("e2e")
    operator = Operator(
        k8s,
        namespace,
        tmp_path / "operator.log",
        "--prometheus-url",
        prometheus.url,
        "--autoscale-interval",
        "2",
    )
    env = Env(k8s, namespace, operator)
    timeline: list[str] = []
    t0 = time.monotonic()

    def mark(what: str) -> None:
        timeline.append(f"{time.monotonic() - t0:6.1f}s  {what}")

    def replicas() -> int:
        return (env.get("deployment", NAME) or {}).get("spec", {}).get("replicas", 0)

    loads: list[subprocess.Popen] = []
    pod_servers: PodServers | None = None
    try:
        env.apply(
            isvc(
                NAME,
                model={"name": "smollm2-135m", "maxModelLen": 2048},
                replicas=None,
                autoscaling=AUTOSCALING,
            )
        )
        env.wait_ready(NAME, replicas=2)
        pod_servers = PodServers(env, servers, prometheus)
        pod_servers.start()
        pods = sorted(pod_servers.assigned)
        env.eventually(
            lambda: (env.condition(NAME, "MetricsAvailable") or {}).get("status") == "True",
            "the first reading of both servers",
        )
        mark(f"2 replicas Ready, both scraped (pods {', '.join(pods)})")

        loads = [bench(s, tmp_path / f"bench-{i}.log") for i, s in enumerate(servers)]
        mark("load started: conveyor bench, concurrency 8 on each server (max_num_seqs 2)")
        env.eventually(lambda: replicas() > 2, "a scale-up under load", timeout=120)
        up = next(e for e in env.events(NAME) if e["reason"] == "ScaleUp")
        mark(f"scaled up: {up['message']}")
        assert "queue depth" in up["message"]

        for load in loads:
            load.wait(timeout=300)
            assert load.returncode == 0, (tmp_path / "bench-0.log").read_text()[-2000:]
        mark("load finished")
        env.eventually(lambda: replicas() == 2, "a scale-down after the window", timeout=120)
        downs = [e["message"] for e in env.events(NAME) if e["reason"] == "ScaleDown"]
        mark(f"scaled down to 2: {downs[-1]}")

        prometheus.stop()
        mark("Prometheus stopped")
        cond = env.eventually(
            lambda: (c := env.condition(NAME, "MetricsAvailable")) and c["status"] == "False" and c,
            "MetricsAvailable=False",
        )
        mark(f"MetricsAvailable=False: {cond['message'][:120]}")
        time.sleep(6)
        assert replicas() == 2
        prometheus.start()
        env.eventually(
            lambda: (env.condition(NAME, "MetricsAvailable") or {}).get("status") == "True",
            "MetricsAvailable=True after the restart",
            timeout=60,
        )
        mark("Prometheus back: MetricsAvailable=True")
        status = (env.get("inferenceservice", NAME) or {})["status"]
        assert status["autoscaler"]["decisions"], status
        mark(
            "decisions in status: "
            + json.dumps([(d["from"], d["to"], d["reason"]) for d in status["autoscaler"]["decisions"]])
        )
    finally:
        if pod_servers is not None:
            pod_servers.stop()
        for load in loads:
            if load.poll() is None:
                load.kill()
        print("\n".join(["autoscaling e2e timeline:", *timeline]))
        env.kubectl("delete", "inferenceservice", NAME, "--wait=true", check=False)
        operator.stop()
        prometheus.stop()
        k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
