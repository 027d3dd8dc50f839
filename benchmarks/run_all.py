"""``make bench``: every system on one workload, in one run, on this machine.

Systems (same model, dtype, torch threads and workload): conveyor continuous batching, conveyor
``--scheduling static`` (when the server has it), transformers ``generate`` in fixed padded batches,
and transformers' continuous batching (when installed). Scenarios:

- offline: all requests at once on a long-tailed workload (10x length spread);
- online: Poisson arrivals at 50 % and 90 % of conveyor static's measured offline capacity (req/s);
- chunked-prefill sweep: conveyor continuous with ``--max-num-batched-tokens`` 512 / 1024 / 4096 on a
  mixed long-prompt workload (256-2,560 tokens) at a steady Poisson rate (``--sweep-rate``);
- quantized weights' quality: KL divergence and top-1 agreement against the float32 model per
  quantization (``conveyor.benchmarks.quality``).

MFU is ``2 * params * total tokens/s`` over the matmul rate of a large ``torch.mm`` measured in the run.
Writes ``<out>/summary.json``, one JSON per run (with every request), the workloads (JSONL), PNG plots
and ``results.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from conveyor.benchmarks import plots, report
from conveyor.benchmarks.client import RequestSettings, served_model_id
from conveyor.benchmarks.datasets import SampleRequest, sharegpt_like_dataset, write_jsonl
from conveyor.benchmarks.metrics import (
    DTYPE_BYTES,
    EMBEDDED_MODEL_FLOPS,
    ModelFlops,
    RequestRecord,
    bandwidth_share,
    compute_metrics,
    copy_bandwidth,
    matmul_flops_per_s,
    model_flops_utilization,
    parse_goodput_slos,
    run_entry,
    static_batching_padding,
)
from conveyor.benchmarks.serve import run_benchmark, warmup
from conveyor.benchmarks.server_process import ConveyorServer, ServerStartError, conveyor_executable
from conveyor.server.engine.builder import pick_dtype

CHUNK_SWEEP = (512, 1024, 4096)


#: Parameters of the embedded SmolLM2-135M (tied embeddings counted once), used when transformers is skipped.
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.benchmarks.run_all", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", default=None, help="results folder; default benchmarks/results/<UTC date>")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="every system's dtype; auto = the server's choice (bfloat16 where the CPU computes it natively)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for every system; 1 because on a shared 2-core machine every 2-thread parallel "
        "region waits for a descheduled thread (4-15x slower under load)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=16, help="max batch size for every system")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests in the main workload")
    parser.add_argument(
        "--min-input-len", type=int, default=24, help="main workload: shortest prompt (tokens)"
    )
    parser.add_argument(
        "--min-output-len", type=int, default=16, help="main workload: shortest output (tokens)"
    )
    parser.add_argument("--spread", type=float, default=10.0, help="main workload: longest / shortest length")
    parser.add_argument(
        "--sweep-num-prompts", type=int, default=16, help="requests in the chunked-prefill sweep"
    )
    parser.add_argument(
        "--sweep-min-input-len", type=int, default=256, help="sweep: shortest prompt (tokens)"
    )
    parser.add_argument("--sweep-output-len", type=int, default=48, help="sweep: shortest output (tokens)")
    parser.add_argument(
        "--sweep-rate",
        type=float,
        default=0.25,
        help="sweep Poisson requests/s: steady decodes while long prompts keep arriving",
    )
    parser.add_argument("--online-fractions", type=float, nargs="*", default=[0.5, 0.9])
    parser.add_argument("--goodput", nargs="+", default=["ttft:5000", "tpot:500"], metavar="KEY:MS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hf-max-batch-tokens",
        type=int,
        default=2048,
        help="transformers continuous batching token budget per step",
    )
    parser.add_argument("--skip-conveyor", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument(
        "--skip-quality", action="store_true", help="skip the quantized weights' quality table"
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild summary, tables and plots from the run JSONs in --out",
    )
    return parser


def measure_matmul_peak(dtype: str, threads: int, n: int = 2048, repeats: int = 5) -> dict[str, Any]:
    """Best-of-``repeats`` FLOP/s of an ``[n, n] @ [n, n]`` ``torch.mm`` in ``dtype`` on ``threads`` threads."""
    torch.set_num_threads(threads)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    a = torch.randn(n, n, dtype=torch_dtype)
    b = torch.randn(n, n, dtype=torch_dtype)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return {
        "n": n,
        "dtype": dtype,
        "threads": threads,
        "seconds": best,
        "flops_per_s": matmul_flops_per_s(n, best),
    }


def environment() -> dict[str, Any]:
    """Versions, CPU and load: enough to tell whether a later run is comparable."""
    import transformers

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout
    except OSError:
        commit = ""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit.strip(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average_start": os.getloadavg(),
    }


class Bench:
    """Runs scenarios and collects run entries, writing each run's JSON as soon as it finishes."""

    def __init__(
        self,
        out: Path,
        args: argparse.Namespace,
        peak_flops: float,
        flops: ModelFlops,
        bandwidth: float | None = None,
    ) -> None:
        self.out = out
        self.args = args
        self.peak_flops = peak_flops
        self.flops = flops
        self.bandwidth = bandwidth  # copy bandwidth, bytes/s (`metrics.copy_bandwidth`)
        self.slos = parse_goodput_slos(args.goodput)
        self.runs: list[dict[str, Any]] = []
        #: Offline requests/s of the first conveyor system run (static when the server has it).
        self.capacity_req_s: float | None = None
        self.capacity_system: str | None = None

    @property
    def weight_bytes(self) -> float:
        """The weight bytes a decode step reads, every system in the run's dtype."""
        return self.flops.weight_bytes(DTYPE_BYTES[self.args.dtype])

    def record(
        self,
        system: str,
        scenario: str,
        samples: Sequence[SampleRequest],
        records: list[RequestRecord],
        duration_s: float,
        request_rate: float | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        metrics = compute_metrics(records, duration_s, self.slos)
        padding = static_batching_padding(
            [s.prompt_len for s in samples], [s.output_len for s in samples], self.args.max_num_seqs
        )
        mfu = model_flops_utilization(
            self.flops, metrics.total_token_throughput, metrics.output_throughput, self.peak_flops
        )
        run = run_entry(system, scenario, samples, records, metrics, mfu, request_rate,
                        weight_bytes=self.weight_bytes, bandwidth=self.bandwidth,
                        static_padding_efficiency=padding.efficiency, **extra)  # fmt: skip
        slug = re.sub(r"[^a-z0-9]+", "_", f"{system} {scenario}".replace("%", "pct").lower()).strip("_")
        (self.out / f"{slug}.json").write_text(json.dumps({**run, "records": [asdict(r) for r in records]}))
        self.runs.append({**run, "records": [asdict(r) for r in records]})
        m = metrics
        print(
            f"[bench] {run['name']}: {m.completed} ok, {m.failed} failed, {m.duration_s:.1f} s, "
            f"{m.output_throughput:.1f} output tok/s, TTFT p99 {m.ttft_ms['p99']} ms, MFU {run['mfu']:.2%}",
            flush=True,
        )
        return run

    def http_run(
        self,
        server: ConveyorServer,
        system: str,
        scenario: str,
        samples: Sequence[SampleRequest],
        request_rate: float = math.inf,
        **extra: Any,
    ) -> dict[str, Any]:
        model = asyncio.run(served_model_id(server.base_url))
        settings = RequestSettings(model=model)
        records, duration = asyncio.run(
            run_benchmark(server.base_url, samples, settings, request_rate=request_rate, seed=self.args.seed)
        )
        rate = None if math.isinf(request_rate) else request_rate
        return self.record(system, scenario, samples, records, duration, request_rate=rate, **extra)


def server_supports(flag: str) -> bool:
    """Whether ``conveyor serve --help`` lists ``flag``."""
    try:
        result = subprocess.run(
            [conveyor_executable(), "serve", "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag in result.stdout


def run_conveyor(bench: Bench, main_samples: list[SampleRequest], sweep_samples: list[SampleRequest]) -> None:
    """Conveyor static (capacity), continuous, online at fractions of static capacity, and the sweep."""
    args = bench.args
    logs = Path(tempfile.mkdtemp(prefix="conveyor-bench-logs-"))  # server logs stay out of the results
    print(f"[bench] server logs in {logs}", flush=True)
    common = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)]
    warm = main_samples[:2]
    capacity: float | None = None
    has_static = server_supports("--scheduling")
    # Static batching prefills whole prompts: its step budget must hold the longest (the model's 8192).
    static_flags = ["--scheduling", "static", "--max-num-batched-tokens", "8192"]
    systems = [("conveyor static", static_flags)] if has_static else []
    if not has_static:
        print("[bench] conveyor serve has no --scheduling: static runs skipped", flush=True)
    systems.append(("conveyor continuous", ["--scheduling", "continuous"] if has_static else []))
    for system, flags in systems:
        try:
            with ConveyorServer(
                common + flags, logs / f"{system.replace(' ', '_')}.log", threads=args.threads
            ) as server:
                asyncio.run(
                    warmup(
                        server.base_url,
                        warm,
                        RequestSettings(model=asyncio.run(served_model_id(server.base_url))),
                        2,
                    )
                )
                offline = bench.http_run(server, system, "offline", main_samples)
                if capacity is None:
                    capacity = offline["metrics"]["request_throughput"]
                    bench.capacity_req_s, bench.capacity_system = capacity, system
                for fraction in args.online_fractions:
                    rate = fraction * capacity
                    bench.http_run(server, system, f"online {fraction:.0%}", main_samples, request_rate=rate)
        except ServerStartError as err:
            print(f"[bench] {system}: {err}", flush=True)
    if args.skip_sweep:
        return
    rate = args.sweep_rate
    for chunk in CHUNK_SWEEP:
        flags = ["--max-num-batched-tokens", str(chunk)]
        if has_static:
            flags += ["--scheduling", "continuous"]
        try:
            with ConveyorServer(common + flags, logs / f"sweep_{chunk}.log", threads=args.threads) as server:
                asyncio.run(
                    warmup(
                        server.base_url,
                        warm,
                        RequestSettings(model=asyncio.run(served_model_id(server.base_url))),
                        2,
                    )
                )
                bench.http_run(
                    server,
                    "conveyor continuous",
                    f"sweep {chunk}",
                    sweep_samples,
                    request_rate=rate,
                    chunk_tokens=chunk,
                )
        except ServerStartError as err:
            print(f"[bench] sweep {chunk}: {err}", flush=True)


def run_transformers(bench: Bench, model: Any, main_samples: list[SampleRequest]) -> None:
    """transformers ``generate`` in static batches, then its continuous batching, both offline."""
    from conveyor.benchmarks.baselines import run_hf_continuous, run_static_generate

    args = bench.args
    run_static_generate(model, main_samples[:2], batch_size=2, show_progress=False)  # warm-up
    records, duration = run_static_generate(model, main_samples, batch_size=args.max_num_seqs)
    bench.record("transformers generate (static batches)", "offline", main_samples, records, duration)
    if not hasattr(model, "continuous_batching_context_manager"):
        print("[bench] this transformers has no continuous batching: skipped", flush=True)
        return
    longest = max(s.prompt_len + s.output_len for s in main_samples)
    page_size = 64
    num_blocks = args.max_num_seqs * math.ceil(longest / page_size) + 8
    try:
        for samples in (main_samples[:2], main_samples):  # warm-up, then the measured run
            records, duration = run_hf_continuous(
                model,
                samples,
                max_batch_tokens=args.hf_max_batch_tokens,
                max_requests_per_batch=args.max_num_seqs,
                num_blocks=num_blocks,
                page_size=page_size,
                show_progress=samples is main_samples,
            )
    except Exception as err:  # a third-party engine failing must not lose the other results
        print(f"[bench] transformers continuous batching failed: {type(err).__name__}: {err}", flush=True)
        return
    bench.record("transformers continuous batching", "offline", main_samples, records, duration)


def write_report(
    bench: Bench, env: dict[str, Any], peak: dict[str, Any], command: str, quality: list[dict] | None = None
) -> None:
    """summary.json, results.md and the PNG plots; `quality`: `benchmarks.quality.measure()`'s rows."""
    out = bench.out
    runs = bench.runs
    summary_runs = [{k: v for k, v in r.items() if k != "records"} for r in runs]
    checks = report.target_checks(summary_runs)
    env.setdefault("load_average_end", os.getloadavg())
    summary = {
        "environment": env,
        "matmul_peak": peak,
        "copy_bandwidth_bytes_per_s": bench.bandwidth,
        "num_params": bench.flops.num_params,
        "model_flops": asdict(bench.flops),
        "command": command,
        "settings": vars(bench.args),
        "targets": checks,
        "online_capacity": {"system": bench.capacity_system, "requests_per_s": bench.capacity_req_s},
        "runs": summary_runs,
        "quality": quality,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))

    main_runs = [r for r in runs if not r["scenario"].startswith("sweep")]
    offline = [r for r in main_runs if r["scenario"] == "offline"]
    sweep = [r for r in runs if r["scenario"].startswith("sweep")]
    if offline:
        plots.throughput_bars(
            offline, out / "throughput.png", "Offline output throughput (10x length spread)"
        )
        plots.ttft_cdf(offline, out / "ttft_cdf_offline.png", "TTFT CDF, offline")
    online = [r for r in main_runs if r["scenario"].startswith("online")]
    if online:
        plots.ttft_cdf(online, out / "ttft_cdf_online.png", "TTFT CDF, online (Poisson)")
    if sweep:
        plots.chunked_prefill_tradeoff(sweep, out / "chunked_prefill.png", "Chunked prefill: TTFT vs ITL")
        plots.p99_by_bucket(
            sweep, out / "p99_ttft_by_bucket.png", "p99 TTFT per prompt length, sweep", "ttft"
        )
        plots.p99_by_bucket(sweep, out / "p99_itl_by_bucket.png", "p99 ITL per prompt length, sweep", "itl")

    peak_gflops = peak["flops_per_s"] / 1e9
    lines = [
        f"# Benchmark results {env['date']}",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {env['cpu']} ({env['cpu_count']} cores), torch {env['torch']}, transformers "
        f"{env['transformers']}, {bench.args.dtype}, {bench.args.threads} threads, commit {env['commit'][:12]}. "
        f"Matmul rate ({peak['n']}x{peak['n']} torch.mm, {peak['dtype']}): {peak_gflops:.1f} GFLOP/s; "
        f"MFU = (2 x {bench.flops.layer_params:,} layer params x total tok/s + 2 x "
        f"{bench.flops.lm_head_params:,} LM-head params x output tok/s) / that rate. "
        + (
            f"Copy bandwidth {bench.bandwidth / 1e9:.1f} GB/s; % of bandwidth = the "
            f"{bench.weight_bytes / 2**20:.0f} MiB of weights a decode step reads / TPOT p50 / that bandwidth. "
            if bench.bandwidth
            else ""
        )
        + f"Load average at start "
        f"{env['load_average_start'][0]:.2f}, at end {env['load_average_end'][0]:.2f} (each run's is in summary.json; "
        "other jobs may share the CPU).",
        "",
        "conveyor runs as a `conveyor serve` process measured over HTTP by `conveyor bench` on the same machine "
        "(streaming, exact output lengths via `ignore_eos` + `min_tokens`); the transformers baselines run "
        "in-process with every request at time 0 and per-token timestamps, so they pay no HTTP or client cost.",
        "",
        f"Main workload: {bench.args.num_prompts} requests, long-tailed prompt and output lengths with a "
        f"{bench.args.spread:g}x spread, exact output lengths, max batch size {bench.args.max_num_seqs} for every system. "
        f"Static batching would use {main_runs[0]['static_padding_efficiency']:.1%} of its token slots on it."
        if main_runs
        else "",
        "",
        f"Online: Poisson arrivals at {', '.join(f'{f:.0%}' for f in bench.args.online_fractions)} of "
        f"{bench.capacity_system}'s offline capacity ({bench.capacity_req_s or 0:.3f} req/s). Chunked-prefill "
        f"sweep: {bench.args.sweep_num_prompts} requests, prompts {bench.args.sweep_min_input_len:,}-"
        f"{round(bench.args.sweep_min_input_len * bench.args.spread):,} tokens, Poisson {bench.args.sweep_rate:g} req/s. "
        f"Goodput SLOs (ms): {', '.join(bench.args.goodput)}.",
        "",
        "## Targets",
        "",
        report.targets_table(checks),
        "",
        "## All runs",
        "",
        report.runs_table(summary_runs),
        "",
        "## Chunked-prefill sweep",
        "",
        report.sweep_table([r for r in summary_runs if "chunk_tokens" in r]),
        "",
        "## p99 per prompt-length bucket",
        "",
        report.bucket_table(summary_runs),
        "",
    ]
    if quality:
        from conveyor.benchmarks.quality import table

        lines += [
            "## Quantized weights: quality against float32",
            "",
            "Next-token distributions on fixed texts against transformers' float32 model of the same file "
            "(`python -m conveyor.benchmarks.quality`).",
            "",
            table(quality),
            "",
        ]
    (out / "results.md").write_text("\n".join(lines))
    print((out / "results.md").read_text())


def rebuild_report(out: Path) -> int:
    """Recompute every run's metrics from its saved records and rewrite summary, tables and plots.

    Keeps the environment, matmul rate, settings and command of ``out/summary.json`` and its runs only
    (``make bench-peers`` results stay in their own ``peers.md``).
    """
    summary = json.loads((out / "summary.json").read_text())
    args = argparse.Namespace(**summary["settings"])
    flops = ModelFlops(**summary["model_flops"]) if "model_flops" in summary else EMBEDDED_MODEL_FLOPS
    bench = Bench(
        out, args, summary["matmul_peak"]["flops_per_s"], flops, summary.get("copy_bandwidth_bytes_per_s")
    )
    bench.capacity_system = summary["online_capacity"]["system"]
    bench.capacity_req_s = summary["online_capacity"]["requests_per_s"]
    order = {run["name"]: index for index, run in enumerate(summary["runs"])}
    runs = []
    for path in out.glob("*.json"):
        if path.name == "summary.json":
            continue
        run = json.loads(path.read_text())
        if run.get("name") not in order:
            continue
        records = [RequestRecord(**{**r, "itl_s": tuple(r["itl_s"])}) for r in run["records"]]
        metrics = compute_metrics(records, run["metrics"]["duration_s"], bench.slos)
        run["metrics"] = asdict(metrics)
        run["mfu"] = model_flops_utilization(
            bench.flops, metrics.total_token_throughput, metrics.output_throughput, bench.peak_flops
        )
        if bench.bandwidth:
            run["bandwidth_share"] = bandwidth_share(
                bench.weight_bytes, metrics.tpot_ms["median"], bench.bandwidth
            )
        runs.append(run)
    bench.runs = sorted(runs, key=lambda r: order[r["name"]])
    write_report(
        bench, summary["environment"], summary["matmul_peak"], summary["command"], summary.get("quality")
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the whole comparison; returns 0 when every system that ran completed all its requests."""
    args = build_parser().parse_args(argv)
    if args.dtype == "auto":
        dtype, why = pick_dtype("auto", torch.device("cpu"))
        args.dtype = str(dtype).removeprefix("torch.")
        print(f"[bench] dtype {args.dtype} ({why})")
    out = Path(args.out or f"benchmarks/results/{time.strftime('%Y-%m-%d', time.gmtime())}")
    if args.report_only:
        return rebuild_report(out)
    out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else argv
    command = "python -m conveyor.benchmarks.run_all " + " ".join(given)
    if os.environ.get("MAKELEVEL"):
        command = "make bench" + (f" BENCH_ARGS='{' '.join(given)}'" if given else "")
    env = environment()
    peak = measure_matmul_peak(args.dtype, args.threads)
    bandwidth = copy_bandwidth()
    print(
        f"[bench] matmul peak {peak['flops_per_s'] / 1e9:.1f} GFLOP/s ({args.dtype}, {args.threads} threads), "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s"
    )

    main_samples = sharegpt_like_dataset(
        args.num_prompts, args.min_input_len, args.min_output_len, spread=args.spread, seed=args.seed
    )
    sweep_samples = sharegpt_like_dataset(
        args.sweep_num_prompts,
        args.sweep_min_input_len,
        args.sweep_output_len,
        spread=args.spread,
        output_spread=2.0,
        seed=args.seed + 1,
    )
    write_jsonl(main_samples, out / "workload_main.jsonl")
    write_jsonl(sweep_samples, out / "workload_sweep.jsonl")

    model = None
    flops = EMBEDDED_MODEL_FLOPS
    if not args.skip_transformers:
        from conveyor.benchmarks.baselines import count_parameters, load_hf_model

        model = load_hf_model(args.dtype)
        flops = ModelFlops.from_config(count_parameters(model), model.config.to_dict())
    bench = Bench(out, args, peak["flops_per_s"], flops, bandwidth)
    if not args.skip_conveyor:
        run_conveyor(bench, main_samples, sweep_samples)
    if model is not None:
        run_transformers(bench, model, main_samples)
    quality = None
    if not args.skip_quality:
        from conveyor.benchmarks.quality import measure

        quality = measure()
    write_report(bench, env, peak, command, quality)
    return 0 if all(r["metrics"]["failed"] == 0 for r in bench.runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
