"""The GGUF conversion cache (`loader.converted`): a GGUF is read once into Hugging Face layout, the
copy is the same model, later starts reuse it, and a cache that cannot be written falls back to the
GGUF itself. The engine's greedy-parity tests (test_engine.py) compare an engine loaded from the copy
with transformers reading the GGUF directly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conveyor.server.model import loader

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def embedded():
    return loader.resolve_model(None)


def test_conversion_is_the_same_model_and_is_reused(tmp_path, monkeypatch, embedded):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = loader.converted(embedded)
    assert source.gguf_file is None and source.default_name == embedded.default_name
    assert os.path.dirname(source.path) == str(tmp_path / "conveyor" / "models")
    assert sorted(p.name for p in (tmp_path / "conveyor" / "models").iterdir()) == [
        os.path.basename(source.path)
    ]  # no temporary folder left behind
    assert loader.converted(embedded) == source  # the second call finds it
    assert loader.converted(source) is source  # a directory is not converted again

    gguf_tok = AutoTokenizer.from_pretrained(embedded.path, gguf_file=embedded.gguf_file)
    tok = AutoTokenizer.from_pretrained(source.path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 🙂 12 + 30?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == gguf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok(text)["input_ids"] == gguf_tok(text)["input_ids"]
    assert tok.eos_token_id == gguf_tok.eos_token_id

    gguf_weights = AutoModelForCausalLM.from_pretrained(
        embedded.path, gguf_file=embedded.gguf_file, dtype=torch.float32
    ).state_dict()
    weights = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).state_dict()
    assert gguf_weights.keys() == weights.keys()
    assert all(torch.equal(gguf_weights[k], weights[k]) for k in weights)


def test_a_start_without_float_weights_converts_only_config_and_tokenizer(tmp_path, monkeypatch, embedded):
    """`--quantization gguf` and the router need no float32 copy of the model: none is made until a
    start asks for the weights, which then go into the same folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = loader.converted(embedded, weights=False)
    files = sorted(p.name for p in Path(source.path).iterdir())
    assert "config.json" in files and "tokenizer.json" in files and loader.WEIGHTS_FILE not in files
    assert loader.load_config(source).num_hidden_layers == 30
    assert loader.converted(embedded, weights=False) == source
    assert loader.converted(embedded) == source
    assert (Path(source.path) / loader.WEIGHTS_FILE).is_file()
    assert sorted(p.name for p in Path(source.path).iterdir()) == sorted([*files, loader.WEIGHTS_FILE])


def test_a_conversion_removes_copies_whose_source_is_gone(tmp_path, monkeypatch, embedded):
    """One copy per live file, not one per install location: a copy whose GGUF was deleted (a removed
    checkout's venv), one of this same file under an older key, and one without a source record are
    removed; a copy of another live file of the same name stays."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "conveyor" / "models"
    stem = Path(embedded.gguf_file).stem
    other = tmp_path / "elsewhere" / embedded.gguf_file
    other.parent.mkdir()
    other.write_bytes(b"GGUF")
    records = {
        "0" * 12: {"gguf": str(tmp_path / "gone" / embedded.gguf_file)},
        "1" * 12: {"gguf": str((Path(embedded.path) / embedded.gguf_file).resolve())},
        "2" * 12: None,
        "3" * 12: {"gguf": str(other)},
    }
    for suffix, record in records.items():
        (cache / f"{stem}-{suffix}").mkdir(parents=True)
        if record is not None:
            (cache / f"{stem}-{suffix}" / loader.SOURCE_FILE).write_text(json.dumps(record))
    (cache / "another-model-000000000000").mkdir()
    source = loader.converted(embedded, weights=False)
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [Path(source.path).name, f"{stem}-{'3' * 12}", "another-model-000000000000"]
    )
    record = json.loads((Path(source.path) / loader.SOURCE_FILE).read_text())
    assert record["gguf"] == str((Path(embedded.path) / embedded.gguf_file).resolve())


def test_unwritable_cache_reads_the_gguf(tmp_path, monkeypatch, caplog, embedded):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert loader.converted(embedded) == embedded
    assert "cannot write the model cache" in caplog.text
