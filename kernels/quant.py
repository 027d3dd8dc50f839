"""GGUF-quantized weights kept in their blocks, and the layers that compute with them on a CPU.

Decode reads every weight once per step, so on a CPU its speed is bounded by memory bandwidth over the
weights' bytes: a Q4_1 layer is read at about a sixth of its float32 size. A `QuantizedWeight` is a linear
layer's (or an embedding table's) weight as a GGUF file stores it: runs of output rows, each run in one
block format (ggml's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; a fused q/k/v layer of a Q4_K_M file
mixes Q4_K and Q6_K rows). `QuantizedLinear` and `QuantizedEmbedding` compute with it through the C++
kernels of `csrc/quant.cpp`, which dequantize blocks as they read them (their layout and formulas are
documented there). The reference is gguf-py's own dequantization (`QuantizedWeight.dequantize`), which
`csrc/quant.cpp` reproduces bit for bit.

One more format is conveyor's own, `Int8Format.INT8`: per-output-channel symmetric int8, a float32
scale per row (`quantize_int8`, from any float checkpoint at load: `--quantization int8`). Its rows are
4 + in_features bytes; the same three methods compute with it.

A `QuantizedLinear` computes one of three ways: `dot` (decode rows: each weight byte read once, its
values dequantized to float32 in L1), `dequant` (many rows: dequantize, then one float32 matmul), both
with the reference's exact weights, and `int8` (x rounded to int8 per 32 values, integer dot products
with the blocks, as llama.cpp computes; AVX2 builds only; outputs move by x's rounding, about 0.4 %).
`conveyor.kernels.selection` times them per layer shape and row count, as it does the float kernels,
and dispatches by the step's rows (`CONVEYOR_CPU_KERNELS=q-dot,q-dequant@9` keeps the exact ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

# The block formats `csrc/quant.cpp` reads (the others are dequantized at load).
BLOCK_TYPES = frozenset(
    {
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)
METHODS = {"dot": 0, "dequant": 1, "int8": 2}  # csrc/quant.cpp's Method


class Int8Format(IntEnum):
    """conveyor's own format (csrc/quant.cpp's kChannelInt8, an id outside ggml's): a row of K values is
    a float32 scale d then K int8 q, w = q * d (per-output-channel symmetric, |q| <= 127)."""

    INT8 = 1024


WeightFormat = GGMLQuantizationType | Int8Format
FORMATS = BLOCK_TYPES | {Int8Format.INT8}  # every format `csrc/quant.cpp` reads
_INT8_GROUP = 32  # INT8 rows are whole 32-value groups (the int8 method's activation blocks)


def row_bytes(qtype: WeightFormat, in_features: int) -> int:
    """Bytes of one row of `in_features` values in `qtype`. Raises ValueError when the row is not a
    whole number of blocks."""
    values, size = (_INT8_GROUP, _INT8_GROUP) if qtype == Int8Format.INT8 else GGML_QUANT_SIZES[qtype]
    if in_features % values:
        raise ValueError(f"{in_features} values are not a whole number of {qtype.name} blocks of {values}")
    return (4 if qtype == Int8Format.INT8 else 0) + in_features // values * size


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight `[out_features, in_features]` in GGUF block formats (or conveyor's `Int8Format.INT8`).

    segments: runs of output rows, each `(format, blocks)` with blocks `[rows, row_bytes]` uint8 (the
    file's bytes for those rows, e.g. a memory map). Rows can be sliced, split and concatenated (a fused
    q/k/v layer is its three weights' rows in order); values only change by `dequantize`.
    Raises ValueError when a segment's bytes do not match `in_features`.
    """

    segments: tuple[tuple[WeightFormat, torch.Tensor], ...]
    in_features: int

    def __post_init__(self) -> None:
        for qtype, blocks in self.segments:
            if qtype not in FORMATS:
                raise ValueError(f"{qtype.name} is not a block format the CPU kernels read")
            expected = row_bytes(qtype, self.in_features)
            if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != expected:
                raise ValueError(
                    f"{qtype.name} rows of {self.in_features} values are {expected} bytes; got a "
                    f"{blocks.dtype} tensor of shape {tuple(blocks.shape)}"
                )

    @property
    def out_features(self) -> int:
        return sum(blocks.shape[0] for _, blocks in self.segments)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(blocks.numel() for _, blocks in self.segments)

    def type_names(self) -> str:
        """The formats of the rows, in order, each once: `Q4_K+Q6_K`."""
        return "+".join(dict.fromkeys(qtype.name for qtype, _ in self.segments))

    def rows(self, start: int, count: int) -> QuantizedWeight:
        """Rows `[start, start + count)`."""
        segments, first = [], 0
        for qtype, blocks in self.segments:
            lo, hi = max(start - first, 0), min(start + count - first, blocks.shape[0])
            if lo < hi:
                segments.append((qtype, blocks[lo:hi]))
            first += blocks.shape[0]
        return QuantizedWeight(tuple(segments), self.in_features)

    def split(self, sizes: Sequence[int]) -> list[QuantizedWeight]:
        """Consecutive row runs of `sizes` rows (as `torch.Tensor.split` with a list)."""
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.rows(start, size) for start, size in zip(starts, sizes, strict=True)]

    def chunk(self, chunks: int) -> list[QuantizedWeight]:
        """`chunks` equal row runs."""
        return self.split([self.out_features // chunks] * chunks)

    @staticmethod
    def cat(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """The rows of `parts` in order (all with the same in_features). Raises ValueError otherwise."""
        if len({part.in_features for part in parts}) != 1:
            raise ValueError("concatenated weights must have the same in_features")
        return QuantizedWeight(tuple(s for part in parts for s in part.segments), parts[0].in_features)

    def dequantize(self) -> torch.Tensor:
        """`[out_features, in_features]` float32, by gguf-py's dequantization (the reference); INT8
        rows as `q * d` in float32."""
        rows = []
        for qtype, blocks in self.segments:
            if qtype == Int8Format.INT8:
                scale = blocks[:, :4].contiguous().view(torch.float32)  # [rows, 1]
                rows.append(blocks[:, 4:].contiguous().view(torch.int8).float() * scale)
            else:
                rows.append(
                    torch.from_numpy(gguf_dequantize(blocks.numpy(), qtype)).reshape(-1, self.in_features)
                )
        return torch.cat(rows)

    def pack(self) -> torch.Tensor:
        """The one uint8 tensor the C++ kernels read (layout in `csrc/quant.cpp`); a copy of the blocks.
        Needs the C++ CPU kernels (`cpu.load_library`)."""
        return torch.ops.conveyor_quant.pack(
            [int(qtype) for qtype, _ in self.segments],
            [blocks.contiguous() for _, blocks in self.segments],
            self.in_features,
        )


class QuantizedLinear(nn.Module):
    """`y = x @ W.T + bias` with W a `QuantizedWeight` packed for the C++ kernels (`csrc/quant.cpp`).

    x: `[num_tokens, in_features]` float32 or bfloat16 -> `[num_tokens, out_features]` in x's dtype, sums
    in float32. method: `dot` or `dequant` (see the module docstring); `with_method` makes the other one
    over the same packed bytes. Needs the C++ CPU kernels. Raises ValueError for an unknown method.
    `int8` rounds x to int8 per 32 values first (see the module docstring).
    """

    def __init__(
        self,
        weight: QuantizedWeight | None,
        bias: torch.Tensor | None = None,
        method: str = "dot",
        *,
        packed: torch.Tensor | None = None,
        shape: tuple[int, int] | None = None,
        types: str = "",
    ) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method must be one of {sorted(METHODS)}, not {method!r}")
        if weight is not None:
            packed, shape, types = weight.pack(), weight.shape, weight.type_names()
        assert packed is not None and shape is not None
        self.out_features, self.in_features = shape
        self.types, self.method = types, method
        self.register_buffer("packed", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def with_method(self, method: str) -> QuantizedLinear:
        """The same layer computing by `method`, sharing the packed weight and bias."""
        return QuantizedLinear(
            None,
            self.bias,
            method,
            packed=self.packed,
            shape=(self.out_features, self.in_features),
            types=self.types,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.conveyor_quant.linear(x, self.packed, bias, METHODS[self.method])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, weight={self.types}, "
            f"method={self.method}"
        )


class QuantizedEmbedding(nn.Module):
    """An embedding table kept quantized: ids `[num_tokens]` int64 -> `[num_tokens, embedding_dim]`
    float32 (the rows dequantized; the caller casts). `packed` may be shared with a tied LM head's
    `QuantizedLinear`. Raises RuntimeError for an id outside the table."""

    def __init__(self, linear: QuantizedLinear) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = linear.out_features, linear.in_features
        self.types = linear.types
        self.register_buffer("packed", linear.packed, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.conveyor_quant.embedding(self.packed, input_ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, weight={self.types}"


# Where each format's float16 scale fields sit in its block (byte offset, count), and the largest |q|
# times sub-scale a value of the block can reach (for `random_weight`'s value range).
_SCALE_FIELDS = {
    GGMLQuantizationType.Q4_0: (0, 1, 8),
    GGMLQuantizationType.Q4_1: (0, 2, 15),
    GGMLQuantizationType.Q5_0: (0, 1, 16),
    GGMLQuantizationType.Q5_1: (0, 2, 31),
    GGMLQuantizationType.Q8_0: (0, 1, 128),
    GGMLQuantizationType.Q4_K: (0, 2, 15 * 63),
    GGMLQuantizationType.Q5_K: (0, 2, 31 * 63),
    GGMLQuantizationType.Q6_K: (208, 1, 32 * 128),
}


def random_weight(
    qtype: GGMLQuantizationType,
    out_features: int,
    in_features: int,
    generator: np.random.Generator,
    value_range: float = 1e-3,
) -> QuantizedWeight:
    """Random blocks of `qtype` for a `[out_features, in_features]` weight: every quantized bit random,
    float16 scales (and mins) random within a factor of 2, so the values stay within about
    ±`value_range`. For `--load-format dummy` shapes and for tests. Raises ValueError when in_features
    is not a whole number of blocks."""
    values, size = GGML_QUANT_SIZES[qtype]
    row_bytes(qtype, in_features)  # raises for a partial block
    blocks = generator.integers(0, 256, size=(out_features, in_features // values, size), dtype=np.uint8)
    offset, count, reach = _SCALE_FIELDS[qtype]
    scales = generator.uniform(0.5, 1.0, size=(*blocks.shape[:2], count)) * (value_range / reach)
    if count == 2 and qtype in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1):
        scales[..., 1] = -value_range * generator.uniform(0.5, 1.0, size=blocks.shape[:2])  # the min
    blocks[..., offset : offset + 2 * count] = scales.astype(np.float16).view(np.uint8)
    return QuantizedWeight(((qtype, torch.from_numpy(blocks.reshape(out_features, -1))),), in_features)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """`weight` `[out_features, in_features]` (any float dtype) as `Int8Format.INT8`: per output row,
    d = max|w| / 127 and q = round(w / d) (to nearest even), so |w - q * d| <= d / 2 (the per-channel
    symmetric scheme of LLM.int8's vector-wise quantization, Dettmers et al. 2022, without its outlier
    split). An all-zero row gets d = 0. Raises ValueError when in_features is not a whole number of
    32-value groups."""
    out_features, in_features = weight.shape
    blocks = torch.empty(out_features, row_bytes(Int8Format.INT8, in_features), dtype=torch.uint8)
    # In chunks of rows (8 MiB of float32 each), so the float temporaries stay small beside a 1 GB table.
    chunk = max(1, (8 << 20) // (4 * in_features))
    for start in range(0, out_features, chunk):
        w = weight[start : start + chunk].detach().float()
        scale = w.abs().amax(dim=1, keepdim=True) / 127.0
        q = torch.round(w / torch.where(scale == 0, 1.0, scale)).clamp_(-127, 127).to(torch.int8)
        blocks[start : start + chunk, :4] = scale.view(torch.uint8)
        blocks[start : start + chunk, 4:] = q.view(torch.uint8)
    return QuantizedWeight(((Int8Format.INT8, blocks),), in_features)


def int8_supported() -> bool:
    """True when the C++ kernels were built with the int8 method (AVX2 and FMA)."""
    return bool(torch.ops.conveyor_quant.int8_dot())


def reference_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`QuantizedLinear`'s result by the reference: gguf-py's dequantized weight in a float32 matmul,
    cast to x's dtype."""
    return torch.nn.functional.linear(x.float(), weight.dequantize(), bias).to(x.dtype)
