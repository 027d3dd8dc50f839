"""Tool calling: model output -> OpenAI `tool_calls`, whole or streamed.

`tool_choice` decides how a reply is read (vLLM's behaviour):
- `none`: free text, tools not shown to the model.
- `auto`: free text; the `--tool-call-parser` finds calls in it (`hermes`: `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` blocks, Hermes/Qwen's format and the default prompt's; `llama3_json`:
  a reply that is one or more `{"name": ..., "parameters": {...}}` objects separated by `;`, Llama 3.1's).
  A call of a function the request's `tools` do not name is not a call: it stays content. With
  `parallel_tool_calls: false` only the first call is returned.
- `required` / a named function: the output is constrained (structured output) to the JSON of the call,
  so it always parses: for a named function its arguments, for `required` a list of `{"name",
  "parameters"}` (`ChatCompletionRequest.tool_call_schema`). A reply cut by `max_tokens` still reads as
  calls, the last one with its arguments cut short (finish_reason `length`), as OpenAI returns them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
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

    def parse(self, text: str, known: Collection[str] | None = None) -> tuple[str, list[ParsedToolCall]]:
        """(the reply without its call blocks, the calls). A block that does not parse, or that calls a
        function not in `known` (when given), stays content; a last block may lack its end tag (the
        model stopped at EOS)."""
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
            if call is not None and known is not None and call.name not in known:
                call = None
            content.append(text[pos:start] if call else text[pos:block_end])
            if call:
                calls.append(call)
            pos = block_end
        content.append(text[pos:])
        return "".join(content), calls

    def content_prefix(self, text: str) -> int:
        """How many leading characters of a reply still being generated are surely content: all up to a
        start tag, holding back a tail that might begin one, and trailing whitespace (dropped, as in
        the whole reply, when a call follows)."""
        end = text.find(self.START)
        if end < 0:
            end = len(text)
            for k in range(min(len(self.START) - 1, len(text)), 0, -1):
                if text.endswith(self.START[:k]):
                    end = len(text) - k
                    break
        return len(text[:end].rstrip())


class Llama3JSONToolParser:
    """A reply that is JSON call objects (`{"name", "parameters"}`) separated by `;`, optionally after
    `<|python_tag|>`; any other reply is content."""

    TAG = "<|python_tag|>"

    def parse(self, text: str, known: Collection[str] | None = None) -> tuple[str, list[ParsedToolCall]]:
        """(content, calls): no content when the reply is calls, the whole reply as content otherwise
        (also when a call names a function not in `known`, when given)."""
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
            if call is None or (known is not None and call.name not in known):
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


# The call a `required` reply was writing when it was cut: its name whole, then its arguments begun.
_CUT_NAME = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_CUT_ARGUMENTS = re.compile(r'\s*,\s*"parameters"\s*:\s*(.*)\Z', re.S)


def parse_constrained(text: str, named: str | None) -> list[ParsedToolCall]:
    """The calls of a reply constrained to `ChatCompletionRequest.tool_call_schema` (`named`: the
    function of a named tool_choice, whose arguments are the reply itself, as streamed). A reply cut
    short gives the calls it completed and the one it was writing, with its arguments as far as they
    got; nothing when not even a function name was written."""
    if named is not None:
        return [ParsedToolCall(named, text)] if text.strip() else []
    decoder, calls = json.JSONDecoder(), []
    pos = text.find("[") + 1
    while 0 < pos < len(text):
        pos = len(text) - len(text[pos:].lstrip().removeprefix(",").lstrip())
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            name = _CUT_NAME.match(text, pos)
            if name:
                arguments = _CUT_ARGUMENTS.match(text, name.end())
                calls.append(ParsedToolCall(json.loads(name[1]), arguments[1] if arguments else ""))
            break
        call = _call_from(obj, ("parameters",))
        if call is not None:
            calls.append(call)
    return calls


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_json(call: ParsedToolCall, index: int | None = None) -> dict:
    """OpenAI's tool call object (with `index` in a streamed delta)."""
    body = {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return body if index is None else {"index": index, **body}


class ToolCallReader:
    """Reads one choice's reply under a request's tool_choice, whole (`finish`) or as it streams (`feed`).

    mode: `none`, `auto`, `required` or `named` (then `named` is the function); parser: for `auto`;
    known: the names of the request's tools (`auto` calls of other names stay content; None: any); parallel:
    False keeps only the first `auto` call (`parallel_tool_calls`).
    """

    def __init__(
        self,
        mode: str,
        parser: HermesToolParser | Llama3JSONToolParser,
        named: str | None = None,
        known: Collection[str] | None = None,
        parallel: bool = True,
    ) -> None:
        self.mode, self.parser, self.named = mode, parser, named
        self.known, self.parallel = known, parallel
        self.text = ""
        self._sent = 0  # characters of content already streamed (`auto`)
        self._opened = False  # the named call's header was streamed
        self.called = False

    def read(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """A whole reply: (content or None, calls)."""
        if self.mode == "none":
            return text, []
        if self.mode in ("required", "named"):  # the text is the calls' JSON encoding, never content
            return None, parse_constrained(text, self.named)
        content, calls = self.parser.parse(text, self.known)
        if calls and not self.parallel:
            calls = calls[:1]
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
            return self._content(self.text[self._sent :], len(self.text)) if self.mode == "auto" else {}
        self.called = True
        delta = {"tool_calls": [tool_call_json(c, i) for i, c in enumerate(calls)]}
        if self.mode == "auto":  # what the whole reply's content has beyond what was streamed
            sent = self.text[: self._sent].strip()
            rest = (content or "")[len(sent) :] if (content or "").startswith(sent) else ""
            if rest:
                delta["content"] = rest
        return delta

    def _content(self, text: str, sent_to: int) -> dict:
        self._sent = max(self._sent, sent_to)
        return {"content": text} if text else {}
