"""Kernel microbenchmarks on one CUDA device.

Times every Triton kernel in `conveyor.kernels.triton` with `triton.testing.do_bench` (median of
repeated runs) over Llama-3-8B (32 query heads, 8 KV heads, head_dim 128) and SmolLM2-135M (9/3/64)
shapes, batch 1..256, context 128..8192, block size 16, and prints one markdown table:

- achieved bandwidth in GB/s (1e9 bytes/s) counting the bytes a kernel must move at least once
  (K/V of every context token read once, queries read, outputs written, ...), and its fraction of the
  device's copy bandwidth, measured in the same run as a large device-to-device copy (read + write);
- for attention also TFLOP/s (2 matmuls of 2 FLOPs per multiply-add over the visible positions), next
  to a large bfloat16 matmul measured in the same run;
- a baseline: decode attention against torch SDPA over the same K/V gathered into contiguous
  `[batch, kv_heads, context, head_dim]` tensors (its output is also compared: `max |diff|`), the
  other kernels against their torch references on the same tensors.

    python benchmarks/kernels.py [--dtype bfloat16|float16] [--quick]

Needs a CUDA device, torch and triton, nothing else: when the `conveyor` distribution is not
installed, the kernels are loaded from this checkout's `kernels/` folder. Exits with status 2 and a
message when no CUDA device is present.
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python benchmarks/kernels.py` puts this folder first on sys.path, where serve.py, datasets.py and
# metrics.py would shadow installed modules of those names.
_HERE = Path(__file__).resolve().parent
if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == _HERE:
    sys.path.pop(0)

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from types import ModuleType  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

Timer = Callable[[Callable[[], object]], float]  # runs fn repeatedly, returns milliseconds


@dataclass(frozen=True)
class ModelShape:
    """The per-layer dimensions the kernels see."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int


LLAMA3_8B = ModelShape("Llama-3-8B", 32, 8, 128, 4096, 14336)
SMOLLM2 = ModelShape("SmolLM2-135M", 9, 3, 64, 576, 1536)
MODELS = (LLAMA3_8B, SMOLLM2)
BLOCK_SIZE = 16
DECODE_BATCHES = (1, 8, 32, 128, 256)
DECODE_CONTEXTS = (128, 1024, 4096, 8192)
# (sequences, query rows per sequence, context per sequence): full prefills and chunks of long prompts.
PREFILL_CASES = ((1, 512, 512), (1, 2048, 2048), (1, 8192, 8192), (4, 512, 4096))
# A continuous-batching step: one 512-token chunk of a 2048-token prompt beside 64 decodes at 2048.
MIXED_CASE = (1, 512, 2048, 64)
TOKEN_COUNTS = (1, 64, 256, 4096)


@dataclass
class Row:
    kernel: str
    model: str
    shape: str
    ms: float
    bytes_moved: float
    flops: float = 0.0
    baseline: str = ""
    baseline_ms: float = float("nan")
    max_diff: float = float("nan")


def import_kernels() -> tuple[ModuleType, ModuleType]:
    """(reference, triton) kernel modules, from the installed distribution or from this checkout."""
    try:
        return importlib.import_module("conveyor.kernels.reference"), importlib.import_module(
            "conveyor.kernels.triton"
        )
    except ModuleNotFoundError:
        pass
    root = _HERE.parent
    if "conveyor" not in sys.modules:
        namespace = ModuleType("conveyor")
        namespace.__path__ = []  # a package with no code of its own, as when installed
        sys.modules["conveyor"] = namespace
    spec = importlib.util.spec_from_file_location(
        "conveyor.kernels",
        root / "kernels" / "__init__.py",
        submodule_search_locations=[str(root / "kernels")],
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["conveyor.kernels"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("conveyor.kernels.reference"), importlib.import_module(
        "conveyor.kernels.triton"
    )


def do_bench_median(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def measure_copy_gbs(device: torch.device, timer: Timer, num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting the read and the write."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, timer: Timer, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = timer(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


class PagedKV:
    """`num_seqs` sequences of `context` tokens each in a paged cache, their blocks randomly placed."""

    def __init__(self, m: ModelShape, num_seqs: int, context: int, dtype: torch.dtype, device: torch.device):
        blocks_per_seq = -(-context // BLOCK_SIZE)
        num_blocks = num_seqs * blocks_per_seq + 1
        shape = (num_blocks, BLOCK_SIZE, m.num_kv_heads, m.head_dim)
        self.key_cache = torch.randn(shape, dtype=dtype, device=device)
        self.value_cache = torch.randn(shape, dtype=dtype, device=device)
        # Block 0 is never used, as in the engine; the rest in random order (no accidental contiguity).
        perm = torch.randperm(num_blocks - 1, device=device)[: num_seqs * blocks_per_seq] + 1
        self.block_tables = perm.view(num_seqs, blocks_per_seq).int()
        self.seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
        self.context = context

    def contiguous(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V as `[num_seqs, num_kv_heads, context, head_dim]`."""

        def gather(cache: torch.Tensor) -> torch.Tensor:
            g = cache[self.block_tables.long()]  # [B, nb, bs, kvh, d]
            g = g.reshape(g.shape[0], -1, *cache.shape[2:])[:, : self.context]
            return g.transpose(1, 2).contiguous()

        return gather(self.key_cache), gather(self.value_cache)

    def kv_bytes(self) -> int:
        b, nb = self.block_tables.shape
        per_token = self.key_cache[0, 0].numel() * self.key_cache.element_size() * 2
        return b * self.context * per_token


def _fits(num_bytes: float, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return num_bytes < 0.4 * free


def bench_decode(
    tk: ModuleType,
    m: ModelShape,
    batch: int,
    context: int,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
) -> Row | None:
    # Cache + gathered copy for SDPA.
    if not _fits(4 * batch * context * m.num_kv_heads * m.head_dim * torch.finfo(dtype).bits // 8, device):
        return None
    kv = PagedKV(m, batch, context, dtype, device)
    query = torch.randn(batch, m.num_heads, m.head_dim, dtype=dtype, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    scale = m.head_dim**-0.5
    args = (
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        query_start_loc,
        kv.seq_lens,
        scale,
        1,
        context,
    )
    ms = timer(lambda: tk.paged_attention(*args))
    k, v = kv.contiguous()
    groups = m.num_heads // m.num_kv_heads
    # The query heads of one KV head folded into the query-length axis: SDPA's fastest GQA decode form.
    q = query.view(batch, m.num_kv_heads, groups, m.head_dim)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    sdpa_ms = timer(sdpa)
    diff = (
        (tk.paged_attention(*args).float() - sdpa().reshape(batch, m.num_heads, -1).float())
        .abs()
        .max()
        .item()
    )
    io_bytes = 2 * query.numel() * query.element_size()
    return Row(
        kernel="paged_attention decode",
        model=m.name,
        shape=f"batch {batch}, context {context}",
        ms=ms,
        bytes_moved=kv.kv_bytes() + io_bytes,
        flops=4 * batch * m.num_heads * m.head_dim * context,
        baseline="SDPA contiguous",
        baseline_ms=sdpa_ms,
        max_diff=diff,
    )


def bench_prefill(
    tk: ModuleType,
    m: ModelShape,
    num_seqs: int,
    q_len: int,
    context: int,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
    decodes: int = 0,
) -> Row | None:
    """Prefill/chunked-prefill rows (the last q_len of `context` tokens), plus `decodes` decode rows at
    the same context in the same step when nonzero (a continuous-batching step)."""
    total = num_seqs + decodes
    if not _fits(2 * total * context * m.num_kv_heads * m.head_dim * torch.finfo(dtype).bits // 8, device):
        return None
    kv = PagedKV(m, total, context, dtype, device)
    q_lens = torch.tensor([q_len] * num_seqs + [1] * decodes, device=device)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long, device=device), q_lens.cumsum(0)]).int()
    num_tokens = int(q_lens.sum())
    query = torch.randn(num_tokens, m.num_heads, m.head_dim, dtype=dtype, device=device)
    args = (
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        query_start_loc,
        kv.seq_lens,
        m.head_dim**-0.5,
    )
    ms = timer(lambda: tk.paged_attention(*args, q_len, context))
    # Row i of a chunk sees context - q_len + i + 1 positions.
    visible = num_seqs * (q_len * (context - q_len) + q_len * (q_len + 1) // 2) + decodes * context
    name = "paged_attention mixed" if decodes else "paged_attention prefill"
    shape = f"{num_seqs} x {q_len} rows, context {context}" + (f", + {decodes} decodes" if decodes else "")
    return Row(
        kernel=name,
        model=m.name,
        shape=shape,
        ms=ms,
        bytes_moved=kv.kv_bytes() + 2 * query.numel() * query.element_size(),
        flops=4 * m.num_heads * m.head_dim * visible,
    )


def bench_small_kernels(
    tk: ModuleType,
    ref: ModuleType,
    m: ModelShape,
    num_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
) -> list[Row]:
    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device)

    def row(kernel: str, fn: Callable[[], object], ref_fn: Callable[[], object], num_bytes: int) -> Row:
        return Row(
            kernel=kernel,
            model=m.name,
            shape=f"{num_tokens} tokens",
            ms=timer(fn),
            bytes_moved=num_bytes,
            baseline="torch reference",
            baseline_ms=timer(ref_fn),
        )

    e = torch.finfo(dtype).bits // 8
    h = m.hidden_size
    rows = []
    x, residual, weight = rnd(num_tokens, h), rnd(num_tokens, h), rnd(h)
    rows.append(
        row(
            "rms_norm",
            lambda: tk.rms_norm(x, weight, 1e-5),
            lambda: ref.rms_norm(x, weight, 1e-5),
            (2 * num_tokens * h + h) * e,
        )
    )
    rows.append(
        row(
            "fused_add_rms_norm",
            lambda: tk.fused_add_rms_norm(x, residual, weight, 1e-5),
            lambda: ref.fused_add_rms_norm(x, residual, weight, 1e-5),
            (4 * num_tokens * h + h) * e,
        )
    )
    gate_up = rnd(num_tokens, 2 * m.intermediate_size)
    rows.append(
        row(
            "silu_and_mul",
            lambda: tk.silu_and_mul(gate_up),
            lambda: ref.silu_and_mul(gate_up),
            3 * num_tokens * m.intermediate_size * e,
        )
    )
    cos_sin = ref.rope_cos_sin_cache(m.head_dim, 8192, 500000.0).to(device)
    positions = torch.randint(0, 8192, (num_tokens,), device=device)
    q, k = rnd(num_tokens, m.num_heads, m.head_dim), rnd(num_tokens, m.num_kv_heads, m.head_dim)
    rows.append(
        row(
            "rotary_embedding",
            lambda: tk.rotary_embedding(positions, q, k, cos_sin),
            lambda: ref.rotary_embedding(positions, q, k, cos_sin),
            2 * (q.numel() + k.numel()) * e + num_tokens * m.head_dim * 4,
        )
    )
    blocks = -(-num_tokens // BLOCK_SIZE) * 4
    key_cache = rnd(blocks, BLOCK_SIZE, m.num_kv_heads, m.head_dim)
    value_cache = rnd(blocks, BLOCK_SIZE, m.num_kv_heads, m.head_dim)
    value = rnd(num_tokens, m.num_kv_heads, m.head_dim)
    slots = torch.randperm(blocks * BLOCK_SIZE, device=device)[:num_tokens]
    rows.append(
        row(
            "reshape_and_cache",
            lambda: tk.reshape_and_cache(k, value, key_cache, value_cache, slots),
            lambda: ref.reshape_and_cache(k, value, key_cache, value_cache, slots),
            4 * k.numel() * e,
        )
    )
    return rows


def run(
    ref: ModuleType,
    tk: ModuleType,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
    quick: bool = False,
) -> list[Row]:
    """Every benchmark row; `quick` keeps one model and the smallest and largest of each sweep."""
    models = MODELS[:1] if quick else MODELS
    batches = (DECODE_BATCHES[0], DECODE_BATCHES[-1]) if quick else DECODE_BATCHES
    contexts = (DECODE_CONTEXTS[0], DECODE_CONTEXTS[-1]) if quick else DECODE_CONTEXTS
    prefills = PREFILL_CASES[::3] if quick else PREFILL_CASES
    tokens = TOKEN_COUNTS[::3] if quick else TOKEN_COUNTS
    rows: list[Row] = []
    for m in models:
        for batch in batches:
            for context in contexts:
                row = bench_decode(tk, m, batch, context, dtype, device, timer)
                if row is None:
                    print(
                        f"skipped {m.name} decode batch {batch} context {context}: not enough memory",
                        file=sys.stderr,
                    )
                else:
                    rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the next shape may need the memory this one cached
        for num_seqs, q_len, context in prefills:
            row = bench_prefill(tk, m, num_seqs, q_len, context, dtype, device, timer)
            rows.extend([row] if row else [])
        num_seqs, q_len, context, decodes = MIXED_CASE
        mixed = bench_prefill(tk, m, num_seqs, q_len, context, dtype, device, timer, decodes=decodes)
        rows.extend([mixed] if mixed else [])
        for num_tokens in tokens:
            rows.extend(bench_small_kernels(tk, ref, m, num_tokens, dtype, device, timer))
    return rows


def format_table(rows: list[Row], copy_gbs: float) -> str:
    lines = [
        "| kernel | model | shape | Triton µs | GB/s | % of copy BW | TFLOP/s | baseline | baseline µs | speedup | max abs diff |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        gbs = r.bytes_moved / (r.ms * 1e-3) / 1e9
        tflops = f"{r.flops / (r.ms * 1e-3) / 1e12:.1f}" if r.flops else ""
        base = f"{r.baseline_ms * 1e3:.1f}" if not math.isnan(r.baseline_ms) else ""
        speedup = f"{r.baseline_ms / r.ms:.2f}x" if not math.isnan(r.baseline_ms) else ""
        diff = f"{r.max_diff:.1e}" if not math.isnan(r.max_diff) else ""
        lines.append(
            f"| {r.kernel} | {r.model} | {r.shape} | {r.ms * 1e3:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% "
            f"| {tflops} | {r.baseline} | {base} | {speedup} | {diff} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="one model, the ends of each sweep")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/kernels.py needs a CUDA device: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). "
            "The kernels' correctness tests run on CPU: pytest tests/integration/test_kernels_backends.py",
            file=sys.stderr,
        )
        return 2
    import triton

    ref, tk = import_kernels()
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    copy_gbs = measure_copy_gbs(device, do_bench_median)
    matmul_tflops = measure_matmul_tflops(device, dtype, do_bench_median)
    rows = run(ref, tk, dtype, device, do_bench_median, quick=args.quick)
    print(
        f"{torch.cuda.get_device_name(device)}, {datetime.date.today().isoformat()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, {args.dtype}, block size {BLOCK_SIZE}; "
        f"device-to-device copy {copy_gbs:.0f} GB/s, {args.dtype} matmul 8192^3 {matmul_tflops:.0f} TFLOP/s; "
        "times are medians of triton.testing.do_bench\n"
    )
    print(format_table(rows, copy_gbs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
