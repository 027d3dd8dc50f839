"""Prompt building: request text -> the token ids the engine computes. One place, used by the server and by
the router (which must name a prompt's KV blocks exactly as the replica will)."""

from __future__ import annotations

from conveyor.server.api.protocol import ChatMessage


class PromptError(ValueError):
    """The prompt cannot be built; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    """The chat template applied to `messages`, tokenized without adding special tokens again (the
    template writes them). Raises PromptError when the template rejects the conversation."""
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # the template's own error (e.g. roles out of order)
        raise PromptError(f"messages: the chat template rejected them: {exc}", "messages") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def completion_prompt_ids(tokenizer, prompt: str | list) -> list[list[int]]:
    """`/v1/completions`' `prompt` (text, token ids, or a list of either) as one token id list per
    prompt. Raises PromptError for an empty list."""
    if isinstance(prompt, str):
        return [tokenizer(prompt)["input_ids"]]
    if not prompt:
        raise PromptError("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompt]
