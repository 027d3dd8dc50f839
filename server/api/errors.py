"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, for the server and the router,
and the message of a request body pydantic refused."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from conveyor.server.api.protocol import FieldError


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
        # A lone surrogate from the client cannot be encoded as UTF-8: escape it rather than fail.
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        body = {"error": {"message": message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _client_path(body: object, loc: tuple) -> list[str]:
    """The parts of a pydantic error location that index into what the client sent: the names of
    union branches (`str`, `list[int]`) pydantic adds are dropped."""
    path, node = [], body
    for part in loc:
        in_dict = isinstance(node, dict) and isinstance(part, str) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if in_dict or in_list:
            node = node[part]
        elif isinstance(part, str) and (not path or (isinstance(node, dict) and part == loc[-1])):
            node = None  # a missing field (at the top or where the error points): name it
        else:
            continue
        path.append(str(part))
    return path


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
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
        head = message.split(":", 1)[0] if ":" in message else ""
        named = head == cause.name or head.startswith(cause.name + ".")  # names a path already
        return (message if named else f"{cause.name}: {message}"), cause.name
    loc = tuple(p for p in first.get("loc", ()) if p != "body")
    path = _client_path(exc.body, loc)
    where = ".".join(path) or "body"
    if not path and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object", None
    if first.get("type") == "extra_forbidden":
        return f"{where}: unknown field (not part of the API this server implements)", path[
            0
        ] if path else None
    if len(path) < len(loc) and len(errors) > 1:  # a union: each branch reported its own complaint
        forms = dict.fromkeys(e.get("msg", "") for e in errors)
        return f"{where}: matches none of the accepted forms ({'; '.join(forms)})", path[0] if path else None
    return f"{where}: {first.get('msg', '').removeprefix('Value error, ')}", path[0] if path else None
