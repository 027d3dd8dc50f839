"""The operator's state, carried by kopf as its memo (`kopf.run(memo=...)`; kopf's docs/memos.rst,
"Custom memo classes"): the settings its flags give, the cluster, Prometheus and the per-resource locks,
built once by run.py; and what this process remembers of one InferenceService between its handler calls.

kopf gives each resource a shallow copy (`copy.copy`) of the operator's memo when it first sees it: the
settings and shared objects are the same in every copy, and the per-resource fields are the
resource's own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from conveyor.operator.autoscaler import History
from conveyor.operator.cluster import ClusterAPI
from conveyor.operator.metrics import PrometheusSource
from conveyor.operator.render import KedaSettings
from conveyor.operator.spec import DEFAULT_IMAGE


@dataclass(frozen=True)
class OperatorSettings:
    """What `conveyor operator`'s flags set for every InferenceService.

    server_image: the image of resources without `spec.image`; namespaces: the namespaces watched (glob
    patterns; empty: all); service_monitor_labels: extra labels of every ServiceMonitor;
    network_policy_from: the extra NetworkPolicyPeers let into the server pods (None: no
    NetworkPolicy); keda: the ScaledObjects' settings.
    """

    server_image: str = DEFAULT_IMAGE
    namespaces: tuple[str, ...] = ()
    service_monitor_labels: dict[str, str] = field(default_factory=dict)
    network_policy_from: list[dict[str, Any]] | None = None
    keda: KedaSettings = KedaSettings()


class ResourceLocks:
    """One lock per InferenceService, by (namespace, name): its handlers run in several threads and must
    not interleave. `prune` drops a deleted resource's lock."""

    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, namespace: str, name: str) -> threading.Lock:
        """The resource's lock (created on first use)."""
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def prune(self, namespace: str, name: str) -> None:
        """Forget the lock of a deleted resource, unless a handler still holds it (a handler finishing
        with a resource gone returns at once; one re-created with the name starts a new lock)."""
        with self._guard:
            lock = self._locks.get((namespace, name))
            if lock is not None and not lock.locked():
                del self._locks[(namespace, name)]

    def __len__(self) -> int:
        return len(self._locks)


@dataclass
class OperatorMemo:
    """kopf's memo. Shared by every resource: `settings`, `prometheus` (None: the operator runs without
    --prometheus-url), `locks`, and `cluster` (connected by the startup handler, so that kopf retries
    a failed connection). The resource's own: the builtin autoscaler's `autoscaler_history` (None:
    read back from status, as after a restart) and whether its metrics were available at this
    process's last step (`metrics_available`, for the log)."""

    settings: OperatorSettings = field(default_factory=OperatorSettings)
    prometheus: PrometheusSource | None = None
    locks: ResourceLocks = field(default_factory=ResourceLocks)
    cluster: ClusterAPI | None = None
    autoscaler_history: History | None = None
    metrics_available: bool | None = None

    @property
    def api(self) -> ClusterAPI:
        """`cluster`, which every resource handler runs after the startup handler connected."""
        if self.cluster is None:
            raise RuntimeError("the operator's startup handler has not connected to the cluster")
        return self.cluster
