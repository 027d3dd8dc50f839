"""Quantized weights' quality against the float32 model: next-token KL divergence and top-1 agreement.

    python -m conveyor.benchmarks.quality [--json FILE]

The embedded SmolLM2-135M-Instruct, served in-process four ways, reads a fixed set of texts (prose,
code, a dialogue, a list; `TEXTS`) in one prefill each. At every position the next-token distribution
is compared with transformers' float32 model of the same file (the GGUF dequantized, the reference the
serving tests use): the mean KL divergence KL(reference || ours) in nats, and the share of positions
whose most likely token is the reference's. Rows:

- `gguf`: the file's Q4_1 / Q8_0 blocks, exact kernels (`q-dot`, `q-dequant`): the weights are the
  reference's values, only float32 summation order differs;
- `gguf, int8 activations`: the same blocks with `q-int8` (x rounded to int8 per 32 values);
- `int8`: the float32 weights quantized at load per output channel (`--quantization int8`), exact kernels;
- `int8, int8 activations`: those with `q-int8`.

A server picks each layer's method by measurement, so its quality is between a row and its int8-activation
row. `make bench` adds this table to its report; `tests/integration/test_quantization_quality.py` holds
each row inside its stated bound.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

# Fixed texts, one prefill each (about 500 tokens together).
TEXTS = (
    "The river rose through the night, and by morning the lower streets of the town were under water. "
    "People carried what they could to the church on the hill, where the priest had opened the doors and "
    "lit the stoves. Nobody spoke much; the children slept on the pews while their parents listened to "
    "the rain on the roof and waited for the boats that the mayor had promised.",
    "def merge_sorted(left: list[int], right: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list."""\n'
    "    out, i, j = [], 0, 0\n"
    "    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n"
    "            out.append(left[i])\n"
    "            i += 1\n"
    "        else:\n"
    "            out.append(right[j])\n"
    "            j += 1\n"
    "    return out + left[i:] + right[j:]\n",
    "User: Can you explain why the sky is blue?\nAssistant: Sunlight is made of many colors. When it "
    "passes through the atmosphere, the short blue wavelengths are scattered by the molecules of the air "
    "much more than the long red ones, so blue light reaches our eyes from every direction of the sky.\n"
    "User: Then why are sunsets red?\nAssistant:",
    "Shopping list for the week: 1. two loaves of rye bread 2. a dozen eggs 3. olive oil 4. tomatoes, "
    "onions and garlic 5. rice and lentils 6. green tea 7. apples and pears 8. a block of parmesan "
    "9. dishwasher tablets 10. batteries for the kitchen clock",
)

# Each row: (label, --quantization, CONVEYOR_CPU_KERNELS pinning its methods).
ROWS = (
    ("gguf", "gguf", "q-dot,q-dequant@9"),
    ("gguf, int8 activations", "gguf", "q-int8"),
    ("int8", "int8", "q-dot,q-dequant@9"),
    ("int8, int8 activations", "int8", "q-int8"),
)


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """Float32 logits `[len(ids), vocab_size]` of one prefill of `ids` through our `model` (a fresh
    KV cache of float32 blocks of 16)."""
    from conveyor.kernels import AttentionMetadata

    block_size, n = 16, len(ids)
    blocks = -(-n // block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
    )
    shape = (blocks, block_size, model.shape.num_kv_heads, model.shape.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.layers]
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta)).float()


def reference_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' next-token log-probabilities `[len(ids), vocab_size]` float32 for `ids`."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def compare(model, references: list[tuple[list[int], torch.Tensor]]) -> dict[str, float]:
    """Mean KL(reference || ours) in nats (float32 rounding can make an exact match a few 1e-9 below
    zero; the table shows 0) and top-1 agreement over every position of every text."""
    kl, agree, positions = 0.0, 0, 0
    for ids, truth in references:
        ours = torch.log_softmax(prefill_logits(model, ids), dim=-1)
        kl += (truth.exp() * (truth - ours)).sum(dim=-1).sum().item()
        agree += int((ours.argmax(-1) == truth.argmax(-1)).sum())
        positions += len(ids)
    return {"kl_nats": kl / positions, "top1_agreement": agree / positions, "positions": positions}


def measure(rows=ROWS) -> list[dict]:
    """One result per row of `rows`: label, quantization, kernels, weight summary, KL and agreement."""
    import os

    from transformers import AutoModelForCausalLM

    from conveyor.server.config import EngineConfig, ModelConfig
    from conveyor.server.engine.builder import build_engine
    from conveyor.server.model import loader

    source = loader.resolve_model(None)
    hf_model = AutoModelForCausalLM.from_pretrained(
        source.path, gguf_file=source.gguf_file, dtype=torch.float32
    ).eval()
    results, references = [], None
    for label, quantization, kernels in rows:
        previous = os.environ.get("CONVEYOR_CPU_KERNELS")
        os.environ["CONVEYOR_CPU_KERNELS"] = kernels
        try:
            engine = build_engine(EngineConfig(model=ModelConfig(dtype="float32", quantization=quantization)))
        finally:
            if previous is None:
                del os.environ["CONVEYOR_CPU_KERNELS"]
            else:
                os.environ["CONVEYOR_CPU_KERNELS"] = previous
        if references is None:
            texts = [engine.tokenizer(text)["input_ids"] for text in TEXTS]
            references = [(ids, reference_logprobs(hf_model, ids)) for ids in texts]
        result = {"label": label, "quantization": quantization, "kernels": kernels}
        result["weights"] = loader.describe_weights(engine.model)
        result.update(compare(engine.model, references))
        results.append(result)
        engine.close()
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| weights | kernels | mean KL vs float32 (nats) | top-1 agreement | positions |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['label']} | {r['kernels']} | {max(r['kl_nats'], 0.0):.2g} | {100 * r['top1_agreement']:.1f} % | "
            f"{r['positions']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.benchmarks.quality", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results = measure()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
