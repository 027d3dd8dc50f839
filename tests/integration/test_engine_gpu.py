"""The engine's CUDA path (marker `gpu`, skipped without a CUDA device): the compiled Triton kernels
inside the real model, and the KV pool sized by profiling free GPU memory."""

from __future__ import annotations

import json

import pytest
import torch

from conveyor.operator import catalog
from conveyor.server.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from conveyor.server.engine.request import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GiB = 1 << 30
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return torch.device("cuda")


def test_greedy_on_cuda_equals_transformers_in_float32(cuda, hf_greedy):
    from conveyor.server.engine.engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(dtype="float32", max_model_len=1024),
            cache=CacheConfig(kv_cache_memory=1 * GiB),
            device=DeviceConfig(device="cuda"),
        )
    )
    assert engine.device.type == "cuda"
    prompts = {f"p{i}": engine.tokenizer(p)["input_ids"] for i, p in enumerate(PROMPTS)}
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, SamplingParams(temperature=0.0, max_tokens=24))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    for request_id, ids in prompts.items():
        assert tokens[request_id] == hf_greedy(ids, 24), request_id


def test_profiled_kv_pool_is_what_utilization_leaves_after_weights(cuda, tmp_path):
    from conveyor.server.engine.engine import LLMEngine

    (tmp_path / "config.json").write_text(json.dumps(catalog.hf_config("smollm2-135m")))
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(tmp_path), load_format="dummy", dtype="bfloat16", max_model_len=2048),
            cache=CacheConfig(gpu_memory_utilization=0.5),
            device=DeviceConfig(device="cuda"),
        )
    )
    total = torch.cuda.mem_get_info()[1]
    weights = catalog.NUM_PARAMS["smollm2-135m"] * 2
    usable = int(total * 0.5)
    # The pool is usable memory less the weights and a profiled activation peak (well under 2 GiB
    # for this model at the default 2048-token step budget).
    assert usable - weights - 2 * GiB < engine.kv_pool_bytes < usable - weights
    assert engine.num_kv_blocks == engine.kv_pool_bytes // (engine.kv_bytes_per_token * 16)
