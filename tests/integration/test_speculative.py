"""Speculative decoding (n-gram prompt lookup) on the real embedded model: with drafts verified in the
step, greedy outputs are token for token the outputs without them (chunked prefill, preemption under a
tiny KV pool, prefix caching, stop strings, logprobs, penalties), sampled outputs keep their distribution, no KV
block leaks, and the counters add up. Also the stop-string rule of `min_tokens` (vllm#21987)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conveyor.server.config import SchedulerConfig
from conveyor.server.engine.kv_cache import KVCacheManager
from conveyor.server.engine.scheduler import make_scheduler
from conveyor.server.messages import SamplingParams
from tests.integration.conftest import engine_config

pytestmark = pytest.mark.slow

# Prompts whose answers copy spans of themselves (the n-gram proposer's workload), and others.
CODE = "def area(width, height):\n    return width * height\n\n\ndef volume(width, height, depth):\n"
CHATS = [
    "Repeat this sentence exactly: the red fox ran over the hill and the red fox ran back.",
    "Rename `area` to `surface` in this code and print all of it:\n" + CODE,
]
PROMPTS = ["1, 2, 3, 4, 5, 6, 7, 8,", "The capital of France is", "def fibonacci(n):"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def spec_engine():
    """The embedded model with n-gram speculation that drafts at every batch size (so every test
    exercises verification), and Prometheus metrics."""
    from conveyor.server.api.metrics import EngineMetrics
    from conveyor.server.engine.builder import build_engine

    config = engine_config(
        speculative={"speculative_config": json.dumps({**NGRAM, "disable_by_batch_size": 1000})}
    )
    return build_engine(config, make_observer=EngineMetrics)


def prompt_ids(engine) -> list[list[int]]:
    tok = engine.tokenizer
    chats = [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
        for c in CHATS
    ]
    return [tok(c, add_special_tokens=False)["input_ids"] for c in chats] + [
        tok(p)["input_ids"] for p in PROMPTS
    ]


def run(engine, requests: list[tuple[list[int], SamplingParams]]) -> list[dict]:
    """Add all requests at once and step until done: per request, its tokens, text, logprobs and finish."""
    for i, (ids, params) in enumerate(requests):
        engine.add_request(engine.make_request(f"r{i}", ids, params))
    out = [{"tokens": [], "text": "", "logprobs": [], "finish": None} for _ in requests]
    while engine.has_unfinished_requests():
        for o in engine.step():
            got = out[int(o.request_id[1:])]
            got["tokens"] += o.new_token_ids
            got["text"] += o.new_text
            got["logprobs"] += o.new_logprobs
            got["finish"] = o.finish_reason
    return out


def drafted(engine) -> tuple[float, float]:
    """(draft tokens verified, accepted) so far, from the engine's Prometheus counters."""
    registry = engine.observer.registry
    name = engine.served_model_name
    get = registry.get_sample_value
    return (
        get("conveyor:spec_decode_num_draft_tokens_total", {"model_name": name}),
        get("conveyor:spec_decode_num_accepted_tokens_total", {"model_name": name}),
    )


def check_greedy_outputs(engine, spec_engine) -> None:
    """Greedy outputs of `spec_engine` (drafting) are `engine`'s token for token, with drafts both
    accepted and rejected, and again from the prefix cache; no block stays held."""
    prompts = prompt_ids(engine)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    before = drafted(spec_engine)
    plain = run(engine, [(ids, params) for ids in prompts])
    spec = run(spec_engine, [(ids, params) for ids in prompts])
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
    assert [r["text"] for r in spec] == [r["text"] for r in plain]
    after = drafted(spec_engine)
    assert after[1] - before[1] >= 20, "drafts were accepted too rarely to test anything"
    assert after[1] - before[1] < after[0] - before[0], "no draft was rejected: the rollback went untested"
    # The same prompts again run from the prefix cache, drafts and all.
    hits = spec_engine.kv_cache.prefix_cache_hits
    again = run(spec_engine, [(ids, params) for ids in prompts])
    assert spec_engine.kv_cache.prefix_cache_hits > hits
    assert [r["tokens"] for r in again] == [r["tokens"] for r in plain]
    assert spec_engine.kv_cache.usage == 0.0


def check_tiny_pool(engine, spec_engine, num_blocks: int) -> None:
    """Twice the prompts at once in a pool of `num_blocks` blocks with a 32-token step budget: prompts
    are prefilled in chunks, requests are preempted, outputs stay `engine`'s and every block is freed."""
    prompts = prompt_ids(engine) * 2
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = run(engine, [(ids, params) for ids in prompts])
    saved = spec_engine.kv_cache, spec_engine.scheduler
    spec_engine.kv_cache = kv = KVCacheManager(
        num_blocks, spec_engine.runner.block_size, enable_prefix_caching=True
    )
    spec_engine.scheduler = make_scheduler(SchedulerConfig(max_num_batched_tokens=32), kv, max_num_seqs=10)
    assert max(map(len, prompts)) > 32  # so prompts are prefilled in chunks
    before = drafted(spec_engine)
    try:
        spec = run(spec_engine, [(ids, params) for ids in prompts])
        assert spec_engine.scheduler.num_preemptions > 0
        assert drafted(spec_engine)[1] > before[1]
        assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
        assert kv.num_free_blocks == kv.num_blocks and not any(kv.ref_counts)
    finally:
        spec_engine.kv_cache, spec_engine.scheduler = saved
        spec_engine.kv_cache.reset_prefix_cache()  # the tiny pool's run overwrote cached blocks


def test_greedy_with_drafts_is_greedy_without_them(engine, spec_engine):
    check_greedy_outputs(engine, spec_engine)


def test_chunked_prefill_and_preemption_in_a_tiny_pool_keep_outputs_and_leak_no_block(engine, spec_engine):
    # 10 requests of up to ~90 prompt + 40 output tokens need ~80 blocks of 16 at once: 24 force
    # preemptions.
    check_tiny_pool(engine, spec_engine, 24)


def check_stops_logprobs_and_penalties(engine, spec_engine) -> None:
    """Stop strings, logprobs and penalties give `engine`'s tokens, texts, finishes and logprobs."""
    prompts = prompt_ids(engine)
    cases = [
        SamplingParams(temperature=0.0, max_tokens=40, stop=["fox ran back"]),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["depth"], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=7, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.4, presence_penalty=0.2),
    ]
    requests = [(ids, params) for params in cases for ids in prompts[:2]]
    plain, spec = run(engine, requests), run(spec_engine, requests)
    for p, s in zip(plain, spec, strict=True):
        assert (s["tokens"], s["text"], s["finish"]) == (p["tokens"], p["text"], p["finish"])
        assert [lp.token_id for lp in s["logprobs"]] == [lp.token_id for lp in p["logprobs"]]
        for a, b in zip(s["logprobs"], p["logprobs"], strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert any(p["finish"].value == "stop" for p in plain[:4]), "no stop string was reached"


def test_stop_strings_logprobs_and_penalties_match_when_a_step_accepts_drafts(engine, spec_engine):
    check_stops_logprobs_and_penalties(engine, spec_engine)


def test_min_tokens_holds_back_stop_strings(engine, spec_engine):
    """`"1, 2, 3, 4,"` with `stop: [","]` and `min_tokens: 12` once returned 3 tokens: a stop string
    that matches before `min_tokens` are out must not end the request (vLLM's rule since vllm#21987)."""
    ids = engine.tokenizer("1, 2, 3, 4,")["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=[","], min_tokens=12)
    for eng in (engine, spec_engine):
        (out,) = run(eng, [(ids, params)])
        assert len(out["tokens"]) > 12 and out["finish"].value == "stop"
        assert out["text"].count(",") >= 4 and not out["text"].endswith(",")


def _chi_square_p_value(a: list[str], b: list[str]) -> float:
    """Two-sample chi-square test of homogeneity over the categories of `a` and `b` (categories seen
    fewer than 10 times in all merged into one). Returns the p-value."""
    counts = {k: (a.count(k), b.count(k)) for k in set(a) | set(b)}
    rare = [k for k, (x, y) in counts.items() if x + y < 10]
    table = [v for k, v in counts.items() if k not in rare]
    table.append((sum(counts[k][0] for k in rare), sum(counts[k][1] for k in rare)))
    table = [row for row in table if sum(row)]
    n_a, n_b = len(a), len(b)
    stat = 0.0
    for x, y in table:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected
    dof = max(len(table) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def test_sampled_outputs_keep_their_distribution(engine, spec_engine):
    """Seeded: 200 samples of a 5-token completion at temperature 1 with and without drafts; the
    completions' distributions must agree (chi-square homogeneity, p > 0.001), and drafts were both
    accepted and rejected along the way."""
    ids = engine.tokenizer("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,")["input_ids"]

    def samples(eng) -> list[str]:
        requests = [(ids, SamplingParams(temperature=1.0, max_tokens=5, seed=i)) for i in range(200)]
        return [json.dumps(r["tokens"]) for r in run(eng, requests)]

    before = drafted(spec_engine)
    plain, spec = samples(engine), samples(spec_engine)
    after = drafted(spec_engine)
    assert 0 < after[1] - before[1] < after[0] - before[0]
    assert len(set(plain)) > 3, "the completion is too peaked to test a distribution"
    assert _chi_square_p_value(plain, spec) > 1e-3
    # Sanity of the test itself: a different temperature is told apart.
    hotter = [
        json.dumps(r["tokens"])
        for r in run(
            engine, [(ids, SamplingParams(temperature=2.0, max_tokens=5, seed=i)) for i in range(200)]
        )
    ]
    assert _chi_square_p_value(plain, hotter) < 1e-3


def test_speculation_metrics_add_up(spec_engine):
    registry = spec_engine.observer.registry
    labels = {"model_name": spec_engine.served_model_name}
    drafts = registry.get_sample_value("conveyor:spec_decode_num_drafts_total", labels)
    draft_tokens, accepted = drafted(spec_engine)
    per_pos = [
        registry.get_sample_value(
            "conveyor:spec_decode_num_accepted_tokens_per_pos_total", {**labels, "position": str(p)}
        )
        for p in range(NGRAM["num_speculative_tokens"])
    ]
    assert 0 < drafts <= draft_tokens <= drafts * NGRAM["num_speculative_tokens"]
    assert 0 < accepted <= draft_tokens
    assert sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # a position is accepted only after the one before
    assert not math.isnan(accepted)


def test_suffix_decoding_drafts_from_earlier_answers_and_keeps_greedy_outputs(engine):
    """The `suffix` method: a repeated question is answered from the first answer's tokens (what agents
    and retries send), with the same greedy tokens as without speculation."""
    from conveyor.server.api.metrics import EngineMetrics
    from conveyor.server.engine.builder import build_engine

    spec = {"method": "suffix", "num_speculative_tokens": 6, "disable_by_batch_size": 1000}
    suffix = build_engine(engine_config(speculative={"speculative_config": json.dumps(spec)}), EngineMetrics)
    ids = engine.tokenizer("Write a haiku about the sea and the moon.")["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    (plain,) = run(engine, [(ids, params)])
    (first,) = run(suffix, [(ids, params)])
    drafted_first = drafted(suffix)
    (second,) = run(suffix, [(ids, params)])
    assert first["tokens"] == second["tokens"] == plain["tokens"]
    drafted_second = [b - a for a, b in zip(drafted_first, drafted(suffix), strict=True)]
    # The second answer is drafted from the first: nearly every token accepted.
    assert drafted_second[1] >= 24 > drafted_first[1]


def structured_output_requests(tokenizer) -> list:
    """A JSON-schema request and a regex request whose answers repeat themselves."""
    from conveyor.server.messages import StructuredOutputParams

    fox = {"type": "string", "enum": ["red fox", "blue fox"]}
    schema = {"type": "object", "properties": {k: fox for k in "abcd"}, "required": list("abcd")}
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "List red fox, blue fox, red fox, blue fox, red fox as JSON items."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
    json_output = StructuredOutputParams("json", json.dumps(schema))
    regex_output = StructuredOutputParams("regex", "(fox ){3,8}")
    return [
        (ids, SamplingParams(temperature=0.0, max_tokens=60, structured_output=json_output)),
        (ids, SamplingParams(temperature=0.0, max_tokens=30, structured_output=regex_output)),
    ]


def test_structured_output_drafts_under_its_grammar_and_keeps_greedy_outputs(engine, spec_engine):
    """A constrained request drafts too: each draft position is masked by the grammar as it stands after
    the drafts before it, so outputs are the same tokens as without speculation, and valid."""
    requests = structured_output_requests(engine.tokenizer)
    before = drafted(spec_engine)
    plain, spec = run(engine, requests), run(spec_engine, requests)
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
    assert spec[0]["finish"].value == "stop" and set(json.loads(spec[0]["text"])) == set("abcd")
    assert drafted(spec_engine)[1] > before[1]
