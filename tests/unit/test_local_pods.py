"""How the local cluster's pod runner maps a rendered pod's container to a local process (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.k8s.local_pods import UnsupportedPodError, local_command


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
    # Only literal values outside volume mounts reach the process.
    assert command.env == {"LOG_LEVEL": "debug"}
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
