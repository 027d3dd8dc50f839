"""KV-capacity math (conveyor.server.capacity) against DESIGN.md's worked examples, and its use by the
operator's planner (conveyor.operator.plan).

Unit convention: GPU memory and weights in binary units (1 GiB = 2**30 bytes), KV bytes per token
exact. DESIGN.md's published figures (about 109, 54 and 116 sequences) mix decimal and binary units;
the binary computation gives 112, 56 and 118, which these tests assert exactly, plus a check that each
lies within 5% of the published figure.
"""

import json

import pytest

from conveyor.operator import plan as plan_cli
from conveyor.operator.catalog import GiB, lookup_gpu
from conveyor.operator.plan import (
    KVCacheTooSmallError,
    MaxModelLenTooLongError,
    parse_quantity,
    plan_for_spec,
)
from conveyor.operator.spec import parse_spec
from conveyor.server import capacity
from conveyor.server.capacity import (
    InsufficientGPUMemoryError,
    kv_bytes_per_token,
    max_num_seqs_for_blocks,
    max_num_seqs_for_split_pool,
    plan_capacity,
    split_kv_pool,
)

A100_80GB = 80 * GiB
LLAMA3_8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
LLAMA3_70B = {"num_layers": 80, "num_kv_heads": 8, "head_dim": 128}


def within(value: float, published: float, tolerance: float = 0.05) -> bool:
    return abs(value - published) <= tolerance * published


def test_kv_bytes_per_token_llama3_8b_and_70b() -> None:
    assert kv_bytes_per_token(**LLAMA3_8B, dtype="float16") == 131_072
    assert kv_bytes_per_token(**LLAMA3_70B, dtype="float16") == 327_680


@pytest.mark.parametrize(("max_model_len", "expected", "published"), [(4096, 112, 109), (8192, 56, 54)])
def test_llama3_8b_on_one_a100_80gb(max_model_len: int, expected: int, published: int) -> None:
    plan = plan_capacity(
        **LLAMA3_8B,
        dtype="float16",
        gpu_memory_bytes=A100_80GB,
        weight_bytes=16 * GiB,
        max_model_len=max_model_len,
        gpu_memory_utilization=0.9,
    )
    assert plan.kv_pool_bytes == 56 * GiB
    assert plan.max_num_seqs == expected
    assert within(plan.max_num_seqs, published)
    assert plan.num_kv_blocks == 56 * GiB // (131_072 * 16)


def test_llama3_70b_on_four_a100_80gb_tensor_parallel() -> None:
    plan = plan_capacity(
        **LLAMA3_70B,
        dtype="float16",
        gpu_memory_bytes=A100_80GB,
        weight_bytes=140 * GiB,
        max_model_len=4096,
        num_gpus=4,
        tensor_parallel_size=4,
    )
    # Each GPU holds 2 of the 8 KV heads: a quarter of the per-token bytes.
    assert plan.kv_bytes_per_token == 327_680 // 4
    assert plan.kv_pool_bytes == 148 * GiB
    assert plan.max_num_seqs == 118
    assert within(plan.max_num_seqs, 116)


def test_tensor_parallel_does_not_change_capacity_of_the_same_pool() -> None:
    kwargs = dict(
        **LLAMA3_8B, dtype="bfloat16", gpu_memory_bytes=A100_80GB, weight_bytes=16 * GiB, max_model_len=4096
    )
    tp1 = plan_capacity(**kwargs, num_gpus=2, tensor_parallel_size=1)
    tp2 = plan_capacity(**kwargs, num_gpus=2, tensor_parallel_size=2)
    assert tp2.kv_bytes_per_token == tp1.kv_bytes_per_token // 2
    assert tp1.max_num_seqs == tp2.max_num_seqs == (144 - 16) * 2


def test_weights_that_do_not_fit_raise_with_the_shortfall() -> None:
    with pytest.raises(InsufficientGPUMemoryError) as excinfo:
        plan_capacity(
            **LLAMA3_70B,
            dtype="float16",
            gpu_memory_bytes=A100_80GB,
            weight_bytes=140 * GiB,
            max_model_len=4096,
        )
    err = excinfo.value
    assert err.required_bytes == 140 * GiB
    assert err.available_bytes == 72 * GiB
    assert err.shortfall_bytes == 68 * GiB
    assert "short by 68.00 GiB" in str(err)


def _spec(**overrides: object) -> dict:
    spec = {
        "model": {"name": "llama-3-8b", "maxModelLen": 4096},
        "resources": {"gpuType": "a100-80gb"},
    }
    for path, value in overrides.items():
        section, key = path.split("__")
        spec.setdefault(section, {})[key] = value
    return spec


def test_operator_plan_for_catalog_llama3_8b_reproduces_the_worked_example() -> None:
    """Catalog weights (8.03e9 params x 2 bytes = 14.96 GiB) plus the 1 GiB activation reserve leave
    the same ~56 GiB pool as the worked example's 16 GiB of weights: 112 sequences at 4K."""
    plan = plan_for_spec(parse_spec(_spec()))
    assert plan.capacity.kv_bytes_per_token == 131_072
    assert plan.max_num_seqs == 112
    assert within(plan.max_num_seqs, 109)
    assert plan.gpu_product_label == "NVIDIA-A100-SXM4-80GB"
    eight_k = plan_for_spec(parse_spec(_spec(model__maxModelLen=8192)))
    assert eight_k.max_num_seqs == 56


def test_operator_plan_llama3_70b_needs_four_gpus() -> None:
    with pytest.raises(InsufficientGPUMemoryError):
        plan_for_spec(parse_spec(_spec(model__name="llama-3-70b")))
    plan = plan_for_spec(parse_spec(_spec(model__name="llama-3-70b", resources__gpusPerReplica=4)))
    assert plan.tensor_parallel_size == 4
    assert plan.capacity.kv_bytes_per_token == 81_920
    # The catalog's 70.55e9 parameters are 131.4 GiB in bf16, less than the worked example's round
    # 140 GiB, so the pool (288 - 131.4 - 4 x 1 GiB reserve = 152.6 GiB) holds 122 sequences of 4K.
    assert plan.max_num_seqs == 122


def test_operator_plan_overrides_win_and_engine_max_num_seqs_overrides_result() -> None:
    plan = plan_for_spec(
        parse_spec(_spec(model__name="my-model", model__layers=2, model__kvHeads=1, model__headDim=64,
                         model__params=1_000_000, engine__maxNumSeqs=7))
    )  # fmt: skip
    assert plan.capacity.kv_bytes_per_token == 2 * 2 * 1 * 64 * 2
    assert plan.max_num_seqs == 7
    assert plan.capacity.max_num_seqs > 7


def test_operator_plan_gpu_memory_override() -> None:
    plan = plan_for_spec(parse_spec(_spec(resources__gpuType="mi300x", resources__gpuMemory="192Gi")))
    assert plan.gpu_memory_bytes == 192 * GiB
    assert plan.gpu_product_label is None


def test_kv_cache_too_small_for_one_sequence_is_insufficient_memory() -> None:
    # 8B weights fit on an A10G (22.5 GiB), but 0.9 x 22.5 - 14.96 - 1 = 4.3 GiB holds 33K tokens:
    # not one 131,072-token sequence.
    with pytest.raises(KVCacheTooSmallError) as excinfo:
        plan_for_spec(
            parse_spec(
                _spec(model__name="llama-3.1-8b", model__maxModelLen=131072, resources__gpuType="a10g")
            )
        )
    assert isinstance(excinfo.value, InsufficientGPUMemoryError)
    assert "131072-token sequence" in str(excinfo.value)


def test_max_model_len_beyond_the_models_context_is_rejected() -> None:
    with pytest.raises(MaxModelLenTooLongError, match="8192-token context"):
        plan_for_spec(parse_spec(_spec(model__maxModelLen=16384)))


def test_catalog_gpu_memory_matches_nvidia_smi() -> None:
    assert lookup_gpu("A100-80GB").memory_bytes == 80 * GiB
    assert lookup_gpu("h100").product_label == "NVIDIA-H100-80GB-HBM3"


def test_plan_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_cli.main(["--model", "llama-3-8b", "--gpu", "a100-80gb", "--max-model-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "max_num_seqs        112" in out
    assert "131,072 per GPU" in out


def test_plan_command_counts_lora_slots_with_the_servers_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama-3-8b", "--gpu", "a100-80gb", "--max-model-len", "4096"]
    assert plan_cli.main([*argv, "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]) == 0
    out = capsys.readouterr().out
    assert "lora adapters       0.31 GiB of adapter slots" in out and "max_num_seqs        111" in out
    assert plan_cli.main([*argv, "--max-loras", "4"]) == 0  # without --enable-lora nothing is counted
    assert "lora adapters" not in capsys.readouterr().out
    assert plan_cli.main([*argv, "--enable-lora", "--max-lora-rank", "2048"]) == 1
    assert capsys.readouterr().err.startswith("conveyor plan: error: --max-lora-rank: Input should be less")


def test_plan_command_fails_with_the_shortfall(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama-3-70b", "--gpu", "a100-80gb", "--max-model-len", "4096"]
    assert plan_cli.main(argv) == 1
    assert "short by" in capsys.readouterr().err
    assert plan_cli.main([*argv, "--gpus", "4", "--tensor-parallel-size", "4"]) == 0


def test_plan_command_names_the_field_and_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama-3-8b", "--gpu", "a100-80gb", "--max-model-len", "4096"]
    assert plan_cli.main([*argv, "--block-size", "12"]) == 1
    assert capsys.readouterr().err == "conveyor plan: error: --block-size: Input should be 8, 16 or 32\n"
    assert plan_cli.main([*argv, "--gpus", "0"]) == 1
    assert capsys.readouterr().err.startswith("conveyor plan: error: --gpus: Input should be greater")
    assert plan_cli.main([*argv, "--gpus", "3"]) == 1
    assert capsys.readouterr().err == (
        "conveyor plan: error: --tensor-parallel-size 3 does not divide llama-3-8b's 32 attention heads\n"
    )
    # conveyor serve runs one rank per GPU: idle GPUs are not planned as KV memory.
    assert plan_cli.main([*argv, "--gpus", "4", "--tensor-parallel-size", "2"]) == 1
    assert (
        "--tensor-parallel-size 2 with --gpus 4: conveyor serve runs one rank per GPU"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("quantity", "expected"), [("80Gi", 80 * GiB), ("24G", 24 * 10**9), ("1.5Ti", 1536 * GiB), ("1024", 1024)]
)
def test_parse_quantity(quantity: str, expected: int) -> None:
    assert parse_quantity(quantity) == expected


def test_parse_quantity_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="not a memory quantity"):
        parse_quantity("lots")


def test_plan_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "smollm2-135m", "--gpu", "l4", "--max-model-len", "4096", "--json"]
    assert plan_cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["capacity"]["kv_bytes_per_token"] == 23040
    assert data["max_num_seqs"] == 216
    assert data["gpu_product_label"] == "NVIDIA-L4"


def test_a_sequence_holds_whole_blocks() -> None:
    """10 blocks of 16 tokens hold 5 sequences of 17 tokens (2 blocks each), not 160 // 17 = 9."""
    assert capacity.max_num_seqs_for_blocks(10, 16, 17) == 5
    assert capacity.max_num_seqs_for_blocks(10, 16, 16) == 10
    assert capacity.max_num_seqs_for_blocks(28_693, 16, 4096) == 112


def test_operator_plans_qwen3_and_gemma3_specs() -> None:
    """Qwen3-8B on an H100 at 8K: 2 x 36 layers x 8 KV heads x 128 x 2 bytes = 147,456 bytes per token;
    (71.68 GiB usable - 15.26 GiB of weights - 1 GiB) // (147,456 x 16) = 25,225 blocks, 49 sequences of
    512 blocks. Gemma 3 270M (one KV head of 256, 18 layers) on an L4 at its 32K positions: 18,432 bytes
    per token, 3,072 of them in its 3 global layers, 15,360 in its 15 sliding ones (window 512); the
    sliding layers hold ceil(511 / 16) + 2 = 34 blocks per sequence plus 2048 / 16 = 128 for a step's
    new tokens, so (20,127,671,449 - 128 x 15,360 x 16) // (2,048 x 3,072 x 16 + 34 x 15,360 x 16) =
    184 sequences (33 if every layer held every token), in 6,384 sliding blocks and 377,578 global ones
    (>= 184 x 2,048)."""
    qwen = plan_for_spec(
        parse_spec(
            _spec(model__name="Qwen/Qwen3-8B", model__maxModelLen=8192, resources__gpuType="h100-80gb")
        )
    )
    assert (qwen.capacity.kv_bytes_per_token, qwen.capacity.num_kv_blocks, qwen.max_num_seqs) == (
        147_456,
        25_225,
        49,
    )
    gemma = plan_for_spec(
        parse_spec(_spec(model__name="gemma-3-270m", model__maxModelLen=32768, resources__gpuType="l4"))
    )
    cap = gemma.capacity
    assert (cap.kv_bytes_per_token, gemma.max_num_seqs) == (18_432, 184)
    assert (cap.num_window_blocks, cap.num_kv_blocks, cap.sliding_window) == (6_384, 377_578, 512)


def test_operator_plans_mixture_of_experts_specs_with_every_expert_in_the_weights(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Qwen3-30B-A3B on an H200 at 8K: all 128 experts of its 48 layers are weights (30.53e9 params x 2
    bytes = 56.87 GiB, though 3.3e9 are active per token); KV only for the attention layers, 2 x 48 x 4
    KV heads x 128 x 2 bytes = 98,304 bytes per token; (126.36 GiB usable - 56.87 - 1) // (98,304 x 16)
    = 46,756 blocks, 91 sequences of 512 blocks. The table names the experts."""
    qwen = plan_for_spec(
        parse_spec(
            _spec(model__name="Qwen/Qwen3-30B-A3B", model__maxModelLen=8192, resources__gpuType="h200-141gb")
        )
    )
    assert qwen.weight_bytes == 30_532_122_624 * 2
    assert (qwen.capacity.kv_bytes_per_token, qwen.capacity.num_kv_blocks, qwen.max_num_seqs) == (
        98_304,
        46_756,
        91,
    )
    # Mixtral-8x7B (93.4 GB of weights) does not fit one H100 but fits two, its experts split over both.
    mixtral = plan_for_spec(
        parse_spec(
            _spec(model__name="mixtral-8x7b", resources__gpuType="h100-80gb", resources__gpusPerReplica=2)
        )
    )
    assert (mixtral.tensor_parallel_size, mixtral.weight_bytes) == (2, 46_702_792_704 * 2)
    assert mixtral.max_num_seqs > 0
    assert plan_cli.main(["--model", "mixtral-8x7b", "--gpu", "h200", "--max-model-len", "8192"]) == 0
    assert "experts             8 per sparse layer, 2 per token" in capsys.readouterr().out


def test_every_layer_sliding_counts_the_window_not_max_model_len() -> None:
    """Mistral 7B v0.1 (window 4,096 on all 32 layers) on an H100 at 32K: 29,283 blocks of 16 tokens;
    a sequence holds at most ceil(4,095 / 16) + 2 = 258 of them and a 2,048-token step 128 more, so
    (29,283 - 128) // 258 = 113 sequences where counting max_model_len gives 29,283 // 2,048 = 14."""
    plan = plan_for_spec(
        parse_spec(_spec(model__name="mistral-7b", model__maxModelLen=32768, resources__gpuType="h100-80gb"))
    )
    cap = plan.capacity
    assert (cap.num_kv_blocks, cap.sliding_window, cap.num_window_blocks) == (29_283, 4096, 0)
    assert plan.max_num_seqs == 113 == (29_283 - 128) // 258
    assert max_num_seqs_for_blocks(29_283, 16, 32768) == 14


def test_a_window_longer_than_the_sequence_changes_nothing() -> None:
    """A window that a max_model_len sequence never outgrows counts like a global layer, and a split
    pool never plans fewer sequences than counting every token of every layer."""
    assert max_num_seqs_for_blocks(1000, 16, 512, sliding_window=4096, max_num_batched_tokens=2048) == 31
    pool, full, window = 10 * GiB, 3 * 4096, 15 * 4096
    for max_model_len in (256, 512, 8192, 32768):
        every_token = pool // ((full + window) * 16) // -(-max_model_len // 16)
        split = max_num_seqs_for_split_pool(pool, full, window, 16, 512, max_model_len, 2048)
        assert split >= every_token
        num_full, num_window = split_kv_pool(pool, full, window, 16, 512, split, 2048)
        assert num_full >= split * -(-max_model_len // 16)
        assert num_full * full * 16 + num_window * window * 16 <= pool
