"""`ModelShape.from_hf_config`'s rotary features: the rotated width, and the rope kinds whose angles
depend on the sequence's length (what the runner, the prefix cache and `--max-model-len` read of them)."""

from __future__ import annotations

import pytest
import transformers

from conveyor.server.model.models.llama import ModelShape

SHAPE = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)


def test_partial_rotary_rotates_that_fraction_of_each_head() -> None:
    shape = ModelShape.from_hf_config(transformers.Phi3Config(**SHAPE, partial_rotary_factor=0.75))
    assert (shape.head_dim, shape.rotary_dim) == (128, 96)
    assert ModelShape.from_hf_config(transformers.Phi3Config(**SHAPE)).rotary_dim == 128


def test_a_rotary_width_that_is_not_even_is_refused_naming_the_factor() -> None:
    config = transformers.Phi3Config(**SHAPE, partial_rotary_factor=0.3)  # 38.4 -> 38: even, accepted
    assert ModelShape.from_hf_config(config).rotary_dim == 38
    config = transformers.Phi3Config(**SHAPE, partial_rotary_factor=0.29)  # 37.12 -> 37
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0.29 of head_dim 128 rotates 37 dims"):
        ModelShape.from_hf_config(config)


def test_longrope_switches_tables_past_the_original_context() -> None:
    config = transformers.Phi3Config(
        **SHAPE,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 64,
            "long_factor": [4.0] * 64,
        },
    )
    shape = ModelShape.from_hf_config(config)
    assert shape.rope_by_length and shape.position_limit == 131072
    assert [shape.rope_cache_key(n) for n in (1, 4096, 4097)] == [None, None, 1]
    # A prompt within the original context is recomputed once it grows past it; a longer one never.
    assert [shape.rope_recompute_after(n) for n in (10, 4096, 4097)] == [4096, 4096, None]


def test_dynamic_ntk_stretches_the_positions_by_its_factor() -> None:
    config = transformers.LlamaConfig(
        **SHAPE, max_position_embeddings=2048, rope_scaling={"rope_type": "dynamic", "factor": 4.0}
    )
    shape = ModelShape.from_hf_config(config)
    assert shape.rope_by_length and shape.position_limit == 8192
    assert [shape.rope_cache_key(n) for n in (2048, 2049, 5000)] == [None, 2049, 5000]
    assert shape.rope_recompute_after(10) is None


def test_rope_kinds_of_one_table_do_not_depend_on_length() -> None:
    config = transformers.LlamaConfig(**SHAPE, rope_scaling={"rope_type": "linear", "factor": 2.0})
    shape = ModelShape.from_hf_config(config)
    assert not shape.rope_by_length and shape.position_limit == config.max_position_embeddings
    assert shape.rope_cache_key(10**6) is None and shape.rope_recompute_after(10) is None
