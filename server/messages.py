"""The messages that cross the engine's boundary, as plain values (SGLang's `io_struct.py`): what the API
hands the engine (sampling parameters, structured-output constraints), what the engine hands back (outputs,
log-probabilities, finish reasons), and what it reports (its limits, per-step stats, KV cache events).

No torch and no engine module is imported here, so the API's request models, the metrics and the router
read these without loading the engine (tests/unit/test_layers.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # a reference the engine passes along; nothing here reads it
    from conveyor.server.model.lora import LoRAAdapter


class FinishReason(enum.StrEnum):
    """Why a request stopped; the values are OpenAI's `finish_reason` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


# The most top log-probabilities a request may ask for per token (OpenAI allows 20).
MAX_LOGPROBS = 20


StructuredOutputKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutputParams:
    """What a request's output must match.

    kind: `json` (spec: a JSON schema as JSON text), `json_object` (any JSON object; spec unused),
    `regex` (spec: a regular expression the whole output matches), `choice` (spec: a JSON list of
    strings; the output is exactly one of them), `grammar` (spec: an EBNF grammar in xgrammar's
    dialect, rule `root`). param: the request field it came from, named in errors.
    """

    kind: StructuredOutputKind
    spec: str = ""
    param: str = "response_format"


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
    def has_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty is on."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty or self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class EngineRequest:
    """A request the engine has checked and queues as it is (vLLM's `EngineCoreRequest`, SGLang's
    `TokenizedGenerateReqInput`). Only `LLMEngine.make_request` makes them, after the checks that raise
    InvalidRequestError naming the field, so holding one means holding a request the engine can serve:
    nothing downstream checks it again.

    prompt_token_ids: the prompt's token ids; arrival_time: seconds (time.monotonic), where TTFT and
    queue time start; priority: the scheduling priority (`--scheduling-policy priority`: lower first);
    lora: the LoRA adapter the request runs under (its `model` named it), None for the base model.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    lora: LoRAAdapter | None = None

    def for_choice(self, request_id: str, seed: int | None) -> EngineRequest:
        """The same request under another id and seed (one choice of an `n > 1` request): neither is
        something the engine's checks look at, so the copy is as valid as the original."""
        return replace(self, request_id=request_id, params=replace(self.params, seed=seed))


@dataclass
class Logprob:
    """Log-probability of one token; `top` lists the most likely alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """What one step produced for one request. Times in seconds (time.monotonic)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[Logprob]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    # Set when the request ended as an error of its own (the API answers 400 with it).
    error: str | None = None


@dataclass(frozen=True)
class EngineLimits:
    """What the engine settled at start: KV pool (`num_kv_blocks` blocks of `block_size` tokens), the
    scheduler's limits (`/metrics` exports them as vLLM's `cache_config_info` and `scheduler_config_info`)
    and what the weights are (`model_weights_info`): `quantization` (the flag, or "none"), `weights` (the
    quantized formats held, e.g. `Q4_1+Q8_0`, else the float dtype) and `weight_bytes` (bytes they take)."""

    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    quantization: str = "none"
    weights: str = ""
    weight_bytes: int = 0
    # Mixture of experts: experts per sparse layer and the indexes of the sparse layers (0 and () for a
    # dense model).
    num_experts: int = 0
    sparse_layers: tuple[int, ...] = ()
    # LoRA: adapters one step can run (`--max-loras`; 0 without --enable-lora).
    max_loras: int = 0
    # Speculative decoding: the most draft tokens per sequence and step (0: off).
    num_speculative_tokens: int = 0
    # Where layers attend to the last `sliding_window` positions only, the KV cache gives back a
    # sequence's blocks that fell out of that window (`KVCacheManager`); None: every block is kept.
    # With only some layers sliding, theirs is a pool of its own of `num_window_blocks` (else 0).
    sliding_window: int | None = None
    num_window_blocks: int = 0


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups over some steps, in tokens: `queries` looked up, `hits` found cached."""

    queries: int = 0
    hits: int = 0


@dataclass
class SpecDecodingStats:
    """Speculative decoding over some steps (vLLM's `SpecDecodingStats`): `num_drafts` drafts verified,
    `num_draft_tokens` tokens they held, `num_accepted_tokens` of them accepted, and per draft position
    (0-based) how often it was accepted (`num_accepted_tokens_per_pos`, `[num_speculative_tokens]`)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]

    @classmethod
    def empty(cls, num_speculative_tokens: int) -> SpecDecodingStats:
        return cls(0, 0, 0, [0] * num_speculative_tokens)

    def add(self, num_drafted: int, num_accepted: int) -> None:
        """Count one verified draft of `num_drafted` tokens whose first `num_accepted` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler after one step, what metrics read (vLLM's `SchedulerStats`).

    num_running, num_waiting: requests. kv_cache_usage: fraction of KV blocks held (0-1).
    num_batched_tokens: tokens computed in the step; num_preempted: requests it preempted.
    prefix_cache_queries, prefix_cache_hits: tokens looked up in and found in the prefix cache in the
    step (first admissions only: see `KVCacheManager.allocate_slots`). expert_tokens: tokens the step
    routed to each expert, `[num_sparse_layers][num_experts]` in the order of `EngineLimits.sparse_layers`
    (mixture-of-experts models; None otherwise), from the model runner. running_lora_adapters,
    waiting_lora_adapters: names of the LoRA adapters of running and waiting requests, sorted.
    spec_decoding: the step's speculative decoding counts (None when it verified no draft).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_batched_tokens: int = 0
    num_preempted: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    expert_tokens: list[list[int]] | None = None
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    spec_decoding: SpecDecodingStats | None = None


@dataclass
class KVCacheEvent:
    """A change to the set of cached block hashes (the keys of `KVCacheManager.cached_blocks`).

    kind: `stored` (the hashes became cached), `evicted` (they stopped being cached) or `cleared` (the
    set is now empty; `block_hashes` is empty). block_hashes: 16-byte `hash_block` digests, in the
    order the changes happened.
    """

    kind: Literal["stored", "evicted", "cleared"]
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass
class KVCacheSnapshot:
    """The set of cached block hashes at one moment, with the pool's shape (tokens per block, blocks)."""

    block_size: int
    num_blocks: int
    block_hashes: list[bytes]
