"""`conveyor serve` flags come from the config models (the docs' flag page is generated from the same
parser: tests/unit/test_docs_site.py)."""

from __future__ import annotations

import pytest

from conveyor.server.cli import build_parser


def test_flags_map_one_to_one_to_config_fields():
    args = build_parser().parse_args(
        ["serve", "/models/x", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--scheduling", "static"]
    )
    assert (args.model, args.max_num_seqs, args.enable_prefix_caching, args.scheduling) == (
        "/models/x",
        8,
        False,
        "static",
    )
    assert args.max_num_batched_tokens is None  # unset flags fall back to the model's default


def test_bad_choice_is_rejected():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--scheduling", "sometimes"])


def test_check_serve_args_refuses_abbreviations_and_unknown_flags() -> None:
    from conveyor.server.cli import check_serve_args

    assert check_serve_args(["model", "--port", "9000", "--seed", "3"]) is None
    assert check_serve_args(["model", "--po=1"]) == "unrecognized arguments: --po=1"
    assert check_serve_args(["model", "--max-num-s", "3"]) == "unrecognized arguments: --max-num-s 3"
    assert "invalid int value" in (check_serve_args(["model", "--seed", "x"]) or "")
    # --help would print and exit(0): the operator's check must say so, not end the operator.
    assert check_serve_args(["model", "--help"]) == (
        "-h/--help prints the help and exits: it is not an argument to serve with"
    )
    assert check_serve_args(["-h"]) is not None
    # The config models' own rules, not only argparse's: what would stop `conveyor serve` at start.
    assert check_serve_args(["model", "--kv-cache-memory", "0"]) == (
        "--kv-cache-memory: Input should be greater than or equal to 1"
    )
    assert check_serve_args(["--gpu-memory-utilization", "1.5"]) == (
        "--gpu-memory-utilization: Input should be less than or equal to 1"
    )
    # Rules between groups too: without chunking a whole prompt must fit one step.
    assert check_serve_args(["--no-enable-chunked-prefill", "--max-model-len", "4096"]) == (
        "without chunked prefill a prompt must fit one step: --max-num-batched-tokens 2048 is less than "
        "--max-model-len 4096"
    )
    assert check_serve_args(["--scheduling", "static", "--max-model-len", "4096"]) is not None
    assert check_serve_args(["--scheduling", "static", "--max-model-len", "2048"]) is None
    # LoRA: both --lora-modules forms parse, bad entries and flag combinations are refused by name.
    assert (
        check_serve_args(["--enable-lora", "--lora-modules", "a=/p", '{"name": "b", "path": "/q"}']) is None
    )
    assert check_serve_args(["--lora-modules", "a=/p"]) == "--lora-modules needs --enable-lora"
    assert check_serve_args(["--enable-lora", "--lora-modules", "garbage"]) == (
        "--lora-modules: entry 'garbage' must be name=path or a JSON object"
    )
    assert check_serve_args(["--enable-lora", "--lora-modules", "a=/p", "a=/q"]) == (
        "--lora-modules: names ['a'] more than once"
    )
    assert check_serve_args(["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"]) == (
        "--max-cpu-loras 1 must be at least --max-loras 2"
    )
    assert check_serve_args(["--enable-lora", "--tensor-parallel-size", "2"]) == (
        "--enable-lora runs on one rank: use --tensor-parallel-size 1"
    )
    assert "--model-impl native" in check_serve_args(["--enable-lora", "--model-impl", "transformers"])


def _other_value(info, name: str = ""):
    """A valid value for a config field that differs from its default."""
    from typing import Literal, get_args, get_origin

    annotation = info.annotation
    if get_origin(annotation) is Literal:
        return next(c for c in get_args(annotation) if c != info.default)
    kinds = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
    kind = kinds[0]
    if get_origin(kind) is Literal:  # an optional choice
        return get_args(kind)[0]
    if kind is bool:
        return not info.default
    if kind is float:
        return 0.5 if info.default != 0.5 else 0.25
    if kind is int:
        return (info.default or 3) * 2 + 1  # within every field's bounds (ports, body size, ...)
    if kind is str and name == "speculative_config":
        return '{"method": "ngram", "num_speculative_tokens": 3}'
    if kind is str:
        return "some-value"
    if get_origin(kind) is list:  # --lora-modules
        return ["adapter=/some/path", '{"name": "other", "path": "/other/path"}']
    raise AssertionError(f"no test value for {annotation}")


def test_serve_argv_renders_every_field_so_that_serve_parses_it_back() -> None:
    """serve_argv is the inverse of the parser: every field of every group, set to a non-default value,
    comes back identical through `conveyor serve`'s full check."""
    from conveyor.server.cli import _ENGINE_GROUPS, parse_serve_argv, serve_argv
    from conveyor.server.config import EngineConfig, ServerConfig

    def changed(model):
        return model(**{name: _other_value(info, name) for name, info in model.model_fields.items()})

    # LoRA runs on one rank and speculation with continuous batching: the changed tensor-parallel size
    # and LoRA group go separately, as do the changed (static) scheduling and speculation.
    for apart in (("parallel", "speculative"), ("lora", "scheduler")):
        engine = EngineConfig(
            **{name: changed(group) for name, group in _ENGINE_GROUPS.items() if name not in apart}
        )
        server = changed(ServerConfig)
        argv = serve_argv(engine, server)
        assert argv[0] == "some-value"  # the model, positional
        settings = parse_serve_argv(argv)
        assert settings.engine.model_dump() == engine.model_dump()
        assert settings.server.model_dump() == server.model_dump()
    # Unset fields are not rendered: the server applies its own defaults.
    assert serve_argv(EngineConfig(), ServerConfig()) == []
