"""Triton kernels with the signatures of `conveyor.kernels.reference`, one module per kernel.

They run on CUDA tensors, and on CPU tensors only under Triton's interpreter (`TRITON_INTERPRET=1`,
set before `triton` is first imported).
"""

import torch

from conveyor.kernels import AttentionMetadata
from conveyor.kernels.reference import rope_cos_sin_cache
from conveyor.kernels.triton.device import TritonUnavailableError
from conveyor.kernels.triton.fused_moe import fused_moe
from conveyor.kernels.triton.lora import add_lora
from conveyor.kernels.triton.paged_attention import paged_attention
from conveyor.kernels.triton.reshape_and_cache import reshape_and_cache
from conveyor.kernels.triton.rms_norm import fused_add_rms_norm, rms_norm
from conveyor.kernels.triton.rotary_embedding import rotary_embedding
from conveyor.kernels.triton.silu_and_mul import gelu_tanh_and_mul, silu_and_mul


def prepare_metadata(
    meta: AttentionMetadata,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor | None,
    block_size: int,
    num_kv_heads: int,
) -> None:
    """See `conveyor.kernels.reference.prepare_metadata`. The Triton kernels read the metadata tensors on
    the device and derive nothing on the host, so there is nothing to prepare (None)."""
    return None


__all__ = [
    "TritonUnavailableError",
    "add_lora",
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_tanh_and_mul",
    "paged_attention",
    "prepare_metadata",
    "reshape_and_cache",
    "rms_norm",
    "rope_cos_sin_cache",
    "rotary_embedding",
    "silu_and_mul",
]
