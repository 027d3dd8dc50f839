"""The expert-load series of `EngineMetrics` for a mixture-of-experts model: what one step's routing
counts add to each, and that a dense model and the default flags export no per-expert series."""

from __future__ import annotations

from conveyor.server.api.metrics import EngineMetrics
from conveyor.server.messages import EngineLimits, SchedulerStats

LIMITS = dict(block_size=16, num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)


def _value(metrics: EngineMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})


def test_a_step_adds_its_assignments_and_one_imbalance_per_layer_with_enough_of_them():
    limits = EngineLimits(**LIMITS, num_experts=4, sparse_layers=(1, 3))
    metrics = EngineMetrics("m", limits, per_expert=True)
    assert _value(metrics, "conveyor:moe_routed_tokens_total") == 0
    assert _value(metrics, "conveyor:moe_expert_tokens_total", layer="3", expert="2") == 0
    # Layer 1: 8 assignments, expert 0 has 4 against a mean of 2 -> 2.0. Layer 3: 2 assignments for 4
    # experts, too few to judge balance: counted, not observed.
    stats = SchedulerStats(1, 0, 0.1, num_batched_tokens=4, expert_tokens=[[4, 2, 1, 1], [0, 1, 1, 0]])
    metrics.on_step(stats)
    assert _value(metrics, "conveyor:moe_routed_tokens_total") == 10
    assert _value(metrics, "conveyor:moe_expert_load_imbalance_count") == 1
    assert _value(metrics, "conveyor:moe_expert_load_imbalance_sum") == 2.0
    assert _value(metrics, "conveyor:moe_expert_tokens_total", layer="1", expert="0") == 4
    assert _value(metrics, "conveyor:moe_expert_tokens_total", layer="3", expert="2") == 1


def test_no_per_expert_series_without_the_flag_and_no_expert_series_for_a_dense_model():
    moe = EngineMetrics("m", EngineLimits(**LIMITS, num_experts=4, sparse_layers=(0,)))
    assert _value(moe, "conveyor:moe_routed_tokens_total") == 0
    assert _value(moe, "conveyor:moe_expert_tokens_total", layer="0", expert="0") is None
    dense = EngineMetrics("m", EngineLimits(**LIMITS))
    assert _value(dense, "conveyor:moe_routed_tokens_total") is None
    dense.on_step(SchedulerStats(1, 0, 0.1, num_batched_tokens=4))
