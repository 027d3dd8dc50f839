"""``make bench-peers``: llama-cpp-python's OpenAI-compatible server on the embedded GGUF, same workload.

llama-cpp-python lives in its own virtual environment (default ``~/.cache/conveyor/llama-cpp-venv``;
its wheel compiles llama.cpp, about 6 minutes on 2 cores, once per machine). It runs the Q4_1 weights
as they are in the file, so its numbers compare a quantized CPU engine with conveyor's bfloat16 one.
Requests are the main workload of a ``make bench`` results folder, as text (llama-cpp-python's
completions take strings), with exact output lengths through ``min_tokens`` and a ban on the EOS token.
Writes ``<results>/llama_cpp_python_offline.json`` and ``<results>/peers.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from conveyor.benchmarks import report
from conveyor.benchmarks.baselines import EMBEDDED_GGUF, PAD_TOKEN_ID, embedded_model_dir
from conveyor.benchmarks.client import RequestSettings
from conveyor.benchmarks.datasets import load_jsonl, to_text
from conveyor.benchmarks.metrics import compute_metrics, model_flops_utilization, parse_goodput_slos
from conveyor.benchmarks.serve import run_benchmark, warmup
from conveyor.benchmarks.server_process import ServerProcess, ServerStartError, free_port

LLAMA_CPP_VERSION = "0.3.36"
DEFAULT_VENV = Path.home() / ".cache" / "conveyor" / "llama-cpp-venv"


def ensure_llama_cpp(venv: Path) -> Path:
    """The venv's python with ``llama-cpp-python[server]`` installed (installing it first if missing).

    Raises subprocess.CalledProcessError when the install fails.
    """
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", "import llama_cpp.server"], capture_output=True, check=False)
    if probe.returncode != 0:
        print(
            f"[peers] installing llama-cpp-python {LLAMA_CPP_VERSION} into {venv} (compiles llama.cpp)",
            flush=True,
        )
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"llama-cpp-python[server]=={LLAMA_CPP_VERSION}"],
            check=True,
        )
    return python


def latest_results_dir() -> Path:
    """The newest ``benchmarks/results/<date>`` folder holding a main workload; raises FileNotFoundError."""
    folders = sorted(p.parent for p in Path("benchmarks/results").glob("*/workload_main.jsonl"))
    if not folders:
        raise FileNotFoundError("no benchmarks/results/<date>/workload_main.jsonl: run make bench first")
    return folders[-1]


def main(argv: list[str] | None = None) -> int:
    """Benchmark llama-cpp-python offline on a results folder's main workload; 0 when all requests succeed."""
    parser = argparse.ArgumentParser(prog="python -m conveyor.benchmarks.run_peers", description=__doc__)
    parser.add_argument("--results", default=None, help="a make bench results folder; default: the newest")
    parser.add_argument("--venv", default=str(DEFAULT_VENV))
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (match make bench)")
    parser.add_argument("--goodput", nargs="+", default=["ttft:5000", "tpot:500"], metavar="KEY:MS")
    args = parser.parse_args(argv)

    results = Path(args.results) if args.results else latest_results_dir()
    python = ensure_llama_cpp(Path(args.venv))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir(), gguf_file=EMBEDDED_GGUF)
    samples = [to_text(s, tokenizer) for s in load_jsonl(results / "workload_main.jsonl")]
    summary_path = results / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    peak = summary.get("matmul_peak", {}).get("flops_per_s")
    num_params = summary.get("num_params", 134_515_008)

    port = free_port()
    command = [
        str(python),
        "-m",
        "llama_cpp.server",
        "--model",
        str(Path(embedded_model_dir()) / EMBEDDED_GGUF),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(args.threads),
        "--n_threads_batch",
        str(args.threads),
        "--n_ctx",
        "4096",
        # By default a new request cuts off the stream in progress; queue them instead, as a server should.
        "--interrupt_requests",
        "False",
    ]
    # llama-cpp-python has no ignore_eos: ban EOS so every request generates exactly max_tokens tokens.
    settings = RequestSettings(model="peer", extra_body={"logit_bias": {str(PAD_TOKEN_ID): -100.0}})
    try:
        with ServerProcess(
            command,
            port,
            Path(tempfile.mkdtemp(prefix="conveyor-peers-")) / "llama_cpp_python.log",
            args.threads,
            health_path="/v1/models",
        ) as server:
            asyncio.run(warmup(server.base_url, samples[:2], settings, 2))
            records, duration = asyncio.run(run_benchmark(server.base_url, samples, settings))
    except ServerStartError as err:
        print(f"[peers] llama-cpp-python server: {err}", flush=True)
        return 1
    metrics = compute_metrics(records, duration, parse_goodput_slos(args.goodput))
    run = {
        "name": "llama-cpp-python server (Q4_1) / offline",
        "system": "llama-cpp-python server (Q4_1)",
        "scenario": "offline",
        "request_rate": None,
        "metrics": asdict(metrics),
        "mfu": model_flops_utilization(num_params, metrics.total_token_throughput, peak) if peak else None,
        "output_len_mismatches": sum(
            1 for r, s in zip(records, samples, strict=True) if r.success and r.output_len != s.output_len
        ),
        "errors": sorted({r.error for r in records if not r.success})[:5],
        "load_average": os.getloadavg(),
        "threads": args.threads,
    }
    (results / "llama_cpp_python_offline.json").write_text(
        json.dumps({**run, "records": [asdict(r) for r in records]})
    )
    others = [r for r in summary.get("runs", []) if r["scenario"] == "offline"]
    table = report.runs_table([*others, run])
    text = (
        "# Peers, offline, same workload\n\n"
        "Command: `make bench-peers`\n\n"
        f"llama-cpp-python {LLAMA_CPP_VERSION} server, Q4_1 weights as in the GGUF file, {args.threads} thread(s); "
        f"text prompts. It sends no usage when streaming, so output tokens are its streamed text chunks; "
        f"{run['output_len_mismatches']} requests streamed fewer chunks than the tokens asked for (a multi-byte "
        "character's tokens arrive as one chunk), which undercounts its throughput slightly. "
        "Other rows: the make bench run in this folder.\n\n" + table + "\n"
    )
    (results / "peers.md").write_text(text)
    print(text)
    return 0 if metrics.failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
