"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, for the server and the router."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error answered with OpenAI's error body. `headers`: extra response headers (`Retry-After`)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        if self.status == 404:
            kind = "not_found_error"
        elif self.status == 429:
            kind = "rate_limit_error"
        elif self.status < 500:
            kind = "invalid_request_error"
        else:
            kind = "internal_server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)
