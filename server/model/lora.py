"""LoRA adapters on the model (Hu et al., 2021): reading a PEFT adapter, and the resident slots a step's
adapters run from.

An adapter adds `scaling * B (A x)` to a projection's output (`A: [r, in]`, `B: [out, r]`, `scaling =
lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA). PEFT names the projections as transformers
does (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`); the decoder fuses
q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so an adapter of a fused projection keeps one A and
one B per slice: its A matrices one under another (`[slices * R, in]`, one shrink for all), its B
matrices transposed side by side (`[R, out]`), each slice's columns expanded from its own part of the
shrink (vLLM's packed LoRA layers keep them per slice too).

`LoRASlots` holds `max_loras` slots per projection, `[max_loras, slices * max_lora_rank, in]` and
`[max_loras, max_lora_rank, out]` in the model's dtype (an adapter of lower rank is zero-padded),
and wraps each projection in a `LoRALinear`, which runs the base projection and then the kernel
backend's `add_lora` over the step's per-token slot indices (`LoRAContext`). Slots are reused least
recently used first, never for an adapter the step runs (the scheduler keeps a step's adapters within
`max_loras`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from conveyor.kernels import KernelBackend
from conveyor.server.block_hash import lora_hash_root
from conveyor.server.model.models.llama import LlamaForCausalLM, LlamaMLP, ModelShape

logger = logging.getLogger(__name__)

# The decoder's projections and the transformers names of their output slices, in output order.
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])\.weight$")
_uids = itertools.count(1)


class LoRAError(ValueError):
    """An adapter that cannot be served here; the message names the adapter and the problem."""


@dataclass(eq=False)
class LoRAAdapter:
    """One adapter read from its PEFT directory, in float32 on the CPU.

    weights: (layer index, transformers projection name) -> (A `[r, in]`, B `[out, r]` times the
    scaling); rank: r; digest: of its files (`adapter_digest`); uid: unique per load (a slot holding
    an older load of the same name is not reused); hash_root: the parent hash of a request's first KV
    block under this adapter (`block_hash.lora_hash_root` of the digest).
    """

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str = ""
    uid: int = field(default_factory=lambda: next(_uids))

    @property
    def hash_root(self) -> bytes:
        return lora_hash_root(self.digest)

    @property
    def num_bytes(self) -> int:
        """Bytes its float32 matrices take in CPU memory."""
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())


def projection_dims(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each transformers projection name of a (one-rank) model."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    hidden, width = shape.hidden_size, shape.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, width),
        "up_proj": (hidden, width),
        "down_proj": (width, hidden),
    }


def _read_config(name: str, path: Path) -> dict:
    """adapter_config.json through PEFT's own `LoraConfig` (its defaults and checks), as a dict."""
    from peft import LoraConfig

    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_config.json in {str(path)!r}")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {str(config_file)!r}: {exc}") from None
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        kind = raw.get("peft_type") if isinstance(raw, dict) else None
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {kind!r} is not LORA")
    try:
        config = LoraConfig.from_pretrained(str(path))
    except (TypeError, ValueError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not a LoRA config: {exc}") from None
    if getattr(config, "target_parameters", None):
        raise LoRAError(
            f"LoRA adapter {name!r}: target_parameters {list(config.target_parameters)} in "
            "adapter_config.json adapts parameters (a mixture-of-experts model's fused experts), not the "
            "attention or dense MLP projections this engine adapts"
        )
    unsupported = {
        "use_dora": bool(config.use_dora),
        "modules_to_save": bool(config.modules_to_save),
        "bias": config.bias != "none",
        "lora_bias": bool(getattr(config, "lora_bias", False)),
        "rank_pattern": bool(config.rank_pattern),
        "alpha_pattern": bool(config.alpha_pattern),
        "fan_in_fan_out": bool(config.fan_in_fan_out),
    }
    refused = [key for key, used in unsupported.items() if used]
    if refused:
        raise LoRAError(
            f"LoRA adapter {name!r}: {', '.join(refused)} in adapter_config.json is not supported"
        )
    return {"r": int(config.r), "lora_alpha": float(config.lora_alpha), "use_rslora": bool(config.use_rslora)}


def _read_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    safetensors_file, bin_file = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if safetensors_file.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors_file))
        if bin_file.is_file():
            return torch.load(str(bin_file), map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: the adapter's fault, not the server's
        raise LoRAError(f"LoRA adapter {name!r}: cannot read its weights: {exc}") from None
    raise LoRAError(
        f"LoRA adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {str(path)!r}"
    )


def adapter_digest(directory: Path) -> str:
    """A 128-bit BLAKE2b digest (hex) of an adapter's `adapter_config.json` and weights file, the
    identity of what its deltas compute: equal files give equal digests on every replica, and files
    replaced in place give another."""
    h = hashlib.blake2b(digest_size=16)
    for file in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        if (directory / file).is_file():
            h.update(file.encode() + b"\0")
            with open(directory / file, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def adapter_directory(name: str, path: str) -> Path:
    """The local directory of the adapter at `path`: a directory, or a Hugging Face Hub id (`org/name`,
    as vLLM's `--lora-modules` takes) downloaded with `huggingface_hub.snapshot_download` into its cache
    (`HF_HOME`; `HF_HUB_OFFLINE=1` reads only what is cached). Raises LoRAError naming the path."""
    directory = Path(path)
    if directory.is_dir():
        return directory
    if path.startswith((".", "/")) or path.count("/") != 1 or directory.exists():
        raise LoRAError(f"LoRA adapter {name!r}: {path!r} is not a directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, allow_patterns=["adapter_config.json", "adapter_model.*"]))
    except Exception as exc:  # huggingface_hub's errors: not found, gated, offline, no network
        raise LoRAError(
            f"LoRA adapter {name!r}: {path!r} is not a directory, and as a Hugging Face Hub id it cannot "
            f"be downloaded ({type(exc).__name__}: {exc})"
        ) from None


def load_adapter(name: str, path: str, shape: ModelShape, max_lora_rank: int) -> LoRAAdapter:
    """Read the PEFT adapter in directory `path` (or Hub id: `adapter_directory`) for a model of `shape`.

    Raises LoRAError naming the adapter and the problem: a missing directory or file, a config that is
    not LoRA or uses a feature this engine does not run (DoRA, biases, modules_to_save, per-module
    rank or alpha patterns, `target_parameters`: experts), a rank above `max_lora_rank` (`--max-lora-rank`), a tensor of a projection
    the decoder does not adapt (embeddings, the LM head, experts) or of another base model (a layer
    past the model's, or a shape that does not match its projection)."""
    directory = adapter_directory(name, path)
    config = _read_config(name, directory)
    rank = config["r"]
    if rank > max_lora_rank:
        raise LoRAError(f"LoRA adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_lora_rank}")
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config["use_rslora"] else rank)
    dims = projection_dims(shape)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(name, directory).items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in dims:
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {key!r} adapts a module this model does not adapt"
            )
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if layer >= shape.num_layers:
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}, but the base model has "
                f"{shape.num_layers} layers (an adapter of another base model?)"
            )
        if shape.moe_layers and shape.moe_layers[layer] and module in ("gate_proj", "up_proj", "down_proj"):
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} adapts a mixture-of-experts layer's MLP")
        in_features, out_features = dims[module]
        want = (rank, in_features) if half == "A" else (out_features, rank)
        if tuple(tensor.shape) != want:
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {key!r} is {list(tensor.shape)}, expected {list(want)} for "
                "this base model (an adapter of another base model?)"
            )
        halves.setdefault((layer, module), {})[half] = tensor.to(torch.float32)
    weights = {}
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_A or lora_B missing")
        weights[(layer, module)] = (pair["A"].contiguous(), (pair["B"] * scaling).contiguous())
    if not weights:
        raise LoRAError(f"LoRA adapter {name!r}: no LoRA tensors in {path!r}")
    return LoRAAdapter(name, path, rank, weights, adapter_digest(directory))


class LoRAContext:
    """The step's per-token adapter slots, shared by every `LoRALinear` of a model: `[num_tokens]`
    int64 (-1: the base model), or None when no token of the step has an adapter."""

    indices: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """A projection plus the LoRA deltas of the step's adapters: `base(x)`, then the kernel backend's
    `add_lora` with this projection's slots (`lora_a [max_loras, slices * R, in]`, `lora_b
    [max_loras, R, out]`)."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        slice_widths: tuple[int, ...],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        ops: KernelBackend,
        context: LoRAContext,
    ) -> None:
        super().__init__()
        self.base = base
        self.slice_widths = slice_widths
        self.max_rank = max_rank
        stacked = len(slice_widths) * max_rank
        self.register_buffer(
            "lora_a",
            torch.zeros(max_loras, stacked, in_features, dtype=dtype, device=device),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(max_loras, max_rank, sum(slice_widths), dtype=dtype, device=device),
            persistent=False,
        )
        self.ops = ops
        self.context = context
        # Each slot's adapter rank on this projection (0: free, or its adapter does not adapt it).
        self.slot_ranks = [0] * max_loras

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        indices = self.context.indices
        if indices is None:
            return y
        return self.ops.add_lora(
            y.contiguous(), x, self.lora_a, self.lora_b, indices, self.slice_widths, self.slot_ranks
        )

    def write(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put one adapter's (A, B) per slice (None: the slice is not adapted) into `slot`."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.slot_ranks[slot] = max((pair[0].shape[0] for pair in pairs if pair is not None), default=0)
        offset = 0
        for i, (width, pair) in enumerate(zip(self.slice_widths, pairs, strict=True)):
            if pair is not None:
                a, b = pair
                rows = slice(i * self.max_rank, i * self.max_rank + a.shape[0])
                self.lora_a[slot, rows] = a.to(self.lora_a.dtype)
                self.lora_b[slot, : a.shape[0], offset : offset + width] = b.T.to(self.lora_b.dtype)
            offset += width


class LoRASlots:
    """`max_loras` resident adapter slots over `model`'s projections (`LoRALinear` wrappers put in
    place of its attention and dense MLP projections at construction; sparse MLPs stay as they are).

    Raises ValueError for a model LoRA does not run on: transformers' implementation, or one rank of
    a tensor-parallel model."""

    def __init__(
        self,
        model: nn.Module,
        ops: KernelBackend,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if not isinstance(model, LlamaForCausalLM):
            raise ValueError("--enable-lora runs on conveyor's own decoder: use --model-impl native or auto")
        if model.tp.size > 1:
            raise ValueError("--enable-lora runs on one rank: use --tensor-parallel-size 1")
        self.max_loras = max_loras
        self.context = LoRAContext()
        dims = projection_dims(model.shape)
        self.layers: list[dict[str, LoRALinear]] = []
        for layer in model.layers:
            owners = {"qkv_proj": layer.self_attn, "o_proj": layer.self_attn}
            if isinstance(layer.mlp, LlamaMLP):
                owners |= {"gate_up_proj": layer.mlp, "down_proj": layer.mlp}
            wrapped = {}
            for fused, owner in owners.items():
                names = FUSED_PROJECTIONS[fused]
                wrapped[fused] = LoRALinear(
                    getattr(owner, fused),
                    dims[names[0]][0],
                    tuple(dims[n][1] for n in names),
                    max_loras,
                    max_rank,
                    dtype,
                    device,
                    ops,
                    self.context,
                )
                setattr(owner, fused, wrapped[fused])
            self.layers.append(wrapped)
        # Resident adapters by uid, least recently used first, and the slot each holds.
        self._slots: OrderedDict[int, int] = OrderedDict()
        self._slot_tensors: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def loop_arguments(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """(lora_a, lora_b, slot ranks) of every projection, per layer q/k/v, o, gate/up and down, as the
        C++ layer loop takes them (a dense model's: every layer has all four)."""
        modules = [layer[name] for layer in self.layers for name in FUSED_PROJECTIONS]
        if self._slot_tensors is None:  # the buffers are written in place: the lists never change
            self._slot_tensors = [m.lora_a for m in modules], [m.lora_b for m in modules]
        return *self._slot_tensors, [r for m in modules for r in m.slot_ranks]

    @property
    def num_bytes(self) -> int:
        """Bytes every slot of every projection takes."""
        return sum(
            m.lora_a.numel() * m.lora_a.element_size() + m.lora_b.numel() * m.lora_b.element_size()
            for layer in self.layers
            for m in layer.values()
        )

    def activate(self, adapters: list[LoRAAdapter]) -> dict[int, int]:
        """Make `adapters` (at most `max_loras` distinct ones) resident, copying in those that are not,
        into free slots or those of the least recently used adapters the step does not run. Returns
        each adapter's slot, by uid."""
        needed = {a.uid: a for a in adapters}
        if len(needed) > self.max_loras:
            raise ValueError(f"a step runs {len(needed)} adapters, more than --max-loras {self.max_loras}")
        for uid in needed:
            if uid in self._slots:
                self._slots.move_to_end(uid)
        for uid, adapter in needed.items():
            if uid in self._slots:
                continue
            if len(self._slots) < self.max_loras:
                slot = len(self._slots)
            else:
                victim = next(u for u in self._slots if u not in needed)
                slot = self._slots.pop(victim)
            self._write(adapter, slot)
            self._slots[uid] = slot
        return {uid: self._slots[uid] for uid in needed}

    def _write(self, adapter: LoRAAdapter, slot: int) -> None:
        logger.info("LoRA adapter %r (rank %d) loaded into slot %d", adapter.name, adapter.rank, slot)
        for index, layer in enumerate(self.layers):
            for fused, module in layer.items():
                module.write(slot, [adapter.weights.get((index, name)) for name in FUSED_PROJECTIONS[fused]])
