"""Rendering an InferenceService into its children, and computing its status (pure, no cluster)."""

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from conveyor.operator.catalog import UnknownModelError
from conveyor.operator.plan import TensorParallelSizeError, format_plan, plan_for_spec
from conveyor.operator.render import (
    KedaSettings,
    Owner,
    model_source,
    render_all,
    render_deployment,
    render_inference_pool,
    render_pod_disruption_budget,
    render_router_deployment,
    render_service,
    render_service_monitor,
    router_args,
    selector_string,
    server_args,
)
from conveyor.operator.spec import DEFAULT_IMAGE, InferenceServiceSpec, RouterSpec, parse_spec
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


def test_the_startup_window_grows_with_the_weights_a_replica_loads() -> None:
    """Llama-3-70B at TP 4 (131 GiB of weights) gets longer to start than Llama-3-8B (15 GiB)."""
    small = _deployment()
    big_spec = _spec(model={"name": "llama-3-70b", "uri": None}, resources={"gpusPerReplica": 4})
    big = _deployment(big_spec)

    def window(dep: dict[str, Any]) -> int:
        probe = dep["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
        assert dep["spec"]["progressDeadlineSeconds"] == probe["periodSeconds"] * probe["failureThreshold"]
        return probe["periodSeconds"] * probe["failureThreshold"]

    assert window(small) == 1800 + 6 * 15
    assert window(big) == 2600  # 1800 + 6 * 132, in whole 10 s probe periods


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


def _observed_deployment(
    desired: int, replicas: int, updated: int, ready: int, spec: InferenceServiceSpec | None = None
) -> dict[str, Any]:
    """A Deployment of `desired` replicas whose controller has seen its spec and counts the pods so."""
    dep = _deployment(spec, replicas=desired)
    dep["metadata"]["generation"] = 1
    dep["status"] = {
        "observedGeneration": 1,
        "replicas": replicas,
        "updatedReplicas": updated,
        "readyReplicas": ready,
    }
    return dep


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_status_while_pods_start_and_when_ready() -> None:
    dep = _deployment()
    dep["metadata"]["generation"] = 1
    dep["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1}
    starting = _status(dep)
    assert starting["observedGeneration"] == 3
    assert starting["capacity"] == {
        "tensorParallelSize": 1,
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


@pytest.mark.parametrize(
    ("replicas", "updated", "ready", "expected"),
    [
        (2, 2, 2, ("True", "ReplicasReady")),  # scaling 2 -> 1: the extra pod is still counted
        (2, 1, 2, ("False", "ReplicasNotReady")),  # a rollout: one pod of the old template left
        (1, 1, 0, ("False", "ReplicasNotReady")),
    ],
)
def test_ready_through_a_scale_down_but_not_an_unfinished_rollout(
    replicas: int, updated: int, ready: int, expected: tuple[str, str]
) -> None:
    dep = _observed_deployment(1, replicas, updated, ready)
    condition = _conditions(_status(dep))["Ready"]
    assert (condition["status"], condition["reason"]) == expected


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
    dep = _observed_deployment(desired, current, current, current)
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


ENGINE_OVERRIDES = [
    {},
    {"model": {"dtype": "bfloat16"}},
    {"model": {"dtype": "float16"}},
    {"engine": {"maxNumSeqs": 3}},
    {"engine": {"maxNumBatchedTokens": 4096}},
    {"engine": {"gpuMemoryUtilization": 0.5}},
    {"engine": {"blockSize": 32}},
    {"engine": {"enablePrefixCaching": False}},
    {"engine": {"enableChunkedPrefill": False, "maxNumBatchedTokens": 4096}},
    {"engine": {"extraArgs": ["--seed", "7", "--scheduling-policy=priority", "--kv-cache-memory", "1024"]}},
]


@pytest.mark.parametrize("tensor_parallel_size", [1, 2, 4, 8])
@pytest.mark.parametrize("extra", ENGINE_OVERRIDES, ids=lambda e: str(e))
def test_server_args_pass_the_servers_full_config_validation(
    extra: dict[str, Any], tensor_parallel_size: int
) -> None:
    """The Deployment's args are accepted by `conveyor serve`'s own checks (argparse, then the config
    models: the check a `--tensor-parallel-size 4` once failed at start) and mean what the plan says."""
    from conveyor.server.cli import parse_serve_argv

    resources = {"resources": {"gpusPerReplica": tensor_parallel_size}}
    spec = _spec(**copy.deepcopy(extra), **resources)
    plan = plan_for_spec(spec)
    args = server_args(spec, plan)
    assert args[0] == "serve"
    settings = parse_serve_argv(args[1:])
    engine, server = settings.engine, settings.server
    assert engine.model.model == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert engine.model.served_model_name == "llama-3-8b"
    assert engine.model.dtype == spec.model.dtype
    assert engine.model.max_model_len == spec.model.max_model_len
    assert engine.scheduler.max_num_seqs == plan.max_num_seqs
    assert engine.cache.gpu_memory_utilization == spec.engine.gpu_memory_utilization
    assert engine.parallel.tensor_parallel_size == tensor_parallel_size
    assert engine.cache.block_size == spec.engine.block_size
    assert engine.cache.enable_prefix_caching is spec.engine.enable_prefix_caching
    assert engine.scheduler.enable_chunked_prefill is spec.engine.enable_chunked_prefill
    assert engine.scheduler.max_num_batched_tokens == (spec.engine.max_num_batched_tokens or 2048)
    assert (server.host, server.port) == ("0.0.0.0", 8000)
    if spec.engine.extra_args:
        assert (engine.model.seed, engine.scheduler.scheduling_policy) == (7, "priority")


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_arguments_the_server_accepts(path: Path) -> None:
    """Each example (the 70B one at tensor parallel 4 too) starts a server that accepts its arguments."""
    from conveyor.server.cli import parse_serve_argv

    spec = parse_spec(yaml.safe_load(path.read_text())["spec"])
    plan = plan_for_spec(spec)
    settings = parse_serve_argv(server_args(spec, plan)[1:])
    assert settings.engine.parallel.tensor_parallel_size == spec.tensor_parallel_size
    assert settings.engine.scheduler.max_num_seqs == plan.max_num_seqs


def test_speculative_spec_renders_the_flag_the_server_parses_back() -> None:
    from conveyor.server.cli import parse_serve_argv

    speculative = {"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMax": 4}
    spec = _spec(engine={"speculative": speculative})
    args = server_args(spec, plan_for_spec(spec))
    assert json.loads(_flag(args, "--speculative-config")) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
    }
    method = parse_serve_argv(args[1:]).engine.speculative.method
    assert (method.num_speculative_tokens, method.prompt_lookup_min, method.prompt_lookup_max) == (3, 4, 4)
    assert "--speculative-config" not in server_args(_spec(), plan_for_spec(_spec()))
    # The server's rules hold in the resource: bounds from its config, and those between keys.
    for bad, message in (
        ({**speculative, "numSpeculativeTokens": 0}, "greater than or equal to 1"),
        ({**speculative, "promptLookupMin": 5}, "prompt_lookup_min 5 is above prompt_lookup_max 4"),
        ({**speculative, "method": "eagle"}, "'ngram'"),
    ):
        with pytest.raises(ValueError, match=message):
            _spec(engine={"speculative": bad})
    suffix = _spec(
        engine={
            "speculative": {"method": "suffix", "numSpeculativeTokens": 6, "suffixDecodingMaxTreeDepth": 32}
        }
    )
    args = server_args(suffix, plan_for_spec(suffix))
    method = parse_serve_argv(args[1:]).engine.speculative.method
    assert (
        method.method,
        method.suffix_decoding_max_tree_depth,
        method.suffix_decoding_max_cached_requests,
    ) == (
        "suffix",
        32,
        10000,
    )
    with pytest.raises(ValueError, match="set engine.speculative instead"):
        _spec(engine={"extraArgs": ["--speculative-config", "{}"]})


def test_server_args_the_server_would_refuse_are_an_error_not_a_pod() -> None:
    from conveyor.server.cli import ServeArgsError

    spec = _spec(engine={"enableChunkedPrefill": False})
    plan = plan_for_spec(spec)
    bad = dataclasses.replace(plan, max_num_seqs=0)  # a plan the server's config refuses
    with pytest.raises(ServeArgsError, match="--max-num-seqs: Input should be greater than or equal to 1"):
        server_args(spec, bad)


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
        keda=KedaSettings(prometheus_url="http://p:9090"),
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


ROUTED = {"enabled": True}


def _rendered(spec: InferenceServiceSpec, **flags: bool) -> dict[tuple[str, str], dict[str, Any]]:
    objects = render_all(OWNER, spec, plan_for_spec(spec), 1, **flags)
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


@pytest.mark.parametrize("router", [None, {}, {"enabled": False, "replicas": 3}])
def test_no_router_without_router_enabled(router: dict[str, Any] | None) -> None:
    spec = _spec() if router is None else _spec(router=router)
    kinds = [k for k, _ in _rendered(spec, service_monitor=True, inference_pool=True)]
    assert kinds == ["Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor"]


def test_router_objects_names_labels_and_owners() -> None:
    objects = _rendered(_spec(router=ROUTED), service_monitor=True, inference_pool=True)
    assert list(objects) == [
        ("Deployment", "llama"),
        ("Service", "llama"),
        ("PodDisruptionBudget", "llama"),
        ("ServiceMonitor", "llama"),
        ("ServiceAccount", "llama-router"),
        ("Role", "llama-router"),
        ("RoleBinding", "llama-router"),
        ("Deployment", "llama-router"),
        ("Service", "llama-router"),
        ("ServiceMonitor", "llama-router"),
        ("InferencePool", "llama"),
    ]
    router_labels = {
        "app.kubernetes.io/name": "conveyor-router",
        "app.kubernetes.io/instance": "llama",
        "app.kubernetes.io/component": "router",
        "app.kubernetes.io/managed-by": "conveyor-operator",
        "serving.conveyor.dev/router": "llama",
    }
    for (kind, name), obj in objects.items():
        assert obj["metadata"]["namespace"] == "serving"
        assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [OWNER.uid]
        if name == "llama-router":
            assert obj["metadata"]["labels"] == router_labels, kind
    assert _rendered(_spec(router=ROUTED), service_monitor=False, inference_pool=False).keys() == {
        k for k in objects if k[0] not in ("ServiceMonitor", "InferencePool")
    }


def test_router_args_are_exact() -> None:
    spec = _spec(
        engine={"blockSize": 32},
        router={
            "enabled": True,
            "policy": "least-load",
            "weights": {"queue": 2, "kv": 0.5, "prefix": 0},
            "queueTimeoutSeconds": 300,
        },
    )
    assert router_args(OWNER, spec) == [
        "router",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--service",
        "serving/llama",
        "--service-port-name",
        "http",
        "--policy",
        "least-load",
        "--weight-queue",
        "2.0",
        "--weight-kv",
        "0.5",
        "--weight-prefix",
        "0.0",
        "--weight-lora",
        "1.0",
        "--tokenizer",
        "meta-llama/Meta-Llama-3-8B-Instruct",
        "--served-model-name",
        "llama-3-8b",
        "--block-size",
        "32",
        "--queue-timeout",
        "300",
    ]
    defaults = router_args(OWNER, _spec(router=ROUTED))
    assert defaults[defaults.index("--policy") :] == [
        "--policy",
        "prefix-aware",
        "--weight-queue",
        "1.0",
        "--weight-kv",
        "1.0",
        "--weight-prefix",
        "2.0",
        "--weight-lora",
        "1.0",
        "--tokenizer",
        "meta-llama/Meta-Llama-3-8B-Instruct",
        "--served-model-name",
        "llama-3-8b",
        "--block-size",
        "16",
        "--queue-timeout",
        "60",
    ]


def test_router_spec_defaults_are_the_routers() -> None:
    """RouterSpec's defaults and policies are RouterConfig's (the source of `conveyor router`'s flags)."""
    from conveyor.server.router.config import RouterConfig

    defaults = RouterConfig(service="ns/name")
    spec_defaults = RouterSpec(enabled=True)
    assert (defaults.policy, defaults.weight_queue, defaults.weight_kv, defaults.weight_prefix) == (
        spec_defaults.policy,
        spec_defaults.weights.queue,
        spec_defaults.weights.kv,
        spec_defaults.weights.prefix,
    )
    assert defaults.queue_timeout == spec_defaults.queue_timeout_seconds
    assert defaults.service_port_name == "http"
    policies = get_args(RouterConfig.model_fields["policy"].annotation)
    assert policies == get_args(RouterSpec.model_fields["policy"].annotation)


@pytest.mark.parametrize(
    "extra",
    [
        {"router": ROUTED},
        {
            "model": {"uri": "pvc://weights/llama"},
            "engine": {"blockSize": 8},
            "router": {"enabled": True, "policy": "round-robin", "queueTimeoutSeconds": 1},
        },
    ],
)
def test_router_args_parse_with_the_routers_own_cli(extra: dict[str, Any]) -> None:
    """The router Deployment's args are accepted by `conveyor router`'s own parser (its flags are built
    from RouterConfig) and mean what the spec says."""
    from conveyor.server.cli import collect_config
    from conveyor.server.router.app import build_parser
    from conveyor.server.router.config import RouterConfig

    spec = _spec(**extra)
    argv = router_args(OWNER, spec)
    assert argv[0] == "router"
    config = collect_config(build_parser().parse_args(argv[1:]), RouterConfig, "conveyor router")
    assert isinstance(config, RouterConfig)
    router = spec.router
    assert router is not None
    assert (config.host, config.port) == ("0.0.0.0", 8000)
    assert (config.service, config.service_port_name, config.endpoint) == ("serving/llama", "http", [])
    assert config.policy == router.policy
    assert (config.weight_queue, config.weight_kv, config.weight_prefix) == (
        router.weights.queue,
        router.weights.kv,
        router.weights.prefix,
    )
    assert config.tokenizer == model_source(spec)[0]
    assert config.served_model_name == spec.model.name
    assert config.block_size == spec.engine.block_size
    assert config.queue_timeout == router.queue_timeout_seconds


def test_router_and_server_pods_are_selected_apart() -> None:
    """No selector of the server's (Deployment, Service, PDB, status.selector, InferencePool) matches a
    router pod, and the router's matches no server pod; the server Deployment's selector is the one
    existing Deployments were created with (it is immutable)."""
    objects = _rendered(_spec(router=ROUTED), service_monitor=True, inference_pool=True)
    server_pod = objects[("Deployment", "llama")]["spec"]["template"]["metadata"]["labels"]
    router_pod = objects[("Deployment", "llama-router")]["spec"]["template"]["metadata"]["labels"]
    server_selectors = [
        objects[("Deployment", "llama")]["spec"]["selector"]["matchLabels"],
        objects[("Service", "llama")]["spec"]["selector"],
        objects[("PodDisruptionBudget", "llama")]["spec"]["selector"]["matchLabels"],
        objects[("InferencePool", "llama")]["spec"]["selector"]["matchLabels"],
        dict(kv.split("=") for kv in selector_string("llama").split(",")),
    ]
    router_selectors = [
        objects[("Deployment", "llama-router")]["spec"]["selector"]["matchLabels"],
        objects[("Service", "llama-router")]["spec"]["selector"],
    ]
    assert server_selectors[0] == {"serving.conveyor.dev/inferenceservice": "llama"}
    assert router_selectors[0] == {"serving.conveyor.dev/router": "llama"}
    for selector in server_selectors:
        assert _selects(selector, server_pod) and not _selects(selector, router_pod), selector
    for selector in router_selectors:
        assert _selects(selector, router_pod) and not _selects(selector, server_pod), selector
    assert (server_pod["app.kubernetes.io/component"], router_pod["app.kubernetes.io/component"]) == (
        "inference-server",
        "router",
    )
    # Each ServiceMonitor picks its own Service.
    server_service = objects[("Service", "llama")]["metadata"]["labels"]
    router_service = objects[("Service", "llama-router")]["metadata"]["labels"]
    server_monitor = objects[("ServiceMonitor", "llama")]["spec"]["selector"]["matchLabels"]
    router_monitor = objects[("ServiceMonitor", "llama-router")]["spec"]["selector"]["matchLabels"]
    assert _selects(server_monitor, server_service) and not _selects(server_monitor, router_service)
    assert _selects(router_monitor, router_service) and not _selects(router_monitor, server_service)
    assert objects[("ServiceMonitor", "llama-router")]["spec"]["endpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "15s"}
    ]


def test_router_deployment_is_a_cpu_pod_with_its_own_identity() -> None:
    spec = _spec(
        model={"uri": "pvc://weights/llama/8b", "cache": {"sizeLimit": "20Gi"}},
        resources={"cpu": "8", "memory": "64Gi"},
        nodeSelector={"pool": "llm"},
        tolerations=[{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        serviceAccountName="llm-sa",
        env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        envFrom=[{"configMapRef": {"name": "settings"}}],
        image="registry.example/conveyor:1.2",
        router={"enabled": True, "replicas": 2},
    )
    dep = render_router_deployment(OWNER, spec)
    assert dep["metadata"]["name"] == "llama-router"
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llama-router"
    assert "nodeSelector" not in pod and "tolerations" not in pod
    (container,) = pod["containers"]
    assert container["name"] == "router"
    assert container["image"] == "registry.example/conveyor:1.2"
    assert container["command"] == ["conveyor"]
    assert container["args"][container["args"].index("--tokenizer") + 1] == "/models/weights/llama/8b"
    assert container["resources"] == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"memory": "2Gi"},
    }
    assert "nvidia.com/gpu" not in str(dep)
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert_restricted(pod)
    assert container["env"] == [
        *OPERATOR_ENV,
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
    ]
    assert container["envFrom"] == [{"configMapRef": {"name": "settings"}}]
    assert pod["volumes"] == [
        {"name": "hf-cache", "emptyDir": {"sizeLimit": "20Gi"}},
        *WRITABLE_VOLUMES,
        {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
    ]
    assert container["volumeMounts"] == [
        {"name": "hf-cache", "mountPath": "/models/hf-cache"},
        *WRITABLE_MOUNTS,
        {"name": "model", "mountPath": "/models/weights", "readOnly": True},
    ]


# What the operator sets in every server and router container, and the emptyDirs it writes to.
OPERATOR_ENV = [
    {"name": "HF_HOME", "value": "/models/hf-cache"},
    {"name": "XDG_CACHE_HOME", "value": "/var/cache/conveyor"},
    {"name": "TRITON_CACHE_DIR", "value": "/var/cache/conveyor/triton"},
]
WRITABLE_VOLUMES = [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
WRITABLE_MOUNTS = [
    {"name": "cache", "mountPath": "/var/cache/conveyor"},
    {"name": "tmp", "mountPath": "/tmp"},
]


def assert_restricted(pod: dict) -> None:
    """The pod spec meets the Pod Security Standards' `restricted` profile with a read-only root
    filesystem (tests/k8s/test_operator.py proves it against the API server's own admission)."""
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
    mounted = {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"]}
    assert {"/tmp", "/var/cache/conveyor", "/models/hf-cache"} <= mounted


def test_server_pods_are_restricted_with_writable_caches_mounted() -> None:
    pod = _deployment()["spec"]["template"]["spec"]
    assert_restricted(pod)
    (container,) = pod["containers"]
    assert container["env"][:3] == OPERATOR_ENV
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]


def test_router_rbac_reads_endpointslices_only() -> None:
    objects = _rendered(_spec(router=ROUTED), service_monitor=False)
    assert objects[("ServiceAccount", "llama-router")]["apiVersion"] == "v1"
    role = objects[("Role", "llama-router")]
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = objects[("RoleBinding", "llama-router")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "llama-router",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-router", "namespace": "serving"}]
    service = objects[("Service", "llama-router")]
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    # The router discovers replicas by this port name in the server Service's EndpointSlices.
    assert [p["name"] for p in objects[("Service", "llama")]["spec"]["ports"]] == ["http"]


def test_inference_pool_selects_server_pods_and_names_an_endpoint_picker_not_the_router() -> None:
    pool = render_inference_pool(OWNER)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "llama"
    assert pool["spec"] == {
        "selector": {"matchLabels": {"serving.conveyor.dev/inferenceservice": "llama"}},
        "targetPorts": [{"number": 8000}],
        "appProtocol": "http",
        "endpointPickerRef": {
            "kind": "Service",
            "name": "llama-epp",
            "port": {"number": 9002},
            "failureMode": "FailOpen",
        },
    }


def _router_status(
    spec: InferenceServiceSpec, server_ready: int, router_ready: int | None, replicas: int = 1
) -> dict[str, Any]:
    dep = _observed_deployment(replicas, replicas, replicas, server_ready, spec)
    router = None
    if router_ready is not None:
        router = render_router_deployment(OWNER, spec)
        router["metadata"]["generation"] = 1
        router["status"] = {
            "observedGeneration": 1,
            "replicas": 1,
            "updatedReplicas": 1,
            "readyReplicas": router_ready,
        }
    return build_status(
        name="llama",
        namespace="serving",
        generation=3,
        spec=spec,
        plan=plan_for_spec(spec),
        failure=None,
        deployment=dep,
        previous={},
        now=NOW,
        router=router,
    )


def test_status_url_goes_through_the_router() -> None:
    spec = _spec(router=ROUTED)
    ready = _router_status(spec, server_ready=1, router_ready=1)
    assert ready["url"] == "http://llama-router.serving.svc.cluster.local"
    assert _conditions(ready)["Ready"]["reason"] == "ReplicasReady"
    # Replicas Ready but no router pod yet: nothing answers at the URL.
    waiting = _router_status(spec, server_ready=1, router_ready=0)
    assert waiting["url"] is None
    ready_cond = _conditions(waiting)["Ready"]
    assert (ready_cond["status"], ready_cond["reason"]) == ("False", "RouterNotReady")
    assert ready_cond["message"] == "1/1 replicas ready; router 0/1 ready, 1 updated"
    assert _router_status(spec, server_ready=1, router_ready=None)["url"] is None
    # Without a router the URL stays the server Service's.
    assert _router_status(_spec(), server_ready=1, router_ready=None)["url"] == (
        "http://llama.serving.svc.cluster.local"
    )


def test_status_url_at_zero_replicas_only_when_the_router_wakes_one() -> None:
    auto = {"minReplicas": 0, "maxReplicas": 2, "targetQueueDepth": 4}
    woken = _router_status(_spec(router=ROUTED, autoscaling=auto), 0, 1, replicas=0)
    assert woken["url"] == "http://llama-router.serving.svc.cluster.local"
    advisory = _spec(router=ROUTED, autoscaling={**auto, "mode": "Advisory"})
    assert _router_status(advisory, 0, 1, replicas=0)["url"] is None
    assert _router_status(_spec(router=ROUTED, replicas=0), 0, 1, replicas=0)["url"] is None


def test_network_policy_admits_the_namespace_and_the_given_peers_to_the_server_port() -> None:
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert ("NetworkPolicy", "llama") not in _rendered(_spec(), service_monitor=False)
    objects = _rendered(_spec(router=ROUTED), service_monitor=False, network_policy_from=[monitoring])
    policy = objects[("NetworkPolicy", "llama")]
    assert policy["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    spec = policy["spec"]
    server_pod = objects[("Deployment", "llama")]["spec"]["template"]["metadata"]["labels"]
    router_pod = objects[("Deployment", "llama-router")]["spec"]["template"]["metadata"]["labels"]
    assert _selects(spec["podSelector"]["matchLabels"], server_pod)
    assert not _selects(spec["podSelector"]["matchLabels"], router_pod)  # the router stays reachable
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["from"] == [{"podSelector": {}}, monitoring]
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]


def test_the_operators_server_image_fills_in_only_a_missing_image() -> None:
    raw = {"model": {"name": "llama-3-8b", "maxModelLen": 4096}, "resources": {"gpuType": "a100-80gb"}}
    assert parse_spec(raw).image == DEFAULT_IMAGE
    assert parse_spec(raw, "registry.example/server:2").image == "registry.example/server:2"
    assert parse_spec({**raw, "image": "mine:1"}, "registry.example/server:2").image == "mine:1"
    pod = _deployment(parse_spec(raw, "registry.example/server:2"))["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.example/server:2"


def test_keda_settings_reach_every_trigger() -> None:
    spec = _spec(autoscaling={**THREE_TARGETS, "engine": "keda"})
    keda = KedaSettings(
        prometheus_url="https://prom.example:9090",
        authentication=("ClusterTriggerAuthentication", "prometheus-token"),
        auth_modes="bearer",
        polling_interval=30,
    )
    (scaled,) = [
        o
        for o in render_all(
            OWNER, spec, plan_for_spec(spec), None, service_monitor=False, scaled_object=True, keda=keda
        )
        if o["kind"] == "ScaledObject"
    ]
    assert scaled["spec"]["pollingInterval"] == 30
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["metadata"]["serverAddress"] == "https://prom.example:9090"
        assert trigger["metadata"]["authModes"] == "bearer"
        assert trigger["authenticationRef"] == {
            "name": "prometheus-token",
            "kind": "ClusterTriggerAuthentication",
        }


def test_a_draft_model_is_rendered_and_planned_with_its_weights_and_kv() -> None:
    from conveyor.server.capacity import kv_bytes_per_token
    from conveyor.server.cli import parse_serve_argv

    speculative = {"model": "meta-llama/Llama-3.2-1B-Instruct", "numSpeculativeTokens": 4}
    spec = _spec(model={"name": "llama-3.1-8b", "uri": "hf://meta-llama/Llama-3.1-8B-Instruct"},
                 engine={"speculative": speculative})  # fmt: skip
    plain = _spec(model={"name": "llama-3.1-8b", "uri": "hf://meta-llama/Llama-3.1-8B-Instruct"})
    plan, before = plan_for_spec(spec), plan_for_spec(plain)
    method = parse_serve_argv(server_args(spec, plan)[1:]).engine.speculative.method
    assert (method.method, method.model) == ("draft_model", "meta-llama/Llama-3.2-1B-Instruct")
    draft = plan.draft_model
    assert draft is not None and draft.name == "llama-3.2-1b"
    assert plan.weight_bytes == before.weight_bytes + draft.num_params * 2
    draft_kv = kv_bytes_per_token(draft.num_layers, draft.num_kv_heads, draft.head_dim, "bfloat16")
    assert plan.capacity.kv_bytes_per_token == before.capacity.kv_bytes_per_token + draft_kv
    assert plan.capacity.num_kv_blocks < before.capacity.num_kv_blocks
    assert "draft model" in format_plan(plan)
    with pytest.raises(
        UnknownModelError, match=r"unknown draft model \(engine.speculative.model\) 'org/tiny'"
    ):
        plan_for_spec(_spec(engine={"speculative": {**speculative, "model": "org/tiny"}}))
    two_ranks = _spec(
        engine={"speculative": speculative}, resources={"gpuType": "a100-80gb", "gpusPerReplica": 2}
    )
    with pytest.raises(TensorParallelSizeError, match="engine.speculative.model runs on one rank"):
        plan_for_spec(two_ranks)


def _lora_spec(adapters: list[dict[str, str]], **lora: Any) -> InferenceServiceSpec:
    return _spec(model={"uri": "pvc://weights/llama/8b", "lora": {"adapters": adapters, **lora}})


def test_lora_adapters_render_a_config_map_every_server_pod_mounts() -> None:
    spec = _lora_spec(
        [
            {"name": "sql", "uri": "hf://org/sql-lora"},
            {"name": "de", "uri": "pvc://adapters/de"},
            {"name": "shared", "uri": "pvc://weights/adapters/shared"},
            {"name": "local", "uri": "/models/hf-cache/adapters/local"},
        ],
        maxAdapters=2,
        maxRank=32,
    )
    objects = render_all(OWNER, spec, plan_for_spec(spec), 2, service_monitor=False)
    config_map = objects[0]
    assert (config_map["kind"], config_map["metadata"]["name"]) == ("ConfigMap", "llama-lora-adapters")
    assert config_map["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert json.loads(config_map["data"]["adapters.json"]) == [
        {"name": "sql", "path": "org/sql-lora"},
        {"name": "de", "path": "/models/adapters/de"},
        {"name": "shared", "path": "/models/weights/adapters/shared"},
        {"name": "local", "path": "/models/hf-cache/adapters/local"},
    ]
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert "--enable-lora" in args
    assert _flag(args, "--lora-modules-file") == "/etc/conveyor/lora/adapters.json"
    assert (_flag(args, "--max-loras"), _flag(args, "--max-lora-rank")) == ("2", "32")
    assert {"name": "lora-adapters", "configMap": {"name": "llama-lora-adapters"}} in pod["volumes"]
    assert {"name": "lora-adapters", "mountPath": "/etc/conveyor/lora", "readOnly": True} in container[
        "volumeMounts"
    ]
    # The adapters' claim is mounted once, read-only; the model's own claim is not mounted twice.
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert sorted(claims) == ["adapters", "weights"]
    assert {"mountPath": "/models/adapters", "readOnly": True}.items() <= next(
        m for m in container["volumeMounts"] if m["mountPath"] == "/models/adapters"
    ).items()


def test_adding_or_removing_an_adapter_leaves_the_pod_template_alone() -> None:
    """Only the ConfigMap changes, so no pod restarts; the server re-reads the file."""
    one = _lora_spec([{"name": "sql", "uri": "hf://org/sql-lora"}])
    two = _lora_spec([{"name": "sql", "uri": "hf://org/sql-lora"}, {"name": "de", "uri": "/adapters/de"}])
    none = _lora_spec([])
    templates = [_deployment(s)["spec"]["template"] for s in (one, two, none)]
    assert templates[0] == templates[1] == templates[2]
    assert _deployment(_spec())["spec"]["template"] != templates[0]  # turning LoRA on is a rollout


def test_lora_adapters_are_checked_in_the_spec() -> None:
    with pytest.raises(ValueError, match="adapter names must be unique: sql repeated"):
        _lora_spec([{"name": "sql", "uri": "hf://org/a"}, {"name": "sql", "uri": "hf://org/b"}])
    with pytest.raises(ValueError, match="'llama-3-8b' is the model's own name"):
        _lora_spec([{"name": "llama-3-8b", "uri": "hf://org/a"}])
    for uri in ("relative/path", "s3://bucket/a", "hf://only-org"):
        with pytest.raises(ValueError, match="uri"):
            _lora_spec([{"name": "a", "uri": uri}])
    with pytest.raises(ValueError, match="maxRank"):
        _lora_spec([], maxRank=2048)


def test_the_plan_counts_the_adapter_slots() -> None:
    """maxAdapters slots of maxRank on Llama-3-8B's seven projections of 32 layers, bfloat16:
    R * (7 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336) elements per layer and slot."""
    base = plan_for_spec(_spec())
    plan = plan_for_spec(_lora_spec([], maxAdapters=4, maxRank=16))
    per_slot_and_layer = 16 * (7 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336)
    assert plan.lora_bytes == 32 * 4 * per_slot_and_layer * 2
    assert plan.weight_bytes == base.weight_bytes + plan.lora_bytes
    assert plan.capacity.kv_pool_bytes < base.capacity.kv_pool_bytes
    assert "lora adapters" in format_plan(plan) and "lora adapters" not in format_plan(base)


def test_status_keeps_the_adapters_timer_fields_while_lora_is_on() -> None:
    timer = {
        "conditions": [
            {"type": "AdaptersReady", "status": "True", "reason": "AdaptersLoaded", "message": ""}
        ],
        "loraAdapters": [{"name": "sql", "loadedReplicas": 1, "readyReplicas": 1}],
    }
    spec = _lora_spec([{"name": "sql", "uri": "hf://org/sql-lora"}])
    kwargs = dict(name="llama", namespace="serving", generation=3, failure=None, deployment=None, now=NOW)
    kept = build_status(spec=spec, plan=plan_for_spec(spec), previous=timer, **kwargs)
    assert kept["loraAdapters"] == timer["loraAdapters"]
    assert "AdaptersReady" in _conditions(kept)
    gone = build_status(spec=_spec(), plan=plan_for_spec(_spec()), previous=timer, **kwargs)
    assert gone["loraAdapters"] is None and "AdaptersReady" not in _conditions(gone)


def test_the_router_and_its_inference_pool_render_beside_adapters() -> None:
    """The router reads the replicas' adapters itself; its objects and the InferencePool (whose endpoint
    picker reads `vllm:lora_requests_info`) are those of a service without adapters."""
    raw = {**_lora_spec([{"name": "sql", "uri": "hf://org/sql-lora"}]).model_dump(by_alias=True)}
    raw["router"] = {"enabled": True}
    with_lora = parse_spec(raw)
    without = parse_spec({**raw, "model": {**raw["model"], "lora": None}})

    def router_objects(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
        objects = render_all(OWNER, spec, plan_for_spec(spec), 1, service_monitor=True, inference_pool=True)
        return [
            o
            for o in objects
            if o["kind"] not in ("ConfigMap", "Deployment") or "router" in o["metadata"]["name"]
        ]

    kinds = [o["kind"] for o in router_objects(with_lora)]
    assert "InferencePool" in kinds
    assert router_objects(with_lora) == router_objects(without)
