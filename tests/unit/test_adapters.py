"""`model.lora`'s status from the Ready pods' `conveyor:lora_adapter_info` series (operator/adapters.py)."""

from __future__ import annotations

from typing import Any

from conveyor.operator.adapters import FILE_SOURCE, AdapterReading, adapter_query, adapter_status
from conveyor.server.engine.lora import SOURCE_FILE, SOURCE_FLAG, SOURCE_RUNTIME

NOW = "2026-12-07T10:00:00Z"
PODS = ["svc-a", "svc-b", "svc-c"]


def _series(pod: str, name: str, error: str = "", source: str = SOURCE_FILE) -> tuple[dict[str, str], float]:
    state = "failed" if error else "loaded"
    return {"pod": pod, "lora_name": name, "source": source, "state": state, "error": error}, 1.0


def _status(series, declared=("sql", "de"), pods=PODS, previous: dict[str, Any] | None = None, error=None):
    reading = AdapterReading(list(pods), series, error)
    return adapter_status(list(declared), reading, previous=previous or {}, generation=2, now=NOW)


def _condition(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "AdaptersReady")


def test_every_adapter_on_every_ready_replica_is_ready() -> None:
    status = _status([_series(p, n) for p in PODS for n in ("sql", "de")])
    assert _condition(status) | {"lastTransitionTime": None} == {
        "type": "AdaptersReady",
        "status": "True",
        "reason": "AdaptersLoaded",
        "message": "2 adapters loaded on every Ready replica (3)",
        "lastTransitionTime": None,
        "observedGeneration": 2,
    }
    assert status["loraAdapters"] == [
        {"name": "sql", "loadedReplicas": 3, "readyReplicas": 3},
        {"name": "de", "loadedReplicas": 3, "readyReplicas": 3},
    ]


def test_a_replica_without_an_adapter_or_with_a_removed_one_is_still_loading() -> None:
    partial = _status([_series(p, "sql") for p in PODS] + [_series("svc-a", "de")])
    assert (_condition(partial)["status"], _condition(partial)["reason"]) == ("False", "AdaptersLoading")
    assert _condition(partial)["message"] == "de loaded on 1 of 3 Ready replicas"
    lingering = _status([_series(p, n) for p in PODS for n in ("sql", "de")] + [_series("svc-b", "old")])
    assert _condition(lingering)["message"] == "old, removed from the spec, still served on 1 Ready replicas"


def test_adapters_named_outside_the_file_are_neither_counted_nor_waited_for() -> None:
    """`--lora-modules` in `engine.extraArgs`, or runtime loading: the operator did not declare them."""
    assert FILE_SOURCE == SOURCE_FILE
    served = [_series(p, n) for p in PODS for n in ("sql", "de")]
    others = [_series("svc-a", "extra", source=SOURCE_FLAG), _series("svc-b", "live", source=SOURCE_RUNTIME)]
    status = _status(served + others)
    assert (_condition(status)["status"], _condition(status)["reason"]) == ("True", "AdaptersLoaded")
    assert [entry["name"] for entry in status["loraAdapters"]] == ["sql", "de"]


def test_a_failed_adapter_names_the_reason_and_the_replicas() -> None:
    why = "LoRA adapter 'de': rank 32 exceeds --max-lora-rank 16"
    status = _status([_series(p, "sql") for p in PODS] + [_series(p, "de", why) for p in PODS[:2]])
    condition = _condition(status)
    assert (condition["status"], condition["reason"]) == ("False", "AdapterLoadFailed")
    assert condition["message"] == f"de failed on 2 of 3 Ready replicas: {why}"
    assert status["loraAdapters"][1] == {
        "name": "de",
        "loadedReplicas": 0,
        "readyReplicas": 3,
        "lastError": why,
    }


def test_no_metrics_keeps_the_last_known_entries_and_says_why() -> None:
    previous = {"loraAdapters": [{"name": "sql", "loadedReplicas": 3, "readyReplicas": 3}], "conditions": []}
    status = _status(None, previous=previous, error="HTTP 503: down")
    assert status["loraAdapters"] == previous["loraAdapters"]
    assert (_condition(status)["reason"], _condition(status)["message"]) == (
        "MetricsUnavailable",
        "the adapters' state cannot be read: HTTP 503: down",
    )
    assert _condition(_status([], pods=[]))["reason"] == "NoReadyReplicas"


def test_the_condition_keeps_its_transition_time_and_the_other_conditions() -> None:
    loaded = [_series(p, n) for p in PODS for n in ("sql", "de")]
    ready = {"type": "Ready", "status": "True", "reason": "ReplicasReady", "message": ""}
    first = _status(loaded, previous={"conditions": [ready]})
    assert first["conditions"][0] == ready
    again = adapter_status(
        ["sql", "de"], AdapterReading(PODS, loaded), previous=first, generation=2, now="2026-12-07T11:00:00Z"
    )
    assert _condition(again)["lastTransitionTime"] == NOW


def test_the_query_selects_the_ready_pods_by_name() -> None:
    assert adapter_query("ns", ["svc-b", "svc.a"]) == (
        "max by (pod, lora_name, source, state, error) "
        '(conveyor:lora_adapter_info{namespace="ns",pod=~"svc-b|svc\\\\.a"})'
    )
