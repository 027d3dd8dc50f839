"""Turns the logits of one step into next tokens, one row per sampling request.

The inputs are tensors the model runner built for the step (`SamplingMetadata`, vLLM v1's name); the
sampler reads no request objects. Row i of every per-row tensor belongs to row i of the step's logits.
Order of operations as in vLLM's sampler: the structured-output grammar's bitmask, logit bias,
penalties, then (for log-probabilities) the raw distribution, then temperature, min_p, top_k and top_p
truncation, then sampling. Random rows sample by the exponential race `argmax(p / q)`,
`q ~ Exp(1)`, which equals drawing from `p`; a request with a seed draws its `q` from its own
generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from conveyor.server.engine.structured_output import apply_grammar_bitmask
from conveyor.server.messages import Logprob


@dataclass(frozen=True)
class Penalties:
    """Repetition, presence and frequency penalties of the rows that have one (vLLM's order and formulas:
    CTRL's repetition penalty on prompt and output tokens, OpenAI's presence/frequency on output tokens).

    rows: `[P]` int64 logits rows. repetition: `[P, 1]` float32 (1 = off); seen: `[P, vocab_size]` bool,
    tokens in the row's prompt or output; both None when no row has a repetition penalty. presence,
    frequency: `[P, 1]` float32 (0 = off); output_counts: `[P, vocab_size]` float32, how often each token
    is in the row's output; all three None when no row has a presence or frequency penalty.
    """

    rows: torch.Tensor
    repetition: torch.Tensor | None
    seen: torch.Tensor | None
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    output_counts: torch.Tensor | None


@dataclass(frozen=True)
class Truncation:
    """Temperature and truncation of the random (non-greedy) rows.

    rows: `[R]` int64 logits rows. temperature: `[R, 1]` float32 (> 0).
    min_p: `[R, 1]` float32, or None when no row uses it. top_k: `[R]` int64 (vocab_size where off) and
    top_p: `[R, 1]` float32 (1 where off), both None when no row uses either. generators: position in
    `rows` -> the request's generator (a seeded request's own, so its draws do not depend on the batch;
    the engine gives the others its shared one); rows without one draw from torch's default generator.
    """

    rows: torch.Tensor
    temperature: torch.Tensor
    min_p: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    generators: dict[int, torch.Generator]


@dataclass(frozen=True)
class SamplingMetadata:
    """Everything `sample` needs for one step of `num_rows` rows, as tensors (built by the model runner,
    `conveyor.server.model.runner.build_sampling_metadata`).

    grammar_rows, grammar_bitmask: the rows whose structured-output grammar constrains this token and
    xgrammar's `[num_rows, ceil(vocab_size / 32)]` int32 bitmask of the tokens each allows (rows not
    listed are not read). logit_bias: (rows `[N]` int64, token ids `[N]` int64, values `[N]` float32),
    one entry per biased (row, token). penalties: see `Penalties`. banned: (rows `[M]`, token ids `[M]`)
    that must not be sampled yet (EOS and stop token ids before `min_tokens`). random: see `Truncation`;
    None when every row is greedy. logprobs: per row, how many top log-probabilities to return (capped at
    MAX_LOGPROBS), None for none.
    """

    num_rows: int
    grammar_rows: list[int]
    grammar_bitmask: torch.Tensor | None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    penalties: Penalties | None
    banned: tuple[torch.Tensor, torch.Tensor] | None
    random: Truncation | None
    logprobs: list[int | None]


@dataclass
class SamplerOutput:
    """token_ids: `[num_rows]` the row's token (its draft token where accepted); logprobs: per row, a
    Logprob of that token or None; accepted: per row, whether its draft token was accepted (all False
    without drafts)."""

    token_ids: list[int]
    logprobs: list[Logprob | None]
    accepted: list[bool]


def _apply_penalties(logits: torch.Tensor, penalties: Penalties) -> None:
    """In place. logits: `[num_rows, vocab_size]` float32. Repetition penalty (CTRL, Keskar et al. 2019)
    divides positive and multiplies negative logits of seen tokens; presence and frequency penalties
    subtract `presence * (count > 0) + frequency * count` (OpenAI's formula)."""
    sub = logits[penalties.rows]
    if penalties.repetition is not None:
        rep = penalties.repetition
        sub = torch.where(penalties.seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if penalties.output_counts is not None:
        counts = penalties.output_counts
        sub -= penalties.frequency * counts + penalties.presence * (counts > 0)
    logits[penalties.rows] = sub


ARGMAX_CHUNK = 4096


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for `[num_rows, vocab_size]` float32: the first index of each row's maximum
    (NaN counting as the maximum), found as the first chunk of `ARGMAX_CHUNK` whose maximum is the row's
    (torch's `amax` is vectorized, its `argmax` is not), then the index within that chunk; a vocabulary
    that is not a multiple of the chunk has its tail compared after. 5-7x torch's argmax on a 262,144-token
    vocabulary on a 2-core AVX-512 CPU, the same indices (`tests/unit/test_sampler.py`)."""
    rows, vocab = x.shape
    main = vocab - vocab % ARGMAX_CHUNK
    if main < 2 * ARGMAX_CHUNK:
        return x.argmax(dim=-1)
    chunks = x[:, :main].reshape(rows, main // ARGMAX_CHUNK, ARGMAX_CHUNK)
    chunk_max = chunks.amax(dim=-1)
    best = chunk_max.argmax(dim=-1)
    ids = best * ARGMAX_CHUNK + chunks[torch.arange(rows), best].argmax(dim=-1)
    if main == vocab:
        return ids
    tail_max, tail_ids = x[:, main:].max(dim=-1)
    main_max = chunk_max.gather(1, best[:, None])[:, 0]
    tail_wins = (tail_max > main_max) | (tail_max.isnan() & ~main_max.isnan())
    return torch.where(tail_wins, tail_ids + main, ids)


def _truncate(logits: torch.Tensor, random: Truncation) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p on the random rows' logits `[R, vocab]`. Returns probabilities
    `[R, vocab]`."""
    probs = (logits / random.temperature).softmax(dim=-1)
    if random.min_p is not None:
        threshold = probs.max(dim=-1, keepdim=True).values * random.min_p
        probs = probs.masked_fill(probs < threshold, 0.0)
    if random.top_k is not None:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[1])[None, :]
        drop = rank >= random.top_k[:, None]
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it does.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= random.top_p * sorted_probs.masked_fill(drop, 0).sum(-1, keepdim=True)
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    return probs


def _logprobs(logits: torch.Tensor, token_ids: list[int], wanted: list[int | None]) -> list[Logprob | None]:
    """Per row, the sampled token's log-probability and the top `wanted[row]` alternatives (None where
    not wanted). Tokens a grammar or min_tokens banned have logprob -inf: not alternatives, and not JSON."""
    rows = [i for i, k in enumerate(wanted) if k is not None]
    out: list[Logprob | None] = [None] * len(wanted)
    if not rows:
        return out
    lp = logits[rows].log_softmax(dim=-1)
    top_vals, top_ids = lp.topk(max(max(wanted[i] for i in rows), 1), dim=-1)
    for j, i in enumerate(rows):
        k = wanted[i]
        top = [
            (t, v)
            for t, v in zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist(), strict=True)
            if v > -math.inf
        ]
        out[i] = Logprob(token_ids[i], float(lp[j, token_ids[i]]), top)
    return out


def sample(
    logits: torch.Tensor, metadata: SamplingMetadata, drafts: torch.Tensor | None = None
) -> SamplerOutput:
    """Sample one token per row, or verify the row's draft token.

    logits: `[num_rows, vocab_size]` (any float dtype; computed in float32); metadata: the step's
    sampling inputs, row i of which belongs to logits row i. drafts: `[num_rows]` int64, the draft token
    each row verifies (-1: none; speculative decoding). A greedy row accepts its draft when it is the
    argmax; a random row accepts it with probability p(draft) under the row's final distribution (the
    draft is deterministic, so this is the speculative-sampling rule min(1, p/q) with q = 1) and else
    samples from p with the draft removed, so each emitted token is distributed as without drafts.
    Log-probabilities, when asked for, are of the model's distribution after the grammar's mask, logit
    bias and penalties and before temperature and truncation (vLLM's default "raw" log-probabilities;
    with a logit_bias they are of the biased distribution, as OpenAI's are).
    """
    # Masks, biases and penalties change a copy; without them the float32 logits are only read.
    in_place = (metadata.grammar_bitmask, metadata.logit_bias, metadata.penalties, metadata.banned)
    logits = logits.to(torch.float32, copy=any(x is not None for x in in_place))
    if metadata.grammar_bitmask is not None:
        apply_grammar_bitmask(logits, metadata.grammar_bitmask, metadata.grammar_rows)
    if metadata.logit_bias is not None:
        rows, ids, values = metadata.logit_bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if metadata.penalties is not None:
        _apply_penalties(logits, metadata.penalties)
    if metadata.banned is not None:
        logits[metadata.banned] = float("-inf")
    token_ids = argmax(logits)
    accepted = torch.zeros(len(token_ids), dtype=torch.bool)
    if drafts is not None:
        accepted = drafts == token_ids

    random = metadata.random
    if random is not None:
        probs = _truncate(logits[random.rows], random)
        q = torch.empty_like(probs)
        u = torch.empty(len(random.rows))
        for j in range(len(random.rows)):
            generator = random.generators.get(j)
            q[j].exponential_(generator=generator)
            if drafts is not None:
                u[j : j + 1].uniform_(generator=generator)
        if drafts is not None:
            row_drafts = drafts[random.rows]
            has = row_drafts >= 0
            draft_ids = row_drafts.clamp(min=0)[:, None]
            p_draft = probs.gather(1, draft_ids)[:, 0]
            accepted[random.rows] = has & (u < p_draft)
            # A rejected draft: sample from p without it (the residual max(0, p - q), normalised).
            probs = torch.where(has[:, None], probs.scatter(1, draft_ids, 0.0), probs)
        token_ids[random.rows] = argmax(probs / q)

    if drafts is not None:
        token_ids = torch.where(accepted, drafts, token_ids)
    ids = token_ids.tolist()
    return SamplerOutput(
        token_ids=ids, logprobs=_logprobs(logits, ids, metadata.logprobs), accepted=accepted.tolist()
    )
