"""`--model-impl transformers`: any decoder-only model transformers implements, run under conveyor's
scheduler, paged KV cache and sampler (vLLM's Transformers backend does the same).

The model is transformers' own (`AutoModelForCausalLM`), loaded with `attn_implementation="conveyor"`:
every attention layer calls `paged_attention_forward` below through transformers' attention interface
(`AttentionInterface`, transformers' docs "Attention interface"), which writes the layer's keys and
values into conveyor's paged KV cache (`reshape_and_cache`) and attends over it with the kernel
backend's `paged_attention`. A step's packed tokens go in as one batch row (`[1, num_tokens]`) with
their positions as `position_ids`, so the model's own rotary embedding, norms and MLPs run unchanged;
no mask is built (a custom attention implementation has none: the kernel is causal over the block
table). The step's metadata reaches the attention layers through the forward's keyword arguments,
which transformers passes down to them.

Logits: the model's `lm_head`, then the post-processing its config names (`final_logit_softcapping`,
`logits_scaling`, `logit_scale`) as the model's own forward applies it.

One rank only (no tensor parallelism), and no C++ layer loop: the native decoder stays the fast path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.server.capacity import sliding_layers
from conveyor.server.model.models.llama import cached_attention
from conveyor.server.model.parallel import TensorParallel, partition

logger = logging.getLogger(__name__)

ATTENTION_NAME = "conveyor"


@dataclass(frozen=True)
class GenericShape:
    """What the runner and the capacity math need of any transformers decoder's config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_window: int | None = None
    # transformers' model rotates q and k itself, however its rope scaling picks the angles.
    rope_by_length = False

    @property
    def position_limit(self) -> int:
        """The longest sequence the model's positions cover."""
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(cls, config) -> GenericShape:
        """Raises ValueError naming the field a config lacks."""
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        try:
            heads = config.num_attention_heads
            hidden = config.hidden_size
            return cls(
                vocab_size=config.vocab_size,
                hidden_size=hidden,
                num_layers=config.num_hidden_layers,
                num_heads=heads,
                num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                head_dim=getattr(config, "head_dim", None) or hidden // heads,
                max_position_embeddings=config.max_position_embeddings,
                sliding_window=sliding_layers(config)[0],
            )
        except AttributeError as exc:
            raise ValueError(
                f"model type {config.model_type!r}: its config has no {exc.name} (--model-impl transformers "
                "runs decoders that name their layers, heads and positions)"
            ) from None


@dataclass(frozen=True)
class StepContext:
    """What the attention layers need of the step: the KV caches (one (key, value) per layer), the
    metadata, and the kernel backend. Passed as the forward's `conveyor_step` keyword."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata
    ops: KernelBackend


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature over conveyor's paged KV cache.

    query: `[1, num_heads, num_tokens, head_dim]`; key, value: `[1, num_kv_heads, num_tokens, head_dim]`
    (after the model's rotary). The layer's `sliding_window` and `softcap`, where the model passes them,
    go to the kernel. Returns (`[1, num_tokens, num_heads, head_dim]`, None).
    """
    step: StepContext = kwargs["conveyor_step"]
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    kv_cache = step.kv_caches[module.layer_idx]
    window, cap = kwargs.get("sliding_window"), kwargs.get("softcap")
    out = cached_attention(step.ops, q, k, v, kv_cache, step.meta, scale, window, cap)
    return out[None], None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


class TransformersForCausalLM(nn.Module):
    """transformers' model of `config` behind the interface the runner uses (`forward`,
    `compute_logits`, `shape`, `partition`, `tp`; `cos_sin_cache` None: the model rotates itself).

    hf_model: an `AutoModelForCausalLM` loaded with `attn_implementation=ATTENTION_NAME`.
    """

    def __init__(self, hf_model: nn.Module, ops: KernelBackend) -> None:
        super().__init__()
        self.hf = hf_model
        self.ops = ops
        self.shape = GenericShape.from_hf_config(hf_model.config)
        self.tp = TensorParallel()
        shape = self.shape
        self.partition = partition(shape.num_heads, shape.num_kv_heads, 0, shape.vocab_size, 0, 1)
        self.cos_sin_cache = None  # the model rotates q and k itself

    @classmethod
    def load(
        cls, path: str, config, dtype: torch.dtype, device: torch.device, ops: KernelBackend, dummy: bool
    ):
        """Load (or with `dummy`, build with random weights) transformers' model of `config` from `path`."""
        from transformers import AutoModelForCausalLM

        _register()
        config._attn_implementation = ATTENTION_NAME
        if dummy:
            with torch.device(device):
                hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION_NAME)
        else:
            hf = AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=dtype, attn_implementation=ATTENTION_NAME
            ).to(device)
        logger.info("--model-impl transformers: %s", type(hf).__name__)
        return cls(hf.eval(), ops)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: `[num_tokens]` int64. Returns hidden states `[num_tokens, hidden_size]`."""
        out = self.hf.base_model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            conveyor_step=StepContext(kv_caches, meta, self.ops),
        )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: `[num_rows, hidden_size]` -> logits `[num_rows, vocab_size]`, post-processed as the
        model's forward does."""
        logits = self.hf.lm_head(hidden)
        config = self.hf.config
        scale = getattr(config, "logit_scale", None)
        if scale is not None:
            logits = logits * scale
        divide = getattr(config, "logits_scaling", None)
        if divide is not None:
            logits = logits / divide
        cap = getattr(config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits[..., : self.shape.vocab_size]
