"""The catalog's config.json fields describe the models it names, and `conveyor plan --write-config`
writes them out as a weights-free model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conveyor.operator import catalog, plan
from conveyor.server.model import loader
from conveyor.server.model.models.llama import LlamaForCausalLM, ModelShape


@pytest.mark.parametrize("name", sorted(catalog.HF_CONFIGS))
def test_config_gives_the_catalog_parameter_count(name, tmp_path):
    # Build our model of the written config on the meta device: its parameter count must be the one
    # the safetensors index gives, so a wrong hidden, intermediate or vocab size cannot pass.
    # A plan-only shape (gpt-oss) is counted by transformers' own model instead.
    assert plan.main(["--model", name, "--write-config", str(tmp_path)]) == 0
    config = loader.load_config(loader.resolve_model(str(tmp_path)))
    shape = catalog.MODELS[name]
    if name in catalog.PLAN_ONLY:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in hf.parameters()) == catalog.NUM_PARAMS[name]
        assert (config.num_hidden_layers, config.num_key_value_heads) == (
            shape.num_layers,
            shape.num_kv_heads,
        )
        assert config.num_local_experts == shape.num_experts
        return
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelShape.from_hf_config(config), ops=None)
    assert sum(p.numel() for p in model.parameters()) == catalog.NUM_PARAMS[name]
    assert (model.shape.num_experts, model.shape.num_experts_per_tok) == (
        shape.num_experts,
        shape.num_experts_per_tok,
    )
    derived = ModelShape.from_hf_config(config)
    assert (derived.num_layers, derived.num_kv_heads, derived.head_dim) == (
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_dim,
    )
    assert derived.max_position_embeddings == shape.max_position_embeddings


def test_write_config_takes_hub_ids_and_prints_the_path(tmp_path, capsys):
    assert (
        plan.main(["--model", "meta-llama/Meta-Llama-3-8B-Instruct", "--write-config", str(tmp_path / "d")])
        == 0
    )
    assert capsys.readouterr().out.strip() == str(tmp_path / "d" / "config.json")
    written = json.loads((tmp_path / "d" / "config.json").read_text())
    assert (written["hidden_size"], written["num_key_value_heads"], written["vocab_size"]) == (
        4096,
        8,
        128256,
    )


def test_write_config_of_an_unknown_model_names_the_known_ones(tmp_path, capsys):
    assert plan.main(["--model", "gpt-17", "--write-config", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert (
        "unknown model 'gpt-17'; known models: gemma-2-9b, gemma-3-270m, gemma-3-27b, gpt-oss-20b, llama-3-70b"
        in err
    )
    assert not (tmp_path / "config.json").exists()


def test_plan_without_gpu_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        plan.main(["--model", "llama-3-8b"])
    assert exc.value.code == 2
    assert "--gpu and --max-model-len are required" in capsys.readouterr().err


def _readme_plan_rows() -> list[list[str]]:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("### Plans for the catalog's shapes", 1)[1].split("\n## ", 1)[0]
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| `")
    ]


def test_the_readme_plan_table_is_what_conveyor_plan_prints(capsys):
    rows = _readme_plan_rows()
    assert {row[0].strip("`") for row in rows} >= {"gemma-3-27b", "qwen3-8b", "llama-3.1-70b", "phi-4"}
    for name, gpus, params, bytes_per_token, pool, max_num_seqs in rows:
        name = name.strip("`")
        args = ["--model", name, "--gpu", "h100-80gb", "--gpus", gpus, "--max-model-len", "8192", "--json"]
        assert plan.main(args) == 0
        got = json.loads(capsys.readouterr().out)
        capacity = got["capacity"]
        assert [params, bytes_per_token, pool, max_num_seqs] == [
            f"{got['model']['num_params'] / 1e9:.2f} B",
            f"{capacity['kv_bytes_per_token'] * got['tensor_parallel_size']:,}",
            f"{capacity['kv_pool_bytes'] / 2**30:.2f} GiB",
            str(got["max_num_seqs"]),
        ], name


@pytest.mark.parametrize(
    ("hub_id", "key"),
    [
        ("google/gemma-3-27b-it", "gemma-3-27b"),
        ("google/gemma-2-9b-it", "gemma-2-9b"),
        ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
    ],
)
def test_hub_ids_name_their_catalog_entries(hub_id, key):
    assert catalog.normalize_model_name(hub_id) == key and key in catalog.MODELS
