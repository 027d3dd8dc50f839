"""InferenceService spec + capacity plan -> the Kubernetes objects that serve it.

Pure functions returning plain dicts ready for server-side apply: a Deployment of `conveyor serve`, a
Service, a PodDisruptionBudget and (when the Prometheus operator's API exists) a ServiceMonitor; with
`spec.router` enabled also a `conveyor router` Deployment and Service with the ServiceAccount, Role and
RoleBinding it reads EndpointSlices with, its ServiceMonitor, and (when the Gateway API Inference
Extension's API exists) an InferencePool of the server pods. Each carries an owner reference to the
InferenceService so that deleting it garbage-collects them. Nothing here calls the API; the same inputs
always give the same objects, which is what makes reconciling idempotent.

Pod selection. Server pods carry `serving.conveyor.dev/inferenceservice: NAME`, which the server
Deployment, Service, PodDisruptionBudget, `status.selector` and the InferencePool select on (a
Deployment's selector is immutable, so it stays what existing Deployments were created with). Router
pods never carry that key: they carry `serving.conveyor.dev/router: NAME`, which the router Deployment
and Service select on, and `app.kubernetes.io/component: router` (server pods: `inference-server`).
Each selector needs a key the other kind of pod lacks, so neither can match the other's pods.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from conveyor.operator.catalog import hub_id
from conveyor.operator.plan import SpecPlan
from conveyor.operator.spec import GROUP, KIND, ROUTER_SUFFIX, VERSION, InferenceServiceSpec
from conveyor.server.cli import ServeArgsError, ServeSettings, parse_serve_argv, serve_argv
from conveyor.server.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)

SERVER_PORT = 8000
SERVICE_PORT = 80
PORT_NAME = "http"
FIELD_MANAGER = "conveyor-operator"

LABEL_INFERENCE_SERVICE = f"{GROUP}/inferenceservice"
LABEL_ROUTER = f"{GROUP}/router"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_RESOURCE = "nvidia.com/gpu"

# Loading tens of GB of weights can take many minutes: the startup probe allows 30 minutes plus 6 s per
# GiB of the replica's weights (a download at about 170 MiB/s, every tensor-parallel rank reading the
# checkpoint) before the kubelet gives up; readiness and liveness stay tight once the server is up.
STARTUP_PERIOD_SECONDS = 10
STARTUP_BASE_SECONDS = 1800
STARTUP_SECONDS_PER_GIB = 6

MODELS_MOUNT = "/models"
HF_HOME = "/models/hf-cache"
# `model.lora`: the ConfigMap listing the adapters, mounted where the server re-reads it
# (`--lora-modules-file`); the kubelet swaps a mounted ConfigMap's files in place when it changes.
LORA_MOUNT = "/etc/conveyor/lora"
LORA_MODULES_KEY = "adapters.json"
LORA_MODULES_FILE = f"{LORA_MOUNT}/{LORA_MODULES_KEY}"
# The root filesystem is read-only; what the server writes goes to emptyDirs: converted models and the
# C++ kernels' build (XDG_CACHE_HOME), Triton's compiled kernels, and /tmp (torch.compile, tempfiles).
CACHE_DIR = "/var/cache/conveyor"
TMP_DIR = "/tmp"
# The images' user (images/*.Dockerfile). Set on the pod, so the kubelet can check runAsNonRoot for an
# image whose USER is a name, and fsGroup makes a cache claim writable to it.
RUN_AS_USER = 10001
# Pod Security Standards, `restricted` profile (kubernetes.io/docs/concepts/security/pod-security-standards):
# the server and router pods pass a namespace that enforces it.
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_USER,
    "runAsGroup": RUN_AS_USER,
    "fsGroup": RUN_AS_USER,
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
SERVER_CONTAINER = "server"
ROUTER_CONTAINER = "router"
COMPONENT_SERVER = "inference-server"
COMPONENT_ROUTER = "router"
# The router is CPU-only: a tokenizer and an HTTP proxy. Requests fit a small node; memory is limited
# (a leak must not take the node), CPU is not (throttling would add latency to every request).
ROUTER_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
# The Gateway API Inference Extension's endpoint picker (EPP): its Service name suffix and ext-proc
# port in the extension's own Helm chart (config/charts/inferencepool: `<pool>-epp`, 9002).
ENDPOINT_PICKER_SUFFIX = "-epp"
ENDPOINT_PICKER_PORT = 9002


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
    """Labels on the server's objects and pods of the InferenceService `name`."""
    return {
        LABEL_NAME: "conveyor-server",
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: COMPONENT_SERVER,
        LABEL_MANAGED_BY: FIELD_MANAGER,
        **selector_labels(name),
    }


def router_name(name: str) -> str:
    """Name of the router's Deployment, Service, ServiceAccount, Role and RoleBinding."""
    return f"{name}{ROUTER_SUFFIX}"


def router_selector_labels(name: str) -> dict[str, str]:
    """Labels that select the router pods of one InferenceService (the router Deployment's selector)."""
    return {LABEL_ROUTER: name}


def router_selector_string(name: str) -> str:
    """`router_selector_labels` as a label-selector string."""
    return ",".join(f"{key}={value}" for key, value in router_selector_labels(name).items())


def router_labels(name: str) -> dict[str, str]:
    """Labels on the router's objects and pods: the operator's instance labels, component `router`,
    and no `serving.conveyor.dev/inferenceservice` (that key selects server pods)."""
    return {
        LABEL_NAME: "conveyor-router",
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: COMPONENT_ROUTER,
        LABEL_MANAGED_BY: FIELD_MANAGER,
        **router_selector_labels(name),
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


def _router_metadata(owner: Owner) -> dict[str, Any]:
    return {
        "name": router_name(owner.name),
        "namespace": owner.namespace,
        "labels": router_labels(owner.name),
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


def lora_config_map_name(name: str) -> str:
    """The ConfigMap of `model.lora`'s adapters: `<name>-lora-adapters`."""
    return f"{name}-lora-adapters"


def _claim_volume(claim: str) -> str:
    """A volume name (a DNS label) for a claim holding adapters, stable while the claim is named."""
    return f"lora-{hashlib.sha256(claim.encode()).hexdigest()[:12]}"


def lora_adapter_path(uri: str) -> str:
    """The path `--lora-modules-file` gives the server for an adapter's `uri`: a Hub id for
    `hf://org/name` (downloaded into HF_HOME), `/models/<claim>/<path>` for `pvc://claim/path`, an
    absolute path as it is."""
    if uri.startswith("hf://"):
        return uri.removeprefix("hf://")
    if uri.startswith("pvc://"):
        claim, _, path = uri.removeprefix("pvc://").partition("/")
        return f"{MODELS_MOUNT}/{claim}/{path}".rstrip("/")
    return uri


def render_lora_config_map(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The ConfigMap the server pods mount at LORA_MOUNT: `adapters.json`, the adapters as
    `--lora-modules-file` reads them (`[{"name": ..., "path": ...}]`, in the spec's order)."""
    assert spec.model.lora is not None
    adapters = [{"name": a.name, "path": lora_adapter_path(a.uri)} for a in spec.model.lora.adapters]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**_metadata(owner), "name": lora_config_map_name(owner.name)},
        "data": {LORA_MODULES_KEY: json.dumps(adapters, indent=1)},
    }


def server_configs(spec: InferenceServiceSpec, plan: SpecPlan) -> ServeSettings:
    """The server's configuration for `spec`: what the operator sets (address, model, planned
    `max_num_seqs`, engine fields) as the server's own config models, so pydantic checks every value
    with the rules `conveyor serve` applies. Raises pydantic's ValidationError (naming the field)."""
    engine = spec.engine
    model, _ = model_source(spec)
    scheduler = {"max_num_seqs": plan.max_num_seqs, "enable_chunked_prefill": engine.enable_chunked_prefill}
    if engine.max_num_batched_tokens is not None:
        scheduler["max_num_batched_tokens"] = engine.max_num_batched_tokens
    return ServeSettings(
        engine=EngineConfig(
            model=ModelConfig(
                model=model,
                served_model_name=spec.model.name,
                dtype=spec.model.dtype,
                max_model_len=spec.model.max_model_len,
            ),
            cache=CacheConfig(
                block_size=engine.block_size,
                gpu_memory_utilization=engine.gpu_memory_utilization,
                enable_prefix_caching=engine.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(**scheduler),
            parallel=ParallelConfig(tensor_parallel_size=plan.tensor_parallel_size),
            speculative=SpeculativeConfig(
                speculative_config=engine.speculative.flag_value() if engine.speculative else None
            ),
            lora=_lora_config(spec),
        ),
        server=ServerConfig(host="0.0.0.0", port=SERVER_PORT),
    )


def _lora_config(spec: InferenceServiceSpec) -> LoRAConfig:
    """`model.lora` as the server's flags: adapters from the mounted ConfigMap's file, which the server
    keeps in step with it, so adding or removing an adapter changes no flag (and restarts no pod)."""
    lora = spec.model.lora
    if lora is None:
        return LoRAConfig()
    return LoRAConfig(
        enable_lora=True,
        lora_modules_file=LORA_MODULES_FILE,
        max_loras=lora.max_adapters,
        max_lora_rank=lora.max_rank,
    )


def server_args(spec: InferenceServiceSpec, plan: SpecPlan) -> list[str]:
    """Arguments of `conveyor serve` (vLLM's flag spelling): `server_configs` rendered by the CLI's own
    `serve_argv`, then the spec's extraArgs. Raises ServeArgsError when the server would refuse them
    (every rendered pod would crash-loop)."""
    try:
        settings = server_configs(spec, plan)
    except ValidationError as exc:
        raise ServeArgsError.from_validation(exc) from None
    args = [*serve_argv(settings.engine, settings.server), *spec.engine.extra_args]
    parse_serve_argv(args)
    return ["serve", *args]


def startup_seconds(plan: SpecPlan) -> int:
    """How long a server pod may take to start (download and load its weights) before it is restarted:
    STARTUP_BASE_SECONDS plus STARTUP_SECONDS_PER_GIB per GiB of weights, whole probe periods."""
    seconds = STARTUP_BASE_SECONDS + STARTUP_SECONDS_PER_GIB * -(-plan.weight_bytes // (1 << 30))
    return -(-seconds // STARTUP_PERIOD_SECONDS) * STARTUP_PERIOD_SECONDS


def _probe(path: str, period: int, failure_threshold: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failure_threshold,
    }


def _model_volumes(spec: InferenceServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) for HF_HOME (`model.cache`), the writable cache and /tmp emptyDirs, and, for
    `pvc://`, the claim holding the weights."""
    _, model_volume = model_source(spec)
    cache = spec.model.cache
    if cache.claim_name is not None:
        hf_cache: dict[str, Any] = {"persistentVolumeClaim": {"claimName": cache.claim_name}}
    else:
        hf_cache = {"emptyDir": {"sizeLimit": cache.size_limit} if cache.size_limit else {}}
    volumes: list[dict[str, Any]] = [
        {"name": "hf-cache", **hf_cache},
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "hf-cache", "mountPath": HF_HOME},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": TMP_DIR},
    ]
    if model_volume is not None:
        claim = model_volume["persistentVolumeClaim"]["claimName"]
        volumes.append(model_volume)
        mounts.append({"name": "model", "mountPath": f"{MODELS_MOUNT}/{claim}", "readOnly": True})
    return volumes, mounts


def _lora_volumes(name: str, spec: InferenceServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of `model.lora`: the adapters' ConfigMap at LORA_MOUNT, and each claim holding
    adapters (`pvc://`) that the model's own claim is not, read-only at /models/<claim>. A claim named
    for the first time changes the pod template (the pods roll once); other adapter changes do not."""
    lora = spec.model.lora
    if lora is None:
        return [], []
    volumes: list[dict[str, Any]] = [
        {"name": "lora-adapters", "configMap": {"name": lora_config_map_name(name)}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "lora-adapters", "mountPath": LORA_MOUNT, "readOnly": True}]
    _, model_volume = model_source(spec)
    mounted = {model_volume["persistentVolumeClaim"]["claimName"]} if model_volume else set()
    for adapter in lora.adapters:
        if not adapter.uri.startswith("pvc://"):
            continue
        claim = adapter.uri.removeprefix("pvc://").partition("/")[0]
        if claim in mounted:
            continue
        mounted.add(claim)
        volume = _claim_volume(claim)
        volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": volume, "mountPath": f"{MODELS_MOUNT}/{claim}", "readOnly": True})
    return volumes, mounts


def _env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    return [
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
        *(e.model_dump(by_alias=True, exclude_none=True) for e in spec.env),
    ]


def _scrape_annotations() -> dict[str, str]:
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(SERVER_PORT),
        "prometheus.io/path": "/metrics",
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

    # Tensor-parallel workers exchange tensors through /dev/shm (NCCL); the container default of
    # 64 MiB is far too small, so mount a memory-backed emptyDir there.
    model_volumes, model_mounts = _model_volumes(spec)
    lora_volumes, lora_mounts = _lora_volumes(owner.name, spec)
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        *model_volumes,
        *lora_volumes,
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}, *model_mounts, *lora_mounts]

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
        "env": _env(spec),
        "ports": [{"name": PORT_NAME, "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "resources": resources,
        "startupProbe": _probe(
            "/health", STARTUP_PERIOD_SECONDS, startup_seconds(plan) // STARTUP_PERIOD_SECONDS
        ),
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        "volumeMounts": mounts,
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }
    if spec.env_from:
        container["envFrom"] = [e.model_dump(by_alias=True, exclude_none=True) for e in spec.env_from]
    pod_spec: dict[str, Any] = {
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
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
            "progressDeadlineSeconds": startup_seconds(plan),
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": common_labels(owner.name),
                    "annotations": _scrape_annotations(),
                },
                "spec": pod_spec,
            },
        },
    }
    if replicas is None:
        del deployment["spec"]["replicas"]
    return deployment


def render_network_policy(owner: Owner, peers: list[dict[str, Any]]) -> dict[str, Any]:
    """A NetworkPolicy admitting to the server pods' port only pods of their namespace (the router, any
    client there) and `peers` (NetworkPolicyPeers: Prometheus' namespace, an ingress gateway); the
    kubelet's probes come from the node and are not subject to it on common CNIs."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(owner),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(owner.name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {}}, *peers],
                    "ports": [{"port": SERVER_PORT, "protocol": "TCP"}],
                }
            ],
        },
    }


def render_service(owner: Owner) -> dict[str, Any]:
    """ClusterIP Service on port 80 in front of the server pods. Its port is named `http`: the
    router finds the replicas as the `http` port of this Service's EndpointSlices."""
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
    return _service_monitor(_metadata(owner), selector_labels(owner.name), extra_labels)


def _service_monitor(
    metadata: dict[str, Any], selector: dict[str, str], extra_labels: dict[str, str] | None
) -> dict[str, Any]:
    """A ServiceMonitor scraping `/metrics` on the `http` port of the Services `selector` matches."""
    metadata["labels"] = {**(extra_labels or {}), **metadata["labels"]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": selector},
            "endpoints": [{"port": PORT_NAME, "path": "/metrics", "interval": "15s"}],
        },
    }


def router_args(owner: Owner, spec: InferenceServiceSpec) -> list[str]:
    """Arguments of `conveyor router`: replicas are the ready endpoints of the server Service's
    EndpointSlices (port `http`), the tokenizer is the model source the server loads, the KV block
    size is the server's, and its metrics' `model_name` is the server's served model name."""
    router = spec.router
    assert router is not None
    model, _ = model_source(spec)
    weights = router.weights
    return [
        "router",
        "--host",
        "0.0.0.0",
        "--port",
        str(SERVER_PORT),
        "--service",
        f"{owner.namespace}/{owner.name}",
        "--service-port-name",
        PORT_NAME,
        "--policy",
        router.policy,
        "--weight-queue",
        str(weights.queue),
        "--weight-kv",
        str(weights.kv),
        "--weight-prefix",
        str(weights.prefix),
        "--weight-lora",
        str(weights.lora),
        "--tokenizer",
        model,
        "--served-model-name",
        spec.model.name,
        "--block-size",
        str(spec.engine.block_size),
        "--queue-timeout",
        str(router.queue_timeout_seconds),
    ]


def render_router_service_account(owner: Owner) -> dict[str, Any]:
    """The router pods' identity: the Role below lets it read EndpointSlices, nothing else."""
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _router_metadata(owner)}


# What the router reads from the API: the EndpointSlices of the server Service (in its namespace).
ROUTER_RULES = [
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
]


def render_router_role(owner: Owner) -> dict[str, Any]:
    """Read EndpointSlices in the namespace. The operator must hold these permissions itself (the API
    server refuses a Role granting more than its creator has), so the chart's ClusterRole has them."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _router_metadata(owner),
        "rules": [dict(rule) for rule in ROUTER_RULES],
    }


def render_router_role_binding(owner: Owner) -> dict[str, Any]:
    """The router's Role, bound to its ServiceAccount."""
    name = router_name(owner.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _router_metadata(owner),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
    }


def render_router_deployment(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The Deployment of `router.replicas` `conveyor router` pods: the server image, no GPU, a
    modest CPU/memory request, no GPU node selector or tolerations (it runs on any node).

    It gets the server's environment (HF_TOKEN for a gated tokenizer) and HF_HOME cache, and for a
    `pvc://` model the claim read-only, since `--tokenizer` is the same model source the server
    loads. Its /health answers while it runs, replicas or not, so a router waiting for a replica
    to wake from zero is Ready and keeps receiving requests.
    """
    router = spec.router
    assert router is not None
    volumes, mounts = _model_volumes(spec)
    container: dict[str, Any] = {
        "name": ROUTER_CONTAINER,
        "image": spec.image,
        "command": ["conveyor"],
        "args": router_args(owner, spec),
        "env": _env(spec),
        "ports": [{"name": PORT_NAME, "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "resources": {key: dict(value) for key, value in ROUTER_RESOURCES.items()},
        # Loading the tokenizer (a download for a hub id) may take a few minutes.
        "startupProbe": _probe("/health", 5, 60),
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        "volumeMounts": mounts,
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }
    if spec.env_from:
        container["envFrom"] = [e.model_dump(by_alias=True, exclude_none=True) for e in spec.env_from]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _router_metadata(owner),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": router_selector_labels(owner.name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {"labels": router_labels(owner.name), "annotations": _scrape_annotations()},
                "spec": {
                    "serviceAccountName": router_name(owner.name),
                    "automountServiceAccountToken": True,
                    "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
                    "containers": [container],
                    "volumes": volumes,
                    # Streams in flight finish after the endpoint is removed, as on the server.
                    "terminationGracePeriodSeconds": 60,
                },
            },
        },
    }


def render_router_service(owner: Owner) -> dict[str, Any]:
    """ClusterIP Service `<name>-router` on port 80 (named `http`) in front of the router pods: the
    InferenceService's URL when the router is enabled."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _router_metadata(owner),
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector_labels(owner.name),
            "ports": [{"name": PORT_NAME, "port": SERVICE_PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def render_router_service_monitor(owner: Owner, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A ServiceMonitor scraping the router pods' /metrics (`conveyor:router_requests_waiting`, which
    the builtin autoscaler reads to wake replicas from zero) through the router Service; its targets
    get `namespace` and `pod`, as the server's do."""
    return _service_monitor(_router_metadata(owner), router_selector_labels(owner.name), extra_labels)


def endpoint_picker_name(name: str) -> str:
    """The Service the InferencePool `name` names as its endpoint picker (not rendered here)."""
    return f"{name}{ENDPOINT_PICKER_SUFFIX}"


def render_inference_pool(owner: Owner) -> dict[str, Any]:
    """An InferencePool (`inference.networking.k8s.io/v1`, Gateway API Inference Extension) of the
    server pods on the server port, so an inference-aware Gateway can route to the same replicas.

    `spec.endpointPickerRef` is required. It does NOT name conveyor's router: a Gateway calls the
    endpoint picker over Envoy's ext-proc gRPC protocol, and `conveyor router` is an HTTP proxy, not
    an ext-proc server; naming it would make every Gateway request fail its picker call. It names
    `<name>-epp` on port 9002, the Service name and port the extension's own chart gives an endpoint
    picker deployed for a pool `<name>` (deploy one there, e.g. the extension's EPP, which reads the
    vLLM-named series conveyor exports). The operator does not create that Service. `failureMode:
    FailOpen` (the extension chart's default) lets a Gateway route to a pool endpoint of its own choice
    while no picker answers, rather than refuse every request.
    """
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": _metadata(owner),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            "targetPorts": [{"number": SERVER_PORT}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "kind": "Service",
                "name": endpoint_picker_name(owner.name),
                "port": {"number": ENDPOINT_PICKER_PORT},
                "failureMode": "FailOpen",
            },
        },
    }


def render_router(
    owner: Owner,
    spec: InferenceServiceSpec,
    *,
    service_monitor: bool,
    inference_pool: bool,
    service_monitor_labels: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The router's objects in apply order (its identity and permissions before its pods), or [] when
    `router.enabled` is false."""
    if not spec.router_enabled:
        return []
    objects = [
        render_router_service_account(owner),
        render_router_role(owner),
        render_router_role_binding(owner),
        render_router_deployment(owner, spec),
        render_router_service(owner),
    ]
    if service_monitor:
        objects.append(render_router_service_monitor(owner, service_monitor_labels))
    if inference_pool:
        objects.append(render_inference_pool(owner))
    return objects


# Pods metrics that Prometheus Adapter serves from the server's series
# (charts/conveyor/prometheus-adapter-values.yaml holds the matching rules).
ADAPTER_QUEUE_METRIC = "conveyor_num_requests_waiting"
ADAPTER_TTFT_METRIC = "conveyor_time_to_first_token_seconds_p90"
ADAPTER_RATE_METRIC = "conveyor_requests_started_per_second"
# Where KEDA's Prometheus triggers look when the operator is given no --prometheus-url
# (kube-prometheus-stack's service).
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"


@dataclass(frozen=True)
class KedaSettings:
    """Operator settings for the ScaledObjects of `autoscaling.engine: keda` (the chart's `keda.*`).

    prometheus_url: the triggers' serverAddress (None: DEFAULT_PROMETHEUS_URL); authentication: (kind,
    name) of a TriggerAuthentication or ClusterTriggerAuthentication for a Prometheus that wants
    credentials, with `auth_modes` (KEDA's `authModes`: bearer, basic, tls, custom); polling_interval:
    seconds between KEDA's queries.
    """

    prometheus_url: str | None = None
    authentication: tuple[str, str] | None = None
    auth_modes: str | None = None
    polling_interval: int = 15


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


def render_scaled_object(owner: Owner, spec: InferenceServiceSpec, keda: KedaSettings) -> dict[str, Any]:
    """A KEDA ScaledObject (keda.sh/v1alpha1) with Prometheus triggers on the same PromQL as the
    builtin autoscaler: queue depth and requests/s as AverageValue (per replica), p90 TTFT as Value
    (ratio to the target times replicas). `ignoreNullValues: "false"` makes an empty result an error, so the HPA
    KEDA drives holds its replicas instead of reading 0."""
    auto = spec.autoscaling
    assert auto is not None
    promql = keda_queries(owner, auto.ttft_window_seconds)
    triggers = []
    if auto.target_queue_depth is not None:
        triggers.append(_prometheus_trigger(keda, promql["queue"], auto.target_queue_depth, "AverageValue"))
    if auto.target_ttft_seconds is not None:
        triggers.append(_prometheus_trigger(keda, promql["ttft"], auto.target_ttft_seconds, "Value"))
    if auto.target_requests_per_second is not None:
        rate = auto.target_requests_per_second
        triggers.append(_prometheus_trigger(keda, promql["rate"], rate, "AverageValue"))
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _metadata(owner),
        "spec": {
            "scaleTargetRef": _scale_target(owner),
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.max_replicas,
            "pollingInterval": keda.polling_interval,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(spec)}},
            "triggers": triggers,
        },
    }


def _prometheus_trigger(keda: KedaSettings, query: str, threshold: float, metric_type: str) -> dict[str, Any]:
    trigger: dict[str, Any] = {
        "type": "prometheus",
        "metricType": metric_type,
        "metadata": {
            "serverAddress": keda.prometheus_url or DEFAULT_PROMETHEUS_URL,
            "query": query,
            "threshold": f"{threshold:g}",
            "ignoreNullValues": "false",
        },
    }
    if keda.auth_modes:
        trigger["metadata"]["authModes"] = keda.auth_modes
    if keda.authentication is not None:
        kind, name = keda.authentication
        trigger["authenticationRef"] = {"name": name, "kind": kind}
    return trigger


def render_all(
    owner: Owner,
    spec: InferenceServiceSpec,
    plan: SpecPlan,
    replicas: int | None,
    *,
    service_monitor: bool,
    scaled_object: bool = False,
    keda: KedaSettings = KedaSettings(),
    service_monitor_labels: dict[str, str] | None = None,
    inference_pool: bool = False,
    network_policy_from: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Every child object, in apply order: `model.lora`'s ConfigMap first (a new pod mounts it); the
    ServiceMonitors only when their API exists; a
    NetworkPolicy when `network_policy_from` is given (operator setting); the router's objects when
    `router.enabled` (its InferencePool when that API exists); an HPA or a ScaledObject (when KEDA's API
    exists) for `autoscaling.engine` hpa or keda."""
    objects = [
        *([render_lora_config_map(owner, spec)] if spec.model.lora is not None else []),
        render_deployment(owner, spec, plan, replicas),
        render_service(owner),
        render_pod_disruption_budget(owner),
    ]
    if network_policy_from is not None:
        objects.append(render_network_policy(owner, network_policy_from))
    if service_monitor:
        objects.append(render_service_monitor(owner, service_monitor_labels))
    objects += render_router(
        owner,
        spec,
        service_monitor=service_monitor,
        inference_pool=inference_pool,
        service_monitor_labels=service_monitor_labels,
    )
    engine = spec.autoscaling.engine if spec.autoscaling is not None else None
    if engine == "hpa":
        objects.append(render_hpa(owner, spec))
    if engine == "keda" and scaled_object:
        objects.append(render_scaled_object(owner, spec, keda))
    return objects
