"""The engine's CUDA path (marker `gpu`, skipped without a CUDA device): the compiled Triton kernels
inside the real model, and the KV pool sized by profiling free GPU memory."""

from __future__ import annotations

import json

import pytest
import torch

from conveyor.operator import catalog
from conveyor.server.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from conveyor.server.messages import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False"
    ),
]

GiB = 1 << 30
VOCAB = 512


def _random_llama(directory) -> None:
    """A random 4-layer Llama (8 query heads, 2 KV heads, head_dim 32) and a word-level tokenizer of
    its vocabulary, saved in Hugging Face layout: the real loader path, no model download."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=500000.0,
        # Peaked logits: greedy ties would test float rounding instead of the kernels.
        initializer_range=0.2,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1")
    tokenizer.save_pretrained(directory)


def test_greedy_on_cuda_equals_transformers_in_float32(tmp_path):
    """Decodes, full prefills and chunked prefills (a 64-token step budget splits the 300-token
    prompt) through the compiled Triton kernels give transformers' greedy tokens (CPU, float32)."""
    import transformers

    from conveyor.server.config import SchedulerConfig
    from conveyor.server.engine.builder import build_engine

    _random_llama(tmp_path)
    engine = build_engine(
        EngineConfig(
            model=ModelConfig(model=str(tmp_path), dtype="float32", max_model_len=1024),
            cache=CacheConfig(kv_cache_memory=GiB // 4),
            scheduler=SchedulerConfig(max_num_batched_tokens=64),
            device=DeviceConfig(device="cuda"),
        )
    )
    assert engine.device.type == "cuda"
    generator = torch.Generator().manual_seed(1)
    prompts = {f"p{n}": torch.randint(2, VOCAB, (n,), generator=generator).tolist() for n in (5, 17, 40, 300)}
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for request_id, ids in prompts.items():
        engine.add_request(engine.make_request(request_id, ids, params))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for request_id, ids in prompts.items():
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert tokens[request_id] == expected[0, len(ids) :].tolist(), request_id


def test_profiled_kv_pool_is_what_utilization_leaves_after_weights(tmp_path):
    from conveyor.server.engine.builder import build_engine

    (tmp_path / "config.json").write_text(json.dumps(catalog.hf_config("smollm2-135m")))
    engine = build_engine(
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
