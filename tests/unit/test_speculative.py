"""The drafting side of speculative decoding: n-gram prompt lookup, the adaptive draft length and the
`--speculative-config` flag."""

from __future__ import annotations

import itertools

import pytest

from conveyor.server.cli import ServeArgsError, parse_serve_argv
from conveyor.server.config import SpeculativeMethod
from conveyor.server.engine.request import Request
from conveyor.server.engine.speculative import Drafter, NgramProposer, StepCost, SuffixProposer
from conveyor.server.messages import SamplingParams

_ids = itertools.count()


def decoding(tokens: list[int], output: int = 1, **params) -> Request:
    """A running request in decode: `tokens` (the last `output` of them generated), all computed but
    the last."""
    r = Request(
        f"r{next(_ids)}", tokens[:-output], SamplingParams(**{"max_tokens": 100, **params}), eos_token_id=None
    )
    r.append_output_tokens(tokens[-output:])
    r.num_computed_tokens = len(tokens) - 1
    return r


def test_ngram_lookup_continues_the_latest_longest_match():
    proposer = NgramProposer(1, 3)
    # "5 6 7" occurs twice; its latest earlier occurrence is followed by 8 9 1.
    r = decoding([5, 6, 7, 1, 2, 5, 6, 7, 8, 9, 1, 6, 7])
    assert proposer.propose(r, 3) == [8, 9, 1]
    # A longer match beats a later shorter one: "4 6 7" (at the start) over the later "6 7".
    r = decoding([4, 6, 7, 3, 3, 6, 7, 5, 5, 4, 6, 7])
    assert proposer.propose(r, 2) == [3, 3]
    assert proposer.propose(decoding([1, 2, 3, 4]), 4) == []  # 4 never occurred before
    # The index grows with the request: a token appended later is found.
    r = decoding([1, 2, 3, 1])
    assert proposer.propose(r, 2) == [2, 3]
    r.append_output_tokens([9, 1])
    r.num_computed_tokens += 2
    assert proposer.propose(r, 2) == [9, 1]


def test_suffix_decoding_drafts_from_earlier_outputs_and_forgets_the_oldest():
    proposer = SuffixProposer(max_depth=8, max_cached_requests=2, max_spec_factor=1.0)
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    earlier = decoding([1, 2, 3, *answer], output=len(answer))
    proposer.finished(earlier)
    # A new request produces the start of the same answer: the cached output continues it, as long as
    # the match (4 tokens: 40-43) allows.
    r = decoding([9, 9, 40, 41, 42, 43], output=4)
    assert proposer.propose(r, 8) == [44, 45, 46, 47]
    # A match of 2 tokens drafts 2 (max_spec_factor 1), and 0.5 halves it.
    assert proposer.propose(decoding([7, 7, 44, 45], output=2), 8) == [46, 47]
    halved = SuffixProposer(max_depth=8, max_cached_requests=2, max_spec_factor=0.5)
    halved.finished(earlier)
    assert halved.propose(decoding([7, 7, 44, 45], output=2), 8) == [46]
    # The request's own tokens still count: it repeats itself.
    assert proposer.propose(decoding([5, 6, 7, 8, 5, 6, 7], output=3), 3) == [8, 5, 6]
    # Two more finished requests push the first out of the cache.
    for other in ([70, 71, 72], [80, 81, 82]):
        proposer.finished(decoding(other, output=3))
    assert proposer.propose(decoding([9, 9, 40, 41, 42, 43], output=4), 8) == []
    assert all(number in proposer.outputs for number, _ in sum(proposer.positions.values(), []))


def _drafter(**method) -> Drafter:
    config = SpeculativeMethod(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, **method)
    # A step costs 20 ms + 1 ms per token.
    return Drafter(config, None if "disable_by_batch_size" in method else StepCost([(1, 0.021), (64, 0.084)]))


def test_drafts_stop_where_a_step_is_compute_bound_and_follow_acceptance():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    drafter = _drafter()
    lone = decoding(tokens)
    drafter.propose([lone], 0, 1000)
    assert len(lone.spec_token_ids) == 4  # one sequence: 1 ms / 21 ms, far below any rate
    crowd = [decoding(tokens) for _ in range(64)]
    drafter.propose(crowd, 0, 1000)
    # Nothing verified yet: the rate is the optimistic prior, and one request finds out.
    assert [len(r.spec_token_ids) for r in crowd] == [4] + [0] * 63
    for request in crowd:
        drafter.record(request, 4, 2)  # positions accepted at 2/3
    drafter.propose(crowd, 0, 1000)
    # 64 ms of 84 ms: a draft position needs 0.76, which (2 + 2/3) / (3 + 1) = 0.67 per request misses.
    assert all(r.spec_token_ids == [] for r in crowd)
    # A request whose drafts keep failing drafts less; one whose drafts land keeps going.
    for _ in range(6):
        drafter.record(lone, 4, 0)
    drafter.propose([lone], 0, 1000)
    assert len(lone.spec_token_ids) == 1  # a 1 ms position against a 21 ms step still pays at ~9 %
    good = decoding(tokens)
    for _ in range(6):
        drafter.record(good, 4, 4)
    drafter.propose([good], 0, 1000)
    assert len(good.spec_token_ids) == 4
    stats = drafter.take_stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (76, 304, 152)
    assert stats.num_accepted_tokens_per_pos == [70, 70, 6, 6] and drafter.take_stats() is None


def test_drafts_respect_limits_and_wait_for_the_prefill():
    tokens = [1, 2, 3, 4] * 4
    drafter = _drafter(disable_by_batch_size=3)
    near_end = decoding(tokens, output=3, max_tokens=5)  # room for one more token after the next
    penalised = decoding(tokens, repetition_penalty=1.2)  # drafts too: its rows count the drafts
    prefilling = decoding(tokens)
    prefilling.num_computed_tokens = 4
    drafter.propose([near_end, penalised, prefilling], 0, 1000)
    assert near_end.spec_token_ids == [1] and penalised.spec_token_ids == [1, 2, 3, 4]
    assert prefilling.spec_token_ids == []
    assert drafter.propose([near_end], 0, len(tokens) + 2) is None and near_end.spec_token_ids == [1]
    drafter.propose([near_end], 3, 1000)  # four requests: above disable_by_batch_size
    assert near_end.spec_token_ids == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}',
         "method: Input should be 'ngram', 'suffix' or 'draft_model'"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs the draft model's `model`"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "m"}',
         "model does not apply to method 'ngram'"),
        ('{"model": "m", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
         "prompt_lookup_max does not apply to method 'draft_model'"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"}',
         "quantization does not apply to method 'ngram'"),
        ('{"model": "m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}',
         "draft_tensor_parallel_size: Input should be less than or equal to 1"),
        ('{"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 0.1}',
         "suffix_decoding_min_token_prob: Extra inputs are not permitted"),
        ('{"method": "ngram"}', "num_speculative_tokens: Field required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens: Input should be greater"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
         "prompt_lookup_min 4 is above prompt_lookup_max 2"),
        ('{"method": "suffix", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
         "prompt_lookup_max does not apply to method 'suffix'"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 3}',
         "suffix_decoding_max_tree_depth does not apply to method 'ngram'"),
        ("ngram", "not JSON"),
        ("[]", "must be a JSON object"),
    ],
)  # fmt: skip
def test_bad_speculative_config_is_refused_naming_the_flag_and_key(value, message):
    with pytest.raises(ServeArgsError, match="--speculative-config: ") as info:
        parse_serve_argv(["--speculative-config", value])
    assert message in str(info.value)


def test_speculation_needs_continuous_batching_and_takes_vllm_defaults():
    with pytest.raises(ServeArgsError, match="--speculative-config needs --scheduling continuous"):
        parse_serve_argv(
            [
                "--scheduling",
                "static",
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2}',
            ]
        )
    method = parse_serve_argv(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    ).engine.speculative.method
    assert (method.prompt_lookup_min, method.prompt_lookup_max) == (5, 5)
    method = SpeculativeMethod(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)
    assert (method.prompt_lookup_min, method.prompt_lookup_max) == (3, 3)


def test_a_draft_model_is_the_method_of_a_config_naming_one_and_runs_on_one_rank():
    method = parse_serve_argv(
        ["--speculative-config", '{"model": "/models/draft", "num_speculative_tokens": 3}']
    ).engine.speculative.method
    assert (method.method, method.model, method.num_speculative_tokens) == ("draft_model", "/models/draft", 3)
    with pytest.raises(ServeArgsError, match="with a draft model runs on one rank"):
        parse_serve_argv(
            [
                "--tensor-parallel-size",
                "2",
                "--speculative-config",
                '{"model": "/models/draft", "num_speculative_tokens": 3}',
            ]
        )


def test_a_draft_model_charges_each_draft_position_its_forwards():
    target = StepCost([(1, 0.021), (64, 0.084)])  # 20 ms + 1 ms per token
    draft = StepCost([(1, 0.0055), (64, 0.0118)])  # 5.4 ms + 0.1 ms per token
    assert target.draft_threshold(1) == pytest.approx(1 / 21)
    # One request: 1 ms of the target, 0.1 ms of the draft and a whole draft forward, of 21 ms.
    assert target.draft_threshold(1, draft) == pytest.approx((1 + 0.1 + 5.4) / 21)
    # 64 requests share each draft forward; the step is compute-bound already.
    assert target.draft_threshold(64, draft) == pytest.approx((1 + 0.1 + 5.4 / 64) * 64 / 84)
    # When only 8 of them draft, each draft forward is shared by 8.
    assert target.draft_threshold(64, draft, sharers=8) == pytest.approx(
        min((1 + 0.1 + 5.4 / 8) * 64 / 84, 1)
    )
    assert target.draft_threshold(1000, draft) == 1.0
