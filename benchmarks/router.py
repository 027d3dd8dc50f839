"""`make bench-router`: the router's policies side by side on three real replicas of this machine.

One run, the same workloads for every policy, fresh replicas for every (policy, workload) so no policy
inherits another's warm caches:

- prefix-shared: 8 system prompts of 512 tokens, 96 requests (a 32-token suffix each, 16 output tokens),
  Poisson arrivals (token-id prompts on /v1/completions, so every policy sees identical tokens);
- multi-turn: 16 conversations of 5 turns on /v1/chat/completions, each turn carrying the conversation so
  far (earlier user turns of ~64 tokens and, as assistant turns, text of the answer's length, 32 tokens),
  conversations starting as a Poisson process, turns one after another;
- uniform: 96 random prompts of 256 tokens, 64 output tokens, all sent at once (max 24 in flight), no
  prefix shared: the throughput the picker's balance gives.

The replicas' KV cache is sized (`--kv-cache-blocks`, default 192 blocks of 16 tokens = 3072 tokens) so one
replica holds about a third of the prefix-shared prompts' prefixes: where requests go then decides what is
recomputed, as with the larger models and caches of production. Reported per policy: TTFT p50/p90/p99,
output tok/s, and the prefix-cache hit rate summed over the replicas (their own counters); plus the hit rate
of a single replica serving the prefix-shared workload directly with a KV cache as large as the three
together (the hit-rate ideal: one cache that every request meets). Targets (issue: router): prefix-aware p90
TTFT <= 1/3 of round-robin's on prefix-shared; summed hit rate >= 90 % of the single replica's; uniform
throughput >= 95 % of least-load's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from conveyor.benchmarks.arrivals import arrival_offsets
from conveyor.benchmarks.client import CHAT_COMPLETIONS, COMPLETIONS, RequestSettings, send_request
from conveyor.benchmarks.datasets import (
    TOKEN_ID_LOW,
    SampleRequest,
    prefix_shared_dataset,
    random_dataset,
)
from conveyor.benchmarks.metrics import RequestRecord, compute_metrics
from conveyor.benchmarks.server_process import ConveyorServer, ServerProcess, conveyor_executable, free_port

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("round-robin", "least-load", "prefix-aware")
WORKLOADS = ("prefix-shared", "multi-turn", "uniform")
MODEL = "SmolLM2-135M-Instruct"
# 2 * layers * kv heads * head_dim * 4 bytes (float32) of the embedded model, per token.
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4


@dataclass(frozen=True)
class Conversation:
    """A multi-turn chat: user turns and the assistant text standing in for each answer."""

    start_s: float
    user_turns: list[str]
    assistant_turns: list[str]
    output_len: int


@dataclass
class PolicyResult:
    policy: str
    workload: str
    completed: int
    failed: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    output_tok_s: float
    hit_rate: float | None
    duration_s: float


def _random_text(tokenizer, rng: np.random.Generator, num_tokens: int) -> str:
    ids = rng.integers(TOKEN_ID_LOW, tokenizer.vocab_size, size=num_tokens).tolist()
    return tokenizer.decode(ids)


def conversations(tokenizer, num: int, turns: int, rate: float, seed: int) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    starts = arrival_offsets(num, rate, seed=seed)
    return [
        Conversation(
            start,
            [_random_text(tokenizer, rng, 64) for _ in range(turns)],
            [_random_text(tokenizer, rng, 32) for _ in range(turns)],
            32,
        )
        for start in starts
    ]


async def run_conversations(base_url: str, convs: list[Conversation]) -> tuple[list[RequestRecord], float]:
    """Each conversation's turns one after another (turn k carries turns < k); conversations overlap."""
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None)
    ) as client:
        t0 = time.perf_counter()

        async def talk(conv: Conversation) -> list[RequestRecord]:
            await asyncio.sleep(max(0.0, conv.start_s - (time.perf_counter() - t0)))
            messages: list[dict] = []
            records = []
            for user, assistant in zip(conv.user_turns, conv.assistant_turns, strict=True):
                messages.append({"role": "user", "content": user})
                settings = RequestSettings(MODEL, CHAT_COMPLETIONS, extra_body={"messages": list(messages)})
                records.append(
                    await send_request(
                        client, base_url, SampleRequest(user, 0, conv.output_len), settings, t0
                    )
                )
                messages.append({"role": "assistant", "content": assistant})
            return records

        per_conv = await asyncio.gather(*(talk(c) for c in convs))
        return [r for rs in per_conv for r in rs], time.perf_counter() - t0


async def run_samples(
    base_url: str, samples: list[SampleRequest], rate: float, max_concurrency: int | None, seed: int
) -> tuple[list[RequestRecord], float]:
    from conveyor.benchmarks.serve import run_benchmark

    settings = RequestSettings(MODEL, COMPLETIONS)
    return await run_benchmark(
        base_url, samples, settings, rate, max_concurrency=max_concurrency, seed=seed, show_progress=False
    )


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """(prefix-cache queries, hits) summed over the replicas, in tokens."""
    queries = hits = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for s in family.samples:
                if s.name == "conveyor:prefix_cache_queries_total":
                    queries += s.value
                elif s.name == "conveyor:prefix_cache_hits_total":
                    hits += s.value
    return queries, hits


def replica_args(args: argparse.Namespace, kv_cache_blocks: int) -> list[str]:
    return [
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--kv-cache-memory",
        str(kv_cache_blocks * 16 * KV_BYTES_PER_TOKEN),
    ]


def measure(args, workload: str, policy: str | None, out: Path, data: dict) -> PolicyResult:
    """One workload through a fresh router (`policy`) over fresh replicas; `policy` None = one replica, direct."""
    n = 1 if policy is None else args.replicas
    label = policy or "single-replica"
    # The single replica is the hit-rate ideal: every request meets one cache as large as all of theirs.
    blocks = args.kv_cache_blocks * (args.replicas if policy is None else 1)
    replicas = [
        ConveyorServer(
            replica_args(args, blocks), out / f"logs/{workload}-{label}-{i}.log", threads=args.threads
        )
        for i in range(n)
    ]
    router = None
    try:
        for r in replicas:
            r.start()
        urls = [r.base_url for r in replicas]
        for (
            url
        ) in urls:  # first-request costs (kernel loading), off the clock and off the workload's prefixes
            httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=120)
        target = urls[0]
        if policy is not None:
            port = free_port()
            command = [
                conveyor_executable(),
                "router",
                "--port",
                str(port),
                "--policy",
                policy,
                "--endpoint",
                *urls,
            ]
            router = ServerProcess(command, port, out / f"logs/{workload}-{label}-router.log", threads=1)
            router.start()
            target = router.base_url
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not _all_ready(target, n):
                time.sleep(0.25)
        q0, h0 = prefix_counters(urls)
        if workload == "multi-turn":
            records, duration = asyncio.run(run_conversations(target, data["multi-turn"]))
        elif workload == "prefix-shared":
            records, duration = asyncio.run(
                run_samples(target, data["prefix-shared"], args.rate, None, args.seed)
            )
        else:
            records, duration = asyncio.run(run_samples(target, data["uniform"], math.inf, 24, args.seed))
        q1, h1 = prefix_counters(urls)
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()
    m = compute_metrics(records, duration)
    result = PolicyResult(
        label,
        workload,
        m.completed,
        m.failed,
        m.ttft_ms.get("median"),
        m.ttft_ms.get("p90"),
        m.ttft_ms.get("p99"),
        m.output_throughput,
        (h1 - h0) / (q1 - q0) if q1 > q0 else None,
        duration,
    )
    print(_row(result), flush=True)
    return result


def _all_ready(router_url: str, n: int) -> bool:
    try:
        text = httpx.get(f"{router_url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return False
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "conveyor:router_endpoints" and s.labels.get("state") == "ready":
                return s.value >= n
    return False


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


HEADER = "| workload | policy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | output tok/s | prefix hit rate | failed |"


def _row(r: PolicyResult) -> str:
    return (
        f"| {r.workload} | {r.policy} | {_fmt(r.ttft_p50_ms)} | {_fmt(r.ttft_p90_ms)} | {_fmt(r.ttft_p99_ms)} "
        f"| {r.output_tok_s:.1f} | {_fmt(r.hit_rate, 3)} | {r.failed} |"
    )


def targets(results: list[PolicyResult]) -> dict[str, float | None]:
    def get(workload: str, policy: str) -> PolicyResult | None:
        return next((r for r in results if r.workload == workload and r.policy == policy), None)

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    pa, rr = get("prefix-shared", "prefix-aware"), get("prefix-shared", "round-robin")
    single = get("prefix-shared", "single-replica")
    upa, ull = get("uniform", "prefix-aware"), get("uniform", "least-load")
    return {
        "prefix_shared_p90_ttft_vs_round_robin": ratio(pa and pa.ttft_p90_ms, rr and rr.ttft_p90_ms),
        "prefix_shared_hit_rate_vs_single_replica": ratio(pa and pa.hit_rate, single and single.hit_rate),
        "uniform_throughput_vs_least_load": ratio(upa and upa.output_tok_s, ull and ull.output_tok_s),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-router", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default benchmarks/results/<date>)"
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--kv-cache-blocks", type=int, default=192, help="KV blocks (16 tokens) per replica")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--rate", type=float, default=1.0, help="prefix-shared arrivals per second (Poisson)")
    parser.add_argument(
        "--conversation-rate", type=float, default=0.5, help="multi-turn conversations per second"
    )
    parser.add_argument("--num-prompts", type=int, default=96, help="requests of prefix-shared and uniform")
    parser.add_argument("--conversations", type=int, default=16, help="multi-turn conversations")
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = args.out or RESULTS / dt.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)

    from conveyor.server.model.loader import converted, load_tokenizer, resolve_model

    tokenizer = load_tokenizer(converted(resolve_model(None)))
    data = {
        "prefix-shared": prefix_shared_dataset(args.num_prompts, 8, 512, 32, 16, seed=args.seed),
        "uniform": random_dataset(args.num_prompts, 256, 64, range_ratio=0.0, seed=args.seed),
        "multi-turn": conversations(
            tokenizer, args.conversations, args.turns, args.conversation_rate, args.seed
        ),
    }
    print(HEADER)
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    results = []
    for workload in args.workloads:
        for policy in args.policies:
            results.append(measure(args, workload, policy, out, data))
        if workload == "prefix-shared":
            results.append(measure(args, workload, None, out, data))
    checks = targets(results)
    report = {
        "config": vars(args) | {"out": str(out)},
        "results": [asdict(r) for r in results],
        "targets": checks,
    }
    (out / "router.json").write_text(json.dumps(report, indent=2, default=str))
    lines = [HEADER, "| --- | --- | --- | --- | --- | --- | --- | --- |", *(_row(r) for r in results)]
    (out / "router.md").write_text("\n".join(lines) + "\n")
    print(
        "router: "
        + ", ".join(f"{k}={_fmt(v, 3)}" for k, v in checks.items())
        + " (targets: <= 0.333, >= 0.9, >= 0.95)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
