"""Structured output: grammars that constrain what a request may generate (xgrammar).

A request's `StructuredOutputParams` (a JSON schema, any JSON object, a regex, a choice of strings, or
an EBNF grammar) is compiled once per distinct spec by xgrammar's `GrammarCompiler`, whose cache makes
the second compile of the same spec a lookup. Each constrained request gets its own `GrammarMatcher`
(its position in the grammar); every step the model runner fills one row of a token bitmask per
constrained row (`grammar_bitmask`, part of the step's sampling inputs), the sampler masks the logits
with it (`apply_grammar_bitmask`), and the engine advances the matcher with the sampled token.
Unconstrained rows are never touched. This is vLLM's and SGLang's design
(xgrammar: Dong et al. 2024, arXiv:2411.15100).

JSON is generated compact (`any_whitespace=False`: no free whitespace between tokens), so a small
model cannot loop on blank lines; `strict_mode` keeps objects to the properties the schema names, as
OpenAI's strict structured outputs do.
"""

from __future__ import annotations

import json
import threading

import torch
import xgrammar as xgr

from conveyor.server.messages import StructuredOutputParams


class InvalidGrammarError(ValueError):
    """A spec that does not compile (a malformed schema, regex or grammar); the message says why."""


# JSON Schema keywords xgrammar does not enforce (it would ignore them silently): refused instead, as
# vLLM refuses them for its xgrammar backend.
_UNSUPPORTED_KEYWORDS = (
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "contains", "minContains",
    "maxContains", "unevaluatedProperties", "unevaluatedItems", "dependencies",
)  # fmt: skip


def check_json_schema(schema: object, path: str = "") -> None:
    """Raise InvalidGrammarError naming the first keyword of `schema` (a parsed JSON schema) that
    generation could not enforce."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_json_schema(item, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    where = path or "/"
    for key in _UNSUPPORTED_KEYWORDS:
        if key in schema:
            raise InvalidGrammarError(f"JSON Schema keyword `{key}` (at {where}) is not supported")
    if schema.get("uniqueItems") is True:
        raise InvalidGrammarError(f"JSON Schema keyword `uniqueItems` (at {where}) is not supported")
    if len(schema.get("allOf") or []) > 1:
        raise InvalidGrammarError(f"`allOf` with more than one schema (at {where}) is not supported")
    step = schema.get("multipleOf")
    if isinstance(step, float) and not step.is_integer():
        raise InvalidGrammarError(f"a fractional `multipleOf` (at {where}) is not supported")
    lower = "minimum" in schema or "exclusiveMinimum" in schema
    upper = "maximum" in schema or "exclusiveMaximum" in schema
    if step is not None and lower != upper:
        # xgrammar enforces multipleOf alone or within a closed range, and drops it beside one bound.
        raise InvalidGrammarError(
            f"`multipleOf` with only {'a lower' if lower else 'an upper'} bound (at {where}) is not supported: "
            "give both a minimum and a maximum, or neither"
        )
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        raise InvalidGrammarError(
            f"`minLength`/`maxLength` with `pattern` or `format` (at {where}) is not supported"
        )
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise InvalidGrammarError(f"a `$ref` outside the schema ({ref!r} at {where}) is not supported")
    for key, value in schema.items():
        if key not in ("enum", "const", "default", "examples"):
            check_json_schema(value, f"{path}/{key}")


def complete_required(schema: object, path: str = "") -> object:
    """`schema` (a parsed JSON schema) with every `required` property an object schema does not list in
    `properties` added there as any value: generation runs in strict mode (no property the schema does
    not name), which would otherwise leave a required property out of every output. Raises
    InvalidGrammarError when `additionalProperties: false` forbids such a property (no object matches)."""
    if isinstance(schema, list):
        return [complete_required(item, f"{path}/{i}") for i, item in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: value
        if key in ("enum", "const", "default", "examples")
        else complete_required(value, f"{path}/{key}")
        for key, value in schema.items()
    }
    required = schema.get("required")
    if isinstance(required, list):
        properties = dict(out.get("properties") or {})
        missing = [name for name in required if isinstance(name, str) and name not in properties]
        if missing and schema.get("additionalProperties") is False:
            raise InvalidGrammarError(
                f"required property {missing[0]!r} (at {path or '/'}) is not in `properties` and "
                "`additionalProperties` is false: no object matches"
            )
        extra = schema.get("additionalProperties")
        for name in missing:
            properties[name] = extra if isinstance(extra, dict) else {}
        if missing:
            out["properties"] = properties
    return out


def _choice_grammar(spec: str) -> str:
    choices = json.loads(spec)
    if not choices:
        raise InvalidGrammarError("a choice needs at least one string")
    # A JSON string literal is a valid EBNF string literal in xgrammar's dialect.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredOutputManager:
    """Compiles grammars for one tokenizer and vocabulary and hands out matchers. Thread-safe: the
    API compiles (off the event loop) to validate, the engine loop compiles again (a cache hit) to
    start the request's matcher.

    tokenizer: the model's transformers tokenizer; vocab_size: rows of the LM head's logits, which
    may exceed the tokenizer's own size (padding ids are never allowed).
    """

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def _get_compiler(self) -> xgr.GrammarCompiler:
        # Built on first use: reading the vocabulary takes about half a second, which servers that
        # never see a constrained request should not pay at start.
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, params: StructuredOutputParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `params`. Raises InvalidGrammarError with xgrammar's reason."""
        compiler = self._get_compiler()
        try:
            if params.kind == "json":
                schema = json.loads(params.spec)
                check_json_schema(schema)
                spec = json.dumps(complete_required(schema))
                return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
            if params.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if params.kind == "regex":
                return compiler.compile_regex(params.spec)
            if params.kind == "choice":
                return compiler.compile_grammar(_choice_grammar(params.spec))
            return compiler.compile_grammar(params.spec)
        except InvalidGrammarError:
            raise
        except (RuntimeError, ValueError) as exc:
            # xgrammar's messages start with a C++ source location and may name its own checks.
            reason = str(exc).strip().splitlines()[0].split(": ", 1)[-1] if str(exc).strip() else repr(exc)
            reason = reason.removeprefix("Check failed: (error.empty()) is false: ")
            raise InvalidGrammarError(reason) from None

    def check(self, params: StructuredOutputParams) -> None:
        """Compile `params` (cached for `matcher`) and make sure its grammar allows a first token.
        Raises InvalidGrammarError when it does not compile or no token can start an output."""
        if not self.allows_a_token(xgr.GrammarMatcher(self.compile(params))):
            raise InvalidGrammarError("no output of this model's tokens matches the constraint")

    def allows_a_token(self, matcher: xgr.GrammarMatcher) -> bool:
        """Whether `matcher`'s grammar allows any token next (False: the constraint dead-ended)."""
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())

    def matcher(self, params: StructuredOutputParams) -> xgr.GrammarMatcher:
        """A fresh matcher at the start of `params`'s grammar."""
        return xgr.GrammarMatcher(self.compile(params))


def grammar_bitmask(
    matchers: list[xgr.GrammarMatcher | None],
    rows: list[int],
    vocab_size: int,
    drafts_before: list[list[int]] | None = None,
) -> torch.Tensor:
    """The tokens each constrained row's grammar allows next: xgrammar's `[len(matchers),
    ceil(vocab_size / 32)]` int32 bitmask, with `rows` (rows whose matcher is not None) filled and the
    others left as allocated (all allowed). matchers[i] belongs to logits row i. With
    `drafts_before[i]` (speculative decoding), row i is the grammar's position after those draft
    tokens: they are accepted, the row filled, and the matcher rolled back. A row whose drafts the
    grammar refuses, or that ends it, is left all allowed: it is never used, since the row before it
    rejects the refused draft, or the request ends at the draft."""
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for row in rows:
        matcher = matchers[row]
        drafts = drafts_before[row] if drafts_before else ()
        accepted = 0
        for token_id in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            accepted += 1
        if accepted == len(drafts) and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, row)
        if accepted:
            matcher.rollback(accepted)
    return bitmask


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: in each of `rows`, tokens its grammar does not allow next (`grammar_bitmask`) get -inf.

    logits: `[num_rows, vocab_size]` float32 on the CPU; bitmask rows line up with logits rows.
    """
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
