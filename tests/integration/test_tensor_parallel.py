"""Tensor parallelism on the CPU (gloo ranks, float32): a sharded engine's greedy tokens equal TP = 1's,
token for token, through batching, chunked prefill, prefix caching and preemption, for dense models and
mixtures of experts (experts sliced, or whole experts per rank); a size that does not split the model
is refused. (The server's side, a killed rank, is in tests/e2e/test_tensor_parallel_server.py.)"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.slow

MiB = 1 << 20
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colours:",
    "Translate to French: the cat sleeps on the warm windowsill while the rain falls outside.",
    "Write a haiku about the sea.",
]
# Run one after the other after PROMPTS: the second reuses the first's cached prefix blocks.
SHARED_PREFIX = (
    "You are a helpful assistant. Answer briefly and precisely, in one sentence, without any "
    "preamble, and say so when you do not know. Question: "
)
PREFIX_PROMPTS = [
    SHARED_PREFIX + "what is two plus two?",
    SHARED_PREFIX + "what is the boiling point of water?",
]


def _pool_bytes(model: str | None, tp: int, num_kv_blocks: int) -> int:
    """A --kv-cache-memory of exactly `num_kv_blocks` 16-token blocks on each rank."""
    from conveyor.server import capacity
    from conveyor.server.model import loader
    from conveyor.server.model.models.llama import ModelShape

    shape = ModelShape.from_hf_config(loader.load_config(loader.converted(loader.resolve_model(model))))
    per_token = capacity.kv_bytes_per_token(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, "float32", tp
    )
    return num_kv_blocks * 16 * per_token


def _greedy(
    model: str | None,
    tp: int,
    num_kv_blocks: int,
    max_model_len: int,
    device: str = "cpu",
    expert_parallel: bool = False,
    **scheduler,
):
    """Greedy tokens (32 each, EOS ignored) of PROMPTS, all at once, then of PREFIX_PROMPTS one after the
    other, through one engine; also the preemptions and prefix-cache hits (tokens) it saw, its start-up
    and mean step seconds."""
    from conveyor.server.config import (
        CacheConfig,
        DeviceConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from conveyor.server.engine.builder import build_engine
    from conveyor.server.messages import SamplingParams

    start = time.monotonic()
    engine = build_engine(
        EngineConfig(
            model=ModelConfig(model=model, dtype="float32", max_model_len=max_model_len),
            cache=CacheConfig(kv_cache_memory=_pool_bytes(model, tp, num_kv_blocks), block_size=16),
            scheduler=SchedulerConfig(**scheduler),
            parallel=ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=expert_parallel),
            device=DeviceConfig(device=device),
        )
    )
    startup = time.monotonic() - start
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    cached = 0

    def run(prompts: dict[str, str]) -> None:
        nonlocal cached
        for request_id, prompt in prompts.items():
            engine.add_request(engine.make_request(request_id, engine.tokenizer(prompt)["input_ids"], params))
            tokens[request_id] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                cached += out.num_cached_tokens if out.finished else 0

    try:
        assert engine.num_kv_blocks == num_kv_blocks
        step_start = time.monotonic()
        run({f"batch-{i}": p for i, p in enumerate(PROMPTS)})
        preempted = sum(s.num_preempted for s in engine.stats.recent_steps)
        for i, prompt in enumerate(PREFIX_PROMPTS):
            run({f"prefix-{i}": prompt})
        step_seconds = (time.monotonic() - step_start) / engine.stats.num_steps
        assert engine.kv_cache.num_free_blocks == num_kv_blocks  # nothing leaked on any path
        return tokens, preempted, cached, startup, step_seconds
    finally:
        engine.close()


def test_embedded_model_at_tp3_equals_tp1_token_for_token(capsys: pytest.CaptureFixture[str]) -> None:
    """SmolLM2-135M (9 query heads, 3 KV heads) split over 3 ranks, one KV head each: a 24-token step
    budget chunks the prompts, the shared prefix hits the cache, and 10 blocks for 6 sequences force
    preemptions; the tokens equal TP = 1's under the same pressure."""
    kwargs = {"num_kv_blocks": 10, "max_model_len": 160, "max_num_batched_tokens": 24, "max_num_seqs": 6}
    tp1 = _greedy(None, 1, **kwargs)
    tp3 = _greedy(None, 3, **kwargs)
    assert tp3[0] == tp1[0]
    assert tp1[1] > 0 and tp3[1] > 0, "the pool was meant to force preemptions"
    assert tp3[2] > 0, "the shared prefix was meant to hit the cache"
    with capsys.disabled():
        print(
            f"\nembedded model: TP=1 start {tp1[3]:.1f} s, step {tp1[4] * 1e3:.0f} ms; "
            f"TP=3 start {tp3[3]:.1f} s, step {tp3[4] * 1e3:.0f} ms; {tp1[1]} / {tp3[1]} preemptions"
        )


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_with_8_heads_and_2_kv_heads_equals_tp1(save_tiny_llama, tp: int) -> None:
    """A random 2-layer Llama, 8 query heads and 2 KV heads: at TP = 2 each rank has one KV head; at
    TP = 4 each KV head is replicated on two ranks (vLLM's rule). Same tokens as TP = 1."""
    model = save_tiny_llama("llama-8h-2kv", num_attention_heads=8, num_key_value_heads=2)
    kwargs = {"num_kv_blocks": 16, "max_model_len": 256, "max_num_batched_tokens": 24, "max_num_seqs": 6}
    tp1 = _greedy(model, 1, **kwargs)
    tpn = _greedy(model, tp, **kwargs)
    assert tpn[0] == tp1[0]
    assert tpn[1] > 0 and tpn[2] > 0


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-sliced", "expert-parallel"])
def test_mixture_of_experts_over_two_ranks_equals_tp1(save_tiny_llama, expert_parallel: bool) -> None:
    """A random 2-layer Qwen2-MoE (8 experts, top-2, a shared expert) over 2 gloo ranks: every expert
    sliced in two, or (--enable-expert-parallel) 4 whole experts per rank running only the pairs routed
    to them; the shared expert sliced either way. Same tokens as TP = 1, through chunked prefill,
    prefix caching and preemption."""
    import transformers

    model = save_tiny_llama(
        "qwen2-moe-8e",
        config_class=transformers.Qwen2MoeConfig,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        norm_topk_prob=False,
    )
    kwargs = {"num_kv_blocks": 16, "max_model_len": 256, "max_num_batched_tokens": 24, "max_num_seqs": 6}
    tp1 = _greedy(model, 1, **kwargs)
    tp2 = _greedy(model, 2, expert_parallel=expert_parallel, **kwargs)
    assert tp2[0] == tp1[0]
    assert tp2[1] > 0 and tp2[2] > 0


def test_expert_parallelism_that_does_not_divide_the_experts_is_refused(save_tiny_llama) -> None:
    import transformers

    model = save_tiny_llama(
        "qwen3-moe-6e",
        config_class=transformers.Qwen3MoeConfig,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
    )
    with pytest.raises(ValueError, match="--tensor-parallel-size 4 does not divide the model's 6 experts"):
        _greedy(model, 4, expert_parallel=True, num_kv_blocks=16, max_model_len=256)


@pytest.mark.gpu
def test_nccl_ranks_on_two_gpus_equal_tp1(save_tiny_llama) -> None:
    """The same equality over NCCL, one rank per CUDA device (float32)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA devices, torch finds {torch.cuda.device_count()}")
    model = save_tiny_llama("llama-8h-2kv-cuda", num_attention_heads=8, num_key_value_heads=2)
    kwargs = {"num_kv_blocks": 16, "max_model_len": 256, "max_num_batched_tokens": 24, "max_num_seqs": 6}
    tp1 = _greedy(model, 1, device="cuda", **kwargs)
    tp2 = _greedy(model, 2, device="cuda", **kwargs)
    assert tp2[0] == tp1[0]


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_both() -> None:
    from conveyor.server.config import EngineConfig, ParallelConfig
    from conveyor.server.engine.builder import build_engine

    with pytest.raises(
        ValueError, match=r"--tensor-parallel-size 2 does not divide the model's 9 attention heads"
    ):
        build_engine(EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2)))
