"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over packed tokens and a paged KV cache.

One forward pass runs every token of the step at once: `[num_tokens, hidden_size]`, no batch axis, no
padding. Attention, norms, rotary embedding and the MLP gate call the kernel backend
(`conveyor.kernels.load_backend`), so the same model runs the C++ kernels (or the torch references) on
CPU and the Triton kernels on CUDA. Projections are fused as in vLLM (q/k/v into one matmul, gate/up
into one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from conveyor.kernels import KernelBackend
from conveyor.kernels.reference import rope_cos_sin_cache


@dataclass
class ModelShape:
    """The architecture numbers the runner and capacity math need, read from a HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        """Accepts a transformers `PretrainedConfig` of a Llama-like model (v4 or v5 rope fields)."""
        rope = dict(getattr(config, "rope_parameters", None) or {})
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        scaling = (
            rope if rope.get("rope_type", "default") != "default" else getattr(config, "rope_scaling", None)
        )
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases; Llama exposes `attention_bias`.
            attention_bias=bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2",
        )


@dataclass
class AttentionMetadata:
    """Where the step's tokens sit in the paged KV cache (see `conveyor.kernels.reference`).

    slot_mapping: `[num_tokens]` int64; block_tables: `[num_seqs, max_blocks]` int32;
    query_start_loc: `[num_seqs + 1]` int32; seq_lens: `[num_seqs]` int32.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normalized, residual stream); with `residual`, adds it first (fused)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, shape: ModelShape, ops: KernelBackend) -> None:
        super().__init__()
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.qkv_proj = nn.Linear(
            shape.hidden_size, self.q_size + 2 * self.kv_size, bias=shape.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=False)
        self.scale = shape.head_dim**-0.5
        self.ops = ops

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotary_embedding(positions, q, k, cos_sin_cache)
        key_cache, value_cache = kv_cache
        self.ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = self.ops.paged_attention(
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            meta.max_query_len,
            meta.max_seq_len,
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, shape: ModelShape, ops: KernelBackend) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, ops: KernelBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(shape, ops)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        self.mlp = LlamaMLP(shape, ops)

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin_cache):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states; `compute_logits` projects chosen rows."""

    def __init__(self, shape: ModelShape, ops: KernelBackend) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(shape, ops) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer(
            "cos_sin_cache",
            rope_cos_sin_cache(
                shape.head_dim, shape.max_position_embeddings, shape.rope_theta, shape.rope_scaling
            ),
            persistent=False,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: `[num_tokens]` int64. Returns hidden states `[num_tokens, hidden_size]`."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, self.cos_sin_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: `[num_rows, hidden_size]` -> logits `[num_rows, vocab_size]`."""
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy weights from a transformers Llama-family `state_dict`, fusing q/k/v and gate/up.

        Raises KeyError naming a missing tensor.
        """
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
        self.embed_tokens.weight.copy_(sd["embed_tokens.weight"])
        self.norm.weight.copy_(sd["norm.weight"])
        if not self.shape.tie_word_embeddings:
            self.lm_head.weight.copy_(state_dict["lm_head.weight"])
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attn = layer.self_attn
            attn.qkv_proj.weight.copy_(
                torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], dim=0)
            )
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.bias.copy_(torch.cat([sd[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
            attn.o_proj.weight.copy_(sd[p + "self_attn.o_proj.weight"])
            layer.mlp.gate_up_proj.weight.copy_(
                torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], dim=0)
            )
            layer.mlp.down_proj.weight.copy_(sd[p + "mlp.down_proj.weight"])
            layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(sd[p + "post_attention_layernorm.weight"])
