"""A mixture-of-experts model against the dense model of the same active width, and an MoE step's time.

    python -m conveyor.benchmarks.moe [--dtypes float32 bfloat16] [--tokens 24] [--json FILE]

Two configs with random weights (`--load-format dummy`), served in-process with the kernels chosen by
measurement as a server chooses them: a Qwen3-MoE of 12 layers, hidden size 1024, 16 experts of
intermediate size 1024 with 2 chosen per token (every layer sparse), and the dense Qwen3 with the
same attention and an MLP of intermediate size 2048, the two chosen experts' width, so both compute
the same multiply-adds per token. At one sequence a decode step reads the two experts' weights per
layer (the dense model's MLP bytes); at 16 sequences the tokens spread over up to all 16 experts, so
the MoE step reads up to 8x the MLP bytes. Reported per dtype: tokens per second (from the median
decode step) at 1 and 16 sequences, the dense-over-MoE throughput ratio, and the MoE step split into the router (logits, softmax, top-k), the experts (`fused_moe`: the sort by expert,
the expert matmuls and the weighted combine, one C++ call) and the rest (attention, norms, LM head,
sampling, scheduling).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from conveyor.benchmarks.quantized import step_times

SEQUENCES = (1, 16)
COMMON = {
    "hidden_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
}
CONFIGS = {
    "moe": {
        **COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": 2048,
        "moe_intermediate_size": 1024,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "dense": {
        **COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": 2048,
    },
}


class Timers:
    """Seconds spent in every sparse layer's router and `fused_moe` while `on` (wrapped in place)."""

    def __init__(self, model) -> None:
        from conveyor.server.model.models.llama import SparseMoE

        self.seconds = {"router": 0.0, "experts": 0.0}
        self.on = False
        for module in model.modules():
            if isinstance(module, SparseMoE):
                module.route = self._timed("router", module.route)
                module.fused_moe = self._timed("experts", module.fused_moe or module.ops.fused_moe)

    def _timed(self, name: str, fn):
        def call(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            return out

        return call


def measure(directory: Path, dtypes: list[str], tokens: int) -> dict:
    from conveyor.server.config import CacheConfig, EngineConfig, ModelConfig
    from conveyor.server.engine.builder import build_engine

    rows = []
    for dtype in dtypes:
        row: dict = {"dtype": dtype}
        for kind in CONFIGS:
            model = ModelConfig(
                model=str(directory / kind), load_format="dummy", dtype=dtype, max_model_len=512
            )
            engine = build_engine(EngineConfig(model=model, cache=CacheConfig(kv_cache_memory=256 << 20)))
            step_times(engine, 1, 4)  # warm-up
            timers = Timers(engine.model) if kind == "moe" else None
            for sequences in SEQUENCES:
                if timers is not None:
                    timers.seconds = dict.fromkeys(timers.seconds, 0.0)
                    timers.on = True
                start = time.perf_counter()
                seconds = step_times(engine, sequences, tokens)
                total = time.perf_counter() - start
                row[f"{kind}_step_ms_{sequences}"] = seconds * 1e3
                row[f"{kind}_tokens_per_s_{sequences}"] = sequences / seconds
                if timers is not None:
                    timers.on = False
                    row[f"split_{sequences}"] = {name: s / total for name, s in timers.seconds.items()}
            engine.close()
        for sequences in SEQUENCES:
            row[f"dense_over_moe_{sequences}"] = (
                row[f"dense_tokens_per_s_{sequences}"] / row[f"moe_tokens_per_s_{sequences}"]
            )
        rows.append(row)
    return {"threads": torch.get_num_threads(), "configs": CONFIGS, "rows": rows}


def table(result: dict) -> str:
    lines = [
        f"MoE 16 experts top-2 vs dense, 12 layers, hidden 1024 ({result['threads']} threads)",
        "| dtype | sequences | dense tok/s | MoE tok/s | dense / MoE | MoE time: router | experts | rest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        for n in SEQUENCES:
            split = r[f"split_{n}"]
            rest = 1 - split["router"] - split["experts"]
            lines.append(
                f"| {r['dtype']} | {n} | {r[f'dense_tokens_per_s_{n}']:.1f} | {r[f'moe_tokens_per_s_{n}']:.1f} | "
                f"{r[f'dense_over_moe_{n}']:.2f}x | {100 * split['router']:.0f} % | "
                f"{100 * split['experts']:.0f} % | {100 * rest:.0f} % |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.benchmarks.moe", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    parser.add_argument("--tokens", type=int, default=24, help="tokens each sequence decodes")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        for kind, config in CONFIGS.items():
            (directory / kind).mkdir()
            (directory / kind / "config.json").write_text(json.dumps(config))
        result = measure(directory, args.dtypes, args.tokens)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
