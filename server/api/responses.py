"""Response bodies as /openapi.json documents them (OpenAI's shapes). The serving code builds plain dicts;
these models exist so that generated clients and schema-driven fuzzers see what the server sends."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error: 400 (a field's rule broken, named in `param`), 401, 404 (unknown model), 413, 429
    (waiting queue full; `Retry-After`), 500, 503."""

    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None


class CompletionResponse(BaseModel):
    """`/v1/completions` without `stream`; with it, `text/event-stream` chunks of this shape
    (`choices[].text` the new text) and a final `data: [DONE]`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ToolCallFunctionOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunctionOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] | None = None


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletionResponse(BaseModel):
    """`/v1/chat/completions` without `stream`; with it, `text/event-stream` chunks
    (`object: chat.completion.chunk`, `choices[].delta`) and a final `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    """One served model (vLLM's card): the base model (`parent` null), or a LoRA adapter, whose
    `parent` is the base model's id and `root` its directory."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed piece of call `index`: its id, type and name come once, its arguments in pieces."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion; the last one, with
    `stream_options.include_usage`, has no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """FastAPI `responses=` entries documenting OpenAI's error body for `statuses`."""
    return {status: {"model": ErrorResponse, "description": _ERROR_WHY[status]} for status in statuses}


_ERROR_WHY = {
    400: "a field breaks a rule (the message names it; `param` is its name)",
    401: "the API key is missing or wrong (only with --api-key)",
    404: "no model of that name is served",
    413: "the body exceeds --max-request-body-bytes",
    429: "the waiting queue is full (--max-waiting-requests); retry after `Retry-After` seconds",
    500: "an internal error (never a client's fault)",
    503: "the engine loop is not running, or the server is shutting down",
}


def with_event_stream(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict]:
    """A 200 that is `model` as JSON, or server-sent events of `chunk` when the request asks for
    `stream` (an error mid-stream is an event of OpenAI's error body; `[DONE]` ends the stream). The
    chunk's schema is added to the components by `stream_schemas`."""
    events = {"anyOf": [_component(chunk), _component(ErrorResponse)]}
    return {
        200: {
            "model": model,
            "description": "JSON; with `stream: true`, server-sent events ending with `data: [DONE]`",
            "content": {"text/event-stream": sse_content(events, done=True)},
        }
    }


def _component(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def stream_schemas() -> dict[str, dict]:
    """The component schemas of the streamed chunks (and the models they use), for /openapi.json."""
    schemas: dict[str, dict] = {}
    for model in (CompletionResponse, ChatCompletionChunk, ErrorResponse):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


KV_EVENT_SCHEMA = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["snapshot", "stored", "evicted", "cleared"]},
        "block_size": {"type": "integer"},
        "num_blocks": {"type": "integer"},
        "hashes": {"type": "array", "items": {"type": "string", "pattern": "^[0-9a-f]{32}$"}},
    },
}


def sse_content(data_schema: dict, done: bool = False) -> dict:
    """A `text/event-stream` media type described event by event: each carries `data` of `data_schema`
    (JSON text, given as `contentSchema`), or the text `[DONE]` when `done` says the stream ends so."""
    data: dict = {"type": "string", "contentMediaType": "application/json", "contentSchema": data_schema}
    if done:
        data = {"anyOf": [data, {"const": "[DONE]"}]}
    return {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": data,
                "event": {"type": "string"},
                "id": {"type": "string"},
            },
        },
    }
