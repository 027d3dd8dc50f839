"""Tool-call parsers and the streaming reader: replies as models write them -> OpenAI tool_calls."""

from __future__ import annotations

import json

import pytest

from conveyor.server.api.tools import (
    HermesToolParser,
    Llama3JSONToolParser,
    ParsedToolCall,
    ToolCallReader,
    parse_constrained,
)

WEATHER = ParsedToolCall("get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just text.", "Just text.", []),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [WEATHER]),
        (
            'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            '<tool_call>{"name": "now", "arguments": {}}</tool_call> Done.',
            "Let me check.  Done.",
            [WEATHER, ParsedToolCall("now", "{}")],
        ),
        # the model stopped at EOS before the end tag
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [WEATHER]),
        # arguments as JSON text, as some models write them
        (
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
            "",
            [WEATHER],
        ),
        # a block that is not a call stays content
        ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ],
)
def test_hermes_parser(text, content, calls) -> None:
    assert HermesToolParser().parse(text) == (content, calls)


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [WEATHER]),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}',
            [WEATHER, ParsedToolCall("now", "{}")],
        ),
        ("The weather is fine.", []),
        ('{"name": "get_weather", "parameters": {"city": "Par', []),  # cut short: content
    ],
)
def test_llama3_json_parser(text, calls) -> None:
    content, parsed = Llama3JSONToolParser().parse(text)
    assert parsed == calls and (content == text) == (not calls)


def test_constrained_outputs_always_parse_into_calls() -> None:
    assert parse_constrained('{"city": "Paris"}', "get_weather") == [WEATHER]
    listed = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    assert parse_constrained(listed, None) == [WEATHER, ParsedToolCall("now", "{}")]


@pytest.mark.parametrize(
    ("text", "named", "calls"),
    [
        # a named call cut short: its arguments as far as they got, as the stream sent them
        ('{"city": "Pa', "get_weather", [ParsedToolCall("get_weather", '{"city": "Pa')]),
        # `required` cut in its second call: the first whole, the second begun
        (
            '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {"tz',
            None,
            [WEATHER, ParsedToolCall("now", '{"tz')],
        ),
        # cut after the arguments, before the call's closing brace
        ('[{"name": "get_weather", "parameters": {"city": "Paris"}', None, [WEATHER]),
        # cut after the name: a call with no arguments yet
        ('[{"name": "get_weather", "param', None, [ParsedToolCall("get_weather", "")]),
        # cut inside the first function name: nothing to call
        ('[{"name": "get_w', None, []),
    ],
)
def test_constrained_outputs_cut_by_max_tokens_still_read_as_calls(text, named, calls) -> None:
    got = parse_constrained(text, named)
    assert [(c.name, c.arguments.replace(" ", "")) for c in got] == [
        (c.name, c.arguments.replace(" ", "")) for c in calls
    ]


@pytest.mark.parametrize("text", ["[", '[{"name": "get_w'])
def test_a_constrained_reply_cut_before_any_call_is_no_content(text) -> None:
    """The reply is the calls' JSON encoding: cut before a name, nothing is left to show."""
    assert ToolCallReader("required", HermesToolParser()).read(text) == (None, [])
    assert ToolCallReader("required", HermesToolParser()).feed(text, finished=True) == {}


def test_auto_calls_of_unknown_functions_stay_content_and_parallel_false_keeps_one() -> None:
    two = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    content, calls = HermesToolParser().parse(two, known={"get_weather"})
    assert calls == [WEATHER] and content == '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    assert Llama3JSONToolParser().parse('{"name": "rm", "parameters": {}}', known={"now"}) == (
        '{"name": "rm", "parameters": {}}',
        [],
    )
    known = {"get_weather", "now"}
    assert ToolCallReader("auto", HermesToolParser(), known=known).read(two)[1] == [
        WEATHER,
        ParsedToolCall("now", "{}"),
    ]
    assert ToolCallReader("auto", HermesToolParser(), known=known, parallel=False).read(two) == (
        None,
        [WEATHER],
    )


def _stream(reader: ToolCallReader, text: str, step: int) -> tuple[str, list[dict]]:
    """Feed `text` in pieces of `step` characters; return the streamed content and tool-call deltas."""
    content, calls = "", []
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for k, piece in enumerate(pieces):
        delta = reader.feed(piece, finished=k == len(pieces) - 1)
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
    return content, calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_auto_reply_reassembles_into_the_whole_read(step) -> None:
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    content, deltas = _stream(ToolCallReader("auto", HermesToolParser()), text, step)
    whole_content, whole_calls = ToolCallReader("auto", HermesToolParser()).read(text)
    assert content == whole_content == "Sure."  # the space before the call is not streamed either
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
        (c.name, c.arguments) for c in whole_calls
    ]
    # Text that only looks like the start of a tag is streamed once it is clearly not one.
    plain, none = _stream(ToolCallReader("auto", HermesToolParser()), "a <tool and <b>", step)
    assert (plain, none) == ("a <tool and <b>", [])


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_streamed_named_call_sends_its_arguments_as_they_come(step) -> None:
    reader = ToolCallReader("named", HermesToolParser(), "get_weather")
    _, deltas = _stream(reader, '{"city": "Paris"}', step)
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"].startswith("call_")
    assert all(d["index"] == 0 for d in deltas)
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Paris"}
    assert reader.called
