"""Every file in examples/ on a cluster with the default node pools (what `make cluster` starts with no
`--pool`): the tour's first `kubectl apply` must schedule without reading about pools first."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.k8s.cluster import LocalCluster
from tests.k8s.operator_env import CRD_PATH, REPO, Env, Operator

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_every_example_schedules_on_a_default_cluster(tmp_path: Path) -> None:
    """A fresh cluster with DEFAULT_NODE_POOLS (not the session's, where other tests add nodes); kwok
    runs the pods. Each example turns Ready with its replicas (autoscaled ones at minReplicas: there
    is no Prometheus, so they hold)."""
    with LocalCluster() as cluster:
        cluster.kubectl("apply", "--server-side", "-f", str(CRD_PATH))
        cluster.kubectl("wait", "--for=condition=Established", "crd/inferenceservices.serving.conveyor.dev")
        namespace = cluster.create_namespace("examples")
        env = Env(cluster, namespace, Operator(cluster, namespace, tmp_path / "operator.log"))
        try:
            expected = {}
            for path in EXAMPLES:
                manifest = yaml.safe_load(path.read_text())
                spec = manifest["spec"]
                auto = spec.get("autoscaling")
                expected[manifest["metadata"]["name"]] = (
                    auto["minReplicas"] if auto else spec.get("replicas", 1)
                )
                env.apply(path)
            assert len(expected) == len(EXAMPLES) >= 4
            for name, replicas in expected.items():
                env.wait_ready(name, replicas=replicas, timeout=120)
                for pod in env.pods(name):
                    scheduled = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
                    assert scheduled["status"] == "True", (name, scheduled)
        finally:
            env.operator.stop()
