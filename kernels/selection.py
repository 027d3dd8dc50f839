"""Which matmul runs each linear layer on a CPU, chosen by measurement on the machine at hand.

No one CPU kernel wins everywhere: the C++ panel kernel (`cpu.CPULinear`) is built for a decode step's
few rows, oneDNN's pre-packed layers (`onednn.PackedLinear`) use AMX tiles on Xeons that have them and
block large matrices well, and a plain `nn.Linear` (MKL's sgemm in float32) can win at prefill sizes.
Which is fastest depends on the CPU, the dtype, the layer's shape and the number of rows of the step,
and the machines this runs on differ (AVX2-only EPYCs, AVX-512 Zen 4, Xeons with AMX), so the table is
measured, not written down: at the first start on a machine each candidate is timed on each distinct
`(in_features, out_features)` of the model at ROW_BUCKETS rows, with that shape's real weights, and the
fastest per bucket is kept (the first available candidate unless another is MARGIN faster, so timing
noise never costs a second copy of the weights). Tables are cached per shape under
`${XDG_CACHE_HOME:-~/.cache}/conveyor/kernels/`, keyed by the CPU (model name and flags), the C++ build,
torch's version and thread count, the dtype, the shape and the linear kernel's source, so a different
CPU, build or kernel measures again and a restart reads them back in milliseconds.

A GGUF-quantized layer (`quant.QuantizedLinear`) has its own candidates over the same packed bytes,
`q-dot`, `q-dequant` and `q-int8` (see `conveyor.kernels.quant`), measured the same way, keyed also
by its block formats.

Every layer is then replaced by the one candidate its table names, or, where the table names several,
by a `SelectedLinear` that picks by the row count of each call. `CONVEYOR_CPU_KERNELS` overrides the
measurement for experiments, for every shape whose candidates it names: `panel`, or `panel,onednn@256`
(panel below 256 rows, oneDNN from 256 on), or `q-dot` for quantized layers.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
OVERRIDE_ENV = "CONVEYOR_CPU_KERNELS"
# Another candidate replaces the first available one only when it is at least this much faster.
MARGIN = 0.05
# A bucket whose fastest call takes longer than this ends the measurement of its shape: the larger
# buckets keep its choice (a 49,152-row LM head at 1,024 rows would take seconds per candidate).
CALL_BUDGET_S = 0.1
# Bumped when the measurement or the choice rule changes, so cached tables are measured again.
TABLE_VERSION = 1

Shape = tuple[int, int]  # (in_features, out_features)
Factory = Callable[[nn.Module], nn.Module]  # an nn.Linear or a quant.QuantizedLinear -> its kernel


def quantized_factories() -> dict[str, Factory]:
    """The candidates of a quantized layer (`quant.QuantizedLinear`), over its packed bytes (no copy):
    `q-dot`, `q-dequant`, and `q-int8` where the C++ build has it."""
    from conveyor.kernels import quant

    factories: dict[str, Factory] = {
        "q-dot": lambda layer: layer.with_method("dot"),
        "q-dequant": lambda layer: layer.with_method("dequant"),
    }
    if quant.int8_supported():
        factories["q-int8"] = lambda layer: layer.with_method("int8")
    return factories


@dataclass(frozen=True)
class RowDispatch:
    """Which candidate runs a call of each row count: `ranges[i] = (first_rows, name)`, ascending,
    the first starting at 1; a range runs up to the next one's first row."""

    ranges: tuple[tuple[int, str], ...]

    def __post_init__(self) -> None:
        starts = [first for first, _ in self.ranges]
        if not starts or starts[0] != 1 or starts != sorted(set(starts)):
            raise ValueError(f"row ranges must start at 1 and ascend, got {self.ranges}")

    def pick(self, rows: int) -> str:
        """The candidate for a call with `rows` rows (0 rows: the first range's)."""
        starts = [first for first, _ in self.ranges]
        return self.ranges[max(0, bisect.bisect_right(starts, rows) - 1)][1]

    def names(self) -> list[str]:
        """The candidates used, in range order, each once."""
        return list(dict.fromkeys(name for _, name in self.ranges))

    def __str__(self) -> str:
        parts = []
        for i, (first, name) in enumerate(self.ranges):
            last = self.ranges[i + 1][0] - 1 if i + 1 < len(self.ranges) else None
            span = f"{first}+" if last is None else (f"{first}" if last == first else f"{first}-{last}")
            parts.append(f"{name} {span}")
        return ", ".join(parts)


def choose(timings: dict[int, dict[str, float]], order: Iterable[str]) -> RowDispatch:
    """The dispatch for one shape from its timings: `timings[bucket][name]` seconds per call at the
    buckets measured (ascending, as ROW_BUCKETS); rows past the last bucket keep its choice.

    A dispatch uses at most two kernels, one below a row count and one from it on (a decode kernel and
    a matrix kernel: at most one extra copy of the weights, and a single noisy bucket cannot split a
    range). Each possible dispatch costs the sum over the buckets of its time over that bucket's
    fastest; the cheapest wins, unless the first timed candidate of `order` alone is within MARGIN per
    bucket of it (then that one, with one copy of the weights). Bucket b's choice covers the rows above
    the bucket before it. Raises ValueError when no bucket was timed."""
    if not timings:
        raise ValueError("no timings to choose from")
    buckets = sorted(timings)
    names = [name for name in order if all(name in timings[b] for b in buckets)]
    if not names:
        raise ValueError(f"no candidate of {list(order)} was timed at every bucket")
    best = {b: min(timings[b][name] for name in names) for b in buckets}

    def cost(low: str, high: str, split: int) -> float:
        return sum(timings[b][low if i < split else high] / best[b] for i, b in enumerate(buckets))

    plans = [(low, high, split) for low in names for high in names for split in range(1, len(buckets))]
    plans = [(name, name, len(buckets)) for name in names] + [p for p in plans if p[0] != p[1]]
    low, high, split = min(plans, key=lambda plan: cost(*plan))  # first of equals: fewer kernels
    if cost(names[0], names[0], len(buckets)) <= cost(low, high, split) + MARGIN * len(buckets):
        return RowDispatch(((1, names[0]),))
    if low == high:
        return RowDispatch(((1, low),))
    return RowDispatch(((1, low), (buckets[split - 1] + 1, high)))


def parse_override(text: str, available: Iterable[str]) -> RowDispatch:
    """`CONVEYOR_CPU_KERNELS`'s value as a dispatch: `name` or `name,name@rows,...` (each from `rows`
    rows on; the first from 1). Raises ValueError naming the variable for an unknown or unavailable
    candidate, a bad row count or ranges out of order."""
    available = list(available)
    ranges: list[tuple[int, str]] = []
    for i, part in enumerate(p.strip() for p in text.split(",")):
        name, _, rows = part.partition("@")
        if name not in available:
            raise ValueError(
                f"{OVERRIDE_ENV}: {name!r} is not a kernel this model can use here "
                f"(available: {', '.join(available)})"
            )
        if not rows and i > 0:
            raise ValueError(f"{OVERRIDE_ENV}: {part!r} needs a first row count, as {name}@256")
        try:
            first = int(rows) if rows else 1
        except ValueError:
            raise ValueError(f"{OVERRIDE_ENV}: {rows!r} in {part!r} is not a row count") from None
        ranges.append((first, name))
    try:
        return RowDispatch(tuple(ranges))
    except ValueError as exc:
        raise ValueError(f"{OVERRIDE_ENV}={text!r}: {exc}") from None


def time_calls(fns: dict[str, Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> dict[str, float]:
    """Seconds per call of each `fn(x)`: the least of up to 9 samples each (at least 3, about 30 ms of
    calls in all), a sample being a batch of calls of at least 1 ms. The samples take turns between
    the functions, so a stretch of load from elsewhere slows all of them, not the one that happened to
    run then; and the least counts, because load only ever adds time: an interrupted sample is slow,
    never fast."""
    batch: dict[str, int] = {}
    slowest = 0.0  # seconds of the longest sample
    for name, fn in fns.items():
        fn(x)
        start = time.perf_counter()
        fn(x)
        once = max(time.perf_counter() - start, 1e-7)
        batch[name] = max(1, int(1e-3 / once))
        slowest = max(slowest, batch[name] * once)
    rounds = max(3, min(9, int(0.03 / slowest)))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(batch[name]):
                fn(x)
            best[name] = min(best[name], (time.perf_counter() - start) / batch[name])
    return best


def measure(
    linear: nn.Module,
    candidates: dict[str, Factory],
    dtype: torch.dtype,
    buckets: Iterable[int] = ROW_BUCKETS,
) -> dict[int, dict[str, float]]:
    """Seconds per call of each candidate built from `linear` at each bucket's row count (x in `dtype`;
    `time_calls`). Stops after the first bucket whose fastest call exceeds CALL_BUDGET_S."""
    modules = {name: make(linear) for name, make in candidates.items()}
    generator = torch.Generator().manual_seed(0)
    timings: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in buckets:
            x = torch.randn(rows, linear.in_features, generator=generator).to(dtype)
            timings[rows] = time_calls(modules, x)
            if min(timings[rows].values()) > CALL_BUDGET_S:
                break
    return timings


def cache_dir() -> Path:
    """Where measured tables live: `${XDG_CACHE_HOME:-~/.cache}/conveyor/kernels`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "conveyor" / "kernels"


LINEAR_SOURCES = ("linear.cpp", "quant.cpp", "moe.cpp", "grouped.h")


def machine_key(sources: Iterable[str] = LINEAR_SOURCES) -> dict[str, str]:
    """What a measurement depends on besides the layer: the CPU (model name and flags), torch's
    version and threads, the C++ kernels' build and the measured kernels' `sources` (files of
    `kernels/csrc`)."""
    from conveyor.kernels import cpu

    cpuinfo = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                cpuinfo.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    source = b"".join((cpu.CSRC / name).read_bytes() for name in sources)
    return {
        "cpu": cpuinfo.get("model name", platform.processor() or platform.machine()),
        "flags": hashlib.sha256(cpuinfo.get("flags", cpuinfo.get("Features", "")).encode()).hexdigest()[:16],
        "build": cpu._build_name(),
        "source": hashlib.sha256(source).hexdigest()[:16],
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "version": str(TABLE_VERSION),
    }


def table_path(
    machine: dict[str, str], shape: Shape, dtype: torch.dtype, names: Iterable[str], weights: str = ""
) -> Path:
    """The cache file of one shape's timings on this machine, with these candidates; `weights` names
    a quantized layer's block formats ("" for float weights)."""
    key = {**machine, "shape": f"{shape[0]}x{shape[1]}", "dtype": str(dtype), "candidates": ",".join(names)}
    if weights:
        key["weights"] = weights
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    kind = weights or str(dtype).removeprefix("torch.")
    return cache_dir() / f"linear-{shape[0]}x{shape[1]}-{kind}-{digest}.json"


def cached_timings(
    linear: nn.Module, candidates: dict[str, Factory], machine: dict[str, str], dtype: torch.dtype
) -> tuple[dict[int, dict[str, float]], str]:
    """This shape's timings (x in `dtype`) from the cache, or measured now and cached. Returns
    (timings, where from)."""
    shape = (linear.in_features, linear.out_features)
    path = table_path(machine, shape, dtype, candidates, getattr(linear, "types", ""))
    return _cached(path, machine, list(shape), lambda: measure(linear, candidates, dtype))


def _cached(
    path: Path,
    machine: dict[str, str],
    shape: list[int],
    measure_now: Callable[[], dict[int, dict[str, float]]],
) -> tuple[dict[int, dict[str, float]], str]:
    """The timings stored at `path`, or `measure_now()`'s, then stored there. Returns (timings, where
    from)."""
    try:
        stored = json.loads(path.read_text())
        return {int(rows): times for rows, times in stored["timings"].items()}, "cached"
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    start = time.perf_counter()
    timings = measure_now()
    elapsed = time.perf_counter() - start
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"key": machine, "shape": shape, "timings": timings}, indent=1))
        partial.replace(path)
    except OSError as exc:
        logger.warning("could not cache the kernel timings in %s: %s", path.parent, exc)
    return timings, f"measured in {elapsed:.1f} s"


MoEKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def moe_candidates() -> dict[str, MoEKernel]:
    """The candidates of a mixture-of-experts layer (the `fused_moe` contract), first the default:
    `moe-cpp` (`csrc/moe.cpp`, weights streamed once per expert, best at decode sizes) and `moe-torch`
    (the reference: one oneDNN / MKL matmul per active expert, which can win at prefill sizes)."""
    from conveyor.kernels import cpu, reference

    return {"moe-cpp": cpu.fused_moe, "moe-torch": reference.fused_moe}


class SelectedMoE:
    """A `fused_moe` that runs the candidate `dispatch` names for the call's token count."""

    def __init__(self, dispatch: RowDispatch, candidates: dict[str, MoEKernel]) -> None:
        self.dispatch = dispatch
        self.kernels = {name: candidates[name] for name in dispatch.names()}

    def __call__(self, hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
        kernel = self.kernels[self.dispatch.pick(hidden.shape[0])]
        return kernel(hidden, w13, w2, topk_weights, topk_ids)


def measure_moe(
    w13: torch.Tensor, w2: torch.Tensor, top_k: int, candidates: dict[str, MoEKernel]
) -> dict[int, dict[str, float]]:
    """Seconds per call of each candidate on a layer's real expert weights at each ROW_BUCKETS token
    count, each token routed to `top_k` distinct experts drawn uniformly (fixed seed). Stops after the
    first bucket whose fastest call exceeds CALL_BUDGET_S."""
    experts, hidden_size = w13.shape[0], w13.shape[2]
    generator = torch.Generator().manual_seed(0)
    timings: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in ROW_BUCKETS:
            ids = torch.rand(rows, experts, generator=generator).topk(top_k, dim=-1).indices
            weights = torch.rand(rows, top_k, generator=generator)
            fns = {
                name: partial(fn, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
                for name, fn in candidates.items()
            }
            x = torch.randn(rows, hidden_size, generator=generator).to(w13.dtype)
            timings[rows] = time_calls(fns, x)
            if min(timings[rows].values()) > CALL_BUDGET_S:
                break
    return timings


def select_moe_kernels(model: nn.Module) -> dict[tuple[int, int, int, int, str], RowDispatch]:
    """Give every mixture-of-experts layer of `model` (a module with `w13`, `w2`, `top_k` and a
    `fused_moe` attribute, `SparseMoE`) the candidates its shape's table names, measured here (or read
    from the cache), in place. Logs one line per shape. Returns the tables by `(num_experts,
    hidden_size, intermediate_size, top_k, dtype)`."""
    candidates = moe_candidates()
    machine = machine_key()
    tables: dict[tuple[int, int, int, int, str], RowDispatch] = {}
    for module in model.modules():
        if not hasattr(module, "w13") or not hasattr(module, "fused_moe"):
            continue
        w13, w2 = module.w13.detach(), module.w2.detach()
        dtype = str(w13.dtype).removeprefix("torch.")
        key = (w13.shape[0], w13.shape[2], w2.shape[2], module.top_k, dtype)
        if key not in tables:
            record = {
                **machine,
                "moe": "x".join(map(str, key[:4])),
                "dtype": dtype,
                "candidates": ",".join(candidates),
            }
            digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]
            path = cache_dir() / f"moe-{'x'.join(map(str, key[:4]))}-{dtype}-{digest}.json"
            timings, source = _cached(
                path, machine, list(key[:4]), partial(measure_moe, w13, w2, module.top_k, candidates)
            )
            tables[key] = choose(timings, candidates)
            logger.info(
                "experts %s (E x hidden x intermediate x top-k) %s: %s (%s)",
                "x".join(map(str, key[:4])),
                dtype,
                tables[key],
                source,
            )
        module.fused_moe = SelectedMoE(tables[key], candidates)
    return tables


# Prompt lengths at which the prefill attention kernels are timed (shorter chunks run the decode kernel,
# `cpu.MAX_DECODE_KERNEL_QUERY_LEN`); longer prompts keep the last measured bucket's choice.
PREFILL_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
PREFILL_KERNELS = ("flash", "amx", "sdpa")
AttentionShape = tuple[int, int, int]  # (query heads, KV heads, head_dim), per tensor-parallel rank


def prefill_candidates(head_dim: int, dtype: torch.dtype) -> list[str]:
    """The prefill attention kernels of `csrc/attention.cpp` that can run `dtype` heads of `head_dim`
    here: `flash` (bfloat16 on AVX512_BF16, head_dim a multiple of 32), `amx` (the same on AMX tiles,
    where the build and the CPU have them) and `sdpa` (torch's, always)."""
    query = torch.empty(1, 1, head_dim, dtype=dtype)
    available = {
        "flash": torch.ops.conveyor_attention.flash_supported(query),
        "amx": torch.ops.conveyor_attention.amx_supported(query),
        "sdpa": True,
    }
    return [name for name in PREFILL_KERNELS if available[name]]


def measure_prefill_attention(
    shape: AttentionShape, dtype: torch.dtype, candidates: Iterable[str]
) -> dict[int, dict[str, float]]:
    """Seconds per call of each of `candidates` (PREFILL_KERNELS) for one sequence's
    causal prefill of each PREFILL_BUCKETS length (queries and paged K/V random, in `dtype`, blocks of
    16 tokens in shuffled order). Stops after the first bucket whose fastest call exceeds
    CALL_BUDGET_S. Leaves the shape's dispatch at the last candidate timed (the caller sets it)."""
    num_heads, num_kv_heads, head_dim = shape
    generator = torch.Generator().manual_seed(0)
    block_size, timings = 16, {}

    def run(query: torch.Tensor, kernel: str, caches: tuple, tokens: int) -> torch.Tensor:
        torch.ops.conveyor_attention.set_prefill_kernels(*shape, [1], [kernel])
        out = torch.empty_like(query)
        torch.ops.conveyor_attention.prefill_attention(
            out, query, *caches, [tokens], [0], [tokens], head_dim**-0.5
        )
        return out

    with torch.inference_mode():
        for tokens in PREFILL_BUCKETS:
            blocks = -(-tokens // block_size)
            cache_shape = (blocks, block_size, num_kv_heads, head_dim)
            key_cache = torch.randn(cache_shape, generator=generator).to(dtype)
            value_cache = torch.randn(cache_shape, generator=generator).to(dtype)
            table = torch.randperm(blocks, generator=generator).to(torch.int32).unsqueeze(0)
            query = torch.randn(tokens, num_heads, head_dim, generator=generator).to(dtype)
            caches = (key_cache, value_cache, table)
            fns = {k: partial(run, kernel=k, caches=caches, tokens=tokens) for k in candidates}
            timings[tokens] = time_calls(fns, query)
            if min(timings[tokens].values()) > CALL_BUDGET_S:
                break
    return timings


def attention_shape(model: nn.Module) -> AttentionShape | None:
    """(query heads, KV heads, head_dim) of `model`'s first attention layer (a module with
    `num_heads`, `num_kv_heads` and `head_dim`), or None if it has none."""
    for module in model.modules():
        if all(hasattr(module, name) for name in ("num_heads", "num_kv_heads", "head_dim")):
            return (int(module.num_heads), int(module.num_kv_heads), int(module.head_dim))
    return None


def select_prefill_attention(model: nn.Module, dtype: torch.dtype) -> RowDispatch | None:
    """Which C++ prefill attention kernel (`prefill_candidates`: the repo's `flash` and `amx`, torch's
    `sdpa`) runs a sequence of each query row count in `model`'s attention shape, measured here (or
    read from the cache) or named by `CONVEYOR_CPU_KERNELS` (`sdpa`, `flash,amx@512`), and set in the
    C++ library (`set_prefill_kernels`). Logs one line. Returns the dispatch, or None where torch's
    kernel is the only one (float32, another head_dim, a CPU without AVX512_BF16). Raises ValueError
    for a `CONVEYOR_CPU_KERNELS` naming these kernels badly or one this CPU cannot run."""
    shape = attention_shape(model)
    candidates = prefill_candidates(shape[2], dtype) if shape is not None else []
    if len(candidates) < 2:
        return None
    override = os.environ.get(OVERRIDE_ENV, "").strip()
    names = [part.partition("@")[0].strip() for part in override.split(",")] if override else []
    if names and all(name in PREFILL_KERNELS for name in names):
        dispatch, source = parse_override(override, candidates), OVERRIDE_ENV
    else:
        machine = machine_key(("attention.cpp", "simd.h"))
        record = {
            **machine,
            "attention": "x".join(map(str, shape)),
            "dtype": str(dtype),
            "candidates": ",".join(candidates),
        }
        digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]
        kind = str(dtype).removeprefix("torch.")
        path = cache_dir() / f"attention-{'x'.join(map(str, shape))}-{kind}-{digest}.json"
        measure_now = partial(measure_prefill_attention, shape, dtype, candidates)
        timings, source = _cached(path, machine, list(shape), measure_now)
        dispatch = choose(timings, candidates)
    firsts = [first for first, _ in dispatch.ranges]
    torch.ops.conveyor_attention.set_prefill_kernels(*shape, firsts, [name for _, name in dispatch.ranges])
    logger.info(
        "prefill attention %s (heads x KV heads x head_dim) %s: %s query rows (%s)",
        "x".join(map(str, shape)),
        str(dtype).removeprefix("torch."),
        dispatch,
        source,
    )
    return dispatch


def replace_linear_layers(
    model: nn.Module,
    make: Callable[[nn.Module], nn.Module],
    when: Callable[[nn.Module], bool] = lambda linear: True,
) -> int:
    """Replace each `nn.Linear` or `quant.QuantizedLinear` of `model` for which `when` holds by
    `make(linear)`, in place. Returns how many were replaced. A tied float LM head gets its own copy
    (the embedding keeps the plain weight for its lookups); a quantized one shares its packed bytes."""
    from conveyor.kernels.quant import QuantizedLinear

    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, QuantizedLinear)) and when(module)
    ]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make(linear))
    return len(targets)


class SelectedLinear(nn.Module):
    """`y = x @ weight.T + bias` through the candidate `dispatch` names for x's row count.

    x: `[num_tokens, in_features]` -> `[num_tokens, out_features]`, in the layer's dtype. Holds each
    candidate's layout of the weight (so about one extra copy per extra candidate); built after the
    weights are final.
    """

    def __init__(self, linear: nn.Module, dispatch: RowDispatch, candidates: dict[str, Factory]) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dispatch = dispatch
        names = dispatch.names()
        self.kernels = nn.ModuleList(candidates[name](linear) for name in names)
        self._starts = [first for first, _ in dispatch.ranges]
        self._index = [names.index(name) for _, name in dispatch.ranges]

    def kernel_for(self, rows: int) -> nn.Module:
        """The module that runs a call with `rows` rows."""
        return self.kernels[self._index[max(0, bisect.bisect_right(self._starts, rows) - 1)]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel_for(x.shape[0])(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows: {self.dispatch}"


def candidate_factories(dtype: torch.dtype, panel: bool) -> dict[str, Factory]:
    """The matmuls that can run `dtype` linear layers on this CPU, in order of preference: `panel`
    (the C++ kernel, float32, and bfloat16 with AVX512_BF16; only when `panel`, i.e. the C++ backend
    runs), `onednn` (pre-packed, float32, and bfloat16 where the CPU computes it natively) and `torch`
    (the layer as loaded). Raises cpu.CPUKernelBuildError when `panel` and the library cannot be built."""
    from conveyor.kernels import cpu, onednn

    factories: dict[str, Factory] = {}
    if panel:
        cpu.load_library()
    if panel and (dtype == torch.float32 or (dtype == torch.bfloat16 and cpu.bf16_matmul_supported())):
        factories["panel"] = cpu.CPULinear
    if onednn.packing_supported(dtype, torch.device("cpu")):
        factories["onednn"] = onednn.PackedLinear
    factories["torch"] = lambda linear: linear
    return factories


def select_linear_kernels(
    model: nn.Module, dtype: torch.dtype, panel: bool
) -> dict[tuple[int, int, str], RowDispatch]:
    """Replace every `nn.Linear` (float32 or bfloat16, on the CPU) and `quant.QuantizedLinear` of
    `model` by the kernels its shape's table names, in place: measured here (or read from the cache),
    or `CONVEYOR_CPU_KERNELS` for the layers whose candidates it names. Logs one line per shape.
    Returns the tables by `(in_features, out_features, weights)`, weights being the dtype's name or a
    quantized layer's block formats. Raises ValueError for a `CONVEYOR_CPU_KERNELS`
    that names no layer's candidates, or a bad one."""
    from conveyor.kernels.quant import QuantizedLinear

    quantized = any(isinstance(m, QuantizedLinear) for m in model.modules())
    kinds = {"": candidate_factories(dtype, panel), "quantized": quantized_factories() if quantized else {}}
    override = os.environ.get(OVERRIDE_ENV, "").strip()
    forced: dict[str, RowDispatch] = {}
    if override:
        errors = []
        for kind, factories in kinds.items():
            try:
                forced[kind] = parse_override(override, factories)
            except ValueError as exc:
                errors.append(exc)
        names = {part.partition("@")[0].strip() for part in override.split(",")}
        if not forced and not names <= set(PREFILL_KERNELS):
            raise errors[0]
    first_of_shape: dict[tuple[int, int, str], nn.Module] = {}
    for module in model.modules():
        if type(module) is nn.Linear or isinstance(module, QuantizedLinear):
            weights = module.types if isinstance(module, QuantizedLinear) else ""
            first_of_shape.setdefault((module.in_features, module.out_features, weights), module)
    machine = machine_key()
    tables: dict[tuple[int, int, str], RowDispatch] = {}
    for key, linear in first_of_shape.items():
        kind = "quantized" if key[2] else ""
        candidates = kinds[kind]
        if kind in forced:
            tables[key], source = forced[kind], OVERRIDE_ENV
        elif len(candidates) == 1:
            tables[key], source = RowDispatch(((1, next(iter(candidates))),)), "the only kernel"
        else:
            timings, source = cached_timings(linear, candidates, machine, dtype)
            tables[key] = choose(timings, candidates)
        weights = key[2] or str(dtype).removeprefix("torch.")
        logger.info("linear %dx%d %s: %s (%s)", key[0], key[1], weights, tables[key], source)

    def key_of(linear: nn.Module) -> tuple[int, int, str]:
        weights = linear.types if isinstance(linear, QuantizedLinear) else ""
        return (linear.in_features, linear.out_features, weights)

    def make(linear: nn.Module) -> nn.Module:
        key = key_of(linear)
        dispatch = tables[key]
        candidates = kinds["quantized" if key[2] else ""]
        if len(dispatch.ranges) == 1:
            return candidates[dispatch.ranges[0][1]](linear)
        return SelectedLinear(linear, dispatch, candidates)

    replace_linear_layers(model, make, lambda m: type(m) is nn.Linear or isinstance(m, QuantizedLinear))
    name = str(dtype).removeprefix("torch.")
    return {(k[0], k[1], k[2] or name): table for k, table in tables.items()}
