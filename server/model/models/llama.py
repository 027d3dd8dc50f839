"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2, Qwen3, Granite, SmolLM) over packed tokens and a
paged KV cache, built from the config's features (`ModelShape`): q/k/v biases, per-head RMSNorm on q and
k before rotary (Qwen3), a head_dim apart from hidden_size / num_heads, and Granite's multipliers
(embeddings, residual branches, attention scale, logits).

One forward pass runs every token of the step at once: `[num_tokens, hidden_size]`, no batch axis, no
padding. Attention, norms, rotary embedding and the MLP gate call the kernel backend
(`conveyor.kernels.load_backend`), so the same model runs the C++ kernels (or the torch references) on
CPU and the Triton kernels on CUDA. Projections are fused as in vLLM (q/k/v into one matmul, gate/up
into one). Under tensor parallelism (`conveyor.server.model.parallel`) each rank builds the layers of its
shard and the model sums row-parallel outputs and the vocabulary-parallel embedding over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.kernels.cpu import DecoderSpec
from conveyor.kernels.quant import QuantizedEmbedding, QuantizedLinear, QuantizedWeight
from conveyor.kernels.reference import (
    LENGTH_DEPENDENT_ROPE,
    rope_cos_sin_cache,
    rope_inv_freq,
    rope_kind,
    rope_rows,
)
from conveyor.server.capacity import sliding_layers
from conveyor.server.model.parallel import Partition, TensorParallel, partition

GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
# Activations of the gated MLP, by the config's `hidden_act` / `hidden_activation`.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass
class ModelShape:
    """The architecture numbers the runner and capacity math need, and the features the decoder switches
    on, read from a HF config (`from_hf_config`)."""

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
    # The rotated width of each head (head_dim x `partial_rotary_factor`; Phi-4-mini rotates 3/4).
    rotary_dim: int = 0
    # The output projection's bias (Llama and Granite put `attention_bias` on it too; Qwen2 does not).
    o_proj_bias: bool = False
    # Per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Granite: embeddings x embedding_multiplier; each residual branch x residual_multiplier before it
    # is added; logits / logits_scaling. Gemma: embeddings x sqrt(hidden_size), the factor rounded to the
    # weights' dtype first (`round_embedding_multiplier`).
    embedding_multiplier: float = 1.0
    round_embedding_multiplier: bool = False
    residual_multiplier: float = 1.0
    # The attention scale (None: head_dim ** -0.5; Granite's attention_multiplier, Gemma's
    # query_pre_attn_scalar ** -0.5).
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Gemma: RMSNorm scales by (1 + weight) (folded into the weights at load); the gated MLP's
    # activation; sandwich norms (Gemma 2/3: a norm after attention and around the MLP).
    norm_weight_offset: float = 0.0
    activation: str = "silu"
    sandwich_norms: bool = False
    # Gemma 2: scores capped as cap * tanh(s / cap) (attention), logits likewise (final).
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Tokens a sliding-window layer attends to (None: every layer attends to the whole sequence), which
    # layers slide, and their rotary base where it differs (Gemma 3's local layers).
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    local_rope_theta: float | None = None
    # OLMoE, OLMo 2: q and k RMS-normed over the whole projection (all heads at once), not per head.
    qk_norm_all_heads: bool = False
    # OLMo 2: no norm before attention or the MLP; each one's output is normed before it joins the
    # residual stream (`post_attention_layernorm`, `post_feedforward_layernorm`).
    post_norms: bool = False
    # Mixture of experts (Qwen2/3-MoE, Mixtral, OLMoE): `num_experts` SwiGLU experts of
    # `moe_intermediate_size`, `num_experts_per_tok` chosen per token by a softmax router (the chosen
    # probabilities renormalized to sum to 1 with `norm_topk_prob`), on the layers `moe_layers` marks
    # (the others keep a dense MLP of `intermediate_size`); Qwen2-MoE adds a shared expert of
    # `shared_expert_intermediate_size` behind a sigmoid gate. num_experts 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not self.rotary_dim:
            self.rotary_dim = self.head_dim

    @property
    def rope_by_length(self) -> bool:
        """Whether a token's rotary angles depend on its sequence's length, not only on its position
        (LongRoPE, dynamic NTK): the model runner then gives each token its length (`rope_lengths`)."""
        return rope_kind(self.rope_scaling) in LENGTH_DEPENDENT_ROPE

    def rope_cache_key(self, length: int) -> int | None:
        """Which rotary table a sequence of `length` tokens is computed with, where that depends on the
        length (`rope_by_length`; the prefix cache keeps K/V of different tables apart): LongRoPE's long
        factors (1) past `original_max_position_embeddings`, dynamic NTK's base for exactly this length
        past `max_position_embeddings`; None for the table of every shorter sequence, and for other
        rope kinds."""
        kind = rope_kind(self.rope_scaling)
        if kind == "longrope" and length > self.rope_scaling["original_max_position_embeddings"]:
            return 1
        if kind == "dynamic" and length > self.max_position_embeddings:
            return length
        return None

    def rope_recompute_after(self, prompt_len: int) -> int | None:
        """The length past which a sequence with a prompt of `prompt_len` tokens has its K/V recomputed
        with the table of its new length: LongRoPE's `original_max_position_embeddings` for a prompt
        within it (transformers' Phi-3 drops its cache there, so every token uses the long factors
        once the sequence is long); None otherwise (dynamic NTK keeps each token's angles, as
        transformers does)."""
        if rope_kind(self.rope_scaling) != "longrope":
            return None
        original = self.rope_scaling["original_max_position_embeddings"]
        return original if prompt_len <= original else None

    @property
    def position_limit(self) -> int:
        """The longest sequence the model's positions cover: `max_position_embeddings`, times `factor`
        for dynamic NTK scaling (which stretches the context past it, as vLLM counts it)."""
        if rope_kind(self.rope_scaling) == "dynamic":
            return int(self.max_position_embeddings * self.rope_scaling["factor"])
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        """Accepts a transformers `PretrainedConfig` of a Llama-like or Gemma model (v4 or v5 rope
        fields). Raises ValueError for a feature this decoder does not implement (naming the field)."""
        kind = config.model_type
        gemma = kind in GEMMA_TYPES
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {act!r} is not supported (model type {kind!r}); expected one of {sorted(ACTIVATIONS)}"
            )
        if getattr(config, "mlp_bias", False):
            raise ValueError(f"mlp_bias is not supported (model type {kind!r})")
        rope_parameters = getattr(config, "rope_parameters", None) or {}
        partial = rope_parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        theta, scaling, local_theta = _rope(config)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rotary_dim = int(head_dim * partial)  # as transformers rounds it
        if rotary_dim % 2 or rotary_dim < 2:
            raise ValueError(
                f"partial_rotary_factor {partial} of head_dim {head_dim} rotates {rotary_dim} dims; an even "
                f"number of at least 2 is needed (model type {kind!r})"
            )
        if rope_kind(scaling) in LENGTH_DEPENDENT_ROPE and local_theta is not None:
            raise ValueError(
                f"rope_type {rope_kind(scaling)!r} with a local rotary base is not supported (model type {kind!r})"
            )
        attention_multiplier = None
        if kind == "granite":
            attention_multiplier = float(config.attention_multiplier)
        elif gemma:
            attention_multiplier = float(getattr(config, "query_pre_attn_scalar", head_dim)) ** -0.5
        window, sliding = sliding_layers(config)
        if getattr(config, "clip_qkv", None) is not None:
            raise ValueError(f"clip_qkv is not supported (model type {kind!r})")
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", gemma)),
            # Qwen2 (and Qwen2-MoE) has q/k/v biases; Llama exposes `attention_bias` (q/k/v and o).
            attention_bias=bool(getattr(config, "attention_bias", False)) or kind in ("qwen2", "qwen2_moe"),
            rotary_dim=rotary_dim,
            o_proj_bias=bool(getattr(config, "attention_bias", False))
            and kind in ("llama", "granite", *GEMMA_TYPES),
            qk_norm=kind in ("qwen3", "gemma3_text", "qwen3_moe", "olmoe", "olmo2"),
            qk_norm_all_heads=kind in ("olmoe", "olmo2"),
            post_norms=kind == "olmo2",
            embedding_multiplier=config.hidden_size**0.5
            if gemma
            else float(getattr(config, "embedding_multiplier", 1.0)),
            round_embedding_multiplier=gemma,
            residual_multiplier=float(getattr(config, "residual_multiplier", 1.0)),
            attention_multiplier=attention_multiplier,
            logits_scaling=float(getattr(config, "logits_scaling", 1.0)),
            norm_weight_offset=1.0 if gemma else 0.0,
            activation=ACTIVATIONS[act],
            sandwich_norms=kind in ("gemma2", "gemma3_text"),
            attn_logit_softcap=getattr(config, "attn_logit_softcapping", None),
            final_logit_softcap=getattr(config, "final_logit_softcapping", None),
            sliding_window=window,
            sliding_layers=sliding,
            local_rope_theta=local_theta,
            **_experts(config),
        )


def _experts(config) -> dict:
    """ModelShape's mixture-of-experts fields from a config (empty for a dense model): Mixtral's
    `num_local_experts` (always renormalized, every layer sparse), or `num_experts` with Qwen-MoE's
    `decoder_sparse_step` / `mlp_only_layers` and shared expert, and OLMoE's `norm_topk_prob`."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    if not experts:
        return {}
    kind = config.model_type
    layers = config.num_hidden_layers
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(config.num_experts_per_tok),
        "moe_intermediate_size": int(
            getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        ),
        "norm_topk_prob": kind == "mixtral" or bool(getattr(config, "norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(getattr(config, "shared_expert_intermediate_size", None) or 0),
        "moe_layers": tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
    }


def _rope(config) -> tuple[float, dict | None, float | None]:
    """(rotary base, scaling dict or None, the sliding layers' own base or None) from a config's v4
    fields (`rope_theta`, `rope_scaling`, Gemma 3's `rope_local_base_freq`) or v5 `rope_parameters`,
    which Gemma 3 keys by layer type (`full_attention`, `sliding_attention`)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    local = None
    if "full_attention" in rope:
        local_params = rope.get("sliding_attention") or {}
        local = local_params.get("rope_theta")
        rope = dict(rope["full_attention"])
    elif getattr(config, "rope_local_base_freq", None) is not None:
        local = config.rope_local_base_freq
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", "default") != "default" else getattr(config, "rope_scaling", None)
    local = float(local) if local is not None and float(local) != float(theta) else None
    return float(theta), scaling, local


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
    """Column-parallel q/k/v (this rank's heads), paged attention, row-parallel output projection.

    sliding: this layer attends within `shape.sliding_window` tokens (and, where the model has a local
    rotary base, rotates with the model's local table)."""

    def __init__(
        self,
        shape: ModelShape,
        ops: KernelBackend,
        part: Partition,
        tp: TensorParallel,
        sliding: bool = False,
    ) -> None:
        super().__init__()
        self.sliding = sliding
        self.num_heads = part.num_heads
        self.num_kv_heads = part.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size = part.num_heads * shape.head_dim
        self.kv_size = part.num_kv_heads * shape.head_dim
        self.qkv_proj = nn.Linear(
            shape.hidden_size, self.q_size + 2 * self.kv_size, bias=shape.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=shape.o_proj_bias)
        self.qk_norm_all_heads = shape.qk_norm_all_heads
        q_width, k_width = (self.q_size, self.kv_size) if shape.qk_norm_all_heads else (shape.head_dim,) * 2
        self.q_norm = RMSNorm(q_width, shape.rms_norm_eps, ops) if shape.qk_norm else None
        self.k_norm = RMSNorm(k_width, shape.rms_norm_eps, ops) if shape.qk_norm else None
        self.scale = shape.attention_multiplier or shape.head_dim**-0.5
        self.window = shape.sliding_window if sliding else None
        self.softcap = shape.attn_logit_softcap
        self.local_rope = shape.local_rope_theta is not None
        self.ops = ops
        self.tp = tp

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.sliding and meta.window is not None:  # this layer's K/V has blocks of its own
            meta = meta.window
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_all_heads:  # over the whole projection (OLMoE)
            q, k = self.q_norm(q.contiguous())[0], self.k_norm(k.contiguous())[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_all_heads:  # per head (Qwen3, Gemma 3)
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view(num_tokens, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view(
                num_tokens, self.num_kv_heads, self.head_dim
            )
        # The step's prepared rotary rows are the model's main table's; a local table is looked up here.
        own_table = self.sliding and self.local_rope
        q, k = self.ops.rotary_embedding(positions, q, k, cos_sin_cache, None if own_table else meta.prepared)
        out = cached_attention(self.ops, q, k, v, kv_cache, meta, self.scale, self.window, self.softcap)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))


def cached_attention(
    ops: KernelBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """One layer's attention over the paged KV cache: the step's keys and values written into the
    layer's cache at the slot mapping, then the queries attend over it (the kernel contract's
    `reshape_and_cache` and `paged_attention`). q: `[num_tokens, num_heads, head_dim]`; k, v:
    `[num_tokens, num_kv_heads, head_dim]`. Returns q's shape and dtype."""
    key_cache, value_cache = kv_cache
    ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    return ops.paged_attention(
        q,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale,
        meta.max_query_len,
        meta.max_seq_len,
        meta.prepared,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )


class LlamaMLP(nn.Module):
    """Column-parallel gate/up (this rank's `intermediate_size / tp`), row-parallel down projection."""

    def __init__(self, shape: ModelShape, ops: KernelBackend, part: Partition, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * part.intermediate_size, bias=False)
        self.down_proj = nn.Linear(part.intermediate_size, shape.hidden_size, bias=False)
        self.activation = shape.activation
        self.ops = ops
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "silu":
            hidden = self.ops.silu_and_mul(gate_up)
        else:  # GeGLU with tanh GELU (Gemma)
            hidden = self.ops.gelu_tanh_and_mul(gate_up)
        return self.tp.all_reduce(self.down_proj(hidden))


def check_expert_split(shape: ModelShape, size: int, expert_parallel: bool) -> None:
    """Whether `size` ranks split `shape`'s mixture-of-experts layers (`SparseMoE`); checked before any
    rank starts. Raises ValueError naming the flag and the number it does not divide: the experts with
    `expert_parallel`, else each expert's width; the shared expert's width either way; OLMoE's q/k
    norms over all heads at any size above 1."""
    if size == 1:
        return
    if shape.qk_norm_all_heads:
        raise ValueError(
            "tensor parallelism of q/k norms over all heads (OLMoE, OLMo 2) is not supported: run it with "
            "--tensor-parallel-size 1"
        )
    if not shape.num_experts:
        return
    if expert_parallel and shape.num_experts % size:
        raise ValueError(
            f"--enable-expert-parallel: --tensor-parallel-size {size} does not divide the model's "
            f"{shape.num_experts} experts"
        )
    if not expert_parallel and shape.moe_intermediate_size % size:
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide the experts' intermediate size "
            f"{shape.moe_intermediate_size} (--enable-expert-parallel splits whole experts instead)"
        )
    if shape.shared_expert_intermediate_size % size:
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide the shared expert's intermediate size "
            f"{shape.shared_expert_intermediate_size}"
        )


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP (`ModelShape`'s expert fields): a softmax router over `num_experts`
    picks `num_experts_per_tok` experts per token and the kernel backend's `fused_moe` runs them; a
    shared expert (Qwen2-MoE) adds `sigmoid(shared_expert_gate(x)) * shared_expert(x)`.

    Router logits are computed in the weights' dtype and soft-maxed in float32, as transformers does.
    The router and the experts' stacked weights are parameters, not `nn.Linear`s: they are never
    quantized or repacked.

    Over `tp.size > 1` ranks every rank holds the router and sees every token. By default each expert
    is split as a dense MLP is (`moe_intermediate_size / tp` rows of its gate and up projections,
    the same columns of its down projection); with `expert_parallel` (`--enable-expert-parallel`, as
    vLLM names it) each rank holds `num_experts / tp` whole experts and runs only the (token, expert)
    pairs routed to them. Either way each rank's output is a partial sum (the shared expert split like
    a dense MLP), added over ranks by one all-reduce. Raises ValueError when the ranks do not divide
    the experts (or their width), naming the flag."""

    def __init__(
        self,
        shape: ModelShape,
        ops: KernelBackend,
        part: Partition,
        tp: TensorParallel,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        experts, width, hidden = shape.num_experts, shape.moe_intermediate_size, shape.hidden_size
        check_expert_split(shape, tp.size, expert_parallel)
        self.expert_parallel = expert_parallel and tp.size > 1
        local = experts // tp.size if self.expert_parallel else experts
        width = width if self.expert_parallel else width // tp.size
        self.first_expert = tp.rank * local if self.expert_parallel else 0
        self.gate = nn.Parameter(torch.empty(experts, hidden))
        self.w13 = nn.Parameter(torch.empty(local, 2 * width, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, width))
        self.top_k = shape.num_experts_per_tok
        self.norm_topk_prob = shape.norm_topk_prob
        self.tp = tp
        self.shared_expert = None
        if shape.shared_expert_intermediate_size:
            shared = replace(part, intermediate_size=shape.shared_expert_intermediate_size // tp.size)
            # A partial sum like the experts' (no all-reduce of its own): one all-reduce adds both.
            self.shared_expert = LlamaMLP(shape, ops, shared, TensorParallel())
            self.shared_expert_gate = nn.Parameter(torch.empty(1, hidden))
        self.ops = ops
        # None: the kernel backend's; else the one measured fastest per token count
        # (`selection.select_moe_kernels`).
        self.fused_moe = None
        # Tokens routed to each expert since the last `LlamaForCausalLM.take_expert_tokens` (metrics).
        self.register_buffer("expert_tokens", torch.zeros(experts, dtype=torch.int64), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: `[num_tokens, hidden_size]` -> (weights `[num_tokens, top_k]` float32, expert ids
        `[num_tokens, top_k]` int64), highest probability first."""
        probs = torch.softmax(F.linear(x, self.gate), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        self.expert_tokens += torch.bincount(ids.flatten(), minlength=self.expert_tokens.shape[0])
        fused_moe = self.fused_moe or self.ops.fused_moe
        if self.expert_parallel:  # this rank's experts only: their pairs, one choice per row
            local = ids - self.first_expert
            tokens, choices = ((local >= 0) & (local < self.w13.shape[0])).nonzero(as_tuple=True)
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            if len(tokens):
                pairs = fused_moe(
                    x[tokens], self.w13, self.w2, weights[tokens, choices, None], local[tokens, choices, None]
                )
                out.index_add_(0, tokens, pairs.float())
            out = out.to(x.dtype)
        else:
            out = fused_moe(x, self.w13, self.w2, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks on a residual stream carried beside the hidden states (each
    norm adds the residual first, fused). With `sandwich_norms` (Gemma 2/3) the attention output and the
    MLP output are normed too before they join the stream: `post_attention_layernorm` then
    `pre_feedforward_layernorm` (which adds the residual), and `post_feedforward_layernorm`. With
    `post_norms` (OLMo 2) there is no norm before either block, only those two after them; the stream
    is then added up before the layer (`hidden + residual`) and handed on the same way."""

    def __init__(
        self,
        shape: ModelShape,
        ops: KernelBackend,
        part: Partition,
        tp: TensorParallel,
        sliding: bool = False,
        sparse: bool = False,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        norm = partial(RMSNorm, shape.hidden_size, shape.rms_norm_eps, ops)
        self.input_layernorm = None if shape.post_norms else norm()
        self.self_attn = LlamaAttention(shape, ops, part, tp, sliding)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if shape.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if shape.sandwich_norms or shape.post_norms else None
        self.mlp = (
            SparseMoE(shape, ops, part, tp, expert_parallel) if sparse else LlamaMLP(shape, ops, part, tp)
        )
        self.residual_multiplier = shape.residual_multiplier

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin_cache):
        if self.input_layernorm is None:  # OLMo 2: x + norm(attn(x)), then x + norm(mlp(x))
            stream = hidden if residual is None else hidden + residual
            hidden, _ = self.post_attention_layernorm(
                self.self_attn(positions, stream, kv_cache, meta, cos_sin_cache)
            )
            stream = stream + hidden
            hidden, _ = self.post_feedforward_layernorm(self.mlp(stream))
            return hidden, stream
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin_cache)
        if self.pre_feedforward_layernorm is not None:
            hidden, _ = self.post_attention_layernorm(hidden)
            hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
            hidden, _ = self.post_feedforward_layernorm(self.mlp(hidden))
            return hidden, residual
        if self.residual_multiplier != 1.0:  # Granite scales each branch before the residual add
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states; `compute_logits` projects chosen rows.

    With `tp` of size > 1 this is one rank's shard (`partition`): its heads, MLP rows and vocabulary
    rows, and its share of the experts (`SparseMoE`, `expert_parallel`); every rank runs `forward` and
    `compute_logits` on the same inputs. Raises ValueError when the
    tensor-parallel size does not split the model (naming both numbers).
    """

    def __init__(
        self,
        shape: ModelShape,
        ops: KernelBackend,
        tp: TensorParallel | None = None,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.shape = shape
        self.tp = tp = tp or TensorParallel()
        self.partition = part = partition(
            shape.num_heads, shape.num_kv_heads, shape.intermediate_size, shape.vocab_size, tp.rank, tp.size
        )
        vocab_rows = part.vocab_per_rank if tp.size > 1 else shape.vocab_size
        self.embed_tokens = nn.Embedding(vocab_rows, shape.hidden_size)
        check_expert_split(shape, tp.size, expert_parallel)
        sliding = shape.sliding_layers or (False,) * shape.num_layers
        sparse = shape.moe_layers or (False,) * shape.num_layers
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(shape, ops, part, tp, sliding[i], sparse[i], expert_parallel)
            for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        self.lm_head = nn.Linear(shape.hidden_size, vocab_rows, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        rope = (shape.rotary_dim, shape.max_position_embeddings, shape.rope_theta, shape.rope_scaling)
        # `[max_position_embeddings, rotary_dim]` float32: every token's angles, or for a rope that
        # depends on the sequence's length (`rotary_table`) those of sequences within the original
        # context (LongRoPE's short factors, dynamic NTK's unscaled base).
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(*rope), persistent=False)
        # LongRoPE's table for sequences past `original_max_position_embeddings` (else None).
        original = (shape.rope_scaling or {}).get("original_max_position_embeddings", 0)
        long_table = (
            rope_cos_sin_cache(*rope, seq_len=original + 1) if rope_kind(rope[3]) == "longrope" else None
        )
        self.register_buffer("long_cos_sin_cache", long_table, persistent=False)
        # The local layers' rotary table where their base differs (Gemma 3), else None.
        self.register_buffer(
            "local_cos_sin_cache",
            None
            if shape.local_rope_theta is None
            else rope_cos_sin_cache(shape.rotary_dim, shape.max_position_embeddings, shape.local_rope_theta),
            persistent=False,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: `[num_tokens]` int64 -> `[num_tokens, hidden_size]` (vocabulary-parallel lookup)."""
        if self.tp.size == 1:
            # A quantized table (`kernels.quant.QuantizedEmbedding`) returns float32 rows.
            hidden = self.embed_tokens(input_ids).to(self.norm.weight.dtype)
        else:
            local = input_ids - self.partition.vocab_start
            outside = (local < 0) | (local >= self.partition.vocab_per_rank)
            hidden = self.embed_tokens(local.masked_fill(outside, 0))
            hidden = self.tp.all_reduce(hidden.masked_fill_(outside[:, None], 0))
        multiplier = self.shape.embedding_multiplier
        if self.shape.round_embedding_multiplier:  # as Gemma computes it: the factor in the weights' dtype
            return hidden * torch.tensor(multiplier, dtype=hidden.dtype)
        return hidden * multiplier if multiplier != 1.0 else hidden

    def rotary_table(
        self, positions: torch.Tensor, rope_lengths: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(table, index) the step's rotary kernels read: the model's table and the positions, or where
        the angles depend on the sequence's length (`ModelShape.rope_by_length`) the step's own rows
        `[num_tokens, rotary_dim]` float32 and their indices `[num_tokens]` (0 .. num_tokens - 1).

        positions: `[num_tokens]` int64. rope_lengths: `[num_tokens]` int64 or None, the length each
        token's angles are chosen by: max(its prompt's length, its position + 1). transformers picks
        them by the longest position in its forward pass (`dynamic_rope_update`), which for one
        sequence generated alone is this: a long prompt's tokens all use the long (or scaled) angles,
        a decoded token those of its own length, and keys already cached keep theirs.
        """
        if rope_lengths is None:
            return self.cos_sin_cache, positions
        scaling = self.shape.rope_scaling
        if rope_kind(scaling) == "longrope":
            long = rope_lengths > scaling["original_max_position_embeddings"]
            rows = torch.where(
                long[:, None], self.long_cos_sin_cache[positions], self.cos_sin_cache[positions]
            )
        else:  # dynamic NTK: the base scaled for each length past max_position_embeddings
            limit = self.shape.max_position_embeddings
            rows = self.cos_sin_cache[positions.clamp(max=limit - 1)]
            scaled = rope_lengths > limit
            if bool(scaled.any()):
                shape = self.shape
                for length in rope_lengths[scaled].unique().tolist():
                    chosen = rope_lengths == length
                    inv_freq, _ = rope_inv_freq(shape.rotary_dim, shape.rope_theta, scaling, limit, length)
                    rows[chosen] = rope_rows(positions[chosen].float().cpu(), inv_freq).to(rows.device)
        return rows, torch.arange(len(positions), device=positions.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: `[num_tokens]` int64; cos_sin_cache: the table `positions` index
        (`rotary_table`; None: the model's). Returns hidden states `[num_tokens, hidden_size]`."""
        hidden = self.embed(input_ids)
        residual = None
        local = self.local_cos_sin_cache
        main = self.cos_sin_cache if cos_sin_cache is None else cos_sin_cache
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            table = local if local is not None and layer.self_attn.sliding else main
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, table)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def take_expert_tokens(self) -> torch.Tensor | None:
        """Tokens routed to each expert since the last call, `[num_sparse_layers, num_experts]` int64 on
        the CPU (a token counts once per expert it chose), then zeroed; None for a dense model."""
        counts = [layer.mlp.expert_tokens for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
        if not counts:
            return None
        taken = torch.stack(counts).cpu()
        for count in counts:
            count.zero_()
        return taken

    def decoder_spec(self) -> DecoderSpec:
        """This decoder's layers as the C++ layer loop takes them (`kernels.cpu.DecoderSpec`): norms,
        q/k norms and linear layers in execution order, and the features' numbers."""
        norms: list[torch.Tensor] = []
        qk_norms: list[torch.Tensor] = []
        linears: list[nn.Module] = []
        for layer in self.layers:
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if layer.pre_feedforward_layernorm is not None:
                norms += [layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight]
            attn, mlp = layer.self_attn, layer.mlp
            if attn.q_norm is not None:
                qk_norms += [attn.q_norm.weight, attn.k_norm.weight]
            linears += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        shape, first = self.shape, self.layers[0].self_attn
        return DecoderSpec(
            norm_weights=[*norms, self.norm.weight],
            norms_per_layer=4 if shape.sandwich_norms else 2,
            qk_norm_weights=qk_norms,
            linears=linears,
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            eps=shape.rms_norm_eps,
            scale=first.scale,
            sliding_windows=[layer.self_attn.window or 0 for layer in self.layers],
            local_cos_sin_cache=self.local_cos_sin_cache,
            logits_soft_cap=shape.attn_logit_softcap,
            residual_multiplier=shape.residual_multiplier,
            activation=shape.activation,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: `[num_rows, hidden_size]` -> logits `[num_rows, vocab_size]` (on rank 0; None on the
        other ranks of a tensor-parallel group)."""
        logits = self.tp.gather_logits(self.lm_head(hidden), self.shape.vocab_size)
        if logits is None:
            return None
        if self.shape.logits_scaling != 1.0:
            logits = logits / self.shape.logits_scaling
        cap = self.shape.final_logit_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict) -> None:
        """Copy this rank's shard of a transformers Llama-family checkpoint, fusing q/k/v and gate/up.

        `state_dict` maps checkpoint names to tensors (a dict, or a lazy mapping that reads each tensor
        when asked). A `kernels.quant.QuantizedWeight` value (a GGUF file's blocks, one rank only) makes
        its layer a `QuantizedLinear` (its embedding table a `QuantizedEmbedding`, shared with a tied LM
        head) instead of being copied. Raises KeyError naming a missing tensor.
        """
        part, hd = self.partition, self.shape.head_dim
        tp = self.tp.size > 1

        # A multimodal checkpoint's language model (Gemma 3) nests the decoder's names.
        prefixes = ("", "model.", "model.language_model.", "language_model.model.", "language_model.")

        def has(name: str) -> bool:
            return any(prefix + name in state_dict for prefix in prefixes)

        def get(name: str) -> torch.Tensor:
            for prefix in prefixes:
                if prefix + name in state_dict:
                    return state_dict[prefix + name]
            raise KeyError(name)

        offset = self.shape.norm_weight_offset

        def norm(module: RMSNorm, name: str) -> None:
            """A norm's weight; Gemma's (1 + w) folded in (exact in float32, as Gemma computes it)."""
            module.weight.copy_(get(name).float() + offset if offset else get(name))

        def rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
            if isinstance(t, QuantizedWeight) and tp:  # a rank's shard of a GGUF file: its values
                t = t.dequantize()
            return t[start : start + count] if tp else t

        def cols(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
            if isinstance(t, QuantizedWeight) and tp:
                t = t.dequantize()
            return t[:, start : start + count] if tp else t

        def vocab(t: torch.Tensor) -> torch.Tensor:
            if not tp:
                return t
            if isinstance(t, QuantizedWeight):
                t = t.dequantize()
            shard = t[part.vocab_start : part.vocab_start + part.vocab_per_rank]
            padded = t.new_zeros(part.vocab_per_rank, *t.shape[1:])
            padded[: shard.shape[0]] = shard
            return padded

        def set_linear(owner: nn.Module, attr: str, parts: list) -> None:
            """Layer `attr` of `owner` gets the rows of `parts` in order: quantized ones kept so (the
            layer becomes a QuantizedLinear with the old one's bias), float ones copied."""
            if all(isinstance(part, QuantizedWeight) for part in parts) and not tp:
                old = getattr(owner, attr)
                setattr(owner, attr, QuantizedLinear(QuantizedWeight.cat(parts), old.bias))
                return
            dense = [part.dequantize() if isinstance(part, QuantizedWeight) else part for part in parts]
            getattr(owner, attr).weight.copy_(torch.cat(dense))

        def dense(t: torch.Tensor) -> torch.Tensor:
            return t.dequantize() if isinstance(t, QuantizedWeight) else t

        def experts(moe: SparseMoE, p: str) -> None:
            """Router, experts and shared expert of a sparse layer (this rank's share): Mixtral's
            `block_sparse_moe` with experts' w1 (gate), w3 (up), w2 (down), or Qwen-MoE / OLMoE's `mlp`
            with gate/up/down_proj, one tensor per expert as checkpoints store them, or stacked
            `experts.gate_up_proj` / `experts.down_proj` (transformers 5's in-memory layout, gate rows
            first)."""
            block = p + ("block_sparse_moe." if has(p + "block_sparse_moe.gate.weight") else "mlp.")
            moe.gate.copy_(dense(get(block + "gate.weight")))
            local, width = moe.w13.shape[0], moe.w2.shape[2]
            full = self.shape.moe_intermediate_size
            cut = (
                slice(0, full)
                if moe.expert_parallel
                else slice(self.tp.rank * width, (self.tp.rank + 1) * width)
            )
            ids = range(moe.first_expert, moe.first_expert + local)
            try:
                gate_up = dense(get(block + "experts.gate_up_proj"))[ids.start : ids.stop]
                down = dense(get(block + "experts.down_proj"))[ids.start : ids.stop]
                moe.w13.copy_(torch.cat([gate_up[:, :full][:, cut], gate_up[:, full:][:, cut]], dim=1))
                moe.w2.copy_(down[:, :, cut])
            except KeyError:
                names = (
                    ("w1", "w3", "w2")
                    if "block_sparse_moe" in block
                    else ("gate_proj", "up_proj", "down_proj")
                )
                for i, e in enumerate(ids):
                    gate, up, down = (dense(get(f"{block}experts.{e}.{n}.weight")) for n in names)
                    moe.w13[i].copy_(torch.cat([gate[cut], up[cut]]))
                    moe.w2[i].copy_(down[:, cut])
            if moe.shared_expert is not None:
                shared = block + "shared_expert."
                shared_rows = (
                    self.tp.rank * moe.shared_expert.down_proj.in_features,
                    moe.shared_expert.down_proj.in_features,
                )
                set_linear(
                    moe.shared_expert,
                    "gate_up_proj",
                    [rows(get(shared + f"{n}_proj.weight"), *shared_rows) for n in ("gate", "up")],
                )
                set_linear(
                    moe.shared_expert, "down_proj", [cols(get(shared + "down_proj.weight"), *shared_rows)]
                )
                moe.shared_expert_gate.copy_(dense(get(block + "shared_expert_gate.weight")))

        try:
            embed = get("embed_tokens.weight")
        except KeyError:
            if not self.shape.tie_word_embeddings:
                raise
            embed = get("lm_head.weight")  # a tied table saved once, under the head's name
        if isinstance(embed, QuantizedWeight) and not tp:
            head = QuantizedLinear(embed)
            self.embed_tokens = QuantizedEmbedding(head)
            if self.shape.tie_word_embeddings:
                self.lm_head = head
        else:
            self.embed_tokens.weight.copy_(vocab(embed))
            if self.shape.tie_word_embeddings:  # a quantized head tied to a float table: the table's values
                self.lm_head.weight = self.embed_tokens.weight
        norm(self.norm, "norm.weight")
        if not self.shape.tie_word_embeddings:
            set_linear(self, "lm_head", [vocab(get("lm_head.weight"))])
        q_rows = (part.head_start * hd, part.num_heads * hd)
        kv_rows = (part.kv_head_start * hd, part.num_kv_heads * hd)
        mlp_rows = (part.rank * part.intermediate_size, part.intermediate_size)
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attn = layer.self_attn

            def qkv(kind: str, p: str = p) -> list:
                try:
                    q, k, v = (get(p + f"self_attn.{n}_proj.{kind}") for n in "qkv")
                except KeyError:  # one fused q/k/v projection (Phi-3)
                    fused = get(p + f"self_attn.qkv_proj.{kind}")
                    kv = self.shape.num_kv_heads * hd
                    q, k, v = fused.split([self.shape.num_heads * hd, kv, kv])
                return [rows(q, *q_rows), rows(k, *kv_rows), rows(v, *kv_rows)]

            def gate_up(p: str = p) -> tuple[torch.Tensor, torch.Tensor]:
                try:
                    return get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")
                except KeyError:  # one fused gate/up projection (Phi-3)
                    gate, up = get(p + "mlp.gate_up_proj.weight").chunk(2)
                    return gate, up

            set_linear(attn, "qkv_proj", qkv("weight"))
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.bias.copy_(torch.cat(qkv("bias")))
            set_linear(attn, "o_proj", [cols(get(p + "self_attn.o_proj.weight"), *q_rows)])
            if attn.o_proj.bias is not None:  # added once: rank 0's shard holds it, the others zeros
                bias = get(p + "self_attn.o_proj.bias")
                attn.o_proj.bias.copy_(bias if self.tp.rank == 0 else torch.zeros_like(bias))
            if attn.q_norm is not None:
                norm(attn.q_norm, p + "self_attn.q_norm.weight")
                norm(attn.k_norm, p + "self_attn.k_norm.weight")
            if isinstance(layer.mlp, SparseMoE):
                experts(layer.mlp, p)
            else:
                gate, up = gate_up()
                set_linear(layer.mlp, "gate_up_proj", [rows(gate, *mlp_rows), rows(up, *mlp_rows)])
                set_linear(layer.mlp, "down_proj", [cols(get(p + "mlp.down_proj.weight"), *mlp_rows)])
            if layer.input_layernorm is not None:
                norm(layer.input_layernorm, p + "input_layernorm.weight")
            norm(layer.post_attention_layernorm, p + "post_attention_layernorm.weight")
            if layer.pre_feedforward_layernorm is not None:
                norm(layer.pre_feedforward_layernorm, p + "pre_feedforward_layernorm.weight")
            if layer.post_feedforward_layernorm is not None:
                norm(layer.post_feedforward_layernorm, p + "post_feedforward_layernorm.weight")
