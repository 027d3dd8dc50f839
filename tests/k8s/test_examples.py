"""A fresh cluster with the default node pools (what `make cluster` starts with no `--pool`), as a newcomer
has it: every file in examples/ schedules without reading about pools first, and an operator started
without `--standalone` on a cluster that lacks kopf's peering CRDs says so instead of failing silently."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.k8s.cluster import LocalCluster
from tests.k8s.operator_env import CRD_PATH, REPO, Env, Operator

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def fresh() -> Iterator[LocalCluster]:
    """Not the session's cluster, where other tests add nodes and install CRDs."""
    with LocalCluster() as cluster:
        cluster.kubectl("apply", "--server-side", "-f", str(CRD_PATH))
        cluster.wait_established("inferenceservices.serving.conveyor.dev")
        yield cluster


def test_every_example_schedules_on_a_default_cluster(fresh: LocalCluster, tmp_path: Path) -> None:
    """kwok runs the pods. Each example turns Ready with its replicas (autoscaled ones at minReplicas:
    there is no Prometheus, so they hold)."""
    namespace = fresh.create_namespace("examples")
    env = Env(fresh, namespace, Operator(fresh, namespace, tmp_path / "operator.log"))
    try:
        expected = {}
        for path in EXAMPLES:
            manifest = yaml.safe_load(path.read_text())
            spec = manifest["spec"]
            auto = spec.get("autoscaling")
            expected[manifest["metadata"]["name"]] = auto["minReplicas"] if auto else spec.get("replicas", 1)
            env.apply(path)
        assert len(expected) == len(EXAMPLES) >= 4
        for name, replicas in expected.items():
            env.wait_ready(name, replicas=replicas, timeout=120)
            for pod in env.pods(name):
                scheduled = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
                assert scheduled["status"] == "True", (name, scheduled)
    finally:
        env.operator.stop()


def test_peering_without_kopfs_crds_is_told_not_silent(fresh: LocalCluster, tmp_path: Path) -> None:
    assert fresh.kubectl("get", "crd", "kopfpeerings.kopf.dev", check=False).returncode != 0
    namespace = fresh.create_namespace("peering")
    named = Operator(
        fresh,
        namespace,
        tmp_path / "named.log",
        argv=["--peering", "ops", "--namespace", namespace, "--metrics-port", "0"],
    )
    try:
        code = named.process.wait(timeout=30)
    finally:
        named.stop()
    log = named.log_path.read_text()
    assert code == 1, log
    assert "--peering ops needs kopf's peering CRD kopfpeerings.kopf.dev, which is not installed" in log, log
    # kopf's default peering: a warning, then it runs as --standalone and reconciles.
    default = Operator(
        fresh, namespace, tmp_path / "default.log", argv=["--namespace", namespace, "--metrics-port", "0"]
    )
    env = Env(fresh, namespace, default)
    try:
        env.eventually(
            lambda: "running without peering" in default.log_path.read_text(),
            "the peering warning",
            timeout=30,
        )
        assert default.process.poll() is None, default.log_tail()
    finally:
        default.stop()
