"""`conveyor serve MODEL`: what the MODEL argument resolves to, and the one-line errors a typo gets."""

from __future__ import annotations

import pytest

from conveyor.server.model import loader


def test_a_file_that_is_not_a_model_is_named_as_such(tmp_path) -> None:
    script = tmp_path / "notes.py"
    script.write_text("print('hi')\n")
    with pytest.raises(loader.ModelNotFoundError, match="is not a model directory .* or a .gguf file"):
        loader.resolve_model(str(script))


def test_a_near_miss_of_a_packaged_name_is_not_sent_to_the_hub() -> None:
    with pytest.raises(loader.ModelNotFoundError, match="did you mean 'gemma-3-270m'"):
        loader.resolve_model("gemma3-270m")


def test_hub_ids_and_missing_paths() -> None:
    assert loader.resolve_model("Qwen/Qwen3-8B") == loader.ModelSource("Qwen/Qwen3-8B", None, "Qwen/Qwen3-8B")
    with pytest.raises(loader.ModelNotFoundError, match="model path /nonexistent/x does not exist"):
        loader.resolve_model("/nonexistent/x")
    with pytest.raises(loader.ModelNotFoundError, match="GGUF file missing.gguf does not exist"):
        loader.resolve_model("missing.gguf")


def test_a_chat_template_is_a_file_or_a_template(tmp_path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert loader.read_chat_template(str(template)) == "{{ messages[0]['content'] }}"
    assert loader.read_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="'nosuchfile' is neither a file nor a Jinja template"):
        loader.read_chat_template("nosuchfile")
