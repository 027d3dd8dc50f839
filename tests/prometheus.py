"""A real Prometheus server (Debian's package) on loopback, for tests that assert on scraped series.

Targets come from a file (`file_sd_configs`) that a test rewrites at will, each with its own labels
(`namespace` and `pod`, as a ServiceMonitor would attach them). Prometheus watches the file, so new
targets are scraped within about a second. `stop()` and `start()` again keep the port and the data,
which is how a test simulates an outage.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.k8s.cluster import free_port

INSTALL_HINT = "prometheus is not installed: apt-get install -y --no-install-recommends prometheus"


def wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    """Poll `url` until it answers 200; fail early if `proc` exits, with the tail of its log."""
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


def stop_process(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class PrometheusServer:
    """`prometheus` scraping the targets of `set_targets` every `scrape_interval` seconds."""

    def __init__(self, workdir: Path, scrape_interval: float = 1.0) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets_file = workdir / "targets.json"
        self.targets_file.write_text("[]")
        interval = f"{scrape_interval:g}s"
        (workdir / "prometheus.yml").write_text(
            f"global: {{scrape_interval: {interval}, evaluation_interval: {interval}}}\n"
            "scrape_configs:\n"
            "  - job_name: conveyor\n"
            f"    file_sd_configs: [{{files: ['{self.targets_file}'], refresh_interval: 1s}}]\n"
        )
        self.proc: subprocess.Popen | None = None
        self.log = workdir / "prometheus.log"

    def set_targets(self, targets: list[tuple[str, dict[str, str]]]) -> None:
        """Replace the scraped targets: [("127.0.0.1:PORT", {"namespace": ..., "pod": ...})]."""
        groups = [{"targets": [address], "labels": labels} for address, labels in targets]
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets_file)

    def start(self) -> None:
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={self.workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_http(f"{self.url}/-/ready", self.proc, 60, self.log)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def query(self, promql: str) -> list[dict]:
        body = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["result"]
