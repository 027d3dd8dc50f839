"""Multi-LoRA throughput: traffic spread over 1, 4 and 16 adapters against base-model-only traffic on the
same engine, at ranks 8 and 64.

    python -m conveyor.benchmarks.lora [--ranks 8 64] [--adapters 1 4 16] [--sequences 16] [--json FILE]
        [--model llama-3.2-1b]

The embedded model (SmolLM2-135M-Instruct, float32, or `--dtype`) with adapters made by `peft` on its
seven projections (random A and B); or `--model`, a catalog model (or a directory with a config.json)
served with random weights (`--load-format dummy`) and adapters of its shape written directly in PEFT's
format (random A and B), where the adapters' share of the bytes a step reads is that of a real model. Each configuration runs one engine with `--max-loras` as large as
the number of adapters (so no request waits for a slot) and `--max-num-seqs` = sequences: the requests
(twice `--sequences` of them, 32-token prompts, `--tokens` tokens each, greedy, EOS ignored) go to
the adapters in turn, and the base-only row runs the same requests on the same engine without an
adapter. Reported: output tokens per second over the whole run (prefills included), the median decode
step, and each configuration's throughput over base-only's in the same run (the issue's target: >= 0.8x
with 16 adapters at 16 sequences).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(directory: Path, ranks: list[int], count: int) -> dict[int, list[str]]:
    """`count` PEFT adapters of each rank on the embedded model, saved under `directory`: rank ->
    directories."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from conveyor.server.model.loader import converted, resolve_model

    base = AutoModelForCausalLM.from_pretrained(converted(resolve_model(None)).path, dtype=torch.float32)
    made: dict[int, list[str]] = {}
    for rank in ranks:
        made[rank] = []
        for i in range(count):
            torch.manual_seed(1000 * rank + i)
            config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
            path = directory / f"r{rank}-{i}"
            get_peft_model(copy.deepcopy(base), config).save_pretrained(str(path))
            made[rank].append(str(path))
    return made


def synthetic_adapters(directory: Path, model_dir: str, ranks: list[int], count: int) -> dict[int, list[str]]:
    """`count` PEFT adapters of each rank on the seven projections of the model in `model_dir` (its
    config.json), random A and B, written without peft (a model of billions of parameters need not be
    built): rank -> directories."""
    from safetensors.torch import save_file

    from conveyor.server.model.loader import ModelSource, load_config
    from conveyor.server.model.lora import projection_dims
    from conveyor.server.model.models.llama import ModelShape

    shape = ModelShape.from_hf_config(load_config(ModelSource(model_dir, None, "model")))
    dims = projection_dims(shape)
    made: dict[int, list[str]] = {}
    for rank in ranks:
        made[rank] = []
        for i in range(count):
            generator = torch.Generator().manual_seed(1000 * rank + i)
            tensors = {}
            for layer in range(shape.num_layers):
                for module, (fan_in, fan_out) in dims.items():
                    owner = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                    key = f"base_model.model.model.layers.{layer}.{owner}.{module}.lora_{{}}.weight"
                    tensors[key.format("A")] = torch.randn(rank, fan_in, generator=generator) * fan_in**-0.5
                    tensors[key.format("B")] = torch.randn(fan_out, rank, generator=generator) * 0.01
            path = directory / f"r{rank}-{i}"
            path.mkdir(parents=True)
            config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
            (path / "adapter_config.json").write_text(json.dumps(config))
            save_file(tensors, str(path / "adapter_model.safetensors"))
            made[rank].append(str(path))
    return made


def run(engine, names: list[str | None], requests: int, tokens: int) -> tuple[float, float]:
    """(output tokens per second over the run, median decode step in seconds) of `requests` requests
    over `names` in turn (None: the base model)."""
    from conveyor.server.messages import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    for i in range(requests):
        prompt = [100 + 7 * i + j for j in range(32)]
        name = names[i % len(names)]
        engine.add_request(engine.make_request(f"{i}-{time.monotonic_ns()}", prompt, params, lora_name=name))
    decode_steps = []
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        engine.step()
        if not any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
            decode_steps.append(time.perf_counter() - step_start)
    return requests * tokens / (time.perf_counter() - start), statistics.median(decode_steps)


def measure(
    adapters: dict[int, list[str]],
    counts: list[int],
    sequences: int,
    tokens: int,
    dtype: str,
    model_dir: str | None = None,
) -> dict:
    """One row per rank and adapter count (`model_dir`: a model folder served with random weights,
    None: the embedded model)."""
    from conveyor.server.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
    from conveyor.server.engine.builder import build_engine

    rows = []
    for rank, paths in adapters.items():
        for count in counts:
            modules = [f"a{i}={paths[i]}" for i in range(count)]
            config = EngineConfig(
                model=ModelConfig(
                    model=model_dir,
                    load_format="dummy" if model_dir else "auto",
                    dtype=dtype,
                    max_model_len=512,
                ),
                cache=CacheConfig(kv_cache_memory=1 << 30),
                scheduler=SchedulerConfig(max_num_seqs=sequences),
                lora=LoRAConfig(enable_lora=True, lora_modules=modules, max_loras=count, max_lora_rank=rank),
            )
            engine = build_engine(config)
            run(engine, [None], sequences, 4)  # warm-up (and the kernel tables)
            run(engine, [f"a{i}" for i in range(count)], sequences, 4)
            base, base_step = run(engine, [None], 2 * sequences, tokens)
            lora, lora_step = run(engine, [f"a{i}" for i in range(count)], 2 * sequences, tokens)
            engine.close()
            rows.append(
                {
                    "rank": rank,
                    "adapters": count,
                    "base_tokens_per_s": base,
                    "lora_tokens_per_s": lora,
                    "base_step_ms": base_step * 1e3,
                    "lora_step_ms": lora_step * 1e3,
                    "lora_over_base": lora / base,
                }
            )
    return {
        "threads": torch.get_num_threads(),
        "sequences": sequences,
        "tokens": tokens,
        "dtype": dtype,
        "rows": rows,
    }


def table(result: dict) -> str:
    lines = [
        f"Multi-LoRA on {result.get('model') or 'SmolLM2-135M'} ({result['dtype']}, {result['sequences']} sequences, {result['tokens']} "
        f"tokens each, {result['threads']} threads)",
        "| rank | adapters | base-only tok/s | LoRA tok/s | LoRA / base | decode step base ms | LoRA ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['rank']} | {r['adapters']} | {r['base_tokens_per_s']:.1f} | {r['lora_tokens_per_s']:.1f} | "
            f"{r['lora_over_base']:.2f}x | {r['base_step_ms']:.1f} | {r['lora_step_ms']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.benchmarks.lora", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--ranks", nargs="+", type=int, default=[8, 64])
    parser.add_argument(
        "--adapters", nargs="+", type=int, default=[1, 4, 16], help="adapters the traffic spreads over"
    )
    parser.add_argument("--sequences", type=int, default=16, help="concurrent sequences (--max-num-seqs)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument(
        "--model", help="a catalog model (e.g. llama-3.2-1b) or a folder with a config.json, random weights"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = None
        if args.model:
            model_dir = args.model if Path(args.model).is_dir() else str(Path(scratch) / "model")
            if not Path(args.model).is_dir():
                from conveyor.operator import plan

                with contextlib.redirect_stdout(io.StringIO()):  # it prints the path written
                    if plan.main(["--model", args.model, "--write-config", model_dir]) != 0:
                        return 2
            adapters = synthetic_adapters(
                Path(scratch) / "adapters", model_dir, args.ranks, max(args.adapters)
            )
        else:
            adapters = make_adapters(Path(scratch), args.ranks, max(args.adapters))
        result = measure(adapters, args.adapters, args.sequences, args.tokens, args.dtype, model_dir)
    result["model"] = args.model
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
