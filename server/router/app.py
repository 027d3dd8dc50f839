"""`conveyor router`: an OpenAI-compatible proxy that picks a replica per request (FastAPI + httpx).

Per request: parse the body once; for `prefix-aware`, build the prompt's token ids as the replica will
(server/api/prompts.py, off the event loop) and name its KV blocks; admit (wait while no replica is
ready, up to `queue_timeout`, then 503; 429 with `Retry-After` when every replica is saturated); pick
(router/scoring.py) and count the request at its replica at once, so a burst spreads; forward. The
replica's status, headers and body are passed through chunk by chunk (SSE included). A replica that
fails before the first byte of its answer is taken out and the request is sent once more, elsewhere; a
client that disconnects closes the upstream connection, which aborts the request on the replica.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.server.api.errors import APIError
from conveyor.server.api.prompts import chat_request_prompt_ids, completion_prompt_ids
from conveyor.server.api.protocol import ChatCompletionRequest
from conveyor.server.block_hash import lora_hash_root
from conveyor.server.router.config import RouterConfig
from conveyor.server.router.endpoints import Endpoint, EndpointPool
from conveyor.server.router.metrics import RouterMetrics
from conveyor.server.router.prefix import block_hashes
from conveyor.server.router.scoring import Weights, pick

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Request headers a replica needs; hop-by-hop and length headers are the proxy's own.
_FORWARDED_REQUEST_HEADERS = ("content-type", "accept", "authorization")
_DROPPED_RESPONSE_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "date",
    "server",
}


class _UpstreamFailed(Exception):
    """The replica failed before the first byte of its answer (connection refused, reset, timeout)."""


class ClientGone(Exception):
    """The client disconnected while its request waited."""


async def _unless_disconnected(raw: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it and raising ClientGone if the client disconnects meanwhile."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await raw.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class Router:
    """Admission, picking and forwarding for one router process."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer,
        pool: EndpointPool,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.weights = Weights(
            config.weight_queue, config.weight_kv, config.weight_prefix, config.weight_lora
        )
        self._turn = 0

    # -- prompt -> blocks -------------------------------------------------------------------------------

    def prompt_token_ids(self, path: str, payload: dict) -> list[int] | None:
        """The token ids the replica will compute first, or None when the body is not one we can read
        (the replica then answers the client's error itself)."""
        try:
            if path == "/v1/chat/completions":
                return chat_request_prompt_ids(self.tokenizer, ChatCompletionRequest.model_validate(payload))
            if path == "/v1/completions":
                return completion_prompt_ids(self.tokenizer, payload["prompt"])[0]
        except Exception:  # a routing hint never fails a request: the replica judges the body
            return None
        return None

    # -- admission and picking --------------------------------------------------------------------------

    async def admit(
        self, raw: Request, token_ids: list[int] | None, arrival: float, adapter: str | None = None
    ) -> tuple[Endpoint, int]:
        """The replica for this request (under LoRA `adapter`, None: the base model), counted at it
        already, and the prompt tokens it is believed to hold. Waits while none is ready (polling the
        others every second meanwhile); raises APIError 503 past `queue_timeout`, 429 when every ready
        replica is saturated."""
        hashes_by: dict[tuple[int, bytes | None], list[bytes]] = {}

        def hashes(endpoint: Endpoint) -> list[bytes]:
            size = endpoint.block_size or self.config.block_size
            digest = endpoint.adapters.served.get(adapter) if adapter and endpoint.adapters else None
            root = lora_hash_root(digest) if digest else None
            if (size, root) not in hashes_by:
                hashes_by[size, root] = block_hashes(token_ids, size, root) if token_ids else []
            return hashes_by[size, root]

        def reusable(endpoint: Endpoint) -> list[bytes]:
            """The blocks a replica can skip: never the one holding the prompt's last token, which the
            engine always computes for its logits (`KVCacheManager.get_computed_blocks`)."""
            size = endpoint.block_size or self.config.block_size
            return hashes(endpoint)[: (len(token_ids) - 1) // size] if token_ids else []

        use_prefix = self.config.policy == "prefix-aware" and token_ids is not None
        held = False
        try:
            while True:
                endpoints = list(self.pool.endpoints.values())
                matched = {e.url: e.index.match(reusable(e)) if use_prefix else 0 for e in endpoints}
                decision = pick(
                    [e.candidate(matched[e.url], adapter) for e in endpoints],
                    self.config.policy,
                    self.weights,
                    prompt_blocks=max((len(reusable(e)) for e in endpoints), default=0) if use_prefix else 0,
                    load_gate=self.config.load_gate,
                    max_waiting=self.config.max_waiting_per_endpoint,
                    rng=self.rng,
                    turn=self._turn,
                )
                if decision.endpoint is not None:
                    break
                if decision.reason == "saturated":
                    self.metrics.rejected.labels(self.metrics.model_name, "saturated").inc()
                    raise APIError(
                        429,
                        f"every replica has {self.config.max_waiting_per_endpoint} or more requests waiting; retry later",
                        code="overloaded",
                        headers={"Retry-After": "1"},
                    )
                if not held:
                    held = True
                    self.metrics.waiting.labels(self.metrics.model_name).inc()
                remaining = arrival + self.config.queue_timeout - time.monotonic()
                if remaining <= 0:
                    self.metrics.rejected.labels(self.metrics.model_name, "queue_timeout").inc()
                    raise APIError(
                        503,
                        f"no replica became ready within {self.config.queue_timeout:g} s (queue_timeout)",
                        code="no_replica_ready",
                        headers={"Retry-After": "1"},
                    )
                self.pool.poll_unready_now()
                await _unless_disconnected(raw, self.pool.wait_changed(min(remaining, 1.0)))
        finally:
            if held:
                self.metrics.waiting.labels(self.metrics.model_name).dec()
        self._turn += 1
        endpoint = self.pool.endpoints[decision.endpoint]
        endpoint.in_flight += 1
        endpoint.sent_since_poll += 1
        name = self.metrics.model_name
        self.metrics.in_flight.labels(name, endpoint.url).set(endpoint.in_flight)
        self.metrics.requests.labels(name, endpoint.url, decision.reason).inc()
        self.metrics.queue_time.labels(name).observe(time.monotonic() - arrival)
        hit_tokens = 0
        if token_ids is not None:
            hit_tokens = matched.get(endpoint.url, 0) * (endpoint.block_size or self.config.block_size)
            endpoint.index.routed_to(hashes(endpoint))
        return endpoint, hit_tokens

    async def models(self, raw: Request) -> Response:
        """`/v1/models` of every ready replica, merged by id (the first answer's card of an id): a model
        or LoRA adapter that any ready replica serves is listed, whichever replica a forward would have
        picked. A replica's error (401 without the API key) is passed on when none answers 200; with no
        replica ready the request waits for one, as others do (`forward`)."""
        ready = [e for e in self.pool.endpoints.values() if e.ready]
        if not ready:
            return await self.forward(raw, "/v1/models")
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}

        async def ask(endpoint: Endpoint) -> httpx.Response | None:
            try:
                return await self.client.get(f"{endpoint.url}/v1/models", headers=headers, timeout=5.0)
            except httpx.HTTPError as exc:
                logger.info("/v1/models of %s: %s", endpoint.url, exc)
                return None

        answers = [a for a in await asyncio.gather(*(ask(e) for e in ready)) if a is not None]
        lists = [a for a in answers if a.status_code == 200]
        if not lists:
            if answers:
                return Response(answers[0].content, answers[0].status_code, media_type="application/json")
            return await self.forward(raw, "/v1/models")
        cards: dict[str, dict] = {}
        for answer in lists:
            for card in answer.json().get("data", []):
                cards.setdefault(card["id"], card)
        return JSONResponse({"object": "list", "data": list(cards.values())})

    def release(self, endpoint: Endpoint) -> None:
        endpoint.in_flight -= 1
        self.metrics.in_flight.labels(self.metrics.model_name, endpoint.url).set(endpoint.in_flight)

    # -- forwarding -------------------------------------------------------------------------------------

    async def _open(
        self, raw: Request, endpoint: Endpoint, path: str, body: bytes
    ) -> tuple[httpx.Response, AsyncIterator[bytes], bytes]:
        """Send the request to the replica; return its response, its body's chunks and the first chunk.
        Raises _UpstreamFailed when the replica fails before that chunk."""
        headers = {k: v for k in _FORWARDED_REQUEST_HEADERS if (v := raw.headers.get(k)) is not None}
        request = self.client.build_request(
            raw.method,
            f"{endpoint.url}{path}",
            content=body,
            headers=headers,
            timeout=httpx.Timeout(10.0, read=None),
        )
        try:
            response = await _unless_disconnected(raw, self.client.send(request, stream=True))
        except httpx.TransportError as exc:
            raise _UpstreamFailed(f"{type(exc).__name__}: {exc}") from exc
        chunks = response.aiter_raw()
        try:
            first = await _unless_disconnected(raw, anext(chunks, b""))
        except httpx.TransportError as exc:
            await response.aclose()
            raise _UpstreamFailed(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            await response.aclose()
            raise
        return response, chunks, first

    async def forward(self, raw: Request, path: str) -> Response:
        arrival = time.monotonic()
        body = await raw.body()
        token_ids, adapter = None, None
        if raw.method == "POST":
            try:
                payload = json.loads(body)
            except ValueError as exc:
                raise APIError(400, f"request body is not valid JSON: {exc}") from None
            if isinstance(payload, dict) and isinstance(payload.get("model"), str):
                # Any other name than the base model's may be a LoRA adapter of the replicas.
                adapter = payload["model"] if payload["model"] != self.metrics.model_name else None
            if self.config.policy == "prefix-aware" and isinstance(payload, dict):
                token_ids = await asyncio.to_thread(self.prompt_token_ids, path, payload)
        for attempt in range(2):
            endpoint, hit_tokens = await self.admit(raw, token_ids, arrival, adapter)
            try:
                response, chunks, first = await self._open(raw, endpoint, path, body)
            except _UpstreamFailed as exc:
                self.release(endpoint)
                self.pool.mark_failed(endpoint, str(exc))
                if attempt:
                    self.metrics.rejected.labels(self.metrics.model_name, "failed").inc()
                    raise APIError(
                        502, f"the replica failed before answering: {exc}", code="upstream_failed"
                    ) from None
                self.metrics.retries.labels(self.metrics.model_name, endpoint.url).inc()
                logger.warning("retrying a request elsewhere: %s failed (%s)", endpoint.url, exc)
                continue
            except BaseException:
                self.release(endpoint)
                raise
            if token_ids is not None and response.status_code < 400:  # prompts the replica took
                self.metrics.prompt_tokens.labels(self.metrics.model_name).inc(len(token_ids))
                self.metrics.prefix_hit_tokens.labels(self.metrics.model_name).inc(hit_tokens)
            return StreamingResponse(
                self._relay(endpoint, response, chunks, first),
                status_code=response.status_code,
                headers={
                    k: v for k, v in response.headers.items() if k.lower() not in _DROPPED_RESPONSE_HEADERS
                },
            )
        raise AssertionError("unreachable")

    async def _relay(
        self, endpoint: Endpoint, response: httpx.Response, chunks: AsyncIterator[bytes], first: bytes
    ) -> AsyncIterator[bytes]:
        """The replica's body chunk by chunk. Cancelled when the client leaves: closing the upstream
        response then aborts the request on the replica."""
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as exc:  # the replica died mid-answer: nothing can be resent
            self.pool.mark_failed(endpoint, f"{type(exc).__name__} while streaming")
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                raise  # the client's connection is cut, as the replica's was: an answer it cannot mistake
            # An SSE client is told in-band, as the server reports an error mid-stream (no `[DONE]`).
            error = APIError(
                502, "the replica failed while streaming; the answer is incomplete", code="upstream_failed"
            )
            yield f"data: {error.response().body.decode()}\n\n".encode()
        finally:
            await response.aclose()
            self.release(endpoint)


def create_app(
    config: RouterConfig, tokenizer, metrics: RouterMetrics, rng: random.Random | None = None
) -> FastAPI:
    """The router app. Starts endpoint discovery and polling on startup; stops them on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(limits=limits) as client:
            pool = EndpointPool(client, config.scrape_interval, config.prefix_mode)
            app.state.router = Router(config, tokenizer, pool, client, metrics, rng)
            watch = None
            loop = asyncio.get_running_loop()
            if config.service is not None:
                from conveyor.server.router.endpoints import EndpointSliceWatch

                namespace, name = config.service.split("/")
                watch = EndpointSliceWatch(
                    namespace,
                    name,
                    config.service_port_name,
                    lambda urls: loop.call_soon_threadsafe(pool.set_urls, urls),
                )
                watch.start()
            elif config.endpoint_file is not None:
                from conveyor.server.router.endpoints import EndpointFileWatch

                watch = EndpointFileWatch(
                    config.endpoint_file, lambda urls: loop.call_soon_threadsafe(pool.set_urls, urls)
                )
                watch.start()
            else:
                pool.set_urls(config.endpoint)
            try:
                yield
            finally:
                if watch is not None:
                    watch.stop()
                await pool.close()

    app = FastAPI(title="conveyor router", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(
        _: Request, exc: StarletteHTTPException
    ) -> Response:  # 404, 405 of the router itself
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return APIError(499, "client disconnected").response()

    @app.get("/health")
    async def health() -> Response:
        # Ready with no replica too: requests wait here while a replica scales from zero.
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics(raw: Request) -> Response:
        endpoints = raw.app.state.router.pool.endpoints.values()
        ready = sum(1 for e in endpoints if e.ready)
        metrics.endpoints.labels(metrics.model_name, "ready").set(ready)
        metrics.endpoints.labels(metrics.model_name, "not_ready").set(len(endpoints) - ready)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await raw.app.state.router.models(raw)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await raw.app.state.router.forward(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await raw.app.state.router.forward(raw, "/v1/chat/completions")

    return app


def load_router_tokenizer(source: str | None):
    """The tokenizer (and chat template) of the model the replicas serve, and that model's default name."""
    from conveyor.server.model.loader import converted, load_tokenizer, resolve_model

    model = resolve_model(source)
    return load_tokenizer(converted(model, weights=False)), model.default_name


def build_parser(
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    """`conveyor router`'s flags, one per RouterConfig field (`--weight-prefix` for `weight_prefix`)."""
    from conveyor.server.cli import add_model_flags

    parser = parser_class(prog="conveyor router", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_model_flags(parser, RouterConfig, skip=set())
    return parser


def main(argv: list[str]) -> int:
    """`conveyor router ...`."""
    import uvicorn

    from conveyor.server.cli import collect_config

    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    config = collect_config(args, RouterConfig, "conveyor router")
    if config is None:
        return 2
    try:
        tokenizer, default_name = load_router_tokenizer(config.tokenizer)
    except (ValueError, OSError) as exc:
        print(f"conveyor router: --tokenizer: {exc}", file=sys.stderr)
        return 1
    metrics = RouterMetrics(config.served_model_name or default_name)
    uvicorn.run(
        create_app(config, tokenizer, metrics), host=config.host, port=config.port, log_level=args.log_level
    )
    return 0
