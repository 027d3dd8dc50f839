"""Real processes on loopback: `conveyor serve` and a Prometheus server scraping it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import free_port


def wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class ServeProcess:
    base_url: str
    port: int
    proc: subprocess.Popen
    log: Path


@pytest.fixture(scope="session")
def serve_process(tmp_path_factory) -> Iterator[ServeProcess]:
    """`conveyor serve` (the console script `make serve` runs) on a free port."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    port = free_port()
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
            args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONSAFEPATH": "1"}
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, 300, log)
        yield ServeProcess(f"http://127.0.0.1:{port}", port, proc, log)
    finally:
        stop(proc)


@dataclass
class Prometheus:
    url: str

    def query(self, promql: str) -> list[dict]:
        body = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["result"]


@pytest.fixture(scope="session")
def prometheus(serve_process, tmp_path_factory) -> Iterator[Prometheus]:
    """Debian's Prometheus scraping the server every second (`.ci/run` installs it)."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError(
            "prometheus is not installed: apt-get install -y --no-install-recommends prometheus"
        )
    workdir = tmp_path_factory.mktemp("prometheus")
    config = workdir / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: conveyor\n    static_configs: [{{targets: ['127.0.0.1:{serve_process.port}']}}]\n"
    )
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/-/ready", proc, 60, log)
        yield Prometheus(f"http://127.0.0.1:{port}")
    finally:
        stop(proc)
