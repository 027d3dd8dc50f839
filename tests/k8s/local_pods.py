"""Process-backed pods: the local cluster's kubelet for the pods of InferenceServices.

kwok simulates every pod on the local cluster's GPU nodes, but on a cluster started with
`LocalCluster(process_pods=True)` it leaves the server and router pods of InferenceServices alone
(`cluster.PROCESS_POD_LABELS`), and `LocalPods` runs them for real:

- **Start.** For each such pod bound to a node, the container's command and args (the `conveyor serve`
  or `conveyor router` the operator rendered) run as a local process on 127.0.0.1 and a free port, with
  GPU-specific flags mapped to CPU equivalents (`local_command`, every mapping logged): tensor
  parallelism to one rank, `--gpu-memory-utilization` to a `--kv-cache-memory` pool, a half dtype to
  the CPU's own `auto` choice, and a model that is not on this machine to the embedded SmolLM2-135M.
  The pod gets an IP of its own (10.245.0.0/16, never routed: only the local forwarders and Prometheus
  know where the process listens), phase Running and a container status naming the PID.
- **Probes** (`ContainerProbes`, the kubelet's rules): the startup probe first (every second here, for
  at most its period x failure threshold, then the process is killed), then readiness and liveness. The
  pod turns Ready only when the readiness probe's path answers 200 (probed every second until it does,
  then at its own period, not Ready after failure-threshold misses); failure-threshold liveness misses
  in a row kill the process (a Warning Event `Unhealthy` says why), which then restarts as below.
- **Restarts.** A process that exits makes the pod not Ready, its container status records the exit
  (`lastState.terminated`) and the restart count, and it is started again after a back-off (1 s, doubling
  to 30 s; the kubelet's starts at 10 s).
- **Environment.** Each start resolves the container's env as the kubelet does (`container_env`):
  `envFrom` (with its prefix; keys that are not valid names skipped), then `env` values and
  `valueFrom` (`secretKeyRef`, `configMapKeyRef`, `fieldRef`), later names winning. A missing Secret,
  ConfigMap or key that is not `optional` leaves the container waiting with reason
  `CreateContainerConfigError` (the pod stays Pending) and is retried until it appears.
- **Limits.** At most `max_server_processes` server processes live at once (2 cores hold about 3); the
  pods beyond stay Pending with container reason `LocalProcessLimit` and start, oldest first, when a
  slot frees. Router processes (a tokenizer and a proxy) do not count.
- **Deletion.** A pod being deleted gets SIGTERM, then SIGKILL after its grace period, and is removed
  from the API once its process has exited; a pod that vanished has its process killed.
- **Monitoring.** Every live process is a Prometheus target (file-based service discovery) with the
  labels a ServiceMonitor gives: namespace, pod, service, endpoint, container, job, instance.
- **Traffic.** Each InferenceService gets a loopback forwarder (`forwarder.Forwarders`) to its ready
  router processes when it has a router, else to its ready server processes; `on_reachable` is told its
  URL the first time it has a backend, and the forwarder closes when the InferenceService is deleted.
  Router processes read their replicas from a file this runner rewrites (`--endpoint-file`) instead of
  EndpointSlices, whose addresses no process here listens on.

- **ConfigMap volumes.** A container's mounts of `configMap` volumes are projected into a directory
  of the pod's (`<workdir>/volumes/...`), one file per key, and arguments naming a path under the mount
  point are rewritten to it. A missing ConfigMap that is not `optional` keeps the container waiting
  (`ContainerCreating`, the kubelet's FailedMount) until it appears. While the process runs, its files
  follow the ConfigMap (each changed file replaced atomically, as the kubelet's symlink swap is; here
  within a tick, where the kubelet takes up to about a minute).

Only httpGet probes are run (the operator renders no other kind); init containers, sidecars and other
volumes are not modelled: env values pointing into a volume mount are dropped, so caches go to the
host's defaults, shared by every pod (the embedded model is converted once); `resourceFieldRef` and
`$(VAR)` expansion are not resolved.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from tests.k8s.cluster import PROCESS_POD_LABELS, LocalCluster, free_port
from tests.k8s.forwarder import Forwarders

logger = logging.getLogger("conveyor.local_pods")

LABEL_INFERENCE_SERVICE, LABEL_ROUTER = PROCESS_POD_LABELS
ISVC_GROUP, ISVC_VERSION, ISVC_PLURAL = "serving.conveyor.dev", "v1alpha1", "inferenceservices"
DEFAULT_MAX_SERVER_PROCESSES = 3
DEFAULT_KV_CACHE_MEMORY = 512 << 20
POD_IP_PREFIX = "10.245"
LIMIT_REASON = "LocalProcessLimit"
UNSUPPORTED_REASON = "UnsupportedCommand"
FIRST_PROBE_PERIOD = 1.0
BACKOFF_START, BACKOFF_MAX = 1.0, 30.0
HALF_DTYPES = ("float16", "bfloat16", "half")
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
CONFIG_ERROR_REASON = "CreateContainerConfigError"


class UnsupportedPodError(ValueError):
    """The pod's container is not a `conveyor serve` or `conveyor router` this runner can start."""


@dataclass(frozen=True)
class LocalCommand:
    """How one container runs here: `argv` and what was mapped (logged)."""

    kind: str  # "server" or "router"
    argv: list[str]
    notes: list[str]


def model_available(model: str) -> bool:
    """Whether `model` (a path or hub id) can be loaded here without a download: an existing path, or a
    hub id whose config.json is in the local Hugging Face cache."""
    if Path(model).exists():
        return True
    if model.startswith(("/", ".")) or model.count("/") != 1:
        return False
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model, "config.json"), str)


def local_command(
    container: dict[str, Any],
    port: int,
    *,
    conveyor: str,
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
    endpoint_file: Path | None = None,
    available: Callable[[str], bool] = model_available,
) -> LocalCommand:
    """Map a pod's container (API JSON) to a local process listening on 127.0.0.1:`port`.

    `conveyor`: the executable to run for the container's `conveyor`. `endpoint_file`: where a router
    reads its replicas. Raises UnsupportedPodError for any other command.
    """
    command = [*(container.get("command") or []), *(container.get("args") or [])]
    if len(command) < 2 or Path(command[0]).name != "conveyor" or command[1] not in ("serve", "router"):
        raise UnsupportedPodError(f"not a conveyor server or router: {' '.join(command)[:200]!r}")
    kind = "server" if command[1] == "serve" else "router"
    args, notes = list(command[2:]), []
    _set_flag(args, "--host", "127.0.0.1")
    _set_flag(args, "--port", str(port))
    if kind == "server":
        if args and not args[0].startswith("-") and not available(args[0]):
            notes.append(
                f"model {args[0]} is not on this machine: serving the embedded SmolLM2-135M-Instruct"
            )
            args.pop(0)
        tensor_parallel = _get_flag(args, "--tensor-parallel-size")
        if tensor_parallel not in (None, "1"):
            _set_flag(args, "--tensor-parallel-size", "1")
            notes.append(f"--tensor-parallel-size {tensor_parallel} -> 1 (one CPU process)")
        utilization = _get_flag(args, "--gpu-memory-utilization")
        if utilization is not None:
            _set_flag(args, "--gpu-memory-utilization", None)
        if _get_flag(args, "--kv-cache-memory") is None:
            _set_flag(args, "--kv-cache-memory", str(kv_cache_memory))
            notes.append(
                f"--gpu-memory-utilization {utilization or 'default'} -> --kv-cache-memory {kv_cache_memory}"
            )
        dtype = _get_flag(args, "--dtype")
        if dtype in HALF_DTYPES:
            _set_flag(args, "--dtype", "auto")
            notes.append(f"--dtype {dtype} -> auto (bfloat16 only where this CPU computes it natively)")
    else:
        service = _get_flag(args, "--service")
        if service is not None:
            if endpoint_file is None:
                raise UnsupportedPodError("a router reading EndpointSlices needs an endpoint file here")
            _set_flag(args, "--service", None)
            _set_flag(args, "--service-port-name", None)
            _set_flag(args, "--endpoint-file", str(endpoint_file))
            notes.append(
                f"--service {service} -> --endpoint-file {endpoint_file} (the ready server processes)"
            )
        tokenizer = _get_flag(args, "--tokenizer")
        if tokenizer is not None and not available(tokenizer):
            _set_flag(args, "--tokenizer", None)
            notes.append(
                f"tokenizer {tokenizer} is not on this machine: the embedded SmolLM2-135M-Instruct's"
            )
    return LocalCommand(kind, [conveyor, command[1], *args], notes)


class ContainerConfigError(ValueError):
    """An env source the container needs is missing (the kubelet's CreateContainerConfigError)."""


def container_env(
    container: dict[str, Any],
    pod: dict[str, Any],
    read: Callable[[str, str, str], dict[str, Any] | None],
) -> tuple[dict[str, str], list[str]]:
    """The environment the kubelet gives `container` (API JSON) of `pod`, and what was left out.

    `read(kind, namespace, name)` returns a "ConfigMap" or "Secret" (API JSON) or None when it does
    not exist. As the kubelet does: `envFrom` sources first (with their `prefix`; keys that are not
    valid variable names skipped), then `env` in order, later names overriding earlier ones; `value`,
    `valueFrom` `secretKeyRef`, `configMapKeyRef` and `fieldRef` (metadata name, namespace, uid,
    labels['k'], annotations['k'], spec nodeName and serviceAccountName, status podIP and hostIP)
    are resolved, Secret data base64-decoded. Here only: a value that points into one of the
    container's volume mounts is left out (the volume is not modelled, so the host's default
    applies), and so are `resourceFieldRef` and `$(VAR)` references (noted).
    Raises ContainerConfigError for a missing, non-optional ConfigMap, Secret or key.
    """
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    notes: list[str] = []

    def data(kind: str, name: str, optional: bool) -> dict[str, str] | None:
        found = read(kind, namespace, name)
        if found is None:
            if optional:
                return None
            raise ContainerConfigError(f'{kind.lower()} "{name}" not found')
        if kind == "Secret":
            return {k: base64.b64decode(v).decode() for k, v in (found.get("data") or {}).items()}
        return dict(found.get("data") or {})

    for source in container.get("envFrom") or []:
        kind, ref = (
            ("Secret", source["secretRef"])
            if "secretRef" in source
            else ("ConfigMap", source["configMapRef"])
        )
        for key, value in (data(kind, ref["name"], ref.get("optional", False)) or {}).items():
            name = source.get("prefix", "") + key
            if ENV_NAME.fullmatch(name):
                env[name] = value
            else:
                notes.append(
                    f"envFrom {kind.lower()} {ref['name']}: {name!r} is not a variable name: skipped"
                )
    mounts = [m["mountPath"].rstrip("/") for m in container.get("volumeMounts") or []]
    for variable in container.get("env") or []:
        name, source = variable["name"], variable.get("valueFrom")
        if source is None:
            value = variable.get("value", "")
        elif "fieldRef" in source:
            value = _field(pod, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source or "configMapKeyRef" in source:
            kind, ref = (
                ("Secret", source["secretKeyRef"])
                if "secretKeyRef" in source
                else ("ConfigMap", source["configMapKeyRef"])
            )
            values = data(kind, ref["name"], ref.get("optional", False))
            if values is None:
                continue
            if ref["key"] not in values:
                if ref.get("optional", False):
                    continue
                raise ContainerConfigError(
                    f"couldn't find key {ref['key']} in {kind} {namespace}/{ref['name']}"
                )
            value = values[ref["key"]]
        else:
            notes.append(f"env {name}: {', '.join(source)} is not resolved here")
            continue
        if any(value == m or value.startswith(m + "/") for m in mounts):
            notes.append(f"env {name}={value} is in a volume: left to this machine's default")
            continue
        if "$(" in value:
            notes.append(f"env {name}: $(VAR) references are not expanded here")
        env[name] = value
    return env, notes


def _field(pod: dict[str, Any], path: str) -> str:
    """A pod field for `fieldRef` (the paths the downward API allows for env)."""
    meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
    if match := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path):
        return (meta.get(match[1]) or {}).get(match[2], "")
    fields = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
    }
    if path not in fields:
        raise ContainerConfigError(f"unsupported fieldRef fieldPath {path!r}")
    return fields[path]


def _get_flag(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1] if i + 1 < len(args) else None
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _set_flag(args: list[str], name: str, value: str | None) -> None:
    """Replace every `name VALUE` / `name=VALUE` in `args` by one `name value` (None: remove them)."""
    i, found = 0, False
    while i < len(args):
        if args[i] == name or args[i].startswith(name + "="):
            width = 2 if args[i] == name else 1
            del args[i : i + width]
            if value is not None and not found:
                args[i:i] = [name, value]
                i += 2
            found = True
        else:
            i += 1
    if value is not None and not found:
        args += [name, value]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class ProbeSpec:
    """One httpGet probe of a container spec; seconds, with the kubelet's defaults for absent fields."""

    path: str
    period: float = 10.0
    timeout: float = 1.0
    failure_threshold: int = 3

    @classmethod
    def of(cls, container: dict[str, Any], kind: str) -> ProbeSpec | None:
        """The container's `startupProbe`, `readinessProbe` or `livenessProbe`; None when absent."""
        probe = container.get(f"{kind}Probe")
        if not probe:
            return None
        return cls(
            path=(probe.get("httpGet") or {}).get("path", "/"),
            period=float(probe.get("periodSeconds", 10)),
            timeout=float(probe.get("timeoutSeconds", 1)),
            failure_threshold=int(probe.get("failureThreshold", 3)),
        )


class ContainerProbes:
    """The kubelet's probe rules for one run of a container, kept pure: results in, verdicts out.

    Until the startup probe succeeds nothing else is probed, and the run is killed when it has not
    succeeded within period x failure threshold seconds of `started_at` (probed every `fast_period`
    here, not at its period, so that a pod is Ready as soon as its server is). Then the readiness probe
    decides `ready` (every `fast_period` until it succeeds, then at its period; not ready after
    failure-threshold misses in a row) and failure-threshold liveness misses in a row kill the run.
    An absent probe passes: no startup probe means started, no readiness probe means ready once started.
    """

    KINDS = ("startup", "readiness", "liveness")

    def __init__(self, container: dict[str, Any], started_at: float, fast_period: float = 1.0) -> None:
        self.specs = {kind: ProbeSpec.of(container, kind) for kind in self.KINDS}
        self.started_at, self.fast_period = started_at, fast_period
        self.started = self.specs["startup"] is None
        self.ready = self.started and self.specs["readiness"] is None
        self.failures = dict.fromkeys(self.KINDS, 0)
        self.next_at = dict.fromkeys(self.KINDS, started_at + fast_period)
        self.killed: str | None = None

    def due(
        self, now: float, in_flight: set[str] | frozenset[str] = frozenset()
    ) -> list[tuple[str, ProbeSpec]]:
        """The probes to send at `now` (monotonic seconds), leaving out those already `in_flight`."""
        if self.killed is not None:
            return []
        kinds = ["readiness", "liveness"] if self.started else ["startup"]
        return [
            (kind, spec)
            for kind in kinds
            if (spec := self.specs[kind]) is not None and kind not in in_flight and now >= self.next_at[kind]
        ]

    def record(self, kind: str, ok: bool, now: float) -> str | None:
        """Take one probe's result; returns why the run must be killed, else None."""
        spec = self.specs[kind]
        assert spec is not None, kind
        self.failures[kind] = 0 if ok else self.failures[kind] + 1
        if kind == "startup":
            if ok:
                self.started, self.ready = True, self.specs["readiness"] is None
                self.next_at.update(readiness=now, liveness=now + self._period("liveness"))
            self.next_at[kind] = now + self.fast_period
        elif kind == "readiness":
            if ok:
                self.ready = True
            elif self.failures[kind] >= spec.failure_threshold:
                self.ready = False
            self.next_at[kind] = now + (spec.period if self.ready else self.fast_period)
        else:
            self.next_at[kind] = now + spec.period
            if self.failures[kind] >= spec.failure_threshold:
                return self._kill(f"Liveness probe failed {self.failures[kind]} times in a row")
        return self.overdue(now)

    def overdue(self, now: float) -> str | None:
        """Why the run must be killed at `now` because its startup probe has not passed in time."""
        spec = self.specs["startup"]
        if self.started or spec is None or self.killed is not None:
            return None
        budget = spec.period * spec.failure_threshold
        if now - self.started_at > budget:
            return self._kill(f"Startup probe did not succeed within {budget:g}s")
        return None

    def _period(self, kind: str) -> float:
        spec = self.specs[kind]
        return spec.period if spec is not None else 0.0

    def _kill(self, why: str) -> str:
        self.killed, self.ready = why, False
        return why


@dataclass
class LocalPod:
    """One process-backed pod: what runs for it and what its status says."""

    namespace: str
    name: str
    uid: str
    isvc: str
    container: dict[str, Any]
    ip: str
    created: str
    manifest: dict[str, Any] = field(repr=False)
    command: LocalCommand | None = None
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    started_at: str | None = None
    restart_count: int = 0
    last_terminated: dict[str, Any] | None = None
    restart_at: float | None = None
    ready: bool = False
    probes: ContainerProbes | None = None
    in_flight: dict[str, Future[bool]] = field(default_factory=dict, repr=False)
    terminating_since: float | None = None
    grace_seconds: float = 30.0
    waiting: tuple[str, str] | None = None
    reported: dict[str, Any] | None = field(default=None, repr=False)
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict, repr=False)
    # ConfigMap volumes mounted: (ConfigMap name, optional, the local directory standing for the mount)
    config_maps: list[tuple[str, bool, Path]] = field(default_factory=list, repr=False)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def kind(self) -> str:
        return self.command.kind if self.command else "server"


class LocalPods:
    """Runs the InferenceService pods of `cluster` (started with `process_pods=True`) as processes.

    `prometheus`: a `tests.prometheus.PrometheusServer` whose targets follow the live processes.
    `on_reachable(namespace, name, url)`: called once per InferenceService when its URL first has a
    backend. `start()` runs a reconcile loop in a daemon thread every `interval` seconds; `stop()` ends
    every process and forwarder.
    """

    def __init__(
        self,
        cluster: LocalCluster,
        workdir: Path,
        *,
        max_server_processes: int = DEFAULT_MAX_SERVER_PROCESSES,
        kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY,
        prometheus: Any | None = None,
        on_reachable: Callable[[str, str, str], None] | None = None,
        interval: float = 0.5,
    ) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.max_server_processes = max_server_processes
        self.kv_cache_memory = kv_cache_memory
        self.prometheus = prometheus
        self.on_reachable = on_reachable
        self.interval = interval
        self.conveyor = shutil.which("conveyor", path=str(Path(sys.executable).parent)) or "conveyor"
        self.pods: dict[str, LocalPod] = {}
        self.urls: dict[str, str] = {}
        self.forwarders = Forwarders()
        self._ips = (f"{POD_IP_PREFIX}.{n // 250}.{n % 250 + 2}" for n in itertools.count())
        self._probes = ThreadPoolExecutor(max_workers=8, thread_name_prefix="probes")
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="local-pods", daemon=True)
        self._targets: list[tuple[str, dict[str, str]]] | None = None
        self._endpoint_files: dict[str, str] = {}
        self._lock = threading.Lock()
        (workdir / "pods").mkdir(parents=True, exist_ok=True)
        (workdir / "endpoints").mkdir(parents=True, exist_ok=True)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> LocalPods:
        from kubernetes import client, config

        self._core = client.CoreV1Api(config.new_client_from_config(config_file=str(self.cluster.kubeconfig)))
        self._custom = client.CustomObjectsApi(self._core.api_client)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop, then every process (SIGTERM, SIGKILL after 10 s) and every forwarder."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        with self._lock:
            for pod in self.pods.values():
                _signal(pod, signal.SIGTERM)
            deadline = time.monotonic() + 10
            for pod in self.pods.values():
                if pod.process is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        pod.process.wait(max(0.1, deadline - time.monotonic()))
                    _signal(pod, signal.SIGKILL)
                    pod.process.wait()
            self.pods.clear()
        self.forwarders.stop()
        self._probes.shutdown(wait=False, cancel_futures=True)
        if self.prometheus is not None:
            self.prometheus.set_targets([])

    def pids(self) -> dict[str, int]:
        """PID of each live process, by pod `namespace/name`."""
        with self._lock:
            return {p.key: p.process.pid for p in self.pods.values() if p.alive and p.process is not None}

    def wait_url(self, namespace: str, name: str, timeout: float = 120.0) -> str:
        """The InferenceService's loopback URL, once it has a ready backend."""
        deadline = time.monotonic() + timeout
        while (url := self.urls.get(f"{namespace}/{name}")) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no ready backend for {namespace}/{name} after {timeout:.0f}s")
            time.sleep(0.2)
        return url

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                with self._lock:
                    self._reconcile()
            except Exception:  # an API hiccup: logged, the next tick retries from what the API says
                logger.exception("local pods: reconcile failed")
            self._stopped.wait(self.interval)

    def _reconcile(self) -> None:
        listed = json.loads(self._core.list_pod_for_all_namespaces(_preload_content=False).data)["items"]
        bound = {
            p["metadata"]["uid"]: p
            for p in listed
            if p["spec"].get("nodeName")
            and any(k in p["metadata"].get("labels", {}) for k in PROCESS_POD_LABELS)
        }
        for uid in [uid for uid in self.pods if uid not in bound]:
            pod = self.pods.pop(uid)
            logger.info("pod %s is gone: killing its process", pod.key)
            _signal(pod, signal.SIGKILL)
        for uid, manifest in bound.items():
            if uid not in self.pods:
                self.pods[uid] = self._adopt(manifest)
            pod = self.pods[uid]
            if manifest["metadata"].get("deletionTimestamp"):
                self._terminate(pod)
        for pod in self.pods.values():
            if pod.config_maps and pod.alive and pod.terminating_since is None:
                self._project(pod)
        self._supervise()
        self._start_waiting()
        for pod in list(self.pods.values()):
            if pod.terminating_since is None:
                self._report(pod)
        self._publish()

    def _adopt(self, manifest: dict[str, Any]) -> LocalPod:
        meta, spec = manifest["metadata"], manifest["spec"]
        labels = meta.get("labels", {})
        pod = LocalPod(
            namespace=meta["namespace"],
            name=meta["name"],
            uid=meta["uid"],
            isvc=labels.get(LABEL_INFERENCE_SERVICE) or labels[LABEL_ROUTER],
            container=spec["containers"][0],
            ip=next(self._ips),
            created=meta.get("creationTimestamp", ""),
            manifest=manifest,
            grace_seconds=float(spec.get("terminationGracePeriodSeconds", 30)),
        )
        pod.port = free_port()
        try:
            pod.command = local_command(
                pod.container,
                pod.port,
                conveyor=self.conveyor,
                kv_cache_memory=self.kv_cache_memory,
                endpoint_file=self._endpoint_file(pod.namespace, pod.isvc),
            )
        except UnsupportedPodError as error:
            pod.waiting = (UNSUPPORTED_REASON, str(error))
            logger.warning("pod %s: %s", pod.key, error)
            return pod
        self._mount_config_maps(pod, spec)
        for note in pod.command.notes:
            logger.info("pod %s: %s", pod.key, note)
        return pod

    def _mount_config_maps(self, pod: LocalPod, spec: dict[str, Any]) -> None:
        """Give each configMap volume the container mounts a local directory, and point the arguments
        under its mount path there."""
        assert pod.command is not None
        volumes = {v["name"]: v["configMap"] for v in spec.get("volumes") or [] if "configMap" in v}
        for mount in pod.container.get("volumeMounts") or []:
            source = volumes.get(mount["name"])
            if source is None:
                continue
            local = self.workdir / "volumes" / f"{pod.namespace}_{pod.name}" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            pod.config_maps.append((source["name"], bool(source.get("optional")), local))
            path = mount["mountPath"].rstrip("/")
            argv = pod.command.argv
            for i, arg in enumerate(argv):
                if arg == path or arg.startswith(path + "/"):
                    argv[i] = str(local) + arg[len(path) :]
                    pod.command.notes.append(f"{arg} -> {argv[i]} (ConfigMap {source['name']})")

    def _project(self, pod: LocalPod) -> str | None:
        """Write the pod's ConfigMaps into their directories (only files that changed, each replaced
        whole); the kubelet's FailedMount message when one that is not optional is missing."""
        for name, optional, local in pod.config_maps:
            config_map = self._read("ConfigMap", pod.namespace, name)
            if config_map is None and not optional:
                return f'MountVolume.SetUp failed: configmap "{name}" not found'
            data = (config_map or {}).get("data") or {}
            for stale in [f for f in local.iterdir() if f.name not in data and not f.name.startswith(".")]:
                stale.unlink()
            for key, value in data.items():
                target = local / key
                if not target.is_file() or target.read_text() != value:
                    tmp = local / f".{key}.tmp"
                    tmp.write_text(value)
                    tmp.replace(target)
        return None

    def _endpoint_file(self, namespace: str, isvc: str) -> Path:
        return self.workdir / "endpoints" / f"{namespace}_{isvc}.txt"

    def _start_waiting(self) -> None:
        servers = sum(1 for p in self.pods.values() if p.kind == "server" and p.process is not None)
        for pod in sorted(self.pods.values(), key=lambda p: p.created):
            if pod.command is None or pod.process is not None or pod.terminating_since is not None:
                continue
            if pod.kind == "server" and servers >= self.max_server_processes:
                pod.waiting = (
                    LIMIT_REASON,
                    f"{servers} server processes already run on this machine (at most "
                    f"{self.max_server_processes}); starts when one ends",
                )
                continue
            servers += pod.kind == "server"
            self._spawn(pod)

    def _read(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        read = (
            self._core.read_namespaced_secret if kind == "Secret" else self._core.read_namespaced_config_map
        )
        try:
            return json.loads(read(name, namespace, _preload_content=False).data)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def _spawn(self, pod: LocalPod) -> None:
        """Start the pod's process, with the environment as the kubelet resolves it at each start."""
        assert pod.command is not None
        fields = {**pod.manifest, "status": {"podIP": pod.ip, "hostIP": "127.0.0.1"}}
        try:
            env, notes = container_env(pod.container, fields, self._read)
        except ContainerConfigError as error:
            if pod.waiting != (CONFIG_ERROR_REASON, str(error)):
                logger.warning("pod %s: %s: %s", pod.key, CONFIG_ERROR_REASON, error)
                pod.waiting = (CONFIG_ERROR_REASON, str(error))
            return
        for note in notes:
            logger.info("pod %s: %s", pod.key, note)
        mount_error = self._project(pod)
        if mount_error is not None:
            if pod.waiting != ("ContainerCreating", mount_error):
                logger.warning("pod %s: %s", pod.key, mount_error)
                pod.waiting = ("ContainerCreating", mount_error)
            return
        pod.log_path = self.workdir / "pods" / f"{pod.namespace}_{pod.name}.log"
        with pod.log_path.open("ab") as log:
            log.write(f"--- {_now()} {' '.join(pod.command.argv)}\n".encode())
            log.flush()
            pod.process = subprocess.Popen(
                pod.command.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env, "PYTHONSAFEPATH": "1"},
                cwd=self.workdir,
                start_new_session=True,
            )
        pod.started_at, pod.waiting, pod.restart_at = _now(), None, None
        pod.probes = ContainerProbes(pod.container, time.monotonic(), FIRST_PROBE_PERIOD)
        pod.ready, pod.in_flight = pod.probes.ready, {}  # results for the previous run are dropped
        logger.info("pod %s: started pid %d on 127.0.0.1:%d", pod.key, pod.process.pid, pod.port)

    def _supervise(self) -> None:
        now = time.monotonic()
        for uid, pod in list(self.pods.items()):
            if pod.process is None:
                continue
            code = pod.process.poll()
            if pod.terminating_since is not None:
                if code is None and now - pod.terminating_since > pod.grace_seconds:
                    _signal(pod, signal.SIGKILL)
                elif code is not None:
                    logger.info("pod %s: process exited (%d) after deletion: removing the pod", pod.key, code)
                    with contextlib.suppress(Exception):
                        self._core.delete_namespaced_pod(pod.name, pod.namespace, grace_period_seconds=0)
                    del self.pods[uid]
                continue
            if code is not None and pod.restart_at is None:
                backoff = min(BACKOFF_MAX, BACKOFF_START * 2**pod.restart_count)
                pod.last_terminated = {
                    "exitCode": code if code >= 0 else 128 - code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": pod.started_at,
                    "finishedAt": _now(),
                    "containerID": f"local://{pod.process.pid}",
                }
                pod.restart_count += 1
                pod.ready, pod.restart_at = False, now + backoff
                pod.waiting = ("CrashLoopBackOff", f"back-off {backoff:g}s restarting failed container")
                logger.warning("pod %s: process exited with %d; restarting in %gs", pod.key, code, backoff)
            elif code is not None and pod.restart_at is not None and now >= pod.restart_at:
                self._spawn(pod)
            elif code is None:
                self._probe(pod, now)

    def _probe(self, pod: LocalPod, now: float) -> None:
        probes = pod.probes
        assert probes is not None
        was_ready, kill = pod.ready, None
        for kind, future in list(pod.in_flight.items()):
            if future.done():
                del pod.in_flight[kind]
                kill = probes.record(kind, future.result(), now) or kill
        kill = kill or probes.overdue(now)
        pod.ready = probes.ready
        if pod.ready != was_ready:
            logger.info("pod %s: %s", pod.key, "ready" if pod.ready else "readiness probe failed: not ready")
        if kill is not None:
            logger.warning("pod %s: %s: killing pid %d", pod.key, kill, pod.process.pid)  # type: ignore[union-attr]
            self._event(pod, "Unhealthy", f"{kill}: container {pod.container['name']} will be restarted")
            _signal(pod, signal.SIGKILL)
            return
        for kind, spec in probes.due(now, set(pod.in_flight)):
            url = f"http://127.0.0.1:{pod.port}{spec.path}"
            pod.in_flight[kind] = self._probes.submit(_get_ok, url, spec.timeout)

    def _event(self, pod: LocalPod, reason: str, message: str) -> None:
        """A Warning Event on the pod, from the kubelet as `kubectl describe pod` shows it."""
        now = _now()
        body = {
            "metadata": {"generateName": f"{pod.name}.", "namespace": pod.namespace},
            "involvedObject": {"kind": "Pod", "namespace": pod.namespace, "name": pod.name, "uid": pod.uid},
            "reason": reason,
            "message": message,
            "type": "Warning",
            "source": {"component": "kubelet", "host": "local"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._core.create_namespaced_event(pod.namespace, body)
        except Exception:  # an Event is informative only: the kill goes ahead
            logger.exception("pod %s: could not record Event %s", pod.key, reason)

    def _terminate(self, pod: LocalPod) -> None:
        if pod.terminating_since is not None:
            return
        pod.terminating_since = time.monotonic()
        pod.ready = False
        if pod.alive:
            logger.info("pod %s: deleted: SIGTERM to pid %d", pod.key, pod.process.pid)  # type: ignore[union-attr]
            _signal(pod, signal.SIGTERM)
        elif pod.process is None:  # nothing ever ran (limit, unsupported): nothing to wait for
            with contextlib.suppress(Exception):
                self._core.delete_namespaced_pod(pod.name, pod.namespace, grace_period_seconds=0)
            del self.pods[pod.uid]

    # -- what the API and the host see -----------------------------------------------------

    def _status(self, pod: LocalPod) -> dict[str, Any]:
        running = pod.alive
        container: dict[str, Any] = {
            "name": pod.container["name"],
            "image": pod.container.get("image", ""),
            "imageID": "",
            "ready": pod.ready,
            "started": running,
            "restartCount": pod.restart_count,
        }
        if running and pod.process is not None:
            container["containerID"] = f"local://{pod.process.pid}"
            container["state"] = {"running": {"startedAt": pod.started_at}}
        else:
            reason, message = pod.waiting or ("ContainerCreating", "")
            container["state"] = {"waiting": {"reason": reason, "message": message}}
        if pod.last_terminated:
            container["lastState"] = {"terminated": pod.last_terminated}
        started = pod.process is not None
        ready = "True" if pod.ready else "False"
        conditions = [
            {"type": "PodScheduled", "status": "True"},
            {"type": "PodReadyToStartContainers", "status": "True" if started else "False"},
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": ready},
            {"type": "Ready", "status": ready},
        ]
        if not pod.ready:
            reason = pod.waiting[0] if pod.waiting and not started else "ContainersNotReady"
            for condition in conditions[3:]:
                condition.update(
                    reason=reason, message=f"containers with unready status: [{pod.container['name']}]"
                )
        status: dict[str, Any] = {
            "phase": "Running" if started else "Pending",
            "conditions": conditions,
            "containerStatuses": [container],
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
        }
        if started:
            status.update(podIP=pod.ip, podIPs=[{"ip": pod.ip}], startTime=pod.started_at)
        return status

    def _report(self, pod: LocalPod) -> None:
        """Patch the pod's status when anything but a timestamp changed since the last patch."""
        status = self._status(pod)
        if status == pod.reported:
            return
        now = _now()
        body = json.loads(json.dumps(status))
        for condition in body["conditions"]:
            # A condition keeps its transition time while its status stays.
            kept = pod.transitions.get(condition["type"])
            if kept is None or kept[0] != condition["status"]:
                kept = pod.transitions[condition["type"]] = (condition["status"], now)
            condition["lastTransitionTime"] = kept[1]
        self._core.patch_namespaced_pod_status(
            pod.name, pod.namespace, {"status": body}, _content_type="application/merge-patch+json"
        )
        pod.reported = status

    def _publish(self) -> None:
        live = [p for p in self.pods.values() if p.alive and p.terminating_since is None]
        if self.prometheus is not None:
            targets = [
                (
                    f"127.0.0.1:{p.port}",
                    {
                        "namespace": p.namespace,
                        "pod": p.name,
                        "container": p.container["name"],
                        "service": p.isvc if p.kind == "server" else f"{p.isvc}-router",
                        "endpoint": "http",
                        "job": p.isvc if p.kind == "server" else f"{p.isvc}-router",
                        "instance": f"{p.ip}:{_container_port(p.container)}",
                    },
                )
                for p in sorted(live, key=lambda p: p.key)
            ]
            if targets != self._targets:
                self.prometheus.set_targets(targets)
                self._targets = targets
        ready: dict[tuple[str, str, str], list[LocalPod]] = {}
        for pod in live:
            if pod.ready:
                ready.setdefault((pod.namespace, pod.isvc, pod.kind), []).append(pod)
        isvcs = self._inference_services()
        for namespace, name in isvcs:
            servers = ready.get((namespace, name, "server"), [])
            text = "".join(f"http://127.0.0.1:{p.port}\n" for p in sorted(servers, key=lambda p: p.name))
            path = self._endpoint_file(namespace, name)
            if self._endpoint_files.get(str(path)) != text:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(text)
                tmp.replace(path)
                self._endpoint_files[str(path)] = text
            has_router = any(
                p.isvc == name and p.namespace == namespace and p.kind == "router" for p in self.pods.values()
            )
            backends = ready.get((namespace, name, "router" if has_router else "server"), [])
            key = f"{namespace}/{name}"
            if backends or key in self.urls:
                port = self.forwarders.expose(key, [("127.0.0.1", p.port) for p in backends])
                if key not in self.urls:
                    self.urls[key] = f"http://127.0.0.1:{port}"
                    if self.on_reachable is not None:
                        self.on_reachable(namespace, name, self.urls[key])
        for key in [k for k in self.urls if tuple(k.split("/", 1)) not in isvcs]:
            self.forwarders.close(key)
            del self.urls[key]

    def _inference_services(self) -> set[tuple[str, str]]:
        from kubernetes.client.exceptions import ApiException

        try:
            listed = self._custom.list_cluster_custom_object(ISVC_GROUP, ISVC_VERSION, ISVC_PLURAL)
        except ApiException as error:
            if error.status == 404:  # the CRD is not installed yet
                return set()
            raise
        return {(i["metadata"]["namespace"], i["metadata"]["name"]) for i in listed["items"]}


def _container_port(container: dict[str, Any]) -> int:
    ports = container.get("ports") or [{}]
    return int(ports[0].get("containerPort", 8000))


def _get_ok(url: str, timeout: float) -> bool:
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _signal(pod: LocalPod, signum: int) -> None:
    """Signal the pod's process group (the server's tensor-parallel ranks and compilers go too)."""
    if pod.process is not None and pod.process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pod.process.pid, signum)
