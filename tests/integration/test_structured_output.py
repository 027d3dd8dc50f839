"""Structured output over real HTTP with the real `openai` client and model: every constrained output
parses and validates against its JSON schema (jsonschema), whatever the sampling, streaming or n."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}

# Twenty schemas: nested objects, arrays, enums, bounded numbers, required fields, string patterns.
SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    {"type": "object", "properties": {"city": _NAME, "country": _NAME}, "required": ["city", "country"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["score"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "name": _NAME},
                "required": ["id", "name"],
            }
        },
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
    },
    {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["date"],
    },
    {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "maxItems": 2,
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": -9, "maximum": 9},
                        "y": {"type": "integer", "minimum": -9, "maximum": 9},
                    },
                    "required": ["x", "y"],
                },
            }
        },
        "required": ["points"],
    },
    {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "why": _NAME},
        "required": ["answer", "why"],
    },
    {
        "type": "object",
        "properties": {"count": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["count"],
    },
    {
        "type": "object",
        "properties": {
            "title": _NAME,
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "genre": {"enum": ["drama", "comedy", "horror"]},
        },
        "required": ["title", "year", "genre"],
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                },
            }
        },
        "required": ["matrix"],
    },
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "rate": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["code", "rate"],
    },
    {
        "type": "object",
        "properties": {"level": {"enum": [1, 2, 3]}, "label": {"const": "priority"}},
        "required": ["level", "label"],
    },
    {
        "type": "object",
        "properties": {
            "first": _NAME,
            "last": _NAME,
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        },
        "required": ["first", "last", "email"],
    },
    {
        "type": "object",
        "properties": {
            "steps": {
                "type": "array",
                "items": {"enum": ["mix", "bake", "cool"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["steps"],
    },
    {
        "type": "object",
        "properties": {
            "address": {
                "type": "object",
                "properties": {"street": _NAME, "number": {"type": "integer", "minimum": 1, "maximum": 500}},
                "required": ["street", "number"],
            },
            "open": {"type": "boolean"},
        },
        "required": ["address", "open"],
    },
    {
        "type": "object",
        "properties": {
            "lang": {"enum": ["python", "go", "rust"]},
            "stars": {"type": "integer", "minimum": 0, "maximum": 5},
        },
        "required": ["lang", "stars"],
    },
]


@pytest.fixture
def aclient(server):
    """A factory: each asyncio.run needs a client made on its own event loop."""
    return lambda: openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


async def _chat(aclient, schema: dict, i: int, stream: bool, seed: int | None) -> list[str]:
    """The n=2 choices of one request constrained by `schema` (streamed deltas joined)."""
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": f"Reply with JSON for item {i}."}],
        response_format={"type": "json_schema", "json_schema": {"name": f"item_{i}", "schema": schema}},
        max_tokens=160,
        n=2,
        temperature=0 if seed is None else 1.0,
        seed=seed,
    )
    if not stream:
        reply = await aclient.chat.completions.create(**kwargs)
        assert all(c.finish_reason == "stop" for c in reply.choices), reply
        return [c.message.content for c in reply.choices]
    texts, reasons = ["", ""], [None, None]
    async for chunk in await aclient.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert reasons == ["stop", "stop"], (reasons, texts)
    return texts


def test_twenty_schemas_greedy_and_seeded_streamed_and_not(aclient) -> None:
    async def main():
        client, jobs = aclient(), []
        for i, schema in enumerate(SCHEMAS):
            jobs.append(_chat(client, schema, i, stream=False, seed=None))
            jobs.append(_chat(client, schema, i, stream=True, seed=1000 + i))
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    for k, texts in enumerate(results):
        schema = SCHEMAS[k // 2]
        for text in texts:
            jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_choice_and_grammar_spellings(server) -> None:
    def create(**body) -> dict:
        reply = httpx.post(
            server.base_url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Describe a cat."}], "max_tokens": 120, **body},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]

    obj = create(response_format={"type": "json_object"}, temperature=0)
    assert obj["finish_reason"] == "stop" and isinstance(json.loads(obj["message"]["content"]), dict)
    for body in (
        {"guided_regex": "[0-9]{3}-[a-z]{2,4}"},
        {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}},
    ):
        text = create(**body, temperature=0)["message"]["content"]
        assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", text), text
    for body in ({"guided_choice": ["purr", "hiss"]}, {"structured_outputs": {"choice": ["purr", "hiss"]}}):
        assert create(**body, temperature=0.8, seed=3)["message"]["content"] in ("purr", "hiss")
    grammar = 'root ::= "the cat says " ("meow" | "purr") "."'
    said = create(guided_grammar=grammar, temperature=0)
    assert said["finish_reason"] == "stop" and re.fullmatch(
        "the cat says (meow|purr)[.]", said["message"]["content"]
    )
    guided = create(
        guided_json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    )
    assert isinstance(json.loads(guided["message"]["content"])["n"], int)


def test_completions_endpoint_takes_a_schema_too(server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(
        model=MODEL,
        prompt="A person as JSON:",
        max_tokens=80,
        temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMAS[0]}},
    )
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMAS[0])


def test_constrained_and_free_rows_in_one_batch_do_not_affect_each_other(aclient) -> None:
    """float32, greedy: each request's output in a mixed batch equals its output alone."""
    free = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three rivers."}],
        max_tokens=40,
        temperature=0,
    )
    bound = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "A movie as JSON."}],
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "movie", "schema": SCHEMAS[12]}},
    )

    async def main():
        client = aclient()

        async def one(kwargs) -> str:
            return (await client.chat.completions.create(**kwargs)).choices[0].message.content

        alone = [await one(free), await one(bound)]
        together = await asyncio.gather(one(free), one(bound), one(free), one(bound))
        return alone, together

    (free_alone, bound_alone), together = asyncio.run(main())
    assert together == [free_alone, bound_alone, free_alone, bound_alone]
    jsonschema.validate(json.loads(bound_alone), SCHEMAS[12])


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a `json_schema`"),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nosuch"}},
                }
            },
            "response_format",
            "nosuch",
        ),
        ({"guided_regex": "[a-"}, "guided_regex", "guided_regex"),
        # Compiles, but no token can start an output: refused before generation, not a 200 "abort".
        ({"guided_regex": "[^\\s\\S]"}, "guided_regex", "no output of this model's tokens matches"),
        ({"guided_json": "{not json"}, "guided_json", "guided_json: the schema is not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        # Keywords generation could not enforce are refused, never silently ignored.
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "`uniqueItems`"),
        ({"guided_json": {"not": {"type": "string"}}}, "guided_json", "`not`"),
        ({"guided_json": {"type": "number", "multipleOf": 0.5}}, "guided_json", "fractional `multipleOf`"),
        # xgrammar drops multipleOf beside a single bound: refused, as the output would not match.
        (
            {
                "guided_json": {
                    "type": "object",
                    "properties": {"a": {"type": "integer", "multipleOf": 3, "maximum": 9}},
                }
            },
            "guided_json",
            "`multipleOf` with only an upper bound (at /properties/a)",
        ),
        ({"guided_json": {"$ref": "http://example.com/s.json"}}, "guided_json", "outside the schema"),
        (
            {"guided_json": {"type": "string", "pattern": "^a+$", "maxLength": 3}},
            "guided_json",
            "`maxLength`",
        ),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "not 2"),
        # No object matches: a required property that additionalProperties false forbids.
        (
            {"guided_json": {"type": "object", "required": ["x"], "additionalProperties": False}},
            "guided_json",
            "required property 'x' (at /) is not in `properties`",
        ),
        # Starts, then dead-ends: found while generating, still a 400 (not a 200 "abort").
        ({"guided_regex": "a[^\\s\\S]"}, "guided_regex", "no token of this model continues the constraint"),
    ],
)
def test_malformed_constraints_are_400s_naming_the_field(server, body, param, says) -> None:
    reply = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body},
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert says in error["message"] and error["param"] == param, error
    # The engine loop is unharmed and holds no blocks for the refused request.
    ok = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_constraint_that_dead_ends_while_streaming_sends_an_error_event(server) -> None:
    body = {"prompt": "Say a", "max_tokens": 8, "guided_regex": "a[^\\s\\S]", "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body) as reply:
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert reply.status_code == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["param"] == "guided_regex" and "no token of this model continues" in error["message"]


def test_a_required_property_the_schema_does_not_list_is_generated(server) -> None:
    """JSON Schema lets a required property be absent from `properties`; strict generation must still
    write it (xgrammar alone would leave it out and answer `{}`)."""
    schema = {"type": "object", "required": ["x"]}
    reply = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Give x."}], "max_tokens": 24, "temperature": 0,
              "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
    )  # fmt: skip
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert choice["message"]["content"].startswith('{"x": ')


def test_constrained_outputs_survive_preemption_and_prefix_caching(engine) -> None:
    """The engine alone, float32 greedy: twelve constrained requests sharing a prompt prefix in a KV pool
    too small for all of them (recompute preemption, prefix-cache hits) produce exactly what each
    produces with the pool to itself, and every output validates."""
    from conveyor.server.config import SchedulerConfig
    from conveyor.server.engine.kv_cache import KVCacheManager
    from conveyor.server.engine.scheduler import make_scheduler
    from conveyor.server.messages import SamplingParams, StructuredOutputParams

    assert not engine.has_unfinished_requests()
    prefix = engine.tokenizer("You are a helpful assistant that only answers in JSON. " * 3)["input_ids"]
    prompts = [prefix + engine.tokenizer(f" Item {i}:")["input_ids"] for i in range(12)]
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(12)]

    def run(tag: str) -> list[str]:
        texts = {}
        for i, (prompt, schema) in enumerate(zip(prompts, schemas, strict=True)):
            so = StructuredOutputParams("json", json.dumps(schema))
            engine.add_request(
                engine.make_request(
                    f"{tag}-{i}", prompt, SamplingParams(temperature=0, max_tokens=120, structured_output=so)
                )
            )
        ids: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    assert out.finish_reason.value == "stop", out
                    texts[out.request_id] = engine.tokenizer.decode(
                        ids[out.request_id], skip_special_tokens=True
                    )
        return [texts[f"{tag}-{i}"] for i in range(12)]

    alone = []
    for i in range(12):  # one at a time: no pressure
        so = StructuredOutputParams("json", json.dumps(schemas[i]))
        engine.add_request(
            engine.make_request(
                f"alone-{i}", prompts[i], SamplingParams(temperature=0, max_tokens=120, structured_output=so)
            )
        )
        out_ids = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                out_ids += out.new_token_ids
        alone.append(engine.tokenizer.decode(out_ids, skip_special_tokens=True))
    saved = engine.kv_cache, engine.scheduler
    engine.kv_cache = KVCacheManager(12, engine.runner.block_size, enable_prefix_caching=True)
    engine.scheduler = make_scheduler(SchedulerConfig(), engine.kv_cache, max_num_seqs=12)
    try:
        crowded = run("crowded")
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv_cache.prefix_cache_hits > 0
        assert engine.kv_cache.num_free_blocks == 12
    finally:
        engine.kv_cache, engine.scheduler = saved
        engine.kv_cache.reset_prefix_cache()  # the small pool's run overwrote blocks the saved one caches
    assert crowded == alone
    for text, schema in zip(crowded, schemas, strict=True):
        jsonschema.validate(json.loads(text), schema)


def test_logprobs_of_a_constrained_request_leave_out_banned_tokens(server) -> None:
    """Tokens the grammar bans have logprob -inf: they are not listed (and the body stays JSON)."""
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "yes or no?"}], "logprobs": True,
                                  "top_logprobs": 5}),
        ("/v1/completions", {"prompt": "Answer:", "logprobs": 5}),
    ):  # fmt: skip
        reply = httpx.post(
            server.base_url + path,
            json={**body, "guided_choice": ["yes", "no"], "max_tokens": 5, "temperature": 0},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        text = json.dumps(reply.json())
        assert "Infinity" not in text and "NaN" not in text
