"""Speculative decoding's drafting side: who drafts, how many tokens, and from where.

Each step, before the scheduler plans it, `Drafter.propose` gives every running request in decode a
draft (`Request.spec_token_ids`): tokens the request is likely to produce next. The scheduler budgets
them beside the request's one real token (they count against `max_num_batched_tokens` and KV blocks),
the model runner computes all of them in the same packed step as other work, and the sampler checks
each draft position against the model's own distribution there (`sampler.sample` with drafts: greedy
rows accept a draft token that is the argmax; random rows accept it with probability p(token), since an
n-gram draft is deterministic, and else draw from p without it, the speculative-sampling rule of
Leviathan et al., ICML 2023, and Chen et al., 2023, so outputs keep the non-speculative distribution).
The longest accepted prefix plus one token from the model come out of the step; the K/V of rejected
positions lies past `num_computed_tokens` and is overwritten later (`Scheduler.update_from_output`).

Proposers: n-gram prompt lookup (vLLM's `ngram` method): the tokens that followed the latest earlier
occurrence of the sequence's last n tokens (prompt and output), n from `prompt_lookup_max` down to
`prompt_lookup_min`; suffix decoding (vLLM's `suffix`): the same over the sequence's own tokens and the
outputs of recent finished requests, the draft's length following the match's. At each draft
position, penalties count the drafts before it as outputs and a structured-output grammar's mask is
the grammar's after them (`structured_output.grammar_bitmask`).

How many: a draft token costs compute in the step; it pays only when it is likely to be accepted and
the step is not compute-bound already. With a step of T tokens costing `a + b * T` seconds (measured at
start, `measure_step_cost`, then fitted to the decode steps as they run, `StepCost`), a draft position
j (1-based) of a request whose positions are accepted with probability alpha is worth proposing when
`alpha ** j >= b * T / (a + b * T)`: the chance it is used against its share of the step's time. So a
lone sequence drafts up to `num_speculative_tokens` tokens, and a big batch (T large, the ratio near 1)
stops drafting. A draft model (`draft_model.DraftModel`) adds its own forwards to each position's cost
(`a_d + b_d * T`, fitted the same way: `b + b_d + a_d / D` in place of `b`, D the requests that draft),
and to the first position the tokens its cache lacks, spread over the tokens the request may still
produce (up to 64). alpha is each request's acceptance rate, decayed so it follows recent text,
starting from the engine's overall rate, itself optimistic before anything was verified (and one
request drafts at a time while it rests on few verified positions); a request that stopped drafting
for a low rate sees its old misses fade each step, and the engine's rate drifts back up while nobody
drafts, so drafting is tried again later.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from conveyor.server.config import SpeculativeMethod
from conveyor.server.engine.request import Request
from conveyor.server.messages import SpecDecodingStats

# Weight of older acceptance counts after each verification (per request and engine-wide).
_DECAY = 0.7
# Acceptance rate assumed before any draft was verified: optimistic, so the first steps draft and
# measure it (a pessimistic guess below the threshold would never be tested).
_PRIOR_ACCEPTANCE = 1.0
# Verified positions (decayed) below which the engine's rate is a guess: one request drafts at a time.
_CONFIDENT_POSITIONS = 8.0
# Weight of the engine's acceptance counts after each step in which no request drafts.
_IDLE_DECAY = 0.998
# Candidate earlier occurrences checked per lookup, latest first.
_MAX_CANDIDATES = 16


class NgramIndex:
    """Where each `n`-gram of one request's tokens ended, latest last, extended as tokens are appended.

    `positions[gram]` lists the indexes just past every occurrence of `gram` (a tuple of `n` token ids)
    that ends before the sequence's last token, so a lookup of the sequence's own suffix finds only
    earlier occurrences.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.positions: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # grams ending at indexes below this are in `positions`

    def update(self, tokens: list[int]) -> None:
        n = self.n
        for end in range(max(self.indexed, n), len(tokens)):
            self.positions.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self.indexed = max(self.indexed, len(tokens))


def longest_match(
    tokens: list[int], candidates: list[tuple[list[int], int]], n_min: int, n_max: int
) -> tuple[list[int], int, int] | None:
    """The candidate whose tokens before `end` match the longest suffix of `tokens` (at least `n_min`
    tokens, which every candidate matches; at most `n_max`), latest first among equals: `(candidate
    tokens, end, match length)`, or None without candidates. candidates: `(tokens, end)`, oldest first;
    only the last _MAX_CANDIDATES are checked."""
    best = None
    for seq, end in reversed(candidates[-_MAX_CANDIDATES:]):
        length = n_min
        while length < n_max and end - length - 1 >= 0 and seq[end - length - 1] == tokens[-length - 1]:
            length += 1
        if best is None or length > best[2]:
            best = (seq, end, length)
        if length == n_max:
            break
    return best


class NgramProposer:
    """Prompt lookup over a request's prompt and output. Per-request state lives on the request
    (`Request.draft_state`), so it goes when the request does."""

    cost = None  # drafting takes no model forward

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def own_match(self, request: Request) -> tuple[list[int], int, int] | None:
        """The longest earlier occurrence of the request's suffix in its own tokens (`longest_match`)."""
        tokens = request.all_token_ids
        if len(tokens) <= self.n_min:
            return None
        index = request.draft_state
        if index is None:
            index = request.draft_state = NgramIndex(self.n_min)
        index.update(tokens)
        ends = index.positions.get(tuple(tokens[-self.n_min :]), [])
        return longest_match(
            tokens, [(tokens, end) for end in ends[-_MAX_CANDIDATES:]], self.n_min, self.n_max
        )

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to `max_tokens` draft tokens continuing `request.all_token_ids`, or [] when its last
        `prompt_lookup_min` tokens occurred nowhere before."""
        match = self.own_match(request) if max_tokens > 0 else None
        if match is None:
            return []
        seq, end, _ = match
        return seq[end : end + max_tokens]

    def fill(self, scheduled: list) -> None:
        """The drafts are final when proposed."""

    def finished(self, request: Request) -> None:
        """Prompt lookup keeps nothing of finished requests."""

    def clear(self) -> None:
        """Nothing to forget."""


class SuffixProposer(NgramProposer):
    """Suffix decoding (SuffixDecoding, Oliaro et al., 2024; vLLM's `suffix`): the longest match of the
    sequence's suffix, up to `max_depth` tokens, in its own tokens or in the outputs of the last
    `max_cached_requests` finished requests (agentic and repeated traffic produces the same spans again),
    drafting at most `max_spec_factor` tokens per matched token. Matches are found through an index of
    2-grams rather than suffix trees; the longest match wins, its latest occurrence among equals."""

    MIN_MATCH = 2

    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float) -> None:
        super().__init__(self.MIN_MATCH, max_depth)
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.outputs: dict[int, list[int]] = {}  # cached outputs by insertion number, oldest first
        self.positions: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # 2-gram -> (output, end)
        self._next = 0

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to `max_tokens` draft tokens, fewer where the match is short; [] without a match."""
        if max_tokens <= 0:
            return []
        tokens = request.all_token_ids
        matches = [self.own_match(request)]
        if len(tokens) >= self.MIN_MATCH and self.outputs:
            hits = self.positions.get(tuple(tokens[-self.MIN_MATCH :]), [])
            cached = [(self.outputs[i], end) for i, end in hits[-_MAX_CANDIDATES:]]
            matches.append(longest_match(tokens, cached, self.n_min, self.n_max))
        found = [m for m in matches if m is not None]
        if not found:
            return []
        seq, end, length = max(found, key=lambda m: m[2])  # the request's own match first among equals
        return seq[end : end + min(max_tokens, max(1, int(self.max_spec_factor * length)))]

    def finished(self, request: Request) -> None:
        """Cache the output of a request that finished, dropping the oldest beyond the bound."""
        output = list(request.output_token_ids)
        if len(output) <= self.MIN_MATCH:
            return
        number, self._next = self._next, self._next + 1
        self.outputs[number] = output
        self._index(number, output, add=True)
        if len(self.outputs) > self.max_cached_requests:
            oldest = next(iter(self.outputs))
            self._index(oldest, self.outputs.pop(oldest), add=False)

    def clear(self) -> None:
        """Forget every cached output."""
        self.outputs.clear()
        self.positions.clear()

    def _index(self, number: int, output: list[int], add: bool) -> None:
        n = self.MIN_MATCH
        for end in range(n, len(output)):  # grams followed by at least one token
            gram = tuple(output[end - n : end])
            if add:
                self.positions.setdefault(gram, []).append((number, end))
                continue
            entries = self.positions[gram]
            entries.remove((number, end))
            if not entries:
                del self.positions[gram]


class StepCost:
    """A step of T tokens (each with its logits) takes about `fixed + per_token * T` seconds: a weighted
    least-squares line through two points measured at start (`measure_step_cost`, each weighted as
    PRIOR_WEIGHT steps) and the decode steps seen since (`observe`, older ones decayed by DECAY per
    step), so it follows what steps really cost here: long contexts, sampling, the machine's load."""

    PRIOR_WEIGHT = 4.0
    DECAY = 0.98

    def __init__(self, points: list[tuple[int, float]]) -> None:
        self._prior = [0.0] * 5
        self._seen = [0.0] * 5  # decayed sums of 1, T, T^2, t, T * t
        for num_tokens, seconds in points:
            self._add(self._prior, num_tokens, seconds, self.PRIOR_WEIGHT)
        self._solve()

    @staticmethod
    def _add(sums: list[float], num_tokens: int, seconds: float, weight: float) -> None:
        for i, value in enumerate((1.0, num_tokens, num_tokens**2, seconds, num_tokens * seconds)):
            sums[i] += weight * value

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One decode step of `num_tokens` tokens that took `seconds`."""
        self._seen = [self.DECAY * v for v in self._seen]
        self._add(self._seen, num_tokens, seconds, 1.0)
        self._solve()

    def _solve(self) -> None:
        n, t, tt, y, ty = (a + b for a, b in zip(self._prior, self._seen, strict=True))
        spread = n * tt - t * t
        slope = (n * ty - t * y) / spread if spread > 0 else 0.0
        self.per_token = max(slope, 0.0)
        self.fixed = max((y - self.per_token * t) / n, 0.0)

    def share(self, num_tokens: int, seconds: float) -> float:
        """`seconds` over the time per token of a step of `num_tokens` tokens: the acceptance chance a
        draft position costing `seconds` must reach to pay."""
        step = self.fixed + self.per_token * num_tokens
        return seconds * num_tokens / step if step > 0 else float("inf")

    def draft_threshold(
        self, num_tokens: int, draft: StepCost | None = None, sharers: int | None = None
    ) -> float:
        """The acceptance chance a draft position must reach in a step of `num_tokens` other tokens: its
        cost (this step's time per token, plus with a draft model `draft` that model's time per token
        and its share of one forward over the `sharers` requests that draft, default all) over the
        step's time per token."""
        cost = self.per_token
        if draft is not None:
            cost += draft.per_token + draft.fixed / max(sharers or num_tokens, 1)
        return min(self.share(num_tokens, cost), 1.0)


def measure_step_cost(run, repeats: int = 5, num_tokens: int = 64) -> StepCost:
    """The StepCost through the median of `repeats` timings of `run(1)` and of `run(num_tokens)` (a
    forward of that many tokens with the logits of each, `ModelRunner.profile(n, all_logits=True)`),
    taken in turn after one warm-up of each, so a busy moment of the machine shifts both alike."""
    times: dict[int, list[float]] = {1: [], num_tokens: []}
    for i in range(repeats + 1):
        for n in times:
            start = time.perf_counter()
            run(n)
            if i:  # the first round warms up
                times[n].append(time.perf_counter() - start)
    return StepCost([(n, statistics.median(t)) for n, t in times.items()])


@dataclass
class _Acceptance:
    """Decayed counts of accepted and verified draft positions."""

    accepted: float = 0.0
    verified: float = 0.0

    def rate(self, prior: float) -> float:
        return (self.accepted + prior) / (self.verified + 1.0)

    def add(self, accepted: int, verified: int, decay: float = _DECAY) -> None:
        self.accepted = decay * self.accepted + accepted
        self.verified = decay * self.verified + verified


class Drafter:
    """Proposes each step's drafts (`propose`) and learns from their verification (`record`).

    method: the parsed `--speculative-config`. step_cost: the machine's step times, for the adaptive
    draft length; None when `disable_by_batch_size` is set (drafting then stops above that many
    requests, vLLM's rule, and otherwise always drafts up to `num_speculative_tokens`). draft_model:
    the proposer of the `draft_model` method (`draft_model.DraftModel`, built with the draft's runner);
    the n-gram and suffix proposers are made here.
    """

    def __init__(self, method: SpeculativeMethod, step_cost: StepCost | None, draft_model=None) -> None:
        self.method = method
        self.num_speculative_tokens = method.num_speculative_tokens
        if method.method == "draft_model":
            if draft_model is None:
                raise ValueError("the draft_model method needs the draft model's runner")
            self.proposer = draft_model
        elif method.method == "suffix":
            self.proposer = SuffixProposer(
                method.suffix_decoding_max_tree_depth,
                method.suffix_decoding_max_cached_requests,
                method.suffix_decoding_max_spec_factor,
            )
        else:
            self.proposer = NgramProposer(method.prompt_lookup_min, method.prompt_lookup_max)
        self.step_cost = step_cost
        self.overall = _Acceptance()
        self.stats = SpecDecodingStats.empty(self.num_speculative_tokens)
        self.total_draft_tokens = 0  # over the engine's life (benchmarks read them)
        self.total_accepted_tokens = 0

    def _draft_lengths(self, running: list[Request], num_waiting: int) -> dict[str, int] | None:
        """Per request id, the most draft tokens worth proposing this step (None: none at all)."""
        limit = self.method.disable_by_batch_size
        if limit is not None:
            return None if len(running) + num_waiting > limit else {}
        prior = self.overall.rate(_PRIOR_ACCEPTANCE)
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        # A draft model's forwards are shared by the requests that draft: guess all of those in decode,
        # then as many as would draft at that price, until the guess holds (each guess is smaller).
        sharers = len(decoding)
        while True:
            threshold = (
                self.step_cost.draft_threshold(len(running), self.proposer.cost, sharers)
                if self.step_cost is not None
                else 0.0
            )
            lengths = {r.request_id: self._length(r, prior, len(running), threshold) for r in decoding}
            drafting = [i for i, k in lengths.items() if k]
            if self.overall.verified < _CONFIDENT_POSITIONS:
                # The rate is mostly the prior (at start, or after a long spell without drafts): one
                # request drafts, so finding out costs one sequence's drafts (a draft model's catch-up).
                lengths.update(dict.fromkeys(drafting[1:], 0))
                drafting = drafting[:1]
            if self.proposer.cost is None or not drafting or len(drafting) >= sharers:
                break
            sharers = len(drafting)
        for request in decoding:
            if not lengths[request.request_id] and request.draft_acceptance is not None:
                request.draft_acceptance.add(0, 0)  # a step without drafts fades old misses: it retries later
        if decoding and not any(lengths.values()):
            # Nobody drafts: the engine's rate drifts slowly back to the optimistic prior, so drafting
            # is tried again now and then (traffic changes) at the cost of an occasional step.
            self.overall.add(0, 0, _IDLE_DECAY)
        return lengths

    def _length(self, request: Request, prior: float, num_tokens: int, threshold: float) -> int:
        """The draft positions of `request` worth their cost in a step of `num_tokens` requests, each
        position needing the acceptance chance `threshold` (`StepCost.draft_threshold`)."""
        acceptance = request.draft_acceptance
        alpha = acceptance.rate(prior) if acceptance is not None else prior
        step_cost, draft_cost = self.step_cost, self.proposer.cost
        first = threshold
        if step_cost is not None and draft_cost is not None:
            # A draft model first computes the tokens its cache lacks (the prompt, for a new request):
            # the first position also pays that, spread over what the request may still produce (at
            # most 64 tokens).
            horizon = min(max(request.sampling_params.max_tokens - len(request.output_token_ids), 1), 64)
            catch_up = self.proposer.lag(request) * draft_cost.per_token / horizon
            first += step_cost.share(num_tokens, catch_up)
        k, chance = 0, alpha
        while k < self.num_speculative_tokens and chance >= (threshold if k else first):
            k, chance = k + 1, chance * alpha
        return k

    def propose(self, running: list[Request], num_waiting: int, max_model_len: int) -> None:
        """Set `spec_token_ids` of every running request: a draft for those in decode that may draft,
        [] for the rest. A draft never takes a request past `max_tokens` or `max_model_len`."""
        lengths = self._draft_lengths(running, num_waiting)
        for request in running:
            request.spec_token_ids = []
            if lengths is None or request.num_tokens - request.num_computed_tokens != 1:
                continue
            params = request.sampling_params
            room = min(
                params.max_tokens - len(request.output_token_ids) - 1,
                max_model_len - request.num_tokens - 1,
                lengths.get(request.request_id, self.num_speculative_tokens),
            )
            request.spec_token_ids = self.proposer.propose(request, room)

    def fill(self, scheduled: list) -> None:
        """After scheduling: write the drafts a draft model only reserved in `propose` (the scheduled
        requests' `spec_token_ids`, as the scheduler trimmed them)."""
        self.proposer.fill(scheduled)

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """Learn from one verification: `num_accepted` of the request's `num_drafted` draft tokens."""
        if not num_drafted:
            return
        verified = num_accepted + (num_accepted < num_drafted)  # positions checked: up to the first miss
        if request.draft_acceptance is None:
            request.draft_acceptance = _Acceptance()
        request.draft_acceptance.add(num_accepted, verified)
        self.overall.add(num_accepted, verified)
        self.stats.add(num_drafted, num_accepted)
        self.total_draft_tokens += num_drafted
        self.total_accepted_tokens += num_accepted

    def finished(self, request: Request) -> None:
        """A request finished (its output may seed later drafts)."""
        self.proposer.finished(request)

    def clear_cache(self) -> None:
        """Forget the finished requests' outputs kept to draft from (the suffix method's)."""
        self.proposer.clear()

    def verified(self, scheduled: list, sampled: dict[str, list[int]], seconds: float) -> None:
        """Learn from a step that took `seconds`: each scheduled request's draft against its new tokens
        (`sampled`, by request id: the accepted drafts, then one more), and the step's time."""
        for sched in scheduled:
            tokens = sampled.get(sched.request.request_id)
            if sched.spec_token_ids and tokens:
                self.record(sched.request, len(sched.spec_token_ids), len(tokens) - 1)
        self._observe_step(scheduled, seconds)

    def _observe_step(self, scheduled: list, seconds: float) -> None:
        """Time a step that took `seconds`, for the step cost, if every request in it decoded (a
        prefill chunk's tokens cost differently: they skip the logits)."""
        if self.step_cost is not None and all(
            s.samples and s.num_new_tokens == 1 + len(s.spec_token_ids) for s in scheduled
        ):
            self.step_cost.observe(sum(s.num_new_tokens for s in scheduled), seconds)

    def take_stats(self) -> SpecDecodingStats | None:
        """The counts since the last call, or None when nothing was drafted."""
        stats = self.stats
        if not stats.num_drafts:
            return None
        self.stats = SpecDecodingStats.empty(self.num_speculative_tokens)
        return stats
