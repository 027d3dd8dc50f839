"""Prometheus -> autoscaler observations (the I/O shell around `autoscaler.decide`).

Reads the Prometheus HTTP API (`GET /api/v1/query`, instant queries) for the series the server exports
(DESIGN.md, "Metrics"), selected by `namespace` and `pod` — the target labels a Prometheus Operator
ServiceMonitor (or Kubernetes pod discovery) attaches — and restricted to the pods that are Ready
*now*, by name, so the series of deleted or starting pods never count:

    p90 TTFT     histogram_quantile(0.9, sum by (le) (rate(conveyor:time_to_first_token_seconds_bucket{S}[W])))
    request rate sum(rate(conveyor:time_to_first_token_seconds_count{S}[W]))
    queue depth  sum by (pod) (conveyor:num_requests_waiting{S})
    running      sum by (pod) (conveyor:num_requests_running{S})
    KV usage     avg(conveyor:kv_cache_usage_perc{S})

and, with the router enabled, over the router pods R (by name, as the server pods are; only router
pods export the series, and `<name>-router-.+` would also match the server pods of an InferenceService
named `<name>-router`):

    router waiting  sum(conveyor:router_requests_waiting{R})

The queries of one observation run concurrently under one deadline: a query without an answer by then
is a timeout. A timeout, an HTTP or PromQL error, an empty vector, NaN or Inf are "unknown" (None), never 0. When
fewer Ready pods report a queue (or running requests) than are Ready (a pod not scraped yet), the sum
is the mean of those that do times the Ready count.

The operator's own series (decisions by reason, query errors, last decision time) live here too.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import httpx
from prometheus_client import Counter, Gauge

from conveyor.operator.autoscaler import Decision, Observation

TTFT = "conveyor:time_to_first_token_seconds"
WAITING = "conveyor:num_requests_waiting"
RUNNING = "conveyor:num_requests_running"
KV_USAGE = "conveyor:kv_cache_usage_perc"
ROUTER_WAITING = "conveyor:router_requests_waiting"
# The longest one autoscaling step waits for Prometheus, all its queries together (seconds).
PROMETHEUS_DEADLINE_SECONDS = 5.0

DECISIONS = Counter(
    "conveyor_operator_autoscaler_decisions",
    "Autoscaling decisions, by reason.",
    ["namespace", "inferenceservice", "reason"],
)
QUERY_ERRORS = Counter(
    "conveyor_operator_prometheus_query_errors",
    "Prometheus queries that failed or returned no usable value.",
    ["namespace", "inferenceservice", "query"],
)
LAST_DECISION = Gauge(
    "conveyor_operator_autoscaler_last_decision_timestamp_seconds",
    "Unix time of the last autoscaling decision.",
    ["namespace", "inferenceservice"],
)
DESIRED = Gauge(
    "conveyor_operator_autoscaler_desired_replicas",
    "Replicas the autoscaler decided on last.",
    ["namespace", "inferenceservice"],
)


def selector(namespace: str, pods: list[str]) -> str:
    """The label matchers of `pods` in `namespace` (pod names are exact, dots escaped for RE2)."""
    names = "|".join(sorted(p.replace(".", "\\\\.") for p in pods))
    return f'namespace="{namespace}",pod=~"{names}"'


def queries(namespace: str, pods: list[str], window_seconds: int) -> dict[str, str]:
    """PromQL for each signal, over the Ready `pods`."""
    s = selector(namespace, pods)
    w = f"{window_seconds}s"
    return {
        "ttft_p90": f"histogram_quantile(0.9, sum by (le) (rate({TTFT}_bucket{{{s}}}[{w}])))",
        "request_rate": f"sum(rate({TTFT}_count{{{s}}}[{w}]))",
        "queue": f"sum by (pod) ({WAITING}{{{s}}})",
        "running": f"sum by (pod) ({RUNNING}{{{s}}})",
        "kv_usage": f"avg({KV_USAGE}{{{s}}})",
    }


def router_query(namespace: str, router_pods: list[str]) -> str:
    """PromQL of the requests the router pods hold while no replica is Ready."""
    return f"sum({ROUTER_WAITING}{{{selector(namespace, router_pods)}}})"


class QueryError(Exception):
    """A Prometheus query that failed (connection, HTTP status, PromQL error)."""


@dataclass(frozen=True)
class Reading:
    """One observation and what went wrong while taking it (empty when nothing did)."""

    observation: Observation
    errors: dict[str, str]


class PrometheusSource:
    """Instant queries against one Prometheus server's HTTP API.

    url: the server's base URL (e.g. http://prometheus-operated.monitoring:9090). deadline_seconds
    bounds one observation, all its queries together (they run at once), so a slow or hung
    Prometheus costs a step at most that long.
    """

    def __init__(self, url: str, deadline_seconds: float = PROMETHEUS_DEADLINE_SECONDS) -> None:
        self.url = url.rstrip("/")
        self.deadline_seconds = deadline_seconds
        self._client = httpx.Client(timeout=deadline_seconds)

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """The instant vector of `promql` as [(labels, value)]; raises QueryError."""
        try:
            response = self._client.get(f"{self.url}/api/v1/query", params={"query": promql})
        except httpx.TimeoutException as exc:
            raise QueryError(self._timeout_message()) from exc
        except httpx.HTTPError as exc:
            raise QueryError(f"{type(exc).__name__}: {exc}") from exc
        try:
            body = response.json()
        except ValueError as exc:
            raise QueryError(f"HTTP {response.status_code}: not JSON") from exc
        if response.status_code != 200 or body.get("status") != "success":
            raise QueryError(f"HTTP {response.status_code}: {body.get('error', body)}")
        data = body.get("data") or {}
        if data.get("resultType") == "scalar":
            return [({}, float(data["result"][1]))]
        return [(item.get("metric", {}), float(item["value"][1])) for item in data.get("result", [])]

    def _timeout_message(self) -> str:
        return f"no answer within {self.deadline_seconds:g} s"

    def _query_all(self, promql: dict[str, str]) -> dict[str, list[tuple[dict[str, str], float]] | str]:
        """Each query's vector, or its error text; all at once, within the deadline."""
        if not promql:
            return {}
        pool = ThreadPoolExecutor(max_workers=len(promql), thread_name_prefix="prometheus")
        futures = {name: pool.submit(self.query, query) for name, query in promql.items()}
        wait(futures.values(), timeout=self.deadline_seconds)
        # Threads still waiting end on the client's own timeout (the same deadline).
        pool.shutdown(wait=False, cancel_futures=True)
        results: dict[str, list[tuple[dict[str, str], float]] | str] = {}
        for name, future in futures.items():
            if not future.done():
                results[name] = self._timeout_message()
            elif isinstance(future.exception(), QueryError):
                results[name] = str(future.exception())
            else:
                results[name] = future.result()
        return results

    def observe(
        self, namespace: str, pods: list[str], window_seconds: int, router_pods: list[str] | None = None
    ) -> Reading:
        """The Observation of `pods` (Ready now) and, unless `router_pods` is None (no router), of the
        router pods; every signal that cannot be read is None."""
        values: dict[str, float | None] = {}
        errors: dict[str, str] = {}
        promql = queries(namespace, pods, window_seconds) if pods else {}
        if not pods:
            errors["pods"] = "no Ready pods"
        if router_pods is not None and not router_pods:
            errors["router_waiting"] = "no router pods"
        elif router_pods is not None:
            promql["router_waiting"] = router_query(namespace, router_pods)
        for name, vector in self._query_all(promql).items():
            if isinstance(vector, str):
                values[name], errors[name] = None, vector
                continue
            finite = [v for _, v in vector if math.isfinite(v)]
            if not finite:
                values[name] = None
                errors[name] = "no data" if not vector else "NaN"
            elif name in ("queue", "running"):
                # Per pod: a Ready pod not scraped yet counts as the mean of those that are.
                values[name] = sum(finite) / len(finite) * max(len(pods), len(finite))
            else:
                values[name] = finite[0]
        # A NaN p90 while no request arrived is idleness, not an error.
        if values.get("request_rate") == 0 and errors.get("ttft_p90") == "NaN":
            errors.pop("ttft_p90")
        observation = Observation(
            ttft_p90_seconds=values.get("ttft_p90"),
            queue_depth=values.get("queue"),
            request_rate=values.get("request_rate"),
            running_requests=values.get("running"),
            kv_cache_usage=values.get("kv_usage"),
            router_waiting=values.get("router_waiting"),
        )
        return Reading(observation, errors)

    def close(self) -> None:
        self._client.close()


def record_decision(
    namespace: str, name: str, decision: Decision, reading: Reading, now_seconds: float
) -> None:
    """Count one autoscaling decision of an InferenceService, and the queries its reading could not
    answer, in the operator's own series (`now_seconds`: Unix time)."""
    DECISIONS.labels(namespace, name, decision.reason).inc()
    LAST_DECISION.labels(namespace, name).set(now_seconds)
    DESIRED.labels(namespace, name).set(decision.replicas)
    for query in reading.errors:
        QUERY_ERRORS.labels(namespace, name, query).inc()
