"""The OpenAI-compatible HTTP front end (FastAPI): routes only.

Request -> protocol validation (protocol.py) -> serving_completions.py / serving_chat.py -> AsyncEngine
-> SSE (sse.py) or JSON. Errors use OpenAI's body (errors.py); nothing a client sends produces a stack
trace or stops the engine loop. A client that disconnects aborts its requests.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.server.api.errors import APIError, validation_message
from conveyor.server.api.metrics import EngineMetrics
from conveyor.server.api.middleware import BearerAuth, BodySizeLimit
from conveyor.server.api.prompts import chat_prompt_ids
from conveyor.server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from conveyor.server.api.serving_chat import ChatServing
from conveyor.server.api.serving_completions import CompletionServing
from conveyor.server.api.sse import kv_event_stream
from conveyor.server.config import ServerConfig
from conveyor.server.engine.async_engine import AsyncEngine

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

        return StreamingResponse(kv_event_stream(engine), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": engine.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "conveyor",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await completion_serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat_serving.chat_completions(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        chat_serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            tokens = await chat_serving.prompt_ids(chat_prompt_ids, req.messages, req.add_generation_prompt)
        else:
            tokens = engine.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        chat_serving.check_model(req.model)
        vocab = engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be in [0, {vocab}); got {bad[:5]}", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    return app
