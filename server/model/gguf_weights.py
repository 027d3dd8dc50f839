"""A GGUF file's tensors under transformers' names, the linear layers' weights kept in their quantized blocks.

The tensors are read with gguf-py's `GGUFReader` (a memory map of the file); names map to transformers'
checkpoint names through transformers' own GGUF tables (`get_gguf_hf_weights_map`, on a model built on
the meta device, so nothing is allocated), and the per-architecture fixes transformers applies when it
dequantizes (llama.cpp's permuted q/k rows, Gemma's `w - 1` norms: its `TENSOR_PROCESSORS`) are applied
here too: to the values of float tensors, and to the row order of quantized ones (a processor that does
more than reorder rows is refused for a quantized tensor, and that tensor dequantized instead).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from conveyor.kernels.quant import BLOCK_TYPES, QuantizedWeight

logger = logging.getLogger(__name__)

FLOAT_TYPES = ("F32", "F16", "BF16")


class GGUFError(ValueError):
    """A GGUF file that cannot be read, or a tensor in it that does not fit the model (named)."""


class GGUFWeights(Mapping):
    """`name -> torch.Tensor | QuantizedWeight` for the GGUF file at `path`, read lazily from its memory
    map. Two-dimensional `*.weight` tensors in a format `kernels.quant` reads stay a `QuantizedWeight`
    (their bytes; `[out_features, in_features]`); every other tensor is float32 (gguf-py's
    dequantization, as transformers loads it). Raises GGUFError for a file gguf-py cannot read (e.g.
    truncated) or one whose architecture transformers cannot map.
    """

    def __init__(self, path: str | Path, hf_config) -> None:
        from gguf import GGUFReader
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self.path = Path(path)
        try:
            self.reader = GGUFReader(str(self.path))
        except (ValueError, OSError, IndexError, KeyError) as exc:
            raise GGUFError(f"{self.path.name} is not a readable GGUF file: {exc}") from exc
        field = self.reader.fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
        config = hf_config.to_dict()
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config)
        try:
            names = get_gguf_hf_weights_map(skeleton, self.processor)
        except NotImplementedError as exc:
            raise GGUFError(f"{self.path.name}: {exc}") from exc
        self._tensors = {}
        for tensor in self.reader.tensors:
            if tensor.name in names:
                self._tensors[names[tensor.name]] = tensor
        self.dequantized: list[str] = []  # quantized tensors in formats the kernels do not read

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __getitem__(self, name: str) -> torch.Tensor | QuantizedWeight:
        tensor = self._tensors[name]
        qtype = tensor.tensor_type
        shape = [int(n) for n in reversed(tensor.shape)]  # GGUF lists the fastest dimension first
        try:
            if qtype.name not in FLOAT_TYPES and len(shape) == 2 and name.endswith(".weight"):
                if qtype in BLOCK_TYPES:
                    weight = self._quantized(tensor, shape)
                    if weight is not None:
                        return weight
                self.dequantized.append(f"{tensor.name} ({qtype.name})")
            return self._dequantized(tensor, shape)
        except (ValueError, IndexError) as exc:
            raise GGUFError(f"{self.path.name}: tensor {tensor.name} ({qtype.name}, {shape}): {exc}") from exc

    def _dequantized(self, tensor, shape: list[int]) -> torch.Tensor:
        from gguf.quants import dequantize

        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        values = self.processor.process(weights=values, name=tensor.name).weights
        return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the memory map is read-only

    def _quantized(self, tensor, shape: list[int]) -> QuantizedWeight | None:
        """The tensor's blocks in transformers' row order; None when transformers' processing of it
        does more than reorder rows (then its values are what counts: it is dequantized)."""
        blocks = np.asarray(tensor.data).reshape(shape[0], -1)
        # The processor's reordering, found by processing the row numbers (a float column).
        rows = np.arange(shape[0], dtype=np.float64).reshape(shape[0], 1)
        order = np.asarray(self.processor.process(weights=rows, name=tensor.name).weights).reshape(-1)
        if order.shape != (shape[0],) or not np.array_equal(np.sort(order), rows[:, 0]):
            return None
        blocks = blocks[order.astype(np.int64)]  # a copy: the file's memory map is read-only
        return QuantizedWeight(((tensor.tensor_type, torch.from_numpy(blocks)),), shape[1])
