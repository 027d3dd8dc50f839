"""Where an engine step's time goes: a per-step breakdown of the in-process engine on a workload.

    python -m conveyor.benchmarks.step_profile [--dtype auto] [--workload FILE] [--num-requests 64]
        [--max-num-seqs 16] [--tensor-parallel-size 1] [--json FILE]

One `LLMEngine` on the embedded model serves the requests of a `make bench` workload file (the main
workload of the newest results folder by default: token-id prompts, exact output lengths) with every
request added at once, as the offline benchmark does, after a warm-up batch (the first requests' prompts
reversed, so nothing of the measured prompts is in the prefix cache). Each step's wall time is
split two ways:

- by stage, timed around the engine's own calls (`time.perf_counter`): schedule, prepare_inputs (the
  runner's batch building), forward (the model), sample, update + output processing (the scheduler's
  update, detokenizing, stop checks);
- the forward stage by operator, from `torch.profiler`'s self CPU time of every aten/custom op over the
  same steps: matmuls (`aten::mm/addmm/linear`, oneDNN's packed linear, the C++ backend's linear), the
  C++ layer loop's own kernels (attention, norms, rotary, SiLU-and-mul, KV writes: one op to the
  profiler), attention (the paged-attention kernels and SDPA), other kernels (RMSNorm, rotary, SiLU-and-mul, embedding, KV writes),
  collectives (tensor parallelism), and the rest of the op time; what the profiler does not see inside
  `forward` (Python between ops) is "Python in forward". Profiled steps are slower than unprofiled
  ones, so the by-operator split is reported as fractions of the profiled forward (a second pass over
  the same requests, prompts rotated by one token so that none is in the prefix cache), applied to
  the unprofiled forward time.

HTTP, tokenization and streaming are outside the engine: `make bench`'s served numbers against this
offline rate show their cost. Output: a table (ms per step and % of the step) and, with `--json`, the
same numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

# Self CPU time of these ops is the forward's "matmul", "attention", ... share (first match wins).
OP_CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    ("collectives", re.compile(r"^(c10d::|gloo|nccl|record_param_comms)")),
    (
        "matmul",
        re.compile(
            r"^(aten::(mm|addmm|bmm|linear|matmul)|mkldnn::_linear_pointwise|conveyor_linear::linear)$"
        ),
    ),
    # The C++ layer loop's own time: attention, norms, rotary, SiLU-and-mul and KV writes called directly
    # from C++ (csrc/decoder.cpp), so the profiler sees them as one op; its matmuls still show as matmuls.
    ("layer loop kernels", re.compile(r"^conveyor_decoder::")),
    (
        "attention",
        re.compile(r"(paged_decode_attention|scaled_dot_product|_flash_attention|attention)", re.IGNORECASE),
    ),
    (
        "other kernels",
        re.compile(r"(rms_norm|rotary|silu|embedding|reshape_and_cache|index_select|index_copy)"),
    ),
]
FORWARD_SCOPE = "conveyor::forward"
STAGES = ("schedule", "prepare_inputs", "forward", "sample", "update + outputs")


def _category(op: str) -> str:
    for name, pattern in OP_CATEGORIES:
        if pattern.search(op):
            return name
    return "other ops"


class StageTimer:
    """Wall seconds spent in each stage of the engine's step, by wrapping the engine's own calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner, attr: str, stage: str, scope: str | None = None) -> None:
        """Replace `owner.attr` by a timed call; with `scope`, also a `torch.profiler` range of that name."""
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                if scope is None:
                    return inner(*args, **kwargs)
                with torch.profiler.record_function(scope):
                    return inner(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - start

        setattr(owner, attr, timed)


def instrument(engine) -> StageTimer:
    """Time the stages of `engine.step` (schedule -> prepare_inputs -> forward -> sample -> update and
    outputs) without changing what it does."""
    from conveyor.server.model import runner as runner_module

    timer = StageTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner, "prepare_inputs", "prepare_inputs")
    timer.wrap(engine.runner, "forward", "forward", scope=FORWARD_SCOPE)
    timer.wrap(runner_module, "sample", "sample")
    timer.wrap(engine.scheduler, "update_from_output", "update + outputs")
    timer.wrap(engine.output_processor, "process", "update + outputs")
    return timer


def _run(engine, samples, tag: str) -> tuple[int, int, float]:
    """All `samples` at once, stepped to the end. Returns (steps, output tokens, wall seconds)."""
    from conveyor.server.messages import SamplingParams

    for i, sample in enumerate(samples):
        params = SamplingParams(temperature=0.0, max_tokens=sample.output_len, ignore_eos=True)
        engine.add_request(engine.make_request(f"{tag}-{i}", list(sample.prompt), params))
    steps = tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
        steps += 1
    return steps, tokens, time.perf_counter() - start


def _forward_op_times(events) -> dict[str, float]:
    """Self CPU microseconds of the ops under each `FORWARD_SCOPE` range, by category, plus the time of
    those ranges no op accounts for ("Python in forward")."""
    totals: dict[str, float] = defaultdict(float)
    for scope in (e for e in events if e.name == FORWARD_SCOPE):
        pending = list(scope.cpu_children)
        while pending:
            event = pending.pop()
            totals[_category(event.name)] += event.self_cpu_time_total
            pending.extend(event.cpu_children)
        totals["Python in forward"] += scope.self_cpu_time_total
    return dict(totals)


@contextmanager
def _profiled():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield prof


def profile_engine(engine, samples, warmup) -> dict:
    """The breakdown of `engine` serving `samples` (after serving `warmup`): see the module docstring."""
    _run(engine, warmup, "warmup")
    timer = instrument(engine)
    steps, tokens, wall = _run(engine, samples, "timed")
    stage_ms = {stage: timer.seconds[stage] * 1e3 / steps for stage in STAGES}
    step_ms = wall * 1e3 / steps
    stage_ms["engine other"] = max(0.0, step_ms - sum(stage_ms.values()))

    timer.seconds.clear()
    # The timed prompts are in the prefix cache now: the profiled pass serves them rotated by one token
    # (same lengths, no shared first block), so its prefills run as the timed pass's did.
    rotated = [dataclasses.replace(s, prompt=s.prompt[1:] + s.prompt[:1]) for s in samples]
    with _profiled() as prof:
        _run(engine, rotated, "profiled")
    forward_ops = _forward_op_times(prof.events())
    forward_total = sum(forward_ops.values()) or 1.0
    forward_ms = {k: stage_ms["forward"] * v / forward_total for k, v in forward_ops.items()}
    return {
        "steps": steps,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "step_ms": step_ms,
        "stages_ms": stage_ms,
        "forward_ms": forward_ms,
    }


def format_breakdown(report: dict, header: str) -> str:
    step = report["step_ms"]
    lines = [
        header,
        f"{report['steps']} steps, {report['output_tokens']} output tokens, "
        f"{report['output_tok_s']:.1f} output tok/s, {step:.1f} ms per step",
        "",
        "| part of a step | ms per step | % of step |",
        "|---|---|---|",
    ]
    for stage, ms in report["stages_ms"].items():
        lines.append(f"| {stage} | {ms:.2f} | {100 * ms / step:.1f} % |")
        if stage == "forward":
            for part, part_ms in sorted(report["forward_ms"].items(), key=lambda kv: -kv[1]):
                lines.append(f"| - forward: {part} | {part_ms:.2f} | {100 * part_ms / step:.1f} % |")
    return "\n".join(lines)


def _cpu_flags() -> str:
    try:
        flags = set(re.findall(r"\b(avx2|avx512f|avx512_bf16|amx_tile)\b", Path("/proc/cpuinfo").read_text()))
    except OSError:
        return "unknown CPU flags"
    return ", ".join(sorted(flags)) or "no AVX2"


def _default_workload() -> Path:
    results = Path(__file__).resolve().parent / "results"
    folders = sorted(p for p in results.iterdir() if (p / "workload_main.jsonl").exists())
    if not folders:
        raise FileNotFoundError(
            f"no results folder with workload_main.jsonl under {results}; pass --workload"
        )
    return folders[-1] / "workload_main.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.benchmarks.step_profile", description=__doc__)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--workload", type=Path, default=None, help="JSONL of token-id prompts")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)

    from conveyor.benchmarks.datasets import load_jsonl
    from conveyor.server.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from conveyor.server.engine.builder import build_engine
    from conveyor.server.engine.tuning import freeze_startup_heap

    samples = load_jsonl(args.workload or _default_workload(), args.num_requests)
    if any(not isinstance(s.prompt, list) for s in samples):
        print("step_profile: the workload must hold token-id prompts", file=sys.stderr)
        return 2
    max_model_len = max(s.prompt_len + s.output_len for s in samples)
    engine = build_engine(
        EngineConfig(
            model=ModelConfig(dtype=args.dtype, max_model_len=max(max_model_len, 256)),
            cache=CacheConfig(kv_cache_memory=1 << 30),
            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs),
            parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
        )
    )
    try:
        # Warm-up prompts reversed: the same lengths, but no prefix the measured requests could find in the
        # prefix cache (which would skip their prefill and overstate the rate).
        warmup = [
            dataclasses.replace(s, prompt=s.prompt[::-1])
            for s in samples[: min(len(samples), args.max_num_seqs)]
        ]
        freeze_startup_heap()  # as the server does when its engine starts
        report = profile_engine(engine, samples, warmup)
    finally:
        engine.close()
    dtype = str(engine.dtype).removeprefix("torch.")
    report.update(
        dtype=dtype,
        threads=torch.get_num_threads(),
        cpu_flags=_cpu_flags(),
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    header = (
        f"step breakdown: {len(samples)} requests, max_num_seqs {args.max_num_seqs}, {dtype}, "
        f"TP {args.tensor_parallel_size}, {report['threads']} threads, CPU: {report['cpu_flags']}"
    )
    print(format_breakdown(report, header))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
