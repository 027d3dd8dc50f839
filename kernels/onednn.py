"""Linear layers with weights pre-packed once for oneDNN: the CPU path's matmuls.

`torch.nn.functional.linear` on a CPU tensor hands the BLAS a plain row-major weight: in bfloat16
oneDNN reorders it into its blocked (VNNI) layout on every call, in float32 MKL's sgemm packs panels of it
on every call. At decode batch sizes that costs about as much as the matmul itself. Reordering once at
load, as PyTorch's own inductor does when it freezes a CPU graph (`torch.ops.mkldnn._reorder_linear_weight`
+ `_linear_pointwise`), makes a batch-16 decode step's matmuls about 1.45x faster in bfloat16 on an
AVX512-BF16 CPU, and in float32 1.3-2.3x per layer and 3.6x for the 49,152-row LM head (a 2-core AMD EPYC
with AVX-512, measured on the embedded model's shapes; `make bench` shows the end-to-end effect).

float32 and bfloat16 are packed (bfloat16 only where the CPU computes it natively); float16 packing needs
AVX512-FP16. Packed float32 sums in a different order than MKL, so results move by float32 rounding
(about 1e-6 relative); the float32 tests compare greedy tokens with transformers token for token through
this path.
"""

from __future__ import annotations

import torch
from torch import nn

# The batch size oneDNN picks the packed layout for; 16-128 give the same speed at every size measured.
PACK_BATCH_SIZE_HINT = 16


def cpu_bf16_native() -> bool:
    """True when this CPU computes bfloat16 natively (AVX512_BF16 or AMX, as PyTorch's cpuinfo reads
    them) and oneDNN supports it. Elsewhere oneDNN emulates bfloat16 (on AVX2, or AVX-512 without
    AVX512_BF16, where it still reports bf16 support) at a fraction of float32's speed."""
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return native and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True when weights of `dtype` on `device` can be pre-packed here: on a CPU with oneDNN, float32,
    and bfloat16 where the CPU computes it natively."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_bf16_native())


class PackedLinear(nn.Module):
    """`y = x @ weight.T + bias` with `weight` held in oneDNN's packed layout.

    x: `[num_tokens, in_features]` -> `[num_tokens, out_features]`, float32 or bfloat16 as the weight. The packed weight
    is an opaque oneDNN tensor: it has no `state_dict` entry and cannot be moved or cast; build the
    module after the weights are final (see `conveyor.kernels.selection`).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach(), PACK_BATCH_SIZE_HINT
        )
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"
