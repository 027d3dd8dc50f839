"""The sampler on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.server.engine.request import Request
from conveyor.server.messages import SamplingParams
from conveyor.server.model import sampler
from conveyor.server.model.runner import build_sampling_metadata


def req(rid="r", output=(), prompt=(1, 2), eos=None, **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), eos_token_id=eos)
    for t in output:
        r.append_output_tokens([t])
    return r


def sample(logits: torch.Tensor, requests: list[Request]) -> sampler.SamplerOutput:
    """The runner's path: the requests' sampling inputs as tensors, then the sampler."""
    return sampler.sample(logits, build_sampling_metadata(requests, logits.shape[1]))


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    assert sample(logits, [req(temperature=0), req(temperature=0)]).token_ids == [1, 0]


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 50)
    expected = logits.argmax(-1).tolist()
    assert (
        sample(logits, [req(str(i), temperature=1.0, top_k=1, seed=i) for i in range(4)]).token_ids
        == expected
    )
    assert (
        sample(logits, [req(str(i), temperature=1.0, top_p=1e-6, seed=i) for i in range(4)]).token_ids
        == expected
    )


def test_min_p_removes_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.6, 0.35, 0.05]]))
    seen = {sample(logits, [req(temperature=1.0, min_p=0.5, seed=s)]).token_ids[0] for s in range(200)}
    assert seen == {0, 1}


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(1, 100)
    alone = [sample(logits, [r]).token_ids[0] for r in [req(temperature=1.0, seed=9)] for _ in range(1)]
    batch = torch.cat([torch.randn(3, 100), logits])
    rows = [
        req("a", temperature=1.0),
        req("b", temperature=0.5, seed=1),
        req("c", temperature=0),
        req(temperature=1.0, seed=9),
    ]
    assert sample(batch, rows).token_ids[3] == alone[0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    r = req(temperature=1.0, seed=0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(probs.log()[None], [r]).token_ids[0]] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_penalties():
    logits = torch.tensor([[2.0, 2.0, -1.0, 1.9]])
    # Token 0 was generated twice: frequency 0.1*2 + presence 0.5 = 0.7 off its logit -> token 1 wins.
    r = req(output=[0, 0], temperature=0, frequency_penalty=0.1, presence_penalty=0.5)
    assert sample(logits.clone(), [r]).token_ids == [1]
    # Repetition penalty 2 on tokens 0 and 1 (prompt + output) halves them: 1.9 wins.
    r = req(prompt=[1], output=[0], temperature=0, repetition_penalty=2.0)
    assert sample(logits.clone(), [r]).token_ids == [3]


def test_min_tokens_masks_eos():
    logits = torch.tensor([[0.0, 9.0, 1.0]])
    assert sample(logits, [req(eos=1, temperature=0, min_tokens=2)]).token_ids == [2]
    assert sample(logits, [req(eos=1, output=[2, 2], temperature=0, min_tokens=2)]).token_ids == [1]


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = sample(logits, [req(temperature=0.5, top_k=1, logprobs=2, seed=0)])
    lp = out.logprobs[0]
    expected = torch.log_softmax(logits, -1)[0]
    assert lp.token_id == 2 and math.isclose(lp.logprob, expected[2].item(), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [2, 1]


def test_logit_bias_is_added_before_everything_and_logprobs_see_it():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    out = sample(
        logits,
        [req(temperature=0, logit_bias={2: 5.0}, logprobs=0), req(temperature=0, logit_bias={1: -100.0})],
    )
    assert out.token_ids == [2, 2]
    biased = torch.tensor([0.0, 3.0, 6.0]).log_softmax(-1)
    assert math.isclose(out.logprobs[0].logprob, float(biased[2]), rel_tol=1e-6)
    # Penalties then apply to the biased logits (vLLM's order).
    out = sample(
        logits[:1], [req(temperature=0, prompt=(0,), output=[2], logit_bias={2: 2.5}, repetition_penalty=2.0)]
    )
    assert out.token_ids == [1]  # (1 + 2.5) / 2 = 1.75 < 3


def test_plain_greedy_step_builds_no_sampling_tensors():
    metadata = build_sampling_metadata([req("a", temperature=0), req("b", temperature=0)], 50)
    parts = (
        metadata.grammar_bitmask,
        metadata.logit_bias,
        metadata.penalties,
        metadata.banned,
        metadata.random,
    )
    assert parts == (None,) * 5 and metadata.logprobs == [None, None]


def test_penalties_and_bans_touch_only_their_own_rows():
    logits = torch.tensor([[2.0, 2.0, -1.0, 1.9]]).repeat(4, 1)
    rows = [
        req("plain", output=[0, 0], temperature=0),
        req("freq", output=[0, 0], temperature=0, frequency_penalty=0.1, presence_penalty=0.5),
        req("rep", prompt=[1], output=[0], temperature=0, repetition_penalty=2.0),
        req("stop", eos=3, output=[2], temperature=0, min_tokens=3, stop_token_ids=[0, 1]),
    ]
    metadata = build_sampling_metadata(rows, 4)
    assert metadata.penalties.rows.tolist() == [1, 2]
    assert metadata.penalties.output_counts[0].tolist() == [2.0, 0.0, 0.0, 0.0]
    assert metadata.penalties.seen[1].tolist() == [True, True, False, False]
    assert metadata.banned[0].tolist() == [3, 3, 3] and sorted(metadata.banned[1].tolist()) == [0, 1, 3]
    assert sampler.sample(logits, metadata).token_ids == [0, 1, 3, 2]


def test_seeded_and_unseeded_random_rows_in_one_batch():
    """Each seeded row draws from its own generator whatever its neighbours are; rows with top_k and
    rows without it share one truncation pass."""
    logits = torch.randn(1, 100)
    alone = sample(logits, [req(temperature=0.7, top_k=5, seed=3)]).token_ids[0]
    batch = torch.cat([torch.randn(2, 100), logits])
    rows = [req("a", temperature=1.0), req("b", temperature=0), req("c", temperature=0.7, top_k=5, seed=3)]
    metadata = build_sampling_metadata(rows, 100)
    assert metadata.random.rows.tolist() == [0, 2] and list(metadata.random.generators) == [1]
    assert metadata.random.top_k.tolist() == [100, 5]
    out = sampler.sample(batch, metadata).token_ids
    assert out[2] == alone and out[1] == int(batch[1].argmax())


def test_a_verified_draft_leaves_the_distribution_as_it_was():
    """Speculative sampling with a deterministic draft: accept it with probability p(draft), else draw
    from p without it. Each row's emitted token must follow p (after temperature and top_k), whichever
    token the draft is: a likely one, an unlikely one, one top_k removed."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    p = (logits / 0.8).softmax(-1)
    p[4:] = 0
    p /= p.sum()
    n = 20000
    for draft in (0, 3, 5):
        rows = [req(str(i), temperature=0.8, top_k=4, seed=i) for i in range(n)]
        out = sampler.sample(logits.expand(n, -1), build_sampling_metadata(rows, 6), torch.full((n,), draft))
        counts = torch.bincount(torch.tensor(out.token_ids), minlength=6).float()
        assert torch.allclose(counts / n, p, atol=0.012), (draft, counts / n, p)
        accepted = torch.tensor(out.accepted)
        assert accepted.float().mean().item() == pytest.approx(p[draft].item(), abs=0.012)
        assert (torch.tensor(out.token_ids)[accepted] == draft).all()


def test_a_greedy_row_accepts_only_the_argmax_and_a_row_without_a_draft_samples():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    rows = [req("a", temperature=0), req("b", temperature=0), req("c", temperature=0)]
    out = sampler.sample(logits, build_sampling_metadata(rows, 3), torch.tensor([1, 2, -1]))
    assert out.accepted == [True, False, False] and out.token_ids == [1, 1, 0]


def test_min_tokens_bans_eos_at_draft_positions_still_short_of_it():
    logits = torch.tensor([[0.0, 5.0, 1.0]] * 3)  # EOS (1) is the argmax everywhere
    r = req(eos=1, output=[2], temperature=0, min_tokens=3)
    metadata = build_sampling_metadata([r, r, r], 3, [[], [2], [2, 2]])
    assert sampler.sample(logits, metadata, torch.tensor([2, 2, -1])).token_ids == [2, 2, 1]


def test_penalties_at_draft_positions_count_the_drafts_before_them():
    """Row j of a request verifying drafts sees drafts 1..j as outputs: a repetition penalty that turns
    the argmax away from a token once it has been drafted, exactly as after it was generated."""
    logits = torch.tensor([[0.0, 2.0, 1.9]] * 3)
    r = req(prompt=(7,), temperature=0, repetition_penalty=2.0)  # no prompt token in the vocabulary
    metadata = build_sampling_metadata([r, r, r], 3, [[], [1], [1, 2]])
    out = sampler.sample(logits, metadata, torch.tensor([1, 2, -1]))
    # Row 0: 1 wins; row 1: 1 seen (2.0 / 2 = 1.0), so 2 wins; row 2: both seen (1.0, 0.95): 1 wins.
    assert out.accepted == [True, True, False] and out.token_ids == [1, 2, 1]


@pytest.mark.parametrize("vocab", [5, 8192, 49_152, 128_256, 262_144])
def test_argmax_is_torchs_on_ties_nan_and_vocabularies_of_every_length(vocab: int) -> None:
    """The sampler's chunked argmax against torch's: random rows; a maximum in the tail past the last
    whole chunk; two equal maxima in different chunks (the first wins); NaN in the first row's tail and
    the last row's body (NaN wins, as in torch); a row of -inf."""
    torch.manual_seed(vocab)
    x = torch.randn(6, vocab)
    x[1, -2] = 100.0
    x[2, 3], x[2, vocab // 2] = 100.0, 100.0
    x[3, -3], x[4, vocab // 3] = float("nan"), float("nan")
    x[5] = float("-inf")
    assert torch.equal(sampler.argmax(x), x.argmax(dim=-1))
