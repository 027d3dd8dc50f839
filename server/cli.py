"""`conveyor` command line: `serve`, plus the commands other packages provide (see COMMANDS).

`serve`'s flags are generated from the pydantic config models (`max_num_seqs` -> `--max-num-seqs`,
booleans as `--x/--no-x`), so they cannot drift from the engine's configuration.
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
from typing import get_args, get_origin

from pydantic import BaseModel, ValidationError

from conveyor.server.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
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

_SERVE_GROUPS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "device": DeviceConfig,
    "server": ServerConfig,
}


def _flag_type(annotation) -> tuple[type | None, list | None]:
    """(argparse type, choices) for a field annotation."""
    if get_origin(annotation) is typing.Literal:
        return type(get_args(annotation)[0]), list(get_args(annotation))
    if get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return _flag_type(inner[0])
    return annotation, None


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel], skip: set[str]) -> None:
    """Add one `--kebab-case` flag per field of `model` (defaults left to the model)."""
    group = parser.add_argument_group(model.__name__, model.__doc__)
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = (
            info.description if info.default is None else f"{info.description} (default: {info.default})"
        )
        if info.annotation is bool:
            group.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
            continue
        if get_origin(info.annotation) is list:  # repeatable: `--endpoint A B` or `--endpoint A --endpoint B`
            (item,) = get_args(info.annotation)
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
    for error in exc.errors():
        loc = [str(p) for p in error["loc"]]
        where = ("--" + "-".join(loc).replace("_", "-") + ": ") if loc else ""
        print(f"{prog}: {where}{error['msg'].removeprefix('Value error, ')}", file=sys.stderr)


def collect_config(args: argparse.Namespace, model: type[BaseModel], prog: str) -> BaseModel | None:
    """`model` from the parsed flags, or None after printing why the values are refused."""
    try:
        return _collect(args, model)
    except ValidationError as exc:
        print_validation_error(prog, exc)
        return None


class _ArgumentError(Exception):
    pass


class _CheckingParser(argparse.ArgumentParser):
    """A parser that raises instead of printing usage and exiting."""

    def error(self, message: str) -> typing.NoReturn:
        raise _ArgumentError(message)


def check_serve_args(argv: list[str]) -> str | None:
    """argparse's complaint about `conveyor serve ARGV` (unknown flag, bad choice or value type), or
    None when it parses. The operator checks an InferenceService's extraArgs with it before a pod
    would crash-loop on them."""
    try:
        build_parser(_CheckingParser).parse_args(["serve", *argv])
    except _ArgumentError as exc:
        return str(exc)
    return None


def build_parser(
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    parser = parser_class(prog="conveyor", description="LLM serving on Kubernetes")
    sub = parser.add_subparsers(dest="command", required=True)
    # No abbreviations: `--po=1` must not pass for `--port` (the operator refuses flags it owns by name).
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible API", allow_abbrev=False)
    serve.add_argument("model", nargs="?", default=None, help=ModelConfig.model_fields["model"].description)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    for group in _SERVE_GROUPS.values():
        add_model_flags(serve, group, skip={"model"})
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


class _Terminated(Exception):
    """SIGTERM arrived after uvicorn's own handler was gone (it re-raises the signal it drained on)."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from conveyor.server.api.app import create_app
    from conveyor.server.api.metrics import EngineMetrics
    from conveyor.server.engine.async_engine import AsyncEngine
    from conveyor.server.engine.engine import LLMEngine

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = EngineConfig(
            model=_collect(args, ModelConfig),
            cache=_collect(args, CacheConfig),
            scheduler=_collect(args, SchedulerConfig),
            device=_collect(args, DeviceConfig),
        )
        server_config = _collect(args, ServerConfig)
    except ValidationError as exc:
        print_validation_error("conveyor serve", exc)
        return 2
    try:
        engine = LLMEngine(config)
    except (ValueError, OSError) as exc:  # bad model, path, or shape; no network for a hub id
        print(f"conveyor serve: {exc}", file=sys.stderr)
        return 1
    metrics = EngineMetrics(engine.served_model_name, engine.limits)
    engine.observer = metrics
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
        log_level=args.log_level,
        timeout_graceful_shutdown=server_config.shutdown_grace_period,
    )
    server = Server(config)
    # uvicorn re-raises the signal it shut down on once it has; a drained server exits 0 instead.
    signal.signal(signal.SIGTERM, _raise_terminated)
    with contextlib.suppress(KeyboardInterrupt, _Terminated):
        server.run()
    return 0 if server.started else 3  # uvicorn.run's exit status when startup fails


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        module, _, func = COMMANDS[argv[0]][0].partition(":")
        return getattr(importlib.import_module(module), func)(argv[1:])
    args = build_parser().parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
