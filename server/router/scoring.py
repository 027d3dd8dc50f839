"""Which replica serves a request: filter, weighted scorers, picker (pure; no I/O).

The shape of llm-d's endpoint picker: filter the replicas (ready, queue under the limit), score each
remaining one in [0, 1] per scorer, sum the scores times their weights, take the best. Scorers:

    queue   (max_load - load) / (max_load - min_load) over the candidates (1 when all are equal);
            load = waiting + running requests, the router's own sends counted at decision time
    kv      1 - KV cache usage
    prefix  leading prompt blocks the replica holds / the prompt's full blocks; 0 for a replica whose
            load exceeds the least-loaded candidate's by more than `load_gate` (affinity never keeps
            feeding a replica that is far behind)
    lora    for a request naming a LoRA adapter: 1 where the adapter is resident (requests of it run or
            wait there), 0.5 where a slot is free to take it, else 0 (the Gateway API Inference
            Extension's LoRA affinity); replicas that do not serve the adapter are filtered out first,
            unless none serves it (the replica then answers 404 itself)

Ties (equal totals) are broken at random per request, so idle replicas share a burst instead of the
first one taking it. `least-load` is `prefix-aware` with the prefix weight at 0; `round-robin` takes
the candidates in turn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from conveyor.server.router.config import Policy

_TIE = 1e-9


@dataclass(frozen=True)
class Candidate:
    """What the router knows about one replica when a request arrives.

    waiting: requests queued at the replica (its `num_requests_waiting`, plus what this router sent since
    that was read beyond the replica's free batch slots); load: requests at the replica, waiting or running (same estimate); kv_usage: 0-1;
    prefix_blocks: leading blocks of this request's prompt the replica holds.
    """

    name: str
    ready: bool
    waiting: int
    load: int
    kv_usage: float = 0.0
    prefix_blocks: int = 0
    serves_adapter: bool = True  # the request's adapter is served there (True for a base-model request)
    adapter_affinity: float = 0.0  # the lora score's input: 1 resident, 0.5 a free slot, 0 neither


@dataclass(frozen=True)
class Weights:
    queue: float = 1.0
    kv: float = 1.0
    prefix: float = 2.0
    lora: float = 1.0


@dataclass(frozen=True)
class Decision:
    """The pick. `endpoint` None means nobody can take the request now: `reason` is `no-ready` (wait)
    or `saturated` (429). Otherwise `reason` is `prefix` (the pick holds part of the prompt), `adapter`
    (the pick has the request's LoRA adapter resident), `gated` (a holder was skipped by the load
    gate), `load` or `round-robin`."""

    endpoint: str | None
    reason: str
    scores: dict[str, float]


def pick(
    candidates: list[Candidate],
    policy: Policy,
    weights: Weights,
    *,
    prompt_blocks: int,
    load_gate: int,
    max_waiting: int,
    rng: random.Random,
    turn: int = 0,
) -> Decision:
    """Choose a replica for one request. `turn`: the round-robin counter (the caller increments it)."""
    ready = [c for c in candidates if c.ready]
    if not ready:
        return Decision(None, "no-ready", {})
    ready = [c for c in ready if c.serves_adapter] or ready
    eligible = [c for c in ready if c.waiting < max_waiting]
    if not eligible:
        return Decision(None, "saturated", {})
    if policy == "round-robin":
        ordered = sorted(eligible, key=lambda c: c.name)
        return Decision(ordered[turn % len(ordered)].name, "round-robin", {})

    prefix_weight = weights.prefix if policy == "prefix-aware" and prompt_blocks else 0.0
    low = min(c.load for c in eligible)
    high = max(c.load for c in eligible)
    scores: dict[str, float] = {}
    gated = False
    for c in eligible:
        queue = 1.0 if high == low else (high - c.load) / (high - low)
        prefix = c.prefix_blocks / prompt_blocks if prompt_blocks else 0.0
        if prefix and c.load > low + load_gate:
            gated, prefix = gated or prefix_weight > 0, 0.0
        scores[c.name] = (
            weights.queue * queue
            + weights.kv * (1.0 - c.kv_usage)
            + prefix_weight * prefix
            + weights.lora * c.adapter_affinity
        )
    best = max(scores.values())
    chosen = rng.choice([name for name, s in scores.items() if s >= best - _TIE])
    pick_ = next(c for c in eligible if c.name == chosen)
    if prefix_weight and pick_.prefix_blocks:
        reason = "prefix"
    elif weights.lora and pick_.adapter_affinity == 1.0:
        reason = "adapter"
    else:
        reason = "gated" if gated else "load"
    return Decision(chosen, reason, scores)
