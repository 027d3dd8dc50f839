"""schemathesis hooks for tests/e2e/test_openapi_schemathesis.py (loaded through SCHEMATHESIS_HOOKS).

`positive_data_acceptance` sends schema-valid requests and expects them served. A few are refused on
purpose, with a 400 in OpenAI's error body, for rules a JSON Schema cannot state; a refusal is let
through only when the server's own message names one of these rules, so any other 400 still fails:

- an integer written as a number with a fraction part (`"n": 1.0`): JSON Schema counts it as an
  integer, while the API takes JSON integers only (OpenAI's strict types);
- rules across fields: prompt plus max_tokens within max_model_len, min_tokens <= max_tokens, one
  structured-output constraint, top_logprobs with logprobs, stream_options with stream, a named or
  `required` tool_choice with tools, a `tool` message answering a call of an earlier assistant
  message, unique function names in `tools`, a batch of prompts times n within --max-waiting-requests;
- a structured-output constraint that does not compile or that no output can match.

One more kind is not schema-valid at all: schemathesis compares integers with the schema's bounds as
floats, so near `seed`'s bound of 2**63 - 1 it sends 9223372036854775999 as valid; the server's refusal
names the bound it broke.
"""

from __future__ import annotations

import re

import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData

# (param, message) patterns of the server's 400s for rules across fields or beyond JSON Schema.
CROSS_FIELD_RULES = [
    (r"(max_tokens|max_completion_tokens|prompt|messages)", r"maximum context length is \d+ tokens"),
    (r"min_tokens", r"min_tokens \(\d+\) must not exceed max_tokens"),
    (r".*", r"give one structured output constraint, not \d+"),
    (r"top_logprobs", r"top_logprobs needs `logprobs: true`"),
    (r"stream_options", r"stream_options is only for `stream: true`"),
    (r"tool_choice", r"(needs `tools`|is not one of the tools|constrains the output itself)"),
    (r"messages", r"messages\.\d+\.tool_call_id: .* answers no tool call of an earlier assistant message"),
    (r"n", r"n: the request needs \d+ engine requests, more than --max-waiting-requests"),
]
STRUCTURED_OUTPUT_PARAMS = {
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
}


def _value_at(body: object, path: str) -> object:
    for part in path.split("."):
        if isinstance(body, dict):
            body = body.get(part)
        elif isinstance(body, list) and part.isdigit() and int(part) < len(body):
            body = body[int(part)]
        else:
            return None
    return body


def refused_on_purpose(body: object, error: dict) -> bool:
    """True when `error` (OpenAI's error object of a 400) names a rule listed in the module docstring."""
    param, message = error.get("param") or "", error.get("message") or ""
    if message == f"{param}: Input should be a valid integer":
        value = _value_at(body, param)
        return isinstance(value, float) and value.is_integer()
    bound = re.fullmatch(
        rf"{re.escape(param)}: Input should be (less|greater) than or equal to (-?\d+)", message
    )
    if bound:
        value, limit = _value_at(body, param), int(bound.group(2))
        return isinstance(value, int) and (value > limit if bound.group(1) == "less" else value < limit)
    if param in STRUCTURED_OUTPUT_PARAMS and message.startswith(param + ":"):
        return True  # the constraint does not compile, or matches no output
    return any(re.fullmatch(p, param) and re.search(m, message) for p, m in CROSS_FIELD_RULES)


@schemathesis.hook
def filter_failure(ctx, failure, case, response) -> bool:
    """Keep every failure except a schema-valid request refused for a rule listed above."""
    if not isinstance(failure, RejectedPositiveData) or response.status_code != 400:
        return True
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return True
    return not refused_on_purpose(case.body, error)
