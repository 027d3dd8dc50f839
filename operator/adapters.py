"""`model.lora`'s status: which Ready server pods serve each declared adapter, and the AdaptersReady
condition.

The operator declares the adapters in a ConfigMap every server pod mounts (`render.py`); each server
loads them before it is Ready and follows the file's changes (`--lora-modules-file`), and exports one
`conveyor:lora_adapter_info{lora_name, source, state, error}` series per adapter it was named: state
`loaded`, or `failed` with the reason; `source` `lora-modules-file` marks the adapters of the file (the
ones the operator declared), apart from those named by `--lora-modules` or loaded at runtime through
`engine.extraArgs`, which this status neither counts nor waits for. `observe` reads those series of the Ready pods from Prometheus (the
autoscaler's source), and `adapter_status` (pure) turns them into `status.loraAdapters` and the
condition:

    AdaptersReady True   AdaptersLoaded      every adapter is loaded on every Ready replica
                  False  AdapterLoadFailed   an adapter failed to load on a replica (the reason given)
                  False  AdaptersLoading     an adapter is not (yet) loaded on every Ready replica, or
                                             one removed from the spec is still served somewhere
                  False  NoReadyReplicas     no server pod is Ready
                  False  MetricsUnavailable  Prometheus cannot be read (or the operator has no URL)
                  False  Forbidden           the API server refused the step a permission (handlers.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.operator.metrics import PrometheusSource, QueryError, selector
from conveyor.operator.status import ADAPTER_LOAD_FAILED, ADAPTERS_READY, make_condition, with_conditions

ADAPTER_INFO = "conveyor:lora_adapter_info"
# The `source` of the adapters a server read from its `--lora-modules-file` (server/engine/lora.py's
# SOURCE_FILE); a series without the label counts as one of them.
FILE_SOURCE = "lora-modules-file"


@dataclass(frozen=True)
class AdapterReading:
    """The Ready pods, and their adapter series as [(labels, value)]; `error` says why there are none
    (then `series` is None)."""

    ready_pods: list[str]
    series: list[tuple[dict[str, str], float]] | None
    error: str | None = None


def adapter_query(namespace: str, pods: list[str]) -> str:
    """PromQL of the adapter series of `pods` (one per pod, adapter and state)."""
    return f"max by (pod, lora_name, source, state, error) ({ADAPTER_INFO}{{{selector(namespace, pods)}}})"


def observe(source: PrometheusSource | None, namespace: str, ready_pods: list[str]) -> AdapterReading:
    """Read the adapter series of the Ready pods; never raises (the error is in the reading)."""
    if source is None:
        return AdapterReading(ready_pods, None, "the operator runs without --prometheus-url")
    if not ready_pods:
        return AdapterReading(ready_pods, [])
    try:
        return AdapterReading(ready_pods, source.query(adapter_query(namespace, ready_pods)))
    except QueryError as exc:
        return AdapterReading(ready_pods, None, str(exc))


def adapter_status(
    declared: list[str],
    reading: AdapterReading,
    *,
    previous: dict[str, Any],
    generation: int | None,
    now: str,
) -> dict[str, Any]:
    """The status merge patch: `loraAdapters` (one entry per declared adapter: the Ready replicas that
    serve it, the Ready replicas, and why it failed to load where it did) and the AdaptersReady
    condition among the previous conditions. `previous`: the current status."""
    ready = len(reading.ready_pods)
    loaded: dict[str, set[str]] = {name: set() for name in declared}
    failed: dict[str, dict[str, str]] = {name: {} for name in declared}
    lingering: dict[str, set[str]] = {}
    for labels, _ in reading.series or []:
        name, pod = labels.get("lora_name", ""), labels.get("pod", "")
        if name not in loaded:
            if labels.get("state") == "loaded" and labels.get("source", FILE_SOURCE) == FILE_SOURCE:
                lingering.setdefault(name, set()).add(pod)
            continue
        if labels.get("state") == "loaded":
            loaded[name].add(pod)
        else:
            failed[name][pod] = labels.get("error", "")
    entries = []
    for name in declared:
        entry: dict[str, Any] = {"name": name, "loadedReplicas": len(loaded[name]), "readyReplicas": ready}
        if failed[name]:
            entry["lastError"] = sorted(set(failed[name].values()))[0]
        entries.append(entry)
    if reading.series is None:
        verdict = (False, "MetricsUnavailable", f"the adapters' state cannot be read: {reading.error}")
        entries = previous.get("loraAdapters") or []  # the last known, until it can be read again
    elif ready == 0:
        verdict = (False, "NoReadyReplicas", "no server pod is Ready")
    elif any(failed[name] for name in declared):
        verdict = (
            False,
            ADAPTER_LOAD_FAILED,
            "; ".join(
                f"{name} failed on {len(pods)} of {ready} Ready replicas: {sorted(set(pods.values()))[0]}"
                for name, pods in failed.items()
                if pods
            ),
        )
    elif any(len(loaded[name]) < ready for name in declared) or lingering:
        parts = [
            f"{name} loaded on {len(loaded[name])} of {ready} Ready replicas"
            for name in declared
            if len(loaded[name]) < ready
        ]
        parts += [
            f"{name}, removed from the spec, still served on {len(pods)} Ready replicas"
            for name, pods in sorted(lingering.items())
        ]
        verdict = (False, "AdaptersLoading", "; ".join(parts))
    else:
        verdict = (
            True,
            "AdaptersLoaded",
            f"{len(declared)} adapters loaded on every Ready replica ({ready})",
        )
    conditions = previous.get("conditions") or []
    condition = make_condition(ADAPTERS_READY, *verdict, generation=generation, now=now, previous=conditions)
    return {"loraAdapters": entries, "conditions": with_conditions(conditions, condition)}
