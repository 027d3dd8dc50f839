"""A request as the engine sees it: prompt, sampling parameters, generated tokens and progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from conveyor.server.engine.structured_output import StructuredOutputParams


class FinishReason(enum.StrEnum):
    """Why a request stopped; the values are OpenAI's `finish_reason` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# The most top log-probabilities a request may ask for per token (OpenAI allows 20).
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Per-request sampling parameters (OpenAI's plus vLLM's extensions, same meanings).

    temperature: 0 means greedy. top_p in (0, 1]; top_k <= 0 means off; min_p in [0, 1].
    logit_bias: token id -> value added to its logit before everything else (OpenAI's logit_bias,
    -100..100: -100 in effect bans a token, +100 in effect forces it).
    repetition_penalty (> 0, 1 = off) divides positive / multiplies negative logits of tokens seen in
    prompt or output (CTRL, Keskar et al. 2019); presence/frequency penalties in [-2, 2] subtract
    from logits of output tokens (OpenAI's formula). seed makes this request's samples reproducible
    whatever else is in the batch. logprobs: number of top log-probabilities to return per token
    (None = none, 0 = only the sampled token's, at most MAX_LOGPROBS). structured_output: a grammar
    the output must match (a JSON schema, regex, choice or EBNF; see structured_output.py), None for
    free text.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_output: StructuredOutputParams | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Logprob:
    """Log-probability of one token; `top` lists the most likely alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


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
    # KV cache block ids, owned by the KV cache manager.
    block_table: list[int] = field(default_factory=list)
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

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)
        self.all_token_ids = list(self.prompt_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
