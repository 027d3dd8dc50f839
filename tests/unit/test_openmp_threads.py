"""`release_openmp_threads`: the thread that built the engine hands back its idle OpenMP workers."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import torch

from conveyor.server.engine.tuning import release_openmp_threads


def _num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_op() -> torch.Tensor:
    # Big enough for ATen to split it over the OpenMP team (its grain size is 32768 elements).
    x = torch.arange(1 << 20, dtype=torch.float32)
    return torch.exp(x * 1e-6).sum()


def test_the_callers_openmp_workers_end_and_later_ops_still_run() -> None:
    assert hasattr(ctypes.CDLL(None), "omp_pause_resource_all"), "torch's OpenMP runtime exports it"
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = _parallel_op()
        with_team = _num_threads()
        release_openmp_threads()
        deadline = time.monotonic() + 5
        while _num_threads() >= with_team and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _num_threads() == with_team - 1  # the one worker of a 2-thread team ended
        # Parallel regions work again afterwards, on this thread and on another one.
        assert torch.equal(_parallel_op(), expected)
        results: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: results.append(_parallel_op()))
        worker.start()
        worker.join()
        assert torch.equal(results[0], expected)
    finally:
        torch.set_num_threads(previous)
