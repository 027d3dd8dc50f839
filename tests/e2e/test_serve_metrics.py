"""`conveyor serve` as a process, scraped by a real Prometheus: the series the autoscaler and dashboards
read exist with the values a client saw."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


def wait_for(prometheus, promql: str, predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    result = []
    while time.monotonic() < deadline:
        result = prometheus.query(promql)
        if result and predicate(result):
            return result
        time.sleep(0.5)
    raise AssertionError(f"{promql} never satisfied the check; last result {result}")


def test_served_chat_answer_and_metrics_in_prometheus(serve_process, prometheus):
    # rate() needs a scrape from before the requests (the server exports the histograms at zero).
    wait_for(prometheus, "conveyor:time_to_first_token_seconds_count", lambda r: True)
    client = openai.OpenAI(base_url=serve_process.base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        temperature=0,
        max_tokens=30,
    )
    assert "Paris" in reply.choices[0].message.content
    for i in range(3):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"Number {i}:", max_tokens=4)

    # What a TTFT autoscaling rule would read: p90 over the last minute, per model.
    p90 = wait_for(
        prometheus,
        "histogram_quantile(0.9, sum by (le, model_name) (rate(conveyor:time_to_first_token_seconds_bucket[1m])))",
        lambda r: r[0]["value"][1] not in ("NaN", "0"),
    )
    assert p90[0]["metric"]["model_name"] == "SmolLM2-135M-Instruct"
    count = wait_for(
        prometheus,
        "sum(conveyor:time_to_first_token_seconds_count)",
        lambda r: float(r[0]["value"][1]) == 4,
    )
    assert float(count[0]["value"][1]) == 4
    expected_tokens = reply.usage.completion_tokens + 12
    tokens = wait_for(
        prometheus, "conveyor:generation_tokens_total", lambda r: float(r[0]["value"][1]) == expected_tokens
    )
    assert float(tokens[0]["value"][1]) == expected_tokens
    # Idle gauges: nothing waiting, nothing running, KV cache empty.
    for gauge in (
        "conveyor:num_requests_waiting",
        "conveyor:num_requests_running",
        "conveyor:kv_cache_usage_perc",
    ):
        assert float(wait_for(prometheus, gauge, lambda r: float(r[0]["value"][1]) == 0)[0]["value"][1]) == 0


@pytest.mark.parametrize(
    ("args", "env", "code", "message"),
    [
        (["--max-num-seqs", "0"], {}, 2, "--max-num-seqs: Input should be greater than or equal to 1"),
        (["--device", "cuda"], {}, 1, "no CUDA device"),
        (["/nonexistent/model"], {}, 1, "does not exist"),
        ([], {"CONVEYOR_CPU_KERNELS": "panel,amx@64"}, 1, "CONVEYOR_CPU_KERNELS: 'amx' is not a kernel"),
    ],
)
def test_serve_rejects_bad_flags_with_a_clear_message(args, env, code, message):
    import os
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("conveyor")
    out = subprocess.run(
        [str(exe), "serve", *args], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )
    assert out.returncode == code
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_health_of_the_process(serve_process):
    assert httpx.get(serve_process.base_url + "/health").status_code == 200
