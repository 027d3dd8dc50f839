"""Start and stop a ``conveyor serve`` process on a free loopback port (the benchmark's server shell)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx


class ServerStartError(RuntimeError):
    """The server exited or did not answer ``/health`` in time; carries the tail of its log."""


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def conveyor_executable() -> str:
    """The ``conveyor`` script next to the running interpreter (the project's virtual environment)."""
    candidate = Path(sys.executable).parent / "conveyor"
    return str(candidate) if candidate.exists() else "conveyor"


class ConveyorServer:
    """``with ConveyorServer([...flags]) as server:`` runs ``conveyor serve`` until the block ends.

    Args:
        args: extra ``conveyor serve`` flags, e.g. ``["--scheduling", "static", "--max-num-seqs", "16"]``.
        log_path: where the server's stdout and stderr go.
        threads: torch/OpenMP threads for the server (``OMP_NUM_THREADS``); None leaves the default.
        startup_timeout_s: seconds to wait for ``GET /health`` to answer 200.
    """

    def __init__(
        self,
        args: list[str],
        log_path: str | Path,
        threads: int | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = [
            conveyor_executable(),
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        self.log_path = Path(log_path)
        self.threads = threads
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ConveyorServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Launch the process and wait until ``/health`` answers; raises ServerStartError otherwise."""
        env = dict(os.environ, PYTHONSAFEPATH="1")
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"no /health after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process by PID, SIGKILL it if it has not exited after ``timeout_s`` seconds."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout_s)

    def log_tail(self, num_bytes: int = 4000) -> str:
        """The last ``num_bytes`` of the server's log."""
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""
