"""The per-step cost of structured output: the same batch through the in-process engine free, under a
regex and under a JSON schema, in one run.

    python -m conveyor.benchmarks.structured [--dtype auto] [--batch 16] [--output-len 64] [--json FILE]

One `LLMEngine` on the embedded model (`--max-num-seqs` = batch) serves each mode in turn: `batch`
chat-templated prompts added at once, sampled at temperature 0.8 with seed i for request i (so outputs
differ between rows), at most `output_len` tokens each, `ignore_eos`. A warm-up batch of each mode runs
first, so grammar compilation (cached per spec) is not timed. Reported per mode: output tokens, wall
seconds, output tok/s, the median step time (seconds), and tok/s as a ratio to the free mode's. A
constraint may end an output early (a grammar decides when the output may end), so the step time is
the like-for-like number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

MODES: dict[str, tuple[str, str] | None] = {
    "free": None,
    "regex": ("regex", r"[A-Za-z ,.]{1,400}"),
    "json_schema": (
        "json",
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
                },
                "required": ["name", "age", "tags"],
            }
        ),
    ),
}
PROMPT = "Describe a person you admire, as JSON with name, age and tags. Person {i}:"


@dataclass
class ModeResult:
    """One mode. Seconds, tokens, tokens/s."""

    mode: str
    output_tokens: int
    wall_s: float
    output_tok_s: float
    median_step_s: float
    texts: list[str]
    tok_s_vs_free: float = 1.0


def run_mode(engine, mode: str, batch: int, output_len: int, tag: str) -> ModeResult:
    """Add `batch` requests constrained as `mode` (a key of MODES) and step until all finish."""
    from conveyor.server.messages import SamplingParams, StructuredOutputParams

    constraint = MODES[mode]
    so = StructuredOutputParams(constraint[0], constraint[1], "bench") if constraint else None
    for i in range(batch):
        messages = [{"role": "user", "content": PROMPT.format(i=i)}]
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        params = SamplingParams(
            temperature=0.8, seed=i, max_tokens=output_len, ignore_eos=True, structured_output=so
        )
        engine.add_request(engine.make_request(f"{tag}-{mode}-{i}", list(prompt), params))
    tokens, steps = 0, []
    texts = [""] * batch
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - t0)
        for out in outputs:
            tokens += len(out.new_token_ids)
            texts[int(out.request_id.rsplit("-", 1)[1])] += out.new_text
    wall = time.perf_counter() - start
    return ModeResult(mode, tokens, wall, tokens / wall, statistics.median(steps), texts)


def run(args: argparse.Namespace) -> list[ModeResult]:
    from conveyor.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from conveyor.server.engine.builder import build_engine

    engine = build_engine(
        EngineConfig(
            model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=1024),
            cache=CacheConfig(kv_cache_memory=args.batch * 1024 * 64 * 1024),
            scheduler=SchedulerConfig(max_num_seqs=args.batch),
        )
    )
    for mode in MODES:  # warm-up: compiles each grammar and touches the KV pages
        run_mode(engine, mode, args.batch, min(8, args.output_len), "warmup")
    results = [run_mode(engine, mode, args.batch, args.output_len, "run") for mode in MODES]
    free = results[0].output_tok_s
    for result in results:
        result.tok_s_vs_free = result.output_tok_s / free
    print(f"dtype {engine.dtype}, batch {args.batch}, output_len {args.output_len}, torch threads "
          f"{__import__('torch').get_num_threads()}")  # fmt: skip
    for r in results:
        print(
            f"{r.mode:12s} {r.output_tokens:6d} tokens {r.wall_s:7.2f} s {r.output_tok_s:8.1f} tok/s "
            f"step {r.median_step_s * 1e3:7.1f} ms  {r.tok_s_vs_free:.2f}x free"
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="conveyor.benchmarks.structured", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    results = run(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump([asdict(r) for r in results], out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
