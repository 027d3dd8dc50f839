"""The chart's Grafana dashboard (charts/conveyor/dashboards/conveyor.json) against a real server under
load, scraped by a real Prometheus with the labels a ServiceMonitor gives: every server panel's queries
find data, and the dashboard renders (benchmarks/dashboard.py). The two autoscaler panels read the
operator's series, which no operator exports here: they must parse and come back empty.

CONVEYOR_DASHBOARD_PNG=PATH keeps the picture (the Helm guide's is made so).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from conveyor.benchmarks.dashboard import load, render
from tests.e2e.conftest import ServeProcess, start_serve
from tests.prometheus import PrometheusServer, stop_process

pytestmark = pytest.mark.slow

LABELS = {"namespace": "llm", "service": "smollm2-135m", "pod": "smollm2-135m-0"}
OPERATOR_PANELS = {"Autoscaler decisions by reason"}
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def loaded_server(tmp_path: Path) -> Iterator[ServeProcess]:
    """A server of its own: the load below must not reach the counts other tests assert on the
    session's server."""
    server = start_serve(tmp_path / "serve.log")
    try:
        yield server
    finally:
        stop_process(server.proc)


def test_every_server_panel_finds_its_series_under_load(loaded_server: ServeProcess, tmp_path: Path) -> None:
    serve_process = loaded_server
    (tmp_path / "prometheus").mkdir()
    prometheus = PrometheusServer(tmp_path / "prometheus")
    prometheus.set_targets([(f"127.0.0.1:{serve_process.port}", LABELS)])
    prometheus.start()
    try:
        start = time.time()
        deadline = time.monotonic() + 30
        while not prometheus.query("conveyor:num_requests_running"):
            assert time.monotonic() < deadline, "the server was never scraped"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=serve_process.base_url + "/v1", api_key="unused", max_retries=0)
        shared = "You are a careful assistant. Answer briefly and precisely. " * 8
        prompts = [
            shared + f"Question {i}: what is {i} plus {i}?"
            if i % 3
            else "Tell me about the sea. " * (20 + 10 * i)
            for i in range(12)
        ]

        def ask(prompt: str) -> int:
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
            return reply.usage.completion_tokens

        for _ in range(2):
            with ThreadPoolExecutor(8) as pool:
                assert all(n > 0 for n in pool.map(ask, prompts))
        time.sleep(4)  # two more scrapes after the last request
        path = Path(os.environ.get("CONVEYOR_DASHBOARD_PNG") or tmp_path / "dashboard.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        drawn = render(
            load(),
            prometheus.url,
            start,
            time.time(),
            path,
            variables={"namespace": LABELS["namespace"], "inferenceservice": LABELS["service"]},
            rate_interval="15s",
            step=2.0,
        )
        assert path.stat().st_size > 10_000
        empty = {title for title, series in drawn.items() if not any(line.points for line in series)}
        assert empty == OPERATOR_PANELS, f"panels without data: {sorted(empty)}"
        buckets = {line.legend.split()[-1] for line in drawn["TTFT p50 / p99 by input length"]}
        assert {"0-512", "512-2048"} <= buckets
        hit_rate = drawn["Prefix cache hit rate"][0].points
        assert max(v for _, v in hit_rate) > 0
    finally:
        prometheus.stop()
