"""Prompt building: request text -> the token ids the engine computes. One place, used by the server and by
the router (which must name a prompt's KV blocks exactly as the replica will)."""

from __future__ import annotations

import json

from conveyor.server.api.protocol import ChatCompletionRequest, ChatMessage, ChatTool


class PromptError(ValueError):
    """The prompt cannot be built; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _token_ids(tokenizer, text: str, param: str, **kwargs) -> list[int]:
    """`text` tokenized; PromptError for text that is not valid Unicode (a lone UTF-16 surrogate, which
    JSON can carry and UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PromptError(f"{param}: the text is not valid Unicode (a lone surrogate)", param) from None
    return tokenizer(text, **kwargs)["input_ids"]


def _tools_block(tools: list[ChatTool]) -> str:
    """The default description of `tools` for a chat template without tool support, in the format the
    `hermes` parser reads."""
    signatures = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help answer. Their signatures, one JSON object per line:\n"
        f"<tools>\n{signatures}\n</tools>\n"
        "To call one, reply with a JSON object naming it and giving its arguments, inside tags:\n"
        '<tool_call>\n{"name": "FUNCTION_NAME", "arguments": {...}}\n</tool_call>\n'
        "Use one such block per call; a function's result comes back inside <tool_response> tags."
    )


def _default_tool_conversation(messages: list[ChatMessage], tools: list[ChatTool] | None) -> list[dict]:
    """`messages` for a template that knows only role and content: the tools appended to the system
    message (one is added if there is none), calls written as `<tool_call>` blocks, results as a user
    turn in `<tool_response>` tags."""
    conversation = []
    for m in messages:
        if m.role == "tool":
            conversation.append({"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"})
            continue
        content = m.text()
        if m.tool_calls:
            blocks = [
                json.dumps(
                    {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                    ensure_ascii=False,
                )
                for c in m.tool_calls
            ]
            content = "\n".join([content, *(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)]).strip()
        conversation.append({"role": m.role, "content": content})
    if tools:
        block = _tools_block(tools)
        if conversation and conversation[0]["role"] in ("system", "developer"):
            conversation[0]["content"] = f"{conversation[0]['content']}\n\n{block}".strip()
        else:
            conversation.insert(0, {"role": "system", "content": block})
    return conversation


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders `tools` itself (transformers passes them in)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def chat_prompt_ids(
    tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    tools: list[ChatTool] | None = None,
) -> list[int]:
    """The chat template applied to `messages` (and `tools`: through the template when it supports
    them, else the default rendering above), tokenized without adding special tokens again (the
    template writes them). Raises PromptError when the template rejects the conversation, or when the
    model has none."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise PromptError(
            "messages: this model has no chat template, so chat messages cannot be turned into a prompt; "
            "use /v1/completions, or start the server with --chat-template (a file or the template itself)",
            "messages",
        )
    native = supports_tools(tokenizer)
    if native:
        conversation = []
        for m in messages:
            turn: dict = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                turn["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                    for c in m.tool_calls
                ]  # fmt: skip
            if m.tool_call_id:
                turn["tool_call_id"] = m.tool_call_id
            conversation.append(turn)
    else:
        conversation = _default_tool_conversation(messages, tools)
    extra = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if native and tools else {}
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except Exception as exc:  # the template's own error (e.g. roles out of order)
        raise PromptError(f"messages: the chat template rejected them: {exc}", "messages") from None
    return _token_ids(tokenizer, text, "messages", add_special_tokens=False)


def chat_request_prompt_ids(tokenizer, req: ChatCompletionRequest) -> list[int]:
    """The prompt of a chat completion request: its messages, and its tools unless tool_choice is
    `none` (then the model is not shown them)."""
    tools = req.tools if req.effective_tool_choice != "none" else None
    return chat_prompt_ids(tokenizer, req.messages, True, tools)


def completion_prompt_ids(tokenizer, prompt: str | list) -> list[list[int]]:
    """`/v1/completions`' `prompt` (text, token ids, or a list of either) as one token id list per
    prompt. Raises PromptError for an empty list."""
    if isinstance(prompt, str):
        return [_token_ids(tokenizer, prompt, "prompt")]
    if not prompt:
        raise PromptError("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [_token_ids(tokenizer, p, "prompt") if isinstance(p, str) else list(p) for p in prompt]


def text_token_ids(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """/tokenize's `prompt` as token ids."""
    return _token_ids(tokenizer, text, "prompt", add_special_tokens=add_special_tokens)
