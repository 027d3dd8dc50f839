"""ASGI middleware of the server: the request body size limit and the API key."""

from __future__ import annotations

import hmac

from conveyor.server.api.errors import APIError

# What a client without the key may still reach (probes and scrapers carry no OpenAI key).
OPEN_PATHS = {"/health", "/metrics"}


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


class BearerAuth:
    """ASGI middleware: every path but /health and /metrics needs `Authorization: Bearer <api_key>`,
    else 401 with OpenAI's `invalid_api_key` (compared in constant time)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            given = b"Bearer " + key if scheme.lower() == b"bearer" else b""  # the scheme is case-insensitive
            if not hmac.compare_digest(given, self.expected):
                refused = APIError(401, "Incorrect API key provided.", code="invalid_api_key").response()
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)
