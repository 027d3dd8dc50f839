"""The Kubernetes Events the operator posts on an InferenceService, as values (pure).

reconcile, the autoscaler's step and the Forbidden report return them; the handlers post them
(`kopf.event`) and log their lines. There is one per write to a child (`written`), and one when a
condition turns to a state a user should hear of (`transitions`), so a reconcile repeated with nothing
new posts none.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from conveyor.operator.status import (
    ADAPTER_LOAD_FAILED,
    ADAPTERS_READY,
    APPLY_FAILURE_REASON,
    APPLY_FAILURE_REASONS,
    CAPACITY_PLANNED,
    FORBIDDEN,
    KEDA_NOT_INSTALLED,
    METRICS_AVAILABLE,
    PODS_UNSCHEDULABLE,
    READY,
    SCALING,
)

_APPLY_FAILURES = {*APPLY_FAILURE_REASONS.values(), APPLY_FAILURE_REASON}
# What the operator did to a child.
Write = Literal["created", "updated", "deleted"]


@dataclass(frozen=True)
class Event:
    """One Event on the InferenceService: `type` Normal or Warning, its `reason` and `message`; `log` is
    the operator's log line of it at `level` (None: not logged)."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    log: str | None = None
    level: int = logging.INFO


def written(action: Write, kind: str, namespace: str, name: str, note: str = "") -> Event:
    """The Created, Updated or Deleted Event of one child the operator wrote, logged too; `note` follows
    the object's name (" (removed env A: not in the spec)")."""
    message = f"{action} {kind} {namespace}/{name}{note}"
    return Event("Normal", action.capitalize(), message, message)


def transitions(
    before: list[dict[str, Any]], after: list[dict[str, Any]], types: Collection[str] | None = None
) -> list[Event]:
    """The Events of the conditions in `after` (of `types`, default all) whose change from `before`
    a user should hear of, in `after`'s order:

    CapacityPlanned   a new plan (Normal CapacityPlanned), or a new reason it cannot be planned
                      (Warning, that reason).
    Ready             pods the scheduler cannot place; a child the API server refused, each new message.
    Scaling           KEDA's API missing under `engine: keda`.
    MetricsAvailable  turned False.
    AdaptersReady     an adapter failed to load (Warning AdapterLoadFailed, each new message), or all
                      adapters are loaded again (Normal AdaptersLoaded).
    any               a permission lost (reason Forbidden), each new message.
    """
    events = []
    for new in after:
        if types is None or new["type"] in types:
            old = next((c for c in before if c.get("type") == new["type"]), {})
            event = _told(old, new)
            if event is not None:
                events.append(event)
    return events


def _told(old: dict[str, Any], new: dict[str, Any]) -> Event | None:
    type_, status, reason, message = new["type"], new["status"], new["reason"], new["message"]

    def changed(*keys: str) -> bool:
        return any(old.get(key) != new[key] for key in keys)

    warning = logging.WARNING
    if reason == FORBIDDEN:
        if changed("status", "reason", "message"):
            return Event("Warning", FORBIDDEN, message, f"{FORBIDDEN}: {message}", warning)
    elif type_ == CAPACITY_PLANNED and changed("status", "message"):
        if status == "True":
            return Event("Normal", CAPACITY_PLANNED, message)
        # An existing Deployment from an earlier, plannable spec keeps serving; nothing new starts.
        return Event("Warning", reason, message, f"capacity not planned: {message}")
    elif type_ == READY and reason == PODS_UNSCHEDULABLE and changed("reason"):
        return Event("Warning", reason, message, message, warning)
    elif type_ == READY and reason in _APPLY_FAILURES and changed("reason", "message"):
        return Event("Warning", reason, message, f"{reason}: {message}", warning)
    elif type_ == SCALING and reason == KEDA_NOT_INSTALLED and changed("reason"):
        return Event("Warning", reason, message, message, warning)
    elif type_ == METRICS_AVAILABLE and status == "False" and changed("status"):
        return Event("Warning", "MetricsUnavailable", message)
    elif type_ == ADAPTERS_READY and reason == ADAPTER_LOAD_FAILED and changed("reason", "message"):
        return Event("Warning", reason, message, f"{reason}: {message}", warning)
    elif type_ == ADAPTERS_READY and status == "True" and changed("status"):
        return Event("Normal", reason, message)
    return None
