"""Shared by the operator tests: the operator as a subprocess, a namespace to drive it in, manifests.

The operator runs as `python -m conveyor.operator.run --standalone --namespace NS`, as `conveyor
operator` would; kwok runs the pods it creates on simulated GPU nodes (no containers start).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.k8s.cluster import LocalCluster

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "serving.conveyor.dev_inferenceservices.yaml"
LLAMA_EXAMPLE = REPO / "examples" / "llama-3-8b-a100.yaml"
SMOLLM_EXAMPLE = REPO / "examples" / "smollm2-135m-l4.yaml"
ISVC_LABEL = "serving.conveyor.dev/inferenceservice"
# Namespaces the operator tests run in enforce the Pod Security Standards' `restricted` profile: the API
# server's PodSecurity admission refuses any server or router pod that breaks it.
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}
T = TypeVar("T")

# A stand-in for the Prometheus operator's CRD: enough for the API to exist.
SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "names": {"kind": "ServiceMonitor", "plural": "servicemonitors", "singular": "servicemonitor"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


def eventually(probe: Callable[[], T | None], timeout: float = 60.0, what: str = "condition") -> T:
    """Poll `probe` until it returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.25)


class Operator:
    """The operator subprocess; its log is read back into failure messages."""

    def __init__(
        self,
        cluster: LocalCluster,
        namespace: str,
        log_path: Path,
        *extra_args: str,
        kubeconfig: Path | None = None,
        argv: list[str] | None = None,
    ) -> None:
        """`kubeconfig`: the operator's credentials (default: the cluster's admin); `argv`: its whole
        command line after `conveyor operator` (default: standalone on `namespace`, no metrics)."""
        self.log_path = log_path
        env = {**os.environ, "KUBECONFIG": str(kubeconfig or cluster.kubeconfig), "PYTHONSAFEPATH": "1"}
        self._log = log_path.open("wb")
        if argv is None:
            argv = ["--standalone", "--namespace", namespace, "--metrics-port", "0", *extra_args]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "conveyor.operator.run", *argv],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()


class Env:
    """One namespace with the CRD installed and an operator watching it."""

    def __init__(
        self, cluster: LocalCluster, namespace: str, operator: Operator, standbys: Sequence[Operator] = ()
    ) -> None:
        """`standbys`: peers of `operator` (replicas of one Deployment); their logs join failure messages."""
        self.cluster = cluster
        self.namespace = namespace
        self.operator = operator
        self.standbys = list(standbys)

    def _logs(self) -> str:
        parts = [self.operator.log_tail()]
        for standby in self.standbys:
            state = "running" if standby.process.poll() is None else f"exited {standby.process.returncode}"
            parts.append(f"--- standby {standby.log_path.name} ({state}):\n{standby.log_tail()}")
        return "\n".join(parts)

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl("-n", self.namespace, *args, **kwargs)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        result = self.kubectl("get", kind, name, "-o", "json", check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr:
                return None
            raise AssertionError(result.stderr)
        return json.loads(result.stdout)

    def items(self, kind: str, selector: str) -> list[dict[str, Any]]:
        return json.loads(self.kubectl("get", kind, "-l", selector, "-o", "json").stdout)["items"]

    def apply(self, manifest: dict[str, Any] | Path) -> subprocess.CompletedProcess[str]:
        if isinstance(manifest, Path):
            return self.kubectl("apply", "-f", str(manifest))
        return self.kubectl("apply", "-f", "-", input=json.dumps(manifest))

    def eventually(self, probe: Callable[[], T | None], what: str, timeout: float = 60.0) -> T:
        """Poll `probe` until it returns something truthy; fail with the operator's log."""
        deadline = time.monotonic() + timeout
        while True:
            result = probe()
            if result:
                return result
            if self.operator.process.poll() is not None:
                pytest.fail(f"operator exited ({self.operator.process.returncode}):\n{self._logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{self._logs()}")
            time.sleep(0.25)

    def condition(self, name: str, type_: str) -> dict[str, Any] | None:
        isvc = self.get("inferenceservice", name) or {}
        return next((c for c in isvc.get("status", {}).get("conditions", []) if c["type"] == type_), None)

    def wait_ready(self, name: str, replicas: int = 1, timeout: float = 90.0) -> dict[str, Any]:
        """Wait until Ready=True with `replicas` ready and status observed for the current generation."""

        def probe() -> dict[str, Any] | None:
            isvc = self.get("inferenceservice", name)
            if not isvc:
                return None
            status = isvc.get("status", {})
            ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), {})
            if (
                ready.get("status") == "True"
                and status.get("readyReplicas") == replicas
                and status.get("observedGeneration") == isvc["metadata"]["generation"]
            ):
                return isvc
            return None

        try:
            return self.eventually(probe, f"{name} Ready with {replicas} replicas", timeout)
        except pytest.fail.Exception as failed:  # say what it was instead, and where its pods are
            isvc = self.get("inferenceservice", name) or {}
            conditions = [
                f"{c['type']}={c['status']} {c.get('reason')}: {c.get('message')}"
                for c in isvc.get("status", {}).get("conditions", [])
            ]
            pods = [
                f"{p['metadata']['name']} {p['status'].get('phase')} on {p['spec'].get('nodeName')}"
                for p in self.pods(name)
            ]
            pytest.fail(f"{failed}\nconditions: {conditions}\npods: {pods}")

    def pods(self, name: str) -> list[dict[str, Any]]:
        return self.items("pods", f"{ISVC_LABEL}={name}")

    def delete(self, name: str) -> None:
        """Delete an InferenceService and wait until its pods are gone (their GPUs are free again)."""
        self.kubectl("delete", "inferenceservice", name, "--ignore-not-found", "--wait=true")
        self.eventually(lambda: not self.pods(name), f"pods of {name} gone", timeout=60)

    def events(self, name: str) -> list[dict[str, Any]]:
        selector = f"involvedObject.kind=InferenceService,involvedObject.name={name}"
        out = self.kubectl("get", "events", "--field-selector", selector, "-o", "json").stdout
        return json.loads(out)["items"]


def isvc(name: str, **spec: Any) -> dict[str, Any]:
    """An InferenceService manifest: Llama-3-8B at 4K on one A100-80GB unless `spec` says otherwise."""
    body: dict[str, Any] = {
        "model": {"name": "llama-3-8b", "maxModelLen": 4096},
        "resources": {"gpuType": "a100-80gb"},
        "replicas": 1,
    }
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        elif value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return {
        "apiVersion": "serving.conveyor.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": body,
    }


def container_args(deployment: dict[str, Any]) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def account_kubeconfig(k8s: LocalCluster, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig at `path` authenticating as service account `account` (a 2-hour token)."""
    token = k8s.kubectl("-n", namespace, "create", "token", account, "--duration=2h").stdout.strip()
    config = json.loads(k8s.kubeconfig.read_text())
    config["users"] = [{"name": account, "user": {"token": token}}]
    config["contexts"][0]["context"]["user"] = account
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return path


class SilentServer:
    """A loopback server that accepts connections and never answers: a hung Prometheus or API server.
    `port`; `accepted` is set on each connection."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.listener.getsockname()[1]
        self.accepted = threading.Event()
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self._held.append(self.listener.accept()[0])
            except OSError:
                return
            self.accepted.set()

    def close(self) -> None:
        self.listener.close()
        for conn in self._held:
            conn.close()
