"""A discrete-event simulation of an autoscaled InferenceService: replicas, Prometheus, the autoscaler.

Everything but the decision is a model, and each model is calibrated or mirrors a documented behaviour:

- **Replica**: a continuous-batching engine stepping like `conveyor serve`'s scheduler (every running
  sequence decodes one token per step; waiting prompts are prefilled FCFS in chunks within
  `max_num_batched_tokens`; at most `max_num_seqs` running). Step times come from the real engine on
  this machine (`StepModel`; `benchmarks/autoscale.py` measures them). A new replica serves after the
  measured time-to-ready of `conveyor serve`; a removed one stops taking requests and drains.
- **Load balancing**: each arrival goes to the Ready replica with the fewest outstanding requests
  (as an inference-aware router does); with no Ready replica it waits for one.
- **Prometheus**: scrapes every Ready replica every `scrape_interval_s` (the TTFT histogram with the
  server's buckets, and the `num_requests_waiting` gauge); an instant query reads the last scrape;
  `rate()` over a window is the increase between the first and last sample inside it over the time
  between them (Prometheus extrapolates it to the window);
  `histogram_quantile` interpolates linearly inside the bucket as Prometheus does. During an outage
  every query fails.
- **Autoscaler**: the operator's own `conveyor.operator.autoscaler.decide`, every `interval_s`, on the
  observation `operator/metrics.py` would build (queue depth extrapolated over unscraped Ready pods).

Outputs per run: every request's TTFT and TPOT, the replica count over time, and the scale events.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from conveyor.operator.autoscaler import History, Observation, decide
from conveyor.operator.spec import AutoscalingSpec
from conveyor.server.api.metrics import LATENCY_BUCKETS


def _interp(table: tuple[tuple[int, float], ...], x: float) -> float:
    """Piecewise-linear through (x, y) points sorted by x, extended linearly past both ends."""
    if len(table) == 1:
        return table[0][1]
    i = min(max(bisect.bisect_left([p[0] for p in table], x), 1), len(table) - 1)
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


@dataclass(frozen=True)
class StepModel:
    """Engine step time in seconds, measured: pure decode steps by batch size (`decode_s`: (sequences,
    seconds)), pure prefill steps by tokens (`prefill_s`: (tokens, seconds)). A mixed step costs the
    decode batch's time plus the prefill tokens at the marginal per-token cost (the slope of `prefill_s`),
    since the fixed cost of a forward pass is paid once."""

    decode_s: tuple[tuple[int, float], ...]
    prefill_s: tuple[tuple[int, float], ...]
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def per_prefill_token_s(self) -> float:
        (x0, y0), (x1, y1) = self.prefill_s[0], self.prefill_s[-1]
        return (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0

    def step_s(self, decode_seqs: int, prefill_tokens: int) -> float:
        if decode_seqs == 0:
            return _interp(self.prefill_s, prefill_tokens)
        return _interp(self.decode_s, decode_seqs) + self.per_prefill_token_s * prefill_tokens

    def unloaded(self, prompt_len: int, output_len: int) -> tuple[float, float]:
        """(TTFT, TPOT) in seconds of one request alone on a replica."""
        ttft, left = 0.0, prompt_len
        while left > 0:
            chunk = min(left, self.max_num_batched_tokens)
            ttft += self.step_s(0, chunk)
            left -= chunk
        return ttft, (self.step_s(1, 0) if output_len > 1 else 0.0)

    def largest_batch_within(self, step_seconds: float) -> int:
        """The most decode sequences whose step takes at most `step_seconds` (at least 1)."""
        best = 1
        for n in range(1, 1025):
            if _interp(self.decode_s, n) > step_seconds:
                break
            best = n
        return best


@dataclass
class SimRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    prefilled: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        assert self.first_token_s is not None and self.finish_s is not None
        return (self.finish_s - self.first_token_s) / max(self.output_len - 1, 1)


class Replica:
    """One simulated server: its queue, its running batch and the series Prometheus scrapes."""

    def __init__(self, index: int, model: StepModel, created_s: float, ready_s: float) -> None:
        self.index = index
        self.model = model
        self.created_s = created_s
        self.ready_s = ready_s
        self.draining = False
        self.removed_s: float | None = None
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []  # admitted, prompt not fully computed
        self.decoding: list[tuple[int, int, SimRequest]] = []  # heap of (finish step, id, request)
        self.steps = 0
        self.busy = False
        # Cumulative TTFT histogram (le buckets, then +Inf) as `conveyor serve` exports it.
        self.ttft_buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self.ttft_count = 0
        self._step_plan: tuple[list[tuple[SimRequest, int]], int] | None = None

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    def is_ready(self, now: float) -> bool:
        return now >= self.ready_s and self.removed_s is None

    def start_step(self, now: float) -> float | None:
        """Plan the next step as the scheduler would; returns its end time, or None when idle."""
        budget = self.model.max_num_batched_tokens - len(self.decoding)
        chunks: list[tuple[SimRequest, int]] = []
        for request in self.prefilling:
            if budget <= 0:
                break
            n = min(request.prompt_len - request.prefilled, budget)
            chunks.append((request, n))
            budget -= n
        running = len(self.decoding) + len(self.prefilling)
        while self.waiting and budget > 0 and running < self.model.max_num_seqs:
            request = self.waiting.popleft()
            self.prefilling.append(request)
            n = min(request.prompt_len, budget)
            chunks.append((request, n))
            budget -= n
            running += 1
        prefill_tokens = sum(n for _, n in chunks)
        if not chunks and not self.decoding:
            self.busy = False
            return None
        self.busy = True
        self._step_plan = (chunks, len(self.decoding))
        return now + self.model.step_s(len(self.decoding), prefill_tokens)

    def finish_step(self, now: float) -> list[SimRequest]:
        """Apply the planned step at its end time `now`; returns the requests that finished."""
        assert self._step_plan is not None
        chunks, _ = self._step_plan
        self._step_plan = None
        self.steps += 1
        finished = []
        while self.decoding and self.decoding[0][0] <= self.steps:
            _, _, request = heapq.heappop(self.decoding)
            request.finish_s = now
            finished.append(request)
        for request, n in chunks:
            request.prefilled += n
            if request.prefilled >= request.prompt_len:
                self.prefilling.remove(request)
                request.first_token_s = now
                self._observe_ttft(request.ttft_s)
                if request.output_len <= 1:
                    request.finish_s = now
                    finished.append(request)
                else:
                    # One token per later step: the last of output_len tokens comes output_len - 1 steps on.
                    heapq.heappush(self.decoding, (self.steps + request.output_len - 1, id(request), request))
        return finished

    def _observe_ttft(self, seconds: float) -> None:
        self.ttft_count += 1
        for i in range(bisect.bisect_left(LATENCY_BUCKETS, seconds), len(self.ttft_buckets)):
            self.ttft_buckets[i] += 1


@dataclass(frozen=True)
class Scrape:
    at_s: float
    ttft_buckets: tuple[int, ...]
    ttft_count: int
    waiting: int
    running: int


def histogram_quantile(q: float, increases: list[float]) -> float:
    """Prometheus's `histogram_quantile` over cumulative bucket increases (LATENCY_BUCKETS, then +Inf):
    linear interpolation inside the bucket holding rank q x total; NaN when there were no samples; the
    highest finite bound when the rank falls into +Inf."""
    total = increases[-1]
    if total <= 0:
        return math.nan
    rank = q * total
    index = next(i for i, c in enumerate(increases) if c >= rank)
    if index == len(LATENCY_BUCKETS):
        return LATENCY_BUCKETS[-1]
    lower = LATENCY_BUCKETS[index - 1] if index > 0 else 0.0
    below = increases[index - 1] if index > 0 else 0.0
    in_bucket = increases[index] - below
    if in_bucket <= 0:
        return LATENCY_BUCKETS[index]
    return lower + (LATENCY_BUCKETS[index] - lower) * (rank - below) / in_bucket


class PrometheusModel:
    """Scrapes per replica, answering the autoscaler's queries as Prometheus would."""

    def __init__(self, scrape_interval_s: float, outages: tuple[tuple[float, float], ...] = ()) -> None:
        self.scrape_interval_s = scrape_interval_s
        self.outages = outages
        self.series: dict[int, list[Scrape]] = {}

    def down(self, now: float) -> bool:
        return any(start <= now < end for start, end in self.outages)

    def scrape(self, now: float, replicas: list[Replica]) -> None:
        if self.down(now):
            return
        for r in replicas:
            if r.is_ready(now):
                running = len(r.prefilling) + len(r.decoding)
                scrape = Scrape(now, tuple(r.ttft_buckets), r.ttft_count, len(r.waiting), running)
                self.series.setdefault(r.index, []).append(scrape)

    def observe(self, now: float, ready: list[Replica], window_s: float) -> Observation:
        """What `operator/metrics.py` reads over the `ready` replicas."""
        if self.down(now) or not ready:
            return Observation(None, None)
        increases = [0.0] * (len(LATENCY_BUCKETS) + 1)
        rate, has_rate, waiting, running = 0.0, False, [], []
        for r in ready:
            samples = self.series.get(r.index, [])
            # Prometheus's 5-minute lookback: the newest sample counts for an instant query.
            if samples and now - samples[-1].at_s <= 300:
                waiting.append(samples[-1].waiting)
                running.append(samples[-1].running)
            inside = [
                s for s in samples[-int(window_s / self.scrape_interval_s) - 2 :] if now - s.at_s < window_s
            ]
            if len(inside) >= 2:
                has_rate = True
                first, last = inside[0], inside[-1]
                # rate() extrapolates the increase between the samples to the whole window.
                rate += (last.ttft_count - first.ttft_count) / (last.at_s - first.at_s)
                for i in range(len(increases)):
                    increases[i] += last.ttft_buckets[i] - first.ttft_buckets[i]
        queue = sum(waiting) / len(waiting) * len(ready) if waiting else None
        busy = sum(running) / len(running) * len(ready) if running else None
        if not has_rate:
            return Observation(None, queue, running_requests=busy)
        p90 = histogram_quantile(0.9, increases)
        return Observation(
            None if math.isnan(p90) else p90,
            queue,
            request_rate=rate,
            running_requests=busy,
        )


@dataclass(frozen=True)
class Arrival:
    at_s: float
    prompt_len: int
    output_len: int


def poisson_arrivals(
    stages: list[tuple[float, float]], prompt_len: int, output_len: int, seed: int = 0
) -> list[Arrival]:
    """Poisson arrivals through `stages` of (duration s, rate req/s); the rate may be a function of
    time by passing many short stages. Prompt and output lengths vary uniformly by +-50 %."""
    rng = random.Random(seed)
    arrivals, start = [], 0.0
    for duration, rate in stages:
        t = start
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= start + duration:
                break
            p = max(1, round(prompt_len * rng.uniform(0.5, 1.5)))
            o = max(2, round(output_len * rng.uniform(0.5, 1.5)))
            arrivals.append(Arrival(t, p, o))
        start += duration
    return arrivals


@dataclass
class SimResult:
    requests: list[SimRequest]
    duration_s: float
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, replicas, ready)
    decisions: list[tuple[float, int, int, str]] = field(default_factory=list)  # (t, from, to, reason)
    replica_seconds: float = 0.0

    @property
    def avg_replicas(self) -> float:
        return self.replica_seconds / self.duration_s

    @property
    def scale_events(self) -> int:
        return sum(1 for _, a, b, _ in self.decisions if a != b)

    def attainment(self, ttft_slo_s: float, tpot_slo_s: float) -> float:
        """Fraction of requests that met both SLOs (TTFT and TPOT)."""
        done = [r for r in self.requests if r.finish_s is not None]
        if not self.requests:
            return 1.0
        ok = sum(1 for r in done if r.ttft_s <= ttft_slo_s and r.tpot_s <= tpot_slo_s)
        return ok / len(self.requests)


@dataclass(frozen=True)
class SimConfig:
    model: StepModel
    time_to_ready_s: float
    scrape_interval_s: float = 15.0
    interval_s: float = 15.0
    outages: tuple[tuple[float, float], ...] = ()


def simulate(
    config: SimConfig,
    arrivals: list[Arrival],
    duration_s: float,
    autoscaling: AutoscalingSpec | None,
    static_replicas: int | None = None,
    initial_replicas: int | None = None,
) -> SimResult:
    """Run `arrivals` for `duration_s` seconds (then drain), autoscaled by `autoscaling` or with a static
    pool of `static_replicas` (Ready from the start)."""
    model = config.model
    start = initial_replicas or static_replicas or (autoscaling.min_replicas if autoscaling else 1)
    replicas = [Replica(i, model, 0.0, 0.0) for i in range(start)]
    next_index = start
    prometheus = PrometheusModel(config.scrape_interval_s, config.outages)
    history = History()
    requests: list[SimRequest] = []
    pending: deque[SimRequest] = deque()  # arrived while no replica was Ready
    result = SimResult(requests, duration_s)

    # Events: (time, order, kind, payload). Order breaks ties deterministically.
    events: list[tuple[float, int, str, object]] = []
    counter = 0

    def push(at: float, kind: str, payload: object = None) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (at, counter, kind, payload))

    for a in arrivals:
        push(a.at_s, "arrival", a)
    t = 0.0
    while t < duration_s:
        push(t, "scrape")
        t += config.scrape_interval_s
    if autoscaling is not None:
        t = config.interval_s
        while t < duration_s:
            push(t, "autoscale")
            t += config.interval_s
    t = 0.0
    while t <= duration_s:
        push(t, "sample")
        t += 5.0

    def route(now: float, request: SimRequest) -> None:
        ready = [r for r in replicas if r.is_ready(now) and not r.draining]
        if not ready:
            pending.append(request)
            return
        target = min(ready, key=lambda r: (r.outstanding, r.index))
        target.waiting.append(request)
        if not target.busy:
            end = target.start_step(now)
            if end is not None:
                push(end, "step", target)

    def live() -> list[Replica]:
        return [r for r in replicas if r.removed_s is None]

    last_time = 0.0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if now > duration_s and kind in ("scrape", "autoscale", "sample"):
            continue
        span_end = min(now, duration_s)
        if span_end > last_time:
            result.replica_seconds += len(live()) * (span_end - last_time)
            last_time = span_end
        if kind == "arrival":
            a = payload
            assert isinstance(a, Arrival)
            request = SimRequest(a.at_s, a.prompt_len, a.output_len)
            requests.append(request)
            route(now, request)
        elif kind == "step":
            replica = payload
            assert isinstance(replica, Replica)
            replica.finish_step(now)
            end = replica.start_step(now)
            if end is not None:
                push(end, "step", replica)
            elif replica.draining and replica.outstanding == 0:
                replica.removed_s = now
        elif kind == "ready":
            while pending:
                route(now, pending.popleft())
        elif kind == "scrape":
            prometheus.scrape(now, live())
        elif kind == "sample":
            current = [r for r in live() if not r.draining]
            result.timeline.append((now, len(live()), sum(r.is_ready(now) for r in current)))
        elif kind == "autoscale":
            assert autoscaling is not None
            serving = [r for r in live() if not r.draining]
            ready = [r for r in serving if r.is_ready(now)]
            observation = prometheus.observe(now, ready, autoscaling.ttft_window_seconds)
            decision, history = decide(autoscaling, len(serving), len(ready), observation, history, now)
            result.decisions.append((now, len(serving), decision.replicas, decision.reason))
            if decision.replicas > len(serving):
                for _ in range(decision.replicas - len(serving)):
                    replica = Replica(next_index, model, now, now + config.time_to_ready_s)
                    next_index += 1
                    replicas.append(replica)
                    push(replica.ready_s, "ready")
            elif decision.replicas < len(serving):
                # As the ReplicaSet controller does: not-Ready pods go first, then the least busy.
                victims = sorted(serving, key=lambda r: (r.is_ready(now), r.outstanding, -r.index))
                for replica in victims[: len(serving) - decision.replicas]:
                    replica.draining = True
                    # Waiting requests are retried elsewhere (the client sees one longer TTFT).
                    moved = list(replica.waiting)
                    replica.waiting.clear()
                    if not replica.is_ready(now) or replica.outstanding == 0:
                        replica.removed_s = now
                    for request in moved:
                        route(now, request)
    return result
