"""Quantized weights against float32 on one shape: decode speed and the share of memory bandwidth it reaches.

    python -m conveyor.benchmarks.quantized [--model llama-3.2-1b]
        [--formats float32 bfloat16 q8_0 q4_0 int8] [--tokens 24] [--json FILE]

Decode reads every weight once per step, so on a CPU its speed is bounded by memory bandwidth over the
bytes of the weights. The model is a catalog shape (`conveyor plan --write-config`, default
`llama-3.2-1b`) or a directory with a config.json, served in-process with `--load-format dummy`:
random float32 or bfloat16 weights, random blocks of a GGUF format (`--quantization q8_0` ...), or the
random float weights quantized per channel (`--quantization int8`), the kernels chosen by measurement as
a server chooses them. Per format: the bytes a decode step reads (every linear layer
and the LM head; the embedding lookup reads one row), the median step time with one sequence decoding
and with 16, and "% of bandwidth": the time the bytes take at the machine's copy bandwidth (a 1 GiB
copy over every thread, read and written bytes counted as STREAM counts them) over the measured step,
the copy measured in the same run. It can pass 100 %: a kernel that prefetches its weight rows streams
them faster than a plain copy (or sum) does. Output: a table and, with `--json`, the same numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from conveyor.benchmarks.metrics import copy_bandwidth

FORMATS = ("float32", "bfloat16", "q8_0", "q4_0", "int8")
FLOATS = {"float32": 4, "bfloat16": 2}  # bytes per weight
SEQUENCES = (1, 16)


def bytes_per_step(shape, fmt: str) -> int:
    """Weight bytes one decode step reads: every linear layer and the LM head, in `fmt`."""
    from conveyor.kernels.quant import Int8Format, row_bytes

    hd, hidden = shape.head_dim, shape.hidden_size
    q, kv = shape.num_heads * hd, shape.num_kv_heads * hd
    layer = [
        (q + 2 * kv, hidden),
        (hidden, q),
        (2 * shape.intermediate_size, hidden),
        (hidden, shape.intermediate_size),
    ]
    matrices = layer * shape.num_layers + [(shape.vocab_size, hidden)]  # (rows, columns)
    if fmt in FLOATS:
        return sum(rows * cols for rows, cols in matrices) * FLOATS[fmt]
    if fmt == "int8":
        return sum(rows * row_bytes(Int8Format.INT8, cols) for rows, cols in matrices)
    from gguf import GGMLQuantizationType

    return sum(rows * row_bytes(GGMLQuantizationType[fmt.upper()], cols) for rows, cols in matrices)


def step_times(engine, sequences: int, tokens: int) -> float:
    """Median seconds of the decode steps of `sequences` requests of 32-token prompts decoding `tokens`."""
    from conveyor.server.messages import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(sequences):
        prompt = [100 + 7 * i + j for j in range(32)]
        engine.add_request(engine.make_request(f"{sequences}-{i}-{time.monotonic_ns()}", prompt, params))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return statistics.median(steps[1:])  # the first step is the prefill


def measure(model_dir: str, formats: list[str], tokens: int) -> dict:
    from conveyor.server.config import CacheConfig, EngineConfig, ModelConfig
    from conveyor.server.engine.builder import build_engine

    bandwidth = copy_bandwidth()
    rows = []
    for fmt in formats:
        model = ModelConfig(
            model=model_dir,
            load_format="dummy",
            dtype="bfloat16" if fmt == "bfloat16" else "float32",
            max_model_len=512,
            quantization=None if fmt in FLOATS else fmt,
        )
        engine = build_engine(EngineConfig(model=model, cache=CacheConfig(kv_cache_memory=256 << 20)))
        step_times(engine, 1, 4)  # warm-up
        weight_bytes = bytes_per_step(engine.model.shape, fmt)
        row = {"format": fmt, "weight_bytes_per_step": weight_bytes}
        for sequences in SEQUENCES:
            seconds = step_times(engine, sequences, tokens)
            row[f"step_ms_{sequences}"] = seconds * 1e3
            row[f"tokens_per_s_{sequences}"] = sequences / seconds
        row["bandwidth_share_1"] = weight_bytes / bandwidth / (row["step_ms_1"] / 1e3)
        rows.append(row)
        engine.close()
    return {
        "model": model_dir,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def table(result: dict) -> str:
    lines = [
        f"copy bandwidth {result['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s ({result['threads']} threads)",
        "| weights | MiB read per step | 1 sequence: ms/step | tok/s | % of bandwidth | 16 sequences: ms/step | tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['format']} | {r['weight_bytes_per_step'] / 2**20:.0f} | {r['step_ms_1']:.1f} | "
            f"{r['tokens_per_s_1']:.1f} | {100 * r['bandwidth_share_1']:.0f} % | {r['step_ms_16']:.1f} | "
            f"{r['tokens_per_s_16']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.benchmarks.quantized", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model", default="llama-3.2-1b", help="a catalog model name or a directory with config.json"
    )
    parser.add_argument(
        "--formats",
        nargs="+",
        default=list(FORMATS),
        help="float32, bfloat16, int8 and GGUF block formats (q8_0, q4_0, q4_k, ...)",
    )
    parser.add_argument("--tokens", type=int, default=24, help="tokens each sequence decodes")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model
        if not Path(model_dir).is_dir():
            from conveyor.operator import plan

            with contextlib.redirect_stdout(io.StringIO()):  # it prints the path written
                if plan.main(["--model", args.model, "--write-config", scratch]) != 0:
                    return 2
            model_dir = scratch
        result = measure(model_dir, args.formats, args.tokens)
    result["model"] = args.model
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
