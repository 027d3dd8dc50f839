"""OpenAI-compatible request bodies (and vLLM's extensions), validated by pydantic.

A field outside its range fails validation, and the app answers 400 with a message naming the field.
Nothing is silently ignored: OpenAI's and vLLM's fields this server does not implement (`audio`,
`store`, legacy `functions`, vLLM's `use_beam_search`, ...) are accepted only at the value that asks
for nothing (`NOT_IMPLEMENTED`) and are otherwise a 400 naming the field; any other unknown field is a
400 as well.

Structured output comes in OpenAI's spelling (`response_format`: `json_object`, or `json_schema` with a
`schema`) or vLLM's (`structured_outputs` with one of `json`, `regex`, `choice`, `grammar`,
`json_object`; or the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`); at most
one of them per request.
"""

from __future__ import annotations

import functools
import json
import math
import typing
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from conveyor.server.messages import MAX_LOGPROBS, SamplingParams, StructuredOutputParams


def start_limit(name: str) -> dict[str, str]:
    """Marks an integer field whose maximum is known only at start; /openapi.json writes it in (see
    app.py): `token_id` (the vocabulary), `tokens` (max_model_len - 1), `engine_requests`
    (--max-waiting-requests)."""
    return {"x-limit": name}


# A token id; /openapi.json bounds it by the served model's vocabulary.
TokenId = Annotated[int, Field(ge=0, json_schema_extra=start_limit("token_id"))]
NonEmptyText = Annotated[str, Field(min_length=1)]


class FieldError(ValueError):
    """A rule across fields broken by the request; `name` is the field the answer names (`param`)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class NotImplementedFieldError(FieldError):
    """A request field this server does not implement, set to a value that asks for it."""

    def __init__(self, name: str, accepted: tuple[object, ...] = ()) -> None:
        values = ", ".join(json.dumps(a) for a in accepted) or "absent"
        super().__init__(name, f"{name}: not supported by this server yet (accepted only as {values})")


class _Body(BaseModel):
    """Strict JSON types, as OpenAI's API: no `"7"` or `false` for a token id, no `1.0` for `n`, no NaN
    or infinity for a float; no field the model does not declare."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


# Fields of OpenAI's (or vLLM's) request bodies not implemented here, with the values that ask for
# nothing (accepted, then dropped); any other value is a 400 naming the field.
NOT_IMPLEMENTED: dict[str, tuple[object, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "echo": (None, False),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "prompt_cache_key": (None,),
    "guided_decoding_backend": (None, "xgrammar"),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
}


def _same(value: object, accepted: object) -> bool:
    """Equal as JSON values: `1` is not `true`, `0` is not `false` (Python's `==` says they are)."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    return value == accepted and (type(value) is type(accepted) or isinstance(value, int | float))


@functools.cache
def _null_means_default(cls: type[BaseModel]) -> list[str]:
    """The optional fields whose type has no null: OpenAI's API takes `null` for them as "the
    default" (clients and SDKs send it), so the request does too."""
    return [
        name
        for name, field in cls.model_fields.items()
        if not field.is_required()
        and field.default is not None
        and type(None) not in typing.get_args(field.annotation)
    ]


def _request_schema(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """/openapi.json as the server reads a request: each NOT_IMPLEMENTED field at the values it
    accepts, and `null` allowed where it means the default."""
    properties = schema.setdefault("properties", {})
    for name, accepted in NOT_IMPLEMENTED.items():
        if name not in cls.model_fields:
            properties[name] = {"enum": list(accepted), "description": "not implemented: only these values"}
    for name in _null_means_default(cls):
        prop = properties[name]
        outer = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
        properties[name] = {"anyOf": [prop, {"type": "null"}], **outer}


class JSONSchemaFormat(_Body):
    """`response_format.json_schema` (OpenAI): a named schema the output must validate against."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    # `schema` would shadow a pydantic BaseModel attribute; the JSON key is still `schema`.
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: `text` (free), `json_object` (any JSON object) or `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError(
                "type `json_schema` needs a `json_schema` object (with a `name`, and a `schema` to follow)"
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"`json_schema` is only for type `json_schema`, not `{self.type}`")
        return self


class StructuredOutputsOptions(_Body):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsOptions:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self


def _schema_text(schema: dict[str, Any] | str, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise FieldError(
                param.split(".")[0], f"{param}: the schema is not valid JSON ({exc.msg})"
            ) from None
    if not isinstance(schema, dict):
        raise FieldError(param.split(".")[0], f"{param}: a JSON schema is an object")
    return json.dumps(schema)


class _GenerationRequest(_Body):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(json_schema_extra=_request_schema)

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # torch generators take 64-bit seeds; choice i of n uses seed + i.
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    n: int = Field(1, ge=1, le=128, json_schema_extra=start_limit("engine_requests"))
    stop: NonEmptyText | list[NonEmptyText] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, json_schema_extra=start_limit("tokens"))
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor of `user`; neither changes generation
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsOptions | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, min_length=1)
    _structured_output: StructuredOutputParams | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only for `stream: true`")
        return self

    @model_validator(mode="after")
    def _one_structured_output(self) -> _GenerationRequest:
        self._structured_output = self._parse_structured_output()
        return self

    def _parse_structured_output(self) -> StructuredOutputParams | None:
        found: list[StructuredOutputParams] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutputParams("json_object", "", "response_format"))
        elif rf is not None and rf.type == "json_schema":
            schema = _schema_text(rf.json_schema.json_schema, "response_format.json_schema.schema")
            found.append(StructuredOutputParams("json", schema, "response_format"))
        so = self.structured_outputs
        if so is not None:
            param = "structured_outputs"
            if so.json_ is not None:
                found.append(StructuredOutputParams("json", _schema_text(so.json_, param + ".json"), param))
            elif so.regex is not None:
                found.append(StructuredOutputParams("regex", so.regex, param))
            elif so.choice is not None:
                found.append(StructuredOutputParams("choice", json.dumps(so.choice), param))
            elif so.grammar is not None:
                found.append(StructuredOutputParams("grammar", so.grammar, param))
            else:
                found.append(StructuredOutputParams("json_object", "", param))
        if self.guided_json is not None:
            schema = _schema_text(self.guided_json, "guided_json")
            found.append(StructuredOutputParams("json", schema, "guided_json"))
        if self.guided_regex is not None:
            found.append(StructuredOutputParams("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            found.append(StructuredOutputParams("choice", json.dumps(self.guided_choice), "guided_choice"))
        if self.guided_grammar is not None:
            found.append(StructuredOutputParams("grammar", self.guided_grammar, "guided_grammar"))
        if len(found) > 1:
            raise FieldError(
                found[1].param,
                f"give one structured output constraint, not {len(found)} ({', '.join(f.param for f in found)})",
            )
        return found[0] if found else None

    @model_validator(mode="before")
    @classmethod
    def _refuse_not_implemented(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            return body
        defaults = set(_null_means_default(cls))
        body = {k: v for k, v in body.items() if not (v is None and k in defaults)}
        for name, accepted in NOT_IMPLEMENTED.items():
            if name in cls.model_fields:  # implemented by this endpoint (tools: chat only)
                continue
            if name in body and not any(_same(body[name], a) for a in accepted):
                raise NotImplementedFieldError(name, accepted)
        return {k: v for k, v in body.items() if k in cls.model_fields or k not in NOT_IMPLEMENTED}

    # OpenAI's shape: JSON object keys are token ids as strings, values in [-100, 100].
    logit_bias: dict[str, Any] | None = Field(
        None,
        json_schema_extra={
            "propertyNames": {"pattern": "^(0|[1-9][0-9]*)$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
    )

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit() and key == str(int(key))):
                raise ValueError(f"key {key!r} is not a token id (a non-negative integer as a string)")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"the bias of token {key} must be a number, got {value!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {value!r}")
        return bias

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): float(v) for k, v in (self.logit_bias or {}).items()},
            structured_output=self._structured_output,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. `prompt`: text, token ids, or a list of either (one choice set each)."""

    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: int | None = Field(16, ge=1, json_schema_extra=start_limit("tokens"))
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class FunctionDefinition(_Body):
    """A tool's function (OpenAI): `parameters` is the JSON schema of its arguments."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, parameters: dict[str, Any]) -> dict[str, Any]:
        if parameters.get("type", "object") != "object":
            raise ValueError("must be a JSON Schema of type `object` (a call's arguments are a JSON object)")
        return parameters


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    """`tool_choice` naming one function: the reply is a call of it."""

    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """A call in an assistant message fed back to the model."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class RefusalPart(_Body):
    """A refusal in an earlier assistant reply (OpenAI's `refusal` content part)."""

    type: Literal["refusal"]
    refusal: str


def _check_parts(content: Any, kinds: dict[str, str]) -> Any:
    """Checked before pydantic tries each branch of the content union, whose messages would name its
    internals (`content.str: Input should be a valid string`) instead of the part's type. `kinds`:
    each accepted part type and the string field it needs."""
    if isinstance(content, list):
        if not content:
            raise ValueError("an empty list of content parts; give at least one text part")
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str) or kind not in kinds:  # a dict is no type name (nor hashable)
                accepted = " or ".join(kinds)
                raise ValueError(
                    f"content part type {kind!r} is not supported by this model ({accepted} only)"
                )
            if not isinstance(part.get(kinds[kind]), str):
                raise ValueError(f"content part {i} of type {kind!r} needs `{kinds[kind]}`, a string")
    return content


def _text_parts_only(content: Any) -> Any:
    return _check_parts(content, {"text": "text"})


def _text_or_refusal_parts(content: Any) -> Any:
    return _check_parts(content, {"text": "text", "refusal": "refusal"})


Parts = Annotated[list[ContentPart], Field(min_length=1)]
AssistantParts = Annotated[
    list[Annotated[ContentPart | RefusalPart, Field(discriminator="type")]], Field(min_length=1)
]


class _Message(_Body):
    content: str | Parts
    name: str | None = None
    # Only an assistant message carries calls and only a tool message answers one (subclasses).
    tool_calls: None = None
    tool_call_id: None = None
    _carries: ClassVar[frozenset[str]] = frozenset()

    _content_parts = field_validator("content", mode="before")(_text_parts_only)

    @field_validator("tool_calls", "tool_call_id", mode="before")
    @classmethod
    def _only_where_it_belongs(cls, value: Any, info) -> Any:
        if value is not None and info.field_name not in cls._carries:
            owner = "an `assistant`" if info.field_name == "tool_calls" else "a `tool`"
            raise ValueError(f"only {owner} message has `{info.field_name}`")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class SystemMessage(_Message):
    role: Literal["system", "developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    """A previous reply: text, calls, or both; a refusal (the `refusal` field or content part) is shown
    to the model as text. `audio`, `function_call` and `annotations` are accepted empty only, so a reply
    echoed back as the openai client dumps it (`message.model_dump()`) is accepted."""

    role: Literal["assistant"]
    content: str | AssistantParts | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    audio: None = None
    function_call: None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    _carries: ClassVar[frozenset[str]] = frozenset({"tool_calls"})

    _content_parts = field_validator("content", mode="before")(_text_or_refusal_parts)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text if isinstance(p, ContentPart) else p.refusal for p in self.content)
        return self.content or self.refusal or ""


class ToolMessage(_Message):
    """A function's result, answering the call `tool_call_id` (OpenAI requires it)."""

    role: Literal["tool"]
    tool_call_id: str
    _carries: ClassVar[frozenset[str]] = frozenset({"tool_call_id"})


# One message of a conversation, told apart by `role` (OpenAI's schema).
ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions. Without max_tokens the reply may use the rest of the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, json_schema_extra=start_limit("tokens"))
    max_completion_tokens: int | None = Field(None, ge=1, json_schema_extra=start_limit("tokens"))
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_form(cls, choice: Any) -> Any:
        """Checked before pydantic tries each branch of the union, whose messages would name them."""
        named = '{"type": "function", "function": {"name": ...}}'
        if isinstance(choice, dict):
            function = choice.get("function")
            if choice.get("type") not in (None, "function"):
                raise ValueError(
                    f"tool_choice type {choice['type']!r} is not supported by this server yet; name a "
                    f"function as {named}"
                )
            if choice.get("type") != "function" or not isinstance(function, dict) or "name" not in function:
                raise ValueError(f"a named tool_choice is {named}")
        elif choice is not None and choice not in ("none", "auto", "required"):
            raise ValueError(f"must be `none`, `auto`, `required` or {named}, got {choice!r}")
        return choice

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[ChatTool] | None) -> list[ChatTool] | None:
        names = [t.function.name for t in tools or []]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"function names must be unique; {twice[0]!r} is given more than once")
        return tools

    @model_validator(mode="after")
    def _tool_messages_answer_calls(self) -> ChatCompletionRequest:
        """A `tool` message answers a call an earlier assistant message made (OpenAI's rule)."""
        asked: set[str] = set()
        for i, message in enumerate(self.messages):
            if isinstance(message, AssistantMessage):
                asked.update(call.id for call in message.tool_calls or [])
            elif isinstance(message, ToolMessage) and message.tool_call_id not in asked:
                raise FieldError(
                    "messages",
                    f"messages.{i}.tool_call_id: {message.tool_call_id!r} answers no tool call of an "
                    "earlier assistant message",
                )
        return self

    @model_validator(mode="after")
    def _one_max_tokens(self) -> ChatCompletionRequest:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise FieldError(
                "max_completion_tokens",
                "max_completion_tokens and max_tokens (its older name) differ; give one of them",
            )
        return self

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs `logprobs: true`")
        return self

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice != "required" and not isinstance(choice, NamedToolChoice):
            return self
        names = [t.function.name for t in self.tools or []]
        if not names:
            raise FieldError("tool_choice", "a `required` or named tool_choice needs `tools`")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError(
                "tool_choice", f"function {choice.function.name!r} is not one of the tools {names}"
            )
        if self._structured_output is not None:
            raise FieldError(
                "tool_choice",
                f"a `required` or named tool_choice constrains the output itself; drop "
                f"{self._structured_output.param}",
            )
        self._structured_output = StructuredOutputParams("json", json.dumps(self.tool_call_schema()), "tools")
        return self

    def tool_schema_checks(self) -> list[StructuredOutputParams]:
        """One constraint per tool, named by its path (`tools.0.function.parameters`), that must
        compile for its `parameters` schema to be usable: a bad schema is a 400 naming the tool
        whatever `tool_choice` says, as OpenAI answers."""
        return [
            StructuredOutputParams(
                "json", json.dumps(t.function.parameters), f"tools.{i}.function.parameters"
            )
            for i, t in enumerate(self.tools or [])
        ]

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: `auto` when tools are given, else `none`."""
        return self.tool_choice or ("auto" if self.tools else "none")

    def tool_call_schema(self) -> dict[str, Any]:
        """The JSON schema a constrained tool call's output follows (vLLM's): for a named function its
        arguments; for `required` a list of `{"name", "parameters"}`, one of the tools each."""
        tools = {t.function.name: t.function for t in self.tools or []}
        if isinstance(self.tool_choice, NamedToolChoice):
            return tools[self.tool_choice.function.name].parameters
        one_of = [
            {
                "type": "object",
                "properties": {"name": {"enum": [name]}, "parameters": fn.parameters},
                "required": ["name", "parameters"],
            }
            for name, fn in tools.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if not self.parallel_tool_calls:
            array["maxItems"] = 1
        return array


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


class TokenizeRequest(_Body):
    """POST /tokenize of a text (`prompt`, with `add_special_tokens`) or of chat messages through the
    chat template (`messages`, with `add_generation_prompt`): exactly one of the two."""

    # Absent, not null, when not given; /openapi.json says "exactly one of the two" with `oneOf`.
    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
    )

    model: str | None = None
    prompt: str = Field(None, validate_default=False, json_schema_extra=_no_default)
    messages: list[ChatMessage] = Field(
        None, min_length=1, validate_default=False, json_schema_extra=_no_default
    )
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give either `prompt` (a text) or `messages`, not both or neither")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's body): serve the PEFT adapter in directory `lora_path` as
    `lora_name`."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's body; `lora_int_id` is accepted and not needed)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
