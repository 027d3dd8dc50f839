"""The engine's LoRA adapters: which names are served (from `--lora-modules` and the runtime load and
unload endpoints) and which are loaded in CPU memory.

Registering an adapter reads it (`model.lora.load_adapter`), so a bad path, a rank above
`--max-lora-rank` or an adapter of another base model is refused when it is named, not when a request
first uses it. At most `--max-cpu-loras` adapters stay loaded; a request for a dropped one reads it
again. A request holds its adapter (`Request.lora`) until it ends, so dropping or unregistering an
adapter never takes weights from a running request: unloading means new requests cannot name it, and
the running ones finish with it. Thread-safe: the API registers and resolves adapters from its threads
while the engine steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from conveyor.server.config import LoRAConfig, parse_lora_module
from conveyor.server.model.lora import LoRAAdapter, LoRAError, load_adapter
from conveyor.server.model.models.llama import ModelShape

logger = logging.getLogger(__name__)

# `--lora-modules-file`: how often the file is read (seconds), and how long an adapter that failed to
# load waits before it is tried again.
POLL_SECONDS = 1.0
RETRY_SECONDS = 10.0


class UnknownAdapterError(LoRAError):
    """No adapter of that name is served."""


# Where an adapter was named to the server: `--lora-modules`, `--lora-modules-file`, or the runtime
# load endpoint. The operator owns only the file's adapters.
SOURCE_FLAG, SOURCE_FILE, SOURCE_RUNTIME = "lora-modules", "lora-modules-file", "runtime"


@dataclass(frozen=True)
class AdapterState:
    """One adapter named to the server, as `conveyor:lora_adapter_info` exports it: served (`digest` of
    its files, `model.lora.adapter_digest`), or declared by `--lora-modules-file` and not served
    (`error`, why); `source` says where it was named (SOURCE_FLAG, SOURCE_FILE or SOURCE_RUNTIME)."""

    name: str
    path: str
    source: str
    digest: str = ""
    error: str = ""


class LoRARegistry:
    """Served adapter names and their directories, and the adapters loaded in CPU memory (least
    recently used dropped past `config.cpu_loras`). `base_name`: the served model's name, which no
    adapter may take."""

    def __init__(self, config: LoRAConfig, shape: ModelShape, base_name: str | None = None) -> None:
        self.config = config
        self.shape = shape
        self.base_name = base_name
        self._paths: dict[str, str] = {}
        self._digests: dict[str, str] = {}
        self._sources: dict[str, str] = {}
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()
        # `--lora-modules-file`: the adapters it declared that are served, and why the others are not.
        self._declared: dict[str, str] = {}
        self._failed: dict[str, tuple[str, str]] = {}  # name -> (path, why)
        self._retry_at = 0.0
        self._watch: threading.Thread | None = None
        self._file_problem: str | None = None
        self._stop = threading.Event()

    @property
    def names(self) -> list[str]:
        """Served adapter names, in the order they were registered."""
        with self._lock:
            return list(self._paths)

    def path(self, name: str) -> str | None:
        with self._lock:
            return self._paths.get(name)

    def add(self, name: str, path: str, source: str = SOURCE_RUNTIME) -> LoRAAdapter:
        """Serve the adapter in directory `path` as `name`, named by `source` (SOURCE_*). Raises
        LoRAError (the name is taken, or the adapter cannot be served: see `load_adapter`; or `name` is
        the base model's)."""
        if name == self.base_name:
            raise LoRAError(f"LoRA adapter {name!r}: the name is the base model's")
        with self._lock:
            if name in self._paths:
                raise LoRAError(f"LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, path, self.shape, self.config.max_lora_rank)
        with self._lock:
            if name in self._paths:
                raise LoRAError(f"LoRA adapter {name!r} is already loaded")
            self._paths[name] = path
            self._sources[name] = source
            self._keep(adapter)
        logger.info("LoRA adapter %r (rank %d) loaded from %s", name, adapter.rank, path)
        return adapter

    def remove(self, name: str) -> None:
        """Stop serving `name` (requests already admitted finish with it). Raises UnknownAdapterError."""
        with self._lock:
            if self._paths.pop(name, None) is None:
                raise UnknownAdapterError(f"LoRA adapter {name!r} is not loaded")
            self._loaded.pop(name, None)
            self._digests.pop(name, None)
            self._sources.pop(name, None)
        logger.info("LoRA adapter %r unloaded", name)

    def get(self, name: str) -> LoRAAdapter:
        """The adapter served as `name`, read again if it was dropped from CPU memory. Raises
        UnknownAdapterError, or LoRAError when its files no longer read."""
        with self._lock:
            path = self._paths.get(name)
            if path is None:
                raise UnknownAdapterError(f"LoRA adapter {name!r} is not loaded")
            adapter = self._loaded.get(name)
            if adapter is not None:
                self._loaded.move_to_end(name)
                return adapter
        adapter = load_adapter(name, path, self.shape, self.config.max_lora_rank)
        with self._lock:
            if self._paths.get(name) == path:
                self._keep(self._loaded.get(name) or adapter)
            return self._loaded.get(name, adapter)

    def failures(self) -> dict[str, str]:
        """Adapters `--lora-modules-file` declares that are not served -> why (the LoRAError's text)."""
        with self._lock:
            return {name: why for name, (_, why) in self._failed.items()}

    def states(self) -> list[AdapterState]:
        """Every adapter named to the server: those served, then those declared and not served."""
        with self._lock:
            served = [
                AdapterState(n, p, self._sources[n], self._digests.get(n, "")) for n, p in self._paths.items()
            ]
            failed = [AdapterState(n, p, SOURCE_FILE, error=why) for n, (p, why) in self._failed.items()]
            return served + failed

    def declare(self, declared: dict[str, str]) -> None:
        """Make the adapters `--lora-modules-file` declares (name -> path) the ones it serves: a name it
        no longer declares, or declares with another path, is removed (as `remove`: running requests
        finish with it); a new one is added. One that cannot be added (`add`'s LoRAError: a bad path, a
        rank too high, another base model's, a name already served otherwise) is logged and kept in
        `failures`, and tried again by the next call after RETRY_SECONDS (its files may appear later);
        the others are served all the same. Adapters from `--lora-modules` or the runtime endpoints are
        never touched."""
        for name, path in list(self._declared.items()):
            if declared.get(name) != path:
                with contextlib.suppress(UnknownAdapterError):
                    self.remove(name)
                del self._declared[name]
        with self._lock:
            for name in [n for n in self._failed if n not in declared]:
                del self._failed[name]
            retry = time.monotonic() >= self._retry_at
        for name, path in declared.items():
            if name in self._declared or (name in self._failed and not retry):
                continue
            try:
                self.add(name, path, SOURCE_FILE)
            except LoRAError as exc:
                with self._lock:
                    if self._failed.get(name) != (path, str(exc)):
                        logger.error("--lora-modules-file: %s", exc)
                    self._failed[name] = (path, str(exc))
                continue
            self._declared[name] = path
            with self._lock:
                self._failed.pop(name, None)
        with self._lock:
            if retry:
                self._retry_at = time.monotonic() + RETRY_SECONDS

    def watch(self, path: str) -> None:
        """Serve the adapters of `--lora-modules-file` `path` now (`declare`; blocking), then keep them
        in step with the file from a daemon thread that reads it every POLL_SECONDS, until `close`. The
        file is `--lora-modules`' JSON form as one list, `[{"name": ..., "path": ...}, ...]`; a file that
        is missing, or does not parse, is logged and changes nothing (a Kubernetes ConfigMap volume
        replaces its files atomically, so a half-written file is never read there)."""
        self.declare(self._read(path) or {})
        self._stop.clear()
        self._watch = threading.Thread(
            target=self._poll, args=(path,), name="conveyor-lora-file", daemon=True
        )
        self._watch.start()

    def close(self) -> None:
        """Stop the `watch` thread, if any."""
        self._stop.set()
        if self._watch is not None:
            self._watch.join(timeout=10)
            self._watch = None

    def _poll(self, path: str) -> None:
        while not self._stop.wait(POLL_SECONDS):
            declared = self._read(path)
            if declared is not None:
                try:
                    self.declare(declared)
                except Exception:  # never let the thread die: the next change is tried again
                    logger.exception("--lora-modules-file %s: applying it failed", path)

    def _read(self, path: str) -> dict[str, str] | None:
        """The adapters (name -> path) the file declares; None when it cannot be read or does not parse
        (logged once per distinct problem). Entries take both of `--lora-modules`' forms."""
        try:
            with open(path, encoding="utf-8") as f:
                entries = json.load(f)
            if not isinstance(entries, list):
                raise ValueError('expected a JSON list of {"name": ..., "path": ...}')
            modules = [parse_lora_module(e if isinstance(e, str) else json.dumps(e)) for e in entries]
            names = [m.name for m in modules]
            if len(set(names)) != len(names):
                raise ValueError(f"names {sorted({n for n in names if names.count(n) > 1})} more than once")
        except (OSError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
            if problem != self._file_problem:
                logger.error(
                    "--lora-modules-file %s cannot be used (%s); the served adapters stay as they are",
                    path,
                    problem,
                )
                self._file_problem = problem
            return None
        self._file_problem = None
        return {m.name: m.path for m in modules}

    def _keep(self, adapter: LoRAAdapter) -> None:
        self._digests[adapter.name] = adapter.digest
        self._loaded[adapter.name] = adapter
        self._loaded.move_to_end(adapter.name)
        while len(self._loaded) > self.config.cpu_loras:
            self._loaded.popitem(last=False)
