"""KV-cache capacity math, shared by the server (pool sizing) and the operator (replica sizing).

Pure Python: no torch import, so the operator image stays small. Formulas (DESIGN.md, as in vLLM's
`gpu_memory_utilization` profiling and its "maximum concurrency" log line):

    kv_bytes_per_token = 2 * num_layers * (num_kv_heads / tensor_parallel_size) * head_dim * dtype_bytes
    kv_pool_bytes      = gpu_memory_bytes * gpu_memory_utilization * num_gpus - weight_bytes
                         - activation_reserve_bytes
    num_kv_blocks      = floor(kv_pool_bytes / (kv_bytes_per_token_all_gpus * block_size))
    max_num_seqs       = floor(num_kv_blocks / ceil(max_model_len / block_size))  (whole blocks a sequence)

`kv_bytes_per_token` is reported per GPU (what one GPU stores for one token); the pool spans all
`num_gpus`, so pool divisions use the per-token bytes summed over the tensor-parallel group. `partition`
is how tensor parallelism splits a model's heads over ranks, the rule behind `num_kv_heads / tp`.

Sliding-window layers hold at most their window per sequence (the KV cache gives back the blocks
behind it, `engine.kv_cache`), so they count the window, not `max_model_len` (vLLM's hybrid KV cache
manager counts the same way; its `SlidingWindowSpec.max_memory_usage_bytes`):

    window_blocks_per_seq = ceil((sliding_window - 1) / block_size) + 2
                            (the window behind a sequence's next token, a partial block on each side)
    sliding blocks        <= max_num_seqs * window_blocks_per_seq + ceil(max_num_batched_tokens / block_size)
                            (a step's new tokens are written before the blocks behind them go back)

Where every layer slides (Mistral v0.1) one pool holds them; where only some do (Gemma 2/3), the
sliding layers get a pool of their own of at most that many blocks (`split_kv_pool`), and the global
layers the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


class InsufficientGPUMemoryError(ValueError):
    """The weights (plus the activation reserve) do not fit in the usable GPU memory.

    Attributes are bytes: `required_bytes` (weights + reserve), `available_bytes` (usable memory),
    `shortfall_bytes` (their difference, > 0).
    """

    def __init__(self, required_bytes: int, available_bytes: int) -> None:
        self.required_bytes = required_bytes
        self.available_bytes = available_bytes
        self.shortfall_bytes = required_bytes - available_bytes
        super().__init__(
            f"model weights and activation reserve need {required_bytes / 2**30:.2f} GiB but only "
            f"{available_bytes / 2**30:.2f} GiB of GPU memory is usable: short by "
            f"{self.shortfall_bytes / 2**30:.2f} GiB"
        )


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a KV-cache dtype name (`float16`, `bfloat16`, `float32`, `fp8`).

    Raises ValueError for an unknown name.
    """
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}") from None


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, tensor_parallel_size: int = 1
) -> int:
    """Bytes of K and V that one GPU stores per token (of `num_layers` layers; 0 for none).

    With tensor parallelism the KV heads are split across GPUs; a KV head is replicated when there are
    fewer KV heads than GPUs (as vLLM does), so each GPU holds `max(1, num_kv_heads // tp)` heads.
    """
    if num_layers < 0 or min(num_kv_heads, head_dim, tensor_parallel_size) < 1:
        raise ValueError("num_layers must be >= 0, num_kv_heads, head_dim and tensor_parallel_size >= 1")
    heads_per_gpu = max(1, num_kv_heads // tensor_parallel_size)
    return 2 * num_layers * heads_per_gpu * head_dim * dtype_bytes(dtype)


def lora_slot_bytes(
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    max_loras: int,
    max_lora_rank: int,
    dtype: str,
    dense_mlp: bool = True,
) -> int:
    """Bytes of `--max-loras` adapter slots of rank `--max-lora-rank` on every layer's q/k/v, o,
    gate/up and down projections, as the server allocates them (`model.lora.LoRASlots`): per fused
    projection and slot, A is `[slices * R, in]` and B `[R, sum of slice widths]`, so per layer and slot
    R * (4 h + 2 q + 2 kv) elements for attention and R * (3 h + 3 I) for a dense MLP (h hidden,
    q = heads * head_dim, kv = kv heads * head_dim, I the MLP's width; `dense_mlp=False`: a mixture of
    experts, whose MLPs take no adapters)."""
    q, kv, h = num_heads * head_dim, num_kv_heads * head_dim, hidden_size
    per_slot = max_lora_rank * (4 * h + 2 * q + 2 * kv + (3 * h + 3 * intermediate_size if dense_mlp else 0))
    return num_layers * max_loras * per_slot * dtype_bytes(dtype)


def sliding_layers(config) -> tuple[int | None, tuple[bool, ...]]:
    """(window, which layers slide) of a transformers config (an object, or config.json's dict):
    Mistral's `sliding_window` on every layer; Qwen2/3's only under `use_sliding_window`; `layer_types`
    where the config has it (Gemma 2/3, Qwen). (None, ()) when no layer slides."""
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    window = get("sliding_window")
    if not window or get("use_sliding_window", True) is False:
        return None, ()
    layer_types = get("layer_types")
    if layer_types is None:
        sliding = (True,) * get("num_hidden_layers")
    else:
        sliding = tuple(t == "sliding_attention" for t in layer_types)
    if not any(sliding):
        return None, ()
    return int(window), sliding


def window_blocks_per_seq(sliding_window: int, block_size: int) -> int:
    """Blocks a sequence's sliding layers hold at most, besides its step's new tokens: the
    `sliding_window - 1` positions behind its next token, plus a partial block at either end."""
    return -(-(sliding_window - 1) // block_size) + 2


def split_kv_pool(
    pool_bytes: int,
    full_bytes_per_token: int,
    window_bytes_per_token: int,
    block_size: int,
    sliding_window: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> tuple[int, int]:
    """(blocks of the global layers' pool, blocks of the sliding layers' pool) for a model whose
    sliding layers keep their K/V apart (bytes per token of all GPUs, each kind's layers): the sliding
    pool gets what `max_num_seqs` sequences and a step's `max_num_batched_tokens` new tokens can hold
    (module docstring), at most as many blocks as the global pool; the global pool the rest."""
    even = pool_bytes // ((full_bytes_per_token + window_bytes_per_token) * block_size)
    bound = max_num_seqs * window_blocks_per_seq(sliding_window, block_size) + -(
        -max_num_batched_tokens // block_size
    )
    num_window = min(bound, even)
    return (pool_bytes - num_window * window_bytes_per_token * block_size) // (
        full_bytes_per_token * block_size
    ), num_window


def max_num_seqs_for_split_pool(
    pool_bytes: int,
    full_bytes_per_token: int,
    window_bytes_per_token: int,
    block_size: int,
    sliding_window: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> int:
    """The most sequences of `max_model_len` tokens whose KV fits when the pool is split as
    `split_kv_pool` splits it for that many: the global layers hold every token of each, the sliding
    layers their windows."""
    blocks_per_seq = -(-max_model_len // block_size)

    def fits(num_seqs: int) -> bool:
        num_full, _ = split_kv_pool(
            pool_bytes,
            full_bytes_per_token,
            window_bytes_per_token,
            block_size,
            sliding_window,
            num_seqs,
            max_num_batched_tokens,
        )
        return num_full >= num_seqs * blocks_per_seq

    low = pool_bytes // ((full_bytes_per_token + window_bytes_per_token) * block_size) // blocks_per_seq
    high = pool_bytes // (full_bytes_per_token * block_size) // blocks_per_seq
    while low < high:  # fits() holds for low and turns false once, as num_seqs grows
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


@dataclass(frozen=True)
class CapacityPlan:
    """The result of `plan_capacity`. Bytes and token counts; `max_num_seqs` is the number of sequences
    of `max_model_len` tokens whose KV fits in the pool at once. With sliding layers, `sliding_window`;
    `num_window_blocks` is their own pool where only some layers slide (else 0)."""

    kv_bytes_per_token: int
    kv_pool_bytes: int
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    sliding_window: int | None = None
    num_window_blocks: int = 0

    @property
    def max_concurrency(self) -> float:
        """Sequences of `max_model_len` tokens that fit, unrounded (vLLM's "maximum concurrency"); with
        sliding layers, `max_num_seqs`."""
        if self.sliding_window is not None:
            return float(self.max_num_seqs)
        return self.num_kv_blocks * self.block_size / self.max_model_len


def plan_capacity(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    gpu_memory_bytes: int,
    weight_bytes: int,
    max_model_len: int,
    gpu_memory_utilization: float = 0.9,
    num_gpus: int = 1,
    tensor_parallel_size: int | None = None,
    activation_reserve_bytes: int = 0,
    block_size: int = 16,
    draft_kv_bytes_per_token: int = 0,
    num_sliding_layers: int = 0,
    sliding_window: int | None = None,
    max_num_batched_tokens: int = 2048,
) -> CapacityPlan:
    """Size the KV pool of one replica of `num_gpus` GPUs.

    gpu_memory_bytes: memory of one GPU. weight_bytes: all weights of the replica (a draft model's
    included). tensor_parallel_size defaults to `num_gpus`. draft_kv_bytes_per_token: a speculative
    draft model's K/V per token (it runs on one rank, tensor_parallel_size 1), held beside the target's
    in the same blocks (the blocks are then all kept: sliding layers count every token).
    num_sliding_layers of the `num_layers` attend to the last `sliding_window` tokens only; they count
    their window (module docstring), with `max_num_batched_tokens` (`--max-num-batched-tokens`) a step's
    most new tokens. Raises InsufficientGPUMemoryError when the weights and reserve do not fit,
    ValueError on nonsensical inputs.
    """
    tp = num_gpus if tensor_parallel_size is None else tensor_parallel_size
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if max_model_len < 1 or block_size < 1 or num_gpus < 1:
        raise ValueError("max_model_len, block_size and num_gpus must be >= 1")
    if sliding_window is None or draft_kv_bytes_per_token:
        num_sliding_layers = 0
    full = kv_bytes_per_token(num_layers - num_sliding_layers, num_kv_heads, head_dim, dtype, tp)
    full += draft_kv_bytes_per_token
    window = kv_bytes_per_token(num_sliding_layers, num_kv_heads, head_dim, dtype, tp)
    usable = int(gpu_memory_bytes * gpu_memory_utilization * num_gpus)
    required = weight_bytes + activation_reserve_bytes
    if required >= usable:
        raise InsufficientGPUMemoryError(required, usable)
    pool = usable - required
    num_window_blocks = 0
    if num_sliding_layers and full:  # some layers slide: two pools
        max_num_seqs = max_num_seqs_for_split_pool(
            pool, full * tp, window * tp, block_size, sliding_window, max_model_len, max_num_batched_tokens
        )
        num_blocks, num_window_blocks = split_kv_pool(
            pool, full * tp, window * tp, block_size, sliding_window, max_num_seqs, max_num_batched_tokens
        )
    else:
        num_blocks = num_kv_blocks_for_pool(pool, (full + window) * tp, block_size)
        every_layer_slides = sliding_window if num_sliding_layers else None
        max_num_seqs = max_num_seqs_for_blocks(
            num_blocks, block_size, max_model_len, every_layer_slides, max_num_batched_tokens
        )
    return CapacityPlan(
        kv_bytes_per_token=full + window,
        kv_pool_bytes=pool,
        max_num_seqs=max_num_seqs,
        num_kv_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        sliding_window=sliding_window if num_sliding_layers else None,
        num_window_blocks=num_window_blocks,
    )


def num_kv_blocks_for_pool(kv_pool_bytes: int, kv_bytes_per_token_all_gpus: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that fit in a pool of `kv_pool_bytes` bytes."""
    return kv_pool_bytes // (kv_bytes_per_token_all_gpus * block_size)


def max_num_seqs_for_blocks(
    num_kv_blocks: int,
    block_size: int,
    max_model_len: int,
    sliding_window: int | None = None,
    max_num_batched_tokens: int = 0,
) -> int:
    """Sequences of `max_model_len` tokens whose KV fits in `num_kv_blocks` blocks at once: the one
    `max_num_seqs` rule, for the operator's plan and the server's start-up alike. Each sequence holds
    whole blocks, `ceil(max_model_len / block_size)` of them (vLLM's
    `get_max_concurrency_for_kv_cache_config`), so this can be less than pool bytes / (bytes per token
    x max_model_len). With a `sliding_window` on every layer, a sequence holds at most its window's
    blocks, and a step's `max_num_batched_tokens` new tokens need theirs (module docstring)."""
    blocks_per_seq = -(-max_model_len // block_size)
    whole = num_kv_blocks // blocks_per_seq
    if sliding_window is None:
        return whole
    step_blocks = -(-max_num_batched_tokens // block_size)
    return max(
        whole, max(0, num_kv_blocks - step_blocks) // window_blocks_per_seq(sliding_window, block_size)
    )


@dataclass(frozen=True)
class Partition:
    """One rank's share of a model (counts, and the first index of its slice in the full model).

    `vocab_per_rank` rows per rank, the last rank's padded with zero rows past `vocab_size`.
    """

    rank: int
    size: int
    num_heads: int
    head_start: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    vocab_per_rank: int

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank


def partition(
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    rank: int,
    size: int,
    setting: str = "--tensor-parallel-size",
) -> Partition:
    """Rank `rank`'s share of a model split over `size` tensor-parallel ranks (Megatron-LM's split of
    heads and MLP rows; KV heads replicated when fewer than ranks, as vLLM does).

    Raises ValueError naming `setting`, its value and the model's number when `size` does not divide
    the attention heads or the MLP's intermediate size, or when the KV heads neither split over nor
    replicate evenly across the ranks.
    """
    flag = f"{setting} {size}"
    if num_heads % size:
        raise ValueError(f"{flag} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"{flag} neither divides the model's {num_kv_heads} KV heads nor is a multiple of them"
        )
    if intermediate_size % size:
        raise ValueError(f"{flag} does not divide the model's MLP intermediate size {intermediate_size}")
    heads = num_heads // size
    if num_kv_heads >= size:
        kv_heads, kv_start = num_kv_heads // size, rank * (num_kv_heads // size)
    else:  # replicated: ranks [k * r, (k + 1) * r) share KV head k, r = size / num_kv_heads
        kv_heads, kv_start = 1, rank // (size // num_kv_heads)
    return Partition(
        rank=rank,
        size=size,
        num_heads=heads,
        head_start=rank * heads,
        num_kv_heads=kv_heads,
        kv_head_start=kv_start,
        intermediate_size=intermediate_size // size,
        vocab_per_rank=-(-vocab_size // size),
    )
