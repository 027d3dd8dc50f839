"""Quantized weights against the float32 model they come from (`conveyor.benchmarks.quality`, the table
`make bench` reports): on fixed texts, the mean KL divergence of next-token distributions from
transformers' float32 model and the share of positions whose most likely token agrees, each row inside a
stated bound. Measured on a 2-core AVX2 EPYC: gguf exact 0 nats / 100 %, gguf with int8 activations
0.0034 / 97.4 %, int8 weights 0.0049 / 96.5 %, int8 weights and activations 0.0078 / 95.4 %."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.benchmarks import quality
from conveyor.kernels.quant import QuantizedEmbedding, QuantizedLinear
from conveyor.server.engine.builder import build_engine
from conveyor.server.model import loader
from tests.integration.conftest import engine_config

# label -> (largest mean KL in nats, smallest top-1 agreement)
BOUNDS = {
    "gguf": (1e-6, 1.0),  # the file's exact values: only float32 summation order differs
    "gguf, int8 activations": (0.01, 0.95),
    "int8": (0.015, 0.94),
    "int8, int8 activations": (0.02, 0.93),
}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return {r["label"]: r for r in quality.measure()}


def test_each_quantization_stays_within_its_bound(results):
    assert set(results) == set(BOUNDS)
    for label, (max_kl, min_agreement) in BOUNDS.items():
        r = results[label]
        assert r["positions"] > 300
        assert r["kl_nats"] < max_kl and r["top1_agreement"] >= min_agreement, r
    assert results["int8"]["weights"].startswith("quantized (INT8 x"), results["int8"]["weights"]
    assert results["gguf"]["weights"].startswith("quantized (Q4_1 x120, Q8_0 x1)")
    table = quality.table(list(results.values()))
    assert "| int8, int8 activations | q-int8 |" in table and table.count("\n") == len(BOUNDS) + 1


def test_int8_at_load_quantizes_every_layer_and_the_table():
    """`--quantization int8` on the embedded model: every linear layer, the embedding table and the tied
    LM head (sharing it) are INT8; the weights take about a quarter of float32's."""
    engine = build_engine(engine_config(model={"quantization": "int8"}))
    model = engine.model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    # One packed weight per layer (the kernel selection may hold it under several methods).
    assert len({m.packed.data_ptr() for m in layers}) == 30 * 4 + 1 and {m.types for m in layers} == {"INT8"}
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert model.embed_tokens.packed.data_ptr() in {m.packed.data_ptr() for m in layers}  # the tied head
    formats, weight_bytes = loader.weights_info(model)
    assert formats == "INT8" and weight_bytes < 134_515_008 * 1.01  # float32: 4 bytes per parameter
    assert engine.limits.quantization == "int8" and engine.limits.weights == "INT8"
    engine.close()


def test_int8_weights_are_quantized_as_the_checkpoint_is_read():
    """`--quantization int8` quantizes each weight as it is read from the checkpoint (`loader.Int8OnRead`),
    never holding the float model: the fused q/k/v layer holds exactly the bytes of its three float
    weights quantized together, the tied table those of the checkpoint's table, and norms stay float.
    A width that is not whole 32-value groups is refused naming the weight."""
    import torch

    from conveyor.kernels import select_backend
    from conveyor.kernels.quant import quantize_int8

    source = loader.converted(loader.resolve_model(None))
    config = loader.load_config(source)
    _, ops = select_backend("cpu", "cpu")
    model = loader.load_model(source, config, torch.float32, torch.device("cpu"), ops, "auto", None, "int8")
    checkpoint = loader.SafetensorsWeights(Path(source.path))
    attn = "model.layers.3.self_attn."
    fused = torch.cat([checkpoint[attn + f"{n}_proj.weight"] for n in "qkv"])  # three segments of rows
    dequantize = torch.ops.conveyor_quant.dequantize
    held = dequantize(model.layers[3].self_attn.qkv_proj.packed)
    assert torch.equal(held, dequantize(QuantizedLinear(quantize_int8(fused)).packed))
    table = dequantize(QuantizedLinear(quantize_int8(checkpoint["lm_head.weight"])).packed)  # saved tied
    assert torch.equal(dequantize(model.embed_tokens.packed), table)
    assert model.lm_head.packed is model.embed_tokens.packed
    assert torch.equal(model.norm.weight, checkpoint["model.norm.weight"].float())
    reader = loader.Int8OnRead({"model.layers.0.mlp.down_proj.weight": torch.ones(4, 40)})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight \(4, 40\): 40 values"):
        reader["model.layers.0.mlp.down_proj.weight"]
