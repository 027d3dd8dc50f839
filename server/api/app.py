"""The OpenAI-compatible HTTP front end (FastAPI): routes only.

Request -> protocol validation (protocol.py) -> serving_completions.py / serving_chat.py -> AsyncEngine
-> SSE (sse.py) or JSON. Errors use OpenAI's body (errors.py); nothing a client sends produces a stack
trace or stops the engine loop. A client that disconnects aborts its requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.server.api.errors import APIError, validation_message
from conveyor.server.api.metrics import EngineMetrics
from conveyor.server.api.middleware import OPEN_PATHS, BearerAuth, BodySizeLimit
from conveyor.server.api.prompts import chat_prompt_ids, text_token_ids
from conveyor.server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from conveyor.server.api.responses import (
    KV_EVENT_SCHEMA,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    error_responses,
    sse_content,
    stream_schemas,
    with_event_stream,
)
from conveyor.server.api.serving_chat import ChatServing
from conveyor.server.api.serving_completions import CompletionServing
from conveyor.server.api.sse import kv_event_stream
from conveyor.server.config import ServerConfig
from conveyor.server.engine.async_engine import AsyncEngine
from conveyor.server.engine.lora import UnknownAdapterError
from conveyor.server.model.lora import LoRAError

logger = logging.getLogger(__name__)


def create_app(engine: AsyncEngine, metrics: EngineMetrics, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app. Starts the engine loop on startup and stops it on shutdown.

    config: the server's settings (default: ServerConfig()). With `api_key`, every path but /health and
    /metrics needs `Authorization: Bearer <api_key>` (else 401, OpenAI's `invalid_api_key`). Setting
    `app.state.draining` (the server does on SIGTERM) makes /health answer 503.
    """
    config = config or ServerConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.is_running:
            engine.start()
        yield
        engine.stop()

    app = FastAPI(title="conveyor", lifespan=lifespan)
    app.openapi = lambda: _openapi(app, engine, config)
    completion_serving = CompletionServing(engine, config)
    chat_serving = ChatServing(engine, config)
    app.state.engine = engine
    app.state.draining = False
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)
    if config.api_key is not None:  # added last: outermost, so a request without the key is not even read
        app.add_middleware(BearerAuth, api_key=config.api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return APIError(400, message, param).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}").response()

    auth = error_responses(401) if config.api_key else {}
    generation = {**error_responses(400, 404, 413, 429, 503), **auth}
    plain = {**error_responses(400, 404, 413), **auth}

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "ready (empty body)"},
            503: {"description": "not ready (empty body)"},
        },
    )
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running and not app.state.draining else 503)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}},
    )
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(
        "/v1/kv_events",
        response_class=StreamingResponse,
        responses={
            200: {
                "description": "a snapshot event, then one per change",
                "content": {"text/event-stream": sse_content(KV_EVENT_SCHEMA)},
            },
            **error_responses(503),
            **auth,
        },
    )
    async def kv_events() -> StreamingResponse:
        """Server-sent events of the prefix cache's block hashes, for a router: a snapshot, then every
        change. A subscriber that falls behind gets `cleared` and the stream ends: reconnect."""
        if not engine.is_running:
            raise APIError(503, "the engine loop is not running")

        return StreamingResponse(kv_event_stream(engine), media_type="text/event-stream")

    card = {
        "id": engine.model_name,
        "object": "model",
        "created": int(time.time()),  # when this server started serving it
        "owned_by": "conveyor",
        "root": engine.model_name,
        "parent": None,
        "max_model_len": engine.max_model_len,
    }

    def cards() -> list[dict]:
        """The base model's card, then one per served LoRA adapter."""
        adapters = engine.lora_adapters()
        return [card] + [
            {**card, "id": name, "root": path, "parent": engine.model_name} for name, path in adapters.items()
        ]

    @app.get("/v1/models", response_model=ModelList, responses=auth)
    async def models() -> dict:
        return {"object": "list", "data": cards()}

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={**error_responses(404), **auth})
    async def model(model: str) -> dict:
        chat_serving.check_model(model)
        return next(c for c in cards() if c["id"] == model)

    if engine.lora_enabled:
        metrics.watch_lora_adapters(engine.lora_states)
    if config.allow_runtime_lora_updating and not engine.lora_enabled:
        logger.warning("--allow-runtime-lora-updating has no effect without --enable-lora")

    def check_lora_updating() -> None:
        if not config.allow_runtime_lora_updating:
            raise APIError(
                404, "runtime LoRA updating is off: start the server with --allow-runtime-lora-updating"
            )
        if not engine.lora_enabled:
            raise APIError(404, "LoRA is off: start the server with --enable-lora")

    lora_responses = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}
    # In /openapi.json only where they serve (vLLM registers them only then): elsewhere they answer 404.
    lora_updates = config.allow_runtime_lora_updating and engine.lora_enabled

    @app.post(
        "/v1/load_lora_adapter",
        response_class=Response,
        responses={**lora_responses, **plain},
        include_in_schema=lora_updates,
    )
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        """Serve another adapter (`--allow-runtime-lora-updating`). 400 when it cannot be served (a bad
        path, a rank above --max-lora-rank, another base model's adapter, a name already served)."""
        check_lora_updating()
        if req.lora_name == engine.model_name:
            raise APIError(400, f"`{req.lora_name}` is the base model's name", "lora_name")
        try:
            await asyncio.to_thread(engine.load_lora_adapter, req.lora_name, req.lora_path)
        except LoRAError as exc:
            param = "lora_name" if "already loaded" in str(exc) else "lora_path"
            raise APIError(400, str(exc), param) from None
        return Response(
            f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain"
        )

    @app.post(
        "/v1/unload_lora_adapter",
        response_class=Response,
        responses={**lora_responses, **plain},
        include_in_schema=lora_updates,
    )
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        """Stop serving an adapter (`--allow-runtime-lora-updating`): new requests naming it get 404;
        requests already running under it finish with it. 404 for a name not served."""
        check_lora_updating()
        try:
            engine.unload_lora_adapter(req.lora_name)
        except UnknownAdapterError as exc:
            raise APIError(404, str(exc), "lora_name", "model_not_found") from None
        return Response(
            f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain"
        )

    @app.post(
        "/v1/completions",
        responses={**with_event_stream(CompletionResponse, CompletionResponse), **generation},
    )
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await completion_serving.completions(req, raw)

    @app.post(
        "/v1/chat/completions",
        responses={**with_event_stream(ChatCompletionResponse, ChatCompletionChunk), **generation},
    )
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat_serving.chat_completions(req, raw)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=plain)
    async def tokenize(req: TokenizeRequest) -> dict:
        chat_serving.check_model(req.model)
        if req.messages is not None:
            tokens = await chat_serving.prompt_ids(chat_prompt_ids, req.messages, req.add_generation_prompt)
        else:
            tokens = await chat_serving.prompt_ids(text_token_ids, req.prompt, req.add_special_tokens)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=plain)
    async def detokenize(req: DetokenizeRequest) -> dict:
        chat_serving.check_model(req.model)
        vocab = engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be in [0, {vocab}); got {bad[:5]}", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    return app


def _openapi(app: FastAPI, engine: AsyncEngine, config: ServerConfig) -> dict:
    """The schema as the server behaves: FastAPI's 422 replaced by the 400 the server answers, and the
    limits only known at start (vocabulary, context length, --max-waiting-requests) written into the
    input schemas."""
    if app.openapi_schema is None:
        schema = get_openapi(title="conveyor", version="1", routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        for name, component in stream_schemas().items():
            schema["components"]["schemas"].setdefault(name, component)
        if config.api_key is not None:  # every path but OPEN_PATHS needs the key
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for route, path in schema["paths"].items():
                for operation in path.values():
                    if route not in OPEN_PATHS:
                        operation["security"] = [{"bearer": []}]
        maxima = {"token_id": engine.vocab_size - 1, "tokens": engine.max_model_len - 1}
        if config.max_waiting_requests is not None:
            maxima["engine_requests"] = config.max_waiting_requests
        _bound_limits(schema, maxima)
        app.openapi_schema = schema
    return app.openapi_schema


def _bound_limits(node: object, maxima: dict[str, int]) -> None:
    """Every schema marked `x-limit` (protocol.start_limit) gets its maximum from `maxima`, on the
    schema itself or on the integer branch of an optional field; a limit not in `maxima` is left open."""
    if isinstance(node, dict):
        name = node.pop("x-limit", None)
        if name in maxima:
            for target in (node, *node.get("anyOf", ())):
                if target.get("type") == "integer":
                    target["maximum"] = min(target.get("maximum", maxima[name]), maxima[name])
        for value in node.values():
            _bound_limits(value, maxima)
    elif isinstance(node, list):
        for value in node:
            _bound_limits(value, maxima)
