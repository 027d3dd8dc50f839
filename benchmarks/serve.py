"""``conveyor bench``: load-test any OpenAI-compatible server, in the spirit of vLLM's ``bench serve``.

Example (offline, everything at once, exact output lengths)::

    conveyor bench --base-url http://127.0.0.1:8000 --dataset-name sharegpt-like --num-prompts 64 \\
        --request-rate inf --goodput ttft:2000 tpot:200 --result-file result.json

Prints a summary and optionally writes a JSON result holding the settings, the aggregates and every
request's record.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from conveyor.benchmarks.arrivals import arrival_offsets
from conveyor.benchmarks.client import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    RequestSettings,
    send_request,
    served_model_id,
)
from conveyor.benchmarks.datasets import (
    DATASET_NAMES,
    DEFAULT_VOCAB_SIZE,
    SampleRequest,
    build_dataset,
    to_text,
)
from conveyor.benchmarks.metrics import (
    BenchmarkMetrics,
    RequestRecord,
    compute_metrics,
    parse_goodput_slos,
    static_batching_padding,
)


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags of ``conveyor bench``."""
    parser = argparse.ArgumentParser(prog="conveyor bench", description=__doc__.split("\n\n")[0])
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument("--endpoint", default=COMPLETIONS, choices=(COMPLETIONS, CHAT_COMPLETIONS))
    target.add_argument("--model", default=None, help="model field; default: first id of GET /v1/models")
    target.add_argument("--no-exact-output", action="store_true", help="do not send ignore_eos/min_tokens")
    target.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    target.add_argument(
        "--extra-body", type=json.loads, default={}, help="JSON object merged into each request"
    )

    data = parser.add_argument_group("workload")
    data.add_argument("--dataset-name", default="random", choices=DATASET_NAMES)
    data.add_argument("--dataset-path", default=None, help="JSONL file for --dataset-name file")
    data.add_argument("--num-prompts", type=int, default=100)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--input-len", type=int, default=256, help="random: mean prompt tokens")
    data.add_argument("--output-len", type=int, default=128, help="random: mean output tokens")
    data.add_argument("--range-ratio", type=float, default=0.0, help="random: +- fraction around the mean")
    data.add_argument("--min-input-len", type=int, default=32, help="sharegpt-like: shortest prompt")
    data.add_argument("--min-output-len", type=int, default=16, help="sharegpt-like: shortest output")
    data.add_argument("--spread", type=float, default=10.0, help="sharegpt-like: longest / shortest")
    data.add_argument("--num-prefixes", type=int, default=4, help="prefix-shared: distinct prefixes")
    data.add_argument("--prefix-len", type=int, default=512, help="prefix-shared: shared prefix tokens")
    data.add_argument("--suffix-len", type=int, default=64, help="prefix-shared: own suffix tokens")
    data.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    data.add_argument(
        "--prompt-format",
        default="ids",
        choices=("ids", "text"),
        help="send token-id lists (exact lengths) or text decoded with --tokenizer",
    )
    data.add_argument("--tokenizer", default=None, help="tokenizer dir for --prompt-format text")
    data.add_argument("--tokenizer-gguf-file", default=None, help="GGUF file name inside --tokenizer")

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf = all at once"
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson"
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    load.add_argument("--warmup-requests", type=int, default=0, help="untimed requests sent first")

    report = parser.add_argument_group("report")
    report.add_argument(
        "--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS"
    )
    report.add_argument(
        "--static-batch-size", type=int, default=None, help="batch for the padding-waste figure"
    )
    report.add_argument("--label", default=None, help="name of the system under test in the result")
    report.add_argument("--result-file", default=None, help="write the JSON result here")
    report.add_argument("--disable-tqdm", action="store_true")
    return parser


def load_samples(args: argparse.Namespace) -> list[SampleRequest]:
    """Build the workload the flags describe (token-id prompts unless ``--prompt-format text``)."""
    tokenizer = _load_tokenizer(args) if args.tokenizer else None
    if args.dataset_name == "random":
        kwargs: dict[str, Any] = {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio,
            "vocab_size": args.vocab_size,
        }
    elif args.dataset_name == "sharegpt-like":
        kwargs = {
            "min_input_len": args.min_input_len,
            "min_output_len": args.min_output_len,
            "spread": args.spread,
            "vocab_size": args.vocab_size,
        }
    elif args.dataset_name == "prefix-shared":
        kwargs = {
            "num_prefixes": args.num_prefixes,
            "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len,
            "output_len": args.output_len,
            "vocab_size": args.vocab_size,
        }
    else:
        if not args.dataset_path:
            raise SystemExit("--dataset-name file needs --dataset-path")
        kwargs = {"path": args.dataset_path, "tokenizer": tokenizer}
    samples = build_dataset(args.dataset_name, args.num_prompts, seed=args.seed, **kwargs)
    if args.prompt_format == "text":
        if tokenizer is None:
            raise SystemExit("--prompt-format text needs --tokenizer")
        samples = [to_text(s, tokenizer) for s in samples]
    return samples


def _load_tokenizer(args: argparse.Namespace) -> Any:
    from transformers import AutoTokenizer

    extra = {"gguf_file": args.tokenizer_gguf_file} if args.tokenizer_gguf_file else {}
    return AutoTokenizer.from_pretrained(args.tokenizer, **extra)


async def run_benchmark(
    base_url: str,
    samples: Sequence[SampleRequest],
    settings: RequestSettings,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
    show_progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send ``samples`` at the scheduled arrival times; returns the records (in sample order) and the wall time.

    ``max_concurrency`` caps requests in flight: a request due while the cap is reached waits for a slot
    (its latency is timed from when it is actually sent, as vLLM does).
    """
    offsets = arrival_offsets(len(samples), request_rate, burstiness, seed)
    limits = httpx.Limits(
        max_connections=max_concurrency or len(samples) or 1, max_keepalive_connections=None
    )
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(samples), disable=not show_progress, unit="req", desc="benchmark")

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(sample: SampleRequest, offset_s: float) -> RequestRecord:
            delay = offset_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is None:
                record = await send_request(client, base_url, sample, settings, t0)
            else:
                async with semaphore:
                    record = await send_request(client, base_url, sample, settings, t0)
            progress.update(1)
            return record

        records = await asyncio.gather(*(one(s, o) for s, o in zip(samples, offsets, strict=True)))
        duration = time.perf_counter() - t0
    progress.close()
    return list(records), duration


async def warmup(
    base_url: str, samples: Sequence[SampleRequest], settings: RequestSettings, count: int
) -> None:
    """Send ``count`` requests (the first samples, output capped at 4 tokens) one after another, untimed."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for sample in list(samples)[:count]:
            short = SampleRequest(sample.prompt, sample.prompt_len, min(sample.output_len, 4))
            await send_request(client, base_url, short, settings, time.perf_counter())


def build_result(
    metrics: BenchmarkMetrics,
    records: Sequence[RequestRecord],
    samples: Sequence[SampleRequest],
    config: dict[str, Any],
    static_batch_size: int,
) -> dict[str, Any]:
    """The JSON-serialisable result: config, aggregates, the padding figure and every record."""
    padding = static_batching_padding(
        [s.prompt_len for s in samples], [s.output_len for s in samples], static_batch_size
    )
    return {
        "config": config,
        "metrics": asdict(metrics),
        "static_padding": {
            "batch_size": static_batch_size,
            "useful_tokens": padding.useful_tokens,
            "slot_tokens": padding.slot_tokens,
            "efficiency": padding.efficiency,
        },
        "output_len_mismatches": sum(
            1 for r, s in zip(records, samples, strict=True) if r.success and r.output_len != s.output_len
        ),
        "errors": sorted({r.error for r in records if not r.success})[:10],
        "records": [asdict(r) for r in records],
    }


def format_summary(label: str, metrics: BenchmarkMetrics, padding_efficiency: float | None = None) -> str:
    """A human-readable block like vLLM's, one figure per line."""
    lines = [
        f"{' ' + label + ' ':=^60}",
        f"{'Successful requests:':<40}{metrics.completed:>20}",
        f"{'Failed requests:':<40}{metrics.failed:>20}",
        f"{'Benchmark duration (s):':<40}{metrics.duration_s:>20.2f}",
        f"{'Total input tokens:':<40}{metrics.total_input_tokens:>20}",
        f"{'Total generated tokens:':<40}{metrics.total_output_tokens:>20}",
        f"{'Request throughput (req/s):':<40}{metrics.request_throughput:>20.3f}",
        f"{'Output token throughput (tok/s):':<40}{metrics.output_throughput:>20.2f}",
        f"{'Total token throughput (tok/s):':<40}{metrics.total_token_throughput:>20.2f}",
    ]
    if metrics.goodput is not None:
        lines.append(f"{'Goodput (req/s):':<40}{metrics.goodput:>20.3f}")
    for name, summary in (
        ("TTFT", metrics.ttft_ms),
        ("TPOT", metrics.tpot_ms),
        ("ITL", metrics.itl_ms),
        ("E2E", metrics.e2el_ms),
    ):
        lines.append(f"{'-' * 20} {name} (ms) {'-' * (34 - len(name))}")
        for key, value in summary.items():
            shown = "n/a" if value is None else f"{value:.2f}"
            lines.append(f"{key:<40}{shown:>20}")
    lines.append(f"{'-' * 20} p99 by prompt length (ms) {'-' * 13}")
    for bucket, values in metrics.p99_by_bucket_ms.items():
        if values["count"]:
            ttft, tpot = values["ttft"], values["tpot"]
            tpot_text = "n/a" if tpot is None else f"{tpot:.1f}"
            lines.append(f"{bucket:<12} n={values['count']:<5} ttft={ttft:.1f} tpot={tpot_text}")
    if padding_efficiency is not None:
        lines.append(f"{'Static batching token efficiency:':<40}{padding_efficiency:>19.1%}")
    lines.append("=" * 60)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``conveyor bench``; returns the process exit code (1 if any request failed)."""
    args = build_parser().parse_args(argv)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    samples = load_samples(args)
    if not samples:
        raise SystemExit("the workload is empty")
    try:
        model = args.model or asyncio.run(served_model_id(base_url))
    except httpx.HTTPError as exc:
        print(f"conveyor bench: cannot reach {base_url}: {exc}", file=sys.stderr)
        return 1
    settings = RequestSettings(
        model=model, endpoint=args.endpoint, exact_output=not args.no_exact_output, extra_body=args.extra_body
    )
    slos = parse_goodput_slos(args.goodput) if args.goodput else None

    if args.warmup_requests:
        asyncio.run(warmup(base_url, samples, settings, args.warmup_requests))
    records, duration = asyncio.run(
        run_benchmark(
            base_url,
            samples,
            settings,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            timeout_s=args.timeout,
            show_progress=not args.disable_tqdm,
        )
    )
    metrics = compute_metrics(records, duration, slos)
    label = args.label or base_url
    config = {
        "label": label,
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model": model,
        "dataset_name": args.dataset_name,
        "num_prompts": len(samples),
        "seed": args.seed,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "prompt_format": args.prompt_format,
        "exact_output": not args.no_exact_output,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    batch = args.static_batch_size or args.max_concurrency or len(samples)
    result = build_result(metrics, records, samples, config, batch)
    print(format_summary(label, metrics, result["static_padding"]["efficiency"]))
    for error in result["errors"]:
        print(f"error: {error}")
    if args.result_file:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"result written to {path}")
    return 1 if metrics.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
