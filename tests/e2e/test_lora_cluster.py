"""LoRA adapters as desired state on every replica, on the local cluster with real server pods.

Everything is real: the control plane, the operator (a process) reading a real Prometheus, and each
server pod a real `conveyor serve` process (`tests/k8s/local_pods.py`, which projects the adapters'
ConfigMap into the pod's mounted directory as the kubelet does). The adapters are made here with
`peft` on the embedded model. The InferenceService is `examples/smollm2-135m-lora.yaml` with the
adapters' URIs pointed at them and float32 weights, so each adapter's greedy answer is checked
against peft's merged model.

The steps: one replica serves the three adapters; scaled to three, every new pod serves all three
the moment it is Ready; removing one from the spec unloads it from every pod without a restart;
adding one that cannot load (a rank above maxRank) is an AdapterLoadFailed condition and a Warning
Event naming the rank, while every pod keeps serving the others.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import yaml

from tests.e2e.local_stack import local_stack
from tests.k8s.operator_env import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.k8s, pytest.mark.slow]

EXAMPLE = REPO / "examples" / "smollm2-135m-lora.yaml"
NAME = "smollm2-lora"
SERVER_START_TIMEOUT = 300.0  # the first start converts the embedded model; 2 cores are shared by all
PROMPT = "The capital of France is"
MAX_TOKENS = 8
# name -> (rank, target modules)
ADAPTERS = {
    "sql": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "chat-de": (4, ["q_proj", "v_proj"]),
    "support": (16, ["gate_proj", "up_proj", "down_proj"]),
}


def make_adapters(root: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """PEFT adapters of the embedded model (random non-zero weights, one too wide for maxRank 16), and
    the greedy answer to PROMPT of each valid one's merged model in float32."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from conveyor.server.model.loader import converted, load_tokenizer, resolve_model

    source = resolve_model(None)
    base = AutoModelForCausalLM.from_pretrained(
        source.path, gguf_file=source.gguf_file, dtype=torch.float32
    ).eval()
    tokenizer = load_tokenizer(converted(source))
    prompt = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    paths, answers = {}, {}
    for seed, (name, (rank, targets)) in enumerate({**ADAPTERS, "too-wide": (32, ["q_proj"])}.items()):
        torch.manual_seed(200 + seed)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        paths[name] = root / name
        get_peft_model(copy.deepcopy(base), config).save_pretrained(str(paths[name]))
        if name in ADAPTERS:
            merged = (
                PeftModel.from_pretrained(copy.deepcopy(base), str(paths[name])).merge_and_unload().eval()
            )
            with torch.no_grad():
                out = merged.generate(prompt, max_new_tokens=MAX_TOKENS, do_sample=False)
            answers[name] = tokenizer.decode(out[0, prompt.shape[1] :])
    return paths, answers


def manifest(paths: dict[str, Path], names: list[str], replicas: int) -> dict[str, Any]:
    body = yaml.safe_load(EXAMPLE.read_text())
    assert body["metadata"]["name"] == NAME
    spec = body["spec"]
    assert [a["name"] for a in spec["model"]["lora"]["adapters"]] == list(ADAPTERS)
    spec["model"]["dtype"] = "float32"
    spec["model"]["lora"]["adapters"] = [{"name": n, "uri": str(paths[n])} for n in names]
    spec["replicas"] = replicas
    return body


def served(port: int) -> set[str]:
    """The adapters one server process lists in /v1/models."""
    cards = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


def test_adapters_follow_the_spec_on_every_replica(tmp_path: Path) -> None:
    paths, answers = make_adapters(tmp_path / "adapters")
    with local_stack(tmp_path, "lora", max_server_processes=3) as stack:
        pods, env = stack.pods, stack.env
        namespace = env.namespace

        def server_pods() -> dict[str, Any]:
            """Server pod name -> its local process (LocalPod), for the live pods of the service."""
            return {
                p.name: p
                for p in list(pods.pods.values())
                if p.namespace == namespace and p.kind == "server" and p.terminating_since is None
            }

        def adapters_ready(loaded: int, names: list[str]) -> bool:
            status = (env.get("inferenceservice", NAME) or {}).get("status") or {}
            condition = env.condition(NAME, "AdaptersReady") or {}
            entries = {a["name"]: a for a in status.get("loraAdapters") or []}
            return (
                condition.get("status") == "True"
                and set(entries) == set(names)
                and all(e["loadedReplicas"] == loaded == e["readyReplicas"] for e in entries.values())
            )

        # 1. One replica serves all three adapters, each answering as peft's merged model does.
        env.apply(manifest(paths, list(ADAPTERS), replicas=1))
        url = pods.wait_url(namespace, NAME, timeout=SERVER_START_TIMEOUT)
        env.wait_ready(NAME, replicas=1, timeout=SERVER_START_TIMEOUT)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2)
        assert {m.id for m in client.models.list().data} == {"smollm2-135m", *ADAPTERS}
        for name, answer in answers.items():
            out = client.completions.create(
                model=name,
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert out.choices[0].text == answer, name
        env.eventually(lambda: adapters_ready(1, list(ADAPTERS)), "AdaptersReady on one replica", timeout=60)
        config_map = env.get("configmap", f"{NAME}-lora-adapters")
        assert config_map is not None and "support" in config_map["data"]["adapters.json"]

        # 2. Three replicas: each new pod serves all three adapters as soon as it is Ready.
        env.kubectl("patch", "inferenceservice", NAME, "--type=merge", "-p", '{"spec": {"replicas": 3}}')
        checked: set[str] = set()
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while len(checked) < 3:
            assert time.monotonic() < deadline, f"pods Ready and checked: {sorted(checked)}"
            for name, pod in server_pods().items():
                if pod.ready and name not in checked:
                    assert served(pod.port) == set(ADAPTERS), name
                    checked.add(name)
            time.sleep(0.2)
        env.wait_ready(NAME, replicas=3, timeout=SERVER_START_TIMEOUT)
        env.eventually(
            lambda: adapters_ready(3, list(ADAPTERS)), "AdaptersReady on three replicas", timeout=90
        )

        # 3. Removing one from the spec unloads it from every pod, none restarted.
        pids = pods.pids()
        env.apply(manifest(paths, ["sql", "chat-de"], replicas=3))
        env.eventually(
            lambda: all(served(p.port) == {"sql", "chat-de"} for p in server_pods().values()),
            "support unloaded everywhere",
            timeout=60,
        )
        env.eventually(lambda: adapters_ready(3, ["sql", "chat-de"]), "AdaptersReady with two", timeout=90)
        assert pods.pids() == pids, "a pod was restarted"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="support", prompt=PROMPT, max_tokens=2)

        # 4. An adapter that cannot load: a condition and a Warning Event naming why; the rest serve.
        env.apply(manifest(paths, ["sql", "chat-de", "too-wide"], replicas=3))

        def failed_everywhere() -> dict[str, Any] | None:
            condition = env.condition(NAME, "AdaptersReady") or {}
            everywhere = "too-wide failed on 3 of 3 Ready replicas" in condition.get("message", "")
            return condition if condition.get("reason") == "AdapterLoadFailed" and everywhere else None

        condition = env.eventually(failed_everywhere, "AdapterLoadFailed on every replica", timeout=90)
        assert condition["status"] == "False"
        assert "rank 32 exceeds --max-lora-rank 16" in condition["message"], condition
        entry = next(
            a for a in env.get("inferenceservice", NAME)["status"]["loraAdapters"] if a["name"] == "too-wide"
        )
        assert entry["loadedReplicas"] == 0 and "rank 32" in entry["lastError"]
        assert any(e["reason"] == "AdapterLoadFailed" and e["type"] == "Warning" for e in env.events(NAME))
        out = client.completions.create(
            model="sql", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == answers["sql"]
        assert pods.pids() == pids, "a pod was restarted"
