"""The OpenAI-compatible API over real HTTP (uvicorn) with the real `openai` client and model."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def scrape(server, name: str, **labels: str) -> float:
    """The value of one series on /metrics (0 when absent)."""
    text = httpx.get(server.base_url + "/metrics").text
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_models_health_and_chat_answer(server, client):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        temperature=0,
        max_tokens=30,
    )
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8


def test_sixteen_concurrent_chats_share_steps(server):
    llm = server.llm_engine
    before = llm.stats.max_num_seqs_in_step
    llm.stats.max_num_seqs_in_step = 0

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        topics = ["cats", "rivers", "stars", "bread", "trains", "music", "snow", "maps"] * 2
        return await asyncio.gather(
            *[
                aclient.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"Tell me one fact about {t}."}],
                    max_tokens=20,
                    temperature=0.7,
                    seed=i,
                )
                for i, t in enumerate(topics)
            ]
        )

    replies = asyncio.run(main())
    assert len(replies) == 16
    assert all(
        r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content for r in replies
    )
    assert llm.stats.max_num_seqs_in_step > 1
    llm.stats.max_num_seqs_in_step = max(before, llm.stats.max_num_seqs_in_step)


def test_stream_equals_non_stream_for_the_same_seed(client):
    kwargs = dict(
        model=MODEL, prompt="The best thing about mornings is", max_tokens=24, temperature=0.8, seed=7
    )
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stop_string_is_never_partly_streamed(client):
    prompt = "Once upon a time"
    greedy = (
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0).choices[0].text
    )
    assert greedy.startswith(", the city of Nova Haven")  # the model's greedy continuation
    stop = "Nova Haven"
    streamed = []
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop], stream=True
    ):
        streamed.append(chunk)
    pieces = [c.choices[0].text for c in streamed]
    text = "".join(pieces)
    assert text == greedy[: greedy.index(stop)] == ", the city of "
    # No prefix of the stop string ("N", "No", ...) was ever sent, not even transiently.
    assert not any(text.endswith(stop[:n]) for n in range(1, len(stop)))
    assert streamed[-1].choices[0].finish_reason == "stop"
    length = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert length.choices[0].finish_reason == "length"
    assert length.usage.completion_tokens == 3


def test_chat_stream_deltas_and_usage(client):
    messages = [{"role": "user", "content": "Name a fruit."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_n2_with_seed_differs_and_reproduces(client):
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=16, temperature=1.0, n=2, seed=42)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts


def test_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the most likely token
        assert token in top
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(chat.choices[0].logprobs.content) == 2
    assert all(len(c.top_logprobs) == 2 for c in chat.choices[0].logprobs.content)


def test_client_disconnect_frees_everything(server):
    body = {
        "model": MODEL,
        "prompt": "Count: 1, 2, 3,",
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.base_url + "/v1/completions", json=body) as resp,
    ):
        chunks = 0
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
            if chunks == 2:
                assert scrape(server, "conveyor:num_requests_running") == 1
                break  # leaving iter_lines closes the connection: the client is gone
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        running = scrape(server, "conveyor:num_requests_running")
        usage = scrape(server, "conveyor:kv_cache_usage_perc")
        if running == 0 and usage == 0:
            break
        time.sleep(0.05)
    assert (running, usage) == (0, 0)
    assert server.llm_engine.kv_cache.num_free_blocks == server.llm_engine.kv_cache.num_blocks


BAD_REQUESTS = [
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [1] * 1100}, 400, "prompt"),
    ({"prompt": "hello", "max_tokens": 1024}, 400, "max_tokens"),
    ({"prompt": "hello", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hello", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "hello", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hello", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hello", "n": 0}, 400, "n"),
    ({"prompt": "hello", "model": "gpt-4"}, 404, "model"),
    ({"prompt": [5, 49152]}, 400, "prompt"),
    ({"prompt": [5, -1]}, 400, "prompt"),
    ({"prompt": "hello", "seed": 2**64}, 400, "seed"),
    ({"prompt": "hello", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "hello", "echo": True}, 400, "echo"),
    ({"prompt": [5, False]}, 400, "prompt"),
    ({"prompt": "hello", "n": 1.0}, 400, "n"),
    ({"prompt": "hello", "max_tokens": "7"}, 400, "max_tokens"),
    ({"prompt": "hello", "stop_token_ids": [True]}, 400, "stop_token_ids"),
    ({"prompt": "hello", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": "hello", "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ({"prompt": "hello", "logit_bias": {"49152": 1}}, 400, "logit_bias"),
    ({"prompt": "hello", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "hello", "logit_bias": {"5": True}}, 400, "logit_bias"),
    ({"prompt": "hello", "logit_bias": {"5": "1"}}, 400, "logit_bias"),
    ({"prompt": "hello", "logit_bias": {"05": 1}}, 400, "logit_bias"),
    ({"prompt": "hello", "stream_options": {"include_usage": True}}, 400, "stream_options"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_REQUESTS)
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, body, status, param):
    resp = httpx.post(server.base_url + "/v1/completions", json=body)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["param"] == param
    assert (
        param in error["message"]
        or error["type"] == "not_found_error"
        or "context length" in error["message"]
    )
    assert httpx.get(server.base_url + "/health").status_code == 200
    ok = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_messages_name_the_field_as_sent_and_the_rule(server):
    """Not pydantic's internals (`content.str`, union branches) and not a range rule for NaN."""
    nan = httpx.post(
        server.base_url + "/v1/completions",
        content=b'{"prompt": "hi", "temperature": NaN}',
        headers={"content-type": "application/json"},
    ).json()["error"]
    assert nan["message"] == "temperature: Input should be a finite number"
    mixed = httpx.post(server.base_url + "/v1/completions", json={"prompt": [1, True]}).json()["error"]
    assert mixed["param"] == "prompt" and mixed["message"].startswith(
        "prompt: matches none of the accepted forms"
    )
    assert ".str" not in mixed["message"] and "list[" not in mixed["message"]
    no_text = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    ).json()["error"]
    assert no_text["message"] == "messages.0.content: content part 0 of type 'text' needs `text`, a string"
    # Regression: a part whose type is an object was a 500 (unhashable) once refusal parts came in.
    odd = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [{"type": {}, "text": ""}]}]},
    )
    assert odd.status_code == 400 and "content part type {}" in odd.json()["error"]["message"], odd.text
    refused = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
    ]
    ok = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": [*refused, {"role": "user", "content": "Why?"}], "max_tokens": 2},
    )
    assert ok.status_code == 200, ok.text
    audio = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a1"}}], "max_tokens": 2},
    ).json()["error"]
    assert audio["message"].startswith("messages.0.audio: ") and audio["param"] == "messages", audio
    for body in (b"[]", b"null"):
        not_object = httpx.post(
            server.base_url + "/v1/completions", content=body, headers={"content-type": "application/json"}
        ).json()["error"]
        assert not_object["message"] == "the request body must be a JSON object"


def test_null_means_the_default_as_in_openai(client, server):
    """OpenAI's API marks its optional fields nullable and SDKs send `null` for "not set"."""
    nulls = {k: None for k in ("temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "stream",
                               "logprobs", "parallel_tool_calls", "min_tokens", "ignore_eos")}  # fmt: skip
    reply = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **nulls},
    )
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 1 and reply.json()["choices"][0]["logprobs"] is None
    schema = httpx.get(server.base_url + "/openapi.json").json()["components"]["schemas"]
    assert {"type": "null"} in schema["ChatCompletionRequest"]["properties"]["temperature"]["anyOf"]


def test_the_model_card_and_more_field_rules(client, server):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.created > 1_700_000_000
    assert httpx.get(server.base_url + "/v1/models/gpt-4").json()["error"]["code"] == "model_not_found"
    ask = {"messages": [{"role": "user", "content": "Hi"}]}
    for body, param, says in [
        ({**ask, "max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens", "differ"),
        ({**ask, "stop": [""]}, "stop", "at least 1 character"),
        (
            {**ask, "tool_choice": {"type": "allowed_tools"}},
            "tool_choice",
            "'allowed_tools' is not supported",
        ),
    ]:
        error = httpx.post(server.base_url + "/v1/chat/completions", json=body).json()["error"]
        assert error["param"] == param and says in error["message"], error


def test_prompt_plus_max_tokens_message_gives_both_lengths(server):
    resp = httpx.post(server.base_url + "/v1/completions", json={"prompt": [7] * 1000, "max_tokens": 100})
    assert resp.status_code == 400
    assert "1000 in the prompt" in resp.json()["error"]["message"]
    assert "100 in max_tokens" in resp.json()["error"]["message"]


def test_malformed_json_and_chat_errors(server):
    resp = httpx.post(
        server.base_url + "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    resp = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": []})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="x").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1
        )


CHAT_ERRORS = [
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}
            ]
        },
        "messages",
        "messages.0.content: content part type 'image_url' is not supported by this model (text only)",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "top_logprobs",
        "top_logprobs: top_logprobs needs `logprobs: true`",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]},
        "messages",
        "messages.1.tool_call_id: Field required",
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "functions": [{"name": "f"}],
        },
        "functions",
        "functions: not supported by this server yet (accepted only as null, [])",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "alloy", "format": "wav"}},
        "audio",
        "audio: not supported by this server yet (accepted only as null)",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "store": True},
        "store",
        "store: not supported by this server yet (accepted only as null, false)",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "echo": True},
        "echo",
        "echo: not supported by this server yet (accepted only as null, false)",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1},
        "frobnicate",
        "frobnicate: unknown field (not part of the API this server implements)",
    ),
    (
        {"messages": [{"role": "user", "content": "hi", "refusal": "no"}]},
        "messages",
        "messages.0.refusal: unknown field (not part of the API this server implements)",
    ),
    (
        {"messages": [{"role": "user", "content": []}]},
        "messages",
        "messages.0.content: an empty list of content parts; give at least one text part",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "c1", "content": "4"},
            ]
        },
        "messages",
        "messages.1.tool_call_id: 'c1' answers no tool call of an earlier assistant message",
    ),
]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"messages": [{"role": "user", "content": "hi " * 1100}]}, "messages", "maximum context length is 1024"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1020}, "max_completion_tokens",
         "in max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1020}, "max_tokens", "in max_tokens"),
    ],
)  # fmt: skip
def test_chat_context_errors_name_the_chat_fields(server, body, param, says):
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize(("body", "param", "message"), CHAT_ERRORS)
def test_what_is_not_supported_is_refused_by_name(server, body, param, message):
    """Never silently ignored: an image part, top_logprobs without logprobs, a tool result without its
    call (or answering none), legacy functions, audio, store, chat echo and unknown fields get a 400
    naming the field; the 'ask for nothing' values of the known ones are accepted."""
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert (error["param"], error["message"]) == (param, message)


def test_the_defaults_of_unsupported_fields_are_accepted(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}],
        max_tokens=2,
        response_format={"type": "text"},
        tool_choice="none",
        store=False,
        metadata={},
        extra_body={"skip_special_tokens": True, "use_beam_search": False},
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_tokenize_and_detokenize(server):
    tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 1024
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    chat = httpx.post(
        server.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}
    ).json()
    assert chat["count"] > tokens["count"]
    bad = httpx.post(server.base_url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    for body in ({}, {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}):
        both = httpx.post(server.base_url + "/tokenize", json=body)
        assert both.status_code == 400 and "either `prompt`" in both.json()["error"]["message"]
    extra = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hi", "max_tokens": 2}).json()["error"]
    assert extra["param"] == "max_tokens" and "unknown field" in extra["message"]


def test_ttft_histogram_agrees_with_the_client(server):
    labels = {"model_name": MODEL, "input_length_bucket": "0-512"}
    count0 = scrape(server, "conveyor:time_to_first_token_seconds_count", **labels)
    sum0 = scrape(server, "conveyor:time_to_first_token_seconds_sum", **labels)
    body = {"model": MODEL, "prompt": "The weather today is", "max_tokens": 5, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as resp:
        ttft = None
        for line in resp.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"] and ttft is None:
                ttft = time.monotonic() - start
    assert scrape(server, "conveyor:time_to_first_token_seconds_count", **labels) == count0 + 1
    observed = scrape(server, "conveyor:time_to_first_token_seconds_sum", **labels) - sum0
    assert abs(observed - ttft) < 0.5
    assert scrape(server, "conveyor:request_success_total", model_name=MODEL, finished_reason="length") >= 1
    assert scrape(server, "conveyor:num_requests_waiting") == 0


def test_unknown_path_gets_an_openai_error_body(server):
    resp = httpx.get(server.base_url + "/v1/nothing-here")
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "not_found_error"


def test_counters_are_exported_before_their_first_event(server):
    text = httpx.get(server.base_url + "/metrics").text
    for name in (
        "conveyor:num_preemptions_total",
        "conveyor:prefix_cache_hits_total",
        "conveyor:prompt_tokens_total",
    ):
        assert f'{name}{{model_name="{MODEL}"}}' in text


def test_logit_bias_forces_and_bans_tokens_and_logprobs_see_it(server, client):
    """+100 makes a token the greedy pick every step, and the returned log-probabilities are of the
    biased distribution (OpenAI's); with -100 on every token but three, random sampling only ever
    emits those three."""

    def text_of(ids: list[int]) -> str:
        return httpx.post(server.base_url + "/detokenize", json={"tokens": ids}).json()["prompt"]

    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    forced_id = 1234
    forced = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=0, logit_bias={str(forced_id): 100}
    )
    assert forced.choices[0].text == text_of([forced_id] * 6) != plain.choices[0].text
    assert forced.choices[0].logprobs.tokens == [text_of([forced_id])] * 6
    assert all(lp > -0.01 for lp in forced.choices[0].logprobs.token_logprobs)  # biased: probability ~1

    allowed = [1234, 2345, 3456]
    vocab = server.llm_engine.vocab_size
    bias = {str(t): -100 for t in range(vocab) if t not in allowed}
    sampled = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0, seed=5, logprobs=0, logit_bias=bias
    )
    assert set(sampled.choices[0].logprobs.tokens) <= {text_of([t]) for t in allowed}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages"),
        ("/v1/completions", {"prompt": "hi \ud800"}, "prompt"),
        ("/tokenize", {"prompt": "hi \ud800"}, "prompt"),
    ],
)
def test_text_that_is_not_unicode_is_a_400(server, path, body, param):
    """A lone UTF-16 surrogate (JSON can carry one, UTF-8 cannot) is refused by name, not a 500."""
    raw = json.dumps({**body, **({} if path == "/tokenize" else {"max_tokens": 2})})  # escapes the surrogate
    resp = httpx.post(server.base_url + path, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("path", "chunk", "body"),
    [
        ("/v1/completions", "CompletionResponse", {"prompt": "Hi", "logprobs": 2}),
        ("/v1/chat/completions", "ChatCompletionChunk", {"messages": [{"role": "user", "content": "Hi"}],
                                                          "logprobs": True, "top_logprobs": 2}),
        ("/v1/chat/completions", "ChatCompletionChunk", {"messages": [{"role": "user", "content": "Weather?"}],
                                                          "tools": [{"type": "function", "function": {"name": "w"}}],
                                                          "tool_choice": "required"}),
    ],
)  # fmt: skip
def test_streamed_events_follow_the_documented_chunk_schema(server, path, chunk, body):
    """/openapi.json's text/event-stream entry names the chunk schema each event follows."""
    doc = httpx.get(server.base_url + "/openapi.json").json()
    events = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
    data = events["schema"]["properties"]["data"]["anyOf"]
    assert {"const": "[DONE]"} in data and f"#/components/schemas/{chunk}" in json.dumps(data)
    validator = jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{chunk}", "components": doc["components"]}
    )
    body = {**body, "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base_url + path, json=body, timeout=120) as reply:
        lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and len(lines) > 3
    for line in lines[:-1]:
        validator.validate(json.loads(line))
