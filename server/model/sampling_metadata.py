"""One step's sampling inputs as tensors (`SamplingMetadata`), built by the model runner from the
requests that sample, so the sampler works on tensors and reads no request objects (vLLM v1's
`SamplingMetadata`, built by its model runner's input batch).

Row i of every per-row tensor belongs to row i of the step's logits. Parts no row uses are None (or
empty), so a step of greedy rows without penalties, bias or grammar costs the sampler one argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.server.engine.request import Request
from conveyor.server.engine.structured_output import grammar_bitmask

MAX_LOGPROBS = 20


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

    rows: `[R]` int64 logits rows, also as the Python list `row_list`. temperature: `[R, 1]` float32 (> 0).
    min_p: `[R, 1]` float32, or None when no row uses it. top_k: `[R]` int64 (vocab_size where off) and
    top_p: `[R, 1]` float32 (1 where off), both None when no row uses either. generators: position in
    `rows` -> the request's generator (a seeded request's own, so its draws do not depend on the batch;
    the engine gives the others its shared one); rows without one draw from torch's default generator.
    """

    rows: torch.Tensor
    row_list: list[int]
    temperature: torch.Tensor
    min_p: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    generators: dict[int, torch.Generator]


@dataclass(frozen=True)
class SamplingMetadata:
    """Everything `conveyor.server.model.sampler.sample` needs for one step of `num_rows` rows.

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

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int) -> SamplingMetadata:
        """The step's sampling inputs; requests[i] owns logits row i. logit_bias token ids must be in
        [0, vocab_size) (the API validates them); stop and EOS ids outside it are left out of the bans,
        and output ids outside it out of the penalties."""
        grammar_rows = [
            i for i, r in enumerate(requests) if r.grammar is not None and not r.grammar.is_terminated()
        ]
        bitmask = (
            grammar_bitmask([r.grammar for r in requests], grammar_rows, vocab_size) if grammar_rows else None
        )
        return cls(
            num_rows=len(requests),
            grammar_rows=grammar_rows,
            grammar_bitmask=bitmask,
            logit_bias=_logit_bias(requests),
            penalties=_penalties(requests, vocab_size),
            banned=_banned(requests, vocab_size),
            random=_truncation(requests, vocab_size),
            logprobs=[
                None if r.sampling_params.logprobs is None else min(r.sampling_params.logprobs, MAX_LOGPROBS)
                for r in requests
            ],
        )


def _flat(pairs: list[tuple[int, list[int]]], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[(row, token ids)] -> (rows, token ids) as flat int64 tensors, ids outside the vocabulary dropped."""
    rows = [row for row, ids in pairs for t in ids if 0 <= t < vocab_size]
    ids = [t for _, ids in pairs for t in ids if 0 <= t < vocab_size]
    return torch.tensor(rows, dtype=torch.long), torch.tensor(ids, dtype=torch.long)


def _logit_bias(requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    biased = [
        (row, r.sampling_params.logit_bias) for row, r in enumerate(requests) if r.sampling_params.logit_bias
    ]
    if not biased:
        return None
    rows = torch.tensor([row for row, bias in biased for _ in bias], dtype=torch.long)
    ids = torch.tensor([t for _, bias in biased for t in bias], dtype=torch.long)
    values = torch.tensor([v for _, bias in biased for v in bias.values()], dtype=torch.float32)
    return rows, ids, values


def _penalties(requests: list[Request], vocab_size: int) -> Penalties | None:
    rows = [
        i
        for i, r in enumerate(requests)
        if r.sampling_params.repetition_penalty != 1.0
        or r.sampling_params.presence_penalty
        or r.sampling_params.frequency_penalty
    ]
    if not rows:
        return None
    params = [requests[i].sampling_params for i in rows]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32)[:, None]

    def per_row_counts(token_lists: list[list[int]]) -> torch.Tensor:
        """`[P, vocab_size]` counts of each row's tokens, by one bincount over `row * vocab + token`."""
        flat_rows, flat_ids = _flat(list(enumerate(token_lists)), vocab_size)
        counts = torch.bincount(flat_rows * vocab_size + flat_ids, minlength=len(token_lists) * vocab_size)
        return counts.view(len(token_lists), vocab_size)

    repetition = any(p.repetition_penalty != 1.0 for p in params)
    additive = any(p.presence_penalty or p.frequency_penalty for p in params)
    return Penalties(
        rows=torch.tensor(rows, dtype=torch.long),
        repetition=column([p.repetition_penalty for p in params]) if repetition else None,
        seen=per_row_counts([requests[i].all_token_ids for i in rows]) > 0 if repetition else None,
        presence=column([p.presence_penalty for p in params]) if additive else None,
        frequency=column([p.frequency_penalty for p in params]) if additive else None,
        output_counts=(
            per_row_counts([requests[i].output_token_ids for i in rows]).float() if additive else None
        ),
    )


def _banned(requests: list[Request], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Before `min_tokens` outputs, EOS and stop token ids cannot be sampled (vLLM's min_tokens). A
    request with a grammar is left to it: the grammar alone says when its output may end."""
    pairs = []
    for row, r in enumerate(requests):
        p = r.sampling_params
        if len(r.output_token_ids) < p.min_tokens and r.grammar is None:
            ids = list(p.stop_token_ids)
            if r.eos_token_id is not None and not p.ignore_eos:
                ids.append(r.eos_token_id)
            if ids:
                pairs.append((row, ids))
    return _flat(pairs, vocab_size) if pairs else None


def _truncation(requests: list[Request], vocab_size: int) -> Truncation | None:
    rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
    if not rows:
        return None
    params = [requests[i].sampling_params for i in rows]
    uses_top = any(p.top_k > 0 or p.top_p < 1 for p in params)
    return Truncation(
        rows=torch.tensor(rows, dtype=torch.long),
        row_list=rows,
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32)[:, None],
        min_p=(
            torch.tensor([p.min_p for p in params], dtype=torch.float32)[:, None]
            if any(p.min_p > 0 for p in params)
            else None
        ),
        top_k=torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params]) if uses_top else None,
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32)[:, None] if uses_top else None,
        generators={
            j: requests[i].generator for j, i in enumerate(rows) if requests[i].generator is not None
        },
    )
