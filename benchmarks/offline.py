"""Offline batches through the in-process engine: throughput, step times, the KV pool, and how close a
decode step comes to its memory-bandwidth floor.

    python -m conveyor.benchmarks.offline MODEL [--load-format dummy] [--dtype bfloat16] [--model-impl transformers]
        [--batch-sizes 1,16,64,256] [--input-len 512] [--output-len 128]
        [--plan-model llama-3-8b --plan-gpu h200-141gb] [--json FILE]

One `LLMEngine` serves every batch size in turn (`max_num_seqs` = the largest batch). Per batch size,
`batch` requests of `input_len` random token ids (numpy seed 0) and exactly `output_len` output tokens
(`ignore_eos`, greedy) are added at once and the engine steps until all finish. Reported:

- output tok/s: output tokens over the wall time from the first step to the last (prefill included);
- decode step: the median wall time of steps in which every one of the `batch` sequences computes one
  token (seconds; `LLMEngine.step` returns after sampling, so the device has finished the step);
- the bandwidth floor of such a step: the bytes it must read at least once, i.e. every weight (the
  input embedding only for looked-up rows, so an untied embedding table is left out) plus the K/V of
  every context token (`batch x mean context x kv_bytes_per_token`), over the device's copy bandwidth
  measured in the same run (read + write of a large buffer); floor tok/s = batch / floor time, and the
  engine's decode tok/s as a fraction of it;
- the KV pool the engine chose at start (bytes, blocks) and, with `--plan-model/--plan-gpu`, the pool
  `conveyor plan` computes for that GPU at the same `gpu_memory_utilization` (their ratio).

The same code runs on CPU (tests use a tiny shape); the targets it reports against are for CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from conveyor.benchmarks.kernels import measure_copy_gbs

GiB = 1 << 30


@dataclass
class BatchResult:
    """One batch size. Times in seconds, rates in tokens/s, bytes in bytes."""

    batch: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    num_steps: int
    num_decode_steps: int
    decode_step_s: float
    decode_tok_s: float
    floor_bytes: float
    floor_step_s: float
    floor_tok_s: float
    fraction_of_floor: float


@dataclass
class OfflineReport:
    device: str
    dtype: str
    model: str
    start_s: float
    weight_bytes: int
    kv_bytes_per_token: int
    kv_pool_bytes: int
    num_kv_blocks: int
    planned_kv_pool_bytes: int | None
    copy_gbs: float
    batches: list[BatchResult]
    model_impl: str = "native"  # the implementation that ran (`--model-impl`'s choice)


def wall_clock_median(fn, repeats: int = 10) -> float:
    """Median wall time of `fn` in milliseconds over `repeats` runs after one warm-up, the device
    synchronized around each (a `kernels.py` timer that needs no triton and works on CPU)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats + 1):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def weight_bytes_read_per_step(shape, dtype: torch.dtype, model: torch.nn.Module | None = None) -> int:
    """Bytes of the weights one forward pass reads: every parameter of the model's shape, less an
    untied input embedding table (a lookup reads only the batch's rows). Counted on the meta device for
    conveyor's decoder; for transformers' own (`model`, `--model-impl transformers`) its parameters."""
    from conveyor.server.model.models.llama import LlamaForCausalLM, ModelShape

    if not isinstance(shape, ModelShape):
        hf = model.hf  # TransformersForCausalLM's transformers model
        embed = hf.get_input_embeddings().weight
        count = sum(p.numel() for p in hf.parameters())  # a tied table is one parameter, counted once
        if hf.get_output_embeddings().weight is not embed:
            count -= embed.numel()
        return count * torch.empty((), dtype=dtype).element_size()
    with torch.device("meta"):
        model = LlamaForCausalLM(shape, ops=None)
    count = sum(p.numel() for p in model.parameters())
    if not shape.tie_word_embeddings:
        count -= model.embed_tokens.weight.numel()
    return count * torch.empty((), dtype=dtype).element_size()


def run_batch(engine, batch: int, input_len: int, output_len: int, vocab_size: int) -> tuple[float, list]:
    """Add `batch` requests and step until they finish. Returns (wall seconds, [(step seconds,
    tokens per scheduled sequence)] per step)."""
    from conveyor.server.messages import SamplingParams

    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        prompt = rng.integers(0, vocab_size, input_len).tolist()
        engine.add_request(engine.make_request(f"b{batch}-{i}", prompt, params))
    steps = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        record = engine.stats.recent_steps[-1]
        steps.append((time.perf_counter() - t0, [n for _, n in record.scheduled]))
    return time.perf_counter() - start, steps


def run(args: argparse.Namespace) -> OfflineReport:
    from conveyor.server.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
    from conveyor.server.engine.builder import build_engine
    from conveyor.server.model.models.transformers_impl import TransformersForCausalLM

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    cache = {"gpu_memory_utilization": args.gpu_memory_utilization}
    if args.kv_cache_memory:
        cache["kv_cache_memory"] = args.kv_cache_memory
    config = EngineConfig(
        model=ModelConfig(
            model=args.model,
            load_format=args.load_format,
            dtype=args.dtype,
            max_model_len=args.input_len + args.output_len,
            model_impl=args.model_impl,
        ),
        cache=CacheConfig(**cache),
        scheduler=SchedulerConfig(max_num_seqs=max(batch_sizes)),
        device=DeviceConfig(device=args.device),
    )
    start = time.perf_counter()
    engine = build_engine(config)
    start_s = time.perf_counter() - start
    shape = engine.model.shape
    weights = weight_bytes_read_per_step(shape, engine.dtype, engine.model)
    copy_gbs = measure_copy_gbs(engine.device, wall_clock_median)
    planned = _planned_pool_bytes(args, str(engine.dtype).removeprefix("torch."))
    results = []
    for batch in batch_sizes:
        wall, steps = run_batch(engine, batch, args.input_len, args.output_len, shape.vocab_size)
        decode = [t for t, tokens in steps if len(tokens) == batch and all(n == 1 for n in tokens)]
        decode_s = statistics.median(decode) if decode else float("nan")
        floor_bytes = weights + batch * (args.input_len + args.output_len / 2) * engine.kv_bytes_per_token
        floor_s = floor_bytes / (copy_gbs * 1e9)
        results.append(
            BatchResult(
                batch=batch,
                output_tokens=batch * args.output_len,
                wall_s=wall,
                output_tok_s=batch * args.output_len / wall,
                num_steps=len(steps),
                num_decode_steps=len(decode),
                decode_step_s=decode_s,
                decode_tok_s=batch / decode_s,
                floor_bytes=floor_bytes,
                floor_step_s=floor_s,
                floor_tok_s=batch / floor_s,
                fraction_of_floor=floor_s / decode_s,
            )
        )
    name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    return OfflineReport(
        device=name,
        dtype=str(engine.dtype).removeprefix("torch."),
        model=args.model or "embedded",
        start_s=start_s,
        weight_bytes=weights,
        kv_bytes_per_token=engine.kv_bytes_per_token,
        kv_pool_bytes=engine.kv_pool_bytes,
        num_kv_blocks=engine.num_kv_blocks,
        planned_kv_pool_bytes=planned,
        copy_gbs=copy_gbs,
        batches=results,
        model_impl="transformers" if isinstance(engine.model, TransformersForCausalLM) else "native",
    )


def _planned_pool_bytes(args: argparse.Namespace, dtype: str) -> int | None:
    if not (args.plan_model and args.plan_gpu):
        return None
    from conveyor.operator.plan import plan_for_spec
    from conveyor.operator.spec import InferenceServiceSpec

    spec = InferenceServiceSpec.model_validate(
        {
            "model": {
                "name": args.plan_model,
                "dtype": dtype,
                "maxModelLen": args.input_len + args.output_len,
            },
            "resources": {"gpuType": args.plan_gpu},
            "engine": {"gpuMemoryUtilization": args.gpu_memory_utilization},
        }
    )
    return plan_for_spec(spec).capacity.kv_pool_bytes


def format_report(report: OfflineReport) -> str:
    """The report as markdown: one line of context, the KV pool, and one table row per batch size."""
    lines = [
        f"{report.device}, {report.model} ({report.model_impl} implementation), {report.dtype}: engine start {report.start_s:.1f} s, weights read "
        f"per step {report.weight_bytes / GiB:.2f} GiB, {report.kv_bytes_per_token:,} KV bytes/token, "
        f"copy bandwidth {report.copy_gbs:.0f} GB/s (read + write).",
        "",
        f"KV pool chosen at start: {report.kv_pool_bytes / GiB:.2f} GiB ({report.num_kv_blocks:,} blocks)"
        + (
            f"; `conveyor plan`: {report.planned_kv_pool_bytes / GiB:.2f} GiB "
            f"(ratio {report.kv_pool_bytes / report.planned_kv_pool_bytes:.3f})."
            if report.planned_kv_pool_bytes
            else "."
        ),
        "",
        "| batch | output tok/s | steps (decode) | decode step ms | decode tok/s | floor step ms | floor tok/s "
        "| % of floor |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report.batches:
        lines.append(
            f"| {r.batch} | {r.output_tok_s:,.1f} | {r.num_steps} ({r.num_decode_steps}) | "
            f"{r.decode_step_s * 1e3:.2f} | {r.decode_tok_s:,.0f} | {r.floor_step_s * 1e3:.2f} | "
            f"{r.floor_tok_s:,.0f} | {100 * r.fraction_of_floor:.0f}% |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conveyor.benchmarks.offline", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "model", nargs="?", default=None, help="model directory (default: the embedded model)"
    )
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    parser.add_argument(
        "--model-impl", choices=["auto", "native", "transformers"], default="auto", help="as conveyor serve's"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--batch-sizes", default="1,16,64,256", help="comma-separated")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--kv-cache-memory", type=int, default=None, help="KV pool bytes (CPU; CUDA profiles)"
    )
    parser.add_argument("--plan-model", default=None, help="catalog model to compare the KV pool with")
    parser.add_argument("--plan-gpu", default=None, help="catalog GPU type of that plan (h200-141gb)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = run(args)
    except ValueError as exc:  # bad model, dtype, or a KV pool too small for the batch
        print(f"conveyor.benchmarks.offline: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
