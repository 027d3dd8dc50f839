"""`conveyor router` in front of three real `conveyor serve` processes on loopback: what passes through is
what the replica sent, a client that leaves aborts on the replica, a dying replica loses no request that
had not started streaming, a replica coming back is used again, prefixes stick to one replica, and
requests wait for a replica (scale from zero) or are refused with OpenAI error bodies."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import ServeProcess, spawn_serve, wait_ready
from tests.k8s.cluster import free_port
from tests.prometheus import stop_process, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = (
    "You are the support assistant of a company that sells bicycles, spare parts and repair services in "
    "three cities. Answer politely, in at most two sentences, and never invent prices. Opening hours are "
    "nine to six on weekdays and ten to four on Saturdays; the shops are closed on Sundays and holidays. "
    "Repairs take two working days; a loan bike is free during a repair. Orders ship within three days. "
) * 3


@dataclass
class RouterProcess:
    base_url: str
    proc: subprocess.Popen
    log: Path

    def metrics(self) -> dict[tuple[str, tuple], float]:
        return scrape(self.base_url)


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of `/metrics` as {(name, sorted labels): value}."""
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def start_router(log: Path, *args: str) -> RouterProcess:
    port = free_port()
    exe = Path(sys.executable).with_name("conveyor")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(exe), "router", "--port", str(port), "--scrape-interval", "0.25", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONSAFEPATH": "1"},
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, 120, log)
    except BaseException:
        stop_process(proc)
        raise
    return RouterProcess(f"http://127.0.0.1:{port}", proc, log)


def wait_until(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def ready_replicas(router: RouterProcess) -> float:
    return total(router.metrics(), "conveyor:router_endpoints", state="ready")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> Iterator[list[ServeProcess]]:
    logs = tmp_path_factory.mktemp("replicas")
    servers = [spawn_serve(logs / f"serve-{i}.log") for i in range(3)]
    try:
        for s in servers:
            wait_ready(s)
        yield servers  # a test may replace a replica it restarted; the one in the list is stopped
    finally:
        for s in servers:
            stop_process(s.proc)


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory) -> Iterator[RouterProcess]:
    log = tmp_path_factory.mktemp("router") / "router.log"
    r = start_router(log, "--endpoint", *(s.base_url for s in replicas))
    try:
        wait_until(lambda: ready_replicas(r) == 3, "three ready replicas")
        yield r
    finally:
        stop_process(r.proc)


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_streaming_through_the_router_equals_streaming_direct(router, replicas) -> None:
    """The router passes a sampled stream on unchanged. Every replica answers the request once directly
    first, so that every answer compared finds the prompt's blocks in its prefix cache: in bfloat16 a
    prompt computed afresh and one read from the cache differ in the last bits (other kernels compute
    the rows after the cached blocks), and a sampled token can differ on them."""

    def deltas(base_url: str) -> list[str]:
        stream = client(base_url).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write a short line about the sea."}],
            temperature=0.9,
            seed=7,
            max_tokens=24,
            stream=True,
        )
        return [c.choices[0].delta.content or "" for c in stream if c.choices]

    for replica in replicas:
        deltas(replica.base_url)
    direct = deltas(replicas[0].base_url)
    assert len(direct) > 5
    for _ in range(3):  # whichever replica the router picks, the same seed gives the same chunks
        assert deltas(router.base_url) == direct
    models = client(router.base_url).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_a_shared_prefix_goes_to_one_replica(router, replicas, tmp_path) -> None:
    before = router.metrics()
    hits_before = [total(scrape(s.base_url), "conveyor:prefix_cache_hits_total") for s in replicas]
    c = client(router.base_url)
    for i in range(6):
        c.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Question {i}: open?"},
            ],
            temperature=0,
            max_tokens=4,
        )
    after = router.metrics()
    per_replica = [
        total(after, "conveyor:router_requests_total", endpoint=s.base_url)
        - total(before, "conveyor:router_requests_total", endpoint=s.base_url)
        for s in replicas
    ]
    assert sorted(per_replica) == [0, 0, 6]
    prefix = total(after, "conveyor:router_requests_total", decision="prefix") - total(
        before, "conveyor:router_requests_total", decision="prefix"
    )
    assert prefix == 5
    # The replica really reused the blocks, and the router's estimate saw it coming.
    holder = per_replica.index(6)
    hits = total(scrape(replicas[holder].base_url), "conveyor:prefix_cache_hits_total") - hits_before[holder]
    assert hits >= 5 * 200
    estimate = total(after, "conveyor:router_prefix_hit_tokens_total") - total(
        before, "conveyor:router_prefix_hit_tokens_total"
    )
    assert estimate >= 5 * 200

    # A router that starts now never routed these prompts: it learns where they live from the replicas'
    # KV events (snapshot at connect), so a restart does not lose prefix affinity.
    fresh = start_router(tmp_path / "router-fresh.log", "--endpoint", *(s.base_url for s in replicas))
    try:
        wait_until(lambda: ready_replicas(fresh) == 3, "three ready replicas")
        time.sleep(1.0)  # the snapshots arrive right after connecting
        client(fresh.base_url).chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Question 7: open?"},
            ],
            temperature=0,
            max_tokens=4,
        )
        samples = fresh.metrics()
        assert total(samples, "conveyor:router_requests_total", decision="prefix") == 1
        assert total(samples, "conveyor:router_requests_total", endpoint=replicas[holder].base_url) == 1
    finally:
        stop_process(fresh.proc)


def test_a_client_disconnect_aborts_the_request_on_its_replica(router, replicas) -> None:
    def aborted() -> float:
        return sum(
            total(scrape(s.base_url), "conveyor:request_success_total", finished_reason="abort")
            for s in replicas
        )

    def running() -> float:
        return sum(total(scrape(s.base_url), "conveyor:num_requests_running") for s in replicas)

    before = aborted()
    body = {"prompt": "Count: one, two,", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router.base_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert running() >= 1
    wait_until(lambda: aborted() == before + 1, "the replica to abort the request")
    wait_until(lambda: running() == 0, "no request running on any replica")
    wait_until(lambda: total(router.metrics(), "conveyor:router_in_flight") == 0, "the router to release it")


def test_requests_wait_for_a_replica_then_get_served(tmp_path) -> None:
    """Scale from zero: the only replica does not exist yet; the request waits in the router (which
    exports it as router_requests_waiting) and is served once the replica starts."""
    port = free_port()
    r = start_router(
        tmp_path / "router.log", "--endpoint", f"http://127.0.0.1:{port}", "--queue-timeout", "240"
    )
    replica = None
    try:
        result: dict = {}

        def send() -> None:
            t0 = time.monotonic()
            result["response"] = httpx.post(
                f"{r.base_url}/v1/completions",
                json={"prompt": "Hello", "max_tokens": 4},
                timeout=300,
            )
            result["seconds"] = time.monotonic() - t0

        thread = threading.Thread(target=send)
        thread.start()
        wait_until(lambda: total(r.metrics(), "conveyor:router_requests_waiting") == 1, "the request to wait")
        replica = spawn_serve(tmp_path / "serve.log", port=port)
        thread.join(timeout=280)
        assert result["response"].status_code == 200, result["response"].text
        assert result["response"].json()["choices"][0]["text"]
        assert total(r.metrics(), "conveyor:router_requests_waiting") == 0
        print(f"arrival at zero replicas -> answer: {result['seconds']:.1f} s (replica start + model load)")
    finally:
        stop_process(r.proc)
        if replica is not None:
            stop_process(replica.proc)


def test_no_replica_within_the_queue_timeout_is_a_503(tmp_path) -> None:
    r = start_router(
        tmp_path / "router.log", "--endpoint", f"http://127.0.0.1:{free_port()}", "--queue-timeout", "1"
    )
    try:
        response = httpx.post(f"{r.base_url}/v1/completions", json={"prompt": "Hi"}, timeout=30)
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "no_replica_ready" and "queue_timeout" in error["message"]
        assert total(r.metrics(), "conveyor:router_rejected_total", reason="queue_timeout") == 1
        assert response.headers["retry-after"] == "1"
        bad = httpx.post(f"{r.base_url}/v1/completions", content=b"{not json", timeout=30)
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        unknown = httpx.post(f"{r.base_url}/v1/embeddings", json={"input": "x"}, timeout=30)
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    finally:
        stop_process(r.proc)


def test_every_replica_saturated_is_a_429_with_retry_after(replicas, tmp_path) -> None:
    """One replica, a queue limit of 1, and its load read only at start: the router's own sends fill
    the replica's batch slots (`max_num_seqs`, from its scheduler_config_info), the next one would
    queue and be the first waiting, so the one after is refused."""
    (info,) = [
        labels
        for (name, labels), _ in scrape(replicas[2].base_url).items()
        if name == "conveyor:scheduler_config_info"
    ]
    max_num_seqs = int(dict(info)["max_num_seqs"])
    r = start_router(
        tmp_path / "router.log",
        "--endpoint",
        replicas[2].base_url,
        "--max-waiting-per-endpoint",
        "1",
        "--scrape-interval",
        "600",
    )
    try:
        wait_until(lambda: ready_replicas(r) == 1, "the replica to be ready")
        body = {"prompt": "A", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, contextlib.ExitStack() as streams:
            for _ in range(max_num_seqs):
                response = streams.enter_context(
                    http.stream("POST", f"{r.base_url}/v1/completions", json=body)
                )
                assert response.status_code == 200

            # The next one waits on the replica for a slot; its answer starts only when one frees, so
            # it is sent from a thread and counted by the router instead of waited for.
            def wait_for_a_slot() -> None:
                with contextlib.suppress(httpx.HTTPError):  # cut off when the router stops
                    httpx.post(f"{r.base_url}/v1/completions", json=body, timeout=600)

            waiter = threading.Thread(target=wait_for_a_slot, daemon=True)
            waiter.start()
            wait_until(
                lambda: total(r.metrics(), "conveyor:router_in_flight") == max_num_seqs + 1,
                "the router to send the request that waits",
            )
            refused = http.post(f"{r.base_url}/v1/completions", json={"prompt": "B"})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert total(r.metrics(), "conveyor:router_rejected_total", reason="saturated") == 1
    finally:
        stop_process(r.proc)


def test_a_dying_replica_loses_no_unstarted_request_and_is_used_again_when_back(
    router, replicas, tmp_path
) -> None:
    """A replica is killed while it streams one answer and runs non-streamed ones: those had not
    received a byte and are served elsewhere; the stream had, so its client is told it is incomplete
    (an OpenAI error event, never a silent clean end)."""
    retries_before = total(router.metrics(), "conveyor:router_retries_total")
    stream_outcome: dict = {}

    def stream() -> None:
        chunks = 0
        try:
            for _ in client(router.base_url).completions.create(
                model=MODEL,
                prompt="Count slowly:",
                max_tokens=900,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                chunks += 1
            stream_outcome["ended"] = chunks
        except openai.APIError as exc:
            stream_outcome["error"] = (chunks, str(exc))

    def running(s: ServeProcess) -> float:
        return total(scrape(s.base_url), "conveyor:num_requests_running")

    def complete(i: int) -> httpx.Response:
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 48, "ignore_eos": True}
        return httpx.post(f"{router.base_url}/v1/completions", json=body, timeout=180)

    streamer = threading.Thread(target=stream)
    streamer.start()
    index = wait_until(
        lambda: next((i + 1 for i, s in enumerate(replicas) if running(s)), None), "the stream"
    )
    victim = replicas[index - 1]
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(complete, i) for i in range(12)]
        wait_until(lambda: running(victim) >= 2, "the victim to run more requests")
        victim.proc.kill()
        victim.proc.wait()
        responses = [f.result() for f in futures]
    streamer.join(timeout=60)
    assert [r.status_code for r in responses] == [200] * 12
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in responses)
    assert total(router.metrics(), "conveyor:router_retries_total") > retries_before
    chunks, message = stream_outcome["error"]
    assert chunks > 0 and "incomplete" in message
    wait_until(lambda: ready_replicas(router) == 2, "the router to take the replica out")
    wait_until(lambda: total(router.metrics(), "conveyor:router_in_flight") == 0, "no request left in flight")

    # The replica comes back on the same address: the router polls it back in and sends it work.
    back = wait_ready(spawn_serve(tmp_path / "serve-back.log", port=victim.port))
    replicas[index - 1] = back
    wait_until(lambda: ready_replicas(router) == 3, "the replica to be polled back in", timeout=60)
    with ThreadPoolExecutor(6) as pool:
        assert [r.status_code for r in pool.map(complete, range(6))] == [200] * 6
    assert total(scrape(back.base_url), "conveyor:request_success_total") >= 1


def _adapter(path: Path) -> str:
    """A rank-2 PEFT adapter of the embedded model's q_proj on every layer (random, non-zero)."""
    import json

    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    )
    key = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    tensors = {key.format(i, "A"): torch.randn(2, 576) * 0.05 for i in range(30)}
    tensors |= {key.format(i, "B"): torch.randn(576, 2) * 0.05 for i in range(30)}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def test_adapter_requests_go_to_the_replicas_serving_the_adapter(tmp_path) -> None:
    """Two replicas with LoRA on; an adapter loaded at runtime on one of them is seen by the router at
    its next poll and every request naming it goes there, then follows it when it moves to the other;
    the router's /v1/models lists it whichever replica would have answered."""
    lora = ["--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating"]
    servers = [spawn_serve(tmp_path / f"lora-serve-{i}.log", *lora) for i in range(2)]
    router_process = None
    try:
        for s in servers:
            wait_ready(s)
        a, b = servers
        router_process = start_router(
            tmp_path / "router.log", "--endpoint", a.base_url, "--endpoint", b.base_url
        )
        wait_until(lambda: ready_replicas(router_process) == 2, "both replicas ready")
        path = _adapter(tmp_path / "sql")
        api = client(router_process.base_url)

        def sent(to: str) -> int:
            samples = router_process.metrics()
            return int(total(samples, "conveyor:router_requests_total", endpoint=to))

        def ask() -> str:
            out = api.completions.create(model="sql", prompt="SELECT", max_tokens=3, temperature=0)
            assert out.model == "sql"
            return out.choices[0].text

        for holder, other in ((b, a), (a, b)):
            loaded = httpx.post(
                f"{holder.base_url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": path}
            )
            assert loaded.status_code == 200, loaded.text
            time.sleep(1.0)  # the router's next polls (every 0.25 s) see it
            before = (sent(holder.base_url), sent(other.base_url))
            # The router's model list merges the replicas': the adapter is listed whichever answers.
            assert all("sql" in {m.id for m in api.models.list().data} for _ in range(4))
            answers = {ask() for _ in range(6)}
            assert len(answers) == 1
            assert (sent(holder.base_url) - before[0], sent(other.base_url) - before[1]) == (6, 0)
            httpx.post(
                f"{holder.base_url}/v1/unload_lora_adapter", json={"lora_name": "sql"}
            ).raise_for_status()
            time.sleep(1.0)
        with pytest.raises(openai.NotFoundError):  # served nowhere now: a replica's own 404
            ask()
        assert "sql" not in {m.id for m in api.models.list().data}
    finally:
        if router_process is not None:
            stop_process(router_process.proc)
        for s in servers:
            stop_process(s.proc)
