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

import logging
import threading
from collections import OrderedDict

from conveyor.server.config import LoRAConfig
from conveyor.server.model.lora import LoRAAdapter, LoRAError, load_adapter
from conveyor.server.model.models.llama import ModelShape

logger = logging.getLogger(__name__)


class UnknownAdapterError(LoRAError):
    """No adapter of that name is served."""


class LoRARegistry:
    """Served adapter names and their directories, and the adapters loaded in CPU memory (least
    recently used dropped past `config.cpu_loras`)."""

    def __init__(self, config: LoRAConfig, shape: ModelShape) -> None:
        self.config = config
        self.shape = shape
        self._paths: dict[str, str] = {}
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        """Served adapter names, in the order they were registered."""
        with self._lock:
            return list(self._paths)

    def path(self, name: str) -> str | None:
        with self._lock:
            return self._paths.get(name)

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Serve the adapter in directory `path` as `name`. Raises LoRAError (the name is taken, or the
        adapter cannot be served: see `load_adapter`)."""
        with self._lock:
            if name in self._paths:
                raise LoRAError(f"LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, path, self.shape, self.config.max_lora_rank)
        with self._lock:
            if name in self._paths:
                raise LoRAError(f"LoRA adapter {name!r} is already loaded")
            self._paths[name] = path
            self._keep(adapter)
        logger.info("LoRA adapter %r (rank %d) from %s", name, adapter.rank, path)
        return adapter

    def remove(self, name: str) -> None:
        """Stop serving `name` (requests already admitted finish with it). Raises UnknownAdapterError."""
        with self._lock:
            if self._paths.pop(name, None) is None:
                raise UnknownAdapterError(f"LoRA adapter {name!r} is not loaded")
            self._loaded.pop(name, None)
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

    def _keep(self, adapter: LoRAAdapter) -> None:
        self._loaded[adapter.name] = adapter
        self._loaded.move_to_end(adapter.name)
        while len(self._loaded) > self.config.cpu_loras:
            self._loaded.popitem(last=False)
