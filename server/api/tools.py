"""Tool calling: model output -> OpenAI `tool_calls`, whole or streamed.

`tool_choice` decides how a reply is read (vLLM's behaviour):
- `none`: free text, tools not shown to the model.
- `auto`: free text; the `--tool-call-parser` finds calls in it (`hermes`: `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` blocks, Hermes/Qwen's format and the default prompt's; `llama3_json`:
  a reply that is one or more `{"name": ..., "parameters": {...}}` objects separated by `;`, Llama 3.1's).
- `required` / a named function: the output is constrained (structured output) to the JSON of the call,
  so it always parses: for a named function its arguments, for `required` a list of `{"name",
  "parameters"}` (`ChatCompletionRequest.tool_call_schema`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def _call_from(obj: object, args_keys: tuple[str, ...]) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models send arguments already as JSON text
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            if not isinstance(args, dict):
                return None
            return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
    return ParsedToolCall(obj["name"], "{}")


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the reply."""

    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """(the reply without its call blocks, the calls). A block that does not parse stays content; a
        last block may lack its end tag (the model stopped at EOS)."""
        content, calls, pos = [], [], 0
        while (start := text.find(self.START, pos)) >= 0:
            end = text.find(self.END, start)
            body_end = end if end >= 0 else len(text)
            block_end = end + len(self.END) if end >= 0 else len(text)
            try:
                call = _call_from(
                    json.loads(text[start + len(self.START) : body_end]), ("arguments", "parameters")
                )
            except json.JSONDecodeError:
                call = None
            content.append(text[pos:start] if call else text[pos:block_end])
            if call:
                calls.append(call)
            pos = block_end
        content.append(text[pos:])
        return "".join(content), calls

    def content_prefix(self, text: str) -> int:
        """How many leading characters of a reply still being generated are surely content: all up to a
        start tag, holding back a tail that might begin one."""
        start = text.find(self.START)
        if start >= 0:
            return start
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):
            if text.endswith(self.START[:k]):
                return len(text) - k
        return len(text)


class Llama3JSONToolParser:
    """A reply that is JSON call objects (`{"name", "parameters"}`) separated by `;`, optionally after
    `<|python_tag|>`; any other reply is content."""

    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        rest = text.strip().removeprefix(self.TAG).lstrip()
        if not rest.startswith("{"):
            return text, []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(rest):
            try:
                obj, pos = decoder.raw_decode(rest, pos)
            except json.JSONDecodeError:
                return text, []
            call = _call_from(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            pos = len(rest) - len(rest[pos:].lstrip().removeprefix(";").lstrip())
        return "", calls

    def content_prefix(self, text: str) -> int:
        head = text.lstrip()
        if (
            not head
            or head.startswith("{")
            or self.TAG.startswith(head[: len(self.TAG)])
            or head.startswith(self.TAG)
        ):
            return 0
        return len(text)


TOOL_CALL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JSONToolParser}


def parse_constrained(text: str, named: str | None) -> list[ParsedToolCall]:
    """The calls of a reply constrained to `ChatCompletionRequest.tool_call_schema` (`named`: the
    function of a named tool_choice). Empty when the reply was cut short and does not parse."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if named is not None:
        return [ParsedToolCall(named, json.dumps(value, ensure_ascii=False))]
    return [c for c in (_call_from(v, ("parameters",)) for v in value) if c is not None]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_json(call: ParsedToolCall, index: int | None = None) -> dict:
    """OpenAI's tool call object (with `index` in a streamed delta)."""
    body = {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return body if index is None else {"index": index, **body}


class ToolCallReader:
    """Reads one choice's reply under a request's tool_choice, whole (`finish`) or as it streams (`feed`).

    mode: `none`, `auto`, `required` or `named` (then `named` is the function); parser: for `auto`.
    """

    def __init__(
        self, mode: str, parser: HermesToolParser | Llama3JSONToolParser, named: str | None = None
    ) -> None:
        self.mode, self.parser, self.named = mode, parser, named
        self.text = ""
        self._sent = 0  # characters of content already streamed (`auto`)
        self._opened = False  # the named call's header was streamed
        self.called = False

    def read(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """A whole reply: (content or None, calls)."""
        if self.mode == "none":
            return text, []
        if self.mode in ("required", "named"):
            calls = parse_constrained(text, self.named)
            return (None, calls) if calls else (text, [])
        content, calls = self.parser.parse(text)
        return (content.strip() or None) if calls else content, calls

    def feed(self, new_text: str, finished: bool) -> dict:
        """The delta (`content` and/or `tool_calls`) to stream for `new_text`; `{}` when nothing is due."""
        self.text += new_text
        if self.mode == "none":
            return {"content": new_text} if new_text else {}
        if self.mode == "named":  # the arguments stream as they come (the output is exactly them)
            delta: dict = {}
            if not self._opened:
                self._opened = self.called = True
                header = {
                    "id": call_id(),
                    "type": "function",
                    "function": {"name": self.named, "arguments": new_text},
                }
                return {"tool_calls": [{"index": 0, **header}]}
            if new_text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": new_text}}]
            return delta
        if not finished:
            if self.mode == "required":
                return {}
            safe = self.parser.content_prefix(self.text)
            return self._content(self.text[self._sent : safe], safe)
        content, calls = self.read(self.text)
        if not calls:
            return self._content(self.text[self._sent :], len(self.text))
        self.called = True
        delta = {"tool_calls": [tool_call_json(c, i) for i, c in enumerate(calls)]}
        if self.mode == "auto":
            unsent, _ = self.parser.parse(self.text[self._sent :])
            if unsent.strip():
                delta["content"] = unsent
        return delta

    def _content(self, text: str, sent_to: int) -> dict:
        self._sent = max(self._sent, sent_to)
        return {"content": text} if text else {}
