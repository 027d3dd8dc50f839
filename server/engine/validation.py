"""Request checks the engine makes before it queues a request: each failure an InvalidRequestError
whose `param` names the field, as OpenAI's 400 bodies do (the API layer has checked types and ranges)."""

from __future__ import annotations

from conveyor.server.engine.structured_output import InvalidGrammarError, StructuredOutputManager
from conveyor.server.messages import SamplingParams


class InvalidRequestError(ValueError):
    """A request the engine cannot serve; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """Prompt plus max_tokens exceed max_model_len. Carries the token counts."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        if num_prompt_tokens >= max_model_len:
            msg = (
                f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens."
            )
            param = "prompt"
        else:
            msg = (
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                f"in max_tokens)."
            )
            param = "max_tokens"
        super().__init__(msg, param)


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    structured_output: StructuredOutputManager,
) -> None:
    """Raise InvalidRequestError (PromptTooLongError for the context length) for a request the engine
    cannot serve: an empty prompt, token ids outside `[0, vocab_size)` (prompt, logit_bias keys,
    stop_token_ids), prompt plus max_tokens beyond `max_model_len` tokens, min_tokens above max_tokens,
    or a structured-output constraint that does not compile (compiled once: the cache keeps it)."""
    if not prompt_token_ids:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}", "prompt")
    if len(prompt_token_ids) + params.max_tokens > max_model_len:
        raise PromptTooLongError(len(prompt_token_ids), params.max_tokens, max_model_len)
    if params.min_tokens > params.max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})",
            "min_tokens",
        )
    bad_bias = [t for t in params.logit_bias if not 0 <= t < vocab_size]
    if bad_bias:
        raise InvalidRequestError(
            f"logit_bias keys must be token ids in [0, {vocab_size}); got {bad_bias[:5]}",
            "logit_bias",
        )
    bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise InvalidRequestError(f"stop_token_ids out of vocabulary: {bad_stop[:5]}", "stop_token_ids")
    so = params.structured_output
    if so is not None:
        try:
            structured_output.check(so)  # compiled once: add_request's compile is a lookup
        except InvalidGrammarError as exc:
            raise InvalidRequestError(f"{so.param}: {exc}", so.param) from None
