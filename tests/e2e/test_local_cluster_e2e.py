"""The local cluster's whole loop (docs/guides/local-cluster.md) as a test.

Everything is real and runs as on a user's machine after `make cluster`: the control plane with a
simulated L4 node, process-backed pods (`tests/k8s/local_pods.py`) running the `conveyor serve` and
`conveyor router` the operator rendered, a real Prometheus scraping them, and the operator (a real
process) reading that Prometheus. The InferenceService is `examples/smollm2-135m-autoscaling.yaml`
with shortened windows (at most 2 replicas, one pod per 2 s, a 10 s scale-down window) and the router
enabled. The GPU is the only thing simulated: kwok's node advertises it, and the server flags that
need one are mapped to CPU equivalents (logged by the pod runner).

The test prints its timeline (`pytest -s`): each scale decision with its reason, each pod Ready, and
the time from a scale-up decision to the new replica answering.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.e2e.local_stack import local_stack
from tests.k8s.operator_env import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.k8s, pytest.mark.slow]

EXAMPLE = REPO / "examples" / "smollm2-135m-autoscaling.yaml"
NAME = "smollm2-autoscaling"
SERVER_START_TIMEOUT = 300.0  # the first start converts the embedded model; 2 cores are shared by all


def manifest(*, router: bool) -> dict[str, Any]:
    """The walkthrough's example with windows a test can wait for."""
    body = yaml.safe_load(EXAMPLE.read_text())
    assert body["metadata"]["name"] == NAME
    body["spec"]["autoscaling"].update(
        maxReplicas=2,
        behavior={
            "scaleUp": {"policies": [{"type": "Pods", "value": 1, "periodSeconds": 2}]},
            "scaleDown": {
                "stabilizationWindowSeconds": 10,
                "policies": [{"type": "Pods", "value": 1, "periodSeconds": 2}],
            },
        },
    )
    if router:
        body["spec"]["router"] = {"enabled": True}
    return body


def chat(url: str) -> str:
    """One real chat answer through the InferenceService's URL, with the real `openai` client."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12
    )
    return reply.choices[0].message.content or ""


def bench(url: str, log: Path) -> subprocess.Popen:
    """`conveyor bench` as in the walkthrough: far more concurrency than 4 sequences per replica hold."""
    exe = Path(sys.executable).with_name("conveyor")
    args = [str(exe), "bench", "--base-url", url, "--dataset-name", "random", "--num-prompts", "400"]
    args += ["--input-len", "32", "--output-len", "64", "--max-concurrency", "12", "--disable-tqdm"]
    with log.open("w") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def group_alive(pid: int) -> bool:
    """Whether any process of the process group `pid` leads (every pod process leads its own) lives."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_walkthrough_serves_scales_restarts_and_cleans_up(tmp_path: Path) -> None:
    timeline: list[str] = []
    t0 = time.monotonic()

    def mark(what: str) -> float:
        now = time.monotonic() - t0
        timeline.append(f"{now:6.1f}s  {what}")
        return now

    load: subprocess.Popen | None = None
    seen: dict[str, tuple[int, int]] = {}  # pod key -> (pid, port) of every process that ran
    with local_stack(tmp_path, "walkthrough") as stack:
        pods, prometheus, env = stack.pods, stack.prometheus, stack.env
        namespace = env.namespace

        def sample() -> dict[str, int]:
            pids = pods.pids()
            for key, pid in pids.items():
                port = next(p.port for p in pods.pods.values() if p.key == key)
                seen.setdefault(f"{key}#{pid}", (pid, port))
            return pids

        def replicas() -> int:
            return (env.get("deployment", NAME) or {}).get("spec", {}).get("replicas", 0)

        def servers() -> list[dict[str, Any]]:
            return [p for p in env.pods(NAME) if not p["metadata"].get("deletionTimestamp")]

        try:
            # 1. Apply, then a real answer through the URL (forwarder -> router -> server).
            env.apply(manifest(router=True))
            mark("applied (router enabled)")
            url = pods.wait_url(namespace, NAME, timeout=SERVER_START_TIMEOUT)
            mark(f"reachable at {url}")
            env.wait_ready(NAME, replicas=1, timeout=SERVER_START_TIMEOUT)
            answer = chat(url)
            assert answer.strip(), "an empty answer through the InferenceService URL"
            mark(f"answer through the URL: {answer!r}")
            env.eventually(
                lambda: (env.condition(NAME, "MetricsAvailable") or {}).get("status") == "True",
                "the operator's first Prometheus reading",
                timeout=60,
            )
            first = servers()[0]["metadata"]["name"]
            assert (
                len([k for k in sample() if k.startswith(f"{namespace}/")]) == 2
            )  # the server and the router

            # 2. Load above the target queue depth: one more replica, and it answers.
            load = bench(url, tmp_path / "bench.log")
            mark("load started: conveyor bench, concurrency 12 (4 sequences per replica, target queue 2)")
            env.eventually(lambda: replicas() == 2, "a scale-up under load", timeout=180)
            up = next(e for e in env.events(NAME) if e["reason"] == "ScaleUp")
            decided = mark(f"ScaleUp: {up['message']}")
            assert "queue depth" in up["message"], up["message"]
            new = env.eventually(
                lambda: next((p for p in servers() if p["metadata"]["name"] != first and pod_ready(p)), None),
                "the new replica Ready",
                timeout=SERVER_START_TIMEOUT,
            )["metadata"]["name"]
            mark(f"pod {new} Ready")
            sample()
            tokens = f'sum(conveyor:generation_tokens_total{{namespace="{namespace}",pod="{new}"}}) > 0'
            env.eventually(lambda: prometheus.query(tokens), f"{new} answering requests", timeout=120)
            answered = mark(f"pod {new} answers (tokens in Prometheus)")
            timeline.append(
                f"        scale-up decision to the new replica answering: {answered - decided:.1f}s"
            )
            load.terminate()
            load.wait(timeout=30)
            mark("load stopped")

            # 3. Quiet: back to one replica after the window, and the removed pod's process ends.
            env.eventually(lambda: replicas() == 1, "a scale-down after the window", timeout=180)
            down = [e["message"] for e in env.events(NAME) if e["reason"] == "ScaleDown"]
            mark(f"ScaleDown: {down[-1]}")
            env.eventually(lambda: len(servers()) == 1, "the removed pod gone", timeout=60)
            survivor = servers()[0]["metadata"]["name"]
            env.eventually(
                lambda: len([k for k in pods.pids() if k.startswith(f"{namespace}/{NAME}-")]) == 2,
                "one server process and the router's left",
                timeout=60,
            )
            mark(f"scaled down to {survivor}; the other server process ended")

            # 4. A killed server process is restarted; the pod's readiness follows it.
            key = f"{namespace}/{survivor}"
            killed = sample()[key]
            os.kill(killed, signal.SIGKILL)
            mark(f"kill -9 {killed} ({survivor})")

            def restarted_status() -> dict[str, Any] | None:
                pod = env.get("pod", survivor) or {}
                status = (pod.get("status", {}).get("containerStatuses") or [{}])[0]
                return status if status.get("restartCount", 0) >= 1 and not pod_ready(pod) else None

            status = env.eventually(
                restarted_status, f"{survivor} not Ready with a restart counted", timeout=30
            )
            assert status["lastState"]["terminated"]["exitCode"] == 137, status
            mark(f"{survivor} not Ready, restartCount {status['restartCount']}, exit 137")
            env.eventually(
                lambda: pod_ready(env.get("pod", survivor) or {}), f"{survivor} Ready again", timeout=120
            )
            assert sample()[key] != killed
            mark(f"{survivor} Ready again (pid {pods.pids()[key]})")
            assert chat(url).strip()
            mark("answer through the URL again")

            # 5. Deleting the InferenceService ends every process and closes its URL.
            ours = {k: v for k, v in seen.items() if k.startswith(f"{namespace}/")}
            env.delete(NAME)
            env.eventually(
                lambda: not any(group_alive(pid) for pid, _ in ours.values()), "every pod process ended", 60
            )
            assert not [port for _, port in ours.values() if port_open(port)]
            url_port = int(url.rsplit(":", 1)[1])
            env.eventually(lambda: not port_open(url_port), "the InferenceService URL closed", timeout=10)
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{url}/health", timeout=5)
            mark(f"deleted: {len(ours)} processes ended, their ports and {url} closed")

            # 6. Without a router the URL forwards to the servers; stopping the cluster ends everything.
            env.apply(manifest(router=False))
            url = pods.wait_url(namespace, NAME, timeout=SERVER_START_TIMEOUT)
            assert chat(url).strip()
            sample()
            mark(f"re-applied without a router: answer through {url}")
        finally:
            if load is not None and load.poll() is None:
                load.kill()
            print("\n".join(["local cluster walkthrough timeline:", *timeline]))
    assert not [pid for pid, _ in seen.values() if group_alive(pid)], "pod processes outlived the cluster"
    assert not [port for _, port in seen.values() if port_open(port)]
    assert not port_open(int(url.rsplit(":", 1)[1]))
    assert not [pid for pid in stack.components if group_alive(pid)], "cluster components outlived its stop"
