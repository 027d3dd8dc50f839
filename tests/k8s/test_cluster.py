"""The local control plane behaves like a real cluster with GPU nodes (tests/k8s/cluster.py)."""

import json
import os
import socket
import uuid
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.k8s.cluster import GPU_RESOURCE, LocalCluster, NodePool
from tests.k8s.operator_env import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


COMPONENTS = {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"}


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def port_listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains `text` (every component's flags name the workdir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                pids.append(int(entry.name))
    return pids


def test_starts_and_stops_cleanly_twice() -> None:
    for _ in range(2):
        cluster = LocalCluster([NodePool(product="NVIDIA-A100-SXM4-80GB", count=1, gpus_per_node=1)])
        cluster.start()
        try:
            pids, ports, workdir = cluster.pids, dict(cluster.ports), cluster.workdir
            assert set(pids) == COMPONENTS
            assert all(process_alive(pid) for pid in pids.values())
            for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
                assert port_listening(ports[name]), name
            assert cluster.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
        finally:
            cluster.stop()

        assert workdir is not None
        assert [name for name, pid in pids.items() if process_alive(pid)] == []
        assert [name for name, port in ports.items() if port_listening(port)] == []
        assert processes_mentioning(str(workdir)) == []
        assert not workdir.exists()


def test_nodes_ready_with_allocatable_gpus(k8s: LocalCluster) -> None:
    table = k8s.kubectl("get", "nodes", "--no-headers").stdout.splitlines()
    statuses = {line.split()[0]: line.split()[1] for line in table}
    assert statuses["a100-sxm4-80gb-0"] == "Ready"
    assert statuses["h100-80gb-hbm3-0"] == "Ready"
    assert statuses["l4-0"] == "Ready"

    nodes = {
        n["metadata"]["name"]: n
        for n in json.loads(k8s.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    }
    a100, h100 = nodes["a100-sxm4-80gb-0"], nodes["h100-80gb-hbm3-0"]
    assert a100["status"]["allocatable"][GPU_RESOURCE] == "8"
    assert h100["status"]["allocatable"][GPU_RESOURCE] == "8"
    assert a100["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert a100["metadata"]["labels"]["nvidia.com/gpu.memory"] == "81920"
    assert h100["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert nodes["l4-0"]["status"]["allocatable"][GPU_RESOURCE] == "4"


def test_gpu_requests_beyond_capacity_stay_pending(k8s: LocalCluster) -> None:
    # Two dedicated 1-GPU nodes, selected by label, so the session's other nodes don't interfere.
    pool_label = f"sched-{uuid.uuid4().hex[:6]}"
    pool = NodePool(
        product="NVIDIA-A100-SXM4-80GB",
        count=2,
        gpus_per_node=1,
        name_prefix=pool_label,
        labels={"conveyor.dev/test-pool": pool_label},
    )
    node_names = k8s.add_nodes(pool)
    namespace = k8s.create_namespace("sched")
    core = client.CoreV1Api(k8s.api_client)
    try:
        deployment = client.V1Deployment(
            metadata=client.V1ObjectMeta(name="gpu-server"),
            spec=client.V1DeploymentSpec(
                replicas=3,
                selector=client.V1LabelSelector(match_labels={"app": "gpu-server"}),
                template=client.V1PodTemplateSpec(
                    metadata=client.V1ObjectMeta(labels={"app": "gpu-server"}),
                    spec=client.V1PodSpec(
                        node_selector={"conveyor.dev/test-pool": pool_label},
                        containers=[
                            client.V1Container(
                                name="server",
                                image="example.invalid/server:1",
                                resources=client.V1ResourceRequirements(limits={GPU_RESOURCE: "1"}),
                            )
                        ],
                    ),
                ),
            ),
        )
        client.AppsV1Api(k8s.api_client).create_namespaced_deployment(namespace, deployment)

        def phases() -> list[client.V1Pod] | None:
            pods = core.list_namespaced_pod(namespace, label_selector="app=gpu-server").items
            counts = sorted(p.status.phase for p in pods)
            return pods if counts == ["Pending", "Running", "Running"] else None

        pods = eventually(phases, what="2 Running and 1 Pending pods")
        running = [p for p in pods if p.status.phase == "Running"]
        assert sorted(p.spec.node_name for p in running) == sorted(node_names)
        (pending,) = [p for p in pods if p.status.phase == "Pending"]
        assert pending.spec.node_name is None

        def scheduling_failure() -> str | None:
            events = core.list_namespaced_event(
                namespace,
                field_selector=f"involvedObject.name={pending.metadata.name},reason=FailedScheduling",
            ).items
            return next((e.message for e in events if f"Insufficient {GPU_RESOURCE}" in e.message), None)

        message = eventually(scheduling_failure, what="a FailedScheduling event")
        assert f"2 Insufficient {GPU_RESOURCE}" in message
    finally:
        k8s.kubectl("delete", "namespace", namespace, "--wait=false")
        k8s.delete_nodes(node_names)


def test_crd_cel_rule_rejects_bad_object_with_its_message(k8s: LocalCluster) -> None:
    group, plural = "test.conveyor.dev", f"widgets{uuid.uuid4().hex[:6]}"
    message = "spec.replicas must not exceed spec.maxReplicas"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": plural[:-1], "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "replicas": {"type": "integer"},
                                        "maxReplicas": {"type": "integer"},
                                    },
                                    "x-kubernetes-validations": [
                                        {"rule": "self.replicas <= self.maxReplicas", "message": message}
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    extensions = client.ApiextensionsV1Api(k8s.api_client)
    extensions.create_custom_resource_definition(crd)
    try:

        def established() -> bool:
            conditions = (
                extensions.read_custom_resource_definition(crd["metadata"]["name"]).status.conditions or []
            )
            return any(c.type == "Established" and c.status == "True" for c in conditions)

        eventually(established, what="the CRD to be Established")
        namespace = k8s.create_namespace("cel")
        objects = client.CustomObjectsApi(k8s.api_client)

        def widget(name: str, replicas: int, max_replicas: int) -> dict:
            return {
                "apiVersion": f"{group}/v1",
                "kind": "Widget",
                "metadata": {"name": name},
                "spec": {"replicas": replicas, "maxReplicas": max_replicas},
            }

        objects.create_namespaced_custom_object(group, "v1", namespace, plural, widget("good", 2, 4))
        with pytest.raises(ApiException) as rejected:
            objects.create_namespaced_custom_object(group, "v1", namespace, plural, widget("bad", 5, 4))
        assert rejected.value.status == 422
        assert message in json.loads(rejected.value.body)["message"]
        k8s.kubectl("delete", "namespace", namespace, "--wait=false")
    finally:
        extensions.delete_custom_resource_definition(crd["metadata"]["name"])


def test_deleting_owner_garbage_collects_owned_objects(k8s: LocalCluster) -> None:
    namespace = k8s.create_namespace("gc")
    core = client.CoreV1Api(k8s.api_client)
    owner = core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"), data={"role": "owner"})
    )
    reference = client.V1OwnerReference(
        api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid
    )
    for name in ("owned-a", "owned-b"):
        core.create_namespaced_config_map(
            namespace,
            client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name, owner_references=[reference])),
        )
    unrelated = core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="unrelated"))
    )

    core.delete_namespaced_config_map("owner", namespace, propagation_policy="Background")

    def remaining() -> list[str] | None:
        # kube-root-ca.crt is published into every namespace by kube-controller-manager.
        names = sorted(
            cm.metadata.name
            for cm in core.list_namespaced_config_map(namespace).items
            if cm.metadata.name != "kube-root-ca.crt"
        )
        return names if "owned-a" not in names and "owned-b" not in names else None

    assert eventually(remaining, what="owned ConfigMaps to be collected") == [unrelated.metadata.name]
    k8s.kubectl("delete", "namespace", namespace, "--wait=false")
