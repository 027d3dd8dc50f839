"""The Helm chart (charts/conveyor): `helm lint`, `helm template` validated offline for Kubernetes
1.30-1.35, the values schema, the monitoring objects against the Prometheus Operator's real CRDs, the
alerts under `promtool test rules`, and installs on the local cluster: RBAC that covers every call the
operator makes, the operator reconciling with only the chart's ServiceAccount, `helm uninstall`.

helm comes with the test-bed binaries (hack/k8s-tools/build.sh), hence the `k8s` marker.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes import client
from prometheus_client.utils import floatToGoString

from conveyor.operator.permissions import required_checks
from conveyor.operator.render import ROUTER_RULES
from conveyor.operator.run import build_parser
from conveyor.server.api.metrics import LATENCY_BUCKETS
from tests.k8s.cluster import LocalCluster, ensure_binaries, free_port, go_module_file
from tests.k8s.operator_env import (
    LLAMA_EXAMPLE,
    RESTRICTED,
    SERVICE_MONITOR_CRD,
    Env,
    Operator,
    account_kubeconfig,
)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "conveyor"
CRD_PATH = REPO / "crds" / "serving.conveyor.dev_inferenceservices.yaml"


def helm(
    tmp_path: Path, *args: str, kubeconfig: Path | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
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
    if check:
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


CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
VALUE_SETS = [None, *CI_VALUES]


def _values_id(path: Path | None) -> str:
    return path.name if path else "defaults"


def _values_args(path: Path | None) -> list[str]:
    return ["--values", str(path)] if path else []


@pytest.mark.parametrize("values", VALUE_SETS, ids=_values_id)
def test_helm_lint(tmp_path: Path, values: Path | None) -> None:
    result = helm(tmp_path, "lint", "--strict", str(CHART), *_values_args(values))
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
    crds = {crd["metadata"]["name"]: crd for crd in objects["CustomResourceDefinition"]}
    assert sorted(crds) == [
        "clusterkopfpeerings.kopf.dev",
        "inferenceservices.serving.conveyor.dev",
        "kopfpeerings.kopf.dev",
    ]
    assert crds["inferenceservices.serving.conveyor.dev"] == yaml.safe_load(CRD_PATH.read_text())
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


# Every (verb, group, resource) the operator and kopf use (operator/permissions.py, which the operator
# also checks at start), and what the router's Role grants (RBAC refuses the Role unless the operator
# holds it too). Checked with SubjectAccessReviews, which need no discovery, so permissions for APIs not
# installed here (ServiceMonitor) are checked as well.
OPERATOR_PERMISSIONS: list[tuple[str, str, str]] = [
    *[(c.verb, c.group, c.resource) for c in required_checks([], peering=True)],
    *[
        (verb, group, resource)
        for rule in ROUTER_RULES
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    ],
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
        k8s.wait_established("inferenceservices.serving.conveyor.dev")
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


KUBERNETES_VERSIONS = ["1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0"]
# Kinds whose schemas ship with Kubernetes; custom resources are checked by the API server below.
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "ClusterKopfPeering", "KopfPeering"}


@pytest.mark.parametrize("values", VALUE_SETS, ids=_values_id)
def test_rendered_objects_are_valid_for_kubernetes_1_30_to_1_35(tmp_path: Path, values: Path | None) -> None:
    """kubernetes-validate's strict schemas: unknown fields and wrong types fail, per version."""
    objects = rendered(tmp_path, "--include-crds", *_values_args(values))
    errors = []
    for version in KUBERNETES_VERSIONS:
        for kind, docs in objects.items():
            if kind in CUSTOM_KINDS:
                continue
            for doc in docs:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    errors.append(
                        f"{version} {kind}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}"
                    )
    assert errors == []


def test_values_schema_refuses_a_wrong_type_naming_the_value(tmp_path: Path) -> None:
    for args, message in [
        (("--set", "replicaCount=two"), "at '/replicaCount': got string, want integer"),
        (("--set", "metrics.prot=1"), "additional properties 'prot' not allowed"),
        (("--set", "prometheusRule.ttftSeconds=0.3"), "/prometheusRule/ttftSeconds"),
    ]:
        result = helm(tmp_path, "template", "x", str(CHART), *args, check=False)
        assert result.returncode != 0 and message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["replicaCount=2", "watchNamespaces={llm,team-*}"], '"team-*" is a glob pattern, but peering'),
        (["metrics.port=8080"], "metrics.port and livenessPort are both 8080"),
        (["metrics.port=0", "metrics.serviceMonitor.enabled=true"], "needs metrics.port"),
        (["serviceAccount.create=false"], "name the existing ServiceAccount"),
        (["serviceMonitorLabels.team=a/b"], "at '/serviceMonitorLabels/team'"),
    ],
)
def test_value_combinations_the_operator_could_not_run_are_refused(
    tmp_path: Path, values: list[str], message: str
) -> None:
    args = [arg for value in values for arg in ("--set", value)]
    result = helm(tmp_path, "template", "x", str(CHART), *args, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_a_standalone_operator_is_replaced_not_rolled(tmp_path: Path) -> None:
    """One replica without peering must never overlap with its successor; peering replicas roll."""
    (deployment,) = rendered(tmp_path)["Deployment"]
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    (deployment,) = rendered(tmp_path, "--set", "replicaCount=2")["Deployment"]
    assert "strategy" not in deployment["spec"]


def test_everything_on_renders_every_optional_object(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "--values", str(CHART / "ci" / "everything-on.yaml"))
    assert {"ServiceMonitor", "PrometheusRule", "Service", "ConfigMap", "Pod"} <= set(objects)
    (monitor,) = objects["ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    maps = {m["metadata"]["name"]: m for m in objects["ConfigMap"]}
    dashboard = maps["conveyor-dashboard"]
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["conveyor.json"]) == json.loads(
        (CHART / "dashboards" / "conveyor.json").read_text()
    )
    adapter = yaml.safe_load(maps["conveyor-adapter-rules"]["data"]["config.yaml"])
    shipped = yaml.safe_load((CHART / "prometheus-adapter.values.yaml").read_text())
    assert adapter["rules"] == shipped["rules"]["custom"]
    (test_pod,) = objects["Pod"]
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert {"name": "BASE_URL", "value": "http://smollm2-135m.llm.svc.cluster.local"} in test_pod["spec"][
        "containers"
    ][0]["env"]
    args = operator_args(objects)
    assert "--server-image=ghcr.io/conveyor-dev/conveyor-server:0.1.0" in args
    assert "--keda-authentication=ClusterTriggerAuthentication/prometheus-token" in args
    assert "--keda-auth-modes=bearer" in args and "--keda-polling-interval=30" in args
    peers = next(a for a in args if a.startswith("--network-policy-from="))
    parsed = build_parser().parse_args(args[1:])
    assert parsed.network_policy_from == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        # helm test's pod runs in the release's namespace: its request must get through.
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "conveyor-system"}}},
    ], peers
    (deployment,) = objects["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_peering_objects_follow_the_replica_count(tmp_path: Path) -> None:
    assert "ClusterKopfPeering" not in rendered(tmp_path)
    objects = rendered(tmp_path, "--values", str(CHART / "ci" / "peering-namespaced.yaml"))
    assert sorted(p["metadata"]["namespace"] for p in objects["KopfPeering"]) == ["batch", "llm"]
    args = operator_args(objects)
    assert "--peering=conveyor" in args and "--standalone" not in args
    assert "--priority=random" in args
    priorities = {build_parser().parse_args(args[1:]).priority for _ in range(3)}
    assert len(priorities) == 3  # each replica draws its own: equal priorities would pause them all
    (deployment,) = objects["Deployment"]
    assert deployment["spec"]["replicas"] == 3
    (cluster_peering,) = rendered(tmp_path, "--set", "replicaCount=2")["ClusterKopfPeering"]
    assert cluster_peering["metadata"]["name"] == "conveyor"


@pytest.mark.parametrize("bound", LATENCY_BUCKETS)
def test_burn_rate_alerts_read_the_bucket_prometheus_exports(tmp_path: Path, bound: float) -> None:
    """The rule's `le` is the label prometheus_client gives that bucket, for every allowed objective."""
    (rule,) = rendered(
        tmp_path,
        "--set",
        "prometheusRule.enabled=true",
        "--set",
        f"prometheusRule.ttftSeconds={bound}",
        "--show-only",
        "templates/prometheusrule.yaml",
    )["PrometheusRule"]
    expr = rule["spec"]["groups"][0]["rules"][0]["expr"]
    assert f'time_to_first_token_seconds_bucket{{le="{floatToGoString(bound)}"}}' in expr


# Synthetic series, one sample a minute, that trip each alert, and healthy ones that must not.
_SERIES = {
    'conveyor:time_to_first_token_seconds_bucket{namespace="llm",service="slow",pod="slow-1",input_length_bucket="0-512",le="1.0"}': "0+1x400",
    'conveyor:time_to_first_token_seconds_count{namespace="llm",service="slow",pod="slow-1",input_length_bucket="0-512"}': "0+2x400",
    'conveyor:time_to_first_token_seconds_bucket{namespace="llm",service="fast",pod="fast-1",input_length_bucket="0-512",le="1.0"}': "0+2x400",
    'conveyor:time_to_first_token_seconds_count{namespace="llm",service="fast",pod="fast-1",input_length_bucket="0-512"}': "0+2x400",
    'conveyor:request_time_per_output_token_seconds_bucket{namespace="llm",service="slow",pod="slow-1",input_length_bucket="0-512",le="0.1"}': "0+1x400",
    'conveyor:request_time_per_output_token_seconds_count{namespace="llm",service="slow",pod="slow-1",input_length_bucket="0-512"}': "0+4x400",
    'up{namespace="llm",pod="gone-1",job="gone"}': "1x30 0x60",
    'conveyor:num_requests_running{namespace="llm",pod="gone-1"}': "1x30",
    'up{namespace="llm",pod="fast-1",job="fast"}': "1x90",
    'conveyor:num_requests_running{namespace="llm",pod="fast-1"}': "1x90",
    'conveyor_operator_prometheus_query_errors_total{namespace="llm",inferenceservice="blind",query="ttft"}': "0+1x90",
    'conveyor:kv_cache_usage_perc{namespace="llm",pod="full-1"}': "0.99x90",
    'conveyor:kv_cache_usage_perc{namespace="llm",pod="fast-1"}': "0.5x90",
    'conveyor:num_requests_waiting{namespace="llm",pod="full-1"}': "0+1x90",
    'conveyor:num_requests_waiting{namespace="llm",pod="fast-1"}': "3x90",
}
_EXPECTED = [
    (70, "ConveyorTTFTBudgetBurnFast", [{"namespace": "llm", "service": "slow", "severity": "critical"}]),
    (70, "ConveyorTTFTBudgetBurnSlow", [{"namespace": "llm", "service": "slow", "severity": "warning"}]),
    (70, "ConveyorTPOTBudgetBurnFast", [{"namespace": "llm", "service": "slow", "severity": "critical"}]),
    (2, "ConveyorTTFTBudgetBurnFast", []),  # pending: a burn must last its `for` (2m) first
    (
        50,
        "ConveyorServerMetricsAbsent",
        [{"namespace": "llm", "pod": "gone-1", "job": "gone", "severity": "warning"}],
    ),
    (
        30,
        "ConveyorAutoscalerMetricsAbsent",
        [{"namespace": "llm", "inferenceservice": "blind", "query": "ttft", "severity": "warning"}],
    ),
    (20, "ConveyorKVCacheNearFull", [{"namespace": "llm", "pod": "full-1", "severity": "warning"}]),
    (30, "ConveyorQueueGrowing", [{"namespace": "llm", "pod": "full-1", "severity": "warning"}]),
    (15, "ConveyorQueueGrowing", []),
]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool comes with `make prometheus`")
def test_alerts_fire_on_synthetic_series_and_stay_quiet_on_healthy_ones(tmp_path: Path) -> None:
    """`promtool test rules` over the rendered PrometheusRule (annotations are checked by
    `promtool check rules`: their templates parse)."""
    (rule,) = rendered(
        tmp_path, "--set", "prometheusRule.enabled=true", "--show-only", "templates/prometheusrule.yaml"
    )["PrometheusRule"]
    groups = rule["spec"]["groups"]
    checked = tmp_path / "rules.yaml"
    checked.write_text(yaml.safe_dump({"groups": groups}))
    check = subprocess.run(["promtool", "check", "rules", str(checked)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    bare = [
        {**group, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in group["rules"]]}
        for group in groups
    ]
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump({"groups": bare}))
    tests = {
        "rule_files": ["bare.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": k, "values": v} for k, v in _SERIES.items()],
                "alert_rule_test": [
                    {
                        "eval_time": f"{minutes}m",
                        "alertname": name,
                        "exp_alerts": [{"exp_labels": lab} for lab in labels],
                    }
                    for minutes, name, labels in _EXPECTED
                ],
            }
        ],
    }
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, width=1000))
    result = subprocess.run(
        ["promtool", "test", "rules", "tests.yaml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr


PROMETHEUS_OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator@v0.85.0"
PROMETHEUS_OPERATOR_CRDS = [
    "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml",
    "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml",
]


def test_monitoring_and_peering_objects_are_accepted_by_their_real_crds(
    k8s: LocalCluster, tmp_path: Path
) -> None:
    """The ServiceMonitor and PrometheusRule against the Prometheus Operator's own CRDs (from its Go
    module), the peering objects against the chart's kopf CRDs: a server-side dry run of each."""
    paths = [go_module_file(PROMETHEUS_OPERATOR_MODULE, crd) for crd in PROMETHEUS_OPERATOR_CRDS]
    paths.append(CHART / "crds" / "kopf.dev_peerings.yaml")
    existing = k8s.kubectl("get", "crd", "servicemonitors.monitoring.coreos.com", check=False)
    replaced_stand_in = existing.returncode == 0
    for path in paths:
        k8s.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    for crd in (
        "servicemonitors.monitoring.coreos.com",
        "prometheusrules.monitoring.coreos.com",
        "kopfpeerings.kopf.dev",
    ):
        k8s.wait_established(crd)
    namespace = k8s.create_namespace("monitoring")
    try:
        objects = rendered(
            tmp_path,
            "--values",
            str(CHART / "ci" / "everything-on.yaml"),
            "--set",
            f"watchNamespaces={{{namespace}}}",
            "--set",
            "replicaCount=2",
        )
        for kind in ("ServiceMonitor", "PrometheusRule", "KopfPeering"):
            for obj in objects[kind]:
                obj["metadata"]["namespace"] = namespace
                result = k8s.kubectl(
                    "apply", "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False
                )
                assert result.returncode == 0, f"{kind}: {result.stderr}"
        bad_rule = copy.deepcopy(objects["PrometheusRule"][0])
        bad_rule["spec"]["groups"][0]["rules"][0]["for"] = "two minutes"
        refused = k8s.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(bad_rule), check=False)
        assert refused.returncode != 0 and "for" in refused.stderr
    finally:
        k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        # Other modules apply a stand-in ServiceMonitor CRD of their own: leave the cluster as it was.
        k8s.kubectl("delete", "crd", "prometheusrules.monitoring.coreos.com", "--wait=false", check=False)
        if replaced_stand_in:
            k8s.kubectl(
                "apply",
                "--server-side",
                "--force-conflicts",
                "-f",
                "-",
                input=json.dumps(SERVICE_MONITOR_CRD),
            )
        else:
            k8s.kubectl("delete", "crd", "servicemonitors.monitoring.coreos.com", "--wait=false", check=False)


_LOG_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", re.MULTILINE)


def _refused(log: str) -> bool:
    """Whether an operator log shows the API server refusing it (`Forbidden`, or HTTP 403 as a word).
    Line timestamps are left out first: their milliseconds may read 403 (`22:53:18,403`), as may the
    digits of kopf's peer ids (which are no word of their own)."""
    return re.search(r"Forbidden|\b403\b", _LOG_TIMESTAMP.sub("", log)) is not None


def test_a_log_line_stamped_at_403_ms_is_no_refusal() -> None:
    assert not _refused(
        "2026-12-04 22:53:18,403 INFO kopf.objects: Handler 'on_inference_service' succeeded.\n"
    )
    assert not _refused("2026-12-04 03:30:14,001 INFO kopf: peer conveyor@host/20261204033014/abc is alive\n")
    assert _refused("2026-12-04 22:53:18,100 ERROR kopf: (403) Reason: Forbidden\n")
    assert _refused("2026-12-04 22:53:18,100 ERROR kopf: APIForbiddenError: 403 on patch\n")


def test_the_installed_chart_runs_the_operator_with_its_own_account_then_uninstalls_cleanly(
    k8s: LocalCluster, tmp_path: Path
) -> None:
    """`helm install` (two peering replicas, one watched namespace, NetworkPolicies, a server image);
    the operator runs from source with the chart's Deployment arguments and only its ServiceAccount's
    token, and reconciles the Llama example (a verb the ClusterRole lacks would leave it not Ready);
    `helm uninstall` then leaves nothing of the release but the CRDs."""
    namespace = k8s.create_namespace("release", labels=RESTRICTED)
    workload = k8s.create_namespace("llm", labels=RESTRICTED)
    release = "conveyor-e2e"
    helm(
        tmp_path,
        "install",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        f"watchNamespaces={{{workload}}}",
        "--set",
        "replicaCount=2",
        "--set",
        f"livenessPort={free_port()}",
        "--set",
        f"metrics.port={free_port()}",
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "serverImage.repository=registry.example/conveyor-server",
        "--wait=false",
        kubeconfig=k8s.kubeconfig,
    )
    operator = None
    try:
        manifest = helm(
            tmp_path, "get", "manifest", release, "-n", namespace, kubeconfig=k8s.kubeconfig
        ).stdout
        (deployment,) = [d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Deployment"]
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[0] == "operator" and f"--peering={release}" in args
        kubeconfig = account_kubeconfig(k8s, namespace, release, tmp_path / "operator.kubeconfig")
        operator = Operator(k8s, workload, tmp_path / "operator.log", kubeconfig=kubeconfig, argv=args[1:])
        # The Deployment's second replica, with the same arguments: kopf's peering keeps one active.
        # (A pod of its own would have its own ports; here they share the host's.)
        standby_args = [
            f"--liveness=http://0.0.0.0:{free_port()}/healthz"
            if a.startswith("--liveness=")
            else f"--metrics-port={free_port()}"
            if a.startswith("--metrics-port=")
            else a
            for a in args[1:]
        ]
        standby = Operator(k8s, workload, tmp_path / "standby.log", kubeconfig=kubeconfig, argv=standby_args)
        env = Env(k8s, workload, operator, standbys=[standby])
        env.apply(LLAMA_EXAMPLE)
        env.wait_ready("llama-3-8b", timeout=120)
        served = env.get("deployment", "llama-3-8b")
        assert served is not None
        assert served["spec"]["template"]["spec"]["containers"][0]["image"] == (
            "registry.example/conveyor-server:0.1.0"
        )
        assert env.get("networkpolicy", "llama-3-8b") is not None
        logs = [operator.log_path.read_text(), standby.log_path.read_text()]
        assert not any(_refused(log) for log in logs)
        assert not any("Pausing all operators" in log for log in logs), "equal priorities paused both"

        # Both replicas keep their entry alive in the peering object, each with its own priority,
        # and only the active one (the highest) reconciled.
        def peers() -> dict[str, Any] | None:
            body = json.loads(k8s.kubectl("-n", workload, "get", "kopfpeering", release, "-o", "json").stdout)
            return body.get("status") if len(body.get("status") or {}) == 2 else None

        status = env.eventually(peers, "both replicas in the peering object")
        assert len({peer["priority"] for peer in status.values()}) == 2
        assert sum("created Deployment" in log for log in logs) == 1
        env.delete("llama-3-8b")
    finally:
        if operator is not None:
            operator.stop()
            standby.stop()
        helm(tmp_path, "uninstall", release, "--namespace", namespace, "--wait", kubeconfig=k8s.kubeconfig)
        # The workload's pods hold GPUs of the session's cluster: free them even when the test failed.
        k8s.kubectl("delete", "namespace", workload, "--wait=false", check=False)
    selector = f"app.kubernetes.io/instance={release}"
    left = k8s.kubectl(
        "get",
        "deployments,services,serviceaccounts,configmaps,kopfpeerings,clusterroles,clusterrolebindings",
        "--all-namespaces",
        "-l",
        selector,
        "-o",
        "name",
    ).stdout.split()
    assert left == []
    for crd in (
        "inferenceservices.serving.conveyor.dev",
        "kopfpeerings.kopf.dev",
        "clusterkopfpeerings.kopf.dev",
    ):
        k8s.kubectl("get", "crd", crd)
    k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
