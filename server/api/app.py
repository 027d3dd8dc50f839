"""The OpenAI-compatible HTTP front end (FastAPI).

Request -> protocol validation -> tokenizer / chat template -> AsyncEngine -> SSE or JSON. Errors use
OpenAI's body `{"error": {"message", "type", "param", "code"}}`; nothing a client sends produces a stack
trace or stops the engine loop. A client that disconnects aborts its requests.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.server.api.errors import APIError
from conveyor.server.api.metrics import EngineMetrics
from conveyor.server.api.prompts import (
    PromptError,
    chat_prompt_ids,
    chat_request_prompt_ids,
    completion_prompt_ids,
)
from conveyor.server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    NamedToolChoice,
    TokenizeRequest,
)
from conveyor.server.api.tools import TOOL_CALL_PARSERS, ToolCallReader, tool_call_json
from conveyor.server.config import ServerConfig
from conveyor.server.engine.async_engine import AsyncEngine
from conveyor.server.engine.engine import InvalidRequestError, RequestOutput
from conveyor.server.engine.kv_cache import KVCacheEvent, KVCacheSnapshot
from conveyor.server.engine.request import Logprob, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    """Accumulated output of one choice (one engine request)."""

    index: int
    num_prompt_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None


class OpenAIServer:
    """Turns HTTP requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncEngine, metrics: EngineMetrics, config: ServerConfig) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = config.max_waiting_requests
        self.tool_parser = TOOL_CALL_PARSERS[config.tool_call_parser]()
        self.tokenizer = engine.engine.tokenizer
        self.model_name = engine.engine.served_model_name
        self.max_model_len = engine.engine.max_model_len

    # -- helpers --------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    async def prompt_ids(self, build: Callable, *args):
        """`build(tokenizer, *args)` (prompts.py) in a worker thread, so that tokenizing and chat
        templating do not hold up the event loop; a PromptError is a 400 naming its field."""
        try:
            return await asyncio.to_thread(build, self.tokenizer, *args)
        except PromptError as exc:
            raise APIError(400, str(exc), exc.param) from None

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """400 for a request the engine would refuse. Runs in a worker thread: compiling a
        structured-output grammar may take a while, and the event loop keeps serving meanwhile."""

        def check() -> None:
            for prompt_ids in prompts:
                self.engine.engine.validate(prompt_ids, params)

        try:
            await asyncio.to_thread(check)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), exc.param) from None

    def admit(self, num_requests: int) -> None:
        """429 (OpenAI's rate-limit body, `Retry-After`) when `num_requests` more would make the
        waiting queue longer than --max-waiting-requests: overload sheds load instead of growing TTFT."""
        limit = self.max_waiting_requests
        if limit is not None and self.engine.num_waiting + num_requests > limit:
            raise APIError(
                429,
                f"the server has {self.engine.num_waiting} requests waiting (--max-waiting-requests "
                f"{limit}); retry later",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )

    async def _merged(
        self, prompts: list[list[int]], params: SamplingParams, n: int, priority: int, arrival: float
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every (prompt, choice) as its own engine request; yield (choice index, output) as they
        come. Closing this iterator aborts every request still running."""
        base = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, prompt_ids: list[int], choice_params: SamplingParams) -> None:
            try:
                async for out in self.engine.generate(
                    f"{base}-{index}", prompt_ids, choice_params, arrival, priority
                ):
                    await queue.put((index, out))
            except Exception as exc:
                await queue.put((index, exc))

        tasks = []
        for p, prompt_ids in enumerate(prompts):
            for i in range(n):
                choice_params = params
                if params.seed is not None and i:
                    # vLLM's rule: choice i of a seeded request uses seed + i, so choices differ and repeat.
                    choice_params = SamplingParams(**{**params.__dict__, "seed": params.seed + i})
                tasks.append(asyncio.create_task(pump(p * n + i, prompt_ids, choice_params)))
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise APIError(500, f"generation failed: {item}") from item
                if item.finished:
                    remaining -= 1
                yield index, item
        finally:
            for task in tasks:
                task.cancel()

    # -- completions ----------------------------------------------------------------------------------

    def _completion_logprobs(self, choice: _Choice) -> dict | None:
        if not choice.logprobs:
            return None
        tokens, offsets, offset = [], [], 0
        for lp in choice.logprobs:
            tokens.append(self.token_text(lp.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in choice.logprobs],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in choice.logprobs],
            "text_offset": offsets,
        }

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(req.model)
        prompts = await self.prompt_ids(completion_prompt_ids, req.prompt)
        params = req.sampling_params(req.max_tokens or 16, req.logprobs)
        await self.validate(prompts, params)
        self.admit(len(prompts) * req.n)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        stream = self._merged(prompts, params, req.n, req.priority, arrival)
        num_prompt_tokens = sum(len(p) for p in prompts)

        if req.stream:

            def delta(index: int, out: RequestOutput) -> dict:
                lp = self._completion_logprobs(_Choice(index, logprobs=out.new_logprobs))
                reason = out.finish_reason.value if out.finish_reason else None
                return {"index": index, "text": out.new_text, "logprobs": lp, "finish_reason": reason}

            header = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
            return _sse_response(stream, header, num_prompt_tokens, req.include_usage, delta)

        choices = await self._collect(stream, raw, len(prompts) * req.n)
        body = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": self._completion_logprobs(c),
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],
            "usage": _usage(num_prompt_tokens, sum(len(c.token_ids) for c in choices)),
        }
        return JSONResponse(body)

    async def _collect(
        self, stream: AsyncIterator[tuple[int, RequestOutput]], raw: Request, num: int
    ) -> list[_Choice]:
        """Gather a non-streamed response; abort everything if the client disconnects meanwhile."""
        choices = [_Choice(i) for i in range(num)]

        async def gather() -> None:
            async for index, out in stream:
                c = choices[index]
                c.text += out.new_text
                c.token_ids += out.new_token_ids
                c.logprobs += out.new_logprobs
                if out.finished:
                    c.finish_reason = out.finish_reason.value if out.finish_reason else None

        task = asyncio.create_task(gather())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await raw.is_disconnected():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    await stream.aclose()
                    raise APIError(499, "client disconnected")
            task.result()
        finally:
            await stream.aclose()
        return choices

    # -- chat completions -------------------------------------------------------------------------------

    def _chat_logprobs(self, logprobs: list[Logprob], top_n: int | None) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for lp in logprobs:
            item = entry(lp.token_id, lp.logprob)
            item["top_logprobs"] = [entry(t, v) for t, v in lp.top[: top_n or 0]]
            content.append(item)
        return {"content": content}

    def _tool_reader(self, req: ChatCompletionRequest) -> ToolCallReader:
        choice = req.effective_tool_choice
        if isinstance(choice, NamedToolChoice):
            return ToolCallReader("named", self.tool_parser, choice.function.name)
        return ToolCallReader(choice, self.tool_parser)

    async def chat_completions(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(req.model)
        prompt_ids = await self.prompt_ids(chat_request_prompt_ids, req)
        max_tokens = (
            req.max_completion_tokens or req.max_tokens or max(1, self.max_model_len - len(prompt_ids))
        )
        params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        await self.validate([prompt_ids], params)
        self.admit(req.n)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        stream = self._merged([prompt_ids], params, req.n, req.priority, arrival)
        top_n = req.top_logprobs

        if req.stream:
            readers = [self._tool_reader(req) for _ in range(req.n)]

            def delta(index: int, out: RequestOutput) -> dict:
                lp = self._chat_logprobs(out.new_logprobs, top_n) if req.logprobs else None
                reader = readers[index]
                content = reader.feed(out.new_text, out.finished)
                reason = out.finish_reason.value if out.finish_reason else None
                if reader.called and reason == "stop":
                    reason = "tool_calls"
                return {"index": index, "delta": content, "logprobs": lp, "finish_reason": reason}

            header = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
            }
            opening = [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(req.n)
            ]
            return _sse_response(stream, header, len(prompt_ids), req.include_usage, delta, opening)

        choices = await self._collect(stream, raw, req.n)
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": [self._chat_choice(c, req) for c in choices],
            "usage": _usage(len(prompt_ids), sum(len(c.token_ids) for c in choices)),
        }
        return JSONResponse(body)

    def _chat_choice(self, c: _Choice, req: ChatCompletionRequest) -> dict:
        content, calls = self._tool_reader(req).read(c.text)
        message: dict = {"role": "assistant", "content": content}
        reason = c.finish_reason
        if calls:
            message["tool_calls"] = [tool_call_json(call) for call in calls]
            reason = "tool_calls" if reason == "stop" else reason
        return {
            "index": c.index,
            "message": message,
            "logprobs": self._chat_logprobs(c.logprobs, req.top_logprobs) if req.logprobs else None,
            "finish_reason": reason,
        }


def _sse_response(
    stream: AsyncIterator[tuple[int, RequestOutput]],
    header: dict,
    num_prompt_tokens: int,
    include_usage: bool,
    delta: Callable[[int, RequestOutput], dict],
    opening: list[dict] | None = None,
) -> StreamingResponse:
    """Server-sent events of OpenAI's streaming format: `opening` choices, then one chunk per output with
    new text (or a finish), the usage chunk when asked for, and `[DONE]`."""

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {**header, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    async def events() -> AsyncIterator[str]:
        completion_tokens = 0
        try:
            for choice in opening or []:
                yield chunk([choice])
            async for index, out in stream:
                if out.finished:
                    completion_tokens += out.num_output_tokens
                if out.new_text or out.finished:
                    choice = delta(index, out)
                    held_back = choice.get("delta") == {} and not choice["finish_reason"]
                    if not held_back or choice.get("logprobs"):  # a tool call still forming sends nothing
                        yield chunk([choice])
            if include_usage:
                yield chunk([], _usage(num_prompt_tokens, completion_tokens))
        except APIError as exc:
            yield f"data: {exc.response().body.decode()}\n\n"
        finally:
            await stream.aclose()  # a client gone mid-stream aborts its requests now
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def kv_event_body(item: KVCacheSnapshot | KVCacheEvent) -> dict:
    """The JSON of one `/v1/kv_events` event: `snapshot` (block_size, num_blocks, hashes), `stored` or
    `evicted` (hashes), `cleared`. A hash is the block's `hash_block` digest as 32 hex digits."""
    if isinstance(item, KVCacheSnapshot):
        return {
            "type": "snapshot",
            "block_size": item.block_size,
            "num_blocks": item.num_blocks,
            "hashes": [h.hex() for h in item.block_hashes],
        }
    if item.kind == "cleared":
        return {"type": "cleared"}
    return {"type": item.kind, "hashes": [h.hex() for h in item.block_hashes]}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _client_path(body: object, loc: tuple) -> list[str]:
    """The parts of a pydantic error location that index into what the client sent: the names of
    union branches (`str`, `list[int]`) pydantic adds are dropped."""
    path, node = [], body
    for part in loc:
        in_dict = isinstance(node, dict) and isinstance(part, str) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if in_dict or in_list:
            node = node[part]
        elif not path and isinstance(part, str):
            node = None  # a missing field: name it
        else:
            continue
        path.append(str(part))
    return path


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for a request body pydantic refused: the field path as the client sent it and
    the rule broken; for a value that matches none of a field's accepted forms, all of them."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg')}", None
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        message = str(cause)
        named = ":" in message and message.split(":", 1)[0].startswith(cause.name)  # names a path already
        return (message if named else f"{cause.name}: {message}"), cause.name
    loc = tuple(p for p in first.get("loc", ()) if p != "body")
    path = _client_path(exc.body, loc)
    where = ".".join(path) or "body"
    if len(path) < len(loc) and len(errors) > 1:  # a union: each branch reported its own complaint
        forms = dict.fromkeys(e.get("msg", "") for e in errors)
        return f"{where}: matches none of the accepted forms ({'; '.join(forms)})", path[0] if path else None
    return f"{where}: {first.get('msg', '').removeprefix('Value error, ')}", path[0] if path else None


# What a client without the key may still reach (probes and scrapers carry no OpenAI key).
_OPEN_PATHS = {"/health", "/metrics"}


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 (OpenAI's error body) before any
    route parses it, whether it declares a Content-Length or comes chunked."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        too_large = APIError(
            413, f"the request body exceeds --max-request-body-bytes ({self.max_bytes} bytes)"
        ).response()
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(scope, receive, send)
            return
        # Read the whole body here (the JSON routes would anyway), counting, then replay it.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


def create_app(engine: AsyncEngine, metrics: EngineMetrics, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app. Starts the engine loop on startup and stops it on shutdown.

    config: the server's settings (default: ServerConfig()). With `api_key`, every path but /health and
    /metrics needs `Authorization: Bearer <api_key>` (else 401, OpenAI's `invalid_api_key`). Setting
    `app.state.draining` (the server does on SIGTERM) makes /health answer 503.
    """
    config = config or ServerConfig()
    api_key = config.api_key

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.is_running:
            engine.start()
        yield
        engine.stop()

    app = FastAPI(title="conveyor", lifespan=lifespan)
    server = OpenAIServer(engine, metrics, config)
    app.state.server = server
    app.state.draining = False
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def require_api_key(request: Request, call_next):
            if request.url.path not in _OPEN_PATHS:
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return APIError(401, "Incorrect API key provided.", code="invalid_api_key").response()
            return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError(400, message, param).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}").response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running and not app.state.draining else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/kv_events")
    async def kv_events() -> StreamingResponse:
        """Server-sent events of the prefix cache's block hashes, for a router: a snapshot, then every
        change. A subscriber that falls behind gets `cleared` and the stream ends: reconnect."""
        if not engine.is_running:
            raise APIError(503, "the engine loop is not running")

        async def events() -> AsyncIterator[str]:
            stream = engine.kv_events()
            try:
                async for item in stream:
                    yield f"data: {json.dumps(kv_event_body(item))}\n\n"
            finally:
                await stream.aclose()  # a client gone unsubscribes now

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": server.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "conveyor",
            "max_model_len": server.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await server.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await server.chat_completions(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        server.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            tokens = await server.prompt_ids(chat_prompt_ids, req.messages, req.add_generation_prompt)
        else:
            tokens = server.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        return {"count": len(tokens), "max_model_len": server.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        server.check_model(req.model)
        vocab = engine.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be in [0, {vocab}); got {bad[:5]}", "tokens")
        return {"prompt": server.tokenizer.decode(req.tokens)}

    return app
