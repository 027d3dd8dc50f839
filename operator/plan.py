"""Capacity plans for InferenceService specs, and the `conveyor plan` command that prints one.

`plan_for_spec` resolves the spec's model and GPU through the catalog (spec overrides win) and runs
`conveyor.server.capacity.plan_capacity`; it is pure and raises a named error for every impossible
spec, which the operator turns into a `CapacityPlanned=False` condition.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import ValidationError

from conveyor.operator.catalog import (
    ACTIVATION_RESERVE_BYTES_PER_GPU,
    GiB,
    ModelShape,
    UnknownGPUTypeError,
    UnknownModelError,
    hf_config,
    lookup_gpu,
    lookup_model,
    resolve_model_shape,
)
from conveyor.operator.spec import InferenceServiceSpec, validation_message
from conveyor.server.capacity import (
    CapacityPlan,
    InsufficientGPUMemoryError,
    dtype_bytes,
    kv_bytes_per_token,
    lora_slot_bytes,
    partition,
    plan_capacity,
)
from conveyor.server.cli import add_model_flags
from conveyor.server.config import (
    NATIVE_MODEL_TYPES,
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

# Catalog models are stored in bfloat16, so `auto` plans with 2-byte weights and KV.
AUTO_DTYPE = "bfloat16"

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_QUANTITY_FACTORS = {
    None: 1,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


class MaxModelLenTooLongError(ValueError):
    """`maxModelLen` exceeds the context length the model was trained for (tokens)."""

    def __init__(self, max_model_len: int, max_position_embeddings: int, model: str) -> None:
        self.max_model_len = max_model_len
        self.max_position_embeddings = max_position_embeddings
        super().__init__(
            f"maxModelLen {max_model_len} exceeds the {max_position_embeddings}-token context of {model}"
        )


class KVCacheTooSmallError(InsufficientGPUMemoryError):
    """The weights fit but the KV pool cannot hold a single sequence of `max_model_len` tokens."""

    def __init__(self, required_bytes: int, available_bytes: int, max_model_len: int) -> None:
        super().__init__(required_bytes, available_bytes)
        self.args = (
            f"weights, activation reserve and the KV cache of one {max_model_len}-token sequence need "
            f"{required_bytes / GiB:.2f} GiB but only {available_bytes / GiB:.2f} GiB of GPU memory is "
            f"usable: short by {self.shortfall_bytes / GiB:.2f} GiB",
        )


class TensorParallelSizeError(ValueError):
    """The tensor-parallel size does not split the model's heads, or differs from the replica's GPUs
    (the server would refuse to start, or leave GPUs idle while planned for their memory)."""


class UnsupportedArchitectureError(ValueError):
    """The server would refuse the model's architecture at start: `--model-impl native` for a model
    type only transformers' implementation runs."""


def check_architecture(spec: InferenceServiceSpec, model_impl: str) -> None:
    """Refuse, before any pod starts, what `conveyor serve --model-impl model_impl` would refuse of the
    spec's model where the catalog knows its `model_type` (the server's rule: `--model-impl native` runs
    `NATIVE_MODEL_TYPES` only). A model outside the catalog is checked by the server as it starts.
    Raises UnsupportedArchitectureError naming the model type."""
    known = lookup_model(spec.model.name) or (lookup_model(spec.model.uri) if spec.model.uri else None)
    if known is None or model_impl != "native":
        return
    kind = hf_config(known.name)["model_type"]
    if kind not in NATIVE_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{known.name}: model type {kind!r} is not supported natively (--model-impl native runs "
            f"{', '.join(sorted(NATIVE_MODEL_TYPES))}); --model-impl auto or transformers runs "
            "transformers' implementation of it"
        )


#: Errors that make a spec impossible to plan; the operator reports them as status conditions.
PlanningError = (
    UnknownModelError,
    UnknownGPUTypeError,
    InsufficientGPUMemoryError,
    MaxModelLenTooLongError,
    TensorParallelSizeError,
    UnsupportedArchitectureError,
)


@dataclass(frozen=True)
class SpecPlan:
    """Everything decided for one replica of an InferenceService, in bytes and tokens.

    `max_num_seqs` is what the server is started with: the spec's override if set, else the plan's.
    `gpu_product_label` is None for GPUs given only by `resources.gpuMemory`.
    """

    model: ModelShape
    gpu_type: str
    gpu_memory_bytes: int
    gpu_product_label: str | None
    num_gpus: int
    tensor_parallel_size: int
    dtype: str
    weight_bytes: int
    activation_reserve_bytes: int
    gpu_memory_utilization: float
    capacity: CapacityPlan
    max_num_seqs: int
    draft_model: ModelShape | None = None
    lora_bytes: int = 0  # adapter slots (`model.lora`), counted in weight_bytes


def parse_quantity(quantity: str) -> int:
    """Bytes in a Kubernetes memory quantity (`80Gi`, `24G`, `1024`); raises ValueError."""
    match = _QUANTITY.match(quantity.strip())
    if not match:
        raise ValueError(f"not a memory quantity: {quantity!r}")
    number, suffix = match.groups()
    return int(float(number) * _QUANTITY_FACTORS[suffix])


def plan_for_spec(spec: InferenceServiceSpec) -> SpecPlan:
    """Plan one replica of `spec`.

    Raises UnknownModelError, UnknownGPUTypeError, MaxModelLenTooLongError, TensorParallelSizeError, or
    InsufficientGPUMemoryError (KVCacheTooSmallError when only the KV of one sequence is missing).
    """
    model = spec.model
    shape = resolve_model_shape(
        model.name,
        uri=model.uri,
        num_layers=model.layers,
        num_kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        num_params=model.params,
    )
    if shape.max_position_embeddings is not None and model.max_model_len > shape.max_position_embeddings:
        raise MaxModelLenTooLongError(model.max_model_len, shape.max_position_embeddings, shape.name)
    tp, gpus = spec.tensor_parallel_size, spec.resources.gpus_per_replica
    if tp != gpus:
        raise TensorParallelSizeError(
            f"tensorParallelSize {tp} with gpusPerReplica {gpus}: conveyor serve runs one rank per GPU, "
            "so a replica's GPUs and its tensor-parallel size must be equal (leave tensorParallelSize unset)"
        )
    if shape.num_heads is not None and shape.intermediate_size is not None:
        try:  # the server's own rule (`conveyor serve` refuses these sizes at start)
            partition(
                shape.num_heads,
                shape.num_kv_heads,
                shape.intermediate_size,
                1,
                0,
                spec.tensor_parallel_size,
                setting="tensorParallelSize",
            )
        except ValueError as exc:
            raise TensorParallelSizeError(str(exc).replace("the model's", f"{shape.name}'s")) from None

    resources = spec.resources
    if resources.gpu_memory is not None:
        gpu_memory_bytes = parse_quantity(resources.gpu_memory)
        try:
            product_label: str | None = lookup_gpu(resources.gpu_type).product_label
        except UnknownGPUTypeError:
            product_label = None
    else:
        gpu = lookup_gpu(resources.gpu_type)
        gpu_memory_bytes, product_label = gpu.memory_bytes, gpu.product_label

    dtype = AUTO_DTYPE if model.dtype == "auto" else model.dtype
    num_gpus = resources.gpus_per_replica
    weight_bytes = shape.num_params * dtype_bytes(dtype)
    draft = _draft_shape(spec)
    draft_kv_bytes_per_token = 0
    if draft is not None:  # its weights and its K/V per token (one rank) join the target's
        weight_bytes += draft.num_params * dtype_bytes(dtype)
        draft_kv_bytes_per_token = kv_bytes_per_token(
            draft.num_layers, draft.num_kv_heads, draft.head_dim, dtype
        )
    lora_bytes = _lora_bytes(spec, shape, dtype)
    weight_bytes += lora_bytes
    reserve = ACTIVATION_RESERVE_BYTES_PER_GPU * num_gpus
    utilization = spec.engine.gpu_memory_utilization
    capacity = plan_capacity(
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=dtype,
        gpu_memory_bytes=gpu_memory_bytes,
        weight_bytes=weight_bytes,
        max_model_len=model.max_model_len,
        gpu_memory_utilization=utilization,
        num_gpus=num_gpus,
        tensor_parallel_size=spec.tensor_parallel_size,
        activation_reserve_bytes=reserve,
        block_size=spec.engine.block_size,
        draft_kv_bytes_per_token=draft_kv_bytes_per_token,
        num_sliding_layers=shape.num_sliding_layers,
        sliding_window=shape.sliding_window,
        max_num_batched_tokens=spec.engine.max_num_batched_tokens
        or SchedulerConfig.model_fields["max_num_batched_tokens"].default,
    )
    if capacity.max_num_seqs < 1:
        one_sequence = capacity.kv_bytes_per_token * spec.tensor_parallel_size * model.max_model_len
        usable = capacity.kv_pool_bytes + weight_bytes + reserve
        raise KVCacheTooSmallError(weight_bytes + reserve + one_sequence, usable, model.max_model_len)
    return SpecPlan(
        model=shape,
        gpu_type=resources.gpu_type,
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_product_label=product_label,
        num_gpus=num_gpus,
        tensor_parallel_size=spec.tensor_parallel_size,
        dtype=dtype,
        weight_bytes=weight_bytes,
        activation_reserve_bytes=reserve,
        gpu_memory_utilization=utilization,
        capacity=capacity,
        max_num_seqs=spec.engine.max_num_seqs or capacity.max_num_seqs,
        draft_model=draft,
        lora_bytes=lora_bytes,
    )


def _lora_bytes(spec: InferenceServiceSpec, shape: ModelShape, dtype: str) -> int:
    """Bytes of `model.lora`'s adapter slots (`capacity.lora_slot_bytes`: maxAdapters slots of maxRank
    on every projection), 0 without adapters. A shape given only by overrides has no widths: the
    hidden width is then estimated from the parameters (about 12 h^2 per layer) and the MLP as 4 h."""
    lora = spec.model.lora
    if lora is None:
        return 0
    hidden = shape.hidden_size or math.isqrt(shape.num_params // (12 * shape.num_layers))
    heads = shape.num_heads or max(hidden // shape.head_dim, 1)
    return lora_slot_bytes(
        shape.num_layers,
        hidden,
        heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.intermediate_size or 4 * hidden,
        lora.max_adapters,
        lora.max_rank,
        dtype,
        dense_mlp=not shape.num_experts,
    )


def _draft_shape(spec: InferenceServiceSpec) -> ModelShape | None:
    """The catalog shape of `engine.speculative.model`, the speculative draft model (None without one).
    Raises UnknownModelError naming the field, TensorParallelSizeError above one rank (the server runs
    a draft model on one)."""
    speculative = spec.engine.speculative
    if speculative is None or speculative.model is None:
        return None
    if spec.tensor_parallel_size > 1:
        raise TensorParallelSizeError(
            f"engine.speculative.model runs on one rank; tensor parallel size is {spec.tensor_parallel_size}"
        )
    shape = lookup_model(speculative.model)
    if shape is None:
        raise UnknownModelError(speculative.model, [], what="draft model (engine.speculative.model)")
    return shape


def format_plan(plan: SpecPlan) -> str:
    """The plan as an aligned two-column table showing the arithmetic (binary units)."""
    cap = plan.capacity
    shape = plan.model
    usable = plan.gpu_memory_bytes * plan.gpu_memory_utilization * plan.num_gpus
    rows = [
        (
            "model",
            f"{shape.name} ({shape.num_layers} layers, {shape.num_kv_heads} KV heads, "
            f"head_dim {shape.head_dim}, {shape.num_params / 1e9:.2f}B params)",
        ),
        *(
            [
                (
                    "experts",
                    f"{shape.num_experts} per sparse layer, {shape.num_experts_per_tok} per token; "
                    "the weights count every expert",
                )
            ]
            if shape.num_experts
            else []
        ),
        (
            "gpus",
            f"{plan.num_gpus} x {plan.gpu_type} ({plan.gpu_memory_bytes / GiB:.2f} GiB each), "
            f"tensor parallel {plan.tensor_parallel_size}",
        ),
        ("dtype", f"{plan.dtype} ({dtype_bytes(plan.dtype)} bytes)"),
        ("usable memory", f"{usable / GiB:.2f} GiB (gpu_memory_utilization {plan.gpu_memory_utilization})"),
        *(
            [
                (
                    "draft model",
                    f"{plan.draft_model.name} ({plan.draft_model.num_layers} layers, "
                    f"{plan.draft_model.num_params / 1e9:.2f}B params): its weights and K/V are counted",
                )
            ]
            if plan.draft_model
            else []
        ),
        *(
            [
                (
                    "lora adapters",
                    f"{plan.lora_bytes / GiB:.2f} GiB of adapter slots, counted in the weights",
                )
            ]
            if plan.lora_bytes
            else []
        ),
        ("weights", f"{plan.weight_bytes / GiB:.2f} GiB"),
        ("activation reserve", f"{plan.activation_reserve_bytes / GiB:.2f} GiB"),
        ("kv pool", f"{cap.kv_pool_bytes / GiB:.2f} GiB"),
        (
            "kv bytes per token",
            f"{cap.kv_bytes_per_token:,} per GPU, "
            f"{cap.kv_bytes_per_token * plan.tensor_parallel_size:,} per replica",
        ),
        (
            "kv blocks",
            f"{cap.num_kv_blocks:,} of {cap.block_size} tokens"
            + (" for the global layers" if cap.num_window_blocks else ""),
        ),
        *(
            [
                (
                    "sliding layers",
                    f"{shape.num_sliding_layers} of {shape.num_layers} attend to the last {cap.sliding_window:,} "
                    "tokens: they count their window, not max_model_len"
                    + (
                        f", in {cap.num_window_blocks:,} blocks of their own" if cap.num_window_blocks else ""
                    ),
                )
            ]
            if cap.sliding_window
            else []
        ),
        ("max_model_len", f"{cap.max_model_len:,} tokens"),
        ("max concurrency", f"{cap.max_concurrency:.2f} sequences of max_model_len tokens"),
        ("max_num_seqs", f"{plan.max_num_seqs}"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in rows) + "\n"


def _plan_json(plan: SpecPlan) -> str:
    data = asdict(plan)
    data["capacity"]["max_concurrency"] = plan.capacity.max_concurrency
    return json.dumps(data, indent=2) + "\n"


def _write_config(model: str, directory: Path) -> int:
    try:
        config = hf_config(model)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    except (UnknownModelError, OSError) as exc:
        print(f"conveyor plan: error: {exc}", file=sys.stderr)
        return 1
    print(directory / "config.json")
    return 0


# The spec fields `conveyor plan`'s flags fill, as its errors name them (longest names first).
_FLAGS_OF_FIELDS = {
    "resources.tensorParallelSize": "--tensor-parallel-size",
    "resources.gpusPerReplica": "--gpus",
    "resources.gpuMemory": "--gpu-memory",
    "resources.gpuType": "--gpu",
    "engine.gpuMemoryUtilization": "--gpu-memory-utilization",
    "engine.blockSize": "--block-size",
    "model.maxModelLen": "--max-model-len",
    "model.kvHeads": "--kv-heads",
    "model.headDim": "--head-dim",
    "model.layers": "--layers",
    "model.params": "--params",
    "model.dtype": "--dtype",
    "model.name": "--model",
    "model.lora.maxAdapters": "--max-loras",
    "model.lora.maxRank": "--max-lora-rank",
    "tensorParallelSize": "--tensor-parallel-size",
    "gpusPerReplica": "--gpus",
    "maxModelLen": "--max-model-len",
}
_FIELD_NAMES = re.compile(r"\b(" + "|".join(re.escape(f) for f in _FLAGS_OF_FIELDS) + r")\b")


def _as_flags(message: str) -> str:
    """A planning or validation message with the spec's field names replaced by this command's flags."""
    return _FIELD_NAMES.sub(lambda m: _FLAGS_OF_FIELDS[m.group(1)], message)


def _without_none(groups: dict[str, dict]) -> dict[str, dict]:
    """Spec groups without the flags not given (the spec's defaults apply)."""
    return {group: {k: v for k, v in fields.items() if v is not None} for group, fields in groups.items()}


def _lora_flags(args: argparse.Namespace) -> dict | None:
    """`model.lora` from `--enable-lora --max-loras --max-lora-rank` (the flags not given: the server's
    defaults), None without `--enable-lora`."""
    if not args.enable_lora:
        return None
    defaults = LoRAConfig()
    return {
        "maxAdapters": args.max_loras or defaults.max_loras,
        "maxRank": args.max_lora_rank or defaults.max_lora_rank,
    }


def main(argv: list[str] | None = None) -> int:
    """`conveyor plan`: print the KV-capacity plan of one replica. Exit status 1 when it cannot fit."""
    parser = argparse.ArgumentParser(
        prog="conveyor plan",
        description="Print the KV-capacity plan (max_num_seqs) of one replica of a model on some GPUs.",
    )
    parser.add_argument("--model", required=True, help="catalog model name or hub id (llama-3-8b)")
    parser.add_argument("--gpu", help="catalog GPU type (a100-80gb, h100-80gb, l4, ...)")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per replica")
    parser.add_argument("--gpu-memory", default=None, help="memory of one GPU (80Gi) for other GPUs")
    # The server's own flags, from its config models (`conveyor serve` takes them the same way).
    add_model_flags(
        parser,
        ModelConfig,
        only={"dtype", "max_model_len"},
        help_overrides={
            "dtype": f"weight and KV dtype (default: auto, planned as {AUTO_DTYPE})",
            "max_model_len": "tokens per sequence (prompt + output)",
        },
    )
    add_model_flags(parser, CacheConfig, only={"gpu_memory_utilization", "block_size"})
    add_model_flags(
        parser,
        LoRAConfig,
        only={"enable_lora", "max_loras", "max_lora_rank"},
        help_overrides={
            "enable_lora": "count LoRA adapter slots (--max-loras of --max-lora-rank) in the plan"
        },
    )
    add_model_flags(
        parser,
        ParallelConfig,
        help_overrides={"tensor_parallel_size": "ranks one replica is split over (default: --gpus)"},
    )
    parser.add_argument("--layers", type=int, default=None, help="override: transformer layers")
    parser.add_argument("--kv-heads", type=int, default=None, help="override: KV heads")
    parser.add_argument("--head-dim", type=int, default=None, help="override: head dimension")
    parser.add_argument("--params", type=int, default=None, help="override: parameter count")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--write-config",
        metavar="DIR",
        help="write the catalog model's config.json into DIR (a weights-free model directory for "
        "`conveyor serve DIR --load-format dummy`) instead of planning",
    )
    args = parser.parse_args(argv)
    if args.write_config:
        return _write_config(args.model, Path(args.write_config))
    if args.gpu is None or args.max_model_len is None:
        parser.error("--gpu and --max-model-len are required (unless --write-config)")
    try:
        spec = InferenceServiceSpec.model_validate(
            _without_none(
                {
                    "model": {
                        "name": args.model,
                        "dtype": args.dtype,
                        "maxModelLen": args.max_model_len,
                        "layers": args.layers,
                        "kvHeads": args.kv_heads,
                        "headDim": args.head_dim,
                        "params": args.params,
                        "lora": _lora_flags(args),
                    },
                    "resources": {
                        "gpuType": args.gpu,
                        "gpusPerReplica": args.gpus,
                        "tensorParallelSize": args.tensor_parallel_size,
                        "gpuMemory": args.gpu_memory,
                    },
                    "engine": {
                        "gpuMemoryUtilization": args.gpu_memory_utilization,
                        "blockSize": args.block_size,
                    },
                }
            )
        )
        plan = plan_for_spec(spec)
    except ValidationError as exc:
        print(f"conveyor plan: error: {_as_flags(validation_message(exc))}", file=sys.stderr)
        return 1
    except (*PlanningError, ValueError) as exc:
        print(f"conveyor plan: error: {_as_flags(str(exc))}", file=sys.stderr)
        return 1
    sys.stdout.write(_plan_json(plan) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
