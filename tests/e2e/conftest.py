"""Real processes on loopback: `conveyor serve` and a Prometheus server scraping it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.k8s.cluster import free_port
from tests.prometheus import PrometheusServer, stop_process, wait_http


@dataclass
class ServeProcess:
    base_url: str
    port: int
    proc: subprocess.Popen
    log: Path


def spawn_serve(log: Path, *extra: str, port: int | None = None) -> ServeProcess:
    """Start `conveyor serve` (the console script `make serve` runs) on `port` (default: a free one)
    without waiting for it; `wait_ready` waits."""
    port = port or free_port()
    exe = Path(sys.executable).with_name("conveyor")
    args = [
        str(exe),
        "serve",
        "--port",
        str(port),
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        str(256 << 20),
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*args, *extra], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONSAFEPATH": "1"}
        )
    return ServeProcess(f"http://127.0.0.1:{port}", port, proc, log)


def wait_ready(server: ServeProcess, timeout: float = 300) -> ServeProcess:
    """Wait until `server` answers /health; stop it and raise if it does not."""
    try:
        wait_http(f"{server.base_url}/health", server.proc, timeout, server.log)
    except BaseException:
        stop_process(server.proc)
        raise
    return server


def start_serve(log: Path, *extra: str) -> ServeProcess:
    """`conveyor serve` on a free port, once it answers /health."""
    return wait_ready(spawn_serve(log, *extra))


@pytest.fixture(scope="session")
def serve_process(tmp_path_factory) -> Iterator[ServeProcess]:
    """One `conveyor serve` on a free port."""
    server = start_serve(tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        yield server
    finally:
        stop_process(server.proc)


@pytest.fixture(scope="session")
def prometheus(serve_process, tmp_path_factory) -> Iterator[PrometheusServer]:
    """Debian's Prometheus scraping the server every second (`.ci/run` installs it)."""
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"))
    server.set_targets([(f"127.0.0.1:{serve_process.port}", {})])
    server.start()
    try:
        yield server
    finally:
        server.stop()
