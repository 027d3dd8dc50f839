"""Draft-model speculative decoding (vLLM's `draft_model` method): a smaller model with the target's
vocabulary proposes each draft greedily, one forward of it per draft token, batched over the requests
that draft.

The draft model's K/V lives in its own cache tensors (`ModelRunner.allocate_kv_cache` of the draft's
runner, as many blocks as the target's) addressed by the target's block tables: a position's draft K/V
sits in the same block and slot as its target K/V, so the blocks the scheduler allocates, frees and
preempts hold both, and the KV pool is sized by the two models' bytes per token together. What the
draft has written for a request is `DraftKV` on the request (`Request.draft_state`); only the part that
still matches the request's tokens is reused, so rejected drafts cost nothing to roll back. Preemption
frees the blocks and the scheduler drops the state with them; a prefix-cache hit is not trusted for the
draft (its K/V there may never have been written), so a new request's draft K/V is computed from its
first token.

Order within a step: the drafter reserves each request's draft length before scheduling (`propose`,
placeholder tokens the scheduler budgets like any draft), the scheduler allocates blocks for them, then
`fill` runs the draft model over the scheduled requests and writes the real draft tokens, before the
target verifies them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from conveyor.server.engine.request import Request
from conveyor.server.engine.scheduler import ScheduledRequest
from conveyor.server.engine.speculative import StepCost
from conveyor.server.model.runner import ModelRunner, pack_rows

# Placeholder of a reserved draft position until `fill` writes the draft model's token.
PENDING = -1


@dataclass
class DraftKV:
    """The tokens whose draft-model K/V are written at positions 0..len-1 of the request's blocks; the
    first `known` of them were the request's own tokens when written (the rest are draft tokens)."""

    tokens: list[int] = field(default_factory=list)
    known: int = 0

    def valid(self, request: Request) -> int:
        """Positions whose draft K/V still hold: the common prefix with the request's tokens, within the
        target's computed positions (later ones were rejected drafts). A request's tokens only grow at
        the end, so only the draft tokens past `known` are compared."""
        limit = min(len(self.tokens), request.num_computed_tokens)
        n = min(self.known, limit)
        while n < limit and self.tokens[n] == request.all_token_ids[n]:
            n += 1
        return n


class DraftModel:
    """The draft model's runner (KV cache allocated with the target's number of blocks) and its step
    times: `cost` fits `fixed + per_token * T` seconds to the draft's one-token-per-request forwards, so
    the drafter can charge each draft position its share of them."""

    def __init__(self, runner: ModelRunner, cost: StepCost) -> None:
        self.runner = runner
        self.cost = cost

    def lag(self, request: Request) -> int:
        """Tokens of `request` the draft model would compute before drafting: those past its K/V."""
        state = request.draft_state
        return request.num_tokens - (state.valid(request) if isinstance(state, DraftKV) else 0)

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Reserve `max_tokens` draft positions (`PENDING`); `fill` writes them after scheduling."""
        return [PENDING] * max(max_tokens, 0)

    @torch.inference_mode()
    def fill(self, scheduled: list[ScheduledRequest]) -> None:
        """Write the draft tokens of every scheduled request with reserved positions, in place in
        `ScheduledRequest.spec_token_ids` (the scheduler may have trimmed them to its budget).

        The first forward catches each request's draft K/V up to its last known token and drafts one
        token; each further forward feeds the previous draft token of the requests still drafting. The
        draft tokens are the draft model's argmax."""
        drafting = [s for s in scheduled if s.spec_token_ids]
        if not drafting:
            return
        start = time.perf_counter()
        rows = []
        for s in drafting:
            request = s.request
            state = request.draft_state
            if not isinstance(state, DraftKV):
                state = request.draft_state = DraftKV()
            valid = state.valid(request)
            del state.tokens[valid:]
            rows.append((request.all_token_ids[valid:], valid, request.block_table))
            state.tokens.extend(request.all_token_ids[valid:])
            state.known = len(state.tokens)
        tokens = self._argmax(rows, [s.request for s in drafting])
        # Each forward's time, its preparation included, fits the draft's cost (`cost`).
        self.cost.observe(sum(len(row[0]) for row in rows), time.perf_counter() - start)
        for depth in range(max(len(s.spec_token_ids) for s in drafting)):
            live = [i for i, s in enumerate(drafting) if depth < len(s.spec_token_ids)]
            for i in live:
                drafting[i].spec_token_ids[depth] = tokens[i]
            feed = [i for i in live if depth + 1 < len(drafting[i].spec_token_ids)]
            if not feed:
                break
            start = time.perf_counter()
            rows = []
            for i in feed:
                request = drafting[i].request
                rows.append(([tokens[i]], request.num_tokens + depth, request.block_table))
                request.draft_state.tokens.append(tokens[i])
            for i, token in zip(feed, self._argmax(rows, [drafting[i].request for i in feed]), strict=True):
                tokens[i] = token
            self.cost.observe(len(rows), time.perf_counter() - start)
        for s in drafting:
            s.request.spec_token_ids = list(s.spec_token_ids)

    def finished(self, request: Request) -> None:
        """The draft K/V of a finished request goes with its blocks."""

    def clear(self) -> None:
        """Nothing kept across requests."""

    def _argmax(self, rows: list[tuple[list[int], int, list[int]]], requests: list[Request]) -> list[int]:
        rope_floors = [r.rope_length for r in requests] if self.runner.rope_by_length else None
        logits = self.runner.forward(pack_rows(rows, self.runner.block_size, rope_floors))
        return logits.argmax(dim=-1).tolist()
