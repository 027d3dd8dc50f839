"""The local cluster with everything that serves on it, for the end-to-end tests that run the whole
loop: the control plane with one simulated node of four L4 GPUs, process-backed pods
(`tests/k8s/local_pods.py`), a real Prometheus scraping them every second, the CRD, one namespace,
and the operator (a real process) reading that Prometheus with a 2 s autoscaling interval."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.k8s.cluster import LocalCluster, NodePool
from tests.k8s.local_pods import LocalPods
from tests.k8s.operator_env import CRD_PATH, Env, Operator
from tests.prometheus import PrometheusServer


@dataclass
class LocalStack:
    cluster: LocalCluster
    prometheus: PrometheusServer
    pods: LocalPods
    env: Env
    components: list[int]  # the cluster's own processes, which must not outlive its stop


@contextlib.contextmanager
def local_stack(tmp_path: Path, namespace: str, **pod_options: Any) -> Iterator[LocalStack]:
    """Start it all (work files under `tmp_path`; `pod_options` go to LocalPods), create the namespace
    (`namespace` is its prefix), yield; on the way out print the operator's log if the body failed,
    then stop the operator, the pods, Prometheus and the cluster, in that order."""
    cluster = LocalCluster([NodePool(product="NVIDIA-L4", count=1, gpus_per_node=4)], process_pods=True)
    cluster.start()
    (tmp_path / "prometheus").mkdir()
    prometheus = PrometheusServer(tmp_path / "prometheus", scrape_interval=1)
    pods = LocalPods(cluster, tmp_path / "local", prometheus=prometheus, **pod_options)
    operator: Operator | None = None
    try:
        prometheus.start()
        pods.start()
        cluster.kubectl("apply", "--server-side", "-f", str(CRD_PATH))
        cluster.wait_established("inferenceservices.serving.conveyor.dev")
        created = cluster.create_namespace(namespace)
        operator = Operator(
            cluster,
            created,
            tmp_path / "operator.log",
            "--prometheus-url",
            prometheus.url,
            "--autoscale-interval",
            "2",
        )
        env = Env(cluster, created, operator)
        yield LocalStack(cluster, prometheus, pods, env, list(cluster.pids.values()))
    except BaseException:
        if operator is not None:
            print(operator.log_tail(80))
        raise
    finally:
        if operator is not None:
            operator.stop()
        pods.stop()
        prometheus.stop()
        cluster.stop()
