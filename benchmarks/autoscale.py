"""`make bench-autoscale`: the builtin autoscaler on simulated traces, against the static pool that
meets the same SLOs.

    python -m conveyor.benchmarks.autoscale [--out DIR] [--recalibrate] [--quick]

1. **Calibration** (saved as `calibration.json` in the output folder and reused; `--recalibrate`
   measures again): the real engine on the embedded model steps through batches of mixed prefill and
   decode; a least-squares fit gives the step time as `base + per_decode x decode sequences +
   per_prefill_token x prefill tokens`. `conveyor serve` is started once to time its readiness (start
   to first `/health` 200): a new replica's time-to-ready.
2. **SLOs** from this engine's unloaded TTFT and TPOT (one request alone on a replica), scaled by the
   ratio of llm-d's SLOs (P90 TTFT <= 3 s, P90 TPOT <= 100 ms) to an 8B model's unloaded TTFT and TPOT
   on its GPUs (about 0.3 s and 10 ms): `SLO_SCALE` x unloaded for both.
3. **Capacity**: the peak rate at which a static pool of 8 replicas still reaches the attainment goal,
   found by bisection; llm-d's ramp (2, 4, 6, 8, 10, 4, 1 requests/s for 330, 360, 360, 360, 360, 360,
   300 s) is scaled so that its peak is that rate, i.e. the peak needs 8 replicas.
4. **Traces**: the ramp; a burst (base load, 90 s at 3x, base again); a sinusoid; and the ramp with
   Prometheus down for 120 s at its peak. Each runs under the builtin autoscaler (`AUTOSCALING`,
   bounds 3-8 as in llm-d's run) and, for comparison, static pools from small to large until one
   reaches the attainment goal.

Prints one table row per trace (combined attainment = the fraction of requests meeting both SLOs,
time-averaged replicas counting starting and draining ones, replicas of the smallest static pool that
meets the goal, scale events), writes `autoscale.json` and one PNG per trace (load, replicas, p90 TTFT
over time), and ends with `ramp: attainment=A avg_replicas=R static_replicas=S`.
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
# The autoscaler as the benchmark runs it: the bounds of llm-d's run, the defaults otherwise except a
# 60 s scale-down window (the HPA's 300 s would keep the peak's replicas 4 minutes into each drop).
AUTOSCALING = {
    "minReplicas": 3,
    "maxReplicas": 8,
    "targetQueueDepth": 2,
    "ttftWindowSeconds": 30,
    "behavior": {"scaleDown": {"stabilizationWindowSeconds": 60}},
}


@dataclass
class Calibration:
    """What the simulation takes from this machine. Seconds; CPU flags name the machine."""

    base_s: float
    per_decode_s: float
    per_prefill_token_s: float
    max_num_seqs: int
    max_num_batched_tokens: int
    time_to_ready_s: float
    fit_r2: float
    num_steps: int
    cpu: str
    measured_at: str


def cpu_description() -> str:
    flags = set()
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = set(re.findall(r"\b(avx512[a-z_0-9]*|avx2|amx[a-z_0-9]*)\b", text))
    except OSError:
        pass
    return f"{platform.machine()} {' '.join(sorted(flags)) or 'no avx2/avx512'}"


def calibrate(max_num_seqs: int, max_num_batched_tokens: int) -> Calibration:
    """Fit the step model to the real engine (embedded model, float32 on CPU) and time `conveyor serve`'s
    start-up."""
    from conveyor.benchmarks.server_process import ConveyorServer
    from conveyor.server.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from conveyor.server.engine.engine import LLMEngine
    from conveyor.server.engine.request import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(max_model_len=2048),
            cache=CacheConfig(kv_cache_memory=1 << 30),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
            ),
        )
    )
    rng = np.random.default_rng(0)
    vocab = engine.model.shape.vocab_size
    rows, times = [], []
    # Waves of requests: mixed steps (new prompts arriving while others decode) and pure decode steps.
    for wave, batch in enumerate((1, 4, 8, 16, 32, max_num_seqs)):
        for i in range(batch):
            prompt = rng.integers(0, vocab, int(rng.integers(PROMPT_LEN // 2, PROMPT_LEN * 3 // 2))).tolist()
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            engine.add_request(f"w{wave}-{i}", prompt, params)
            if i % 4 == 3:
                _timed_step(engine, rows, times)
        while engine.has_unfinished_requests():
            _timed_step(engine, rows, times)
    x = np.array([[1.0, d, p] for d, p in rows])
    y = np.array(times)
    # Drop the first steps (warm-up) from the fit.
    coef, *_ = np.linalg.lstsq(x[5:], y[5:], rcond=None)
    predicted = x[5:] @ coef
    r2 = 1 - float(np.sum((y[5:] - predicted) ** 2) / np.sum((y[5:] - y[5:].mean()) ** 2))
    del engine

    with tempfile.TemporaryDirectory() as tmp:
        starts = []
        for _ in range(2):
            server = ConveyorServer(["--max-model-len", "2048"], Path(tmp) / "serve.log")
            started = time.monotonic()
            with server:
                starts.append(time.monotonic() - started)
    return Calibration(
        base_s=max(float(coef[0]), 0.0),
        per_decode_s=max(float(coef[1]), 0.0),
        per_prefill_token_s=max(float(coef[2]), 0.0),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        time_to_ready_s=statistics.median(starts),
        fit_r2=r2,
        num_steps=len(rows) - 5,
        cpu=cpu_description(),
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )


def _timed_step(engine, rows: list[tuple[int, int]], times: list[float]) -> None:
    started = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - started
    record = engine.stats.recent_steps[-1] if engine.stats.recent_steps else None
    if record is None or not record.scheduled:
        return
    decodes = sum(1 for _, n in record.scheduled if n == 1)
    prefill = sum(n for _, n in record.scheduled if n > 1)
    rows.append((decodes, prefill))
    times.append(elapsed)


@dataclass
class TraceResult:
    name: str
    attainment: float
    avg_replicas: float
    static_replicas: int | None
    static_attainment: float | None
    scale_events: int
    p90_ttft_s: float
    p90_tpot_s: float
    num_requests: int
    min_replicas_during_outage: int | None = None


def run_trace(
    name: str,
    config: SimConfig,
    stages: list[tuple[float, float]],
    slo: tuple[float, float],
    spec: AutoscalingSpec,
    static_from: int,
    out: Path,
    seed: int,
) -> tuple[TraceResult, SimResult]:
    arrivals = poisson_arrivals(stages, PROMPT_LEN, OUTPUT_LEN, seed)
    duration = sum(d for d, _ in stages)
    auto = simulate(config, arrivals, duration, spec)
    attainment = auto.attainment(*slo)
    static_n, static_att = None, None
    for n in range(max(static_from, 1), spec.max_replicas + 5):
        att = simulate(
            SimConfig(config.model, config.time_to_ready_s), arrivals, duration, None, static_replicas=n
        )
        if att.attainment(*slo) >= GOAL:
            static_n, static_att = n, att.attainment(*slo)
            break
    done = [r for r in auto.requests if r.finish_s is not None]
    result = TraceResult(
        name=name,
        attainment=attainment,
        avg_replicas=auto.avg_replicas,
        static_replicas=static_n,
        static_attainment=static_att,
        scale_events=auto.scale_events,
        p90_ttft_s=float(np.percentile([r.ttft_s for r in done], 90)) if done else float("nan"),
        p90_tpot_s=float(np.percentile([r.tpot_s for r in done], 90)) if done else float("nan"),
        num_requests=len(auto.requests),
    )
    if config.outages:
        start, end = config.outages[0]
        result.min_replicas_during_outage = min(n for t, n, _ in auto.timeline if start <= t < end)
    plot(out / f"autoscale_{name}.png", name, arrivals, auto, stages, slo)
    return result, auto


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
    one = 1.0 / config.model.step_s(1, PROMPT_LEN)  # generous upper start: prefill-bound rate of one
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
    parser.add_argument("--max-num-seqs", type=int, default=64, help="max_num_seqs of each replica")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--quick", action="store_true", help="the ramp only, time-compressed 10x (a smoke run)"
    )
    args = parser.parse_args(argv)
    out = args.out or RESULTS / datetime.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)

    cal_path = args.calibration or out / "calibration.json"
    if cal_path.exists() and not args.recalibrate:
        calibration = Calibration(**json.loads(cal_path.read_text()))
        print(f"calibration: {cal_path} ({calibration.measured_at}, {calibration.cpu})", flush=True)
    else:
        print("calibrating the engine and conveyor serve's start-up ...", flush=True)
        calibration = calibrate(args.max_num_seqs, args.max_num_batched_tokens)
        (out / "calibration.json").write_text(json.dumps(asdict(calibration), indent=2) + "\n")
    model = StepModel(
        calibration.base_s,
        calibration.per_decode_s,
        calibration.per_prefill_token_s,
        calibration.max_num_seqs,
        calibration.max_num_batched_tokens,
    )
    config = SimConfig(model, calibration.time_to_ready_s)
    ttft0, tpot0 = model.unloaded(PROMPT_LEN, OUTPUT_LEN)
    slo = (SLO_SCALE * ttft0, SLO_SCALE * tpot0)
    print(
        f"step = {model.base_s * 1e3:.2f} ms + {model.per_decode_s * 1e3:.3f} ms/decode seq + "
        f"{model.per_prefill_token_s * 1e6:.1f} us/prefill token (R^2 {calibration.fit_r2:.3f}); "
        f"time to ready {calibration.time_to_ready_s:.1f} s; unloaded TTFT {ttft0 * 1e3:.0f} ms, "
        f"TPOT {tpot0 * 1e3:.1f} ms; SLO: P90 TTFT <= {slo[0]:.2f} s, TPOT <= {slo[1] * 1e3:.0f} ms",
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
        peak_start = sum(d for d, _ in LLMD_RAMP[:4])
        outage = SimConfig(model, calibration.time_to_ready_s, outages=((peak_start + 60, peak_start + 180),))
        traces["outage"] = (ramp, outage)
    spec = AutoscalingSpec.model_validate(AUTOSCALING)
    results = []
    header = f"{'trace':10} {'attainment':>10} {'avg_repl':>9} {'static':>7} {'events':>7} {'p90 TTFT':>9} {'p90 TPOT':>9}"
    print(header)
    for seed, (name, (stages, trace_config)) in enumerate(traces.items()):
        result, _ = run_trace(name, trace_config, stages, slo, spec, 3, out, seed)
        results.append(result)
        static = result.static_replicas if result.static_replicas is not None else "-"
        print(
            f"{name:10} {result.attainment:10.3f} {result.avg_replicas:9.2f} {static!s:>7} "
            f"{result.scale_events:7d} {result.p90_ttft_s:9.3f} {result.p90_tpot_s * 1e3:7.1f}ms",
            flush=True,
        )
        if result.min_replicas_during_outage is not None:
            print(f"{'':10} replicas held during the outage: min {result.min_replicas_during_outage}")
    report = {
        "calibration": asdict(calibration),
        "slo": {"ttft_s": slo[0], "tpot_s": slo[1], "scale": SLO_SCALE, "goal": GOAL},
        "peak_rate": peak,
        "autoscaling": AUTOSCALING,
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
