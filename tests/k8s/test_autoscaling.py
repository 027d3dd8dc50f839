"""The builtin autoscaler against the local control plane and a real Prometheus, and the hpa / keda
engines against the real API server with the real CRDs.

kwok's pods run no containers, so each Ready pod's `/metrics` is served by a prometheus_client exporter
in this process that carries the server's series the operator reads (`conveyor:num_requests_waiting`,
running requests, the TTFT histogram with no request yet, KV-cache usage) and is scraped
by Debian's Prometheus with the pod's `namespace` and `pod` as target labels, as a ServiceMonitor
would attach them. That exporter is the only stand-in: the operator (a real process), its queries,
the scale subresource and status are all real. tests/e2e/test_local_cluster_e2e.py closes the loop
with real `conveyor serve` and `conveyor router` processes as the pods.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest

from conveyor.operator.render import KedaSettings, Owner, render_scaled_object
from conveyor.operator.spec import parse_spec
from tests.k8s.cluster import LocalCluster, go_module_file
from tests.k8s.operator_env import CRD_PATH, ISVC_LABEL, Env, Operator, SilentServer, container_args, isvc
from tests.prometheus import PrometheusServer

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

KEDA_MODULE = "github.com/kedacore/keda/v2@v2.21.0"
ROUTER_LABEL = "serving.conveyor.dev/router"
KEDA_CRD = "config/crd/bases/keda.sh_scaledobjects.yaml"


class PodExporter:
    """The server's autoscaling series for one simulated pod (or, with `router`, the router's held
    requests), on its own port, in the text format the server's /metrics uses (prometheus_client's own
    server would negotiate OpenMetrics, whose samples spell `conveyor:` as `conveyor_`)."""

    def __init__(self, router: bool = False) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.router = router
        if router:
            self.held = Gauge(
                "conveyor:router_requests_waiting",
                "Requests held while no replica is ready.",
                labels,
                registry=self.registry,
            )
        else:
            self.waiting = Gauge(
                "conveyor:num_requests_waiting", "Requests queued.", labels, registry=self.registry
            )
            self.running = Gauge(
                "conveyor:num_requests_running", "Requests running.", labels, registry=self.registry
            )
            # Every signal the operator reads exists, idle: no request yet, a quarter of the KV used.
            Histogram("conveyor:time_to_first_token_seconds", "TTFT.", labels, registry=self.registry).labels(
                "m"
            )
            kv = Gauge("conveyor:kv_cache_usage_perc", "KV-cache usage.", labels, registry=self.registry)
            kv.labels("m").set(0.25)
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def set(self, waiting: float) -> None:
        if self.router:
            self.held.labels("m").set(waiting)
            return
        self.waiting.labels("m").set(waiting)
        self.running.labels("m").set(1)

    def close(self) -> None:
        self.server.shutdown()


class PodMetrics:
    """Keeps one exporter per live pod of the namespace and Prometheus's targets in step with them."""

    def __init__(self, env: Env, prometheus: PrometheusServer) -> None:
        self.env = env
        self.prometheus = prometheus
        self.waiting: dict[str, float] = {}  # per pod, by InferenceService name
        self.router_waiting: dict[str, float] = {}  # per router pod, by InferenceService name
        self.exporters: dict[str, PodExporter] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(subprocess.SubprocessError, json.JSONDecodeError, AssertionError):
                self.sync()
            self._stop.wait(0.5)

    def sync(self) -> None:
        pods = self.env.items("pods", ISVC_LABEL)
        live = {p["metadata"]["name"]: (p["metadata"]["labels"][ISVC_LABEL], False) for p in pods}
        routers = self.env.items("pods", ROUTER_LABEL)
        live.update({p["metadata"]["name"]: (p["metadata"]["labels"][ROUTER_LABEL], True) for p in routers})
        for name in set(self.exporters) - set(live):
            self.exporters.pop(name).close()
        for name, (owner, router) in live.items():
            exporter = self.exporters.get(name) or self.exporters.setdefault(name, PodExporter(router))
            exporter.set((self.router_waiting if router else self.waiting).get(owner, 0.0))
        self.prometheus.set_targets(
            [
                (f"127.0.0.1:{e.port}", {"namespace": self.env.namespace, "pod": name})
                for name, e in sorted(self.exporters.items())
            ]
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for exporter in self.exporters.values():
            exporter.close()


class AutoEnv(Env):
    """An operator with the builtin autoscaler stepping every second against a real Prometheus."""

    def __init__(
        self, cluster: LocalCluster, namespace: str, operator: Operator, prometheus: PrometheusServer
    ):
        super().__init__(cluster, namespace, operator)
        self.prometheus = prometheus
        self.metrics = PodMetrics(self, prometheus)

    def replicas(self, name: str) -> int | None:
        dep = self.get("deployment", name)
        return None if dep is None else dep["spec"].get("replicas")

    def status(self, name: str) -> dict[str, Any]:
        return (self.get("inferenceservice", name) or {}).get("status", {})


@pytest.fixture(scope="module")
def crd(k8s: LocalCluster) -> LocalCluster:
    """The cluster with the InferenceService CRD installed and established."""
    k8s.kubectl("apply", "--server-side", "-f", str(CRD_PATH))
    k8s.wait_established("inferenceservices.serving.conveyor.dev")
    return k8s


@pytest.fixture(scope="module")
def auto(crd: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AutoEnv]:
    k8s = crd
    prometheus = PrometheusServer(tmp_path_factory.mktemp("prometheus"))
    prometheus.start()
    namespace = k8s.create_namespace("autoscale")
    log_path = tmp_path_factory.mktemp("operator") / "operator.log"
    operator = Operator(
        k8s, namespace, log_path, "--prometheus-url", prometheus.url, "--autoscale-interval", "1"
    )
    env = AutoEnv(k8s, namespace, operator, prometheus)
    try:
        yield env
    finally:
        env.metrics.close()
        env.operator.stop()
        prometheus.stop()
        k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def autoscaled(name: str, **autoscaling: Any) -> dict[str, Any]:
    """A SmolLM2-on-A100 InferenceService autoscaled on queue depth (2 waiting per replica)."""
    spec = {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 2, **autoscaling}
    return isvc(name, model={"name": "smollm2-135m", "maxModelLen": 2048}, replicas=None, autoscaling=spec)


FAST_DOWN = {
    "scaleDown": {
        "stabilizationWindowSeconds": 4,
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 1}],
    }
}


def test_scales_up_on_queue_depth_reconcile_keeps_it_and_scales_down_after_the_window(auto: AutoEnv) -> None:
    auto.apply(autoscaled("queue", behavior=FAST_DOWN))
    try:
        auto.wait_ready("queue")
        # One Ready pod with 8 waiting: ceil(8 / 2) = 4 replicas, the maximum.
        auto.metrics.waiting["queue"] = 8
        auto.eventually(lambda: auto.replicas("queue") == 4, "a scale-up to 4 replicas", timeout=60)
        events = [e for e in auto.events("queue") if e["reason"] == "ScaleUp"]
        assert events and "queue depth" in events[0]["message"], events
        auto.wait_ready("queue", replicas=4)
        status = auto.eventually(
            lambda: (
                (s := auto.status("queue")).get("autoscaler", {}).get("metrics", {}).get("readyPods") == 4
                and s
            ),
            "a reading over the 4 Ready pods",
        )
        assert status["desiredReplicas"] == 4
        assert status["lastScaleTime"]
        decisions = status["autoscaler"]["decisions"]
        ups = [d for d in decisions if d["reason"] == "ScaleUp"]
        assert ups and ups[0]["from"] == 1 and ups[-1]["to"] == 4, decisions
        assert status["autoscaler"]["metrics"]["queueDepth"] == 32
        conditions = {c["type"]: c for c in status["conditions"]}
        assert conditions["MetricsAvailable"]["status"] == "True"
        assert conditions["Scaling"]["reason"] == "AtMaxReplicas"
        table = auto.kubectl("get", "cisvc", "queue").stdout
        header, row = table.splitlines()
        assert "DESIRED" in header and "SCALING" in header
        assert row.split()[header.split().index("DESIRED")] == "4"
        assert "AtMaxReplicas" in row

        # Reconcile (a spec change rolls the pods) never reverts what the autoscaler wrote.
        auto.kubectl(
            "patch",
            "inferenceservice",
            "queue",
            "--type=merge",
            "-p",
            '{"spec":{"engine":{"maxNumSeqs":64}}}',
        )
        auto.eventually(
            lambda: (
                "--max-num-seqs"
                in (dep := auto.get("deployment", "queue"))["spec"]["template"]["spec"]["containers"][0][
                    "args"
                ]
                and "64" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
            ),
            "the spec change to reach the Deployment",
        )
        assert auto.replicas("queue") == 4

        # Quiet: down to 1 only after the 4 s window, one pod per second.
        auto.metrics.waiting["queue"] = 0
        quiet_at = time.monotonic()
        auto.eventually(lambda: auto.replicas("queue") == 1, "a scale-down to 1 replica", timeout=90)
        assert time.monotonic() - quiet_at >= 4
        downs = [e for e in auto.events("queue") if e["reason"] == "ScaleDown"]
        assert len(downs) == 3 and all("-> " in e["message"] for e in downs), downs
    finally:
        auto.metrics.waiting.pop("queue", None)
        auto.delete("queue")


def test_requests_held_by_the_router_wake_a_service_scaled_to_zero(auto: AutoEnv) -> None:
    """minReplicas 0 behind the router: idle, it goes to 0; requests the router holds bring one back."""
    manifest = autoscaled("wake", minReplicas=0, behavior=FAST_DOWN)
    manifest["spec"]["router"] = {"enabled": True}
    auto.apply(manifest)
    try:
        auto.wait_ready("wake")
        auto.eventually(lambda: auto.replicas("wake") == 0, "a scale-down to 0 replicas", timeout=90)
        status = auto.eventually(
            lambda: (
                (s := auto.status("wake"))
                .get("autoscaler", {})
                .get("metrics", {})
                .get("routerRequestsWaiting")
                == 0
                and s
            ),
            "a reading of the router at zero replicas",
        )
        assert status["url"] == f"http://wake-router.{auto.namespace}.svc.cluster.local"
        auto.metrics.router_waiting["wake"] = 3
        auto.eventually(lambda: auto.replicas("wake") == 1, "a scale-from-zero to 1 replica", timeout=60)
        # kopf posts Events from a queue of its own, after the scale write the line above saw.
        events = auto.eventually(
            lambda: [e for e in auto.events("wake") if e["reason"] == "RouterRequestsWaiting"],
            "the RouterRequestsWaiting Event",
            timeout=30,
        )
        assert "3 waiting in the router" in events[0]["message"], events
    finally:
        auto.metrics.router_waiting.pop("wake", None)
        auto.delete("wake")


def test_prometheus_outage_holds_replicas_and_says_so(auto: AutoEnv) -> None:
    auto.apply(autoscaled("outage", minReplicas=2, behavior=FAST_DOWN))
    try:
        auto.wait_ready("outage", replicas=2)
        auto.metrics.waiting["outage"] = 3  # 6 over 2 = 3 per replica: up to 3
        auto.eventually(lambda: auto.replicas("outage") == 3, "a scale-up to 3", timeout=60)
        log_start = len(auto.operator.log_path.read_text().splitlines())
        auto.prometheus.stop()
        available = auto.eventually(
            lambda: (c := auto.condition("outage", "MetricsAvailable")) and c["status"] == "False" and c,
            "MetricsAvailable=False",
        )
        assert available["reason"] == "MetricsUnavailable"
        assert "holding 3 replicas" in available["message"]
        # Status holds no number from before the outage: the signals are absent, the errors say why,
        # and lastSuccessfulReadTime says how old the last good reading is.
        metrics = auto.status("outage")["autoscaler"]["metrics"]
        signals = ("ttftP90Seconds", "requestRate", "queueDepth", "runningRequests", "kvCacheUsage")
        assert not set(signals) & set(metrics), metrics
        assert metrics["errors"] and metrics["lastSuccessfulReadTime"] < metrics["time"], metrics
        # Read as 0 this would scale down after the 4 s window; held, it stays.
        time.sleep(8)
        assert auto.replicas("outage") == 3
        assert auto.condition("outage", "Scaling")["reason"] == "MetricsUnavailable"
        assert any(e["reason"] == "MetricsUnavailable" for e in auto.events("outage"))
        auto.prometheus.start()
        auto.eventually(
            lambda: (auto.condition("outage", "MetricsAvailable") or {}).get("status") == "True",
            "MetricsAvailable=True again",
            timeout=60,
        )
        # Every signal reads again (rate() needs two scrapes after the restart): the errors are gone.
        metrics = auto.eventually(
            lambda: "errors" not in (m := auto.status("outage")["autoscaler"]["metrics"]) and m,
            "a reading without errors after the outage",
        )
        assert metrics["lastSuccessfulReadTime"] == metrics["time"], metrics
        # 3 waiting per pod (the autoscaler may already be scaling up from 3 on them).
        assert metrics["queueDepth"] == 3 * metrics["readyPods"] and metrics["kvCacheUsage"] == 0.25, metrics
        auto.metrics.waiting["outage"] = 0
        auto.eventually(lambda: auto.replicas("outage") == 2, "scaling to resume (down to 2)", timeout=60)
        # The operator's log tells the outage once and the return once, not every step.
        lines = auto.operator.log_path.read_text().splitlines()[log_start:]
        log = [line for line in lines if f"{auto.namespace}/outage:" in line]
        unavailable = [line for line in log if "metrics unavailable" in line]
        back = [line for line in log if "metrics available again" in line]
        assert len(unavailable) == 1 and " WARNING " in unavailable[0], log
        assert len(back) == 1 and " INFO " in back[0], log
    finally:
        auto.metrics.waiting.pop("outage", None)
        auto.delete("outage")


def test_a_hung_prometheus_never_delays_a_reconcile(crd: LocalCluster, tmp_path: Path) -> None:
    """Every autoscaling step waits out its 5 s deadline on a Prometheus that never answers; a spec
    change made while a step waits reaches the Deployment without waiting for it."""
    k8s = crd
    hung = SilentServer()
    namespace = k8s.create_namespace("hung")
    args = ("--prometheus-url", f"http://127.0.0.1:{hung.port}", "--autoscale-interval", "10")
    env = Env(k8s, namespace, Operator(k8s, namespace, tmp_path / "operator.log", *args))
    try:
        env.apply(autoscaled("hung"))
        env.wait_ready("hung")
        # A step that ran before the pod was Ready says "no Ready pods"; wait for one that asked.
        env.eventually(
            lambda: (
                (c := env.condition("hung", "MetricsAvailable"))
                and c["status"] == "False"
                and "queueDepth: no answer within 5 s" in c["message"]
            ),
            "MetricsAvailable=False naming the unanswered query",
        )
        hung.accepted.clear()
        env.eventually(hung.accepted.is_set, "an autoscaling step asking Prometheus", timeout=30)
        changed_at = time.monotonic()
        env.kubectl(
            "patch", "inferenceservice", "hung", "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":48}}}'
        )
        env.eventually(
            lambda: "48" in container_args(env.get("deployment", "hung") or _NO_DEPLOYMENT),
            "the spec change in the Deployment",
        )
        waited = time.monotonic() - changed_at
        # Held behind the step's lock it would wait out the rest of the 5 s deadline.
        assert waited < 2.5, f"the reconcile waited {waited:.1f} s"
    finally:
        env.operator.stop()
        hung.close()
        k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


_NO_DEPLOYMENT = {"spec": {"template": {"spec": {"containers": [{"args": []}]}}}}


def test_a_restarted_operator_keeps_the_scale_down_window(auto: AutoEnv, tmp_path: Path) -> None:
    """The history the windows need is in status: a new operator does not forget the recent high
    recommendations and scale down at once."""
    window = {
        "scaleDown": {
            "stabilizationWindowSeconds": 25,
            "policies": [{"type": "Pods", "value": 4, "periodSeconds": 1}],
        }
    }
    auto.apply(autoscaled("restart", behavior=window))
    try:
        auto.wait_ready("restart")
        auto.metrics.waiting["restart"] = 8
        auto.eventually(lambda: auto.replicas("restart") == 4, "a scale-up to 4 replicas", timeout=60)
        auto.operator.stop()
        auto.metrics.waiting["restart"] = 0
        quiet_at = time.monotonic()
        args = ("--prometheus-url", auto.prometheus.url, "--autoscale-interval", "1")
        auto.operator = Operator(auto.cluster, auto.namespace, tmp_path / "restarted.log", *args)
        auto.eventually(lambda: auto.replicas("restart") == 1, "the scale-down after the window", timeout=90)
        # The last high recommendation came just before the restart: nothing goes for ~25 s.
        assert time.monotonic() - quiet_at >= 20
    finally:
        auto.metrics.waiting.pop("restart", None)
        auto.delete("restart")


def test_advisory_mode_records_without_writing_replicas(auto: AutoEnv) -> None:
    auto.apply(autoscaled("advice", mode="Advisory"))
    try:
        auto.wait_ready("advice")
        auto.metrics.waiting["advice"] = 6
        status = auto.eventually(
            lambda: (s := auto.status("advice")).get("desiredReplicas") == 3 and s, "an advised 3 replicas"
        )
        scaling = next(c for c in status["conditions"] if c["type"] == "Scaling")
        assert scaling["reason"] == "ScaleUp" and scaling["message"].startswith("Advisory")
        assert status["autoscaler"]["decisions"][-1]["to"] == 3
        time.sleep(3)
        assert auto.replicas("advice") == 1
        assert any(e["reason"] == "AdvisoryScaleUp" for e in auto.events("advice"))
    finally:
        auto.metrics.waiting.pop("advice", None)
        auto.delete("advice")


def test_hpa_engine_renders_an_hpa_and_leaves_replicas_to_it(auto: AutoEnv) -> None:
    auto.apply(autoscaled("hpa", engine="hpa", minReplicas=2, targetTTFTSeconds=0.5))
    try:
        hpa = auto.eventually(lambda: auto.get("hpa", "hpa"), "the HorizontalPodAutoscaler")
        spec = hpa["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "hpa"}
        assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 4)
        metrics = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in spec["metrics"]}
        assert metrics == {
            "conveyor_num_requests_waiting": {"type": "AverageValue", "averageValue": "2"},
            "conveyor_time_to_first_token_seconds_p90": {"type": "AverageValue", "averageValue": "500m"},
        }
        assert spec["behavior"]["scaleDown"]["policies"] == [
            {"type": "Pods", "value": 1, "periodSeconds": 15}
        ]
        auto.eventually(lambda: auto.get("deployment", "hpa"), "the Deployment")
        dep = json.loads(
            auto.kubectl("get", "deployment", "hpa", "-o", "json", "--show-managed-fields").stdout
        )
        owners = {
            f["manager"]
            for f in dep["metadata"]["managedFields"]
            if "f:replicas" in json.dumps(f.get("fieldsV1", {}))
        }
        assert "conveyor-operator" not in owners, dep["metadata"]["managedFields"]
        # The builtin autoscaler stays out of it.
        time.sleep(2)
        assert "autoscaler" not in auto.status("hpa")

        # Back to the builtin engine: the rendered HPA goes away.
        auto.kubectl(
            "patch",
            "inferenceservice",
            "hpa",
            "--type=merge",
            "-p",
            '{"spec":{"autoscaling":{"engine":"builtin"}}}',
        )
        auto.eventually(lambda: auto.get("hpa", "hpa") is None, "the HPA to be deleted")
    finally:
        auto.delete("hpa")


def keda_crd() -> Path:
    """KEDA's ScaledObject CRD from its Go module (the Go module proxy serves it; cached by Go)."""
    return go_module_file(KEDA_MODULE, KEDA_CRD)


def test_keda_engine_renders_a_scaled_object_the_real_crd_accepts(auto: AutoEnv) -> None:
    auto.cluster.kubectl("apply", "--server-side", "-f", str(keda_crd()))
    auto.cluster.wait_established("scaledobjects.keda.sh")
    try:
        # The operator's discovery cache may still say "no KEDA" for up to a minute.
        auto.apply(autoscaled("keda", engine="keda", minReplicas=0, targetTTFTSeconds=0.5))
        scaled = auto.eventually(lambda: auto.get("scaledobject", "keda"), "the ScaledObject", timeout=90)
        spec = scaled["spec"]
        assert spec["scaleTargetRef"]["name"] == "keda"
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 4)
        triggers = {t["metricType"]: t["metadata"] for t in spec["triggers"]}
        assert triggers["AverageValue"]["threshold"] == "2"
        assert "conveyor:num_requests_waiting" in triggers["AverageValue"]["query"]
        assert "kube_pod_status_ready" in triggers["AverageValue"]["query"]
        assert triggers["Value"]["threshold"] == "0.5"
        assert triggers["Value"]["serverAddress"] == auto.prometheus.url
        assert triggers["Value"]["ignoreNullValues"] == "false"
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 300
        # Server-side dry-run validates the object again, against the CRD's schema as stored.
        manifest = {k: scaled[k] for k in ("apiVersion", "kind", "spec")}
        manifest["metadata"] = {"name": "keda-copy"}
        auto.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(manifest))
    finally:
        auto.delete("keda")


def test_a_scaled_object_with_keda_authentication_is_accepted_by_the_real_crd(k8s: LocalCluster) -> None:
    """The chart's `keda.*` settings (authenticationRef, authModes, pollingInterval), server-side dry run."""
    k8s.kubectl("apply", "--server-side", "-f", str(keda_crd()))
    k8s.wait_established("scaledobjects.keda.sh")
    namespace = k8s.create_namespace("keda")
    try:
        spec = parse_spec(
            isvc("keda", autoscaling={"engine": "keda", "maxReplicas": 3, "targetQueueDepth": 4})["spec"]
        )
        keda = KedaSettings(
            "https://prom.example:9090", ("ClusterTriggerAuthentication", "prom"), "bearer", 30
        )
        owner = Owner("keda", namespace, "0b4f7e2a-1c1d-4f0e-9a55-0f6f1d2d9a10")
        scaled = render_scaled_object(owner, spec, keda)
        del scaled["metadata"]["ownerReferences"]  # no such owner exists; the dry run checks the schema
        result = k8s.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(scaled), check=False)
        assert result.returncode == 0, result.stderr
        assert scaled["spec"]["triggers"][0]["authenticationRef"]["kind"] == "ClusterTriggerAuthentication"
    finally:
        k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
