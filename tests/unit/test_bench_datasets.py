"""Benchmark workloads: seeded, exact lengths; arrival schedules."""

import math

import numpy as np
import pytest

from conveyor.benchmarks.arrivals import arrival_offsets
from conveyor.benchmarks.datasets import (
    TOKEN_ID_LOW,
    SampleRequest,
    build_dataset,
    load_jsonl,
    long_tailed_lengths,
    prefix_shared_dataset,
    random_dataset,
    sharegpt_like_dataset,
    to_text,
    write_jsonl,
)


def test_random_dataset_has_exact_lengths_in_range_and_is_seeded():
    samples = random_dataset(50, input_len=100, output_len=20, range_ratio=0.5, vocab_size=1000, seed=3)
    assert len(samples) == 50
    for s in samples:
        assert len(s.prompt) == s.prompt_len
        assert 50 <= s.prompt_len <= 150
        assert 10 <= s.output_len <= 30
        assert all(TOKEN_ID_LOW <= t < 1000 for t in s.prompt)
    assert samples == random_dataset(
        50, input_len=100, output_len=20, range_ratio=0.5, vocab_size=1000, seed=3
    )
    assert samples != random_dataset(
        50, input_len=100, output_len=20, range_ratio=0.5, vocab_size=1000, seed=4
    )


def test_random_dataset_without_range_is_fixed_length():
    samples = random_dataset(5, input_len=64, output_len=8)
    assert [(s.prompt_len, s.output_len) for s in samples] == [(64, 8)] * 5


def test_long_tailed_lengths_span_exactly_the_spread():
    lengths = long_tailed_lengths(np.random.default_rng(0), 200, min_len=20, spread=10)
    assert min(lengths) == 20
    assert max(lengths) == 200
    # Long tail: most requests are short, the mean sits well below the middle of the range.
    assert np.median(lengths) < 60
    assert long_tailed_lengths(np.random.default_rng(0), 1, min_len=20, spread=10) == [20]


def test_sharegpt_like_dataset():
    samples = sharegpt_like_dataset(32, min_input_len=25, min_output_len=16, spread=10, seed=0)
    prompt_lens = [s.prompt_len for s in samples]
    output_lens = [s.output_len for s in samples]
    assert (min(prompt_lens), max(prompt_lens)) == (25, 250)
    assert (min(output_lens), max(output_lens)) == (16, 160)
    assert all(len(s.prompt) == s.prompt_len for s in samples)
    assert samples == sharegpt_like_dataset(32, min_input_len=25, min_output_len=16, spread=10, seed=0)


def test_prefix_shared_dataset_shares_exact_prefixes():
    samples = prefix_shared_dataset(6, num_prefixes=2, prefix_len=40, suffix_len=8, output_len=5, seed=1)
    assert [s.prompt_len for s in samples] == [48] * 6
    assert all(len(s.prompt) == 48 and s.output_len == 5 for s in samples)
    assert samples[0].prompt[:40] == samples[2].prompt[:40] == samples[4].prompt[:40]
    assert samples[1].prompt[:40] == samples[3].prompt[:40]
    assert samples[0].prompt[:40] != samples[1].prompt[:40]
    assert samples[0].prompt[40:] != samples[2].prompt[40:]


def test_jsonl_round_trip(tmp_path):
    samples = random_dataset(4, input_len=10, output_len=3, seed=0) + [
        SampleRequest("hello there", 2, 7),
        SampleRequest([5, 6], 2, 1, model="sql-adapter"),
    ]
    path = tmp_path / "w.jsonl"
    write_jsonl(samples, path)
    assert load_jsonl(path) == samples
    assert load_jsonl(path, num_prompts=2) == samples[:2]
    assert build_dataset("file", 3, path=path) == samples[:3]


def test_jsonl_text_prompt_needs_length_or_tokenizer(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "a b c", "output_len": 4}\n')
    with pytest.raises(ValueError, match="tokenizer"):
        load_jsonl(path)

    class WordTokenizer:
        def encode(self, text, add_special_tokens=False):
            return list(range(len(text.split())))

        def decode(self, ids):
            return " ".join("w" for _ in ids)

    assert load_jsonl(path, tokenizer=WordTokenizer()) == [SampleRequest("a b c", 3, 4)]


def test_to_text_matches_the_length_the_text_encodes_to():
    class CharTokenizer:
        """Each id decodes to one letter; encoding splits into characters."""

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(97 + i % 26) for i in ids)

    sample = SampleRequest([100, 101, 102, 103], 4, 9)
    text = to_text(sample, CharTokenizer())
    assert text == SampleRequest("wxyz", 4, 9)


def test_unknown_dataset_name():
    with pytest.raises(ValueError, match="unknown dataset"):
        build_dataset("sharegpt", 1)


def test_arrivals_all_at_once_for_infinite_rate():
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_offsets(0, 1.0) == []


def test_poisson_arrivals_have_the_requested_mean_rate():
    offsets = arrival_offsets(20_001, request_rate=4.0, burstiness=1.0, seed=0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0
    assert np.all(gaps >= 0)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    assert arrival_offsets(10, 4.0, seed=7) == arrival_offsets(10, 4.0, seed=7)


def test_bursty_arrivals_keep_the_mean_but_widen_the_gaps():
    gaps = np.diff(arrival_offsets(20_001, request_rate=2.0, burstiness=0.25, seed=0))
    assert np.mean(gaps) == pytest.approx(0.5, rel=0.05)
    assert np.std(gaps) == pytest.approx(0.5 / math.sqrt(0.25), rel=0.1)  # gamma: cv = 1 / sqrt(shape)


@pytest.mark.parametrize(("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_arrivals_reject_bad_parameters(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_offsets(3, rate, burstiness)


def test_sharegpt_like_output_spread_can_differ_from_the_prompt_spread():
    samples = sharegpt_like_dataset(
        16, min_input_len=256, min_output_len=48, spread=10, output_spread=2, seed=1
    )
    assert (min(s.prompt_len for s in samples), max(s.prompt_len for s in samples)) == (256, 2560)
    assert (min(s.output_len for s in samples), max(s.output_len for s in samples)) == (48, 96)
