"""Prometheus metrics, observed where the events happen. Names are vLLM's with the `conveyor:` prefix
(DESIGN.md, "Metrics"), so dashboards and autoscaling rules written for vLLM port over.

Each server has its own CollectorRegistry (several engines can live in one test process). No torch and
no engine module is imported here: the chart's values model reads the bucket bounds, and the docs read
the series.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from conveyor.server.messages import EngineLimits, SchedulerStats

if TYPE_CHECKING:  # the engine's types, for annotations only: this module imports no engine code
    from conveyor.server.engine.lora import AdapterState
    from conveyor.server.engine.request import Request

LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# The busiest expert's load over the mean (1 = even; top_k / num_experts of every token on one expert
# gives num_experts / top_k).
# The longest `error` label of `conveyor:lora_adapter_info` (characters).
ERROR_LABEL_CHARS = 300
IMBALANCE_BUCKETS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0, 128.0)


def input_length_bucket(num_prompt_tokens: int) -> str:
    """The `input_length_bucket` label: `0-512`, `512-2048` or `2048+` prompt tokens."""
    if num_prompt_tokens < 512:
        return "0-512"
    if num_prompt_tokens < 2048:
        return "512-2048"
    return "2048+"


class EngineMetrics:
    """The engine's Prometheus series for one served model. Implements the engine's StatsObserver.

    limits: the engine's (`LLMEngine.limits`), exported as labels of the config-info series. A
    mixture-of-experts model (`limits.num_experts`) adds the expert-load series; `per_expert`
    (`--enable-expert-load-metrics`) adds one counter per sparse layer and expert. With LoRA
    (`limits.max_loras`): the Gateway API Inference Extension's adapter gauge, as
    `conveyor:lora_requests_info` and under vLLM's name `vllm:lora_requests_info` (the name its endpoint
    picker reads): one series whose labels list the adapters of running and waiting requests and whose
    value is the time it was set (Unix seconds); and finished requests per adapter (served names only).
    With speculative decoding (`limits.num_speculative_tokens`): vLLM's `spec_decode_*` counters.
    """

    def __init__(
        self,
        model_name: str,
        limits: EngineLimits,
        registry: CollectorRegistry | None = None,
        per_expert: bool = False,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        mb = ["model_name", "input_length_bucket"]

        def hist(name: str, doc: str, labels: list[str], buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"conveyor:{name}", doc, labels, buckets=buckets, registry=r)

        self.ttft = hist(
            "time_to_first_token_seconds", "Arrival to first token, queueing included (seconds).", mb
        )
        self.itl = hist(
            "inter_token_latency_seconds", "Time between consecutive tokens (seconds).", m, ITL_BUCKETS
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "(latency - TTFT) / (output tokens - 1) per request (seconds).",
            mb,
            ITL_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token (seconds).", mb)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled (seconds).", mb)
        self.prefill_time = hist(
            "request_prefill_time_seconds", "First scheduled to first token (seconds).", mb
        )
        self.decode_time = hist("request_decode_time_seconds", "First token to last token (seconds).", mb)
        self.iteration_tokens = hist(
            "iteration_tokens_total", "Tokens computed per engine step.", m, _TOKEN_BUCKETS
        )
        self.num_waiting = Gauge("conveyor:num_requests_waiting", "Requests queued.", m, registry=r)
        self.num_running = Gauge("conveyor:num_requests_running", "Requests running.", m, registry=r)
        self.kv_usage = Gauge("conveyor:kv_cache_usage_perc", "KV cache usage (0-1).", m, registry=r)
        self.prompt_tokens = Counter("conveyor:prompt_tokens", "Prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("conveyor:generation_tokens", "Tokens generated.", m, registry=r)
        self.preemptions = Counter("conveyor:num_preemptions", "Preemptions (recompute).", m, registry=r)
        self.prefix_queries = Counter(
            "conveyor:prefix_cache_queries", "Tokens looked up in the prefix cache.", m, registry=r
        )
        self.prefix_hits = Counter("conveyor:prefix_cache_hits", "Prefix cache tokens hit.", m, registry=r)
        self.request_success = Counter(
            "conveyor:request_success", "Finished requests.", ["model_name", "finished_reason"], registry=r
        )
        # vLLM's cache_config_info: the KV pool's shape as labels (value 1), so a router reads a replica's
        # block size and block count from /metrics.
        Gauge(
            "conveyor:cache_config_info",
            "KV cache configuration (labels; value 1).",
            ["model_name", "block_size", "num_gpu_blocks"],
            registry=r,
        ).labels(model_name, str(limits.block_size), str(limits.num_kv_blocks)).set(1)
        # The same for the scheduler's limits: a router tells running from waiting requests with it.
        Gauge(
            "conveyor:scheduler_config_info",
            "Scheduler limits (labels; value 1).",
            ["model_name", "max_num_seqs", "max_num_batched_tokens"],
            registry=r,
        ).labels(model_name, str(limits.max_num_seqs), str(limits.max_num_batched_tokens)).set(1)
        # What the weights are: a dashboard tells a quantized replica from a float one.
        Gauge(
            "conveyor:model_weights_info",
            "Weights as served: --quantization, formats held, bytes (labels; value 1).",
            ["model_name", "quantization", "weights", "weight_bytes"],
            registry=r,
        ).labels(model_name, limits.quantization, limits.weights, str(limits.weight_bytes)).set(1)
        # Mixture of experts: how evenly the router spreads tokens, without a label per expert unless asked.
        self.moe_routed = self.moe_imbalance = self.expert_tokens = None
        self.sparse_layers = [str(layer) for layer in limits.sparse_layers]
        if limits.num_experts:
            self.moe_routed = Counter(
                "conveyor:moe_routed_tokens",
                "Token-to-expert assignments over all sparse layers (a token counts once per expert it chose).",
                m,
                registry=r,
            )
            self.moe_routed.labels(model_name)
            self.moe_imbalance = hist(
                "moe_expert_load_imbalance",
                "Per step and sparse layer with at least one assignment per expert on average: the busiest "
                "expert's tokens over the mean per expert (1 = even).",
                m,
                IMBALANCE_BUCKETS,
            )
            self.moe_imbalance.labels(model_name)
        if limits.num_experts and per_expert:
            self.expert_tokens = Counter(
                "conveyor:moe_expert_tokens",
                "Tokens routed to each expert of each sparse layer (--enable-expert-load-metrics).",
                ["model_name", "layer", "expert"],
                registry=r,
            )
            for layer in self.sparse_layers:
                for expert in range(limits.num_experts):
                    self.expert_tokens.labels(model_name, layer, str(expert))
        # LoRA: which adapters the replica is running, for a router's adapter affinity.
        self.max_loras = str(limits.max_loras)
        self.lora_info: list[Gauge] = []
        self.lora_requests = None
        self._lora_adapters: Collector | None = None
        if limits.max_loras:
            lora_labels = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
            doc = "LoRA adapters of running and waiting requests (labels, comma-separated; value: Unix time set)."
            self.lora_info = [
                Gauge(f"{prefix}:lora_requests_info", doc, lora_labels, registry=r)
                for prefix in ("conveyor", "vllm")
            ]
            self.lora_requests = Counter(
                "conveyor:lora_requests",
                "Finished requests per LoRA adapter.",
                ["model_name", "lora_name", "finished_reason"],
                registry=r,
            )
            self._set_lora_info((), ())
        # Speculative decoding: vLLM's counters, acceptance per draft position included.
        self.spec = None
        if limits.num_speculative_tokens:
            self.spec = [
                Counter(f"conveyor:spec_decode_{name}", doc, m, registry=r)
                for name, doc in (
                    ("num_drafts", "Drafts verified."),
                    ("num_draft_tokens", "Draft tokens verified."),
                    ("num_accepted_tokens", "Draft tokens accepted."),
                )
            ]
            self.spec_per_pos = Counter(
                "conveyor:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each draft position (0-based).",
                ["model_name", "position"],
                registry=r,
            )
            for series in self.spec:
                series.labels(model_name)
            for position in range(limits.num_speculative_tokens):
                self.spec_per_pos.labels(model_name, str(position))
        # Export every gauge and counter from the start, so a query sees 0 rather than no data.
        for series in (self.num_waiting, self.num_running, self.kv_usage, self.prompt_tokens):
            series.labels(model_name)
        for series in (self.generation_tokens, self.preemptions, self.prefix_queries, self.prefix_hits):
            series.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        # Histograms too: rate() over a series needs a sample from before its first observation.
        for series in (self.itl, self.iteration_tokens):
            series.labels(model_name)
        per_bucket = (self.ttft, self.tpot, self.e2e, self.queue_time, self.prefill_time, self.decode_time)
        for series in per_bucket:
            for bucket in ("0-512", "512-2048", "2048+"):
                series.labels(model_name, bucket)

    def on_step(self, stats: SchedulerStats) -> None:
        """Gauges and counters that follow the scheduler; called after every step, idle ones too."""
        name = self.model_name
        self.num_waiting.labels(name).set(stats.num_waiting)
        self.num_running.labels(name).set(stats.num_running)
        self.kv_usage.labels(name).set(stats.kv_cache_usage)
        if stats.num_batched_tokens:
            self.iteration_tokens.labels(name).observe(stats.num_batched_tokens)
        self.preemptions.labels(name).inc(stats.num_preempted)
        self.prefix_queries.labels(name).inc(stats.prefix_cache_queries)
        self.prefix_hits.labels(name).inc(stats.prefix_cache_hits)
        if stats.expert_tokens and self.moe_routed is not None:
            self._observe_experts(stats.expert_tokens)
        if self.lora_info:
            self._set_lora_info(stats.running_lora_adapters, stats.waiting_lora_adapters)
        spec = stats.spec_decoding
        if spec is not None and self.spec is not None:
            values = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
            for series, value in zip(self.spec, values, strict=True):
                series.labels(name).inc(value)
            for position, count in enumerate(spec.num_accepted_tokens_per_pos):
                self.spec_per_pos.labels(name, str(position)).inc(count)

    def _set_lora_info(self, running: tuple[str, ...], waiting: tuple[str, ...]) -> None:
        """One series per gauge: the last label set replaces the one before."""
        labels = (self.max_loras, ",".join(running), ",".join(waiting))
        for gauge in self.lora_info:
            gauge.clear()
            gauge.labels(*labels).set_to_current_time()

    def watch_lora_adapters(self, states: Callable[[], list[AdapterState]]) -> None:
        """Export `conveyor:lora_adapter_info{model_name, lora_name, path, source, digest, state, error}` = 1,
        read at each scrape from `states()` (`LoRARegistry.states`): one series per adapter served
        (state `loaded`, `digest` of its files, which seeds its prefix-cache hashes,
        `block_hash.lora_hash_root`) and per adapter `--lora-modules-file` declares that is not served
        (state `failed`, `error` the reason, at most ERROR_LABEL_CHARS characters on one line); `source`
        says where it was named (`lora-modules`, `lora-modules-file` or `runtime`). The operator's
        per-adapter status reads it (the file's adapters are the ones it declared), and the router its replicas' adapters; its label set is
        bounded by the adapters named to this server."""
        model_name = self.model_name
        if self._lora_adapters is not None:  # an app made again on the same metrics
            self.registry.unregister(self._lora_adapters)

        class _Adapters(Collector):
            _labelnames = (
                "model_name",
                "lora_name",
                "path",
                "source",
                "digest",
                "state",
                "error",
            )  # as prometheus_client's

            def describe(self):
                return [self._family()]

            def _family(self) -> GaugeMetricFamily:
                return GaugeMetricFamily(
                    "conveyor:lora_adapter_info",
                    "LoRA adapters named to this server: loaded (served) or failed (declared, not served).",
                    labels=list(self._labelnames),
                )

            def collect(self):
                family = self._family()
                for a in states():
                    state = "failed" if a.error else "loaded"
                    error = " ".join(a.error.split())[:ERROR_LABEL_CHARS]
                    family.add_metric([model_name, a.name, a.path, a.source, a.digest, state, error], 1.0)
                yield family

        self._lora_adapters = _Adapters()
        self.registry.register(self._lora_adapters)

    def _observe_experts(self, expert_tokens: list[list[int]]) -> None:
        name = self.model_name
        for layer, counts in zip(self.sparse_layers, expert_tokens, strict=True):
            total = sum(counts)
            self.moe_routed.labels(name).inc(total)
            if total >= len(counts):  # fewer assignments than experts: every step would look uneven
                self.moe_imbalance.labels(name).observe(max(counts) * len(counts) / total)
            if self.expert_tokens is not None:
                for expert, count in enumerate(counts):
                    if count:
                        self.expert_tokens.labels(name, layer, str(expert)).inc(count)

    def on_new_tokens(
        self, request: Request, num_new_tokens: int, now: float, previous_token_time: float | None
    ) -> None:
        name = self.model_name
        self.generation_tokens.labels(name).inc(num_new_tokens)
        if previous_token_time is None:
            bucket = input_length_bucket(request.num_prompt_tokens)
            self.ttft.labels(name, bucket).observe(now - request.arrival_time)
            self.prompt_tokens.labels(name).inc(request.num_prompt_tokens)
        else:
            self.itl.labels(name).observe(now - previous_token_time)

    def on_finished(self, request: Request) -> None:
        name = self.model_name
        bucket = input_length_bucket(request.num_prompt_tokens)
        reason = request.finish_reason.value if request.finish_reason else "abort"
        self.request_success.labels(name, reason).inc()
        if request.lora is not None and self.lora_requests is not None:
            self.lora_requests.labels(name, request.lora.name, reason).inc()
        end = request.finished_time or request.last_token_time
        if end is None:
            return
        self.e2e.labels(name, bucket).observe(end - request.arrival_time)
        if request.first_scheduled_time is not None:
            self.queue_time.labels(name, bucket).observe(request.first_scheduled_time - request.arrival_time)
        if request.first_token_time is not None:
            if request.first_scheduled_time is not None:
                self.prefill_time.labels(name, bucket).observe(
                    request.first_token_time - request.first_scheduled_time
                )
            last = request.last_token_time or request.first_token_time
            self.decode_time.labels(name, bucket).observe(last - request.first_token_time)
            num_output = len(request.output_token_ids)
            if num_output > 1:
                self.tpot.labels(name, bucket).observe((last - request.first_token_time) / (num_output - 1))
