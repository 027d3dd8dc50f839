"""Turns the logits of one step into next tokens, one row per sampling request.

Order of operations as in vLLM's sampler: the structured-output grammar's bitmask, logit bias, penalties, then (for log-probabilities) the raw
distribution, then temperature, min_p, top_k and top_p truncation, then sampling. Random rows sample by
the exponential race `argmax(p / q)`, `q ~ Exp(1)`, which equals drawing from `p`; a request with a seed
draws its `q` from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from conveyor.server.engine.request import Logprob, Request
from conveyor.server.engine.structured_output import apply_grammar_bitmask

MAX_LOGPROBS = 20


@dataclass
class SamplerOutput:
    """token_ids: `[num_rows]` int64 sampled ids; logprobs: per row, a Logprob or None."""

    token_ids: list[int]
    logprobs: list[Logprob | None]


def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
    """In place: each row's `logit_bias` added to its logits (ids validated in [0, vocab))."""
    for row, request in enumerate(requests):
        bias = request.sampling_params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long)
            logits[row, ids] += torch.tensor(list(bias.values()), dtype=torch.float32)


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """In place. logits: `[num_rows, vocab_size]` float32."""
    vocab = logits.shape[1]
    for row, request in enumerate(requests):
        p = request.sampling_params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long)
            seen = seen[seen < vocab]
            vals = logits[row, seen]
            logits[row, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
            counts = torch.bincount(torch.tensor(request.output_token_ids), minlength=vocab)[:vocab]
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _mask_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """Before `min_tokens` outputs, EOS and stop token ids cannot be sampled (vLLM's min_tokens).
    A request with a grammar is left to it: the grammar alone says when its output may end."""
    for row, request in enumerate(requests):
        p = request.sampling_params
        if len(request.output_token_ids) < p.min_tokens and request.grammar is None:
            banned = list(p.stop_token_ids)
            if request.eos_token_id is not None and not p.ignore_eos:
                banned.append(request.eos_token_id)
            if banned:
                logits[row, banned] = float("-inf")


def _truncate(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p on the random rows. Returns probabilities `[rows, vocab]`."""
    temps = torch.tensor([r.sampling_params.temperature for r in requests], dtype=torch.float32)
    logits = logits / temps[:, None]
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([r.sampling_params.min_p for r in requests], dtype=torch.float32)
    if bool((min_p > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    top_k = torch.tensor([r.sampling_params.top_k for r in requests])
    top_p = torch.tensor([r.sampling_params.top_p for r in requests], dtype=torch.float32)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[1])[None, :]
        k = torch.where(top_k > 0, top_k, probs.shape[1])
        drop = rank >= k[:, None]
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it does.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_p[:, None] * sorted_probs.masked_fill(drop, 0).sum(-1, keepdim=True)
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    return probs


def sample(logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
    """Sample one token per row.

    logits: `[num_rows, vocab_size]` (any float dtype; computed in float32); row i belongs to
    requests[i]. Log-probabilities, when asked for, are of the model's distribution after the grammar's
    mask, logit bias and penalties and before temperature and truncation (vLLM's default "raw" log-probabilities; with
    a logit_bias they are of the biased distribution, as OpenAI's are).
    """
    logits = logits.to(torch.float32, copy=True)  # penalties and masks work in place
    apply_grammar_bitmask(logits, [r.grammar for r in requests])
    _apply_logit_bias(logits, requests)
    _apply_penalties(logits, requests)
    _mask_min_tokens(logits, requests)
    num_rows = logits.shape[0]
    token_ids = logits.argmax(dim=-1)

    random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
    if random_rows:
        sub = [requests[i] for i in random_rows]
        probs = _truncate(logits[random_rows], sub)
        q = torch.empty_like(probs)
        for j, request in enumerate(sub):
            q[j].exponential_(generator=request.generator)
        token_ids[random_rows] = (probs / q).argmax(dim=-1)

    want = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    logprobs: list[Logprob | None] = [None] * num_rows
    if want:
        lp = logits[want].log_softmax(dim=-1)
        max_k = max(min(requests[i].sampling_params.logprobs or 0, MAX_LOGPROBS) for i in want)
        top_vals, top_ids = lp.topk(max(max_k, 1), dim=-1)
        for j, i in enumerate(want):
            k = min(requests[i].sampling_params.logprobs or 0, MAX_LOGPROBS)
            tid = int(token_ids[i])
            # Tokens a grammar or min_tokens banned have logprob -inf: not alternatives, and not JSON.
            top = [
                (t, v)
                for t, v in zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist(), strict=True)
                if v > -math.inf
            ]
            logprobs[i] = Logprob(tid, float(lp[j, tid]), top)
    return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)
