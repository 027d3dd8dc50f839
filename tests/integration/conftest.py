"""Fixtures that load the real embedded model (SmolLM2-135M-Instruct) once per session."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from tests.k8s.cluster import free_port

MiB = 1 << 20


def engine_config(**overrides):
    """float32 (the correctness anchor), a 1024-token context and a 768 MiB KV pool (17 full-length
    sequences), unless overridden: `model=`, `cache=`, `scheduler=`, `speculative=` take dicts of
    fields."""
    from conveyor.server.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )

    return EngineConfig(
        model=ModelConfig(**{"dtype": "float32", "max_model_len": 1024, **overrides.get("model", {})}),
        cache=CacheConfig(**{"kv_cache_memory": 768 * MiB, **overrides.get("cache", {})}),
        scheduler=SchedulerConfig(**overrides.get("scheduler", {})),
        speculative=SpeculativeConfig(**overrides.get("speculative", {})),
    )


def cpu_build_ops(source: str, macro: str, build: tuple[str, list[str]] | None, native: str):
    """The ops of one build of `kernels/csrc/<source>`: `torch.ops.<native>` (the server's library) for
    None, else `(namespace, compiler flags)` compiled here with `-D<macro>=<namespace>` (so an AVX-512
    machine also runs the AVX2 and scalar paths), cached like the server's build."""
    import torch
    from torch.utils import cpp_extension

    from conveyor.kernels import cpu

    cpu.load_library()
    if build is None:
        return getattr(torch.ops, native)
    namespace, flags = build
    cpp_extension.load(
        name=f"{namespace}_{cpu._build_name()}",
        sources=[str(cpu.CSRC / source)],
        extra_cflags=[*flags, "-fopenmp", f"-D{macro}={namespace}"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )
    return getattr(torch.ops, namespace)


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own model of the embedded GGUF, float32: the reference for greedy outputs."""
    import torch
    from transformers import AutoModelForCausalLM

    from conveyor.server.model.loader import resolve_model

    source = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def engine():
    """A synchronous LLMEngine on the embedded model (tests drive `step()` themselves)."""
    from conveyor.server.engine.builder import build_engine

    return build_engine(engine_config())


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """`hf_greedy(prompt_ids, max_new_tokens)`: transformers' greedy continuation (token ids, prompt
    excluded, ending at EOS if it comes)."""
    import torch

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False
            )
        return out[0, len(prompt_ids) :].tolist()

    return generate


@dataclass
class LiveServer:
    """A real uvicorn server in a background thread of this process, on 127.0.0.1."""

    base_url: str
    app: object

    @property
    def llm_engine(self):
        return self.app.state.engine.engine


@pytest.fixture(scope="session")
def server() -> Iterator[LiveServer]:
    from conveyor.server.api.metrics import EngineMetrics
    from conveyor.server.engine.builder import build_engine

    with live_server(build_engine(engine_config(), EngineMetrics)) as live:
        yield live


@contextmanager
def live_server(llm) -> Iterator[LiveServer]:
    """The OpenAI server over the engine `llm` (built with an observer), served by uvicorn until exit."""
    import uvicorn

    from conveyor.server.api.app import create_app
    from conveyor.server.engine.async_engine import AsyncEngine

    app = create_app(AsyncEngine(llm), llm.observer)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    yield LiveServer(f"http://127.0.0.1:{port}", app)
    uv.should_exit = True
    thread.join(timeout=30)


def _byte_level_tokenizer():
    """A 258-token byte-level tokenizer (256 bytes + BOS + EOS): any text, no download, fast to load."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def save_tiny_llama(tmp_path_factory: pytest.TempPathFactory):
    """`save_tiny_llama(name, **config)`: a 2-layer Llama (head_dim 64, hidden 256) with random weights
    (seed 0) and a byte-level tokenizer, saved in Hugging Face layout; returns its directory. `config`
    overrides transformers' LlamaConfig fields (heads, KV heads, ...); `config_class` another config
    class (a Qwen3MoeConfig, with its expert fields in `config`)."""
    import torch
    import transformers

    def save(name: str, config_class=None, **config) -> str:
        path = tmp_path_factory.mktemp(name)
        tokenizer = _byte_level_tokenizer()
        heads = config.get("num_attention_heads", 4)
        llama_config = (config_class or transformers.LlamaConfig)(
            **{
                "vocab_size": len(tokenizer),
                "hidden_size": 64 * heads,
                "intermediate_size": 512,
                "num_hidden_layers": 2,
                "num_attention_heads": heads,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "max_position_embeddings": 256,
                "rope_theta": 10000.0,
                # Larger than the default 0.02 so the random model's logits are peaked: greedy ties would
                # make comparisons depend on float rounding instead of on the code under test.
                "initializer_range": 0.2,
                "tie_word_embeddings": False,
                "bos_token_id": 256,
                "eos_token_id": 257,
                **config,
            }
        )
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(llama_config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        return str(path)

    return save
