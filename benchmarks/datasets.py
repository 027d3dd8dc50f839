"""Benchmark workloads: seeded prompts of exact token lengths with exact output lengths.

Prompts are token-id lists drawn from ``[TOKEN_ID_LOW, vocab_size)`` (clear of the special tokens at the
bottom of Llama/SmolLM2-style vocabularies), so their length is exact without a tokenizer; ``to_text``
turns them into strings for servers or endpoints that take text.

Datasets:
- ``random``: prompt and output lengths uniform in ``[len * (1 - range_ratio), len * (1 + range_ratio)]``.
- ``sharegpt-like``: long-tailed lengths, exponential draws rescaled so the shortest is ``min_len`` and the
  longest ``spread * min_len`` (a 10x spread by default), as in real chat traffic: most requests short, a few long.
- ``prefix-shared``: groups of prompts sharing a long common prefix, each with its own suffix.
- ``file``: JSONL, one ``{"prompt": str | list[int], "output_len": int, "prompt_len"?: int}`` per line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

#: Lowest token id drawn for synthetic prompts; ids below it are special tokens in the embedded model.
TOKEN_ID_LOW = 100
#: Vocabulary size of the embedded SmolLM2-135M model.
DEFAULT_VOCAB_SIZE = 49152

DATASET_NAMES = ("random", "sharegpt-like", "prefix-shared", "file")


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request.

    Attributes:
        prompt: token ids, or text for the ``file`` dataset and after ``to_text``.
        prompt_len: prompt length in tokens.
        output_len: exact number of tokens to generate.
        model: the ``model`` sent instead of the run's (a LoRA adapter's name), None for the run's.
    """

    prompt: list[int] | str
    prompt_len: int
    output_len: int
    model: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSONL form read back by ``load_jsonl``."""
        row = {"prompt": self.prompt, "prompt_len": self.prompt_len, "output_len": self.output_len}
        return row if self.model is None else {**row, "model": self.model}


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer used here."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


def _token_ids(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    return rng.integers(TOKEN_ID_LOW, vocab_size, size=length).tolist()


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def uniform_lengths(rng: np.random.Generator, n: int, mean_len: int, range_ratio: float) -> list[int]:
    """``n`` integers uniform in ``[max(1, floor(mean_len * (1 - r))), ceil(mean_len * (1 + r))]`` inclusive."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(np.floor(mean_len * (1.0 - range_ratio))))
    high = int(np.ceil(mean_len * (1.0 + range_ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def long_tailed_lengths(rng: np.random.Generator, n: int, min_len: int, spread: float) -> list[int]:
    """``n`` long-tailed lengths between ``min_len`` and ``round(spread * min_len)`` tokens, both reached.

    Exponential draws, min-max rescaled onto the range: most lengths near ``min_len``, a tail up to the maximum.
    With ``n == 1`` the single length is ``min_len``.
    """
    _check_positive(n=n, min_len=min_len)
    if spread < 1.0:
        raise ValueError(f"spread must be >= 1, got {spread}")
    max_len = round(spread * min_len)
    draws = rng.exponential(1.0, size=n)
    span = draws.max() - draws.min()
    if span == 0.0:
        return [min_len] * n
    scaled = min_len + (draws - draws.min()) / span * (max_len - min_len)
    return np.rint(scaled).astype(int).tolist()


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts and outputs with lengths uniform around ``input_len`` / ``output_len`` (``range_ratio`` spread)."""
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    rng = np.random.default_rng(seed)
    prompt_lens = uniform_lengths(rng, num_prompts, input_len, range_ratio)
    output_lens = uniform_lengths(rng, num_prompts, output_len, range_ratio)
    return [
        SampleRequest(_token_ids(rng, p, vocab_size), p, o)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


def sharegpt_like_dataset(
    num_prompts: int,
    min_input_len: int,
    min_output_len: int,
    spread: float = 10.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    output_spread: float | None = None,
) -> list[SampleRequest]:
    """Long-tailed prompt and output lengths drawn independently; prompts span exactly ``spread`` x,
    outputs ``output_spread`` x (default: ``spread``)."""
    _check_positive(num_prompts=num_prompts, min_input_len=min_input_len, min_output_len=min_output_len)
    rng = np.random.default_rng(seed)
    prompt_lens = long_tailed_lengths(rng, num_prompts, min_input_len, spread)
    output_lens = long_tailed_lengths(
        rng, num_prompts, min_output_len, spread if output_spread is None else output_spread
    )
    return [
        SampleRequest(_token_ids(rng, p, vocab_size), p, o)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


def prefix_shared_dataset(
    num_prompts: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_prompts`` prompts of ``prefix_len + suffix_len`` tokens; prompt ``i`` uses prefix ``i % num_prefixes``.

    Prompts sharing a prefix are identical for their first ``prefix_len`` tokens and differ after it.
    """
    _check_positive(
        num_prompts=num_prompts, num_prefixes=num_prefixes, suffix_len=suffix_len, output_len=output_len
    )
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    rng = np.random.default_rng(seed)
    prefixes = [_token_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    return [
        SampleRequest(
            prefixes[i % num_prefixes] + _token_ids(rng, suffix_len, vocab_size),
            prefix_len + suffix_len,
            output_len,
        )
        for i in range(num_prompts)
    ]


def load_jsonl(
    path: str | Path, num_prompts: int | None = None, tokenizer: Tokenizer | None = None
) -> list[SampleRequest]:
    """Read requests from JSONL (``prompt``, ``output_len``, optional ``prompt_len`` and ``model``).

    A text prompt without ``prompt_len`` is measured with ``tokenizer``; raises ValueError when there is none,
    or when a line lacks ``prompt`` or a positive ``output_len``. Reads at most ``num_prompts`` requests.
    """
    samples: list[SampleRequest] = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if num_prompts is not None and len(samples) >= num_prompts:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = row.get("prompt")
            output_len = row.get("output_len")
            if prompt is None or not isinstance(output_len, int) or output_len < 1:
                raise ValueError(f"{path}:{line_no}: need 'prompt' and a positive integer 'output_len'")
            if "prompt_len" in row:
                prompt_len = int(row["prompt_len"])
            elif isinstance(prompt, list):
                prompt_len = len(prompt)
            elif tokenizer is not None:
                prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
            else:
                raise ValueError(f"{path}:{line_no}: text prompt without 'prompt_len' needs a tokenizer")
            samples.append(SampleRequest(prompt, prompt_len, output_len, row.get("model")))
    return samples


def write_jsonl(samples: Sequence[SampleRequest], path: str | Path) -> None:
    """Write requests in the form ``load_jsonl`` reads, one per line."""
    with open(path, "w", encoding="utf-8") as handle:
        for sample in samples:
            handle.write(json.dumps(sample.to_json()) + "\n")


def to_text(sample: SampleRequest, tokenizer: Tokenizer, max_tries: int = 10) -> SampleRequest:
    """Turn a token-id prompt into text that re-encodes to the same number of tokens where possible.

    Decoding random ids and encoding the text again can merge or split tokens; like vLLM's random dataset
    this trims or extends the ids and retries, then records the length the text really encodes to.
    """
    if isinstance(sample.prompt, str):
        return sample
    ids = list(sample.prompt)
    target = sample.prompt_len
    text = tokenizer.decode(ids)
    for _ in range(max_tries):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == target:
            break
        ids = encoded[:target] if len(encoded) > target else encoded + ids[: target - len(encoded)]
        text = tokenizer.decode(ids)
    actual = len(tokenizer.encode(text, add_special_tokens=False))
    return SampleRequest(text, actual, sample.output_len)


def build_dataset(name: str, num_prompts: int, seed: int = 0, **kwargs: Any) -> list[SampleRequest]:
    """Dispatch on a dataset name from ``DATASET_NAMES`` with that generator's keyword arguments."""
    if name == "random":
        return random_dataset(num_prompts, seed=seed, **kwargs)
    if name == "sharegpt-like":
        return sharegpt_like_dataset(num_prompts, seed=seed, **kwargs)
    if name == "prefix-shared":
        return prefix_shared_dataset(num_prompts, seed=seed, **kwargs)
    if name == "file":
        return load_jsonl(kwargs["path"], num_prompts, kwargs.get("tokenizer"))
    raise ValueError(f"unknown dataset {name!r}; choose from {DATASET_NAMES}")
