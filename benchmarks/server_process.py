"""Start and stop a server process (``conveyor serve`` or a peer) on a loopback port, by PID."""

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


class ServerProcess:
    """``with ServerProcess([...command], port, log_path) as server:`` runs an HTTP server until the block ends.

    Args:
        command: the full command line; it must listen on 127.0.0.1:``port``.
        port: the port the command listens on.
        log_path: where the server's stdout and stderr go.
        threads: torch/OpenMP threads for the server (``OMP_NUM_THREADS``); None leaves the default.
        startup_timeout_s: seconds to wait for ``health_path`` to answer 200.
        health_path: the readiness URL path.
        env: the process's environment; default: this one's.
    """

    def __init__(
        self,
        command: list[str],
        port: int,
        log_path: str | Path,
        threads: int | None = None,
        startup_timeout_s: float = 300.0,
        health_path: str = "/health",
        env: dict[str, str] | None = None,
    ) -> None:
        self.env = env
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.command = command
        self.log_path = Path(log_path)
        self.threads = threads
        self.startup_timeout_s = startup_timeout_s
        self.health_path = health_path
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
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
        env = dict(self.env if self.env is not None else os.environ, PYTHONSAFEPATH="1")
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
                if httpx.get(self.base_url + self.health_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(
            f"no {self.health_path} after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}"
        )

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


class ConveyorServer(ServerProcess):
    """``conveyor serve`` with extra ``args`` (e.g. ``["--scheduling", "static"]``) on a free loopback port."""

    def __init__(
        self,
        args: list[str],
        log_path: str | Path,
        threads: int | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        port = free_port()
        command = [conveyor_executable(), "serve", "--host", "127.0.0.1", "--port", str(port), *args]
        super().__init__(command, port, log_path, threads, startup_timeout_s)
