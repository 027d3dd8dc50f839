"""Known GPU types (memory, node label) and model shapes, the inputs of the KV-capacity plan.

Pure data and lookups, no I/O. An InferenceService names a GPU type and a model; anything the catalog
does not know must come from the spec's overrides (`resources.gpuMemory`, `model.layers` ...), and an
unknown name without overrides is an error (`UnknownGPUTypeError`, `UnknownModelError`), never a guess.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from conveyor.server.capacity import sliding_layers

MiB = 2**20
GiB = 2**30

# Memory the GPU itself needs for activations, CUDA graphs and the NCCL/cuBLAS workspaces, kept out of
# the KV pool. vLLM measures this with a profiling forward pass at start-up; the operator has no GPU,
# so it reserves a fixed amount per GPU that covers 7-8B models at the default batch token budget.
# The server measures real free memory at start and never schedules past it, so this only has to be
# conservative enough that the planned `--max-num-seqs` is reachable.
ACTIVATION_RESERVE_BYTES_PER_GPU = 1 * GiB


class UnknownGPUTypeError(LookupError):
    """A GPU type the catalog does not know, with no `resources.gpuMemory` override."""

    def __init__(self, gpu_type: str) -> None:
        self.gpu_type = gpu_type
        super().__init__(
            f"unknown GPU type {gpu_type!r}; known types: {', '.join(sorted(GPUS))}; "
            "set resources.gpuMemory (and a nodeSelector) for other GPUs"
        )


class UnknownModelError(LookupError):
    """A model the catalog does not know, with its shape not (fully) given in the spec."""

    def __init__(self, model_name: str, missing: list[str], what: str = "model") -> None:
        self.model_name = model_name
        self.missing = missing
        known = ", ".join(sorted(MODELS))
        if missing:
            message = f"unknown {what} {model_name!r}: set model.{', model.'.join(missing)} in the spec or use a known model ({known})"
        else:
            message = f"unknown {what} {model_name!r}; known models: {known}"
        super().__init__(message)


@dataclass(frozen=True)
class GPUType:
    """One GPU model: total memory in bytes as `nvidia-smi` reports it, and the value of the
    `nvidia.com/gpu.product` node label that NVIDIA's GPU feature discovery sets for it."""

    name: str
    memory_bytes: int
    product_label: str


@dataclass(frozen=True)
class ModelShape:
    """What the KV-capacity math needs from a model's config.json, plus its parameter count.

    `max_position_embeddings` is the longest context the model was trained for (tokens), None when the
    shape comes only from spec overrides.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    max_position_embeddings: int | None
    num_heads: int | None = None  # attention heads, MLP and model width: None for override-only shapes
    intermediate_size: int | None = None
    hidden_size: int | None = None
    # Mixture of experts: experts per sparse layer and chosen per token (0 for a dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    # Layers that attend to the last `sliding_window` tokens only (0 and None: none).
    num_sliding_layers: int = 0
    sliding_window: int | None = None


# Total memory from `nvidia-smi --query-gpu=memory.total` (MiB); product labels from GPU feature
# discovery on the common SKU (SXM for A100/H100/H200).
GPUS: dict[str, GPUType] = {
    g.name: g
    for g in (
        GPUType("a100-40gb", 40960 * MiB, "NVIDIA-A100-SXM4-40GB"),
        GPUType("a100-80gb", 81920 * MiB, "NVIDIA-A100-SXM4-80GB"),
        GPUType("h100-80gb", 81559 * MiB, "NVIDIA-H100-80GB-HBM3"),
        GPUType("h200-141gb", 143771 * MiB, "NVIDIA-H200"),
        GPUType("l40s", 46068 * MiB, "NVIDIA-L40S"),
        GPUType("a10g", 23028 * MiB, "NVIDIA-A10G"),
        GPUType("l4", 23034 * MiB, "NVIDIA-L4"),
        GPUType("t4", 15360 * MiB, "Tesla-T4"),
    )
}

GPU_ALIASES: dict[str, str] = {
    "a100": "a100-80gb",
    "a100-80g": "a100-80gb",
    "a100-40g": "a100-40gb",
    "h100": "h100-80gb",
    "h200": "h200-141gb",
    "l40s-48gb": "l40s",
    "a10g-24gb": "a10g",
    "l4-24gb": "l4",
    "t4-16gb": "t4",
}

# The architecture fields of each model's config.json on the Hugging Face hub (the base model's
# release; the -Instruct variants share them). `hf_config` writes them out so the server can run the
# shape with random weights (`--load-format dummy`); the KV shape below is derived from them.
_LLAMA_3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "vocab_size": 128256,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
_LLAMA_3_1_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
_LLAMA_3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32}
_LLAMA_3_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80}
HF_CONFIGS: dict[str, dict] = {
    "llama-3-8b": {
        **_LLAMA_3,
        **_LLAMA_3_8B,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
    },
    "llama-3.1-8b": {
        **_LLAMA_3,
        **_LLAMA_3_8B,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_scaling": _LLAMA_3_1_ROPE,
    },
    "llama-3.2-1b": {
        **_LLAMA_3,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rope_scaling": {**_LLAMA_3_1_ROPE, "factor": 32.0},
    },
    "llama-3-70b": {
        **_LLAMA_3,
        **_LLAMA_3_70B,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
    },
    "llama-3.1-70b": {
        **_LLAMA_3,
        **_LLAMA_3_70B,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_scaling": _LLAMA_3_1_ROPE,
    },
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "torch_dtype": "bfloat16",
    },
    "qwen3-8b": {
        **_QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "max_window_layers": 36,
    },
    "qwen3-32b": {
        **_QWEN3,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "max_window_layers": 64,
    },
    "mistral-small-24b": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 131072,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(42)],
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    },
    "phi-4": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 17920,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 10,
        "vocab_size": 100352,
        "max_position_embeddings": 16384,
        "original_max_position_embeddings": 16384,
        "rms_norm_eps": 1e-05,
        "rope_theta": 250000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 100257,
        "eos_token_id": 100265,
        "pad_token_id": 100349,
        "torch_dtype": "bfloat16",
    },
    "gemma-3-270m": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    },
    "gemma-3-27b": {  # the language model of google/gemma-3-27b-it (its vision tower is not served)
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 168,
        "sliding_window": 1024,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)],
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {
        **_QWEN3,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_window_layers": 48,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    # A shape for the plan only: conveyor does not run gpt-oss (attention sinks, biased and clamped
    # SwiGLU experts); its hub checkpoint stores the experts in MXFP4, the plan counts them in `dtype`.
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_act": "silu",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "eos_token_id": 200002,
        "pad_token_id": 199999,
        "torch_dtype": "bfloat16",
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
}

# Where each catalog model's weights live on the Hugging Face hub (the -Instruct release whose
# config.json is above): what a spec without `model.uri` serves.
HUB_IDS: dict[str, str] = {
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B-Instruct",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "llama-3-70b": "meta-llama/Meta-Llama-3-70B-Instruct",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.1",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "mistral-small-24b": "mistralai/Mistral-Small-24B-Instruct-2501",
    "gemma-2-9b": "google/gemma-2-9b-it",
    "phi-4": "microsoft/phi-4",
    "gemma-3-270m": "google/gemma-3-270m-it",
    "gemma-3-27b": "google/gemma-3-27b-it",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "gpt-oss-20b": "openai/gpt-oss-20b",
}

# Catalog shapes conveyor plans for but does not serve (`conveyor plan` sizes them; a server refuses
# their model type natively).
PLAN_ONLY = frozenset({"gpt-oss-20b"})

# Parameter counts from each model's safetensors index (embeddings included, since they occupy GPU
# memory too); a test checks that the configs above give exactly these counts.
NUM_PARAMS: dict[str, int] = {
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "qwen3-32b": 32_762_123_264,
    "mistral-small-24b": 23_572_403_200,
    "gemma-2-9b": 9_241_705_984,
    "phi-4": 14_659_507_200,
    "gemma-3-270m": 268_098_176,
    "gemma-3-27b": 27_009_346_304,  # the language model: the checkpoint's 27.4 B include its vision tower
    "smollm2-135m": 134_515_008,
    "qwen3-30b-a3b": 30_532_122_624,  # every expert counts: 3.3 B are active per token
    "mixtral-8x7b": 46_702_792_704,
    "gpt-oss-20b": 20_914_757_184,
}


def _shape_from_hf_config(name: str, config: dict) -> ModelShape:
    heads = config["num_attention_heads"]
    window, sliding = sliding_layers(config)
    return ModelShape(
        name=name,
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim", config["hidden_size"] // heads),
        num_params=NUM_PARAMS[name],
        max_position_embeddings=config["max_position_embeddings"],
        num_heads=heads,
        intermediate_size=config["intermediate_size"],
        hidden_size=config["hidden_size"],
        num_experts=config.get("num_experts") or config.get("num_local_experts") or 0,
        num_experts_per_tok=config.get("num_experts_per_tok", 0),
        num_sliding_layers=sum(sliding),
        sliding_window=window,
    )


MODELS: dict[str, ModelShape] = {name: _shape_from_hf_config(name, cfg) for name, cfg in HF_CONFIGS.items()}

MODEL_ALIASES: dict[str, str] = {
    "llama3-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b",
    "mistral-7b-v0.1": "mistral-7b",
    "mistral-7b-v0.3": "mistral-7b",
    "qwen2.5-7b": "qwen2.5-7b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
}

_MODEL_SUFFIXES = ("-instruct", "-chat", "-hf", "-it")


def normalize_model_name(name: str) -> str:
    """Catalog key for a model name or hub id: `meta-llama/Meta-Llama-3-8B-Instruct` -> `llama-3-8b`.

    Drops the organisation, lower-cases, strips a `meta-` prefix and the usual fine-tune suffixes.
    """
    key = name.rsplit("/", 1)[-1].strip().lower()
    key = key.removeprefix("meta-")
    for suffix in _MODEL_SUFFIXES:
        key = key.removesuffix(suffix)
    return MODEL_ALIASES.get(key, key)


def lookup_gpu(gpu_type: str) -> GPUType:
    """The catalog entry for `gpu_type` (case-insensitive, aliases such as `h100`); raises
    UnknownGPUTypeError."""
    key = gpu_type.strip().lower()
    key = GPU_ALIASES.get(key, key)
    try:
        return GPUS[key]
    except KeyError:
        raise UnknownGPUTypeError(gpu_type) from None


def hf_config(name: str) -> dict:
    """The config.json fields of a catalog model (a copy), for a weights-free model directory that
    `conveyor serve --load-format dummy` runs. Raises UnknownModelError for a model not in the catalog."""
    key = normalize_model_name(name)
    if key not in HF_CONFIGS:
        raise UnknownModelError(name, [])
    return json.loads(json.dumps(HF_CONFIGS[key]))


def hub_id(name: str) -> str | None:
    """The hub id of a catalog model (`llama-3-8b` -> `meta-llama/Meta-Llama-3-8B-Instruct`), None for
    a name the catalog does not know."""
    return HUB_IDS.get(normalize_model_name(name))


def lookup_model(name: str) -> ModelShape | None:
    """The catalog shape for a model name or hub id, or None when the catalog does not know it."""
    return MODELS.get(normalize_model_name(name))


def resolve_model_shape(
    name: str,
    *,
    uri: str | None = None,
    num_layers: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    num_params: int | None = None,
) -> ModelShape:
    """The model's shape with the spec's overrides applied over the catalog entry.

    The catalog is searched by `name`, then by the last path element of `uri`
    (`hf://meta-llama/Meta-Llama-3-8B-Instruct`). Raises UnknownModelError naming the missing fields
    when neither the catalog nor the overrides give a complete shape.
    """
    known = lookup_model(name)
    if known is None and uri:
        known = lookup_model(uri.rstrip("/"))
    overrides = {
        "layers": num_layers,
        "kvHeads": num_kv_heads,
        "headDim": head_dim,
        "params": num_params,
    }
    if known is None:
        missing = [field for field, value in overrides.items() if value is None]
        if missing:
            raise UnknownModelError(name, missing)
        return ModelShape(
            name=name,
            num_layers=num_layers,  # type: ignore[arg-type]  # checked by `missing` above
            num_kv_heads=num_kv_heads,  # type: ignore[arg-type]
            head_dim=head_dim,  # type: ignore[arg-type]
            num_params=num_params,  # type: ignore[arg-type]
            max_position_embeddings=None,
        )
    if num_layers not in (None, known.num_layers):  # which layers slide is unknown then: none counted
        known = replace(known, num_sliding_layers=0, sliding_window=None)
    return replace(
        known,
        num_layers=num_layers or known.num_layers,
        num_kv_heads=num_kv_heads or known.num_kv_heads,
        head_dim=head_dim or known.head_dim,
        num_params=num_params or known.num_params,
    )
