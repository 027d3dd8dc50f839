"""`make bench-autoscale`: the builtin autoscaler on simulated traces, against the static pool that
meets the same SLOs.

    python -m conveyor.benchmarks.autoscale [--out DIR] [--recalibrate] [--quick]

1. **Calibration** (saved as `calibration.json` in the output folder and reused; `--recalibrate`
   measures again): `conveyor serve` is started twice to time its readiness (start to first `/health`
   200), a new replica's time-to-ready; then the real engine on the embedded model runs pure prefill
   steps (64 to 2048 tokens) and pure decode steps (1 to 64 sequences at a context of ~256 tokens),
   and the medians become the simulated replicas' step times.
2. **SLOs** from this engine's unloaded TTFT and TPOT (one request alone on a replica), scaled by the
   ratio of llm-d's SLOs (P90 TTFT <= 3 s, P90 TPOT <= 100 ms) to an 8B model's unloaded TTFT and TPOT
   on its GPUs (about 0.3 s and 10 ms): `SLO_SCALE` x unloaded for both. Each replica runs the largest
   `max_num_seqs` whose decode step stays within 30 % of the TPOT SLO (`--max-num-seqs` overrides).
3. **Capacity**: the peak rate at which a static pool of 8 replicas still reaches the attainment goal,
   found by bisection; llm-d's ramp (2, 4, 6, 8, 10, 4, 1 requests/s for 330, 360, 360, 360, 360, 360,
   300 s) is scaled so that its peak is that rate, i.e. the peak needs 8 replicas.
4. **Traces**: the ramp; a burst (base load, 90 s at 3x, base again); a sinusoid; and the ramp with
   Prometheus down for 120 s across the drop from its peak. Each runs, for `--seeds` Poisson arrival seeds, under the
   builtin autoscaler (`autoscaling_for`: bounds 3-8 as in llm-d's run) and, for comparison, static
   pools from small to large until one reaches the attainment goal.

Prints one table row per trace (combined attainment = the fraction of requests meeting both SLOs,
time-averaged replicas counting starting and draining ones, replicas of the smallest static pool that
meets the goal, scale events), writes `autoscale.json` and one PNG per trace (load, replicas, p90 TTFT
over time, first seed), and ends with `ramp: attainment=A avg_replicas=R static_replicas=S` (means
over the seeds; static: the largest any seed needed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from conveyor.benchmarks.autoscale_sim import (
    Arrival,
    SimConfig,
    SimResult,
    StepModel,
    poisson_arrivals,
    simulate,
)
from conveyor.operator.spec import AutoscalingSpec

RESULTS = Path(__file__).resolve().parent / "results"
# llm-d's staged ramp: (seconds, requests/s).
LLMD_RAMP = [(330, 2), (360, 4), (360, 6), (360, 8), (360, 10), (360, 4), (300, 1)]
LLMD_PEAK = 10
LLMD_STATIC = 8
# llm-d's SLOs over an 8B model's unloaded TTFT and TPOT on its GPUs (3 s / ~0.3 s, 100 ms / ~10 ms).
SLO_SCALE = 10.0
GOAL = 0.96
PROMPT_LEN, OUTPUT_LEN = 256, 128


def autoscaling_for(capacity_rps: float, slo: tuple[float, float]) -> dict:
    """The autoscaler as the benchmark runs it: llm-d's bounds (3-8); requests/s per replica at 90 %
    of one replica's capacity measured in this run, the p90 TTFT SLO and 4 waiting per replica as
    guards; a 30 s TTFT/rate window and a 30 s scale-down window (the defaults otherwise)."""
    return {
        "minReplicas": 3,
        "maxReplicas": 8,
        "targetRequestsPerSecond": round(0.9 * capacity_rps, 4),
        "targetTTFTSeconds": round(slo[0], 4),
        "targetQueueDepth": 4,
        "ttftWindowSeconds": 30,
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 30}},
    }


@dataclass
class Calibration:
    """What the simulation takes from this machine: step times (seconds) of pure decode steps by batch
    size and of pure prefill steps by tokens, and `conveyor serve`'s time to ready (seconds)."""

    decode_s: list[list[float]]
    prefill_s: list[list[float]]
    max_num_batched_tokens: int
    time_to_ready_s: float
    num_steps: int
    cpu: str
    measured_at: str

    def step_model(self, max_num_seqs: int) -> StepModel:
        return StepModel(
            tuple((int(n), s) for n, s in self.decode_s),
            tuple((int(n), s) for n, s in self.prefill_s),
            max_num_seqs,
            self.max_num_batched_tokens,
        )


def cpu_description() -> str:
    flags = set()
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = set(re.findall(r"\b(avx512[a-z_0-9]*|avx2|amx[a-z_0-9]*)\b", text))
    except OSError:
        pass
    return f"{platform.machine()} {' '.join(sorted(flags)) or 'no avx2/avx512'}"


def calibrate(max_batch: int, max_num_batched_tokens: int) -> Calibration:
    """Time `conveyor serve`'s start-up, then the real engine's steps (embedded model, the server's
    default dtype): pure prefill steps of 64 to `max_num_batched_tokens` tokens, pure decode steps of
    1 to `max_batch` sequences at a context of about PROMPT_LEN tokens. Medians per size."""
    from conveyor.benchmarks.server_process import ConveyorServer
    from conveyor.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from conveyor.server.engine.builder import build_engine
    from conveyor.server.messages import SamplingParams
    from conveyor.server.model import loader

    # Start-up first: an engine in this process would compete with the server for the cores. The
    # model cache is filled first (a one-time conversion is not a replica's start).
    loader.converted(loader.resolve_model(None))
    with tempfile.TemporaryDirectory() as tmp:
        starts = []
        for _ in range(2):
            server = ConveyorServer(["--max-model-len", "2048"], Path(tmp) / "serve.log")
            started = time.monotonic()
            with server:
                starts.append(time.monotonic() - started)
    engine = build_engine(
        EngineConfig(
            model=ModelConfig(max_model_len=4096),
            cache=CacheConfig(kv_cache_memory=2 << 30),
            scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=max_num_batched_tokens),
        )
    )
    rng = np.random.default_rng(0)
    vocab = engine.model.shape.vocab_size
    ids = iter(range(1 << 30))
    steps: list[tuple[int, int, float]] = []

    def run(requests: list[tuple[int, int]]) -> None:
        for prompt_len, max_tokens in requests:
            prompt = rng.integers(0, vocab, prompt_len).tolist()
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(engine.make_request(f"calibration-{next(ids)}", prompt, params))
        while engine.has_unfinished_requests():
            _timed_step(engine, steps)

    run([(64, 4)] * 4)  # warm-up
    steps.clear()
    prefill = {}
    for tokens in (64, 128, 256, 512, 1024, max_num_batched_tokens):
        steps.clear()
        for _ in range(3):
            run([(tokens, 1)])
        prefill[tokens] = statistics.median(t for d, p, t in steps if d == 0 and p == tokens)
    decode = {}
    for batch in sorted({1, 2, 4, 8, 16, 32, 48, max_batch}):
        steps.clear()
        run([(PROMPT_LEN, 16)] * batch)
        decode[batch] = statistics.median(t for d, p, t in steps if d == batch and p == 0)
    return Calibration(
        decode_s=[[n, s] for n, s in sorted(decode.items())],
        prefill_s=[[n, s] for n, s in sorted(prefill.items())],
        max_num_batched_tokens=max_num_batched_tokens,
        time_to_ready_s=statistics.median(starts),
        num_steps=len(steps),
        cpu=cpu_description(),
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )


def _timed_step(engine, steps: list[tuple[int, int, float]]) -> None:
    """One engine step: (decode sequences, prefill tokens, seconds) appended to `steps`."""
    before = engine.stats.num_steps
    started = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - started
    if engine.stats.num_steps == before:
        return  # nothing was scheduled
    record = engine.stats.recent_steps[-1]
    decodes = sum(1 for _, n in record.scheduled if n == 1)
    prefill = sum(n for _, n in record.scheduled if n > 1)
    steps.append((decodes, prefill, elapsed))


@dataclass
class TraceResult:
    """One trace over several arrival seeds: means, except static_replicas (the most any seed needed)."""

    name: str
    attainment: float
    avg_replicas: float
    static_replicas: int | None
    scale_events: float
    p90_ttft_s: float
    p90_tpot_s: float
    num_requests: int
    per_seed: list[dict[str, float]]
    min_replicas_during_outage: int | None = None


def _static_replicas(
    config: SimConfig, arrivals: list[Arrival], duration: float, slo, start: int
) -> int | None:
    """The smallest static pool reaching GOAL on `arrivals`."""
    for n in range(max(start, 1), start + 12):
        static = simulate(
            SimConfig(config.model, config.time_to_ready_s), arrivals, duration, None, static_replicas=n
        )
        if static.attainment(*slo) >= GOAL:
            return n
    return None


def run_trace(
    name: str,
    config: SimConfig,
    stages: list[tuple[float, float]],
    slo: tuple[float, float],
    spec: AutoscalingSpec,
    out: Path,
    seeds: int,
) -> TraceResult:
    duration = sum(d for d, _ in stages)
    per_seed, statics, outage_min = [], [], []
    for seed in range(seeds):
        arrivals = poisson_arrivals(stages, PROMPT_LEN, OUTPUT_LEN, seed)
        auto = simulate(config, arrivals, duration, spec)
        done = [r for r in auto.requests if r.finish_s is not None]
        per_seed.append(
            {
                "seed": seed,
                "attainment": auto.attainment(*slo),
                "avg_replicas": auto.avg_replicas,
                "scale_events": auto.scale_events,
                "p90_ttft_s": float(np.percentile([r.ttft_s for r in done], 90)),
                "p90_tpot_s": float(np.percentile([r.tpot_s for r in done], 90)),
                "num_requests": len(auto.requests),
            }
        )
        statics.append(_static_replicas(config, arrivals, duration, slo, spec.min_replicas))
        if config.outages:
            start, end = config.outages[0]
            outage_min.append(min(n for t, n, _ in auto.timeline if start <= t < end))
        if seed == 0:
            plot(out / f"autoscale_{name}.png", name, arrivals, auto, stages, slo)

    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in per_seed]))

    return TraceResult(
        name=name,
        attainment=mean("attainment"),
        avg_replicas=mean("avg_replicas"),
        static_replicas=None if None in statics else max(statics),
        scale_events=mean("scale_events"),
        p90_ttft_s=mean("p90_ttft_s"),
        p90_tpot_s=mean("p90_tpot_s"),
        num_requests=int(mean("num_requests")),
        per_seed=per_seed,
        min_replicas_during_outage=min(outage_min) if outage_min else None,
    )


def plot(
    path: Path,
    name: str,
    arrivals: list[Arrival],
    result: SimResult,
    stages: list[tuple[float, float]],
    slo: tuple[float, float],
) -> None:
    """Load (requests/s per 30 s), replicas, and p90 TTFT of the requests arriving in each 30 s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    duration = sum(d for d, _ in stages)
    edges = np.arange(0, duration + 30, 30)
    load = np.histogram([a.at_s for a in arrivals], bins=edges)[0] / 30
    ttft = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        window = [r.ttft_s for r in result.requests if lo <= r.arrival_s < hi and r.first_token_s is not None]
        ttft.append(np.percentile(window, 90) if window else np.nan)
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    ax1.step(edges[:-1], load, where="post", color="tab:blue")
    ax1.set_ylabel("requests / s")
    ax1.set_title(f"{name}: builtin autoscaler (simulated, calibrated on this machine)")
    times = [t for t, _, _ in result.timeline]
    ax2.step(times, [n for _, n, _ in result.timeline], where="post", label="replicas", color="tab:orange")
    ax2.step(times, [r for _, _, r in result.timeline], where="post", label="ready", color="tab:green")
    ax2.set_ylabel("replicas")
    ax2.legend(loc="upper left")
    ax3.plot(edges[:-1], ttft, color="tab:red", label="p90 TTFT (30 s)")
    ax3.axhline(slo[0], color="grey", linestyle="--", label="TTFT SLO")
    ax3.set_yscale("log")
    ax3.set_ylabel("seconds")
    ax3.set_xlabel("time (s)")
    ax3.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def peak_rate_for(config: SimConfig, replicas: int, slo: tuple[float, float], seconds: float) -> float:
    """The largest Poisson rate (requests/s) a static pool of `replicas` serves at >= GOAL attainment."""
    # Twice the prefill-bound rate of one replica: surely more than it serves.
    one = 2.0 / (config.model.per_prefill_token_s * PROMPT_LEN)
    lo, hi = 0.0, one * replicas
    for _ in range(12):
        mid = (lo + hi) / 2
        arrivals = poisson_arrivals([(seconds, mid)], PROMPT_LEN, OUTPUT_LEN, seed=1)
        result = simulate(config, arrivals, seconds, None, static_replicas=replicas)
        if result.attainment(*slo) >= GOAL:
            lo = mid
        else:
            hi = mid
    return lo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.benchmarks.autoscale", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default benchmarks/results/<date>)"
    )
    parser.add_argument("--recalibrate", action="store_true", help="measure the engine again")
    parser.add_argument("--calibration", type=Path, default=None, help="read the calibration from this file")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="max_num_seqs of each simulated replica (default: the largest batch within half the TPOT SLO)",
    )
    parser.add_argument("--seeds", type=int, default=4, help="arrival seeds per trace (results are means)")
    parser.add_argument("--calibration-max-batch", type=int, default=64, help="largest decode batch measured")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--quick", action="store_true", help="the ramp only, time-compressed 10x (a smoke run)"
    )
    args = parser.parse_args(argv)
    out = args.out or RESULTS / datetime.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)

    if args.calibration is not None and not args.calibration.is_file():
        parser.error(f"--calibration {args.calibration}: no such file")
    cal_path = args.calibration or out / "calibration.json"
    if cal_path.exists() and not args.recalibrate:
        calibration = Calibration(**json.loads(cal_path.read_text()))
        print(f"calibration: {cal_path} ({calibration.measured_at}, {calibration.cpu})", flush=True)
    else:
        print("calibrating the engine and conveyor serve's start-up ...", flush=True)
        calibration = calibrate(args.calibration_max_batch, args.max_num_batched_tokens)
        (out / "calibration.json").write_text(json.dumps(asdict(calibration), indent=2) + "\n")
    probe = calibration.step_model(args.max_num_seqs or 1)
    ttft0, tpot0 = probe.unloaded(PROMPT_LEN, OUTPUT_LEN)
    slo = (SLO_SCALE * ttft0, SLO_SCALE * tpot0)
    # As a latency-bound deployment is sized: the largest decode batch whose step takes at most 30 % of
    # the TPOT SLO, leaving the rest for the prefill chunks that share its steps.
    max_num_seqs = args.max_num_seqs or probe.largest_batch_within(0.3 * slo[1])
    model = calibration.step_model(max_num_seqs)
    config = SimConfig(model, calibration.time_to_ready_s)
    decode = ", ".join(f"{int(n)}: {s * 1e3:.1f}" for n, s in calibration.decode_s)
    prefill = ", ".join(f"{int(n)}: {s * 1e3:.0f}" for n, s in calibration.prefill_s)
    print(
        f"decode step ms by batch {{{decode}}}; prefill step ms by tokens {{{prefill}}}; "
        f"time to ready {calibration.time_to_ready_s:.1f} s",
        flush=True,
    )
    print(
        f"unloaded TTFT {ttft0 * 1e3:.0f} ms, TPOT {tpot0 * 1e3:.1f} ms -> SLO P90 TTFT <= {slo[0]:.2f} s, "
        f"TPOT <= {slo[1] * 1e3:.0f} ms; replicas run max_num_seqs {max_num_seqs}",
        flush=True,
    )
    compress = 10.0 if args.quick else 1.0
    peak = peak_rate_for(config, LLMD_STATIC, slo, 300.0 / compress)
    unit = peak / LLMD_PEAK
    print(f"capacity: {LLMD_STATIC} static replicas serve {peak:.2f} requests/s at >= {GOAL}", flush=True)
    ramp = [(d / compress, r * unit) for d, r in LLMD_RAMP]
    traces: dict[str, tuple[list[tuple[float, float]], SimConfig]] = {"ramp": (ramp, config)}
    if not args.quick:
        base = 3 * unit
        traces["burst"] = ([(600, base), (90, 3 * base), (600, base)], config)
        traces["sinusoid"] = (
            [(30, unit * (5.5 + 4.5 * np.sin(2 * np.pi * (i * 30) / 900))) for i in range(60)],
            config,
        )
        # Prometheus down across the drop from the peak: read as 0 the pool would fall to its minimum.
        drop = sum(d for d, _ in LLMD_RAMP[:5])
        outage = SimConfig(model, calibration.time_to_ready_s, outages=((drop - 60, drop + 60),))
        traces["outage"] = (ramp, outage)
    spec = AutoscalingSpec.model_validate(autoscaling_for(peak / LLMD_STATIC, slo))
    results = []
    header = (
        f"{'trace':10} {'attainment':>10} {'avg_repl':>9} {'static':>7} {'events':>7} "
        f"{'p90 TTFT':>9} {'p90 TPOT':>9}   (means over {args.seeds} arrival seeds)"
    )
    print(header)
    for name, (stages, trace_config) in traces.items():
        result = run_trace(name, trace_config, stages, slo, spec, out, args.seeds)
        results.append(result)
        static = result.static_replicas if result.static_replicas is not None else "-"
        print(
            f"{name:10} {result.attainment:10.3f} {result.avg_replicas:9.2f} {static!s:>7} "
            f"{result.scale_events:7.1f} {result.p90_ttft_s:9.3f} {result.p90_tpot_s * 1e3:7.1f}ms",
            flush=True,
        )
        if result.min_replicas_during_outage is not None:
            print(f"{'':10} replicas during the outage never fell below {result.min_replicas_during_outage}")
    report = {
        "calibration": asdict(calibration),
        "slo": {"ttft_s": slo[0], "tpot_s": slo[1], "scale": SLO_SCALE, "goal": GOAL},
        "peak_rate": peak,
        "max_num_seqs": max_num_seqs,
        "autoscaling": spec.model_dump(by_alias=True, exclude_none=True),
        "traces": [asdict(r) for r in results],
    }
    (out / "autoscale.json").write_text(json.dumps(report, indent=2) + "\n")
    ramp_result = results[0]
    print(
        f"ramp: attainment={ramp_result.attainment:.3f} avg_replicas={ramp_result.avg_replicas:.2f} "
        f"static_replicas={ramp_result.static_replicas}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
