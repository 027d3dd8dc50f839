"""A two-layer Llama of random weights (any of the decoder's features switched on) on the reference kernels, and its logits for one prompt: the
fixture the linear-layer packing tests compare packed and plain models on."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from conveyor.kernels import AttentionMetadata, KernelBackend
from conveyor.kernels import reference as ref
from conveyor.server.model.models.llama import LlamaForCausalLM, ModelShape

NUM_KV_HEADS, HEAD_DIM = 2, 16


def tiny_llama(tie: bool, dtype: torch.dtype, ops: KernelBackend = ref, **features: Any) -> LlamaForCausalLM:
    """Weights from seed 0, so two calls build the same model; parameters cast to `dtype`; `ops` the
    kernel backend (default the torch reference); `features`: `ModelShape` fields to switch on (qk_norm,
    sandwich_norms, sliding_window with sliding_layers, ...)."""
    shape = ModelShape(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attention_bias=True,
    )
    shape = dataclasses.replace(shape, **features)
    torch.manual_seed(0)
    model = LlamaForCausalLM(shape, ops)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model.eval()


def forward_logits(model: LlamaForCausalLM, dtype: torch.dtype, num_tokens: int = 10) -> torch.Tensor:
    """Float32 logits `[num_tokens, vocab_size]` of a prefill of `num_tokens` fixed random ids."""
    block_size = 16
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )
    ids = torch.randint(0, 300, (num_tokens,), generator=torch.Generator().manual_seed(1))
    cache_shape = (1, block_size, NUM_KV_HEADS, HEAD_DIM)
    caches = [
        (torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype))
        for _ in range(len(model.layers))
    ]
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(num_tokens), caches, meta)).float()
