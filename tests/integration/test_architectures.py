"""Each supported architecture, as a small random model in Hugging Face layout loaded from a local
directory (`conveyor serve MODEL`): greedy tokens equal transformers' own implementation's."""

from __future__ import annotations

import pytest
import torch

from conveyor.server.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from conveyor.server.engine.builder import build_engine
from tests.conformance import assert_greedy_equals_transformers

pytestmark = pytest.mark.slow

PROMPTS = ["Hello there", "The capital of France is", "A long prompt " * 12]
WINDOW = 16  # shorter than the prompts: the window bites in prefill, chunked prefill and decode
SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # Peaked logits: greedy ties would test float rounding instead of the model code.
    initializer_range=0.2,
)


def _config(kind: str):
    import transformers

    if kind in ("llama", "llama-sharded"):
        return transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True, rope_theta=500000.0)
    if kind == "llama3-rope-scaling":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return transformers.LlamaConfig(**SHAPE, rope_theta=500000.0, rope_scaling=scaling)
    if kind == "mistral":
        return transformers.MistralConfig(**SHAPE, sliding_window=None)
    if kind == "mistral-window":  # every layer slides
        return transformers.MistralConfig(**SHAPE, sliding_window=WINDOW)
    if kind == "gemma2":  # soft-capped attention scores and logits, every other layer sliding
        return transformers.Gemma2Config(
            **SHAPE,
            head_dim=48,
            query_pre_attn_scalar=64,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=10.0,
        )
    if kind == "qwen2":  # q/k/v projections with bias
        return transformers.Qwen2Config(**SHAPE, tie_word_embeddings=False)
    if kind == "qwen3":  # per-head q/k RMSNorm; head_dim 48, not hidden_size / heads = 32
        return transformers.Qwen3Config(**SHAPE, head_dim=48, tie_word_embeddings=True)
    if kind == "qwen3-yarn":  # YaRN rope scaling past a 128-token original context
        yarn = {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 1e6,
        }
        return transformers.Qwen3Config(**SHAPE, head_dim=48, rope_parameters=yarn)
    if kind == "granite":  # every multiplier away from 1, and biases on q/k/v and o
        return transformers.GraniteConfig(
            **SHAPE,
            embedding_multiplier=6.0,
            residual_multiplier=0.5,
            attention_multiplier=0.05,
            logits_scaling=4.0,
            attention_bias=True,
        )
    if kind == "phi3":  # fused qkv_proj and gate_up_proj in the checkpoint
        return transformers.Phi3Config(**SHAPE, pad_token_id=0)
    if kind == "phi3-longrope":  # LongRoPE past a 12-token original context, 3/4 of each head rotated
        return transformers.Phi3Config(**SHAPE, **_longrope(12), pad_token_id=0, partial_rotary_factor=0.75)
    if kind == "llama-dynamic":  # dynamic NTK: the base grows with sequences past 12 tokens
        return transformers.LlamaConfig(
            **{**SHAPE, "max_position_embeddings": 12}, rope_scaling={"rope_type": "dynamic", "factor": 48.0}
        )
    if kind == "gemma":  # GeGLU, (1 + w) norms, scaled embeddings, head_dim 48
        return transformers.GemmaConfig(**SHAPE, head_dim=48)
    if (
        kind == "gemma3"
    ):  # sandwich norms, qk-norm, query_pre_attn_scalar, rotary per layer type (linear global)
        return transformers.Gemma3TextConfig(
            **SHAPE,
            head_dim=48,
            query_pre_attn_scalar=64,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        )
    experts = dict(num_experts_per_tok=2)
    if kind == "qwen3_moe":  # qk-norm, renormalized top-k; layer 1 of 3 keeps a dense MLP
        return transformers.Qwen3MoeConfig(
            **{**SHAPE, "num_hidden_layers": 3},
            **experts,
            num_experts=8,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    if kind == "qwen2_moe":  # q/k/v biases, a gated shared expert, raw top-k probabilities
        return transformers.Qwen2MoeConfig(
            **SHAPE,
            **experts,
            num_experts=8,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
        )
    if kind == "mixtral":  # top-2 of 4 experts of intermediate_size, every layer sliding
        return transformers.MixtralConfig(**SHAPE, **experts, num_local_experts=4, sliding_window=WINDOW)
    if kind == "olmo2":  # q and k normed over all heads at once; norms after attention and MLP only
        return transformers.Olmo2Config(**SHAPE)
    if kind == "olmoe":  # q and k normed over all heads at once; top-4
        return transformers.OlmoeConfig(**SHAPE, num_experts=8, num_experts_per_tok=4, norm_topk_prob=False)
    raise ValueError(kind)


def _longrope(original: int) -> dict:
    """Phi3Config arguments of LongRoPE past `original` tokens, for heads of 32 dims rotating 24: short
    and long factors far apart, so K/V computed with the wrong ones changes the tokens."""
    return dict(
        original_max_position_embeddings=original,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(12)],
            "long_factor": [2.0 + 1.5 * i for i in range(12)],
            "partial_rotary_factor": 0.75,
        },
    )


class _FreshModelPerPrompt:
    """transformers' dynamic NTK keeps the longest length it has seen across `generate` calls: each
    prompt gets the saved model afresh, as a server's sequences do not share that state."""

    def __init__(self, path) -> None:
        self.path = path

    def generate(self, *args, **kwargs):
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        return model.generate(*args, **kwargs)


def _engine(path, backend: str, max_model_len: int = 512, **model):
    """The engine on the model saved at `path` in float32, the `backend` kernels, 32-token steps (chunked
    prefill bites), a 16 MiB KV cache; `model`: more ModelConfig fields."""
    return build_engine(
        EngineConfig(
            model=ModelConfig(model=str(path), dtype="float32", max_model_len=max_model_len, **model),
            cache=CacheConfig(kv_cache_memory=1 << 24),
            scheduler=SchedulerConfig(max_num_batched_tokens=32),
            device=DeviceConfig(device="cpu", attention_backend=backend),
        )
    )


def _small_pool_engine(path, backend: str, kv_cache_memory: int):
    """The engine on the model at `path` in float32 with a KV pool of `kv_cache_memory` bytes, 128-token
    sequences, 32-token steps and at most 5 sequences: a pool small enough to preempt."""
    return build_engine(
        EngineConfig(
            model=ModelConfig(model=str(path), dtype="float32", max_model_len=128),
            cache=CacheConfig(kv_cache_memory=kv_cache_memory),
            scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=5),
            device=DeviceConfig(device="cpu", attention_backend=backend),
        )
    )


def _saved_random_model(config, tokenizer, path):
    """transformers' model of `config` with the embedded tokenizer's vocabulary, random weights (seed 0),
    saved with the tokenizer in Hugging Face layout at `path`; returned in eval mode."""
    import transformers

    config.vocab_size = len(tokenizer)
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def tokenizer():
    from conveyor.server.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


@pytest.mark.parametrize(
    "kind",
    [
        "llama",
        "llama-sharded",
        "llama3-rope-scaling",
        "mistral",
        "mistral-window",
        "qwen2",
        "qwen3",
        "qwen3-yarn",
        "granite",
        "phi3",
        "phi3-longrope",
        "llama-dynamic",
        "gemma",
        "gemma2",
        "gemma3",
        "olmo2",
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "olmoe",
    ],
)
@pytest.mark.parametrize("backend", ["cpu", "torch"])  # the C++ kernels, and the torch reference
def test_random_model_from_a_local_directory_matches_transformers(kind, backend, tokenizer, tmp_path):
    import transformers

    config = _config(kind)
    config.vocab_size = len(tokenizer)
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for layer in hf.model.layers:  # random biases and norm weights, so the test notices a dropped one
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            proj = getattr(attn, name, None)
            if proj is not None and proj.bias is not None:
                torch.nn.init.normal_(proj.bias, std=0.5)
        norms = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
        norms += [
            getattr(layer, n, None) for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        ]
        norms += [getattr(layer, "input_layernorm", None), layer.post_attention_layernorm]  # OLMo 2: none
        for norm in norms:
            if norm is not None:
                torch.nn.init.normal_(norm.weight, mean=0.5, std=0.5)
    if kind == "llama-sharded":  # several files and model.safetensors.index.json, as large checkpoints are
        hf.save_pretrained(tmp_path, max_shard_size="1MB")
        assert (tmp_path / "model.safetensors.index.json").is_file()
    else:
        hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    engine = _engine(tmp_path, backend)
    assert engine.served_model_name == tmp_path.name
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    # With a 12-token original context (LongRoPE, dynamic NTK) the 2-token prompt stays short, the
    # 5-token one grows past it while decoding, the 37-token one starts past it.
    reference = _FreshModelPerPrompt(tmp_path) if kind == "llama-dynamic" else hf
    assert_greedy_equals_transformers(engine, reference, ids, 10, kind)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import transformers

    transformers.T5Config(num_layers=1, d_model=32, num_heads=2).save_pretrained(tmp_path / "t5")
    with pytest.raises(ValueError, match="model type 't5' is not supported: .* no causal language model"):
        build_engine(EngineConfig(model=ModelConfig(model=str(tmp_path / "t5"))))
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported natively"):
        build_engine(EngineConfig(model=ModelConfig(model=str(tmp_path / "gpt2"), model_impl="native")))


def test_a_config_transformers_refuses_is_a_clear_error(tmp_path):
    """LongRoPE factors of the wrong length (5 where the rotated width needs 12): transformers' config
    validation refuses them, and the server says so as a ValueError (one line from `conveyor serve`)."""
    import json

    import transformers

    config = transformers.Phi3Config(**SHAPE, **_longrope(12))
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    written["rope_parameters"]["short_factor"] = [1.0] * 5
    (tmp_path / "config.json").write_text(json.dumps(written))
    with pytest.raises(
        ValueError, match="transformers refuses its config: .*short_factor field must have length"
    ):
        build_engine(EngineConfig(model=ModelConfig(model=str(tmp_path))))


def test_missing_model_path_is_a_clear_error():
    from conveyor.server.model.loader import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        build_engine(EngineConfig(model=ModelConfig(model="/nonexistent/model")))


def test_triton_backend_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from conveyor.server.config import DeviceConfig

    config = EngineConfig(device=DeviceConfig(device="cpu", attention_backend="triton"))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        build_engine(config)


@pytest.mark.parametrize("kind", ["olmo", "gpt2", "llama"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_transformers_implementation_matches_transformers(kind, backend, tokenizer, tmp_path, caplog):
    """`--model-impl transformers`: transformers' own model on conveyor's paged KV cache, scheduler and
    sampler. OLMo (norms without weights, q/k/v clipped) and GPT-2 (learned absolute positions) have no
    native code, so `auto` picks transformers for them; Llama is forced."""
    import transformers

    configs = {
        "olmo": lambda: transformers.OlmoConfig(**SHAPE, clip_qkv=0.5),
        "gpt2": lambda: transformers.GPT2Config(
            n_embd=128, n_layer=2, n_head=4, n_positions=512, initializer_range=0.2
        ),
        "llama": lambda: transformers.LlamaConfig(**SHAPE),
    }
    config = configs[kind]()
    hf = _saved_random_model(config, tokenizer, tmp_path)
    impl = "transformers" if kind == "llama" else "auto"
    with caplog.at_level("INFO", logger="conveyor.server.engine.builder"):
        engine = _engine(tmp_path, backend, model_impl=impl)
    assert "model implementation transformers" in caplog.text
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    # With a 12-token original context (LongRoPE, dynamic NTK) the 2-token prompt stays short, the
    # 5-token one grows past it while decoding, the 37-token one starts past it.
    reference = _FreshModelPerPrompt(tmp_path) if kind == "llama-dynamic" else hf
    assert_greedy_equals_transformers(engine, reference, ids, 10, kind)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_mixture_of_experts_under_preemption_and_prefix_caching_matches_transformers(
    backend, tokenizer, tmp_path
):
    """Qwen2-MoE with top-4 routing and a shared expert in a KV pool of 8 blocks: five prompts sharing a
    40-token prefix cannot all run at once, so some are preempted and recomputed, and later ones find
    the prefix cached; greedy tokens still equal transformers'."""
    import transformers

    config = transformers.Qwen2MoeConfig(
        **SHAPE,
        num_experts=8,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        norm_topk_prob=True,
    )
    hf = _saved_random_model(config, tokenizer, tmp_path)
    kv_bytes_per_token = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * 32 * 4
    engine = _small_pool_engine(tmp_path, backend, 8 * 16 * kv_bytes_per_token)
    assert engine.limits.num_kv_blocks == 8
    prefix = tokenizer("A long prompt " * 10)["input_ids"][:40]
    ids = [prefix + tokenizer(f" number {i}")["input_ids"] for i in range(5)]
    assert_greedy_equals_transformers(engine, hf, ids, 30, f"qwen2_moe top-4 ({backend})")
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.prefix_cache_hits > 0


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_longrope_prefix_cache_keeps_the_short_and_long_tables_apart(backend, tokenizer, tmp_path):
    """Phi-3 LongRoPE past a 40-token original context, prefix caching on (16-token blocks), one request
    at a time: a 36-token prompt (short factors) decodes past 40 tokens, where its K/V is computed
    again with the long factors (as transformers' Phi-3 drops its cache there); a long prompt sharing
    its first 32 tokens reuses only blocks computed with the long factors, a short one only those with
    the short factors. Every output equals transformers'."""
    import transformers

    config = transformers.Phi3Config(**SHAPE, **_longrope(40), pad_token_id=0, partial_rotary_factor=0.75)
    hf = _saved_random_model(config, tokenizer, tmp_path)
    engine = _engine(tmp_path, backend, max_model_len=256)
    words = tokenizer("A long prompt " * 40)["input_ids"]
    short = words[:36]
    long = words[:32] + tokenizer(" and then some more words to go past the original context")["input_ids"]
    long = (long + words)[:52]
    other_short = words[:32] + tokenizer(" the end")["input_ids"]
    assert len(short) == 36 and len(long) == 52 and len(other_short) < 40
    cached = {}
    for name, ids in [("short", short), ("long", long), ("other short", other_short), ("long again", long)]:
        hits = engine.kv_cache.prefix_cache_hits
        assert_greedy_equals_transformers(engine, hf, [ids], 10, f"{name} ({backend})")
        cached[name] = engine.kv_cache.prefix_cache_hits - hits
    # "long": the short prompt's two first blocks as recomputed with the long factors; "other short":
    # the same two blocks as first computed, with the short factors; "long again": its own three.
    assert cached == {"short": 0, "long": 32, "other short": 32, "long again": 48}


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_window_on_every_layer_gives_blocks_back_and_tokens_stay_equal(backend, tokenizer, tmp_path):
    """Mistral with a 16-token window on every layer, 16-token blocks: a 37-token prompt decoding 60
    tokens holds at most three blocks at a time (the window's two and the one being written) while its
    sequence grows to seven, and its greedy tokens equal transformers'."""
    import transformers

    from conveyor.server.messages import SamplingParams

    hf = _saved_random_model(transformers.MistralConfig(**SHAPE, sliding_window=WINDOW), tokenizer, tmp_path)
    engine = _engine(tmp_path, backend)
    assert engine.kv_cache.sliding_window == WINDOW
    ids = tokenizer(PROMPTS[2])["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    request = engine.add_request(engine.make_request("a", ids, params))
    ours, held = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            ours += out.new_token_ids
        held.append(len(request.block_table) - request.num_skipped_blocks)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=60, min_new_tokens=60, do_sample=False)
    assert ours == ref[0, len(ids) :].tolist()
    assert max(held[2:]) <= 3 and -(-(len(ids) + 60) // 16) == 7


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_sliding_layers_hold_their_window_under_preemption_and_prefix_caching(backend, tokenizer, tmp_path):
    """Gemma 3 (a sliding layer, window 16, and a global one) whose sliding layer keeps its K/V in blocks
    of its own: five prompts sharing a prefix, each decoding 30 tokens, in pools of 8 blocks each, too
    small for all at once: some are preempted and recomputed, later ones find the prefix cached (global
    blocks and the sliding layer's last window); each sequence grows to 4-5 global blocks while its sliding layer
    holds at most 4 (the window's 2, a partial block, and a 32-token step's 2 more, less the overlap);
    greedy tokens equal transformers'; every block of both pools is free at the end."""
    from conveyor.server.messages import SamplingParams

    hf = _saved_random_model(_config("gemma3"), tokenizer, tmp_path)
    layer_bytes = 2 * SHAPE["num_key_value_heads"] * 48 * 4  # K and V of one layer, float32
    engine = _small_pool_engine(tmp_path, backend, 16 * 16 * layer_bytes)
    kv, limits = engine.kv_cache, engine.limits
    assert kv.window is not None and (limits.num_kv_blocks, limits.num_window_blocks) == (8, 8)
    prefix = tokenizer("A long prompt " * 10)["input_ids"][:40]
    ids = [prefix + tokenizer(f" number {i}")["input_ids"] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    requests = [engine.add_request(engine.make_request(str(i), p, params)) for i, p in enumerate(ids)]
    ours: dict[str, list[int]] = {str(i): [] for i in range(len(ids))}
    held, grown = 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            ours[out.request_id] += out.new_token_ids
        for r in requests:
            held = max(held, len(r.window_block_table) - r.num_skipped_window_blocks)
            grown = max(grown, len(r.block_table))
    for i, p in enumerate(ids):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=30, min_new_tokens=30, do_sample=False)
        assert ours[str(i)] == ref[0, len(p) :].tolist(), f"prompt {i}"
    assert engine.scheduler.num_preemptions > 0 and kv.prefix_cache_hits > 0
    assert grown == max(-(-(len(p) + 29) // 16) for p in ids) >= 4 and held <= 4
    assert (kv.num_free_blocks, kv.window.num_free_blocks) == (kv.num_blocks, kv.window.num_blocks)
