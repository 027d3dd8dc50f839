"""The processes of a tensor-parallel replica (`--tensor-parallel-size N`), as vLLM v1 lays them out.

Rank 0 is the engine's own process: it runs the API, the scheduler, the sampler and its shard of the
model. `Workers` starts ranks 1..N-1 (torch.multiprocessing, `spawn`), each a `_rank_main` that loads
its shard and then does what rank 0 tells it, in order, over the group's CPU channel: allocate the KV
cache, run a step's forward pass on the `ModelInput` rank 0 built, stop. The ranks meet on a loopback
TCP port (`torch.distributed`, NCCL on CUDA, gloo on CPU); the model's collectives run inside the
forward pass on every rank at once.

A rank that dies takes the whole server down at once with a message naming it (the pod then restarts)
instead of leaving rank 0 waiting in a collective; a worker whose rank 0 dies is killed by the kernel
(Linux's parent-death signal).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass

import torch

from conveyor.server.model.parallel import TensorParallel

logger = logging.getLogger(__name__)

# Seconds a stopping worker gets to leave on its own before it is killed.
STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class RankConfig:
    """What a worker needs to build its shard exactly as rank 0 built its own (the choices rank 0
    made at start: dtype, kernel backend, not re-decided)."""

    source: object  # loader.ModelSource
    dtype: torch.dtype
    device_type: str
    backend: str
    load_format: str
    block_size: int
    size: int
    init_method: str
    num_threads: int
    expert_parallel: bool = False


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (rank 0) exits, however it exits."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _rank_main(rank: int, config: RankConfig, log_level: int) -> None:
    """A worker rank: load this rank's shard, then follow rank 0's commands until told to stop."""
    _die_with_parent()
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    from conveyor.kernels import load_backend, pack_weights
    from conveyor.server.model import loader
    from conveyor.server.model.runner import ModelRunner

    torch.set_num_threads(config.num_threads)
    if config.device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(config.device_type, rank) if config.device_type == "cuda" else torch.device("cpu")
    tp = TensorParallel.init(rank, config.size, config.init_method, device)
    ops = load_backend(config.backend)
    hf_config = loader.load_config(config.source)
    model = loader.load_model(
        config.source,
        hf_config,
        config.dtype,
        device,
        ops,
        config.load_format,
        tp,
        None,
        config.expert_parallel,
    )
    pack_weights(model, ops, config.dtype, device)
    runner = ModelRunner(model, ops, config.block_size, config.dtype, device)
    while True:
        command, arg = tp.broadcast()
        if command == "stop":
            break
        if command == "allocate_kv_cache":
            runner.allocate_kv_cache(*arg)
        elif command == "forward":
            runner.forward(arg)
        else:
            raise RuntimeError(f"rank {rank}: unknown command {command!r}")
    tp.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """Ranks 1..size-1 of a tensor-parallel replica, seen from rank 0.

    `Workers(...)` starts them and joins the process group with them as rank 0 (blocking until all are
    in); `tp` is rank 0's TensorParallel for its own shard; `tell` sends a command to every worker;
    `shutdown` stops them. Exits this process with status 1 when a worker dies before `shutdown`.
    """

    def __init__(self, config_without_address: dict, size: int, device: torch.device) -> None:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        threads = max(1, (os.cpu_count() or 1) // size)
        config = RankConfig(**config_without_address, size=size, init_method=init_method, num_threads=threads)
        ctx = torch.multiprocessing.get_context("spawn")
        self._closing = False
        self.processes = [
            ctx.Process(
                target=_rank_main,
                args=(rank, config, logging.getLogger().getEffectiveLevel()),
                name=f"conveyor-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for process in self.processes:
            process.start()
        logger.info(
            "tensor parallel %d: rank 0 is pid %d; %s",
            size,
            os.getpid(),
            ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(self.processes, 1)),
        )
        threading.Thread(target=self._watch, name="conveyor-tp-watch", daemon=True).start()
        atexit.register(self.shutdown)
        self.tp = TensorParallel.init(0, size, init_method, device)

    def tell(self, command: str, arg=None) -> None:
        """Send `(command, arg)` to every worker (they run it in the order sent)."""
        self.tp.broadcast((command, arg))

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, 1)}
        ready = multiprocessing.connection.wait(list(by_sentinel))
        if self._closing:
            return
        rank, process = by_sentinel[ready[0]]
        process.join(timeout=1)
        message = (
            f"conveyor serve: tensor-parallel rank {rank} (pid {process.pid}) exited with code "
            f"{process.exitcode}; the server stops (a replica cannot serve without every rank)"
        )
        logger.critical(message)
        print(message, file=sys.stderr, flush=True)
        for other in self.processes:
            if other.is_alive():
                other.kill()
        os._exit(1)

    def shutdown(self) -> None:
        """Stop every worker (politely, then by SIGKILL after STOP_TIMEOUT) and leave the group."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        try:
            if all(p.is_alive() for p in self.processes):
                self.tell("stop")
        except Exception:  # a broken channel: the workers are killed below
            logger.warning("tensor parallel: could not tell the workers to stop", exc_info=True)
        for process in self.processes:
            process.join(timeout=STOP_TIMEOUT)
            if process.is_alive():
                process.kill()
                process.join()
        self.tp.close()
