"""Draft-model speculative decoding on the real embedded model: the draft is the embedded model cut to
its first layers (a smaller model with the same tokenizer, which agrees with the full model often but
not always), so steps both accept and reject drafts. Greedy outputs equal the outputs without
speculation, token for token, with chunked prefill, preemption under a tiny KV pool, prefix caching,
stop strings, logprobs, penalties and structured output; no KV block leaks; the counters add up; a
draft with another vocabulary or fewer positions is refused at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.benchmarks.speculative import embedded_draft
from conveyor.server.messages import SamplingParams
from tests.integration.conftest import engine_config
from tests.integration.test_speculative import (
    check_greedy_outputs,
    check_stops_logprobs_and_penalties,
    check_tiny_pool,
    drafted,
    prompt_ids,
    run,
    structured_output_requests,
)

pytestmark = pytest.mark.slow

# Of the embedded model's 30: its greedy tokens agree with the full model's on about 1 draft in 8 here.
DRAFT_LAYERS = 22


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> str:
    """The embedded model's first DRAFT_LAYERS layers with its tokenizer (`embedded_draft`)."""
    return embedded_draft(DRAFT_LAYERS, str(tmp_path_factory.mktemp("draft")))


def speculative_config(model: str, **keys) -> dict:
    return {"speculative_config": json.dumps({"model": model, "num_speculative_tokens": 4, **keys})}


@pytest.fixture(scope="module")
def draft_engine(draft_dir):
    """The embedded model drafting with `draft_dir` at every batch size (so every test verifies drafts),
    with Prometheus metrics."""
    from conveyor.server.api.metrics import EngineMetrics
    from conveyor.server.engine.builder import build_engine

    config = engine_config(speculative=speculative_config(draft_dir, disable_by_batch_size=1000))
    return build_engine(config, make_observer=EngineMetrics)


def test_the_pool_holds_both_models_kv(engine, draft_engine):
    # The draft's 22 layers add 22/30 of the target's bytes per token to each pooled token.
    assert draft_engine.kv_bytes_per_token == engine.kv_bytes_per_token * (30 + DRAFT_LAYERS) // 30
    assert draft_engine.drafter.proposer.runner.kv_caches[0][0].shape[0] == draft_engine.num_kv_blocks


def test_greedy_with_a_draft_model_is_greedy_without_it(engine, draft_engine):
    check_greedy_outputs(engine, draft_engine)


def test_chunked_prefill_and_preemption_in_a_tiny_pool_keep_outputs_and_leak_no_block(engine, draft_engine):
    # 16 blocks force preemptions here (every decode reserves 4 draft positions, so fewer run at once).
    check_tiny_pool(engine, draft_engine, 16)


def test_stop_strings_logprobs_and_penalties_match(engine, draft_engine):
    check_stops_logprobs_and_penalties(engine, draft_engine)


def test_structured_output_keeps_greedy_outputs(engine, draft_engine):
    """The draft model drafts without the grammar; the target's mask at each draft position rejects
    what the grammar refuses, so outputs are the tokens without speculation, and valid."""
    requests = structured_output_requests(engine.tokenizer)
    before = drafted(draft_engine)
    plain, spec = run(engine, requests), run(draft_engine, requests)
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
    assert set(json.loads(spec[0]["text"])) == set("abcd")
    assert drafted(draft_engine)[0] > before[0]


def test_a_quantized_draft_serves_its_gguf_blocks_and_keeps_greedy_outputs(engine):
    """The embedded model's own GGUF as the draft, its Q4_1 blocks served as they are (`quantization:
    gguf`): it agrees with the float model most of the time, and outputs stay the float model's."""
    from conveyor.server.api.metrics import EngineMetrics
    from conveyor.server.engine.builder import build_engine
    from conveyor.server.model import loader

    gguf = loader.resolve_model(None).gguf_path
    config = engine_config(
        speculative=speculative_config(gguf, quantization="gguf", disable_by_batch_size=1000)
    )
    llm = build_engine(config, EngineMetrics)
    assert "Q4_1" in loader.weights_info(llm.drafter.proposer.runner.model)[0]
    requests = [(ids, SamplingParams(temperature=0.0, max_tokens=24)) for ids in prompt_ids(engine)]
    plain, spec = run(engine, requests), run(llm, requests)
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
    draft_tokens, accepted = drafted(llm)
    assert accepted > draft_tokens / 2, "a quantized copy of the model should agree with it mostly"


def test_metrics_add_up(draft_engine):
    registry = draft_engine.observer.registry
    labels = {"model_name": draft_engine.served_model_name}
    drafts = registry.get_sample_value("conveyor:spec_decode_num_drafts_total", labels)
    draft_tokens, accepted = drafted(draft_engine)
    assert 0 < drafts <= draft_tokens <= 4 * drafts
    assert 0 < accepted < draft_tokens


def test_a_missing_draft_or_one_with_another_vocabulary_or_fewer_positions_is_refused(
    save_tiny_llama, draft_dir, tmp_path
):
    from conveyor.server.engine.builder import build_engine
    from conveyor.server.model.loader import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="--speculative-config model: model path /nowhere/draft"):
        build_engine(engine_config(speculative=speculative_config("/nowhere/draft")))
    byte_level = save_tiny_llama("byte_level_draft")
    with pytest.raises(ValueError, match="has another vocabulary than the target"):
        build_engine(engine_config(speculative=speculative_config(byte_level)))
    for item in Path(draft_dir).iterdir():  # the same draft, configured for 512 positions
        (tmp_path / item.name).symlink_to(item)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    with pytest.raises(ValueError, match="has 512 positions, fewer than max_model_len 1024"):
        build_engine(engine_config(speculative=speculative_config(str(tmp_path))))


def test_n_choices_over_the_openai_api_are_each_the_greedy_output(engine, draft_dir):
    """`n: 3` through the real server and client: each choice is its own request with its own drafts
    and draft K/V, and each is the output without speculation."""
    from openai import OpenAI

    from conveyor.server.api.metrics import EngineMetrics
    from conveyor.server.engine.builder import build_engine
    from tests.integration.conftest import live_server

    ids = prompt_ids(engine)[1]
    expected = run(engine, [(ids, SamplingParams(temperature=0.0, max_tokens=32))])[0]["text"]
    config = engine_config(speculative=speculative_config(draft_dir, disable_by_batch_size=1000))
    llm = build_engine(config, EngineMetrics)
    with live_server(llm) as live:
        client = OpenAI(base_url=f"{live.base_url}/v1", api_key="unused")
        out = client.completions.create(
            model=llm.served_model_name, prompt=ids, n=3, max_tokens=32, temperature=0.0
        )
    assert [c.text for c in out.choices] == [expected] * 3
    assert drafted(llm)[0] > 0
