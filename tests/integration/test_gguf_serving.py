"""`--quantization gguf`: the embedded SmolLM2 GGUF served from its Q4_1 and Q8_0 blocks. The weights are the
file's values exactly (gguf-py's dequantization is the reference the kernels equal bit for bit), so greedy outputs
equal transformers' on the dequantized float32 model token for token; a file or a start that cannot be served that
way is refused before anything loads, naming the flag or the tensor."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from conveyor.kernels.quant import QuantizedEmbedding, QuantizedLinear
from conveyor.server.engine.builder import build_engine
from conveyor.server.model import loader
from conveyor.server.model.gguf_weights import GGUFError, GGUFWeights
from tests.conformance import assert_greedy_equals_transformers
from tests.integration.conftest import engine_config

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea and the wind that blows over it at night, " * 3,
    "In 1905 Albert Einstein published four papers. " * 12,
]


EXACT_KERNELS = "q-dot,q-dequant@9"  # the methods that compute with the file's exact weights


def engine_with_kernels(kernels: str):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONVEYOR_CPU_KERNELS", kernels)
        return build_engine(engine_config(model={"quantization": "gguf"}))


@pytest.fixture(scope="module")
def quantized_engine():
    return engine_with_kernels(EXACT_KERNELS)


def test_greedy_outputs_equal_transformers_on_the_dequantized_model(quantized_engine, hf_model):
    model = quantized_engine.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.embed_tokens.types == "Q8_0"
    formats = {m.types for m in model.modules() if isinstance(m, QuantizedLinear)}
    assert formats == {"Q4_1", "Q8_0"}  # every layer, and the tied LM head sharing the table's blocks
    ids = [quantized_engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len(ids[-1]) > 100  # prefill rows past the decode kernel's row range
    assert_greedy_equals_transformers(quantized_engine, hf_model, ids, 16, "Q4_1 blocks")


def test_the_weights_stay_the_size_of_the_file(quantized_engine):
    source = loader.resolve_model(None)
    file_bytes = os.path.getsize(source.gguf_path)
    packed = {}
    for module in quantized_engine.model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            packed[module.packed.data_ptr()] = module.packed.numel()
    floats = sum(p.numel() * p.element_size() for p in quantized_engine.model.parameters())
    assert sum(packed.values()) + floats <= file_bytes  # the float32 model is about 540 MB
    summary = loader.describe_weights(quantized_engine.model)
    assert summary.startswith("quantized (Q4_1 x120, Q8_0 x1):"), summary


def _source_config():
    source = loader.converted(loader.resolve_model(None))
    return source, loader.load_config(source)


@pytest.mark.parametrize(
    ("quantization", "device", "backend", "tp", "load_format", "message"),
    [
        ("gguf", "cpu", "torch", 1, "auto", "runs on the CPU kernels"),
        ("gguf", "cpu", "cpu", 2, "auto", "runs on one rank, not --tensor-parallel-size 2"),
        ("gguf", "cpu", "cpu", 1, "dummy", "--load-format dummy loads none"),
    ],
)
def test_a_start_that_cannot_serve_the_blocks_is_refused(
    quantization, device, backend, tp, load_format, message
):
    source, _ = _source_config()
    with pytest.raises(ValueError, match=message):
        loader.check_quantization(quantization, source, torch.device(device), backend, tp, load_format)
    loader.check_quantization(None, source, torch.device(device), backend, tp, load_format)  # the default


def test_a_model_that_is_not_a_gguf_file_is_refused(tmp_path):
    source, _ = _source_config()
    directory = loader.resolve_model(source.path)  # the Hugging Face layout copy: no GGUF file
    with pytest.raises(ValueError, match="is not a GGUF file"):
        loader.check_quantization("gguf", directory, torch.device("cpu"), "cpu", 1)


def test_a_truncated_file_names_itself_or_its_tensor(tmp_path):
    source, config = _source_config()
    broken = tmp_path / "broken.gguf"
    with open(source.gguf_path, "rb") as whole, open(broken, "wb") as part:
        shutil.copyfileobj(whole, part)
        part.truncate(whole.tell() // 2)
    with pytest.raises(GGUFError, match="broken.gguf"):
        weights = GGUFWeights(broken, config)
        for name in weights:  # a reader that maps lazily fails at the first tensor past the end
            weights[name]


def test_dummy_weights_in_a_block_format_run_a_shape_without_its_file(tmp_path):
    """`--load-format dummy --quantization q8_0`: a config-only directory served from random Q8_0 blocks
    (how shapes without a downloadable file are measured as they would serve)."""
    from conveyor.operator import plan
    from conveyor.server.messages import SamplingParams

    assert plan.main(["--model", "smollm2-135m", "--write-config", str(tmp_path)]) == 0
    engine = build_engine(
        engine_config(model={"model": str(tmp_path), "load_format": "dummy", "quantization": "q8_0"})
    )
    layers = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and {m.types for m in layers} == {"Q8_0"}
    assert isinstance(engine.model.embed_tokens, QuantizedEmbedding)
    engine.add_request(engine.make_request("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert len(tokens) == 4
    # 576 values are not a whole number of 256-value K-quant blocks: refused naming the layer.
    with pytest.raises(ValueError, match=r"--quantization q4_k: the embedding table \(49152x576\)"):
        build_engine(
            engine_config(model={"model": str(tmp_path), "load_format": "dummy", "quantization": "q4_k"})
        )
    with pytest.raises(ValueError, match="random weights in that format for --load-format dummy"):
        build_engine(engine_config(model={"quantization": "q4_0"}))
    # int8 quantizes the dummy float weights per channel (any width of whole 32-value groups).
    engine = build_engine(
        engine_config(model={"model": str(tmp_path), "load_format": "dummy", "quantization": "int8"})
    )
    assert {m.types for m in engine.model.modules() if isinstance(m, QuantizedLinear)} == {"INT8"}
    engine.close()
