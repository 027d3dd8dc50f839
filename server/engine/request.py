"""A request as the engine sees it: prompt, sampling parameters, generated tokens and progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from conveyor.server.block_hash import rope_hash_root
from conveyor.server.messages import FinishReason, Logprob, SamplingParams

if TYPE_CHECKING:
    from conveyor.server.model.lora import LoRAAdapter


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated. Token counts are in tokens, times in seconds (time.monotonic)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)
    # Tokens whose K/V is in the cache; the scheduler advances it, preemption resets it to 0.
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache when the request was first scheduled.
    num_cached_tokens: int = 0
    # KV cache block ids, owned by the KV cache manager. The first `num_skipped_blocks` fell out of a
    # sliding window every layer has and were given back (`KVCacheManager`); their entries stay, as
    # `SKIPPED_BLOCK`, so each position keeps its index.
    block_table: list[int] = field(default_factory=list)
    num_skipped_blocks: int = 0
    # A model whose sliding layers keep their K/V in blocks of their own (Gemma 2/3): those blocks, the
    # first `num_skipped_window_blocks` given back as they fell out of the window; `block_table` is then
    # the other layers', which keep every block.
    window_block_table: list[int] = field(default_factory=list)
    num_skipped_window_blocks: int = 0
    # Hashes of this request's full blocks (prefix caching), extended as blocks fill.
    block_hashes: list[bytes] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    generator: torch.Generator | None = None
    # The request's position in its structured-output grammar (an xgrammar GrammarMatcher), if any.
    grammar: object | None = None
    # Why a request ended as an error of its own (a constraint that dead-ended), for the API to report.
    error: str | None = None
    # Prompt followed by output tokens, kept as one list so a step can slice it without copying both.
    all_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter the request runs under (None: the base model), held until the request ends.
    lora: LoRAAdapter | None = None
    # Speculative decoding: this step's draft tokens (the drafter sets them before each step), the
    # proposer's index of the request's tokens, and the request's decayed draft acceptance counts.
    spec_token_ids: list[int] = field(default_factory=list)
    draft_state: object | None = None
    draft_acceptance: object | None = None
    # Where the model's rotary angles depend on the sequence's length (LongRoPE, dynamic NTK;
    # `ModelShape.rope_by_length`): the length every token's angles are chosen by at least (the runner
    # takes max(rope_length, position + 1); the prompt's length, or the whole sequence's once recomputed),
    # the prefix cache's key of that table (`ModelShape.rope_cache_key`, None for the table of short
    # sequences), and (length, key) past which the request's K/V is recomputed with the table of its new
    # length (LongRoPE past the original context, as transformers' Phi-3 recomputes its cache there).
    rope_length: int = 0
    rope_key: int | None = None
    rope_recompute: tuple[int, int | None] | None = None

    @property
    def hash_root(self) -> bytes | None:
        """The parent hash of the request's first KV block: its adapter's (`block_hash.lora_hash_root`),
        so prefixes are shared only between requests of the same adapter, and under it its rotary
        table's (`block_hash.rope_hash_root`); None for the base model with one table."""
        root = self.lora.hash_root if self.lora is not None else None
        return root if self.rope_key is None else rope_hash_root(root, self.rope_key)

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)
        self.all_token_ids = list(self.prompt_token_ids)

    def append_output_tokens(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first `num_output_tokens` (a step accepted several and an earlier
        one ended the request)."""
        drop = len(self.output_token_ids) - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[-drop:]
            del self.output_logprobs[num_output_tokens:]
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
