"""`conveyor serve --tensor-parallel-size N` as a real process: it answers, a size that does not split
the model is refused at start, and a killed rank takes the server down with a message, not a hang."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import spawn_serve, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_the_server_refuses_a_size_that_does_not_divide_the_heads(tmp_path) -> None:
    server = spawn_serve(tmp_path / "serve.log", "--tensor-parallel-size", "2", "--device", "cpu")
    assert server.proc.wait(timeout=300) == 1
    log = server.log.read_text()
    assert "conveyor serve: --tensor-parallel-size 2 does not divide the model's 9 attention heads" in log


def test_a_killed_rank_ends_the_server_with_a_message(tmp_path) -> None:
    """At TP = 3 the server answers a completion; SIGKILL rank 2 and the server exits with status 1
    within a minute, naming the rank, and no rank process is left."""
    server = wait_ready(
        spawn_serve(
            tmp_path / "serve.log", "--tensor-parallel-size", "3", "--dtype", "float32", "--device", "cpu"
        )
    )
    try:
        reply = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4},
            timeout=120,
        )
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
        match = re.search(r"tensor parallel 3: rank 0 is pid \d+; (.*)", server.log.read_text())
        assert match, server.log.read_text()
        pids = {int(r): int(p) for r, p in re.findall(r"rank (\d) pid (\d+)", match.group(1))}
        assert sorted(pids) == [1, 2]
        started = time.monotonic()
        os.kill(pids[2], signal.SIGKILL)
        assert server.proc.wait(timeout=60) == 1
        log = server.log.read_text()
        assert f"tensor-parallel rank 2 (pid {pids[2]}) exited with code -9; the server stops" in log
        print(f"server gone {time.monotonic() - started:.1f} s after rank 2 was killed")
        time.sleep(1)  # rank 1 is killed by the server, then by the kernel's parent-death signal
        for pid in pids.values():
            stat = Path(f"/proc/{pid}/stat")
            assert not stat.exists() or " Z " in stat.read_text()  # gone, or a zombie not yet reaped
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
