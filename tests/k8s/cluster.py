"""A local Kubernetes control plane with simulated GPU nodes, for tests and local trials.

`LocalCluster` starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok
on 127.0.0.1 free ports, with a CA, serving and client certificates and a service-account
signing key generated at start. kwok simulates the nodes (Ready, with `nvidia.com/gpu`
capacity and GPU feature-discovery labels) and the lifecycle of pods bound to them
(Running, no container runtime). With `process_pods=True` kwok leaves the pods of InferenceServices
alone, for `tests/k8s/local_pods.py` to run them as local processes. Every process is stopped by PID
on `stop()`.

Binaries come from `hack/k8s-tools/build.sh` (built once per machine into a cache outside
the repository) or from the directory named by `CONVEYOR_K8S_BIN_DIR`.

Run as a script (`make cluster`) to keep a cluster in the foreground, with Prometheus and process-backed
pods (`tests/k8s/local_pods.py`):
    python tests/k8s/cluster.py [--pool PRODUCT:NODES:GPUS ...] [--max-server-processes N]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # `make cluster` runs this file as a script (PYTHONSAFEPATH=1: the repository root is not on the path,
    # where operator/ would shadow the standard library); appended, it cannot shadow anything.
    sys.path.append(str(Path(__file__).resolve().parents[2]))

import argparse
import base64
import contextlib
import ctypes
import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import IO, TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "k8s-tools" / "build.sh"
KWOK_GO_MOD = REPO_ROOT / "hack" / "k8s-tools" / "kwok" / "go.mod"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm")

GPU_RESOURCE = "nvidia.com/gpu"
# kwok manages only nodes carrying this annotation, so a user may add other nodes by hand.
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
POD_CIDR = "10.244.0.1/16"
# Pods carrying either label key (server and router pods of an InferenceService) are run by the local pod
# runner when the cluster is started with `process_pods=True`; kwok's pod stages skip them.
PROCESS_POD_LABELS = ("serving.conveyor.dev/inferenceservice", "serving.conveyor.dev/router")
KWOK_POD_STAGES = ("pod-ready", "pod-complete", "pod-delete")

# Memory per GPU in MiB as NVIDIA GPU feature discovery reports it in `nvidia.com/gpu.memory`.
GPU_MEMORY_MIB = {
    "NVIDIA-A100-SXM4-80GB": 81920,
    "NVIDIA-A100-SXM4-40GB": 40960,
    "NVIDIA-A100-PCIE-40GB": 40960,
    "NVIDIA-H100-80GB-HBM3": 81559,
    "NVIDIA-H200": 143771,
    "NVIDIA-L4": 23034,
    "NVIDIA-A10G": 23028,
}


class ToolsBuildError(RuntimeError):
    """The test-bed binaries are missing and `hack/k8s-tools/build.sh` failed to build them."""


class ClusterStartError(RuntimeError):
    """A component exited or the cluster did not become ready in time; carries the log tail."""


@dataclass(frozen=True)
class NodePool:
    """A group of identical simulated GPU nodes.

    `product` is the `nvidia.com/gpu.product` label value; `gpus_per_node` becomes the node's
    `nvidia.com/gpu` capacity and allocatable. Node names are `<name_prefix>-<index>`, the
    prefix defaulting to the product in lower case without the `NVIDIA-` part.
    """

    product: str = "NVIDIA-A100-SXM4-80GB"
    count: int = 1
    gpus_per_node: int = 8
    gpu_memory_mib: int | None = None
    name_prefix: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    cpu: str = "64"
    memory: str = "512Gi"
    max_pods: int = 110

    @property
    def prefix(self) -> str:
        """Node name prefix, a valid DNS label."""
        if self.name_prefix:
            return self.name_prefix
        slug = re.sub(r"[^a-z0-9-]+", "-", self.product.lower().removeprefix("nvidia-")).strip("-")
        return slug or "gpu-node"

    def node_labels(self, name: str) -> dict[str, str]:
        """Labels a real GPU node would carry (kubelet well-known labels plus GPU feature discovery)."""
        labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": self.product,
            "nvidia.com/gpu.count": str(self.gpus_per_node),
        }
        memory_mib = self.gpu_memory_mib or GPU_MEMORY_MIB.get(self.product)
        if memory_mib is not None:
            labels["nvidia.com/gpu.memory"] = str(memory_mib)
        labels.update(self.labels)
        return labels

    def manifest(self, name: str) -> dict[str, Any]:
        """The Node object, status included: the API server keeps a Node's status on create."""
        resources = {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": str(self.max_pods),
            GPU_RESOURCE: str(self.gpus_per_node),
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": self.node_labels(name),
                "annotations": {KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1]},
            },
            "status": {"capacity": resources, "allocatable": dict(resources)},
        }


# Every file in examples/ schedules on these (tests/k8s/test_examples.py): the L4 node is the
# walkthroughs' (SmolLM2 on L4s), the A100 node takes Llama-3-8B and the 4-GPU Llama-3-70B replica.
DEFAULT_NODE_POOLS: tuple[NodePool, ...] = (
    NodePool(product="NVIDIA-A100-SXM4-80GB", count=1, gpus_per_node=8),
    NodePool(product="NVIDIA-H100-80GB-HBM3", count=1, gpus_per_node=8),
    NodePool(product="NVIDIA-L4", count=1, gpus_per_node=4),
)


def ensure_binaries() -> Path:
    """Return the directory holding the test-bed binaries, building them first if needed.

    `CONVEYOR_K8S_BIN_DIR` overrides the build. Raises ToolsBuildError with the build's
    output when the binaries cannot be had: the k8s tests must fail, never skip.
    """
    override = os.environ.get("CONVEYOR_K8S_BIN_DIR")
    if override:
        bin_dir = Path(override)
    else:
        result = subprocess.run(
            ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, check=False, cwd=REPO_ROOT
        )
        if result.returncode != 0:
            raise ToolsBuildError(
                f"{BUILD_SCRIPT.relative_to(REPO_ROOT)} failed (exit {result.returncode}):\n"
                + _tail(result.stdout + result.stderr, 60)
            )
        bin_dir = Path(result.stdout.strip().splitlines()[-1])
    missing = [name for name in BINARIES if not os.access(bin_dir / name, os.X_OK)]
    if missing:
        raise ToolsBuildError(f"missing executables in {bin_dir}: {', '.join(missing)}")
    return bin_dir


@dataclass
class _Component:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return _tail(self.log_path.read_text(errors="replace"), lines)
        except OSError:
            return ""


class LocalCluster:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok on loopback.

    Use as a context manager, or call `start()` and `stop()`. After start:
    `kubeconfig` (Path, admin credentials), `server` (API URL), `api_client`
    (`kubernetes.client.ApiClient`), `kubectl(...)`, `add_nodes(...)`, `create_namespace()`.
    """

    def __init__(
        self,
        node_pools: Sequence[NodePool] = DEFAULT_NODE_POOLS,
        *,
        bin_dir: Path | None = None,
        workdir: Path | None = None,
        ready_timeout: float = 180.0,
        process_pods: bool = False,
    ) -> None:
        self.node_pools = tuple(node_pools)
        self.process_pods = process_pods
        self.ready_timeout = ready_timeout
        self._bin_dir = bin_dir
        self._requested_workdir = workdir
        self.workdir: Path | None = None
        self.components: list[_Component] = []
        self.ports: dict[str, int] = {}
        self.node_names: list[str] = []
        self.startup_seconds: float | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def bin_dir(self) -> Path:
        """Directory of the binaries (built on first use)."""
        if self._bin_dir is None:
            self._bin_dir = ensure_binaries()
        return self._bin_dir

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (client certificate in group system:masters)."""
        return self._dir / "kubeconfig"

    @property
    def server(self) -> str:
        """The API server's URL."""
        return f"https://127.0.0.1:{self.ports['kube-apiserver']}"

    @property
    def pids(self) -> dict[str, int]:
        """PID of each component process, by component name."""
        return {c.name: c.process.pid for c in self.components}

    def start(self) -> LocalCluster:
        """Start every component, create the nodes and wait until they are Ready.

        Raises ClusterStartError (after stopping what was started) when a component exits
        or readiness is not reached within `ready_timeout` seconds.
        """
        bin_dir = self.bin_dir
        started = time.monotonic()
        if self._requested_workdir is not None:
            self._requested_workdir.mkdir(parents=True, exist_ok=True)
            self.workdir = self._requested_workdir
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix="conveyor-k8s-"))
        try:
            self._write_pki()
            self.ports = {
                name: free_port()
                for name in (
                    "etcd",
                    "etcd-peer",
                    "kube-apiserver",
                    "kube-controller-manager",
                    "kube-scheduler",
                )
            }
            self._write_kubeconfig()
            deadline = started + self.ready_timeout
            self._start_etcd(bin_dir)
            self._wait_http("etcd", f"http://127.0.0.1:{self.ports['etcd']}/health", deadline)
            self._start_apiserver(bin_dir)
            self._wait_http("kube-apiserver", f"{self.server}/readyz", deadline)
            self._start_controllers(bin_dir)
            self._wait_default_service_account("default", deadline)
            for pool in self.node_pools:
                self.add_nodes(pool, timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def stop(self, grace_seconds: float = 10.0) -> None:
        """Stop every started process (SIGTERM, then SIGKILL) in reverse order and delete the workdir."""
        for component in reversed(self.components):
            _terminate(component.process, grace_seconds)
            component.log_file.close()
        self.components.clear()
        if self.__dict__.get("api_client") is not None:
            self.__dict__.pop("api_client").close()
        if self.workdir is not None and self._requested_workdir is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.node_names.clear()

    # -- use -------------------------------------------------------------------------------

    @cached_property
    def api_client(self) -> ApiClient:
        """A `kubernetes` ApiClient for the admin kubeconfig (closed on stop)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; raises CalledProcessError (with stderr) when `check`."""
        command = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(
            command, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, command, result.stdout, result.stderr)
        return result

    def wait_established(self, crd: str, timeout: float = 60.0) -> None:
        """Wait until the CustomResourceDefinition named `crd` is Established. Right after an apply the
        API server can still answer NotFound for it for a moment, which `kubectl wait` reports at once
        rather than waiting; so it is retried until `timeout` seconds. Raises CalledProcessError with
        kubectl's last answer when the time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(1, int(deadline - time.monotonic()))
            result = self.kubectl(
                "wait",
                "--for=condition=Established",
                f"crd/{crd}",
                f"--timeout={left}s",
                check=False,
                timeout=left + 10,
            )
            if result.returncode == 0:
                return
            if time.monotonic() >= deadline:
                raise subprocess.CalledProcessError(
                    result.returncode, result.args, result.stdout, result.stderr
                )
            time.sleep(0.5)

    def add_nodes(self, pool: NodePool, timeout: float = 60.0) -> list[str]:
        """Create `pool.count` simulated nodes and wait until kwok reports them Ready; returns their names."""
        existing = set(self.node_names)
        names: list[str] = []
        index = 0
        while len(names) < pool.count:
            name = f"{pool.prefix}-{index}"
            if name not in existing:
                names.append(name)
            index += 1
        node_list = {"apiVersion": "v1", "kind": "List", "items": [pool.manifest(n) for n in names]}
        self.kubectl("create", "-f", "-", input=json.dumps(node_list))
        self.node_names.extend(names)
        self.wait_nodes_ready(names, timeout)
        return names

    def delete_nodes(self, names: Iterable[str]) -> None:
        """Delete simulated nodes (their pods are left to the controllers)."""
        names = list(names)
        if names:
            self.kubectl("delete", "node", "--wait=true", *names)
        self.node_names[:] = [n for n in self.node_names if n not in names]

    def wait_nodes_ready(self, names: Sequence[str], timeout: float = 60.0) -> None:
        """Wait until every named node has condition Ready=True; raises ClusterStartError on timeout."""
        deadline = time.monotonic() + timeout
        pending: set[str] = set(names)
        while True:
            self._check_running()
            nodes = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)["items"]
            for node in nodes:
                conditions = node.get("status", {}).get("conditions", [])
                if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                    pending.discard(node["metadata"]["name"])
            if not pending:
                return
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"nodes not Ready after {timeout:.0f}s: {sorted(pending)}\n{self._log_tail('kwok')}"
                )
            time.sleep(0.2)

    def create_namespace(
        self, prefix: str = "test", timeout: float = 30.0, labels: Mapping[str, str] | None = None
    ) -> str:
        """Create a uniquely named namespace carrying `labels` and wait for its default ServiceAccount,
        without which pods are rejected at admission; returns the name."""
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.kubectl("create", "namespace", name)
        if labels:
            self.kubectl("label", "namespace", name, *(f"{k}={v}" for k, v in labels.items()))
        self._wait_default_service_account(name, time.monotonic() + timeout)
        return name

    # -- internals -------------------------------------------------------------------------

    @property
    def _dir(self) -> Path:
        if self.workdir is None:
            raise RuntimeError("cluster not started")
        return self.workdir

    def _write_pki(self) -> None:
        pki = self._dir / "pki"
        pki.mkdir(exist_ok=True)
        # EC P-256 keys: generated in milliseconds, and accepted for serving, client and
        # service-account signing (ES256) certificates alike.
        for key in ("ca", "apiserver", "admin", "front-proxy-client", "service-account"):
            _openssl(
                "genpkey",
                "-algorithm",
                "EC",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-out",
                pki / f"{key}.key",
            )
        _openssl("pkey", "-in", pki / "service-account.key", "-pubout", "-out", pki / "service-account.pub")
        _openssl(
            "req", "-x509", "-new", "-key", pki / "ca.key", "-subj", "/CN=conveyor-test-ca", "-days", "30",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-out", pki / "ca.crt",
        )  # fmt: skip
        sans = ",".join(
            ["IP:127.0.0.1", "IP:10.96.0.1", "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default"]
            + ["DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local"]
        )
        self._sign(
            pki, "apiserver", "/CN=kube-apiserver", f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\n"
        )
        # Group system:masters is bound to cluster-admin by the API server's bootstrap policy.
        self._sign(pki, "admin", "/O=system:masters/CN=conveyor-admin", "extendedKeyUsage=clientAuth\n")
        # The aggregation layer's client, so APIService backends (e.g. a metrics adapter) work.
        self._sign(pki, "front-proxy-client", "/CN=front-proxy-client", "extendedKeyUsage=clientAuth\n")

    @staticmethod
    def _sign(pki: Path, name: str, subject: str, extensions: str) -> None:
        (pki / f"{name}.ext").write_text("keyUsage=critical,digitalSignature,keyEncipherment\n" + extensions)
        _openssl("req", "-new", "-key", pki / f"{name}.key", "-subj", subject, "-out", pki / f"{name}.csr")
        _openssl(
            "x509", "-req", "-in", pki / f"{name}.csr", "-CA", pki / "ca.crt", "-CAkey", pki / "ca.key",
            "-CAcreateserial", "-days", "30", "-extfile", pki / f"{name}.ext", "-out", pki / f"{name}.crt",
        )  # fmt: skip

    def _write_kubeconfig(self) -> None:
        pki = self._dir / "pki"

        def b64(name: str) -> str:
            return base64.b64encode((pki / name).read_bytes()).decode()

        # Credentials are embedded so the file still works when copied elsewhere.
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "conveyor-local",
                    "cluster": {"server": self.server, "certificate-authority-data": b64("ca.crt")},
                }
            ],
            "users": [
                {
                    "name": "conveyor-admin",
                    "user": {
                        "client-certificate-data": b64("admin.crt"),
                        "client-key-data": b64("admin.key"),
                    },
                }
            ],
            "contexts": [
                {"name": "conveyor-local", "context": {"cluster": "conveyor-local", "user": "conveyor-admin"}}
            ],
            "current-context": "conveyor-local",
        }
        self.kubeconfig.write_text(json.dumps(kubeconfig, indent=2))
        self.kubeconfig.chmod(0o600)

    def _spawn(self, name: str, command: list[str]) -> None:
        logs = self._dir / "logs"
        logs.mkdir(exist_ok=True)
        log_path = logs / f"{name}.log"
        log_file = log_path.open("wb")
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=self._dir,
            # Own process group, so Ctrl-C in a terminal reaches only our parent, which then
            # stops the components in order.
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.components.append(_Component(name, process, log_path, log_file))

    def _start_etcd(self, bin_dir: Path) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        self._spawn(
            "etcd",
            [
                str(bin_dir / "etcd"),
                "--name=conveyor",
                f"--data-dir={self._dir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=conveyor={peer}",
                # A throw-away store: durability buys nothing and fsync costs seconds on slow disks.
                "--unsafe-no-fsync=true",
                "--quota-backend-bytes=2147483648",
                "--log-level=warn",
            ],
        )

    def _start_apiserver(self, bin_dir: Path) -> None:
        pki = self._dir / "pki"
        self._spawn(
            "kube-apiserver",
            [
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.ports['kube-apiserver']}",
                f"--cert-dir={self._dir / 'apiserver-certs'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--service-account-key-file={pki / 'service-account.pub'}",
                f"--service-account-signing-key-file={pki / 'service-account.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--authorization-mode=RBAC",
                f"--requestheader-client-ca-file={pki / 'ca.crt'}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
                "--allow-privileged=true",
                # One client, no contention: flow control only costs CPU on a small machine.
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                "--v=1",
            ],
        )

    def _start_controllers(self, bin_dir: Path) -> None:
        pki = self._dir / "pki"
        kubeconfig = f"--kubeconfig={self.kubeconfig}"
        common = [
            kubeconfig,
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ]
        self._spawn(
            "kube-controller-manager",
            [
                str(bin_dir / "kube-controller-manager"),
                *common,
                f"--secure-port={self.ports['kube-controller-manager']}",
                f"--cert-dir={self._dir / 'kube-controller-manager-certs'}",
                f"--service-account-private-key-file={pki / 'service-account.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                str(bin_dir / "kube-scheduler"),
                *common,
                f"--secure-port={self.ports['kube-scheduler']}",
                f"--cert-dir={self._dir / 'kube-scheduler-certs'}",
            ],
        )
        kwok_config = self._dir / "kwok.yaml"
        # An explicit configuration keeps a user's ~/.kwok/kwok.yaml out; kind by kind (Node, Pod), with
        # no Stage objects configured kwok applies its built-in node-fast and pod-fast stages.
        documents = ["apiVersion: config.kwok.x-k8s.io/v1alpha1\nkind: KwokConfiguration\noptions: {}\n"]
        if self.process_pods:
            documents += [json.dumps(stage) for stage in kwok_pod_stages(exclude_labels=PROCESS_POD_LABELS)]
        kwok_config.write_text("---\n".join(documents))
        self._spawn(
            "kwok",
            [
                str(bin_dir / "kwok"),
                kubeconfig,
                f"--config={kwok_config}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION[0]}={KWOK_NODE_ANNOTATION[1]}",
                # Lease heartbeats keep the node-lifecycle controller from marking nodes NotReady.
                "--node-lease-duration-seconds=40",
                f"--cidr={POD_CIDR}",
                "--node-ip=127.0.0.1",
            ],
        )

    def _check_running(self) -> None:
        for component in self.components:
            code = component.process.poll()
            if code is not None:
                raise ClusterStartError(f"{component.name} exited with {code}:\n{component.log_tail()}")

    def _log_tail(self, name: str) -> str:
        for component in self.components:
            if component.name == name:
                return f"--- {name} log ---\n{component.log_tail()}"
        return ""

    def _wait_http(self, name: str, url: str, deadline: float) -> None:
        context = None
        if url.startswith("https:"):
            pki = self._dir / "pki"
            context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
            context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        last_error = ""
        while time.monotonic() < deadline:
            self._check_running()
            try:
                with urllib.request.urlopen(url, timeout=2, context=context) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError) as error:
                last_error = str(error)
            time.sleep(0.2)
        raise ClusterStartError(f"{name} not ready at {url}: {last_error}\n{self._log_tail(name)}")

    def _wait_default_service_account(self, namespace: str, deadline: float) -> None:
        # The service-account controller in kube-controller-manager creates it; pods are
        # rejected at admission until it exists.
        while True:
            self._check_running()
            result = self.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False)
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"no default ServiceAccount in {namespace!r}: {result.stderr.strip()}\n"
                    f"{self._log_tail('kube-controller-manager')}"
                )
            time.sleep(0.2)


def go_module_file(module: str, path: str) -> Path:
    """A file of a Go module (`MODULE@VERSION`) as the Go module proxy serves it, cached by Go: the
    third-party CRDs the tests apply (KEDA, the Gateway API Inference Extension)."""
    out = subprocess.run(
        ["go", "mod", "download", "-json", module],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "GOFLAGS": "-mod=mod"},
        cwd="/",
    ).stdout
    return Path(json.loads(out)["Dir"]) / path


def kwok_pod_stages(exclude_labels: Sequence[str]) -> list[dict[str, Any]]:
    """kwok's own pod-fast Stages (ready, complete, delete) from its Go module at the pinned version, each
    selecting only pods that carry none of `exclude_labels`: those pods are left to another kubelet."""
    version = re.search(r"^\s*sigs\.k8s\.io/kwok (v\S+)", KWOK_GO_MOD.read_text(), re.MULTILINE)
    if version is None:
        raise ClusterStartError(f"no sigs.k8s.io/kwok requirement in {KWOK_GO_MOD}")
    stages = []
    for name in KWOK_POD_STAGES:
        path = go_module_file(f"sigs.k8s.io/kwok@{version[1]}", f"kustomize/stage/pod/fast/{name}.yaml")
        stage = yaml.safe_load(path.read_text())
        expressions = stage["spec"].setdefault("selector", {}).setdefault("matchExpressions", [])
        expressions += [
            {"key": f'.metadata.labels["{label}"]', "operator": "DoesNotExist"} for label in exclude_labels
        ]
        stages.append(stage)
    return stages


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _openssl(*args: str | Path) -> None:
    result = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ClusterStartError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child before exec: if the Python process dies without stopping us
    # (SIGKILL, crash), the kernel kills this component too, so nothing is left behind.
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _terminate(process: subprocess.Popen[bytes], grace_seconds: float) -> None:
    if process.poll() is not None:
        return
    # The component leads its own process group (start_new_session): signal the group so
    # that anything it forked goes too.
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(grace_seconds)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _parse_pool(text: str) -> NodePool:
    try:
        product, count, gpus = text.split(":")
        return NodePool(product=product, count=int(count), gpus_per_node=int(gpus))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected PRODUCT:NODES:GPUS_PER_NODE, got {text!r}") from error


def main(argv: Sequence[str] | None = None) -> int:
    """Run a cluster in the foreground until Ctrl-C or SIGTERM, with Prometheus and process-backed pods."""
    from tests.k8s.local_pods import DEFAULT_KV_CACHE_MEMORY, DEFAULT_MAX_SERVER_PROCESSES, LocalPods
    from tests.prometheus import PrometheusServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pool",
        action="append",
        type=_parse_pool,
        metavar="PRODUCT:NODES:GPUS",
        help="simulated GPU node pool, repeatable (default: "
        + ", ".join(f"{p.product}:{p.count}:{p.gpus_per_node}" for p in DEFAULT_NODE_POOLS)
        + ")",
    )
    parser.add_argument("--workdir", type=Path, help="keep certificates, kubeconfig, logs and etcd data here")
    parser.add_argument(
        "--max-server-processes",
        type=int,
        default=DEFAULT_MAX_SERVER_PROCESSES,
        help="server pods of InferenceServices run as local processes, at most this many at once; "
        "0: kwok simulates them too (they run nothing) (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=int,
        default=DEFAULT_KV_CACHE_MEMORY,
        help="KV cache bytes of each server process (default: %(default)s)",
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=5.0,
        help="Prometheus' scrape interval in seconds (default: 5)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # every probe would log a line
    if args.max_server_processes < 0:
        parser.error("--max-server-processes must be >= 0")

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    process_pods = args.max_server_processes > 0
    cluster = LocalCluster(args.pool or DEFAULT_NODE_POOLS, workdir=args.workdir, process_pods=process_pods)
    prometheus: PrometheusServer | None = None
    pods: LocalPods | None = None
    try:
        cluster.start()
        print(cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product,nvidia.com/gpu.count").stdout)
        print(f"Control plane ready in {cluster.startup_seconds:.1f}s; logs in {cluster.workdir}/logs")
        if process_pods:
            prometheus_dir = cluster._dir / "prometheus"
            prometheus_dir.mkdir()
            prometheus = PrometheusServer(prometheus_dir, scrape_interval=args.scrape_interval)
            prometheus.start()
            pods = LocalPods(
                cluster,
                cluster._dir,
                max_server_processes=args.max_server_processes,
                kv_cache_memory=args.kv_cache_memory,
                prometheus=prometheus,
                on_reachable=lambda ns, name, url: print(f"InferenceService {ns}/{name}: {url}", flush=True),
            ).start()
            print(f"Prometheus: {prometheus.url}")
            print(f"Pods of InferenceServices run here as processes (logs in {cluster.workdir}/pods)")
        print("In another shell:\n")
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        print(f"export PATH={cluster.bin_dir}:$PATH\n")
        print("Ctrl-C stops the cluster and deletes its files.", flush=True)
        while True:
            cluster._check_running()
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nstopping", file=sys.stderr)
    except (ClusterStartError, ToolsBuildError, RuntimeError) as error:
        print(error, file=sys.stderr)
        return 1
    finally:
        if pods is not None:
            pods.stop()
        if prometheus is not None:
            prometheus.stop()
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
