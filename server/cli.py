"""`conveyor` command line: `serve`, plus the commands other packages provide (see COMMANDS).

`serve`'s flags are generated from the pydantic config models (`max_num_seqs` -> `--max-num-seqs`,
booleans as `--x/--no-x`), so they cannot drift from the engine's configuration. The same fields go the
other way too: `serve_argv` renders configs as the arguments that mean them (the operator's pods are
started with its output) and `parse_serve_argv` is the full check `conveyor serve` applies at start
(argparse, then the config models' validation).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import types
import typing
from dataclasses import dataclass
from functools import partial
from typing import get_args, get_origin

from pydantic import BaseModel, ValidationError

from conveyor.server.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)

# Subcommands implemented in other modules: name -> ("module:function(argv) -> int", help).
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": (
        "conveyor.benchmarks.serve:main",
        "benchmark any OpenAI-compatible server (vLLM's bench serve)",
    ),
    "plan": ("conveyor.operator.plan:main", "print the KV-capacity plan (max_num_seqs) of a model on GPUs"),
    "crd": ("conveyor.operator.crd:main", "print or write the InferenceService CRD YAML"),
    "operator": ("conveyor.operator.run:main", "run the Kubernetes operator (kopf)"),
    "router": (
        "conveyor.server.router.app:main",
        "route OpenAI requests over replicas by load and prefix-cache affinity",
    ),
}

# EngineConfig's groups, by its field names, then the HTTP front end's.
_ENGINE_GROUPS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "device": DeviceConfig,
    "lora": LoRAConfig,
    "speculative": SpeculativeConfig,
}
_SERVE_GROUPS: dict[str, type[BaseModel]] = {**_ENGINE_GROUPS, "server": ServerConfig}


def _flag_type(annotation) -> tuple[type | None, list | None]:
    """(argparse type, choices) for a field annotation."""
    if get_origin(annotation) is typing.Literal:
        return type(get_args(annotation)[0]), list(get_args(annotation))
    if get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return _flag_type(inner[0])
    return annotation, None


def flag_name(field: str) -> str:
    """The command-line flag of a config field: `max_num_seqs` -> `--max-num-seqs`."""
    return "--" + field.replace("_", "-")


def add_model_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    skip: set[str] = frozenset(),
    only: set[str] | None = None,
    help_overrides: dict[str, str] | None = None,
) -> None:
    """Add one `--kebab-case` flag per field of `model` (all but `skip`, or just `only`; defaults left to
    the model, so an absent flag is an unset field). `help_overrides` replaces a field's help text where
    another command reads the flag differently (`conveyor plan`)."""
    group = parser.add_argument_group(model.__name__, model.__doc__)
    for name, info in model.model_fields.items():
        if name in skip or (only is not None and name not in only):
            continue
        flag = flag_name(name)
        help_text = (
            info.description if info.default is None else f"{info.description} (default: {info.default})"
        )
        help_text = (help_overrides or {}).get(name, help_text)
        if info.annotation is bool:
            group.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
            continue
        listed = [a for a in (get_args(info.annotation) or ()) if get_origin(a) is list]
        if (
            get_origin(info.annotation) is list or listed
        ):  # repeatable: `--endpoint A B` or `--endpoint A --endpoint B`
            (item,) = get_args(listed[0] if listed else info.annotation)
            group.add_argument(
                flag, dest=name, type=item, nargs="+", action="extend", default=None, help=info.description
            )
            continue
        kind, choices = _flag_type(info.annotation)
        group.add_argument(flag, dest=name, type=kind, choices=choices, default=None, help=help_text)


def _collect(args: argparse.Namespace, model: type[BaseModel]) -> BaseModel:
    values = {k: getattr(args, k) for k in model.model_fields if getattr(args, k, None) is not None}
    return model(**values)


def print_validation_error(prog: str, exc: ValidationError) -> None:
    """One line per error, naming the flag (`conveyor serve: --max-num-seqs: ...`)."""
    for line in _validation_lines(exc):
        print(f"{prog}: {line}", file=sys.stderr)


def collect_config(args: argparse.Namespace, model: type[BaseModel], prog: str) -> BaseModel | None:
    """`model` from the parsed flags, or None after printing why the values are refused."""
    try:
        return _collect(args, model)
    except ValidationError as exc:
        print_validation_error(prog, exc)
        return None


class ServeArgsError(ValueError):
    """`conveyor serve` would refuse these arguments; the message says why, naming the flag."""

    @classmethod
    def from_validation(cls, exc: ValidationError) -> ServeArgsError:
        return cls("; ".join(_validation_lines(exc)))


class _CheckingParser(argparse.ArgumentParser):
    """A parser that raises instead of printing (usage, help) and exiting."""

    def error(self, message: str) -> typing.NoReturn:
        raise ServeArgsError(message)

    def print_help(self, file=None) -> typing.NoReturn:
        raise ServeArgsError("-h/--help prints the help and exits: it is not an argument to serve with")

    def exit(self, status: int = 0, message: str | None = None) -> typing.NoReturn:
        raise ServeArgsError(message or f"the arguments end conveyor serve at once (status {status})")


@dataclass(frozen=True)
class ServeSettings:
    """Everything `conveyor serve` starts from: the engine's configuration and the HTTP front end's."""

    engine: EngineConfig
    server: ServerConfig
    log_level: str = "info"


def _validation_lines(exc: ValidationError) -> list[str]:
    lines = []
    for error in exc.errors():
        where = flag_name("-".join(str(p) for p in error["loc"])) + ": " if error["loc"] else ""
        lines.append(where + error["msg"].removeprefix("Value error, "))
    return lines


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """The configs that parsed `serve` flags mean. Raises pydantic's ValidationError."""
    engine = EngineConfig(**{name: _collect(args, group) for name, group in _ENGINE_GROUPS.items()})
    return ServeSettings(engine, _collect(args, ServerConfig), args.log_level)


def parse_serve_argv(argv: list[str]) -> ServeSettings:
    """What `conveyor serve ARGV` (without the `serve`) would start with, after every check it makes
    before loading the model: argparse (unknown flag, bad choice or type), then the config models.

    Raises ServeArgsError naming the flag (`--max-num-seqs: Input should be greater than or equal to 1`).
    """
    args = build_parser(_CheckingParser).parse_args(["serve", *argv])
    try:
        return settings_from_args(args)
    except ValidationError as exc:
        raise ServeArgsError.from_validation(exc) from None


def check_serve_args(argv: list[str]) -> str | None:
    """Why `conveyor serve ARGV` would refuse to start (see `parse_serve_argv`), or None. The operator
    checks an InferenceService's extraArgs with it before a pod would crash-loop on them."""
    try:
        parse_serve_argv(argv)
    except ServeArgsError as exc:
        return str(exc)
    return None


def _flag_values(config: BaseModel) -> list[str]:
    """Flags for the fields of `config` set explicitly (pydantic's `model_fields_set`) and not None."""
    argv: list[str] = []
    for name in type(config).model_fields:
        value = getattr(config, name)
        if name not in config.model_fields_set or value is None or name == "model":
            continue
        if isinstance(value, bool):
            argv.append(flag_name(name) if value else "--no-" + flag_name(name).removeprefix("--"))
        elif isinstance(value, list):
            argv += [flag_name(name), *map(str, value)]
        else:
            argv += [flag_name(name), str(value)]
    return argv


def serve_argv(engine: EngineConfig, server: ServerConfig) -> list[str]:
    """The `conveyor serve` arguments (after `serve`) that mean `engine` and `server`: the model, if set,
    as the positional argument, then one flag per explicitly set field in the models' field order.
    `parse_serve_argv(serve_argv(e, s))` gives back `e` and `s`."""
    argv = [engine.model.model] if engine.model.model is not None else []
    for name in _ENGINE_GROUPS:
        argv += _flag_values(getattr(engine, name))
    return argv + _flag_values(server)


def build_parser(
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    parser = parser_class(prog="conveyor", description="LLM serving on Kubernetes")
    sub = parser.add_subparsers(dest="command", required=True)
    # No abbreviations: `--po=1` must not pass for `--port` (the operator refuses flags it owns by name).
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible API", allow_abbrev=False)
    serve.add_argument("model", nargs="?", default=None, help=ModelConfig.model_fields["model"].description)
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the server's log level (default: info)",
    )
    for group in _SERVE_GROUPS.values():
        add_model_flags(serve, group, skip={"model"})
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


class _Terminated(Exception):
    """SIGTERM arrived after uvicorn's own handler was gone (it re-raises the signal it drained on)."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated


def serve(settings: ServeSettings) -> int:
    import uvicorn

    from conveyor.server.api.app import create_app
    from conveyor.server.api.metrics import EngineMetrics
    from conveyor.server.engine.async_engine import AsyncEngine
    from conveyor.server.engine.builder import build_engine

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    server_config = settings.server
    try:
        per_expert = server_config.enable_expert_load_metrics
        engine = build_engine(settings.engine, partial(EngineMetrics, per_expert=per_expert))
    except (ValueError, OSError) as exc:  # bad model, path, or shape; no network for a hub id
        print(f"conveyor serve: {exc}", file=sys.stderr)
        return 1
    metrics = engine.observer
    async_engine = AsyncEngine(engine)
    if server_config.api_key is None and os.environ.get("CONVEYOR_API_KEY"):
        server_config = server_config.model_copy(update={"api_key": os.environ["CONVEYOR_API_KEY"]})
    app = create_app(async_engine, metrics, server_config)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # SIGTERM (the pod is going away): readiness fails at once so no new traffic comes; uvicorn
            # then stops listening and waits up to the grace period for running responses.
            app.state.draining = True
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            # uvicorn's graceful shutdown waits for every open response; KV event streams never end.
            async_engine.end_kv_event_streams()
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=server_config.shutdown_grace_period,
    )
    server = Server(config)
    # uvicorn re-raises the signal it shut down on once it has; a drained server exits 0 instead.
    signal.signal(signal.SIGTERM, _raise_terminated)
    with contextlib.suppress(KeyboardInterrupt, _Terminated):
        server.run()
    engine.close()  # tensor-parallel workers, if any
    return 0 if server.started else 3  # uvicorn.run's exit status when startup fails


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        module, _, func = COMMANDS[argv[0]][0].partition(":")
        return getattr(importlib.import_module(module), func)(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print_validation_error("conveyor serve", exc)
        return 2
    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
