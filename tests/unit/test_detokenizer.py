"""Incremental detokenization with the embedded model's real tokenizer."""

from __future__ import annotations

import pytest

from conveyor.server.engine.detokenizer import IncrementalDetokenizer
from conveyor.server.messages import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    from conveyor.server.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


def stream(tokenizer, text: str, stop: list[str]) -> tuple[list[str], bool]:
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [1, 2], SamplingParams(stop=stop))
    deltas = []
    stopped = False
    for i, t in enumerate(ids):
        stopped = detok.update([t])
        deltas.append(detok.delta(finished=stopped or i == len(ids) - 1))
        if stopped:
            break
    return deltas, stopped


def test_concatenated_deltas_equal_the_text(tokenizer):
    text = "Hello, wörld! Ünïcödé → 日本語 and emoji 🙂🚀 end."
    deltas, stopped = stream(tokenizer, text, [])
    assert "".join(deltas) == text and not stopped
    assert not any("\ufffd" in d for d in deltas)  # no half UTF-8 character ever sent


def test_stop_string_cuts_the_text_and_no_prefix_is_streamed(tokenizer):
    text = "The answer is 42. STOP here and more text"
    deltas, stopped = stream(tokenizer, text, ["STOP here"])
    assert stopped and "".join(deltas) == "The answer is 42. "
    sent = ""
    for d in deltas:
        sent += d
        assert not any(sent.endswith("STOP here"[:n]) for n in range(1, 9)) or sent.endswith(". ")


def test_stop_string_inside_one_token_and_include_option(tokenizer):
    ids = tokenizer("abcdef")["input_ids"]
    detok = IncrementalDetokenizer(
        tokenizer, [], SamplingParams(stop=["cd"], include_stop_str_in_output=True)
    )
    stopped = any(detok.update([t]) for t in ids)
    assert stopped and detok.output_text == "abcd"
