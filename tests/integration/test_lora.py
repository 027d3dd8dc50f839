"""Multi-LoRA serving on the real embedded model (SmolLM2-135M-Instruct), with adapters made here by
`peft` (random, non-zero A and B; several ranks, alphas and target modules, one with rsLoRA).

The reference for every adapter is `peft`'s merged model (`merge_and_unload`) in float32 through
transformers' greedy `generate`: the engine's greedy tokens must equal it, token for token, with
adapters and the base model mixed in one batch, under `--max-loras 2` with five adapters (slots and
the CPU cache evicting), and after prefixes were cached under other adapters. The HTTP tests run a real
uvicorn server and the `openai` client. The engines run the C++ kernels and layer loop, and one the torch reference's Python
layers.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.integration.conftest import engine_config
from tests.k8s.cluster import free_port

pytestmark = pytest.mark.slow

# name -> (rank, alpha, target modules, rsLoRA)
ADAPTERS = {
    "all-r8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "qv-r4": (4, 8, ["q_proj", "v_proj"], False),
    "mlp-r16": (16, 8, ["gate_proj", "up_proj", "down_proj"], False),
    "ko-r2-rslora": (2, 4, ["k_proj", "o_proj"], True),
    "down-r12": (12, 24, ["down_proj", "q_proj"], False),
}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    # The classic recursive definition, with a dictionary of results already computed, so that\n"
    "    # each value is computed once; the base cases are 0 and 1, which return n itself.\n",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory, tokenizer) -> dict[str, tuple[str, list[list[int]]]]:
    """name -> (PEFT directory, merged model's greedy tokens for each of PROMPTS)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        config = LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
        )
        peft_model = get_peft_model(copy.deepcopy(hf_model), config)
        path = root / name
        peft_model.save_pretrained(str(path))
        merged = PeftModel.from_pretrained(copy.deepcopy(hf_model), str(path)).merge_and_unload().eval()
        made[name] = (str(path), [_greedy(merged, tokenizer(p)) for p in PROMPTS])
    return made


@pytest.fixture(scope="module")
def hf_tokenizer():
    from conveyor.server.model.loader import converted, load_tokenizer, resolve_model

    return load_tokenizer(converted(resolve_model(None)))


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizer):
    """text -> prompt token ids, as the server tokenizes a completion prompt."""
    return lambda text: hf_tokenizer(text)["input_ids"]


@pytest.fixture(scope="module")
def base_tokens(hf_model, tokenizer) -> list[list[int]]:
    return [_greedy(hf_model, tokenizer(p)) for p in PROMPTS]


def _greedy(model, prompt_ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def _lora_engine(adapters, names, model: dict | None = None, speculative: dict | None = None, **lora):
    """An engine serving `names` from `adapters`; with `speculative`, drafting, with Prometheus metrics."""
    from conveyor.server.api.metrics import EngineMetrics
    from conveyor.server.config import LoRAConfig
    from conveyor.server.engine.builder import build_engine

    config = engine_config(**{k: v for k, v in (("model", model), ("speculative", speculative)) if v})
    modules = [f"{name}={adapters[name][0]}" for name in names]
    return build_engine(
        config.model_copy(update={"lora": LoRAConfig(enable_lora=True, lora_modules=modules, **lora)}),
        make_observer=EngineMetrics if speculative else None,
    )


def _run(engine, jobs: list[tuple[str | None, list[int]]]) -> tuple[list[list[int]], list]:
    """Queue every (adapter, prompt) at once, step until all finish; returns tokens per job and the
    adapters of each step's requests."""
    from conveyor.server.messages import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = []
    for i, (name, prompt) in enumerate(jobs):
        request = engine.make_request(f"job-{i}-{time.monotonic_ns()}", prompt, params, lora_name=name)
        engine.add_request(request)
        ids.append(request.request_id)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = []
    while engine.has_unfinished_requests():
        steps.append({r.lora.name for r in engine.scheduler.running if r.lora is not None})
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[rid] for rid in ids], steps


def test_four_adapters_and_the_base_model_in_one_batch_match_peft(adapters, base_tokens, tokenizer):
    names = list(ADAPTERS)[:4]
    engine = _lora_engine(adapters, names, max_loras=4)
    jobs = [(None, tokenizer(p)) for p in PROMPTS] + [(n, tokenizer(p)) for n in names for p in PROMPTS]
    tokens, steps = _run(engine, jobs)
    expected = base_tokens + [t for n in names for t in adapters[n][1]]
    assert tokens == expected
    # All four adapters ran in the same steps, beside the base model's rows.
    assert any(s == set(names) for s in steps)
    assert engine.kv_cache.usage == 0.0

    # A prefix computed under one adapter is not reused under another (or by the base model), and is
    # reused under the same one.
    long_prompt = tokenizer(PROMPTS[1])
    assert len(long_prompt) >= 2 * engine.limits.block_size
    first, _ = _run(engine, [(names[0], long_prompt)])
    again, _ = _run(engine, [(names[1], long_prompt), (None, long_prompt), (names[0], long_prompt)])
    assert first == [adapters[names[0]][1][1]]
    assert again == [adapters[names[1]][1][1], base_tokens[1], adapters[names[0]][1][1]]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_adapters_under_speculative_decoding_match_peft(
    method, adapters, base_tokens, tokenizer, tmp_path_factory
):
    """Drafts (prompt n-grams, or the embedded model cut to 22 layers, which drafts without adapters)
    are verified by the model with each row's adapter: greedy tokens still equal peft's merged models,
    with the base model's rows in the same batches, and some drafts were accepted."""
    from conveyor.benchmarks.speculative import embedded_draft
    from tests.integration.test_speculative import NGRAM, drafted

    if method == "ngram":
        spec = NGRAM
    else:
        spec = {
            "model": embedded_draft(22, str(tmp_path_factory.mktemp("draft"))),
            "num_speculative_tokens": 4,
        }
    config = {"speculative_config": json.dumps({**spec, "disable_by_batch_size": 1000})}
    names = list(ADAPTERS)[:4]
    engine = _lora_engine(adapters, names, speculative=config, max_loras=4)
    jobs = [(None, tokenizer(p)) for p in PROMPTS] + [(n, tokenizer(p)) for n in names for p in PROMPTS]
    tokens, _ = _run(engine, jobs)
    assert tokens == base_tokens + [t for n in names for t in adapters[n][1]]
    verified, accepted = drafted(engine)
    assert verified > 0 and accepted > 0, (verified, accepted)
    assert engine.kv_cache.usage == 0.0


def test_adapters_on_a_mixture_of_experts_model_match_peft(hf_tokenizer, tokenizer, tmp_path):
    """A tiny random Qwen3-MoE (qk-norm, top-2 of 8 experts): an adapter on every attention projection
    equals peft's merged model token for token, beside the base model in one batch. Adapters that reach
    the experts are refused by name: peft's (its `target_parameters` on the fused experts) and one
    whose tensors name an MLP projection of a layer of experts."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file, save_file

    from conveyor.server.model.lora import LoRAError, load_adapter
    from conveyor.server.model.models.llama import ModelShape
    from tests.integration.test_architectures import _config, _saved_random_model

    config = _config("qwen3_moe")
    hf = _saved_random_model(config, hf_tokenizer, tmp_path / "base")

    def save(name: str, targets: list[str]) -> Path:
        torch.manual_seed(7)
        lora_config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
        get_peft_model(copy.deepcopy(hf), lora_config).save_pretrained(str(tmp_path / name))
        return tmp_path / name

    path = save("attention", ["q_proj", "k_proj", "v_proj", "o_proj"])
    merged = PeftModel.from_pretrained(copy.deepcopy(hf), str(path)).merge_and_unload().eval()
    prompts = [tokenizer(p) for p in PROMPTS]
    expected = [_greedy(hf, p) for p in prompts] + [_greedy(merged, p) for p in prompts]
    assert expected[: len(prompts)] != expected[len(prompts) :], "the adapter changes nothing"
    adapters = {"attention": (str(path), [])}
    model = {"model": str(tmp_path / "base"), "max_model_len": 256}
    engine = _lora_engine(adapters, ["attention"], model=model, max_loras=1)
    tokens, steps = _run(engine, [(None, p) for p in prompts] + [("attention", p) for p in prompts])
    assert tokens == expected
    assert {"attention"} in steps
    assert engine.kv_cache.usage == 0.0

    shape = ModelShape.from_hf_config(config)
    experts = save("experts", ["q_proj", "gate_proj", "up_proj", "down_proj"])
    with pytest.raises(LoRAError, match="'experts': target_parameters .*gate_up_proj"):
        load_adapter("experts", str(experts), shape, max_lora_rank=8)
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "adapter_config.json").write_text((path / "adapter_config.json").read_text())
    tensors = load_file(str(path / "adapter_model.safetensors"))
    renamed = {k.replace("self_attn.q_proj", "mlp.gate_proj"): v for k, v in tensors.items()}
    save_file(renamed, str(moved / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="'moved': tensor .*mlp.gate_proj.* mixture-of-experts layer's MLP"):
        load_adapter("moved", str(moved), shape, max_lora_rank=8)


def test_the_python_layers_with_the_reference_kernels_match_peft_too(adapters, base_tokens, tokenizer):
    """The tests above run the C++ layer loop (it adds the deltas itself); the torch backend runs the
    model's Python layers, whose `LoRALinear`s call the reference `add_lora`."""
    from conveyor.server.config import DeviceConfig, LoRAConfig
    from conveyor.server.engine.builder import build_engine

    names = ["all-r8", "ko-r2-rslora"]
    config = engine_config().model_copy(
        update={
            "device": DeviceConfig(attention_backend="torch"),
            "lora": LoRAConfig(
                enable_lora=True, lora_modules=[f"{n}={adapters[n][0]}" for n in names], max_loras=2
            ),
        }
    )
    engine = build_engine(config)
    assert engine.runner.layer_loop is None
    tokens, _ = _run(engine, [(None, tokenizer(PROMPTS[0]))] + [(n, tokenizer(PROMPTS[0])) for n in names])
    assert tokens == [base_tokens[0]] + [adapters[n][1][0] for n in names]


def test_adapters_on_a_gguf_quantized_base_match_peft(adapters, base_tokens, tokenizer, monkeypatch):
    """`--quantization gguf` serves the file's Q4_1 blocks as they are, whose values are exactly the
    float32 model peft merges into: with the kernels that keep float32 activations (the quality
    table's exact row), the LoRA deltas on the quantized projections give the same tokens."""
    from conveyor.kernels.quant import QuantizedLinear

    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "q-dot,q-dequant@9")
    names = list(ADAPTERS)[:3]
    engine = _lora_engine(adapters, names, model={"quantization": "gguf"}, max_loras=3)
    try:
        base = engine.runner.lora.layers[0]["qkv_proj"].base
        assert isinstance(base, QuantizedLinear) or all(isinstance(k, QuantizedLinear) for k in base.kernels)
        jobs = [(name, tokenizer(p)) for name in names for p in PROMPTS] + [(None, tokenizer(PROMPTS[1]))]
        tokens, _ = _run(engine, jobs)
        expected = [adapters[name][1][i] for name in names for i in range(len(PROMPTS))] + [base_tokens[1]]
        assert tokens == expected
    finally:
        engine.close()


def _teacher_forced_error(
    engine, reference, name: str | None, prompts: list[list[int]]
) -> tuple[float, float]:
    """(how far below the reference's top log-probability the engine's greedy tokens fall, how far the
    engine's log-probabilities of them are from the reference's), the worst over every position of
    `prompts` under adapter `name`, the reference (a transformers model) teacher-forced on the engine's
    own tokens."""
    from conveyor.server.messages import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    gap, diff = 0.0, 0.0
    for ids in prompts:
        engine.add_request(engine.make_request(f"tf-{time.monotonic_ns()}", ids, params, lora_name=name))
        chosen: list[tuple[int, float]] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                chosen += [(lp.token_id, lp.logprob) for lp in out.new_logprobs]
        tokens = [t for t, _ in chosen]
        with torch.no_grad():
            logits = reference(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
        for (token, logprob), row in zip(chosen, torch.log_softmax(logits.float(), dim=-1), strict=True):
            gap = max(gap, float(row.max() - row[token]))
            diff = max(diff, abs(logprob - float(row[token])))
    return gap, diff


@pytest.mark.parametrize(
    ("model", "max_gap", "max_diff"),
    [({"dtype": "bfloat16"}, 0.15, 0.5), ({"quantization": "int8"}, 0.4, 0.8)],
    ids=["bfloat16", "int8-base"],
)
def test_adapters_in_bfloat16_or_on_int8_weights_track_peft(
    adapters, hf_model, tokenizer, model, max_gap, max_diff
):
    """In bfloat16 (slots, activations and weights), or on weights quantized to int8 at load, greedy
    tokens may leave float32's at near-ties, so they are compared by teacher forcing against peft's
    float32 merged model: each engine token falls at most `max_gap` nats below the top choice, and its
    log-probability strays at most `max_diff` (a wrong delta would be off by nats). Measured on a 2-core
    AVX-512 BF16 EPYC, worst over 3 adapters x 2 prompts x 12 tokens: bfloat16 0 / 0.23 nats (every token
    the top choice; bfloat16 logits of magnitude 16-32 are 0.125 apart), int8 0.23 / 0.49 (one near-tie
    taken the other way). The base model alone against transformers: bfloat16 0 / 0.08 nats, int8 a gap
    of 0. The random adapters move the logits far more than trained ones, so their errors are larger."""
    from peft import PeftModel

    names = list(ADAPTERS)[:3]
    prompts = [tokenizer(p) for p in PROMPTS]
    engine = _lora_engine(adapters, names, model=model, max_loras=3)
    try:
        for name in names:
            merged = PeftModel.from_pretrained(copy.deepcopy(hf_model), adapters[name][0]).merge_and_unload()
            gap, diff = _teacher_forced_error(engine, merged, name, prompts)
            assert gap < max_gap and diff < max_diff, (name, gap, diff)
    finally:
        engine.close()


def test_prefix_cache_hits_only_under_the_same_adapter(adapters, tokenizer):
    from conveyor.server.engine.request import Request
    from conveyor.server.messages import SamplingParams

    engine = _lora_engine(adapters, ["qv-r4", "all-r8"], max_loras=2)
    prompt = tokenizer(PROMPTS[1])
    _run(engine, [("qv-r4", prompt)])
    kv = engine.kv_cache
    params = SamplingParams(temperature=0.0, max_tokens=1)
    hits = {}
    for name in ("qv-r4", "all-r8", None):
        probe = Request("probe", list(prompt), params, None, lora=engine.lora.get(name) if name else None)
        hits[name] = len(kv.get_computed_blocks(probe))
    assert hits["qv-r4"] == (len(prompt) - 1) // engine.limits.block_size > 0
    assert hits["all-r8"] == 0 and hits[None] == 0


def test_an_adapter_reloaded_with_other_files_reuses_no_prefix_of_its_old_ones(adapters, tokenizer, tmp_path):
    """The prefix cache keys an adapter by its files' digest, not its name or path: unloading it,
    replacing its files in place and loading it again under the same name and path computes every
    block again, and the answer is the new weights' (a name or path key would reuse the old K/V)."""
    import shutil

    path = tmp_path / "reloaded"
    shutil.copytree(adapters["qv-r4"][0], path)
    engine = _lora_engine(adapters, [], max_loras=1)
    try:
        prompt = tokenizer(PROMPTS[1])
        engine.lora.add("x", str(path))
        assert _run(engine, [("x", prompt)])[0] == [adapters["qv-r4"][1][1]]
        engine.lora.remove("x")
        shutil.rmtree(path)
        shutil.copytree(adapters["all-r8"][0], path)
        engine.lora.add("x", str(path))
        assert _run(engine, [("x", prompt)])[0] == [adapters["all-r8"][1][1]]
    finally:
        engine.close()


def test_no_adapter_may_take_the_base_models_name(adapters):
    from conveyor.server.model.lora import LoRAError

    engine = _lora_engine(adapters, [], max_loras=1)
    try:
        with pytest.raises(LoRAError, match="the name is the base model's"):
            engine.lora.add(engine.served_model_name, adapters["qv-r4"][0])
        assert engine.lora.names == []
    finally:
        engine.close()


def test_five_adapters_through_two_slots_keep_outputs_right(adapters, tokenizer):
    """--max-loras 2 and --max-cpu-loras 2 with five adapters: requests of a third adapter wait for a
    slot, slots are rewritten, adapters dropped from CPU memory are read again; no step runs more than
    two adapters, and no KV block is left held."""
    names = list(ADAPTERS)
    engine = _lora_engine(adapters, names, max_loras=2, max_cpu_loras=2)
    jobs = [(n, tokenizer(p)) for p in PROMPTS for n in names]
    tokens, steps = _run(engine, jobs)
    assert tokens == [adapters[n][1][i] for i in range(len(PROMPTS)) for n in names]
    assert max(len(s) for s in steps) == 2
    assert engine.kv_cache.usage == 0.0


def _adapter_dir(tmp_path: Path, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def test_adapters_that_cannot_be_served_are_refused_by_name(tmp_path):
    from conveyor.server.config import LoRAConfig
    from conveyor.server.engine.lora import LoRARegistry, UnknownAdapterError
    from conveyor.server.model.loader import converted, load_config, resolve_model
    from conveyor.server.model.lora import LoRAError
    from conveyor.server.model.models.llama import ModelShape

    shape = ModelShape.from_hf_config(load_config(converted(resolve_model(None))))
    registry = LoRARegistry(LoRAConfig(enable_lora=True, max_lora_rank=8), shape)
    key = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    lora = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}

    def good(layer=0, rank=8, width=576):
        return {
            key.format(layer, "A"): torch.randn(rank, width),
            key.format(layer, "B"): torch.randn(576, rank),
        }

    cases = {
        "missing": (str(tmp_path / "nowhere"), "is not a directory"),
        "rank": (
            _adapter_dir(tmp_path, "rank", {**lora, "r": 16}, good(rank=16)),
            "rank 16 exceeds --max-lora-rank 8",
        ),
        "other-base": (_adapter_dir(tmp_path, "other", lora, good(width=960)), "expected [8, 576]"),
        "layers": (_adapter_dir(tmp_path, "layers", lora, good(layer=40)), "base model has 30 layers"),
        "dora": (_adapter_dir(tmp_path, "dora", {**lora, "use_dora": True}, good()), "use_dora"),
        "prefix": (_adapter_dir(tmp_path, "prefix", {"peft_type": "PREFIX_TUNING"}, good()), "is not LORA"),
        "embeddings": (
            _adapter_dir(
                tmp_path,
                "emb",
                lora,
                {"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(8, 5)},
            ),
            "does not adapt",
        ),
    }
    for name, (path, message) in cases.items():
        with pytest.raises(LoRAError, match=message.replace("[", r"\[").replace("]", r"\]")):
            registry.add(name, path)
    assert registry.names == []
    registry.add("fine", _adapter_dir(tmp_path, "fine", lora, good()))
    with pytest.raises(LoRAError, match="already loaded"):
        registry.add("fine", str(tmp_path / "fine"))
    registry.remove("fine")
    with pytest.raises(UnknownAdapterError):
        registry.get("fine")


@pytest.fixture(scope="module")
def lora_server(adapters):
    """A real uvicorn server with two adapters from --lora-modules (one in the JSON form), room for a
    third at runtime, and runtime updating on."""
    import uvicorn

    from conveyor.server.api.app import create_app
    from conveyor.server.api.metrics import EngineMetrics
    from conveyor.server.cli import parse_serve_argv
    from conveyor.server.engine.async_engine import AsyncEngine
    from conveyor.server.engine.builder import build_engine

    first, second = list(ADAPTERS)[:2]
    settings = parse_serve_argv(
        [
            "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", str(256 << 20),
            "--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating",
            "--lora-modules", f"{first}={adapters[first][0]}",
            json.dumps({"name": second, "path": adapters[second][0], "base_model_name": "SmolLM2"}),
        ]
    )  # fmt: skip
    llm = build_engine(settings.engine, EngineMetrics)
    app = create_app(AsyncEngine(llm), llm.observer, settings.server)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        assert thread.is_alive()
        time.sleep(0.05)
    port = uv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(timeout=30)


def test_adapters_are_served_through_the_openai_api(lora_server, adapters, base_tokens, hf_tokenizer):
    client = openai.OpenAI(base_url=lora_server + "/v1", api_key="unused", max_retries=0)
    first, second, third = list(ADAPTERS)[:3]
    cards = {m.id: m for m in client.models.list().data}
    base = next(name for name, card in cards.items() if card.parent is None)
    assert set(cards) == {base, first, second}
    assert cards[first].parent == base and cards[first].root == adapters[first][0]

    def complete(model: str, prompt: str) -> str:
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.model == model
        return out.choices[0].text

    def text(token_ids: list[int]) -> str:
        return hf_tokenizer.decode(token_ids)

    for name in (first, second):
        assert complete(name, PROMPTS[0]) == text(adapters[name][1][0])
    assert complete(base, PROMPTS[0]) == text(base_tokens[0])
    with pytest.raises(openai.NotFoundError, match=third):
        complete(third, PROMPTS[0])

    # Runtime load: a bad one is a 400 naming the problem, and the server keeps serving.
    http = httpx.Client(base_url=lora_server, timeout=60)
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": third, "lora_path": "/nowhere"})
    assert bad.status_code == 400 and "is not a directory" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "lora_path"
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": third, "lora_path": adapters[third][0]})
    assert loaded.status_code == 200, loaded.text
    again = http.post("/v1/load_lora_adapter", json={"lora_name": third, "lora_path": adapters[third][0]})
    assert again.status_code == 400 and "already loaded" in again.text
    assert complete(third, PROMPTS[1]) == text(adapters[third][1][1])
    assert third in {m.id for m in client.models.list().data}

    # Unload while a request runs under it: the request finishes with it, unchanged; new requests get
    # 404 and the model list drops it; unknown names are 404 too.
    stream = client.completions.create(
        model=third, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    pieces = [next(stream).choices[0].text]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": third}).status_code == 200
    pieces += [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(pieces) == text(adapters[third][1][0])
    with pytest.raises(openai.NotFoundError):
        complete(third, PROMPTS[0])
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": third}).status_code == 404
    assert third not in {m.id for m in client.models.list().data}

    metrics = http.get("/metrics").text
    for prefix in ("vllm", "conveyor"):
        assert (
            f'{prefix}:lora_requests_info{{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}}'
            in metrics
        )
    assert (
        f'conveyor:lora_requests_total{{finished_reason="length",lora_name="{first}",model_name="{base}"}} 1.0'
        in metrics
    )


def _hub_cache(root: Path, repo_id: str, directory: str) -> Path:
    """A Hugging Face Hub cache (`HF_HUB_CACHE` layout) holding `directory`'s files as `repo_id`'s main
    revision, so `snapshot_download` finds them offline."""
    import shutil

    revision = "0" * 40
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(directory, repo / "snapshots" / revision)
    return root


def test_a_lora_modules_file_is_kept_in_step_while_serving(adapters, tokenizer, tmp_path, monkeypatch):
    """`--lora-modules-file`: its adapters are served when the engine is built (a Hub id from the Hub's
    cache among them), one that cannot load is reported and the rest served, and edits to the file load
    and unload adapters while the engine runs; `conveyor:lora_adapter_info` says which is which."""
    from huggingface_hub import constants
    from prometheus_client import generate_latest

    from conveyor.server.api.errors import APIError
    from conveyor.server.api.metrics import EngineMetrics
    from conveyor.server.capacity import lora_slot_bytes
    from conveyor.server.config import LoRAConfig, ServerConfig
    from conveyor.server.engine.async_engine import AsyncEngine
    from conveyor.server.engine.builder import build_engine

    first, second, third = list(ADAPTERS)[:3]
    monkeypatch.setattr(
        constants, "HF_HUB_CACHE", str(_hub_cache(tmp_path / "hub", "org/third", adapters[third][0]))
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    modules = tmp_path / "adapters.json"

    def declare(entries: list) -> None:  # written whole and renamed, as a ConfigMap volume swaps its files
        (tmp_path / "next.json").write_text(json.dumps(entries))
        (tmp_path / "next.json").replace(modules)

    declare(
        [
            {"name": first, "path": adapters[first][0]},
            "ghost=/no/such/adapter",
            {"name": third, "path": "org/third"},
        ]
    )
    lora = LoRAConfig(enable_lora=True, max_loras=2, lora_modules_file=str(modules))
    engine = build_engine(engine_config().model_copy(update={"lora": lora}), EngineMetrics)
    try:
        assert engine.lora.names == [first, third]
        assert (
            set(engine.lora.failures()) == {"ghost"}
            and "is not a directory" in engine.lora.failures()["ghost"]
        )
        engine.observer.watch_lora_adapters(engine.lora.states)
        scrape = generate_latest(engine.observer.registry).decode()
        digest = engine.lora.get(first).digest
        assert len(digest) == 32
        assert (
            f'conveyor:lora_adapter_info{{digest="{digest}",error="",lora_name="{first}",'
            f'model_name="SmolLM2-135M-Instruct",path="{adapters[first][0]}",source="lora-modules-file",'
            'state="loaded"} 1.0'
        ) in scrape
        assert (
            'lora_name="ghost",model_name="SmolLM2-135M-Instruct",path="/no/such/adapter",'
            'source="lora-modules-file",state="failed"} 1.0'
        ) in scrape
        # The operator's plan counts exactly the slots the server allocates.
        shape = engine.runner.model.shape
        assert engine.runner.lora.num_bytes == lora_slot_bytes(
            shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            shape.intermediate_size, 2, 16, "float32",
        )  # fmt: skip
        jobs = [(first, tokenizer(PROMPTS[0])), (third, tokenizer(PROMPTS[1]))]
        assert _run(engine, jobs)[0] == [adapters[first][1][0], adapters[third][1][1]]

        # first removed, second added, ghost gone: the watch applies it within a few polls.
        declare([{"name": second, "path": adapters[second][0]}, {"name": third, "path": "org/third"}])
        deadline = time.monotonic() + 30
        while engine.lora.names != [third, second] or engine.lora.failures():
            assert time.monotonic() < deadline, (engine.lora.names, engine.lora.failures())
            time.sleep(0.2)
        assert _run(engine, [(second, tokenizer(PROMPTS[0]))])[0] == [adapters[second][1][0]]
        with pytest.raises(Exception, match="not loaded"):
            engine.lora.get(first)

        # A request naming a declared adapter that failed is told why (the 404 of an unknown name else).
        from conveyor.server.api.serving import OpenAIServing

        declare(
            [
                {"name": second, "path": adapters[second][0]},
                {"name": third, "path": "org/third"},
                "gone=/gone",
            ]
        )
        deadline = time.monotonic() + 30
        while "gone" not in engine.lora.failures():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        serving = OpenAIServing(AsyncEngine(engine), ServerConfig())
        with pytest.raises(
            APIError, match="`gone` is not served: LoRA adapter 'gone': '/gone' is not a directory"
        ):
            serving.check_model("gone")
        with pytest.raises(APIError, match="`other` does not exist"):
            serving.check_model("other")

        # A file that does not parse changes nothing.
        modules.write_text("{not json")
        time.sleep(2.5)
        assert engine.lora.names == [third, second]
    finally:
        engine.close()
