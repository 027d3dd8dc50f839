"""Every kernel of the `cpu` (C++) and `triton` backends against its torch reference: the C++ kernels
compiled for this CPU, the Triton kernels on CPU under Triton's interpreter and compiled on CUDA (`gpu`
marker) when a device is present.

Triton reads TRITON_INTERPRET once per function when `@triton.jit` decorates it, and its own library
(`tl.sum`, `tl.max`, ...) is decorated when `triton` is first imported, which transformers' model code
does as a side effect. So without a GPU this module sets the variable when it is collected, before any
test runs; it cannot be scoped to these tests. Nothing else uses Triton on CPU, and on a CUDA machine
the variable is left alone so the `gpu` tests run compiled kernels.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from types import ModuleType

import pytest
import torch

from conveyor.kernels import KERNEL_NAMES, cpu
from conveyor.kernels import reference as ref

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# (num_heads, num_kv_heads, head_dim, block_size): the head ratios 9:3 (SmolLM2), 32:8 (Llama-3-8B),
# 2:1 and 1:1, head_dim 64 and 128, block sizes 8, 16 and 32 (the C++ decode kernel scores 16 tokens at
# a time, so a block of 8 splits them).
LAYOUTS = [
    (9, 3, 64, 16),
    (9, 3, 64, 32),
    (32, 8, 128, 16),
    (4, 4, 128, 32),
    (2, 2, 64, 16),
    (8, 4, 64, 8),
]
LAYOUT_IDS = ["h{}_kv{}_d{}_bs{}".format(*x) for x in LAYOUTS]
DTYPES = [torch.float32, torch.bfloat16]
# Decodes at 1, 15, 16, 17 and a few hundred tokens of context, in one batch.
DECODE_BATCH = [(1, 1), (15, 1), (16, 1), (17, 1), (300, 1)]
# (seq_len, q_len): decodes, full prefills and chunked prefills (cached prefix + chunk), in one batch.
MIXED_BATCH = [(1, 1), (15, 15), (16, 1), (17, 5), (300, 40), (33, 33), (200, 1), (16, 16)]
# Sliding windows by their size against the layout's block and the batches' contexts (at most 300
# tokens): a window of 1 (each row sees itself only), within a block, exactly a block, a few blocks,
# and longer than any context (the same as none). The chunks (17, 5) and (300, 40) of MIXED_BATCH start
# inside their first row's window for all but the first and last, so their rows' windows cross from the
# chunk into the cached prefix at different offsets.
# The layouts the sliding-window and soft-cap tests run: every layout in float32, two in bfloat16
# (the interpreted Triton kernels take seconds per call, and the options add no dtype-specific code).
OPTION_LAYOUTS = [(layout, torch.float32) for layout in LAYOUTS] + [
    (LAYOUTS[2], torch.bfloat16),
    (LAYOUTS[5], torch.bfloat16),
]
OPTION_LAYOUT_IDS = [f"{LAYOUT_IDS[LAYOUTS.index(layout)]}-{dtype}" for layout, dtype in OPTION_LAYOUTS]
WINDOWS = {
    "one": lambda block_size: 1,
    "under_block": lambda block_size: block_size - 3,
    "block": lambda block_size: block_size,
    "blocks": lambda block_size: 2 * block_size + 3,
    "over_context": lambda block_size: 1000,
}


def _interpreting() -> bool:
    """Whether Triton's interpreter is in effect for its own library functions, not just for ours."""
    import triton.language.standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.standard.sum, InterpretedFunction)


@pytest.fixture(scope="module")
def triton_cpu() -> ModuleType:
    """`conveyor.kernels.triton` running in Triton's interpreter on CPU tensors."""
    if not _interpreting():
        reason = (
            "Triton's interpreter is off: `triton` was imported before TRITON_INTERPRET=1 was set "
            f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r})"
        )
        if torch.cuda.is_available():
            pytest.skip(reason + "; with a CUDA device the gpu tests check the compiled kernels")
        pytest.fail(reason + "; without a CUDA device nothing else checks the Triton kernels")
    return importlib.import_module("conveyor.kernels.triton")


@pytest.fixture(scope="module")
def cpu_kernels() -> ModuleType:
    """`conveyor.kernels.cpu`, compiled here on first use (a build failure fails the test with the
    compiler's message: the machines this runs on have a C++ compiler)."""
    from conveyor.kernels import load_backend

    return load_backend("cpu")


@pytest.fixture(scope="module", params=["cpu", "triton"])
def backend(request: pytest.FixtureRequest) -> ModuleType:
    """Each non-reference backend in turn: the C++ CPU kernels, then Triton interpreted on CPU."""
    return request.getfixturevalue("cpu_kernels" if request.param == "cpu" else "triton_cpu")


@pytest.fixture(scope="module")
def triton_cuda() -> ModuleType:
    """`conveyor.kernels.triton` compiled for the CUDA device; skips when there is none."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    if _interpreting():
        pytest.skip("TRITON_INTERPRET=1: the kernels are interpreted, not compiled")
    return importlib.import_module("conveyor.kernels.triton")


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `torch.empty` return NaN-filled floating tensors for the test's duration, so an output
    element a kernel forgets to write shows up as NaN instead of as plausible stale memory."""
    original = torch.empty

    def empty(*args, **kwargs):
        t = original(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


# (tokens, hidden, intermediate, experts, top_k, routing)
MOE_CASES = [
    (1, 64, 32, 8, 2, "even"),
    (37, 40, 20, 8, 2, "even"),  # widths that are not whole vectors
    (19, 64, 48, 16, 4, "even"),
    (23, 32, 24, 8, 1, "one-expert"),  # every token to expert 3; the other experts hold NaN
    (12, 48, 16, 8, 2, "skewed"),  # experts 0 and 5 only; the rest hold NaN
]


def moe_case(tokens, hidden, width, experts, top_k, routing, dtype):
    g = torch.Generator().manual_seed(tokens * 31 + hidden)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * width, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, width, generator=g) / width**0.5
    weights = torch.rand(tokens, top_k, generator=g)
    if routing == "even":
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    elif routing == "one-expert":
        ids = torch.full((tokens, top_k), 3)
    else:
        ids = torch.tensor([[0, 5] if t % 3 else [5, 0] for t in range(tokens)])
    unused = [e for e in range(experts) if e not in set(ids.flatten().tolist())]
    w13[unused] = float("nan")
    w2[unused] = float("nan")
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


MOE_IDS = [f"{c[0]}x{c[1]}-E{c[3]}-top{c[4]}-{c[5]}" for c in MOE_CASES]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16 has 8 significant bits (relative step 2^-8 ~ 4e-3); the interpreter also truncates instead of
    # rounding on float32 -> bf16 casts, so allow a few steps.
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


class PagedBatch:
    """A packed step over a paged cache with randomly placed blocks; never-written slots hold NaN."""

    def __init__(
        self,
        shape: list[tuple[int, int]],
        layout: tuple[int, int, int, int],
        dtype: torch.dtype,
        seed: int,
        device: str = "cpu",
    ) -> None:
        num_heads, num_kv_heads, head_dim, block_size = layout
        g = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-s // block_size) for s, _ in shape]
        num_blocks = sum(blocks_per_seq) + 3
        # Block 0 stays unused: it is what padding entries of the block tables point at.
        perm = torch.randperm(num_blocks - 1, generator=g) + 1
        self.key_cache = torch.full(
            (num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
        )
        self.value_cache = torch.full_like(self.key_cache, float("nan"))
        self.block_tables = torch.zeros(len(shape), max(blocks_per_seq) + 1, dtype=torch.int32)
        used = 0
        for b, (seq_len, _) in enumerate(shape):
            ids = perm[used : used + blocks_per_seq[b]]
            used += blocks_per_seq[b]
            self.block_tables[b, : len(ids)] = ids.int()
            flat = (ids[:, None] * block_size + torch.arange(block_size)).flatten()[:seq_len]
            for cache in (self.key_cache, self.value_cache):
                kv = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
                cache.view(-1, num_kv_heads, head_dim)[flat] = kv
        q_lens = torch.tensor([q for _, q in shape])
        self.query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int()
        self.seq_lens = torch.tensor([s for s, _ in shape], dtype=torch.int32)
        self.query = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=g).to(dtype)
        self.scale = head_dim**-0.5
        self.max_query_len = int(q_lens.max())
        self.max_seq_len = int(self.seq_lens.max())
        self.q_lens = q_lens.tolist()
        for name in ("key_cache", "value_cache", "block_tables", "query_start_loc", "seq_lens", "query"):
            setattr(self, name, getattr(self, name).to(device))

    def args(self) -> tuple:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
            self.scale,
            self.max_query_len,
            self.max_seq_len,
        )

    def truth(self, **options) -> torch.Tensor:
        """The reference in float32 on the same (upcast) inputs, on CPU; options: paged_attention's
        keyword arguments (sliding_window, logits_soft_cap)."""
        args = [
            a.cpu().float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in self.args()
        ]
        args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        return ref.paged_attention(*args, **options)

    def poison_blocks_before_window(self, sliding_window: int) -> int:
        """Fill with NaN every block of K and V that lies wholly before the window of each sequence's
        first query row, which no row may read; returns how many blocks were poisoned."""
        block_size = self.key_cache.shape[1]
        starts = self.query_start_loc.tolist()
        poisoned = 0
        for b, seq_len in enumerate(self.seq_lens.tolist()):
            first_key = max(0, seq_len - (starts[b + 1] - starts[b]) - sliding_window + 1)
            blocks = self.block_tables[b, : first_key // block_size].long()
            self.key_cache[blocks] = float("nan")
            self.value_cache[blocks] = float("nan")
            poisoned += len(blocks)
        return poisoned

    def decode_rows(self) -> list[int]:
        starts = self.query_start_loc.tolist()
        return [starts[b] for b, q in enumerate(self.q_lens) if q == 1]


def test_exports_every_kernel_with_reference_signatures(backend: ModuleType):
    """Same parameter names, kinds and defaults as the reference (the annotation of `prepared` names each
    backend's own per-step type)."""
    import inspect

    def params(fn) -> list[tuple]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    for name in KERNEL_NAMES:
        assert params(getattr(backend, name)) == params(getattr(ref, name)), name


def test_kernels_on_cpu_without_interpreter_name_the_fix():
    """Outside the interpreter a CPU tensor gets an error that says what to do, not "0 active drivers"."""
    import subprocess

    code = (
        "import torch\n"
        "from conveyor.kernels.triton import TritonUnavailableError, silu_and_mul\n"
        "try:\n"
        "    silu_and_mul(torch.randn(2, 8))\n"
        "except TritonUnavailableError as exc:\n"
        "    print(exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "set TRITON_INTERPRET=1" in proc.stdout


# --- paged attention -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_paged_attention_decode_batch(backend: ModuleType, layout, dtype, poisoned_empty):
    batch = PagedBatch(DECODE_BATCH, layout, dtype, seed=11)
    out = backend.paged_attention(*batch.args())
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.float(), batch.truth(), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_paged_attention_mixed_prefill_and_decode(backend: ModuleType, layout, dtype, poisoned_empty):
    batch = PagedBatch(MIXED_BATCH, layout, dtype, seed=12)
    out = backend.paged_attention(*batch.args())
    torch.testing.assert_close(out.float(), batch.truth(), **_tol(dtype))


@pytest.mark.parametrize("num_splits", [1, 2, 4, 8])
def test_paged_attention_decode_split_reduce(triton_cpu: ModuleType, num_splits: int):
    """The flash-decoding split + reduce for any number of splits, including splits that are empty
    for the shorter sequences; prefill rows are left untouched by the decode kernels."""
    from conveyor.kernels.triton.paged_attention import paged_attention_decode

    batch = PagedBatch(MIXED_BATCH, (9, 3, 64, 16), torch.float32, seed=13)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_decode(out, *batch.args()[:7], batch.max_seq_len, num_splits=num_splits)
    rows = batch.decode_rows()
    torch.testing.assert_close(out[rows], batch.truth()[rows], **_tol(torch.float32))
    others = [r for r in range(out.shape[0]) if r not in rows]
    assert out[others].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_splits_one_long_sequence_by_default(triton_cpu: ModuleType, dtype):
    """A lone long decode is split across programs by the default heuristic (the case it exists for)."""
    from conveyor.kernels.triton.paged_attention import num_kv_splits

    batch = PagedBatch([(777, 1)], (4, 2, 64, 16), dtype, seed=19)
    assert num_kv_splits(1, 2, 777, torch.device("cpu")) == 2
    out = triton_cpu.paged_attention(*batch.args())
    torch.testing.assert_close(out.float(), batch.truth(), **_tol(dtype))


def test_paged_attention_prefill_kernel_alone_covers_decode_rows(triton_cpu: ModuleType):
    """The prefill kernel is general: with skip_decode=False it computes every row, decode rows too."""
    from conveyor.kernels.triton.paged_attention import paged_attention_prefill

    batch = PagedBatch(MIXED_BATCH, (4, 4, 128, 32), torch.float32, seed=14)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_prefill(out, *batch.args()[:8], skip_decode=False)
    torch.testing.assert_close(out, batch.truth(), **_tol(torch.float32))


def test_paged_attention_long_prefill_spans_query_tiles(backend: ModuleType):
    """A chunk longer than one 64-row query tile, starting mid-block after a cached prefix."""
    batch = PagedBatch([(227, 130), (70, 70)], (9, 3, 64, 16), torch.bfloat16, seed=15)
    out = backend.paged_attention(*batch.args())
    torch.testing.assert_close(out.float(), batch.truth(), **_tol(torch.bfloat16))


@pytest.mark.parametrize(("layout", "dtype"), OPTION_LAYOUTS, ids=OPTION_LAYOUT_IDS)
@pytest.mark.parametrize("window", list(WINDOWS))
def test_paged_attention_sliding_window(backend: ModuleType, window: str, layout, dtype, poisoned_empty):
    """Decode rows, full prefills and chunks crossing the window's edge, in a mixed step and in a step of
    decodes only. The blocks before each sequence's window hold NaN, so a kernel that reads one (instead
    of starting at the window) fails too."""
    sliding_window = WINDOWS[window](layout[3])
    for shape, seed in ((MIXED_BATCH, 51), (DECODE_BATCH, 52)):
        batch = PagedBatch(shape, layout, dtype, seed=seed)
        truth = batch.truth(sliding_window=sliding_window)
        # The window matters: without it the rows that have keys before their window differ.
        assert torch.allclose(truth, batch.truth()) == (window == "over_context")
        poisoned = batch.poison_blocks_before_window(sliding_window)
        assert (poisoned > 0) == (window != "over_context")
        out = backend.paged_attention(*batch.args(), sliding_window=sliding_window)
        torch.testing.assert_close(out.float(), truth, **_tol(dtype))


@pytest.mark.parametrize(("layout", "dtype"), OPTION_LAYOUTS, ids=OPTION_LAYOUT_IDS)
@pytest.mark.parametrize(("sliding_window", "logits_soft_cap"), [(None, 1.5), (7, 2.0)])
def test_paged_attention_soft_cap(
    backend: ModuleType, sliding_window: int | None, logits_soft_cap: float, layout, dtype, poisoned_empty
):
    """Soft-capped scores (queries scaled up so that scores of a few units are capped hard at 1.5 or
    2), alone and with a window, over decodes, full prefills and chunks."""
    options = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
    batch = PagedBatch(MIXED_BATCH, layout, dtype, seed=53)
    batch.query = batch.query * 3
    out = backend.paged_attention(*batch.args(), **options)
    truth = batch.truth(**options)
    torch.testing.assert_close(out.float(), truth, **_tol(dtype))
    assert not torch.allclose(truth, batch.truth(sliding_window=sliding_window), atol=1e-3)  # the cap bites


def test_paged_attention_window_and_cap_over_long_prefill_tiles(backend: ModuleType):
    """A chunk of 130 rows (three 64-row query tiles) after a cached prefix, a full prefill of 70 and a
    long decode: each tile starts at its own first row's window. Also Gemma 2's cap of 50 alone."""
    batch = PagedBatch([(227, 130), (70, 70), (500, 1)], (9, 3, 64, 16), torch.float32, seed=55)
    for options in (
        {"sliding_window": 40},
        {"sliding_window": 70, "logits_soft_cap": 2.0},
        {"logits_soft_cap": 50.0},
    ):
        out = backend.paged_attention(*batch.args(), **options)
        torch.testing.assert_close(out, batch.truth(**options), **_tol(torch.float32))


@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_paged_attention_decode_splits_divide_the_window(triton_cpu: ModuleType, num_splits: int):
    """The flash-decoding splits cover the window, not the whole context: with the blocks before it
    poisoned, every split count still gives the reference's rows (short sequences included, whose
    window is their whole context)."""
    from conveyor.kernels.triton.paged_attention import paged_attention_decode

    batch = PagedBatch(MIXED_BATCH, (9, 3, 64, 16), torch.float32, seed=56)
    truth = batch.truth(sliding_window=100, logits_soft_cap=3.0)
    assert batch.poison_blocks_before_window(100) > 0
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_decode(
        out, *batch.args()[:7], batch.max_seq_len, num_splits, sliding_window=100, logits_soft_cap=3.0
    )
    rows = batch.decode_rows()
    torch.testing.assert_close(out[rows], truth[rows], **_tol(torch.float32))


def test_paged_attention_refuses_an_empty_window_or_a_cap_that_is_not_positive(backend: ModuleType):
    batch = PagedBatch(DECODE_BATCH[:2], (9, 3, 64, 16), torch.float32, seed=57)
    with pytest.raises(ValueError, match="sliding_window must be at least 1 .*; got 0"):
        backend.paged_attention(*batch.args(), sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap must be positive; got -1.0"):
        backend.paged_attention(*batch.args(), logits_soft_cap=-1.0)


def test_paged_attention_strided_query(backend: ModuleType):
    """The query as the model produces it: a view into a fused QKV projection (rows strided)."""
    batch = PagedBatch(MIXED_BATCH[:4], (9, 3, 64, 16), torch.float32, seed=16)
    qkv = torch.randn(batch.query.shape[0], (9 + 2 * 3) * 64)
    query = qkv[:, : 9 * 64].view(-1, 9, 64)
    query.copy_(batch.query)
    out = backend.paged_attention(query, *batch.args()[1:])
    torch.testing.assert_close(out, batch.truth(), **_tol(torch.float32))


def test_paged_attention_rejects_bad_head_ratio(triton_cpu: ModuleType):
    batch = PagedBatch(DECODE_BATCH[:2], (9, 3, 64, 16), torch.float32, seed=17)
    query = torch.randn(batch.query.shape[0], 8, 64)
    with pytest.raises(ValueError, match="not a multiple"):
        triton_cpu.paged_attention(query, *batch.args()[1:])


def test_cpu_kernels_reject_bad_input_with_a_message(cpu_kernels: ModuleType):
    """Out-of-range indices are refused before anything is read or written, with the numbers."""
    batch = PagedBatch(DECODE_BATCH[:2], (9, 3, 64, 16), torch.float32, seed=17)
    with pytest.raises(RuntimeError, match="num_heads must be a multiple of num_kv_heads"):
        cpu_kernels.paged_attention(torch.randn(batch.query.shape[0], 8, 64), *batch.args()[1:])
    too_long = batch.seq_lens.clone()
    too_long[1] = 10_000
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\] = 10000 does not fit its block table"):
        cpu_kernels.paged_attention(*batch.args()[:5], too_long, *batch.args()[6:])
    cache = ref.rope_cos_sin_cache(64, 32, 10000.0)
    q, k = torch.randn(2, 9, 64), torch.randn(2, 3, 64)
    with pytest.raises(RuntimeError, match="position 32 is outside the rotary table of 32 positions"):
        cpu_kernels.rotary_embedding(torch.tensor([0, 32]), q, k, cache)
    key_cache = torch.full((2, 16, 3, 64), float("nan"))
    value_cache = key_cache.clone()
    with pytest.raises(RuntimeError, match="slot 32 is outside the cache's 32 slots"):
        cpu_kernels.reshape_and_cache(k, k, key_cache, value_cache, torch.tensor([0, 32]))
    assert key_cache.isnan().all()  # nothing was written


def _run_fresh(code: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Python `code` (lines) in a fresh interpreter with `env` added to this one's environment."""
    return subprocess.run(
        [sys.executable, "-c", "\n".join(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


_PICK_BACKEND = [
    "import logging",
    "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(message)s')",
    "from conveyor.kernels import cpu, default_backend, load_backend",
    "print('default', default_backend('cpu'))",
    "for _ in range(2):",
    "    try:",
    "        load_backend('cpu')",
    "    except cpu.CPUKernelBuildError as exc:",
    "        print('error', exc)",
]


def test_cpu_backend_without_a_compiler_falls_back_to_torch(tmp_path):
    """A machine without a C++ compiler: `auto` picks the torch kernels and logs why; asking for `cpu`
    by name raises CPUKernelBuildError naming the missing compiler, on every call."""
    missing = str(tmp_path / "no-such-compiler")
    proc = _run_fresh(_PICK_BACKEND, {"CXX": missing, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    reason = f"no C++ compiler to build the CPU kernels: {missing!r} was not found (install g++, or set CXX)"
    assert proc.stdout.splitlines() == ["default torch", f"error {reason}", f"error {reason}"]
    assert f"WARNING {reason}; using the torch reference kernels on CPU" in proc.stderr


_BUILD_FAILED = f"error building the C++ CPU kernels ({', '.join(s.name for s in cpu.SOURCES)}) failed: "


def test_cpu_backend_build_failure_names_the_compiler_message(tmp_path):
    """A compiler that fails: the error carries its message, not the compiler command lines."""
    compiler = tmp_path / "broken-c++"
    compiler.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "g++ (Debian 12.2.0-14) 12.2.0"; exit 0; fi\n'
        "echo 'fatal error: no space left on device' >&2\nexit 1\n"
    )
    compiler.chmod(0o755)
    proc = _run_fresh(_PICK_BACKEND, {"CXX": str(compiler), "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "default torch"
    assert lines[1].startswith(_BUILD_FAILED)
    assert "fatal error: no space left on device" in lines[1]
    assert str(compiler) not in lines[1]  # ninja's echo of the full compiler command is left out


def test_cpu_backend_compiler_that_cannot_even_say_its_version_falls_back(tmp_path):
    """torch asks the compiler for `--version` first; a failure there is a build failure too."""
    compiler = tmp_path / "broken-c++"
    compiler.write_text("#!/bin/sh\nexit 3\n")
    compiler.chmod(0o755)
    proc = _run_fresh(_PICK_BACKEND, {"CXX": str(compiler), "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "default torch"
    assert lines[1].startswith(_BUILD_FAILED)


def test_serve_asking_for_cpu_kernels_without_a_compiler_exits_with_one_line(tmp_path):
    env = {"CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    code = [
        "import sys",
        "from conveyor.server.cli import main",
        "sys.exit(main(['serve', '--attention-backend', 'cpu', '--port', '1']))",
    ]
    proc = _run_fresh(code, env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "kernel backend" not in proc.stderr  # the refused backend is never announced
    assert "conveyor serve: --attention-backend cpu: no C++ compiler to build the CPU kernels" in proc.stderr
    assert proc.stderr.rstrip().endswith("or use --attention-backend torch")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_long_contexts(backend: ModuleType, dtype):
    """Contexts of ~1-2K tokens decoded and chunk-prefilled with the default split heuristic."""
    shape = [(2048, 1), (1500, 1), (1100, 64), (17, 1)]
    batch = PagedBatch(shape, (32, 8, 128, 16), dtype, seed=18)
    out = backend.paged_attention(*batch.args())
    torch.testing.assert_close(out.float(), batch.truth(), **_tol(dtype))


# --- KV cache write ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS[:3], ids=LAYOUT_IDS[:3])
def test_reshape_and_cache(backend: ModuleType, layout, dtype):
    _, num_kv_heads, head_dim, block_size = layout
    g = torch.Generator().manual_seed(21)
    num_blocks, num_tokens = 6, 23
    # K and V as the model produces them: views into one fused projection output.
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_dim + 8, generator=g).to(dtype)
    key = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[3, 10]] = -1  # padding tokens: not written
    caches = [
        torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
        for _ in range(4)
    ]
    backend.reshape_and_cache(key, value, caches[0], caches[1], slots)
    ref.reshape_and_cache(key, value, caches[2], caches[3], slots)
    for mine, theirs in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(mine.isnan(), theirs.isnan())  # the same slots written, the rest untouched
        assert torch.equal(mine.nan_to_num(), theirs.nan_to_num())
    written = slots[slots >= 0]
    assert int((~caches[0].view(-1, num_kv_heads, head_dim).isnan()).all(-1).all(-1).sum()) == len(written)


# --- fused small ops -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden_size", [576, 1000, 4096])
def test_rms_norm(backend: ModuleType, hidden_size: int, dtype, poisoned_empty):
    g = torch.Generator().manual_seed(31)
    x = (torch.randn(5, hidden_size, generator=g) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden_size, generator=g)).to(dtype)
    out = backend.rms_norm(x, weight, 1e-6)
    expected = ref.rms_norm(x, weight, 1e-6)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden_size", [576, 4096])
def test_fused_add_rms_norm(backend: ModuleType, hidden_size: int, dtype, poisoned_empty):
    g = torch.Generator().manual_seed(32)
    x = torch.randn(5, hidden_size, generator=g).to(dtype)
    residual = torch.randn(5, hidden_size, generator=g).to(dtype)
    weight = torch.randn(hidden_size, generator=g).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = backend.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_residual = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, expected_residual, **_tol(dtype))
    torch.testing.assert_close(out, expected_out, **_tol(dtype))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS[:3], ids=LAYOUT_IDS[:3])
@pytest.mark.parametrize("partial", [1.0, 0.75], ids=["full", "partial"])  # Phi-4-mini rotates 3/4
def test_rotary_embedding(backend: ModuleType, layout, dtype, partial, poisoned_empty):
    """The rotated width is the table's: all of head_dim, or its first 3/4 (the rest passes)."""
    num_heads, num_kv_heads, head_dim, _ = layout
    rotary_dim = int(head_dim * partial)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cache = ref.rope_cos_sin_cache(rotary_dim, 16384, 500000.0, scaling)
    g = torch.Generator().manual_seed(33)
    positions = torch.tensor([0, 1, 15, 16, 17, 300, 8191, 16383])
    query = torch.randn(len(positions), num_heads, head_dim, generator=g).to(dtype)
    key = torch.randn(len(positions), num_kv_heads, head_dim, generator=g).to(dtype)
    q, k = backend.rotary_embedding(positions, query, key, cache)
    eq, ek = ref.rotary_embedding(positions, query, key, cache)
    torch.testing.assert_close(q, eq, **_tol(dtype))
    torch.testing.assert_close(k, ek, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate_size", [1536, 100, 3000])
@pytest.mark.parametrize("activation", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_gated_activations(
    backend: ModuleType, activation: str, intermediate_size: int, dtype, poisoned_empty
):
    x = (torch.randn(6, 2 * intermediate_size, generator=torch.Generator().manual_seed(34)) * 4).to(dtype)
    out = getattr(backend, activation)(x)
    torch.testing.assert_close(out, getattr(ref, activation)(x), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MOE_CASES, ids=MOE_IDS)
def test_fused_moe(backend: ModuleType, case, dtype, poisoned_empty):
    """Even and skewed routing (every token to one expert; experts no token chose hold NaN); the
    reference in float32 on the same values."""
    x, w13, w2, weights, ids = moe_case(*case, dtype)
    out = backend.fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype
    expected = ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(out.float(), expected, **_tol(dtype))


# (tokens, in_features, output slices, rank, slots, adapter index per token): adapters mixed in a decode
# batch of a fused q/k/v projection, base-model rows (-1) between them, one adapter over a prefill's
# rows with odd widths (gate/up), every row on the base model.
LORA_CASES = [
    (8, 576, (576, 192, 192), 16, 4, [0, -1, 1, 2, 3, -1, 2, 0]),
    (37, 100, (67, 63), 8, 3, [1] * 30 + [-1] * 5 + [2, 0]),
    (4, 64, (48,), 24, 2, [-1, -1, -1, -1]),
]
LORA_IDS = ["mixed-decode-qkv", "prefill-odd-widths", "base-only"]


def lora_case(tokens, in_features, slices, rank, slots, index, dtype):
    """y, x, lora_a, lora_b, indices, output_slices of one LORA_CASES row; slots no row names hold NaN
    (never read)."""
    g = torch.Generator().manual_seed(36)
    y = torch.randn(tokens, sum(slices), generator=g).to(dtype)
    x = torch.randn(tokens, in_features, generator=g).to(dtype)
    lora_a = (torch.randn(slots, len(slices) * rank, in_features, generator=g) / in_features**0.5).to(dtype)
    lora_b = torch.randn(slots, rank, sum(slices), generator=g).to(dtype)
    indices = torch.tensor(index, dtype=torch.long)
    for slot in set(range(slots)) - set(index):
        lora_a[slot] = float("nan")
        lora_b[slot] = float("nan")
    return y, x, lora_a, lora_b, indices, slices


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LORA_CASES, ids=LORA_IDS)
def test_add_lora(backend: ModuleType, case, dtype, poisoned_empty):
    """Each row gets its own adapter's delta, base rows keep y exactly, unused slots are not read; the
    reference in float32 on the same values."""
    y, x, lora_a, lora_b, indices, slices = lora_case(*case, dtype)
    expected = ref.add_lora(y.float().clone(), x.float(), lora_a.float(), lora_b.float(), indices, slices)
    base_rows = indices < 0
    before = y.clone()
    out = backend.add_lora(y, x, lora_a, lora_b, indices, slices)
    assert out.data_ptr() == y.data_ptr() and out.dtype == dtype  # in place
    assert torch.equal(out[base_rows], before[base_rows])
    torch.testing.assert_close(out.float(), expected, **_tol(dtype))


def test_reference_add_lora_is_the_lora_formula():
    """The contract itself, row by row and slice by slice: y + B_s,i (A_s,i x) for rows with an adapter."""
    y, x, lora_a, lora_b, indices, slices = lora_case(*LORA_CASES[0], torch.float32)
    rank = lora_b.shape[1]
    out = ref.add_lora(y.clone(), x, lora_a, lora_b, indices, slices)
    for t, i in enumerate(indices.tolist()):
        parts = []
        for s, (first, width) in enumerate(zip((0, 576, 768), slices, strict=True)):
            a = lora_a[i, s * rank : (s + 1) * rank]  # [R, in]
            b = lora_b[i, :, first : first + width].T  # [width, R]
            parts.append(b @ (a @ x[t]))
        want = y[t] if i < 0 else y[t] + torch.cat(parts)
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)


# --- the same kernels compiled for CUDA ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_gpu_paged_attention(triton_cuda: ModuleType, layout, dtype):
    shape = MIXED_BATCH + [(4096, 1), (3000, 1), (2000, 300)]
    batch = PagedBatch(shape, layout, dtype, seed=41, device="cuda")
    out = triton_cuda.paged_attention(*batch.args())
    # float16 carries 3 more mantissa bits than bfloat16: the bf16 tolerance covers it.
    torch.testing.assert_close(out.float().cpu(), batch.truth(), **_tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("sliding_window", "logits_soft_cap"), [(1, None), (16, None), (100, 30.0), (None, 2.0)]
)
def test_gpu_paged_attention_window_and_soft_cap(
    triton_cuda: ModuleType, sliding_window: int | None, logits_soft_cap: float | None, dtype
):
    options = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
    shape = MIXED_BATCH + [(4096, 1), (3000, 1), (2000, 300)]
    batch = PagedBatch(shape, (32, 8, 128, 16), dtype, seed=43, device="cuda")
    truth = batch.truth(**options)
    batch.poison_blocks_before_window(sliding_window or 10**6)
    out = triton_cuda.paged_attention(*batch.args(), **options)
    torch.testing.assert_close(out.float().cpu(), truth, **_tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_small_kernels(triton_cuda: ModuleType, dtype):
    g = torch.Generator().manual_seed(42)
    dev = "cuda"
    x = torch.randn(300, 4096, generator=g).to(dtype)
    residual = torch.randn(300, 4096, generator=g).to(dtype)
    weight = torch.randn(4096, generator=g).to(dtype)
    tol = _tol(dtype)
    torch.testing.assert_close(
        triton_cuda.rms_norm(x.to(dev), weight.to(dev), 1e-5).cpu(), ref.rms_norm(x, weight, 1e-5), **tol
    )
    out, res = triton_cuda.fused_add_rms_norm(x.to(dev), residual.to(dev), weight.to(dev), 1e-5)
    eout, eres = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(res.cpu(), eres, **tol)
    torch.testing.assert_close(out.cpu(), eout, **tol)
    up = torch.randn(300, 2 * 14336, generator=g).to(dtype)
    torch.testing.assert_close(triton_cuda.silu_and_mul(up.to(dev)).cpu(), ref.silu_and_mul(up), **tol)
    cache = ref.rope_cos_sin_cache(128, 8192, 500000.0)
    positions = torch.randint(0, 8192, (300,), generator=g)
    q = torch.randn(300, 32, 128, generator=g).to(dtype)
    k = torch.randn(300, 8, 128, generator=g).to(dtype)
    gq, gk = triton_cuda.rotary_embedding(positions.to(dev), q.to(dev), k.to(dev), cache.to(dev))
    eq, ek = ref.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(gq.cpu(), eq, **tol)
    torch.testing.assert_close(gk.cpu(), ek, **tol)
    key_cache = torch.full((64, 16, 8, 128), float("nan"), dtype=dtype, device=dev)
    value_cache = key_cache.clone()
    slots = torch.randperm(64 * 16, generator=g)[:300]
    triton_cuda.reshape_and_cache(
        k.to(dev), q[:, :8].contiguous().to(dev), key_cache, value_cache, slots.to(dev)
    )
    assert torch.equal(key_cache.view(-1, 8, 128)[slots.to(dev)].cpu(), k)
    assert int((~key_cache.isnan()).sum()) == 300 * 8 * 128


# --- the GPU benchmark script's plumbing, on CPU -------------------------------------------------


def _call_once(fn) -> float:
    fn()
    return 1.0


def test_benchmark_rows_and_table_on_cpu(triton_cpu: ModuleType):
    """benchmarks/kernels.py's shapes, byte counts, SDPA baseline and table, with a stand-in timer
    (do_bench needs CUDA). The attention it times agrees with SDPA on the gathered K/V."""
    from conveyor.benchmarks import kernels as bench

    tiny = bench.ModelShape("tiny", 4, 2, 64, 128, 96)
    cpu = torch.device("cpu")
    decode = bench.bench_decode(triton_cpu, tiny, 3, 40, torch.float32, cpu, _call_once)
    assert decode is not None and decode.max_diff < 1e-5
    # K and V of 3 x 40 tokens x 2 heads x 64 float32 values, plus the query read and the output written.
    assert decode.bytes_moved == 2 * 3 * 40 * 2 * 64 * 4 + 2 * 3 * 4 * 64 * 4
    mixed = bench.bench_prefill(triton_cpu, tiny, 1, 20, 33, torch.float32, cpu, _call_once, decodes=2)
    assert mixed is not None and mixed.flops == 4 * 4 * 64 * (20 * 13 + 20 * 21 // 2 + 2 * 33)
    small = bench.bench_small_kernels(triton_cpu, ref, tiny, 5, torch.float32, cpu, _call_once)
    assert [r.kernel for r in small] == [
        "rms_norm",
        "fused_add_rms_norm",
        "silu_and_mul",
        "rotary_embedding",
        "reshape_and_cache",
    ]
    table = bench.format_table([decode, mixed, *small], copy_gbs=1.0).splitlines()
    assert table[0].startswith("| kernel | model | shape | Triton µs | GB/s | % of copy BW |")
    assert len(table) == 2 + 2 + len(small)
    assert table[2].startswith("| paged_attention decode | tiny | batch 3, context 40 | 1000.0 |")


def test_benchmark_sweep_on_cpu(triton_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch):
    """The whole sweep of benchmarks/kernels.py, shrunk to tiny shapes, with a stand-in timer."""
    from conveyor.benchmarks import kernels as bench

    monkeypatch.setattr(bench, "MODELS", (bench.ModelShape("tiny", 4, 2, 64, 128, 96),))
    monkeypatch.setattr(bench, "DECODE_BATCHES", (1, 2))
    monkeypatch.setattr(bench, "DECODE_CONTEXTS", (16, 40))
    monkeypatch.setattr(bench, "PREFILL_CASES", ((1, 20, 20), (2, 8, 40)))
    monkeypatch.setattr(bench, "MIXED_CASE", (1, 8, 24, 2))
    monkeypatch.setattr(bench, "TOKEN_COUNTS", (3,))
    rows = bench.run(ref, triton_cpu, torch.float32, torch.device("cpu"), _call_once)
    kinds = ["paged_attention decode"] * 4 + ["paged_attention prefill"] * 2 + ["paged_attention mixed"]
    assert [r.kernel for r in rows[:7]] == kinds
    assert len(rows) == 7 + 5
    assert all(r.max_diff < 1e-5 for r in rows[:4])


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message printed when there is no CUDA device"
)
def test_benchmark_script_without_cuda_exits_with_message():
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA device" in proc.stderr


def test_benchmark_loads_kernels_from_checkout_when_not_installed():
    """On a fresh GPU machine `conveyor` is not installed: the script loads `kernels/` by path."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"
    code = f"""
import importlib.abc, importlib.util, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ("conveyor", "conveyor.kernels"):
            raise ModuleNotFoundError(name)
        return None
sys.meta_path.insert(0, NotInstalled())
spec = importlib.util.spec_from_file_location("bench", {str(script)!r})
bench = sys.modules["bench"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
ref, tk = bench.import_kernels()
import torch
x, w = torch.randn(3, 64), torch.randn(64)
torch.testing.assert_close(tk.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
print(tk.__file__)
"""
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(str(Path("kernels") / "triton" / "__init__.py"))


# --- end to end: the engine with either backend --------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama_dir(save_tiny_llama) -> str:
    """A 2-layer Llama (GQA 4:2, head_dim 64) with random weights and a byte-level tokenizer."""
    return save_tiny_llama("tiny-llama", num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def tiny_moe_dir(save_tiny_llama) -> str:
    """A 2-layer Qwen3-MoE (8 experts of width 128, top-2) with random weights and a byte-level
    tokenizer."""
    import transformers

    return save_tiny_llama(
        "tiny-moe",
        config_class=transformers.Qwen3MoeConfig,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
    )


def _greedy_tokens(model_dir: str, backend: str, prompts: list[str]) -> list[list[int]]:
    from conveyor.server.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
    from conveyor.server.engine.builder import build_engine
    from conveyor.server.messages import SamplingParams

    engine = build_engine(
        EngineConfig(
            model=ModelConfig(model=model_dir, dtype="float32", max_model_len=256),
            cache=CacheConfig(kv_cache_memory=1 << 22, block_size=16),
            # A 24-token budget splits the longer prompts into chunks that share steps with decodes.
            scheduler=SchedulerConfig(max_num_batched_tokens=24),
            device=DeviceConfig(device="cpu", attention_backend=backend),
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.make_request(str(i), engine.tokenizer(prompt)["input_ids"], params))
    tokens: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[int(out.request_id)] += out.new_token_ids
    return tokens


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_moe_dir"])
@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_engine_greedy_tokens_equal_with_each_backend_and_torch(
    name: str, model: str, request: pytest.FixtureRequest
):
    """The same random 2-layer Llama, and Qwen3-MoE, through the engine (chunked prefill, mixed steps,
    decodes) with the C++ CPU kernels or the Triton kernels (interpreted) and with the torch
    references: identical greedy tokens (the torch references' are transformers', in
    test_architectures.py)."""
    from conveyor.kernels import load_backend

    kernels = request.getfixturevalue("cpu_kernels" if name == "cpu" else "triton_cpu")
    assert load_backend(name) is kernels  # the engine will pick up these kernels
    model_dir = request.getfixturevalue(model)
    prompts = ["Hello", "The capital of France is", "def fibonacci(n): return n if n < 2 else"]
    torch_tokens = _greedy_tokens(model_dir, "torch", prompts)
    tokens = _greedy_tokens(model_dir, name, prompts)
    assert [len(t) for t in torch_tokens] == [12, 12, 12]
    assert tokens == torch_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", MOE_CASES, ids=MOE_IDS)
def test_gpu_fused_moe(triton_cuda: ModuleType, case, dtype):
    x, w13, w2, weights, ids = (t.cuda() for t in moe_case(*case, dtype))
    out = triton_cuda.fused_moe(x, w13, w2, weights, ids)
    expected = ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(out.float(), expected, **_tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", LORA_CASES, ids=LORA_IDS)
def test_gpu_add_lora(triton_cuda: ModuleType, case, dtype):
    y, x, lora_a, lora_b, indices, slices = lora_case(*case, dtype)
    expected = ref.add_lora(y.float().clone(), x.float(), lora_a.float(), lora_b.float(), indices, slices)
    out = triton_cuda.add_lora(y.cuda(), x.cuda(), lora_a.cuda(), lora_b.cuda(), indices.cuda(), slices)
    torch.testing.assert_close(out.float().cpu(), expected, **_tol(dtype))
