"""InferenceService spec + capacity plan -> the Kubernetes objects that serve it.

Pure functions returning plain dicts ready for server-side apply: a Deployment of `conveyor serve`, a
Service, a PodDisruptionBudget and (when the Prometheus operator's API exists) a ServiceMonitor. Each
carries an owner reference to the InferenceService so that deleting it garbage-collects them. Nothing
here calls the API; the same inputs always give the same objects, which is what makes reconciling
idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.operator.catalog import hub_id
from conveyor.operator.plan import SpecPlan
from conveyor.operator.spec import GROUP, KIND, VERSION, InferenceServiceSpec

SERVER_PORT = 8000
SERVICE_PORT = 80
PORT_NAME = "http"
FIELD_MANAGER = "conveyor-operator"

LABEL_INFERENCE_SERVICE = f"{GROUP}/inferenceservice"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_RESOURCE = "nvidia.com/gpu"

# Loading tens of GB of weights can take many minutes; the startup probe allows 30 minutes
# (period x failureThreshold) before the kubelet gives up, while readiness and liveness stay tight
# once the server is up.
STARTUP_PERIOD_SECONDS = 10
STARTUP_FAILURE_THRESHOLD = 180

MODELS_MOUNT = "/models"
HF_HOME = "/models/hf-cache"
SERVER_CONTAINER = "server"


@dataclass(frozen=True)
class Owner:
    """The InferenceService the rendered objects belong to."""

    name: str
    namespace: str
    uid: str


def selector_labels(name: str) -> dict[str, str]:
    """Labels that select the pods of one InferenceService (also the Deployment's selector)."""
    return {LABEL_INFERENCE_SERVICE: name}


def selector_string(name: str) -> str:
    """`selector_labels` as a label-selector string, for `status.selector` (scale subresource, HPA)."""
    return ",".join(f"{key}={value}" for key, value in selector_labels(name).items())


def common_labels(name: str) -> dict[str, str]:
    """Labels on every object rendered for the InferenceService `name`."""
    return {
        LABEL_NAME: "conveyor-server",
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: "inference-server",
        LABEL_MANAGED_BY: FIELD_MANAGER,
        **selector_labels(name),
    }


def owner_reference(owner: Owner) -> dict[str, Any]:
    """A controller owner reference to the InferenceService; deletion cascades through it."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(owner: Owner) -> dict[str, Any]:
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": common_labels(owner.name),
        "ownerReferences": [owner_reference(owner)],
    }


def service_url(name: str, namespace: str) -> str:
    """In-cluster base URL of the InferenceService (OpenAI clients append `/v1`)."""
    return f"http://{name}.{namespace}.svc.cluster.local"


def model_source(spec: InferenceServiceSpec) -> tuple[str, dict[str, Any] | None]:
    """The `conveyor serve MODEL` argument and, for `pvc://claim/path`, the volume holding it.

    `hf://org/name` becomes the hub id `org/name`; no URI means the catalog model's hub id
    (`llama-3-8b` -> `meta-llama/Meta-Llama-3-8B-Instruct`), else the model name itself.
    """
    uri = spec.model.uri
    if uri is None:
        return hub_id(spec.model.name) or spec.model.name, None
    if uri.startswith("hf://"):
        return uri.removeprefix("hf://"), None
    claim, _, path = uri.removeprefix("pvc://").partition("/")
    volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return f"{MODELS_MOUNT}/{claim}/{path}".rstrip("/"), volume


def server_args(spec: InferenceServiceSpec, plan: SpecPlan) -> list[str]:
    """Arguments of `conveyor serve` (vLLM's flag spelling) with the planned `--max-num-seqs`."""
    engine = spec.engine
    model, _ = model_source(spec)
    args = [
        "serve",
        model,
        "--host",
        "0.0.0.0",
        "--port",
        str(SERVER_PORT),
        "--served-model-name",
        spec.model.name,
        "--dtype",
        spec.model.dtype,
        "--max-model-len",
        str(spec.model.max_model_len),
        "--max-num-seqs",
        str(plan.max_num_seqs),
        "--gpu-memory-utilization",
        str(engine.gpu_memory_utilization),
        "--tensor-parallel-size",
        str(plan.tensor_parallel_size),
        "--block-size",
        str(engine.block_size),
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching",
        "--enable-chunked-prefill" if engine.enable_chunked_prefill else "--no-enable-chunked-prefill",
    ]
    if engine.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    return args + list(engine.extra_args)


def _probe(path: str, period: int, failure_threshold: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failure_threshold,
    }


def render_deployment(
    owner: Owner, spec: InferenceServiceSpec, plan: SpecPlan, replicas: int | None
) -> dict[str, Any]:
    """The Deployment running `replicas` pods of the server, each with `plan.num_gpus` GPUs.

    `replicas=None` leaves the field out, for an HPA or KEDA that owns it (the API server then starts
    one pod and the autoscaler takes over).
    """
    gpus = str(plan.num_gpus)
    resources: dict[str, dict[str, str]] = {
        "limits": {GPU_RESOURCE: gpus},
        "requests": {GPU_RESOURCE: gpus},
    }
    for key, value in (("cpu", spec.resources.cpu), ("memory", spec.resources.memory)):
        if value is not None:
            resources["limits"][key] = value
            resources["requests"][key] = value

    _, model_volume = model_source(spec)
    # Tensor-parallel workers exchange tensors through /dev/shm (NCCL); the container default of
    # 64 MiB is far too small, so mount a memory-backed emptyDir there.
    cache = spec.model.cache
    if cache.claim_name is not None:
        hf_cache: dict[str, Any] = {"persistentVolumeClaim": {"claimName": cache.claim_name}}
    else:
        hf_cache = {"emptyDir": {"sizeLimit": cache.size_limit} if cache.size_limit else {}}
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "hf-cache", **hf_cache},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "hf-cache", "mountPath": HF_HOME},
    ]
    if model_volume is not None:
        claim = model_volume["persistentVolumeClaim"]["claimName"]
        volumes.append(model_volume)
        mounts.append({"name": "model", "mountPath": f"{MODELS_MOUNT}/{claim}", "readOnly": True})

    node_selector = {GPU_PRODUCT_LABEL: plan.gpu_product_label} if plan.gpu_product_label else {}
    node_selector.update(spec.node_selector)
    # GPU nodes are commonly tainted nvidia.com/gpu:NoSchedule so that only GPU pods land there.
    tolerations: list[dict[str, Any]] = [
        {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
        *(t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations),
    ]

    container = {
        "name": SERVER_CONTAINER,
        "image": spec.image,
        "command": ["conveyor"],
        "args": server_args(spec, plan),
        "env": [
            {"name": "HF_HOME", "value": HF_HOME},
            *(e.model_dump(by_alias=True, exclude_none=True) for e in spec.env),
        ],
        "ports": [{"name": PORT_NAME, "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "resources": resources,
        "startupProbe": _probe("/health", STARTUP_PERIOD_SECONDS, STARTUP_FAILURE_THRESHOLD),
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        "volumeMounts": mounts,
    }
    if spec.env_from:
        container["envFrom"] = [e.model_dump(by_alias=True, exclude_none=True) for e in spec.env_from]
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "nodeSelector": node_selector,
        "tolerations": tolerations,
        "volumes": volumes,
        # In-flight requests get time to finish after the endpoint is removed.
        "terminationGracePeriodSeconds": 60,
    }
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name

    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(owner.name)},
            # A new pod must be ready before an old one goes, so a rollout never drops capacity;
            # it needs one spare replica's worth of GPUs.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": STARTUP_PERIOD_SECONDS * STARTUP_FAILURE_THRESHOLD,
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": common_labels(owner.name),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(SERVER_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
        },
    }
    if replicas is None:
        del deployment["spec"]["replicas"]
    return deployment


def render_service(owner: Owner) -> dict[str, Any]:
    """ClusterIP Service on port 80 in front of the server pods."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner.name),
            "ports": [{"name": PORT_NAME, "port": SERVICE_PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def render_pod_disruption_budget(owner: Owner) -> dict[str, Any]:
    """Voluntary evictions (node drains) take one server pod at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner.name)}},
    }


def render_service_monitor(owner: Owner, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A Prometheus-operator ServiceMonitor scraping the server's /metrics through the Service;
    `extra_labels` (operator setting) are what a Prometheus' serviceMonitorSelector looks for, such
    as kube-prometheus-stack's `release: NAME`."""
    metadata = _metadata(owner)
    metadata["labels"] = {**(extra_labels or {}), **metadata["labels"]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            "endpoints": [{"port": PORT_NAME, "path": "/metrics", "interval": "15s"}],
        },
    }


# Pods metrics that Prometheus Adapter serves from the server's series
# (charts/conveyor/prometheus-adapter-values.yaml holds the matching rules).
ADAPTER_QUEUE_METRIC = "conveyor_num_requests_waiting"
ADAPTER_TTFT_METRIC = "conveyor_time_to_first_token_seconds_p90"
ADAPTER_RATE_METRIC = "conveyor_requests_started_per_second"
# Where KEDA's Prometheus triggers look when the operator is given no --prometheus-url
# (kube-prometheus-stack's service).
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"


def quantity(value: float) -> str:
    """A Kubernetes quantity for a metric target: 4 -> "4", 0.5 -> "500m"."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def _behavior(spec: InferenceServiceSpec) -> dict[str, Any]:
    auto = spec.autoscaling
    assert auto is not None
    return {
        "scaleUp": auto.scale_up.model_dump(by_alias=True, exclude_none=True),
        "scaleDown": auto.scale_down.model_dump(by_alias=True, exclude_none=True),
    }


def _scale_target(owner: Owner) -> dict[str, str]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner.name}


def render_hpa(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """An autoscaling/v2 HorizontalPodAutoscaler on Pods metrics from Prometheus Adapter: per-pod
    waiting requests (AverageValue = targetQueueDepth), per-pod p90 TTFT (AverageValue =
    targetTTFTSeconds) and per-pod requests started per second (AverageValue =
    targetRequestsPerSecond), with the spec's behavior. The HPA controller needs minReplicas >= 1."""
    auto = spec.autoscaling
    assert auto is not None
    metrics = []
    if auto.target_queue_depth is not None:
        metrics.append(_pods_metric(ADAPTER_QUEUE_METRIC, auto.target_queue_depth))
    if auto.target_ttft_seconds is not None:
        metrics.append(_pods_metric(ADAPTER_TTFT_METRIC, auto.target_ttft_seconds))
    if auto.target_requests_per_second is not None:
        metrics.append(_pods_metric(ADAPTER_RATE_METRIC, auto.target_requests_per_second))
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(owner),
        "spec": {
            "scaleTargetRef": _scale_target(owner),
            "minReplicas": max(auto.min_replicas, 1),
            "maxReplicas": auto.max_replicas,
            "metrics": metrics,
            "behavior": _behavior(spec),
        },
    }


def _pods_metric(name: str, target: float) -> dict[str, Any]:
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": quantity(target)},
        },
    }


def keda_queries(owner: Owner, window_seconds: int) -> dict[str, str]:
    """The PromQL of the KEDA triggers: the builtin autoscaler's, over this InferenceService's Ready
    pods as kube-state-metrics reports them (`kube_pod_status_ready`)."""
    pods = f'namespace="{owner.namespace}",pod=~"{owner.name}-[a-z0-9]+-[a-z0-9]+"'
    ready = f'on (namespace, pod) group_left () kube_pod_status_ready{{{pods},condition="true"}}'
    bucket = f"rate(conveyor:time_to_first_token_seconds_bucket{{{pods}}}[{window_seconds}s])"
    started = f"rate(conveyor:time_to_first_token_seconds_count{{{pods}}}[{window_seconds}s])"
    return {
        "queue": f"sum(conveyor:num_requests_waiting{{{pods}}} * {ready})",
        "ttft": f"histogram_quantile(0.9, sum by (le) ({bucket} * {ready}))",
        "rate": f"sum({started} * {ready})",
    }


def render_scaled_object(
    owner: Owner, spec: InferenceServiceSpec, prometheus_url: str | None
) -> dict[str, Any]:
    """A KEDA ScaledObject (keda.sh/v1alpha1) with Prometheus triggers on the same PromQL as the
    builtin autoscaler: queue depth and requests/s as AverageValue (per replica), p90 TTFT as Value
    (ratio to the target times replicas). `ignoreNullValues: "false"` makes an empty result an error, so the HPA
    KEDA drives holds its replicas instead of reading 0."""
    auto = spec.autoscaling
    assert auto is not None
    server = prometheus_url or DEFAULT_PROMETHEUS_URL
    promql = keda_queries(owner, auto.ttft_window_seconds)
    triggers = []
    if auto.target_queue_depth is not None:
        triggers.append(_prometheus_trigger(server, promql["queue"], auto.target_queue_depth, "AverageValue"))
    if auto.target_ttft_seconds is not None:
        triggers.append(_prometheus_trigger(server, promql["ttft"], auto.target_ttft_seconds, "Value"))
    if auto.target_requests_per_second is not None:
        rate = auto.target_requests_per_second
        triggers.append(_prometheus_trigger(server, promql["rate"], rate, "AverageValue"))
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _metadata(owner),
        "spec": {
            "scaleTargetRef": _scale_target(owner),
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.max_replicas,
            "pollingInterval": 15,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(spec)}},
            "triggers": triggers,
        },
    }


def _prometheus_trigger(server: str, query: str, threshold: float, metric_type: str) -> dict[str, Any]:
    return {
        "type": "prometheus",
        "metricType": metric_type,
        "metadata": {
            "serverAddress": server,
            "query": query,
            "threshold": f"{threshold:g}",
            "ignoreNullValues": "false",
        },
    }


def render_all(
    owner: Owner,
    spec: InferenceServiceSpec,
    plan: SpecPlan,
    replicas: int | None,
    *,
    service_monitor: bool,
    scaled_object: bool = False,
    prometheus_url: str | None = None,
    service_monitor_labels: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Every child object, in apply order: the ServiceMonitor only when its API exists; an HPA or a
    ScaledObject (when KEDA's API exists) for `autoscaling.engine` hpa or keda."""
    objects = [
        render_deployment(owner, spec, plan, replicas),
        render_service(owner),
        render_pod_disruption_budget(owner),
    ]
    if service_monitor:
        objects.append(render_service_monitor(owner, service_monitor_labels))
    engine = spec.autoscaling.engine if spec.autoscaling is not None else None
    if engine == "hpa":
        objects.append(render_hpa(owner, spec))
    if engine == "keda" and scaled_object:
        objects.append(render_scaled_object(owner, spec, prometheus_url))
    return objects
