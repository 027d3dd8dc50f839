"""Resident memory of a served model: float against quantized weights, against what it must hold.

    python -m conveyor.benchmarks.memory [--quantization none gguf int8] [--kv-cache-memory BYTES]
        [--json FILE]

Each row is a `conveyor serve` process on the embedded model (`--quantization` as named, the KV pool
fixed by `--kv-cache-memory`), measured after it served 16 requests at once: its resident set (VmRSS
of /proc/<pid>/status, the peak VmHWM beside it). "Must hold" is the weights the server reports
(`conveyor:model_weights_info`'s `weight_bytes`) + the KV pool + the runtime, the resident set of a
process that imported the server, loaded its C++ kernels and the model's tokenizer, without weights
(measured in the same run).
The ratio resident / must-hold says what the server keeps beyond that: transient copies, allocator
slack, conversion leftovers. For `gguf` the weights are the file's blocks, so "must hold" is the file
size + KV pool + runtime, the quantization issue's bound (<= 1.2x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

RUNTIME_PROBE = (
    "import conveyor.server.cli, conveyor.server.api.app, conveyor.server.engine.builder\n"
    "from conveyor.kernels import cpu\n"
    "from conveyor.server.model import loader\n"
    "cpu.load_library()\n"
    "tokenizer = loader.load_tokenizer(loader.converted(loader.resolve_model(None), weights=False), 'auto', None)\n"
    "print(open('/proc/self/status').read())\n"
)


def status_bytes(status: str, field: str) -> int:
    """A `kB` field of /proc/<pid>/status text (`VmRSS`, `VmHWM`) in bytes."""
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no {field} in the status")


def runtime_bytes() -> int:
    """Resident bytes of a fresh process that imported the server, loaded its kernels and the embedded
    model's tokenizer, no weights."""
    done = subprocess.run([sys.executable, "-c", RUNTIME_PROBE], capture_output=True, text=True, check=True)
    return status_bytes(done.stdout, "VmRSS")


def weight_bytes(base_url: str) -> int:
    """The `weight_bytes` label of the server's `conveyor:model_weights_info`."""
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith("conveyor:model_weights_info{"):
            return int(line.split('weight_bytes="')[1].split('"')[0])
    raise ValueError("the server exports no conveyor:model_weights_info")


def measure(quantizations: list[str], kv_cache_memory: int, threads: int) -> dict:
    from conveyor.benchmarks.client import RequestSettings, served_model_id
    from conveyor.benchmarks.datasets import sharegpt_like_dataset
    from conveyor.benchmarks.serve import run_benchmark
    from conveyor.benchmarks.server_process import ConveyorServer

    runtime = runtime_bytes()
    samples = sharegpt_like_dataset(16, 64, 16, spread=4.0, seed=0)
    logs = Path(tempfile.mkdtemp(prefix="conveyor-memory-"))
    rows = []
    for quantization in quantizations:
        flags = ["--kv-cache-memory", str(kv_cache_memory), "--max-num-seqs", "16", "--max-model-len", "2048"]
        if quantization != "none":
            flags += ["--quantization", quantization]
        with ConveyorServer(flags, logs / f"{quantization}.log", threads) as server:
            settings = RequestSettings(model=asyncio.run(served_model_id(server.base_url)))
            records, _ = asyncio.run(run_benchmark(server.base_url, samples, settings, show_progress=False))
            status = Path(f"/proc/{server.process.pid}/status").read_text()
            weights = weight_bytes(server.base_url)
        must_hold = weights + kv_cache_memory + runtime
        rss = status_bytes(status, "VmRSS")
        rows.append(
            {
                "quantization": quantization,
                "failed": sum(not r.success for r in records),
                "rss_bytes": rss,
                "peak_rss_bytes": status_bytes(status, "VmHWM"),
                "weight_bytes": weights,
                "must_hold_bytes": must_hold,
                "ratio": rss / must_hold,
            }
        )
    return {"runtime_bytes": runtime, "kv_cache_memory": kv_cache_memory, "threads": threads, "rows": rows}


def table(result: dict) -> str:
    mib = 2**20
    lines = [
        f"runtime {result['runtime_bytes'] / mib:.0f} MiB, KV pool {result['kv_cache_memory'] / mib:.0f} MiB",
        "| --quantization | weights (MiB) | must hold (MiB) | resident (MiB) | peak (MiB) | resident / must hold |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['quantization']} | {r['weight_bytes'] / mib:.0f} | {r['must_hold_bytes'] / mib:.0f} | "
            f"{r['rss_bytes'] / mib:.0f} | {r['peak_rss_bytes'] / mib:.0f} | {r['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.benchmarks.memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--quantization", nargs="+", default=["none", "gguf", "int8"], help="none, gguf, int8"
    )
    parser.add_argument(
        "--kv-cache-memory", type=int, default=256 << 20, help="each server's KV pool (bytes)"
    )
    parser.add_argument("--threads", type=int, default=1, help="each server's torch threads")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    result = measure(args.quantization, args.kv_cache_memory, args.threads)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if all(r["failed"] == 0 for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
