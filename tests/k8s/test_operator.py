"""The operator against the local control plane (tests/k8s/cluster.py): CRD, examples, status, drift,
CEL validation, impossible specs, garbage collection and the scale subresource.

The operator runs as a subprocess (`python -m conveyor.operator.run --standalone --namespace NS`), as
`conveyor operator` would; kwok runs the pods it creates on simulated GPU nodes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.k8s.cluster import LocalCluster
from tests.k8s.operator_env import (
    CRD_PATH,
    ISVC_LABEL,
    LLAMA_EXAMPLE,
    RESTRICTED,
    SERVICE_MONITOR_CRD,
    SMOLLM_EXAMPLE,
    Env,
    Operator,
    container_args,
    flag,
    isvc,
)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


@pytest.fixture(scope="module")
def env(k8s: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    k8s.kubectl("apply", "--server-side", "-f", str(CRD_PATH))
    k8s.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(SERVICE_MONITOR_CRD))
    for crd in ("inferenceservices.serving.conveyor.dev", "servicemonitors.monitoring.coreos.com"):
        k8s.wait_established(crd)
    namespace = k8s.create_namespace("operator", labels=RESTRICTED)
    log_path = tmp_path_factory.mktemp("operator") / "operator.log"
    operator = Operator(k8s, namespace, log_path)
    try:
        yield Env(k8s, namespace, operator)
    finally:
        operator.stop()
        k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_llama_example_reproduces_the_worked_example(env: Env) -> None:
    env.apply(LLAMA_EXAMPLE)
    try:
        resource = env.wait_ready("llama-3-8b")
        status = resource["status"]
        assert status["capacity"]["kvBytesPerToken"] == 131072
        assert status["capacity"]["maxNumSeqs"] == 112
        assert status["capacity"]["maxConcurrencyAtMaxModelLen"] == pytest.approx(112.08, abs=0.01)
        assert status["url"] == f"http://llama-3-8b.{env.namespace}.svc.cluster.local"
        assert status["selector"] == f"{ISVC_LABEL}=llama-3-8b"
        conditions = {c["type"]: c for c in status["conditions"]}
        assert conditions["CapacityPlanned"]["status"] == "True"
        assert "max_num_seqs 112" in conditions["CapacityPlanned"]["message"]
        # The autoscaler's Scaling condition follows at its next step (15 s) if one ran while the pod
        # was not Ready yet (WaitingForReadyReplicas).
        env.eventually(
            lambda: (env.condition("llama-3-8b", "Scaling") or {}).get("status") == "False",
            "Scaling=False",
            timeout=45,
        )

        deployment = env.get("deployment", "llama-3-8b")
        assert deployment is not None
        args = container_args(deployment)
        assert args[:2] == ["serve", "meta-llama/Meta-Llama-3-8B-Instruct"]
        assert flag(args, "--max-num-seqs") == "112"
        assert flag(args, "--max-model-len") == "4096"
        assert flag(args, "--gpu-memory-utilization") == "0.9"
        assert flag(args, "--tensor-parallel-size") == "1"
        assert flag(args, "--max-num-batched-tokens") == "8192"
        pod_spec = deployment["spec"]["template"]["spec"]
        container = pod_spec["containers"][0]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "1", "cpu": "8", "memory": "64Gi"}
        assert container["startupProbe"]["httpGet"]["path"] == "/health"
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert pod_spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}

        (pod,) = env.pods("llama-3-8b")
        assert pod["status"]["phase"] == "Running"
        node = env.cluster.kubectl("get", "node", pod["spec"]["nodeName"], "-o", "json").stdout
        assert json.loads(node)["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"

        uid = resource["metadata"]["uid"]
        for kind in ("deployment", "service", "poddisruptionbudget", "servicemonitor"):
            child = env.get(kind, "llama-3-8b")
            assert child is not None, f"{kind} missing"
            assert [r["uid"] for r in child["metadata"]["ownerReferences"]] == [uid], kind

        reasons = {e["reason"] for e in env.events("llama-3-8b")}
        assert {"CapacityPlanned", "Created"} <= reasons

        env.eventually(lambda: env.condition("llama-3-8b", "MetricsAvailable"), "the autoscaler's first step")
        table = env.kubectl("get", "cisvc", "llama-3-8b").stdout
        header, row = table.splitlines()
        columns = ["NAME", "MODEL", "GPU", "TP", "READY", "REASON", "REPLICAS", "AVAILABLE", "DESIRED"]
        assert header.split() == [*columns, "SCALING", "MAXSEQS", "AGE"]
        # The example autoscales; this operator has no --prometheus-url, so the autoscaler holds.
        assert row.split()[:11] == [
            "llama-3-8b",
            "llama-3-8b",
            "a100-80gb",
            "1",
            "True",
            "ReplicasReady",
            "1",
            "1",
            "1",
            "MetricsUnavailable",
            "112",
        ]
        wide = env.kubectl("get", "cisvc", "llama-3-8b", "-o", "wide").stdout.splitlines()
        assert wide[0].split()[-2:] == ["URL", "AGE"]
        assert f"http://llama-3-8b.{env.namespace}.svc.cluster.local" in wide[1].split()
    finally:
        env.delete("llama-3-8b")


def test_smollm2_example_on_l4_nodes(env: Env) -> None:
    """The default cluster's L4 node takes the SmolLM2 example (its GPU type selects the node)."""
    env.apply(SMOLLM_EXAMPLE)
    try:
        status = env.wait_ready("smollm2-135m")["status"]
        assert status["capacity"]["kvBytesPerToken"] == 23040
        assert status["capacity"]["maxNumSeqs"] == 216
        (pod,) = env.pods("smollm2-135m")
        node = json.loads(env.cluster.kubectl("get", "node", pod["spec"]["nodeName"], "-o", "json").stdout)
        assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-L4"
        deployment = env.get("deployment", "smollm2-135m")
        assert deployment is not None
        assert flag(container_args(deployment), "--max-num-seqs") == "216"
    finally:
        env.delete("smollm2-135m")


def test_reconcile_is_idempotent(env: Env) -> None:
    env.apply(isvc("idem"))
    try:
        env.wait_ready("idem")
        before = {kind: env.get(kind, "idem") for kind in ("deployment", "service", "poddisruptionbudget")}
        # An annotation change makes kopf run the update handler: a full reconcile with nothing to do.
        env.kubectl("annotate", "inferenceservice", "idem", "example.com/touched=1")

        def handled() -> bool:
            isvc_now = env.get("inferenceservice", "idem") or {}
            annotations = isvc_now["metadata"].get("annotations", {})
            last = annotations.get("serving.conveyor.dev/last-handled-configuration", "")
            return "example.com/touched" in last

        env.eventually(handled, "the update handler to run")
        time.sleep(1)
        for kind, obj in before.items():
            after = env.get(kind, "idem")
            assert after is not None and obj is not None
            assert after["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"], kind
    finally:
        env.delete("idem")


def test_spec_edit_rolls_the_deployment(env: Env) -> None:
    env.apply(isvc("roll"))
    try:
        env.wait_ready("roll")
        first = env.get("deployment", "roll")
        assert first is not None and flag(container_args(first), "--max-num-seqs") == "112"
        env.kubectl(
            "patch",
            "inferenceservice",
            "roll",
            "--type=merge",
            "-p",
            '{"spec":{"model":{"maxModelLen":8192}}}',
        )

        def rolled() -> dict[str, Any] | None:
            dep = env.get("deployment", "roll")
            status = (dep or {}).get("status", {})
            if (
                dep
                and flag(container_args(dep), "--max-num-seqs") == "56"
                and status.get("observedGeneration") == dep["metadata"]["generation"]
                and status.get("updatedReplicas") == 1
                and status.get("replicas") == 1
                and status.get("readyReplicas") == 1
            ):
                return dep
            return None

        second = env.eventually(rolled, "the rollout to --max-num-seqs 56")
        assert second["metadata"]["generation"] > first["metadata"]["generation"]
        (pod,) = env.pods("roll")
        assert flag(pod["spec"]["containers"][0]["args"], "--max-model-len") == "8192"
        status = env.wait_ready("roll")["status"]
        assert status["capacity"]["maxNumSeqs"] == 56
    finally:
        env.delete("roll")


def test_manual_edits_are_corrected(env: Env) -> None:
    env.apply(isvc("drift"))
    try:
        env.wait_ready("drift")
        dep = env.get("deployment", "drift")
        assert dep is not None
        args = container_args(dep)
        index = args.index("--max-num-seqs") + 1
        patch = [{"op": "replace", "path": f"/spec/template/spec/containers/0/args/{index}", "value": "999"}]
        env.kubectl("patch", "deployment", "drift", "--type=json", "-p", json.dumps(patch))
        env.eventually(
            lambda: flag(container_args(env.get("deployment", "drift") or dep), "--max-num-seqs") == "112",
            "the operator to restore --max-num-seqs 112",
        )
        env.kubectl("delete", "service", "drift", "--wait=true")
        env.eventually(lambda: env.get("service", "drift"), "the Service to be recreated")
    finally:
        env.delete("drift")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"replicas": None, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
            "minReplicas must be <= maxReplicas",
        ),
        (
            {"resources": {"gpusPerReplica": 3, "tensorParallelSize": 2}},
            "gpusPerReplica must be divisible by tensorParallelSize",
        ),
        ({"replicas": 2, "autoscaling": {"maxReplicas": 4}}, "set either replicas or autoscaling, not both"),
        (
            {"replicas": None, "autoscaling": {"maxReplicas": 4}},
            "set at least one of targetTTFTSeconds, targetQueueDepth, targetRequestsPerSecond",
        ),
        (
            {
                "replicas": None,
                "autoscaling": {
                    "maxReplicas": 4,
                    "targetQueueDepth": 2,
                    "behavior": {
                        "scaleUp": {"policies": [{"type": "Nodes", "value": 1, "periodSeconds": 15}]}
                    },
                },
            },
            'Unsupported value: "Nodes"',
        ),
        ({"model": {"dtype": "int3"}}, "Unsupported value"),
        ({"engine": {"gpuMemoryUtilization": 1.5}}, "should be less than or equal to 1"),
    ],
)
def test_invalid_objects_are_rejected_by_the_api_server(env: Env, spec: dict[str, Any], message: str) -> None:
    result = env.kubectl("apply", "-f", "-", input=json.dumps(isvc("invalid", **spec)), check=False)
    assert result.returncode != 0
    assert message in result.stderr
    assert env.get("inferenceservice", "invalid") is None


def test_too_large_model_reports_insufficient_memory_then_recovers(env: Env) -> None:
    env.apply(isvc("big", model={"name": "llama-3-70b"}, resources={"gpuType": "h100-80gb"}))
    try:
        planned = env.eventually(
            lambda: (c := env.condition("big", "CapacityPlanned")) and c["status"] == "False" and c,
            "CapacityPlanned=False",
        )
        assert planned["reason"] == "InsufficientGPUMemory"
        assert "short by" in planned["message"] and "GiB" in planned["message"]
        resource = env.get("inferenceservice", "big")
        assert resource is not None
        assert "capacity" not in resource["status"]
        assert env.condition("big", "Ready")["reason"] == "CapacityNotPlanned"  # type: ignore[index]
        warnings = [e for e in env.events("big") if e["type"] == "Warning"]
        assert any(e["reason"] == "InsufficientGPUMemory" for e in warnings)
        time.sleep(2)
        assert env.get("deployment", "big") is None
        assert env.pods("big") == []

        env.kubectl(
            "patch",
            "inferenceservice",
            "big",
            "--type=merge",
            "-p",
            '{"spec":{"resources":{"gpusPerReplica":4}}}',
        )
        status = env.wait_ready("big")["status"]
        assert env.condition("big", "CapacityPlanned")["status"] == "True"  # type: ignore[index]
        assert status["capacity"]["kvBytesPerToken"] == 81920
        deployment = env.get("deployment", "big")
        assert deployment is not None
        assert flag(container_args(deployment), "--tensor-parallel-size") == "4"
        limits = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "4"
    finally:
        env.delete("big")


def test_a_replica_larger_than_any_node_is_refused_naming_the_node_size(env: Env) -> None:
    """The test bed's A100 nodes have 8 GPUs each: a 16-GPU replica cannot be placed (tensor-parallel
    ranks share a node), so CapacityPlanned=False with the node size and no Deployment."""
    env.apply(isvc("wide", model={"name": "llama-3-70b"}, resources={"gpusPerReplica": 16}))
    try:
        planned = env.eventually(
            lambda: (c := env.condition("wide", "CapacityPlanned")) and c["status"] == "False" and c,
            "CapacityPlanned=False",
        )
        assert planned["reason"] == "ReplicaExceedsNode"
        assert "needs 16 GPUs on one node" in planned["message"]
        assert "has 8 allocatable" in planned["message"]
        assert env.get("deployment", "wide") is None
    finally:
        env.delete("wide")


def test_delete_removes_every_child(env: Env) -> None:
    env.apply(isvc("gone"))
    env.wait_ready("gone")
    env.kubectl("delete", "inferenceservice", "gone", "--wait=true")

    def all_gone() -> bool:
        return all(
            env.get(kind, "gone") is None
            for kind in ("deployment", "service", "poddisruptionbudget", "servicemonitor")
        ) and not env.pods("gone")

    env.eventually(all_gone, "garbage collection of the children")


def test_kubectl_scale_through_the_scale_subresource(env: Env) -> None:
    env.apply(isvc("scaled"))
    try:
        env.wait_ready("scaled")
        env.kubectl("scale", "inferenceservice/scaled", "--replicas=3")
        resource = env.wait_ready("scaled", replicas=3)
        assert resource["spec"]["replicas"] == 3
        assert resource["status"]["replicas"] == 3
        assert len(env.pods("scaled")) == 3
        scale = json.loads(
            env.cluster.kubectl(
                "get",
                "--raw",
                f"/apis/serving.conveyor.dev/v1alpha1/namespaces/{env.namespace}"
                "/inferenceservices/scaled/scale",
            ).stdout
        )
        assert scale["spec"]["replicas"] == 3
        assert scale["status"]["replicas"] == 3
        assert scale["status"]["selector"] == f"{ISVC_LABEL}=scaled"
    finally:
        env.delete("scaled")


def test_server_pods_pass_the_restricted_pod_security_profile(env: Env) -> None:
    """The namespace enforces `restricted` (a root pod is refused), and the server's pods are admitted
    (every test in this module runs its pods there)."""
    root_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "root"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    refused = env.kubectl("apply", "-f", "-", input=json.dumps(root_pod), check=False)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted' in refused.stderr
    env.apply(isvc("restricted"))
    try:
        env.wait_ready("restricted")
        (pod,) = env.pods("restricted")
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    finally:
        env.delete("restricted")


def test_examples_are_valid_for_the_api_server(env: Env) -> None:
    for path in (LLAMA_EXAMPLE, SMOLLM_EXAMPLE):
        manifest = yaml.safe_load(path.read_text())
        manifest["metadata"]["name"] = "dry-" + manifest["metadata"]["name"]
        env.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(manifest))


def test_restarted_operator_resumes_and_corrects_drift(
    k8s: LocalCluster, env: Env, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Changes made while no operator runs are reconciled when one starts (kopf's resume handler)."""
    namespace = k8s.create_namespace("resume")
    log_dir = tmp_path_factory.mktemp("resume")
    first = Operator(k8s, namespace, log_dir / "first.log")
    resumed = Env(k8s, namespace, first)
    try:
        resumed.apply(isvc("resume"))
        resumed.wait_ready("resume")
        first.stop()
        patch = {
            "spec": {
                "template": {"spec": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}}
            }
        }
        resumed.kubectl("patch", "deployment", "resume", "--type=merge", "-p", json.dumps(patch))
        resumed.operator = Operator(k8s, namespace, log_dir / "second.log")

        def corrected() -> bool:
            dep = resumed.get("deployment", "resume") or {}
            selector = dep.get("spec", {}).get("template", {}).get("spec", {}).get("nodeSelector", {})
            return selector.get("nvidia.com/gpu.product") == "NVIDIA-A100-SXM4-80GB"

        resumed.eventually(corrected, "the restarted operator to restore the node selector")
        resumed.wait_ready("resume")
    finally:
        resumed.operator.stop()
        k8s.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
