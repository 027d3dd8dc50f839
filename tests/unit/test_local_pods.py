"""How the local cluster's pod runner maps a rendered pod's container to a local process (pure)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from tests.k8s.local_pods import (
    ContainerConfigError,
    ContainerProbes,
    UnsupportedPodError,
    container_env,
    local_command,
)


def server_container(*args: str) -> dict:
    return {
        "name": "server",
        "command": ["conveyor"],
        "args": ["serve", "meta-llama/Meta-Llama-3-70B-Instruct", *args],
        "env": [
            {"name": "HF_HOME", "value": "/models/hf-cache"},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            {"name": "LOG_LEVEL", "value": "debug"},
        ],
        "volumeMounts": [{"name": "hf-cache", "mountPath": "/models/hf-cache"}],
    }


def test_server_flags_map_to_cpu_equivalents() -> None:
    command = local_command(
        server_container(
            "--dtype", "bfloat16", "--tensor-parallel-size", "4", "--gpu-memory-utilization", "0.9",
            "--max-num-seqs", "122", "--host", "0.0.0.0", "--port", "8000",
        ),
        4321,
        conveyor="/venv/bin/conveyor",
        kv_cache_memory=1 << 29,
        available=lambda model: False,
    )  # fmt: skip
    assert command.kind == "server"
    assert command.argv == [
        "/venv/bin/conveyor", "serve", "--dtype", "auto", "--tensor-parallel-size", "1",
        "--max-num-seqs", "122", "--host", "127.0.0.1", "--port", "4321", "--kv-cache-memory", str(1 << 29),
    ]  # fmt: skip
    assert any("embedded" in note for note in command.notes)


def test_an_available_model_and_explicit_kv_pool_are_kept() -> None:
    command = local_command(
        server_container("--kv-cache-memory", "1000", "--port=8000"),
        5000,
        conveyor="conveyor",
        available=lambda model: True,
    )
    assert command.argv[2] == "meta-llama/Meta-Llama-3-70B-Instruct"
    assert command.argv[3:] == ["--kv-cache-memory", "1000", "--port", "5000", "--host", "127.0.0.1"]


def test_router_reads_the_runner_endpoint_file() -> None:
    container = {
        "name": "router",
        "command": ["conveyor"],
        "args": ["router", "--host", "0.0.0.0", "--port", "8000", "--service", "ns/chat",
                 "--service-port-name", "http", "--tokenizer", "org/model", "--policy", "least-load"],
    }  # fmt: skip
    command = local_command(
        container, 6000, conveyor="conveyor", endpoint_file=Path("/w/ns_chat.txt"), available=lambda m: False
    )
    assert command.kind == "router"
    assert command.argv == [
        "conveyor", "router", "--host", "127.0.0.1", "--port", "6000", "--policy", "least-load",
        "--endpoint-file", "/w/ns_chat.txt",
    ]  # fmt: skip


def test_other_commands_are_refused() -> None:
    with pytest.raises(UnsupportedPodError, match="not a conveyor server or router"):
        local_command({"name": "x", "command": ["sleep"], "args": ["60"]}, 1, conveyor="conveyor")


def probed(**probes: dict) -> dict:
    """A container with httpGet probes on /health: `startup=`, `readiness=`, `liveness=` give the
    periodSeconds and failureThreshold of each."""
    return {
        "name": "server",
        **{
            f"{kind}Probe": {"httpGet": {"path": "/health", "port": "http"}, **fields}
            for kind, fields in probes.items()
        },
    }


def test_nothing_but_the_startup_probe_runs_until_it_passes() -> None:
    probes = ContainerProbes(
        probed(
            startup={"periodSeconds": 10, "failureThreshold": 3},
            readiness={"periodSeconds": 5, "failureThreshold": 3},
            liveness={"periodSeconds": 10, "failureThreshold": 2},
        ),
        started_at=100.0,
    )
    assert probes.due(100.5) == []
    assert [kind for kind, _ in probes.due(101.0)] == ["startup"]
    assert probes.due(101.0, {"startup"}) == []
    assert probes.record("startup", False, 101.2) is None
    assert not probes.started and not probes.ready
    assert probes.record("startup", True, 102.2) is None
    assert probes.started and not probes.ready
    # Readiness at once, then every second until it passes; liveness after its own period.
    assert [kind for kind, _ in probes.due(102.2)] == ["readiness"]
    probes.record("readiness", False, 102.3)
    assert [kind for kind, _ in probes.due(103.3)] == ["readiness"]
    probes.record("readiness", True, 103.4)
    assert probes.ready
    assert probes.due(104.5) == []  # the readiness period (5 s) once ready
    assert [kind for kind, _ in probes.due(108.4)] == ["readiness"]
    assert sorted(kind for kind, _ in probes.due(112.2)) == ["liveness", "readiness"]


def test_a_startup_probe_that_never_passes_kills_after_its_budget() -> None:
    probes = ContainerProbes(probed(startup={"periodSeconds": 5, "failureThreshold": 4}), started_at=0.0)
    assert probes.record("startup", False, 19.0) is None
    assert probes.overdue(20.0) is None
    why = probes.overdue(20.5)
    assert why == "Startup probe did not succeed within 20s"
    assert probes.due(30.0) == [] and probes.overdue(31.0) is None  # one verdict per run


def test_readiness_drops_after_the_threshold_and_returns_on_one_success() -> None:
    probes = ContainerProbes(probed(readiness={"periodSeconds": 5, "failureThreshold": 3}), started_at=0.0)
    assert probes.started and not probes.ready
    probes.record("readiness", True, 1.0)
    for t in (6.0, 11.0):
        probes.record("readiness", False, t)
        assert probes.ready
    probes.record("readiness", False, 16.0)
    assert not probes.ready
    assert probes.next_at["readiness"] == 17.0  # probed every second again while not ready
    probes.record("readiness", True, 17.0)
    assert probes.ready


def test_liveness_misses_in_a_row_kill_and_a_success_resets_the_count() -> None:
    probes = ContainerProbes(
        probed(readiness={"periodSeconds": 5}, liveness={"periodSeconds": 10, "failureThreshold": 3}),
        started_at=0.0,
    )
    probes.record("readiness", True, 1.0)
    assert probes.record("liveness", False, 10.0) is None
    assert probes.record("liveness", False, 20.0) is None
    assert probes.record("liveness", True, 30.0) is None
    assert probes.record("liveness", False, 40.0) is None
    assert probes.record("liveness", False, 50.0) is None
    assert probes.record("liveness", False, 60.0) == "Liveness probe failed 3 times in a row"
    assert not probes.ready and probes.due(100.0) == []


def test_a_container_without_probes_is_ready_once_running() -> None:
    probes = ContainerProbes({"name": "server"}, started_at=0.0)
    assert probes.started and probes.ready and probes.due(5.0) == []


POD = {
    "metadata": {"name": "chat-0", "namespace": "ns", "uid": "u-1", "labels": {"app": "chat"}},
    "spec": {"nodeName": "l4-0", "serviceAccountName": "chat"},
    "status": {"podIP": "10.245.0.2", "hostIP": "127.0.0.1"},
}
OBJECTS = {
    ("ConfigMap", "settings"): {"data": {"LOG_LEVEL": "info", "MODE": "fast", "not a name": "x"}},
    ("Secret", "hf"): {"data": {"token": base64.b64encode(b"hf_secret").decode()}},
}


def read(kind: str, namespace: str, name: str) -> dict | None:
    assert namespace == "ns"
    return OBJECTS.get((kind, name))


def test_env_is_resolved_as_the_kubelet_does() -> None:
    container = {
        **server_container(),
        "envFrom": [
            {"configMapRef": {"name": "settings"}},
            {"prefix": "CFG_", "configMapRef": {"name": "settings"}},
            {"secretRef": {"name": "absent", "optional": True}},
        ],
    }
    container["env"] += [
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "MODE"}}},
        {"name": "GONE", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "other", "optional": True}}},
        {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
    ]
    env, notes = container_env(container, POD, read)
    assert env == {
        # envFrom first, then env in order: the literal LOG_LEVEL overrides the ConfigMap's.
        "LOG_LEVEL": "debug",
        "MODE": "fast",
        "CFG_LOG_LEVEL": "info",
        "CFG_MODE": "fast",
        "HF_TOKEN": "hf_secret",
        "POD": "chat-0",
        "IP": "10.245.0.2",
        "APP": "chat",
    }
    # HF_HOME points into the container's volume: the host's default applies.
    assert any("HF_HOME" in n and "volume" in n for n in notes)
    assert any("not a name" in n for n in notes)
    assert any("CPUS" in n and "resourceFieldRef" in n for n in notes)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"envFrom": [{"secretRef": {"name": "absent"}}]}, 'secret "absent" not found'),
        (
            {"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "absent", "key": "k"}}}]},
            'configmap "absent" not found',
        ),
        (
            {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "nope"}}}]},
            "couldn't find key nope in Secret ns/hf",
        ),
    ],
)
def test_a_missing_required_source_is_a_config_error(entry: dict, message: str) -> None:
    with pytest.raises(ContainerConfigError, match=message):
        container_env({"name": "server", **entry}, POD, read)
