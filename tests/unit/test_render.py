"""Rendering an InferenceService into its children, and computing its status (pure, no cluster)."""

import copy
from typing import Any

import pytest

from conveyor.operator.plan import plan_for_spec
from conveyor.operator.render import (
    Owner,
    render_all,
    render_deployment,
    render_pod_disruption_budget,
    render_service,
    render_service_monitor,
    selector_string,
    server_args,
)
from conveyor.operator.spec import InferenceServiceSpec, parse_spec
from conveyor.operator.status import build_status

OWNER = Owner(name="llama", namespace="serving", uid="0b4f7e2a-1c1d-4f0e-9a55-0f6f1d2d9a10")
NOW = "2026-11-29T10:00:00Z"
LATER = "2026-11-29T10:05:00Z"


def _spec(**extra: Any) -> InferenceServiceSpec:
    raw: dict[str, Any] = {
        "model": {
            "name": "llama-3-8b",
            "uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct",
            "maxModelLen": 4096,
        },
        "resources": {"gpuType": "a100-80gb"},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and key in raw:
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return parse_spec(raw)


def _deployment(spec: InferenceServiceSpec | None = None, replicas: int = 1) -> dict[str, Any]:
    spec = spec or _spec()
    return render_deployment(OWNER, spec, plan_for_spec(spec), replicas)


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize(
    ("model", "served"),
    [
        ({"name": "llama-3-8b", "uri": None}, "meta-llama/Meta-Llama-3-8B-Instruct"),
        ({"name": "Qwen2.5-7B-Instruct", "uri": None}, "Qwen/Qwen2.5-7B-Instruct"),
        ({"name": "smollm2-135m", "uri": None}, "HuggingFaceTB/SmolLM2-135M-Instruct"),
        (
            {
                "name": "my-org/custom-7b",
                "uri": None,
                "layers": 32,
                "kvHeads": 8,
                "headDim": 128,
                "params": 7_000_000_000,
            },
            "my-org/custom-7b",
        ),
        ({"name": "llama-3-8b", "uri": "pvc://weights/llama"}, "/models/weights/llama"),
    ],
)
def test_a_model_without_uri_serves_the_catalog_hub_id(model: dict[str, Any], served: str) -> None:
    raw = {"name": "x", "uri": None, "maxModelLen": 4096, **model}
    spec = parse_spec(
        {"model": {k: v for k, v in raw.items() if v is not None}, "resources": {"gpuType": "a100-80gb"}}
    )
    assert server_args(spec, plan_for_spec(spec))[1] == served


def test_every_catalog_model_has_a_hub_id() -> None:
    from conveyor.operator.catalog import HF_CONFIGS, HUB_IDS

    assert HUB_IDS.keys() == HF_CONFIGS.keys()


def test_server_args_carry_the_planned_capacity() -> None:
    spec = _spec()
    args = server_args(spec, plan_for_spec(spec))
    assert args[:2] == ["serve", "meta-llama/Meta-Llama-3-8B-Instruct"]
    assert _flag(args, "--max-num-seqs") == "112"
    assert _flag(args, "--max-model-len") == "4096"
    assert _flag(args, "--gpu-memory-utilization") == "0.9"
    assert _flag(args, "--tensor-parallel-size") == "1"
    assert _flag(args, "--served-model-name") == "llama-3-8b"
    assert _flag(args, "--port") == "8000"
    assert _flag(args, "--block-size") == "16"
    assert "--enable-prefix-caching" in args and "--enable-chunked-prefill" in args
    assert "--max-num-batched-tokens" not in args


def test_server_args_engine_overrides() -> None:
    spec = _spec(
        engine={
            "maxNumSeqs": 64,
            "maxNumBatchedTokens": 4096,
            "enablePrefixCaching": False,
            "enableChunkedPrefill": False,
            "gpuMemoryUtilization": 0.85,
            "extraArgs": ["--seed", "7"],
        }
    )
    args = server_args(spec, plan_for_spec(spec))
    assert _flag(args, "--max-num-seqs") == "64"
    assert _flag(args, "--max-num-batched-tokens") == "4096"
    assert _flag(args, "--gpu-memory-utilization") == "0.85"
    assert "--no-enable-prefix-caching" in args and "--no-enable-chunked-prefill" in args
    assert args[-2:] == ["--seed", "7"]


def test_deployment_resources_node_selector_probes_and_labels() -> None:
    spec = _spec(
        resources={"gpusPerReplica": 2, "cpu": "8", "memory": "64Gi"},
        nodeSelector={"pool": "llm"},
        tolerations=[{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        serviceAccountName="llm-sa",
    )
    dep = _deployment(spec, replicas=3)
    assert dep["metadata"]["name"] == "llama"
    assert dep["metadata"]["namespace"] == "serving"
    assert dep["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"] == {
        "limits": {"nvidia.com/gpu": "2", "cpu": "8", "memory": "64Gi"},
        "requests": {"nvidia.com/gpu": "2", "cpu": "8", "memory": "64Gi"},
    }
    assert _flag(container["args"], "--tensor-parallel-size") == "2"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "pool": "llm"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["serviceAccountName"] == "llm-sa"
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200, "slow model loads need time"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    template_meta = dep["spec"]["template"]["metadata"]
    assert template_meta["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }
    assert template_meta["labels"]["serving.conveyor.dev/inferenceservice"] == "llama"
    assert dep["spec"]["selector"]["matchLabels"] == {"serving.conveyor.dev/inferenceservice": "llama"}
    assert selector_string("llama") == "serving.conveyor.dev/inferenceservice=llama"


def test_pvc_uri_mounts_the_claim_read_only() -> None:
    spec = _spec(model={"uri": "pvc://weights/llama/8b"})
    dep = _deployment(spec)
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["args"][1] == "/models/weights/llama/8b"
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod[
        "volumes"
    ]
    assert {"name": "model", "mountPath": "/models/weights", "readOnly": True} in container["volumeMounts"]


def test_every_child_is_owned_by_the_inference_service() -> None:
    spec = _spec()
    objects = render_all(OWNER, spec, plan_for_spec(spec), 1, service_monitor=True)
    assert [o["kind"] for o in objects] == ["Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor"]
    for obj in objects:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "serving.conveyor.dev/v1alpha1",
            "kind": "InferenceService",
            "name": "llama",
            "uid": OWNER.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "conveyor-operator"
    assert [o["kind"] for o in render_all(OWNER, spec, plan_for_spec(spec), 1, service_monitor=False)] == [
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    ]


def test_service_pdb_and_service_monitor() -> None:
    service = render_service(OWNER)
    assert service["spec"]["selector"] == {"serving.conveyor.dev/inferenceservice": "llama"}
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    pdb = render_pod_disruption_budget(OWNER)
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1
    monitor = render_service_monitor(OWNER)
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]


def test_render_is_deterministic_and_does_not_share_state() -> None:
    first = _deployment()
    snapshot = copy.deepcopy(first)
    first["spec"]["template"]["spec"]["containers"][0]["args"].append("--mutated")
    assert _deployment() == snapshot


def test_spec_change_changes_the_pod_template() -> None:
    before = _deployment()
    after = _deployment(_spec(model={"maxModelLen": 8192}))
    args = after["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _flag(args, "--max-num-seqs") == "56"
    assert before["spec"]["template"] != after["spec"]["template"]


def _status(deployment: dict[str, Any] | None, previous: dict[str, Any] | None = None, now: str = NOW):
    spec = _spec()
    return build_status(
        name="llama",
        namespace="serving",
        generation=3,
        spec=spec,
        plan=plan_for_spec(spec),
        failure=None,
        deployment=deployment,
        previous=previous or {},
        now=now,
    )


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_status_while_pods_start_and_when_ready() -> None:
    dep = _deployment()
    dep["metadata"]["generation"] = 1
    dep["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1}
    starting = _status(dep)
    assert starting["observedGeneration"] == 3
    assert starting["capacity"] == {
        "kvBytesPerToken": 131072,
        "kvPoolBytes": starting["capacity"]["kvPoolBytes"],
        "numKvBlocks": starting["capacity"]["kvPoolBytes"] // (131072 * 16),
        "maxNumSeqs": 112,
        "maxConcurrencyAtMaxModelLen": 112.08,
    }
    assert starting["url"] is None  # nothing answers yet
    assert starting["selector"] == "serving.conveyor.dev/inferenceservice=llama"
    conditions = _conditions(starting)
    assert conditions["CapacityPlanned"]["status"] == "True"
    assert "max_num_seqs 112" in conditions["CapacityPlanned"]["message"]
    assert conditions["Ready"]["status"] == "False"
    assert conditions["Ready"]["reason"] == "ReplicasNotReady"

    dep["status"]["readyReplicas"] = 1
    ready = _status(dep, previous=starting, now=LATER)
    conditions = _conditions(ready)
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("True", "ReplicasReady")
    assert conditions["Ready"]["lastTransitionTime"] == LATER
    # Unchanged conditions keep their transition time, so a repeated reconcile writes nothing new.
    assert conditions["CapacityPlanned"]["lastTransitionTime"] == NOW
    assert _status(dep, previous=ready, now="2026-11-29T11:00:00Z") == ready
    assert ready["readyReplicas"] == 1 and ready["replicas"] == 1
    assert ready["url"] == "http://llama.serving.svc.cluster.local"


def test_unschedulable_pods_are_named_in_ready() -> None:
    dep = _deployment(replicas=2)
    dep["metadata"]["generation"] = 1
    dep["status"] = {"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 1}
    why = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    status = build_status(
        name="llama",
        namespace="serving",
        generation=3,
        spec=_spec(),
        plan=plan_for_spec(_spec()),
        failure=None,
        deployment=dep,
        previous={},
        now=NOW,
        unschedulable=(1, why),
    )
    ready = _conditions(status)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "PodsUnschedulable")
    assert ready["message"] == f"1/2 replicas ready; 1 pod(s) cannot be scheduled: {why}"


@pytest.mark.parametrize(
    ("current", "desired", "reason"), [(1, 3, "ScalingUp"), (3, 1, "ScalingDown"), (2, 2, "Stable")]
)
def test_scaling_condition(current: int, desired: int, reason: str) -> None:
    dep = _deployment(replicas=desired)
    dep["metadata"]["generation"] = 2
    dep["status"] = {
        "observedGeneration": 2,
        "replicas": current,
        "updatedReplicas": current,
        "readyReplicas": current,
    }
    scaling = _conditions(_status(dep))["Scaling"]
    assert scaling["reason"] == reason
    assert scaling["status"] == ("False" if reason == "Stable" else "True")


def test_status_for_a_spec_that_does_not_fit() -> None:
    spec = _spec(model={"name": "llama-3-70b", "uri": None})
    status = build_status(
        name="llama",
        namespace="serving",
        generation=1,
        spec=spec,
        plan=None,
        failure=("InsufficientGPUMemory", "short by 60.42 GiB"),
        deployment=None,
        previous={},
        now=NOW,
    )
    conditions = _conditions(status)
    assert conditions["CapacityPlanned"] == {
        "type": "CapacityPlanned",
        "status": "False",
        "reason": "InsufficientGPUMemory",
        "message": "short by 60.42 GiB",
        "lastTransitionTime": NOW,
        "observedGeneration": 1,
    }
    assert conditions["Ready"]["reason"] == "CapacityNotPlanned"
    assert status["capacity"] is None
    assert status["url"] is None
    assert status["replicas"] == 0


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"resources": {"gpusPerReplica": 2}, "model": {"dtype": "bfloat16"}},
        {
            "engine": {
                "maxNumBatchedTokens": 4096,
                "enablePrefixCaching": False,
                "enableChunkedPrefill": False,
            }
        },
    ],
)
def test_server_args_parse_with_the_servers_own_cli(extra: dict[str, Any]) -> None:
    """The Deployment's args are accepted by `conveyor serve` and mean what the plan says."""
    from conveyor.server.cli import build_parser

    spec = _spec(**extra)
    plan = plan_for_spec(spec)
    args = build_parser().parse_args(server_args(spec, plan))
    assert args.command == "serve"
    assert args.model == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert args.served_model_name == "llama-3-8b"
    assert args.dtype == spec.model.dtype
    assert args.max_model_len == spec.model.max_model_len
    assert args.max_num_seqs == plan.max_num_seqs
    assert args.gpu_memory_utilization == spec.engine.gpu_memory_utilization
    assert args.tensor_parallel_size == spec.tensor_parallel_size
    assert args.block_size == spec.engine.block_size
    assert args.enable_prefix_caching is spec.engine.enable_prefix_caching
    assert args.enable_chunked_prefill is spec.engine.enable_chunked_prefill
    assert args.max_num_batched_tokens == spec.engine.max_num_batched_tokens
    assert (args.host, args.port) == ("0.0.0.0", 8000)


THREE_TARGETS = {
    "minReplicas": 0,
    "maxReplicas": 6,
    "targetTTFTSeconds": 0.75,
    "targetQueueDepth": 4,
    "targetRequestsPerSecond": 2.5,
}


def test_hpa_engine_renders_pods_metrics_for_every_target_and_no_replicas() -> None:
    spec = _spec(autoscaling={**THREE_TARGETS, "engine": "hpa"})
    objects = render_all(OWNER, spec, plan_for_spec(spec), None, service_monitor=False)
    deployment, hpa = objects[0], objects[-1]
    assert "replicas" not in deployment["spec"]
    assert hpa["kind"] == "HorizontalPodAutoscaler"
    assert hpa["spec"]["minReplicas"] == 1  # the HPA controller cannot go to 0
    targets = {
        m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]
    }
    assert targets == {
        "conveyor_num_requests_waiting": "4",
        "conveyor_time_to_first_token_seconds_p90": "750m",
        "conveyor_requests_started_per_second": "2500m",
    }
    assert hpa["spec"]["behavior"]["scaleUp"]["policies"][1] == {
        "type": "Pods",
        "value": 4,
        "periodSeconds": 15,
    }


def test_keda_engine_renders_a_trigger_per_target_over_ready_pods() -> None:
    spec = _spec(autoscaling={**THREE_TARGETS, "engine": "keda"})
    objects = render_all(
        OWNER,
        spec,
        plan_for_spec(spec),
        None,
        service_monitor=False,
        scaled_object=True,
        prometheus_url="http://p:9090",
    )
    scaled = objects[-1]
    assert scaled["kind"] == "ScaledObject" and scaled["spec"]["minReplicaCount"] == 0
    triggers = [
        (t["metricType"], t["metadata"]["threshold"], t["metadata"]["query"])
        for t in scaled["spec"]["triggers"]
    ]
    assert [(kind, threshold) for kind, threshold, _ in triggers] == [
        ("AverageValue", "4"),
        ("Value", "0.75"),
        ("AverageValue", "2.5"),
    ]
    assert all('kube_pod_status_ready{namespace="serving"' in query for _, _, query in triggers)
    assert all(t["metadata"]["serverAddress"] == "http://p:9090" for t in scaled["spec"]["triggers"])
    # Without KEDA's API nothing is rendered for it.
    assert (
        render_all(OWNER, spec, plan_for_spec(spec), None, service_monitor=False)[-1]["kind"]
        == "PodDisruptionBudget"
    )
