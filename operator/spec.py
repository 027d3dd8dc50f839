"""The InferenceService resource (`serving.conveyor.dev/v1alpha1`) as pydantic models.

These models are the single source of the CRD's OpenAPI schema (`conveyor.operator.crd`): field names
are camelCase aliases as Kubernetes writes them, defaults and enums land in the schema, and the CEL
rules the API server enforces are attached to the models as `x-kubernetes-validations`.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from conveyor.server.config import (
    CacheConfig,
    LoRAConfig,
    Quantization,
    SchedulerConfig,
    SpeculativeMethod,
    parse_speculative_config,
)

GROUP = "serving.conveyor.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["cisvc"]

# The server image (images/server.Dockerfile) of resources without `spec.image`, unless the operator is
# given another (`conveyor operator --server-image`, the chart's `serverImage`).
SERVER_IMAGE_REPOSITORY = "ghcr.io/conveyor-dev/conveyor-server"
DEFAULT_IMAGE = f"{SERVER_IMAGE_REPOSITORY}:{importlib.metadata.version('conveyor')}"

Dtype = Literal["auto", "float16", "bfloat16", "float32"]

# Names and values the children's API objects require, as Kubernetes validates them (apimachinery's
# validation.IsDNS1035Label, IsDNS1123Subdomain, IsQualifiedName, IsValidLabelValue and
# resource.Quantity). Each is used by a CEL rule or `pattern` in the CRD and by pydantic alike, so
# the API server refuses what the operator could not create, and parse_spec agrees with it.
DNS1035_LABEL = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE = r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"
QUANTITY = r"^[+]?([0-9]+([.][0-9]*)?|[.][0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
NAME_RULE_MESSAGE = (
    "metadata.name must be a DNS-1035 label (at most 63 lower-case letters, digits and '-', starting "
    "with a letter and ending with a letter or digit): it names the InferenceService's Service"
)
# The router's objects are `<name>-router`, and a Service name is a DNS-1035 label (at most 63).
ROUTER_SUFFIX = "-router"
MAX_NAME_WITH_ROUTER = 63 - len(ROUTER_SUFFIX)
ROUTER_NAME_RULE_MESSAGE = (
    f"with router.enabled metadata.name must be at most {MAX_NAME_WITH_ROUTER} characters: it names "
    f"the router's Service <name>{ROUTER_SUFFIX}, a DNS-1035 label of at most 63"
)
# `conveyor serve` flags the operator sets (flag -> what to do instead).
OWNED_FLAGS = {
    "--host": "it is the operator's",
    "--port": "it is the operator's (the probes and the Service target it)",
    "--served-model-name": "set model.name instead",
    "--dtype": "set model.dtype instead",
    "--max-model-len": "set model.maxModelLen instead",
    "--max-num-seqs": "set engine.maxNumSeqs instead",
    "--gpu-memory-utilization": "set engine.gpuMemoryUtilization instead",
    "--tensor-parallel-size": "set resources.tensorParallelSize instead",
    "--block-size": "set engine.blockSize instead",
    "--enable-prefix-caching": "set engine.enablePrefixCaching instead",
    "--no-enable-prefix-caching": "set engine.enablePrefixCaching instead",
    "--enable-chunked-prefill": "set engine.enableChunkedPrefill instead",
    "--no-enable-chunked-prefill": "set engine.enableChunkedPrefill instead",
    "--max-num-batched-tokens": "set engine.maxNumBatchedTokens instead",
    "--speculative-config": "set engine.speculative instead",
}
_OWNED_FLAG_RE = "^(" + "|".join(OWNED_FLAGS) + ")(=.*)?$"  # flags need no escaping


def _flag_of(arg: str) -> str:
    return arg.split("=", 1)[0]


def _cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One `x-kubernetes-validations` entry."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


def _validations(*rules: dict[str, str]) -> ConfigDict:
    """A model's config carrying CEL rules (`_cel` entries) for the CRD."""
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": list(rules)})


class _CamelModel(BaseModel):
    """Base for resource fields: camelCase aliases, population by either name, unknown fields ignored
    (the API server already prunes them; an older operator must tolerate a newer CRD)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class KeyRef(_CamelModel):
    """A key of a Secret or ConfigMap in the resource's namespace."""

    name: str = Field(pattern=DNS1123_SUBDOMAIN, max_length=253, description="The Secret or ConfigMap.")
    key: str = Field(min_length=1, max_length=253, description="The key in it.")
    optional: bool | None = Field(default=None, description="Start even when it is missing.")


class FieldRef(_CamelModel):
    """A field of the pod (metadata.name, metadata.namespace, status.podIP, ...)."""

    field_path: str = Field(min_length=1, max_length=256)


class EnvVarSource(_CamelModel):
    """Where an environment variable's value comes from (core/v1 EnvVarSource, one of)."""

    model_config = _validations(
        _cel(
            "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef)]"
            ".filter(x, x).size() == 1",
            "valueFrom takes exactly one of secretKeyRef, configMapKeyRef, fieldRef",
        )
    )

    secret_key_ref: KeyRef | None = None
    config_map_key_ref: KeyRef | None = None
    field_ref: FieldRef | None = None

    @model_validator(mode="after")
    def _one_source(self) -> EnvVarSource:
        if sum(x is not None for x in (self.secret_key_ref, self.config_map_key_ref, self.field_ref)) != 1:
            raise ValueError("valueFrom takes exactly one of secretKeyRef, configMapKeyRef, fieldRef")
        return self


# Environment variables the operator sets itself: where it mounts the model cache and the writable caches
# (operator/render.py).
OWNED_ENV = {"HF_HOME", "TRITON_CACHE_DIR", "XDG_CACHE_HOME"}
OWNED_ENV_MESSAGE = "set by the operator (where it mounts the model cache and the writable caches)"


class EnvVar(_CamelModel):
    """An environment variable of the server container (core/v1 EnvVar), e.g. HF_TOKEN from a Secret."""

    model_config = _validations(
        _cel("!(has(self.value) && has(self.valueFrom))", "set value or valueFrom, not both"),
        _cel(
            "!(self.name in [" + ", ".join(f"'{n}'" for n in sorted(OWNED_ENV)) + "])",
            f"{', '.join(sorted(OWNED_ENV))} are {OWNED_ENV_MESSAGE}",
        ),
    )

    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=256)
    value: str | None = None
    value_from: EnvVarSource | None = None

    @model_validator(mode="after")
    def _value_or_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError("set value or valueFrom, not both")
        if self.name in OWNED_ENV:
            raise ValueError(f"{self.name} is {OWNED_ENV_MESSAGE}")
        return self


class LocalObjectRef(_CamelModel):
    """A Secret or ConfigMap whose every key becomes an environment variable."""

    name: str = Field(pattern=DNS1123_SUBDOMAIN, max_length=253)
    optional: bool | None = None


class EnvFromSource(_CamelModel):
    """core/v1 EnvFromSource: all keys of one Secret or ConfigMap, optionally prefixed."""

    model_config = _validations(
        _cel(
            "has(self.secretRef) != has(self.configMapRef)",
            "envFrom takes exactly one of secretRef, configMapRef",
        )
    )

    prefix: str | None = Field(default=None, max_length=256)
    secret_ref: LocalObjectRef | None = None
    config_map_ref: LocalObjectRef | None = None

    @model_validator(mode="after")
    def _one_source(self) -> EnvFromSource:
        if (self.secret_ref is None) == (self.config_map_ref is None):
            raise ValueError("envFrom takes exactly one of secretRef, configMapRef")
        return self


def _check_unique(names: list[str], what: str) -> None:
    """Raise ValueError naming the repeated ones among `names` (`what`: e.g. "env names")."""
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{what} must be unique: {', '.join(duplicates)} repeated")


def _server_field(config: type[BaseModel], name: str, description: str, default: Any = ...) -> Any:
    """A field with the bounds (ge, gt, le, lt) and, unless given, the default of the server's config
    field `config.name`, so the CRD accepts no value `conveyor serve` refuses and defaults to what it
    would (DESIGN.md: the engine spec derives from the server's config models)."""
    info = config.model_fields[name]
    bounds = {
        key: getattr(item, key)
        for item in info.metadata
        for key in ("ge", "gt", "le", "lt")
        if hasattr(item, key)
    }
    return Field(default=info.default if default is ... else default, description=description, **bounds)


class ModelCacheSpec(_CamelModel):
    """Where pods keep downloaded weights (HF_HOME): by default an emptyDir per pod, so every new pod
    downloads again; a PersistentVolumeClaim (ReadWriteMany) shares one download between pods."""

    model_config = _validations(
        _cel(
            "!(has(self.claimName) && has(self.sizeLimit))",
            "sizeLimit is for the emptyDir; a claim has its own size",
        )
    )

    claim_name: str | None = Field(
        default=None,
        pattern=DNS1123_SUBDOMAIN,
        max_length=253,
        description="A PersistentVolumeClaim in the namespace, mounted read-write at HF_HOME.",
    )
    size_limit: str | None = Field(
        default=None,
        pattern=QUANTITY,
        max_length=64,
        description="Size limit of the per-pod emptyDir (e.g. 100Gi); the kubelet evicts a pod past it.",
    )

    @model_validator(mode="after")
    def _claim_or_size(self) -> ModelCacheSpec:
        if self.claim_name is not None and self.size_limit is not None:
            raise ValueError("sizeLimit is for the emptyDir; a claim has its own size")
        return self


# An adapter's source: a Hub id, a claim and path in it, or a path in the server container.
_ADAPTER_URI = r"^(hf://[^/\s]+/[^/\s]+|pvc://[^/\s]+(/\S*)?|/\S+)$"


class LoRAAdapterSpec(_CamelModel):
    """One LoRA adapter (a PEFT directory) of the base model, served as its own OpenAI `model`."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*$",
        max_length=128,
        description="The OpenAI `model` id requests name it by.",
    )
    uri: str = Field(
        pattern=_ADAPTER_URI,
        max_length=1024,
        description="Where the adapter comes from: hf://org/name (a Hub id, downloaded into the model cache "
        "as the base model is), pvc://claim/path (a claim in the namespace, mounted read-only), or an "
        "absolute path in the server container (e.g. under the model cache, /models/hf-cache/...).",
    )

    @field_validator("uri", mode="before")
    @classmethod
    def _uri_form(cls, value: Any) -> Any:
        if isinstance(value, str) and not re.match(_ADAPTER_URI, value):
            raise ValueError(f"{value!r} is not hf://org/name, pvc://claim/path or an absolute path")
        return value


class LoRASpec(_CamelModel):
    """LoRA adapters served beside the base model (`conveyor serve --enable-lora`). The operator keeps
    the set on every replica: a new pod loads them all before it is Ready, and adding or removing one
    here loads or unloads it on the running pods without a restart (a ConfigMap the server re-reads,
    `--lora-modules-file`)."""

    adapters: list[LoRAAdapterSpec] = Field(
        default_factory=list,
        max_length=64,
        description="The adapters, by name.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    max_adapters: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Adapters one engine step runs, each in its own slot of maxRank (--max-loras); more are "
        "served, their requests waiting for a slot. Changing it restarts the pods; adding adapters does not.",
    )
    max_rank: int = _server_field(
        LoRAConfig, "max_lora_rank", "The highest adapter rank accepted (--max-lora-rank)."
    )

    @field_validator("adapters")
    @classmethod
    def _unique_names(cls, value: list[LoRAAdapterSpec]) -> list[LoRAAdapterSpec]:
        _check_unique([a.name for a in value], "adapter names")
        return value


class ModelSpec(_CamelModel):
    """Which model to serve and how long its sequences may be."""

    name: str = Field(
        min_length=1,
        description="Model name, served as the OpenAI `model` id; also the catalog key (e.g. llama-3-8b).",
    )
    uri: str | None = Field(
        default=None,
        pattern=r"^(hf://[^/\s]+/[^/\s]+|pvc://[^/\s]+(/\S*)?)$",
        description="Where the weights come from: hf://org/name (hub id) or pvc://claim/path. "
        "Defaults to the catalog model's hub id (llama-3-8b: meta-llama/Meta-Llama-3-8B-Instruct), "
        "else the model name as a hub id or local path.",
    )
    dtype: Dtype = Field(default="auto", description="Weight and KV-cache dtype (--dtype).")
    max_model_len: int = Field(
        ge=16, le=1_048_576, description="Longest sequence (prompt + output) in tokens (--max-model-len)."
    )
    layers: int | None = Field(default=None, ge=1, description="Override: number of transformer layers.")
    kv_heads: int | None = Field(default=None, ge=1, description="Override: number of KV heads.")
    head_dim: int | None = Field(default=None, ge=1, description="Override: attention head dimension.")
    params: int | None = Field(default=None, ge=1, description="Override: number of parameters.")
    cache: ModelCacheSpec = Field(
        default_factory=ModelCacheSpec, description="Where pods keep downloaded weights (HF_HOME)."
    )
    lora: LoRASpec | None = Field(
        default=None, description="LoRA adapters of this model, served beside it on every replica."
    )

    @model_validator(mode="after")
    def _adapter_names(self) -> ModelSpec:
        if self.lora is not None and any(a.name == self.name for a in self.lora.adapters):
            raise ValueError(f"lora.adapters: {self.name!r} is the model's own name")
        return self


class ResourcesSpec(_CamelModel):
    """GPUs per replica and extra container resources."""

    model_config = _validations(
        _cel(
            "!has(self.tensorParallelSize) || self.gpusPerReplica % self.tensorParallelSize == 0",
            "gpusPerReplica must be divisible by tensorParallelSize",
        )
    )

    gpu_type: str = Field(
        min_length=1,
        description="GPU type from the catalog (a100-80gb, h100-80gb, h200-141gb, l40s, a10g, l4, t4, ...).",
    )
    gpus_per_replica: int = Field(default=1, ge=1, le=16, description="GPUs per replica (nvidia.com/gpu).")
    tensor_parallel_size: int | None = Field(
        default=None, ge=1, le=16, description="Tensor-parallel degree; defaults to gpusPerReplica."
    )
    gpu_memory: str | None = Field(
        default=None,
        pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$",
        description="Override: memory of one GPU as a quantity (e.g. 80Gi), for GPUs not in the catalog.",
    )
    cpu: str | None = Field(
        default=None,
        pattern=QUANTITY,
        max_length=64,
        description="CPU request and limit of the server container, a quantity (e.g. 8 or 8000m).",
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel("quantity(self).isGreaterThan(quantity('0'))", "cpu must be more than 0")
            ]
        },
    )
    memory: str | None = Field(
        default=None,
        pattern=QUANTITY,
        max_length=64,
        description="Memory request and limit of the server container, a quantity (e.g. 64Gi).",
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel("quantity(self).isGreaterThan(quantity('0'))", "memory must be more than 0")
            ]
        },
    )

    @field_validator("cpu", "memory")
    @classmethod
    def _positive(cls, value: str | None, info: Any) -> str | None:
        if value is not None and float(re.match(r"[+]?([0-9.]*)", value).group(1) or 0) <= 0:
            raise ValueError(f"{info.field_name} must be more than 0")
        return value


class SpeculativeSpec(_CamelModel):
    """Speculative decoding (`conveyor serve --speculative-config`, vLLM's keys; unset ones take the
    server's defaults): drafts verified in the decode step. `ngram` and `suffix` draft from tokens already
    seen, so they add no weights and no KV cache to the plan; a `draft_model` adds its weights and its
    K/V per token (the plan reads its shape from the catalog)."""

    method: Literal["ngram", "suffix", "draft_model"] | None = Field(
        default=None,
        description="How drafts are proposed: ngram = prompt lookup; suffix = suffix decoding over the "
        "sequence and recent requests' outputs; draft_model = a smaller model with the same tokenizer "
        "(the default when model is set).",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        description="draft_model: the draft model, a Hugging Face id the server downloads or a path in "
        "the server container (e.g. under the model cache volume); the catalog must know its shape.",
    )
    quantization: Quantization = _server_field(
        SpeculativeMethod,
        "quantization",
        "draft_model: the draft's weights as --quantization takes them (gguf, int8); the plan counts "
        "them unquantized.",
    )
    num_speculative_tokens: int = _server_field(
        SpeculativeMethod, "num_speculative_tokens", "The most draft tokens per sequence and step."
    )
    prompt_lookup_min: int | None = _server_field(
        SpeculativeMethod, "prompt_lookup_min", "Shortest n-gram matched (default: promptLookupMax)."
    )
    prompt_lookup_max: int | None = _server_field(
        SpeculativeMethod, "prompt_lookup_max", "Longest n-gram matched (default: promptLookupMin, else 5)."
    )
    suffix_decoding_max_tree_depth: int | None = _server_field(
        SpeculativeMethod,
        "suffix_decoding_max_tree_depth",
        "suffix: the longest suffix matched (tokens).",
        None,
    )
    suffix_decoding_max_cached_requests: int | None = _server_field(
        SpeculativeMethod,
        "suffix_decoding_max_cached_requests",
        "suffix: finished requests whose outputs are kept to draft from.",
        None,
    )
    suffix_decoding_max_spec_factor: float | None = _server_field(
        SpeculativeMethod, "suffix_decoding_max_spec_factor", "suffix: draft tokens per matched token.", None
    )
    disable_by_batch_size: int | None = _server_field(
        SpeculativeMethod,
        "disable_by_batch_size",
        "No drafts while more requests than this are running or waiting; default: the server drafts "
        "where the step times it measures at start say drafts pay.",
    )

    @model_validator(mode="after")
    def _server_accepts(self) -> SpeculativeSpec:
        parse_speculative_config(self.flag_value())  # the rules between keys, as the server checks them
        return self

    def flag_value(self) -> str:
        """The `--speculative-config` JSON (vLLM's snake_case keys; unset ones left out)."""
        return json.dumps(self.model_dump(exclude_none=True))


class EngineSpec(_CamelModel):
    """Server engine settings (`conveyor serve`'s bounds and defaults); unset ones come from the plan."""

    max_num_seqs: int | None = _server_field(
        SchedulerConfig, "max_num_seqs", "Override the computed --max-num-seqs (sequences per step)."
    )
    max_num_batched_tokens: int | None = _server_field(
        SchedulerConfig,
        "max_num_batched_tokens",
        "Tokens per engine step (--max-num-batched-tokens); default: the server's "
        f"{SchedulerConfig.model_fields['max_num_batched_tokens'].default}.",
        default=None,
    )
    gpu_memory_utilization: float = _server_field(
        CacheConfig, "gpu_memory_utilization", "Fraction of GPU memory the server may use."
    )
    block_size: Literal[8, 16, 32] = Field(
        default=CacheConfig.model_fields["block_size"].default, description="KV-cache block size in tokens."
    )
    enable_chunked_prefill: bool = _server_field(
        SchedulerConfig, "enable_chunked_prefill", "Split long prefills across steps."
    )
    enable_prefix_caching: bool = _server_field(
        CacheConfig, "enable_prefix_caching", "Share KV blocks of common prefixes."
    )
    speculative: SpeculativeSpec | None = Field(
        default=None, description="Speculative decoding (--speculative-config); default: off."
    )
    extra_args: list[Annotated[str, StringConstraints(max_length=1024)]] = Field(
        default_factory=list,
        max_length=64,
        description="Extra arguments for `conveyor serve`; flags the operator sets from other fields "
        "(--port, --max-num-seqs, ...) are refused, and unknown flags are reported in status.",
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    f"self.all(a, !a.matches('{_OWNED_FLAG_RE}'))",
                    "extraArgs must not set flags the operator sets from the spec ("
                    + ", ".join(
                        sorted({"--" + f.removeprefix("--").removeprefix("no-") for f in OWNED_FLAGS})
                    )
                    + "): use the spec's fields",
                )
            ]
        },
    )

    @field_validator("extra_args")
    @classmethod
    def _extra_args_known(cls, value: list[str]) -> list[str]:
        for arg in value:
            flag = _flag_of(arg)
            if flag in OWNED_FLAGS:
                raise ValueError(f"{flag} is set by the operator: {OWNED_FLAGS[flag]}")
        from conveyor.server.cli import check_serve_args

        problem = check_serve_args(["model", *value])
        if problem is not None:
            raise ValueError(f"conveyor serve would refuse {value}: {problem}")
        return value


class ScalingPolicy(_CamelModel):
    """One rate limit of autoscaling/v2 `HPAScalingPolicy`: at most `value` pods (or percent of the
    replicas at the start of the period) added or removed per `periodSeconds`."""

    type: Literal["Pods", "Percent"]
    value: int = Field(ge=1, description="Pods, or percent of the replicas at the period's start.")
    period_seconds: int = Field(ge=1, le=1800, description="Length of the sliding period.")


class ScalingRules(_CamelModel):
    """autoscaling/v2 `HPAScalingRules` for one direction; unset fields take that direction's default."""

    stabilization_window_seconds: int | None = Field(
        default=None,
        ge=0,
        le=3600,
        description="Recommendations of this long are smoothed (up: lowest, down: highest); "
        "default 0 up, 300 down.",
    )
    select_policy: Literal["Max", "Min", "Disabled"] = Field(
        default="Max",
        description="Which policy wins: the one allowing the most change (Max), the least, "
        "or no scaling in this direction.",
    )
    policies: list[ScalingPolicy] | None = Field(
        default=None,
        min_length=1,
        description="Rate limits; default up: max(100 %, 4 pods) per 15 s, down: 1 pod per 15 s.",
    )


class ScalingBehavior(_CamelModel):
    """autoscaling/v2 `HorizontalPodAutoscalerBehavior`, also rendered as is for the hpa and keda engines."""

    scale_up: ScalingRules = Field(default_factory=ScalingRules)
    scale_down: ScalingRules = Field(default_factory=ScalingRules)


# The defaults of the Horizontal Pod Autoscaler, except scale-down: one pod per period, not 100 %.
DEFAULT_SCALE_UP = ScalingRules(
    stabilization_window_seconds=0,
    select_policy="Max",
    policies=[
        ScalingPolicy(type="Percent", value=100, period_seconds=15),
        ScalingPolicy(type="Pods", value=4, period_seconds=15),
    ],
)
DEFAULT_SCALE_DOWN = ScalingRules(
    stabilization_window_seconds=300,
    select_policy="Max",
    policies=[ScalingPolicy(type="Pods", value=1, period_seconds=15)],
)


def resolved_rules(rules: ScalingRules, default: ScalingRules) -> ScalingRules:
    """`rules` with its unset fields taken from `default`."""
    return ScalingRules(
        stabilization_window_seconds=(
            rules.stabilization_window_seconds
            if rules.stabilization_window_seconds is not None
            else default.stabilization_window_seconds
        ),
        select_policy=rules.select_policy,
        policies=rules.policies if rules.policies is not None else default.policies,
    )


class AutoscalingSpec(_CamelModel):
    """Replica bounds, the latency/queue targets the autoscaler keeps, and who does the scaling."""

    model_config = _validations(
        _cel("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas"),
        _cel(
            "has(self.targetTTFTSeconds) || has(self.targetQueueDepth) || has(self.targetRequestsPerSecond)",
            "set at least one of targetTTFTSeconds, targetQueueDepth, targetRequestsPerSecond",
        ),
    )

    engine: Literal["builtin", "hpa", "keda"] = Field(
        default="builtin",
        description="Who writes replicas: the operator (builtin), an autoscaling/v2 HPA on Pods metrics "
        "from Prometheus Adapter (hpa), or a KEDA ScaledObject with Prometheus triggers (keda).",
    )
    mode: Literal["Active", "Advisory"] = Field(
        default="Active",
        description="Advisory: the builtin autoscaler computes and records decisions but never writes replicas.",
    )
    min_replicas: int = Field(default=1, ge=0, description="Fewest replicas.")
    max_replicas: int = Field(ge=1, description="Most replicas.")
    target_ttft_seconds: float | None = Field(
        default=None, alias="targetTTFTSeconds", gt=0, description="Target p90 time to first token."
    )
    target_queue_depth: float | None = Field(
        default=None, gt=0, description="Target waiting requests per Ready replica."
    )
    target_requests_per_second: float | None = Field(
        default=None,
        gt=0,
        alias="targetRequestsPerSecond",
        description="Target requests started per second per Ready replica (over ttftWindowSeconds); "
        "independent of the replica count, so it does not feed back on itself.",
    )
    ttft_window_seconds: int = Field(
        default=60,
        ge=5,
        le=3600,
        alias="ttftWindowSeconds",
        description="Window of the TTFT histogram's rate() that the p90 is taken over.",
    )
    tolerance: float = Field(
        default=0.1, ge=0, lt=1, description="Metric ratios within 1 +- tolerance leave replicas alone."
    )
    behavior: ScalingBehavior = Field(
        default_factory=ScalingBehavior,
        description="Stabilization windows and rate limits, as autoscaling/v2 HPA behavior.",
    )

    @property
    def scale_up(self) -> ScalingRules:
        """Scale-up rules with defaults filled in."""
        return resolved_rules(self.behavior.scale_up, DEFAULT_SCALE_UP)

    @property
    def scale_down(self) -> ScalingRules:
        """Scale-down rules with defaults filled in."""
        return resolved_rules(self.behavior.scale_down, DEFAULT_SCALE_DOWN)


RouterPolicy = Literal["prefix-aware", "least-load", "round-robin"]


class RouterWeights(_CamelModel):
    """How much each score counts when the router picks a replica (`conveyor router --weight-*`)."""

    queue: float = Field(default=1.0, ge=0, description="Weight of the queue-depth score (--weight-queue).")
    kv: float = Field(default=1.0, ge=0, description="Weight of the KV-cache-usage score (--weight-kv).")
    prefix: float = Field(
        default=2.0,
        ge=0,
        description="Weight of the prefix-affinity score (--weight-prefix); used by policy prefix-aware only.",
    )
    lora: float = Field(
        default=1.0,
        ge=0,
        description="Weight of the LoRA-affinity score (--weight-lora): a request naming an adapter prefers "
        "replicas where it is resident.",
    )


class RouterSpec(_CamelModel):
    """A `conveyor router` Deployment and Service in front of the server replicas: an OpenAI-compatible
    proxy that picks a Ready replica per request by queue depth, KV-cache use and prefix-cache affinity,
    and holds requests while no replica is Ready (the builtin autoscaler wakes one from zero)."""

    enabled: bool = Field(
        default=False,
        description="Render the router; status.url then points at it. false removes what was rendered.",
    )
    replicas: int = Field(default=1, ge=1, description="Router pods (each routes on its own view).")
    policy: RouterPolicy = Field(
        default="prefix-aware",
        description="prefix-aware: weighted queue, KV-use and prefix-affinity scores; least-load: queue "
        "and KV-use scores only; round-robin: in turn (--policy).",
    )
    weights: RouterWeights = Field(default_factory=RouterWeights, description="Weights of the scores.")
    queue_timeout_seconds: int = Field(
        default=60,
        ge=1,
        le=3600,
        description="Seconds a request waits in the router while no replica is Ready (scale from zero), "
        "then 503 (--queue-timeout).",
    )


_TOLERATION_RULES = [
    (
        "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
        "a toleration with operator Exists takes no value",
        lambda t: t.operator != "Exists" or not t.value,
    ),
    (
        "(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
        "a toleration without a key needs operator Exists",
        lambda t: bool(t.key) or t.operator == "Exists",
    ),
    (
        "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        "tolerationSeconds needs effect NoExecute",
        lambda t: t.toleration_seconds is None or t.effect == "NoExecute",
    ),
]


class Toleration(_CamelModel):
    """A core/v1 Toleration, with the API server's rules for it."""

    model_config = _validations(*(_cel(rule, msg) for rule, msg, _ in _TOLERATION_RULES))

    key: str | None = Field(default=None, pattern=LABEL_KEY, max_length=317)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(default=None, pattern=LABEL_VALUE, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    @model_validator(mode="after")
    def _api_rules(self) -> Toleration:
        for _, message, holds in _TOLERATION_RULES:
            if not holds(self):
                raise ValueError(message)
        return self


class InferenceServiceSpec(_CamelModel):
    """Desired state of an InferenceService."""

    model_config = _validations(
        _cel(
            "!(has(self.replicas) && has(self.autoscaling))",
            "set either replicas or autoscaling, not both (an autoscaled InferenceService is "
            "not scaled by hand: change autoscaling.minReplicas and maxReplicas instead)",
        )
    )

    model: ModelSpec
    resources: ResourcesSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    autoscaling: AutoscalingSpec | None = Field(
        default=None, description="Autoscale on TTFT and queue depth; excludes replicas."
    )
    replicas: int | None = Field(
        default=None, ge=0, description="Fixed number of replicas (default 1) when autoscaling is unset."
    )
    # No default in the CRD: the operator fills in its configured server image (parse_spec), so a new
    # operator version or chart value moves every resource that did not choose an image.
    image: str = Field(
        default_factory=lambda: DEFAULT_IMAGE,
        min_length=1,
        description="Server container image; default: the operator's server image (the chart's serverImage).",
    )
    node_selector: dict[str, Annotated[str, StringConstraints(max_length=63)]] = Field(
        default_factory=dict,
        max_length=64,
        description="Extra node labels; merged over the GPU product label.",
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    f"self.all(k, size(k) <= 317 && k.matches('{LABEL_KEY}'))",
                    "nodeSelector keys must be label keys ([prefix/]name: letters, digits, '-', '_', '.')",
                ),
                _cel(
                    f"self.all(k, self[k].matches('{LABEL_VALUE}'))",
                    "nodeSelector values must be label values (at most 63 letters, digits, '-', '_', '.')",
                ),
            ]
        },
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=64, description="Extra pod tolerations."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        description="Environment variables of the server container (e.g. HF_TOKEN from a Secret).",
        # A list map keyed by name: the API server refuses two entries with one name, as a pod would.
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    env_from: list[EnvFromSource] = Field(
        default_factory=list, max_length=16, description="Secrets or ConfigMaps whose keys become variables."
    )
    service_account_name: str | None = Field(
        default=None,
        pattern=DNS1123_SUBDOMAIN,
        max_length=253,
        description="Service account of the server pods (a DNS-1123 subdomain).",
    )
    router: RouterSpec | None = Field(
        default=None,
        description="A load- and prefix-aware router in front of the replicas (<name>-router); absent "
        "or enabled: false means clients use the server Service <name> directly.",
    )

    @field_validator("env")
    @classmethod
    def _unique_env(cls, value: list[EnvVar]) -> list[EnvVar]:
        _check_unique([e.name for e in value], "env names")
        return value

    @field_validator("node_selector")
    @classmethod
    def _label_selector(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            if len(key) > 317 or not re.match(LABEL_KEY, key):
                raise ValueError(f"nodeSelector key {key!r} is not a label key")
            if not re.match(LABEL_VALUE, label):
                raise ValueError(f"nodeSelector value {label!r} of {key!r} is not a label value")
        return value

    @property
    def tensor_parallel_size(self) -> int:
        """The tensor-parallel degree, defaulting to all GPUs of a replica."""
        return self.resources.tensor_parallel_size or self.resources.gpus_per_replica

    @property
    def router_enabled(self) -> bool:
        """Whether a router is rendered in front of the replicas."""
        return self.router is not None and self.router.enabled

    @property
    def desired_replicas(self) -> int:
        """Replicas when no autoscaler decides: `replicas`, else the autoscaling minimum, else 1."""
        if self.replicas is not None:
            return self.replicas
        if self.autoscaling is not None:
            return max(self.autoscaling.min_replicas, 1)
        return 1


class Condition(_CamelModel):
    """A metav1.Condition."""

    type: str = Field(description="CapacityPlanned, Ready, Scaling, MetricsAvailable or AdaptersReady.")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(description="CamelCase cause, e.g. ReplicasReady, ApplyFailed, PodsUnschedulable.")
    message: str = Field(default="", description="What happened, with the numbers.")
    last_transition_time: str | None = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(default=None, description="The spec generation it describes.")


class CapacityStatus(_CamelModel):
    """The KV-capacity plan of one replica (bytes and sequences)."""

    tensor_parallel_size: int | None = Field(
        default=None, description="Ranks (GPUs) one replica's model is split over (--tensor-parallel-size)."
    )
    kv_bytes_per_token: int = Field(description="KV bytes one GPU stores per token.")
    kv_pool_bytes: int = Field(description="KV-cache pool of one replica, all its GPUs.")
    num_kv_blocks: int = Field(description="KV blocks of blockSize tokens in the pool.")
    max_num_seqs: int = Field(description="Sequences per step the server is started with.")
    max_concurrency_at_max_model_len: float = Field(
        description="Sequences of maxModelLen tokens whose KV fits at once, unrounded."
    )


class ObservedMetrics(_CamelModel):
    """What the autoscaler read from Prometheus at `time`; a signal it could not read then is absent (no
    value outlives the reading it came from)."""

    time: str
    ready_pods: int = Field(description="Pods Ready when the metrics were read (the query's scope).")
    ttft_p90_seconds: float | None = Field(default=None, alias="ttftP90Seconds")
    request_rate: float | None = Field(default=None, description="Requests started per second.")
    queue_depth: float | None = Field(default=None, description="Waiting requests over the Ready pods.")
    running_requests: float | None = None
    kv_cache_usage: float | None = Field(default=None, description="Mean KV-cache usage (0-1).")
    router_requests_waiting: float | None = Field(
        default=None, description="Requests the router holds because no replica is Ready."
    )
    errors: dict[str, str] = Field(
        default_factory=dict, description="Queries without a usable value at `time` (absent: none)."
    )
    last_successful_read_time: str | None = Field(
        default=None,
        description="When a reading was last usable (MetricsAvailable=True), RFC 3339: how old the last "
        "good numbers are during an outage (the signals themselves are absent then, never stale).",
    )


class DecisionRecord(_CamelModel):
    """One autoscaling decision."""

    time: str = Field(description="When it was decided (RFC 3339).")
    from_replicas: int = Field(alias="from", description="Replicas before.")
    to: int = Field(description="Replicas decided.")
    reason: str = Field(
        description="CamelCase reason, e.g. ScaleUp, ScaleDownStabilizing, MetricsUnavailable."
    )
    message: str = Field(description="The inputs and the arithmetic.")


class RecommendationRecord(_CamelModel):
    """A replica recommendation kept for the stabilization windows (Unix seconds)."""

    at: float
    replicas: int


class ScaleEventRecord(_CamelModel):
    """A change of replicas kept for the rate limits (Unix seconds, signed change)."""

    at: float
    change: int


class AutoscalerStatus(_CamelModel):
    """The builtin autoscaler's state: its last reading, its last decisions, and the history its
    stabilization windows and rate limits need (so an operator restart loses nothing)."""

    metrics: ObservedMetrics | None = Field(default=None, description="The last reading from Prometheus.")
    decisions: list[DecisionRecord] = Field(default_factory=list, description="Newest last, at most 5.")
    recommendations: list[RecommendationRecord] = Field(
        default_factory=list, description="Recent recommendations, for the stabilization windows."
    )
    scale_events: list[ScaleEventRecord] = Field(
        default_factory=list, description="Recent changes of replicas, for the rate limits."
    )


class LoRAAdapterStatus(_CamelModel):
    """One declared adapter on the Ready replicas (read from their metrics)."""

    name: str = Field(description="The adapter.")
    loaded_replicas: int | None = Field(default=None, description="Ready replicas serving it.")
    ready_replicas: int | None = Field(default=None, description="Ready replicas when it was read.")
    last_error: str | None = Field(default=None, description="Why it failed to load where it did.")


class InferenceServiceStatus(_CamelModel):
    """Observed state of an InferenceService, written by the operator."""

    observed_generation: int | None = Field(default=None, description="The spec generation last reconciled.")
    conditions: list[Condition] = Field(
        default_factory=list, description="CapacityPlanned, Ready, Scaling and (autoscaled) MetricsAvailable."
    )
    capacity: CapacityStatus | None = Field(
        default=None, description="The KV-capacity plan behind max_num_seqs."
    )
    replicas: int | None = Field(default=None, description="Pods of the server Deployment.")
    ready_replicas: int | None = Field(default=None, description="Pods that pass their readiness probe.")
    desired_replicas: int | None = Field(
        default=None, description="Replicas wanted now: the spec's, or the autoscaler's last decision."
    )
    last_scale_time: str | None = Field(
        default=None, description="When the autoscaler last changed replicas."
    )
    autoscaler: AutoscalerStatus | None = Field(default=None, description="The builtin autoscaler's state.")
    url: str | None = Field(
        default=None,
        description="In-cluster base URL of the OpenAI API (the router's Service <name>-router with "
        "spec.router enabled), once a request can be answered.",
    )
    selector: str | None = Field(default=None, description="Label selector of the pods (scale subresource).")
    lora_adapters: list[LoRAAdapterStatus] | None = Field(
        default=None, description="model.lora: each adapter's replicas (AdaptersReady sums them up)."
    )


def validation_message(exc: ValidationError) -> str:
    """pydantic's errors as one line a user reads in a condition: `field: message; ...`."""
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(p) for p in error["loc"]) or "spec"
        parts.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def parse_spec(spec: dict[str, Any], server_image: str = DEFAULT_IMAGE) -> InferenceServiceSpec:
    """Validate a resource's `.spec` (camelCase keys) into the model, with `server_image` where it sets
    no image; raises pydantic.ValidationError."""
    if "image" not in spec:
        spec = {**spec, "image": server_image}
    return InferenceServiceSpec.model_validate(spec)
