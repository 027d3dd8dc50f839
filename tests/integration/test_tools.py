"""Tool calling over real HTTP with the real `openai` client and model (whose chat template has no tool
support, so the default tool prompt is used): `required` and named calls always parse, streamed deltas
reassemble into the same calls, and a tool result round-trips."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(client, **kwargs) -> tuple[list[tuple[str, str]], str, list[str | None]]:
    """(name, arguments) per call reassembled from the deltas, streamed content, finish reasons."""
    calls: dict[int, list[str]] = {}
    content, reasons = "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", ""])
                entry[0] += (d.function.name or "") if d.function else ""
                entry[1] += (d.function.arguments or "") if d.function else ""
    return [tuple(calls[i]) for i in sorted(calls)], content, reasons


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_required_calls_always_parse(client, seed) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        n=3,
        temperature=0 if seed is None else 1.0,
        seed=seed,
        max_tokens=120,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        _check_calls(choice.message.tool_calls)


def test_a_named_function_is_called(client) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=80,
        temperature=0,
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_calls([call])


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_deltas_reassemble_into_the_same_calls(client, tool_choice) -> None:
    kwargs = dict(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=0
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed, content, reasons = _streamed(client, **kwargs)
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert content == "" and reasons[-1] == "tool_calls"


def test_auto_reply_is_either_text_or_parseable_calls_streamed_alike(client) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed, content, reasons = _streamed(client, **kwargs)
    if whole.message.tool_calls:
        _check_calls(whole.message.tool_calls)
        assert whole.finish_reason == "tool_calls"
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert content.strip() == (whole.message.content or "").strip()
    assert reasons[-1] == whole.finish_reason


def test_a_tool_result_round_trips(client) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0
    )
    assistant = first.choices[0].message
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}
        for call in assistant.tool_calls
    ]
    # The reply as the openai client dumps it (refusal, audio, function_call, annotations: None).
    echoed = assistant.model_dump()
    assert {"refusal", "audio", "function_call", "annotations"} <= echoed.keys()
    second = client.chat.completions.create(
        model=MODEL,
        messages=[*ASK, echoed, *results],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=40,
        temperature=0,
    )
    reply = second.choices[0]
    assert reply.message.content and not reply.message.tool_calls
    assert reply.finish_reason in ("stop", "length")


def test_tools_reach_the_prompt_unless_tool_choice_is_none(server) -> None:
    def count(**body) -> int:
        reply = httpx.post(
            server.base_url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, **body}
        )
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens"]

    plain = count()
    assert count(tools=TOOLS, tool_choice="none") == plain
    assert count(tools=TOOLS) > plain + 50


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools.0.function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "drop response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nosuch"}}}}}],
          "tool_choice": "required"}, "tools", "nosuch"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages", "only an `assistant`"),
        # a tool schema is checked whatever tool_choice says
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]}, "tools",
         "tools.0.function.parameters: JSON Schema keyword `not` (at /)"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
          "tool_choice": "required"}, "tools", "must be a JSON Schema of type `object`"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is given more than once"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "a named tool_choice is"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(server, body, param, says) -> None:
    reply = httpx.post(
        server.base_url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert says in error["message"] and error["param"] == param, error


def test_completions_refuse_tools_by_name(server) -> None:
    reply = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "tools": TOOLS})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"


@pytest.mark.parametrize(
    ("tool_choice", "max_tokens"),
    [("required", 18), ({"type": "function", "function": {"name": "get_weather"}}, 5)],
)
def test_calls_cut_by_max_tokens_are_calls_streamed_alike(client, tool_choice, max_tokens) -> None:
    """Cut short by max_tokens, a constrained reply is still tool calls (the last one's arguments cut,
    finish_reason `length`, as OpenAI's), the same whole and streamed."""
    kwargs = dict(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=max_tokens, temperature=0
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    assert whole.message.tool_calls and whole.message.tool_calls[0].function.name == "get_weather"
    assert whole.message.tool_calls[-1].function.arguments.startswith("{")  # begun, then cut
    streamed, content, reasons = _streamed(client, **kwargs)
    assert content == "" and reasons[-1] == "length"
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_parallel_tool_calls_false_keeps_to_one_call(client) -> None:
    """`required` with parallel_tool_calls false: exactly one call (the schema allows one item)."""
    for seed in (1, 2, 3):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
        ).choices[0]
        assert len(reply.message.tool_calls) == 1
