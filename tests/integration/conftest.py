"""Fixtures that load the real embedded model (SmolLM2-135M-Instruct) once per session."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_config(**overrides):
    """float32 (the correctness anchor), a 1024-token context and a 768 MiB KV pool (17 full-length
    sequences), unless overridden: `model=`, `cache=`, `scheduler=` take dicts of fields."""
    from conveyor.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    return EngineConfig(
        model=ModelConfig(**{"dtype": "float32", "max_model_len": 1024, **overrides.get("model", {})}),
        cache=CacheConfig(**{"kv_cache_memory": 768 * MiB, **overrides.get("cache", {})}),
        scheduler=SchedulerConfig(**overrides.get("scheduler", {})),
    )


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
    from conveyor.server.engine.engine import LLMEngine

    return LLMEngine(engine_config())


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
    import uvicorn

    from conveyor.server.api.app import create_app
    from conveyor.server.api.metrics import EngineMetrics
    from conveyor.server.engine.async_engine import AsyncEngine
    from conveyor.server.engine.engine import LLMEngine

    llm = LLMEngine(engine_config())
    metrics = EngineMetrics(llm.served_model_name, llm.limits)
    llm.observer = metrics
    app = create_app(AsyncEngine(llm), metrics)
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
