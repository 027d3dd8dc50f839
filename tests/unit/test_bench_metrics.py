"""Benchmark maths against hand-computed values."""

import math

import pytest

from conveyor.benchmarks.metrics import (
    ModelFlops,
    RequestRecord,
    compute_metrics,
    goodput,
    input_length_bucket,
    matmul_flops_per_s,
    meets_slos,
    model_flops_utilization,
    p99_by_bucket_ms,
    parse_goodput_slos,
    percentile,
    static_batching_padding,
    summarize_ms,
)


def test_percentile_interpolates_linearly_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4, rank = 3 * q / 100
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_percentile_rejects_out_of_range_q():
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_converts_seconds_to_ms():
    summary = summarize_ms([0.1, 0.2, 0.3, 0.4, 1.0])
    assert summary["mean"] == pytest.approx(400.0)
    assert summary["median"] == pytest.approx(300.0)
    assert summary["p90"] == pytest.approx(760.0)  # rank 3.6: 400 + 0.6 * 600
    assert summary["p99"] == pytest.approx(976.0)  # rank 3.96: 400 + 0.96 * 600
    assert summary["max"] == pytest.approx(1000.0)
    assert summarize_ms([]) == {"mean": None, "median": None, "p90": None, "p99": None, "max": None}


@pytest.mark.parametrize(
    ("prompt_len", "bucket"),
    [
        (0, "0-512"),
        (511, "0-512"),
        (512, "512-2048"),
        (2047, "512-2048"),
        (2048, "2048+"),
        (100_000, "2048+"),
    ],
)
def test_input_length_bucket_edges(prompt_len, bucket):
    assert input_length_bucket(prompt_len) == bucket


def test_tpot_excludes_first_token():
    record = RequestRecord(prompt_len=10, output_len=11, ttft_s=0.5, latency_s=1.5)
    assert record.tpot_s == pytest.approx(0.1)
    assert RequestRecord(prompt_len=10, output_len=1, ttft_s=0.5, latency_s=0.5).tpot_s is None


def _record(prompt_len, ttft, latency, output_len=11, itl=(), success=True):
    return RequestRecord(prompt_len, output_len, ttft, latency, tuple(itl), success=success)


def test_goodput_counts_requests_within_every_slo():
    records = [
        _record(10, ttft=0.2, latency=1.2),  # tpot 100 ms: good
        _record(10, ttft=0.6, latency=1.6),  # ttft 600 ms > 500: bad
        _record(10, ttft=0.2, latency=2.2),  # tpot 200 ms > 150: bad
        _record(10, ttft=0.5, latency=2.0),  # ttft 500 ms, tpot 150 ms: exactly on the limits, good
        _record(10, ttft=0.1, latency=0.2, success=False),
    ]
    slos = parse_goodput_slos(["ttft:500", "tpot:150"])
    assert slos == {"ttft": 500.0, "tpot": 150.0}
    assert [meets_slos(r, slos) for r in records] == [True, False, False, True, False]
    assert goodput(records, slos, duration_s=4.0) == pytest.approx(0.5)


@pytest.mark.parametrize("bad", ["ttft", "ttft=5", "queue:5", "tpot:x", "e2el:-1"])
def test_parse_goodput_rejects_malformed(bad):
    with pytest.raises(ValueError):
        parse_goodput_slos([bad])


def test_p99_by_bucket_groups_by_prompt_length():
    records = [
        _record(100, ttft=0.1, latency=1.1, itl=[0.1]),
        _record(300, ttft=0.3, latency=1.3, itl=[0.2]),
        _record(1000, ttft=2.0, latency=4.0, itl=[0.5, 0.7]),
        _record(5000, ttft=9.0, latency=9.0, output_len=1, success=False),
    ]
    buckets = p99_by_bucket_ms(records)
    assert buckets["0-512"]["count"] == 2
    assert buckets["0-512"]["ttft"] == pytest.approx(298.0)  # 100 + 0.99 * 200
    assert buckets["0-512"]["tpot"] == pytest.approx(100.0)
    assert buckets["0-512"]["itl"] == pytest.approx(199.0)
    assert buckets["512-2048"] == {
        "count": 1,
        "ttft": pytest.approx(2000.0),
        "tpot": pytest.approx(200.0),
        "itl": pytest.approx(698.0),
        "e2el": pytest.approx(4000.0),
    }
    assert buckets["2048+"] == {"count": 0, "ttft": None, "tpot": None, "itl": None, "e2el": None}


def test_compute_metrics_throughputs():
    records = [
        _record(100, ttft=0.1, latency=1.1, output_len=11),
        _record(300, ttft=0.3, latency=2.3, output_len=21),
        _record(50, ttft=0.0, latency=0.0, output_len=0, success=False),
    ]
    metrics = compute_metrics(records, duration_s=4.0, slos_ms={"ttft": 200.0})
    assert (metrics.completed, metrics.failed) == (2, 1)
    assert metrics.total_input_tokens == 400
    assert metrics.total_output_tokens == 32
    assert metrics.request_throughput == pytest.approx(0.5)
    assert metrics.output_throughput == pytest.approx(8.0)
    assert metrics.total_token_throughput == pytest.approx(108.0)
    assert metrics.goodput == pytest.approx(0.25)
    assert metrics.ttft_ms["mean"] == pytest.approx(200.0)
    assert metrics.tpot_ms["mean"] == pytest.approx(100.0)


def test_padding_classic_example_is_54_7_percent():
    # One batch of 20: ten 2,048-token sequences and ten 192-token ones, all padded to 2,048.
    lengths = [2048] * 10 + [192] * 10
    padding = static_batching_padding(lengths, [0] * 20, batch_size=20)
    assert padding.useful_tokens == 22_400
    assert padding.slot_tokens == 40_960
    assert padding.efficiency == pytest.approx(22_400 / 40_960)
    assert round(padding.efficiency * 100, 1) == 54.7
    assert padding.waste == pytest.approx(1 - 0.546875)


def test_padding_pads_prompts_and_outputs_per_batch():
    # Batch 1: prompts 10, 30 (pad to 30), outputs 5, 20 (run to 20): 2 * 50 = 100 slots, 65 useful.
    # Batch 2: one request 40 + 10: 50 slots, 50 useful.
    padding = static_batching_padding([10, 30, 40], [5, 20, 10], batch_size=2)
    assert padding.useful_tokens == 115
    assert padding.slot_tokens == 150
    assert padding.efficiency == pytest.approx(115 / 150)


def test_padding_without_spread_has_no_waste():
    assert static_batching_padding([8, 8, 8], [4, 4, 4], batch_size=2).efficiency == 1.0


def test_padding_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        static_batching_padding([1, 2], [1], batch_size=2)
    with pytest.raises(ValueError):
        static_batching_padding([1], [1], batch_size=0)


def test_mfu():
    # 1024^3 * 2 FLOPs in 10 ms = 214.75 GFLOP/s.
    peak = matmul_flops_per_s(1024, 0.01)
    assert peak == pytest.approx(2 * 1024**3 / 0.01)
    # 135 M params, 35 M of them a tied LM head: every token runs the 100 M layer parameters, only the
    # 40 output tokens of 100 tok/s the LM head: 2 x (100 M x 100 + 35 M x 40) = 22.8 GFLOP/s of 228.
    flops = ModelFlops(135_000_000, 35_000_000)
    assert flops.layer_params == 100_000_000
    assert model_flops_utilization(flops, 100.0, 40.0, 228e9) == pytest.approx(0.1)
    # Untied, the input table is a lookup and the output table a matmul: 135 - 2 x 35 M layer params.
    assert ModelFlops(135_000_000, 35_000_000, tied=False).layer_params == 65_000_000
    assert math.isclose(model_flops_utilization(flops, 0.0, 0.0, 1.0), 0.0)
    gemma = ModelFlops.from_config(268_098_176, {"vocab_size": 262_144, "hidden_size": 640})
    assert (gemma.layer_params, gemma.lm_head_params) == (100_326_016, 167_772_160)
