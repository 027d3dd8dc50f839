"""Serving-benchmark maths: per-request latencies, percentiles, goodput, input-length buckets,
static-batching padding waste and model-FLOPs utilisation.

Pure functions over plain numbers; no I/O, no clocks. Times are in seconds unless a name says ``_ms``.
Definitions follow vLLM's ``bench serve`` so that numbers are comparable:

- TTFT: request sent -> first streamed chunk received (queueing included).
- ITL: gap between two successive streamed chunks of one request.
- TPOT: ``(latency - ttft) / (output_tokens - 1)``, defined for requests with more than one output token.
- E2E latency: request sent -> last chunk received.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: Prompt-length buckets, the same labels as the server's ``input_length_bucket`` metric label.
#: A prompt of ``n`` tokens falls in the bucket whose ``[low, high)`` contains ``n``.
INPUT_LENGTH_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("0-512", 0, 512),
    ("512-2048", 512, 2048),
    ("2048+", 2048, None),
)

#: Percentiles reported for every latency, besides the mean and the median.
DEFAULT_PERCENTILES: tuple[float, ...] = (90.0, 99.0)

#: Goodput SLO keys accepted by ``--goodput`` (values in milliseconds).
SLO_KEYS: tuple[str, ...] = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request.

    Attributes:
        prompt_len: prompt length in tokens (as sent).
        output_len: generated tokens actually received (usage count, else chunk count).
        ttft_s: seconds from send to the first chunk.
        latency_s: seconds from send to the last chunk.
        itl_s: seconds between successive chunks, ``len = chunks - 1``.
        start_s: send time in seconds relative to the benchmark start.
        success: False when the request failed; failed requests count in no latency.
        error: the error text for a failed request.
    """

    prompt_len: int
    output_len: int
    ttft_s: float
    latency_s: float
    itl_s: tuple[float, ...] = ()
    start_s: float = 0.0
    success: bool = True
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, in seconds; None with fewer than 2 output tokens."""
        if self.output_len < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_len - 1)


@dataclass
class BenchmarkMetrics:
    """Aggregates of one benchmark run; latencies in milliseconds, throughputs per second."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2el_ms: dict[str, float | None]
    p99_by_bucket_ms: dict[str, dict[str, float | int | None]]
    goodput: float | None = None
    goodput_slo_ms: dict[str, float] = field(default_factory=dict)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks (numpy's default).

    Returns None for an empty sequence. Example: ``percentile([1, 2, 3, 4], 90) == 3.7``.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize_ms(
    values_s: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> dict[str, float | None]:
    """Mean, median, the given percentiles and the maximum of latencies given in seconds, in milliseconds.

    Keys: ``mean``, ``median``, ``p<q>`` (``p90``, ``p99``, ``p99.9``), ``max``. Values are None when
    ``values_s`` is empty.
    """
    ms = [v * 1000.0 for v in values_s]
    summary: dict[str, float | None] = {
        "mean": (sum(ms) / len(ms)) if ms else None,
        "median": percentile(ms, 50.0),
    }
    for q in percentiles:
        summary[f"p{q:g}"] = percentile(ms, q)
    summary["max"] = max(ms) if ms else None
    return summary


def input_length_bucket(prompt_len: int) -> str:
    """Label of the prompt-length bucket (``0-512``, ``512-2048``, ``2048+``) holding ``prompt_len`` tokens."""
    if prompt_len < 0:
        raise ValueError(f"prompt_len must be >= 0, got {prompt_len}")
    for label, low, high in INPUT_LENGTH_BUCKETS:
        if prompt_len >= low and (high is None or prompt_len < high):
            return label
    raise AssertionError("buckets cover [0, inf)")


def p99_by_bucket_ms(records: Iterable[RequestRecord]) -> dict[str, dict[str, float | int | None]]:
    """Per input-length bucket: request count and p99 of TTFT, TPOT, ITL and E2E latency in milliseconds.

    Every bucket label is present; an empty bucket has count 0 and None p99s. Failed requests are ignored.
    """
    grouped: dict[str, list[RequestRecord]] = {label: [] for label, _, _ in INPUT_LENGTH_BUCKETS}
    for record in records:
        if record.success:
            grouped[input_length_bucket(record.prompt_len)].append(record)
    result: dict[str, dict[str, float | int | None]] = {}
    for label, group in grouped.items():
        tpots = [r.tpot_s for r in group if r.tpot_s is not None]
        itls = [gap for r in group for gap in r.itl_s]
        result[label] = {
            "count": len(group),
            "ttft": _ms(percentile([r.ttft_s for r in group], 99.0)),
            "tpot": _ms(percentile(tpots, 99.0)),
            "itl": _ms(percentile(itls, 99.0)),
            "e2el": _ms(percentile([r.latency_s for r in group], 99.0)),
        }
    return result


def parse_goodput_slos(items: Sequence[str]) -> dict[str, float]:
    """Parse ``["ttft:500", "tpot:50"]`` into ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds).

    Raises ValueError on an unknown key, a missing colon or a negative or non-numeric value.
    """
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"goodput SLO must be KEY:MS with KEY in {SLO_KEYS}, got {item!r}")
        try:
            limit = float(value)
        except ValueError as err:
            raise ValueError(f"goodput SLO value must be a number of milliseconds, got {item!r}") from err
        if limit < 0:
            raise ValueError(f"goodput SLO must be >= 0 ms, got {item!r}")
        slos[key] = limit
    return slos


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """Whether a successful request met every SLO (``ttft``, ``tpot``, ``e2el`` in ms; ``<=`` passes).

    A request without a TPOT (one output token) passes a TPOT SLO.
    """
    if not record.success:
        return False
    measured_ms = {
        "ttft": record.ttft_s * 1000.0,
        "tpot": None if record.tpot_s is None else record.tpot_s * 1000.0,
        "e2el": record.latency_s * 1000.0,
    }
    for key, limit in slos_ms.items():
        value = measured_ms[key]
        if value is not None and value > limit:
            return False
    return True


def goodput(records: Sequence[RequestRecord], slos_ms: Mapping[str, float], duration_s: float) -> float:
    """Requests per second that completed within every SLO (DistServe's goodput, as vLLM reports it)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    return sum(1 for r in records if meets_slos(r, slos_ms)) / duration_s


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    slos_ms: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> BenchmarkMetrics:
    """Aggregate per-request records of one run that lasted ``duration_s`` seconds (wall clock)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        ttft_ms=summarize_ms([r.ttft_s for r in ok], percentiles),
        tpot_ms=summarize_ms([r.tpot_s for r in ok if r.tpot_s is not None], percentiles),
        itl_ms=summarize_ms([gap for r in ok for gap in r.itl_s], percentiles),
        e2el_ms=summarize_ms([r.latency_s for r in ok], percentiles),
        p99_by_bucket_ms=p99_by_bucket_ms(ok),
        goodput=goodput(records, slos_ms, duration_s) if slos_ms else None,
        goodput_slo_ms=dict(slos_ms or {}),
    )


@dataclass(frozen=True)
class PaddingWaste:
    """Token slots a static batcher would have occupied for a workload.

    Attributes:
        useful_tokens: sum of prompt + output tokens over requests.
        slot_tokens: sum over batches of ``batch_len * (max prompt + max output in the batch)``.
        efficiency: ``useful_tokens / slot_tokens`` (1.0 means no padding).
        waste: ``1 - efficiency``.
    """

    useful_tokens: int
    slot_tokens: int

    @property
    def efficiency(self) -> float:
        return self.useful_tokens / self.slot_tokens if self.slot_tokens else 1.0

    @property
    def waste(self) -> float:
        return 1.0 - self.efficiency


def static_batching_padding(
    prompt_lens: Sequence[int], output_lens: Sequence[int], batch_size: int
) -> PaddingWaste:
    """Padding of request-level (static) batching: requests taken in order in batches of ``batch_size``.

    Each row of a batch is left-padded to the batch's longest prompt and keeps its slot until the batch's
    longest output is generated, so a batch occupies ``rows * (max prompt + max output)`` token slots.
    Example: 10 sequences of 2,048 tokens and 10 of 192 in one batch of 20 use 22,400 of 40,960 slots (54.7 %).
    """
    if len(prompt_lens) != len(output_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(output_lens)} output lengths")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    useful = sum(prompt_lens) + sum(output_lens)
    slots = 0
    for start in range(0, len(prompt_lens), batch_size):
        prompts = prompt_lens[start : start + batch_size]
        outputs = output_lens[start : start + batch_size]
        slots += len(prompts) * (max(prompts) + max(outputs))
    return PaddingWaste(useful_tokens=useful, slot_tokens=slots)


def matmul_flops_per_s(n: int, seconds_per_mm: float) -> float:
    """FLOP/s of one ``[n, n] @ [n, n]`` matmul that took ``seconds_per_mm`` seconds (``2 n^3`` FLOPs)."""
    if seconds_per_mm <= 0:
        raise ValueError(f"seconds_per_mm must be > 0, got {seconds_per_mm}")
    return 2.0 * n**3 / seconds_per_mm


@dataclass(frozen=True)
class ModelFlops:
    """The weights a model's forward pass multiplies per token, for MFU (2 FLOPs per weight, attention
    ignored; Kaplan et al. 2020's 2N). Every token runs the decoder layers (`layer_params`: every
    parameter but the embedding table and an untied LM head); only a token whose logits are computed,
    an output token, runs the LM head (`lm_head_params` = vocab_size x hidden_size); the input
    embedding is a lookup. num_params: distinct parameters, a tied table once."""

    num_params: int
    lm_head_params: int
    tied: bool = True

    @property
    def layer_params(self) -> int:
        return self.num_params - self.lm_head_params * (1 if self.tied else 2)

    @classmethod
    def from_config(cls, num_params: int, config: Mapping[str, Any]) -> ModelFlops:
        """From a model's parameter count and its config.json fields (`vocab_size`, `hidden_size`,
        `tie_word_embeddings`, default True as transformers' Gemma and Llama-family configs say)."""
        return cls(
            num_params, config["vocab_size"] * config["hidden_size"], config.get("tie_word_embeddings", True)
        )

    def weight_bytes(self, bytes_per_param: float) -> float:
        """The bytes a decode step reads from the weights (the decoder layers and the LM head; the
        embedding lookup reads a row per token) at `bytes_per_param` (4 float32, 2 bfloat16)."""
        return (self.layer_params + self.lm_head_params) * bytes_per_param


# The embedded SmolLM2-135M-Instruct: 134,515,008 parameters, a tied 49,152 x 576 embedding.
EMBEDDED_MODEL_FLOPS = ModelFlops(134_515_008, 49_152 * 576)


def model_flops_utilization(
    flops: ModelFlops, total_tokens_per_s: float, output_tokens_per_s: float, peak_flops_per_s: float
) -> float:
    """MFU: ``2 * layer_params * total tok/s + 2 * lm_head_params * output tok/s`` (forward-pass FLOPs,
    attention ignored) over the measured matmul rate. Raises ValueError for a rate that is not positive."""
    if peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s must be > 0, got {peak_flops_per_s}")
    work = flops.layer_params * total_tokens_per_s + flops.lm_head_params * output_tokens_per_s
    return 2.0 * work / peak_flops_per_s


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per parameter of a float dtype


def copy_bandwidth(size: int = 1 << 30) -> float:
    """Bytes per second of a `size`-byte copy (read plus written bytes, as STREAM counts a copy), the
    best of five, over every torch thread."""
    import torch

    source = torch.ones(size, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * size / best


def bandwidth_share(weight_bytes: float, tpot_ms: float | None, bandwidth: float) -> float | None:
    """A decode's share of the memory bandwidth: the weights a step reads (`weight_bytes`) over the
    median time per output token (a step's time: each running sequence gets one token per step) over
    `bandwidth` bytes/s (`copy_bandwidth`), so CPU numbers compare across machines (the quantization
    issue's "% of bandwidth"; Databricks' MBU without the KV cache's reads, so a lower bound). None
    without a TPOT."""
    if not tpot_ms or bandwidth <= 0:
        return None
    return weight_bytes / (tpot_ms / 1e3) / bandwidth


def run_entry(
    system: str,
    scenario: str,
    samples: Sequence[Any],
    records: Sequence[RequestRecord],
    metrics: BenchmarkMetrics,
    mfu: float | None,
    request_rate: float | None = None,
    *,
    weight_bytes: float | None = None,
    bandwidth: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One run as the results files record it: its name, `metrics`, `mfu`, `bandwidth_share` (see
    `bandwidth_share`; None unless the weights' bytes and the copy bandwidth are given), how many
    successful requests missed their sample's `output_len` (exact lengths are asked for), the first
    distinct errors, the machine's load average, and `extra` fields."""
    share = None
    if weight_bytes is not None and bandwidth is not None:
        share = bandwidth_share(weight_bytes, metrics.tpot_ms["median"], bandwidth)
    return {
        "name": f"{system} / {scenario}",
        "system": system,
        "scenario": scenario,
        "request_rate": request_rate,
        "metrics": asdict(metrics),
        "mfu": mfu,
        "bandwidth_share": share,
        "output_len_mismatches": sum(
            1 for r, s in zip(records, samples, strict=True) if r.success and r.output_len != s.output_len
        ),
        "errors": sorted({r.error for r in records if not r.success})[:5],
        "load_average": os.getloadavg(),
        **extra,
    }


def _ms(value_s: float | None) -> float | None:
    return None if value_s is None else value_s * 1000.0
