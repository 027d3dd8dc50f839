"""The InferenceService spec model and the CRD generated from it (no cluster)."""

from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from pydantic import ValidationError
from pydantic.alias_generators import to_camel

from conveyor.operator import crd
from conveyor.operator.spec import DEFAULT_IMAGE, EngineSpec, InferenceServiceSpec, parse_spec

REPO = Path(__file__).resolve().parents[2]
CRD_PATHS = [REPO / "crds" / crd.CRD_FILENAME, REPO / "charts" / "conveyor" / "crds" / crd.CRD_FILENAME]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

MINIMAL = {"model": {"name": "llama-3-8b", "maxModelLen": 4096}, "resources": {"gpuType": "a100-80gb"}}


def _schema() -> dict[str, Any]:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every schema node below `node`, with a dotted path."""
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found.append((path, node))
        for name, prop in node.get("properties", {}).items():
            found += _walk(prop, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            found += _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            found += _walk(node["additionalProperties"], f"{path}{{}}")
    return found


def test_minimal_spec_gets_defaults() -> None:
    spec = parse_spec(MINIMAL)
    assert spec.model.dtype == "auto"
    assert spec.resources.gpus_per_replica == 1
    assert spec.tensor_parallel_size == 1
    assert spec.engine.gpu_memory_utilization == 0.9
    assert spec.engine.block_size == 16
    assert spec.engine.enable_chunked_prefill and spec.engine.enable_prefix_caching
    assert spec.image == DEFAULT_IMAGE
    assert spec.desired_replicas == 1


def test_camel_case_aliases_round_trip() -> None:
    raw = {
        "model": {"name": "m", "maxModelLen": 2048, "kvHeads": 2, "headDim": 64},
        "resources": {"gpuType": "h100-80gb", "gpusPerReplica": 4, "tensorParallelSize": 2},
        "engine": {"maxNumBatchedTokens": 8192, "enablePrefixCaching": False, "extraArgs": ["--seed", "1"]},
        "autoscaling": {"minReplicas": 2, "maxReplicas": 5, "targetTTFTSeconds": 0.5},
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        "serviceAccountName": "llm",
    }
    spec = parse_spec(raw)
    assert spec.model.kv_heads == 2
    assert spec.tensor_parallel_size == 2
    assert spec.autoscaling is not None and spec.autoscaling.target_ttft_seconds == 0.5
    assert spec.desired_replicas == 2
    dumped = spec.model_dump(by_alias=True, exclude_none=True)
    assert dumped["autoscaling"]["targetTTFTSeconds"] == 0.5
    assert dumped["resources"]["gpusPerReplica"] == 4
    assert InferenceServiceSpec.model_validate(dumped) == spec


@pytest.mark.parametrize(
    "bad",
    [
        {"model": {"name": "m"}, "resources": {"gpuType": "l4"}},  # maxModelLen is required
        {**MINIMAL, "engine": {"gpuMemoryUtilization": 1.5}},
        {**MINIMAL, "engine": {"blockSize": 12}},
        {**MINIMAL, "model": {"name": "m", "maxModelLen": 4096, "dtype": "int3"}},
        {**MINIMAL, "model": {"name": "m", "maxModelLen": 4096, "uri": "s3://bucket/model"}},
        {**MINIMAL, "router": {"enabled": True, "policy": "random"}},
        {**MINIMAL, "router": {"enabled": True, "replicas": 0}},
        {**MINIMAL, "router": {"enabled": True, "weights": {"prefix": -1}}},
        {**MINIMAL, "router": {"enabled": True, "queueTimeoutSeconds": 0}},
    ],
)
def test_invalid_specs_are_rejected(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        parse_spec(bad)


def test_checked_in_crd_is_current() -> None:
    """Regenerate with `conveyor crd -o crds/... -o charts/conveyor/crds/...` when this fails."""
    expected = crd.render_crd_yaml()
    for path in CRD_PATHS:
        assert path.read_text() == expected, f"{path.relative_to(REPO)} is stale"


def test_crd_schema_is_structural() -> None:
    nodes = _walk(_schema())
    assert len(nodes) > 40
    for path, node in nodes:
        assert "type" in node, f"{path} has no type"
        for forbidden in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "title", "const"):
            assert forbidden not in node, f"{path} has {forbidden}"
        for keyword in ("exclusiveMinimum", "exclusiveMaximum"):
            # OpenAPI v3.0: a boolean beside minimum/maximum, not JSON Schema 2020-12's number.
            assert node.get(keyword, True) is True, f"{path}.{keyword} is not boolean"
        assert node.get("default", 0) is not None, f"{path} defaults to null"
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is None, (
                f"{path} mixes properties and additionalProperties"
            )


def test_crd_schema_defaults_enums_and_required() -> None:
    spec = _schema()["properties"]["spec"]
    props = spec["properties"]
    assert spec["required"] == ["model", "resources"]
    assert props["engine"]["default"] == {}
    assert props["engine"]["properties"]["gpuMemoryUtilization"] == {
        "default": 0.9,
        "description": "Fraction of GPU memory the server may use.",
        "exclusiveMinimum": True,
        "maximum": 1,
        "minimum": 0,
        "type": "number",
    }
    assert props["model"]["properties"]["dtype"]["enum"] == ["auto", "float16", "bfloat16", "float32"]
    assert props["model"]["required"] == ["name", "maxModelLen"]
    assert "targetTTFTSeconds" in props["autoscaling"]["properties"]
    assert "default" not in props["replicas"], "a default would collide with autoscaling's CEL rule"


def test_crd_cel_rules() -> None:
    spec = _schema()["properties"]["spec"]
    rules = {
        "spec": spec["x-kubernetes-validations"],
        "resources": spec["properties"]["resources"]["x-kubernetes-validations"],
        "autoscaling": spec["properties"]["autoscaling"]["x-kubernetes-validations"],
    }
    assert rules["spec"] == [
        {
            "message": "set either replicas or autoscaling, not both (an autoscaled InferenceService is "
            "not scaled by hand: change autoscaling.minReplicas and maxReplicas instead)",
            "rule": "!(has(self.replicas) && has(self.autoscaling))",
        }
    ]
    assert "self.gpusPerReplica % self.tensorParallelSize == 0" in rules["resources"][0]["rule"]
    assert rules["autoscaling"][0]["rule"] == "self.minReplicas <= self.maxReplicas"


def test_crd_names_subresources_and_columns() -> None:
    doc = crd.build_crd()
    assert doc["metadata"]["name"] == "inferenceservices.serving.conveyor.dev"
    assert doc["spec"]["names"]["shortNames"] == ["cisvc"]
    version = doc["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert version["subresources"]["status"] == {}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == [
        "Model",
        "GPU",
        "TP",
        "Ready",
        "Reason",
        "Replicas",
        "Available",
        "Desired",
        "Scaling",
        "MaxSeqs",
        "URL",
        "Age",
    ]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(status["capacity"]["properties"]) == {
        "tensorParallelSize",
        "kvBytesPerToken",
        "kvPoolBytes",
        "numKvBlocks",
        "maxNumSeqs",
        "maxConcurrencyAtMaxModelLen",
    }
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]


def test_crd_command_prints_and_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert crd.main([]) == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["kind"] == "CustomResourceDefinition"
    target = tmp_path / "out" / "crd.yaml"
    assert crd.main(["--output", str(target)]) == 0
    assert target.read_text() == printed


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_parse_and_plan(path: Path) -> None:
    from conveyor.operator.plan import plan_for_spec

    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "serving.conveyor.dev/v1alpha1"
    assert doc["kind"] == "InferenceService"
    plan = plan_for_spec(parse_spec(doc["spec"]))
    assert plan.max_num_seqs >= 1


def test_there_are_five_examples() -> None:
    assert [p.name for p in EXAMPLES] == [
        "llama-3-70b-4xa100.yaml",
        "llama-3-8b-a100.yaml",
        "smollm2-135m-autoscaling.yaml",
        "smollm2-135m-l4.yaml",
        "smollm2-135m-lora.yaml",
    ]


@pytest.mark.parametrize(
    ("field", "server_field"),
    [
        ("max_num_seqs", "scheduler.max_num_seqs"),
        ("max_num_batched_tokens", "scheduler.max_num_batched_tokens"),
        ("gpu_memory_utilization", "cache.gpu_memory_utilization"),
        ("block_size", "cache.block_size"),
        ("enable_chunked_prefill", "scheduler.enable_chunked_prefill"),
        ("enable_prefix_caching", "cache.enable_prefix_caching"),
    ],
)
def test_engine_spec_takes_the_servers_bounds_and_defaults(field: str, server_field: str) -> None:
    """The CRD accepts no engine value `conveyor serve` refuses, and defaults to the server's."""
    from conveyor.server.config import EngineConfig

    group, name = server_field.split(".")
    server_model = type(getattr(EngineConfig(), group))
    ours = EngineSpec.model_json_schema()["properties"][to_camel(field)]
    theirs = server_model.model_json_schema()["properties"][name]
    for bound in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if "enum" not in ours else ():
        bounded = [s.get(bound) for s in (theirs, *theirs.get("anyOf", [])) if bound in s]
        mine = [s.get(bound) for s in (ours, *ours.get("anyOf", [])) if bound in s]
        assert mine == bounded, f"{field}: {bound} {mine} vs the server's {bounded}"
    if EngineSpec.model_fields[field].default is not None:
        assert EngineSpec.model_fields[field].default == server_model.model_fields[name].default
    for value in get_args(EngineSpec.model_fields[field].annotation):  # blockSize: 8, 16, 32
        if isinstance(value, int) and not isinstance(value, bool):
            server_model(**{name: value})


def test_conveyor_cli_routes_crd_and_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.server.cli import main

    assert main(["crd"]) == 0
    assert capsys.readouterr().out == crd.render_crd_yaml()
    assert main(["plan", "--model", "llama-3-8b", "--gpu", "a100-80gb", "--max-model-len", "8192"]) == 0
    assert "max_num_seqs        56" in capsys.readouterr().out
    with pytest.raises(SystemExit) as excinfo:
        main(["operator", "--help"])
    assert excinfo.value.code == 0
    assert "--all-namespaces" in capsys.readouterr().out


def test_router_is_off_unless_enabled_and_has_the_routers_defaults() -> None:
    assert parse_spec(MINIMAL).router is None and not parse_spec(MINIMAL).router_enabled
    assert not parse_spec({**MINIMAL, "router": {}}).router_enabled
    spec = parse_spec({**MINIMAL, "router": {"enabled": True}})
    router = spec.router
    assert spec.router_enabled and router is not None
    assert (router.replicas, router.policy, router.queue_timeout_seconds) == (1, "prefix-aware", 60)
    assert (router.weights.queue, router.weights.kv, router.weights.prefix) == (1.0, 1.0, 2.0)
    raw = {
        "enabled": True,
        "replicas": 2,
        "policy": "round-robin",
        "queueTimeoutSeconds": 5,
        "weights": {"kv": 0},
    }
    dumped = parse_spec({**MINIMAL, "router": raw}).model_dump(by_alias=True, exclude_none=True)["router"]
    assert dumped == {**raw, "weights": {"queue": 1.0, "kv": 0.0, "prefix": 2.0, "lora": 1.0}}


def test_crd_router_schema_and_name_rule() -> None:
    schema = _schema()
    router = schema["properties"]["spec"]["properties"]["router"]
    assert "default" not in router, "an unset router stays absent from stored objects"
    props = router["properties"]
    assert list(props) == ["enabled", "replicas", "policy", "weights", "queueTimeoutSeconds"]
    assert props["enabled"]["default"] is False
    assert props["policy"]["enum"] == ["prefix-aware", "least-load", "round-robin"]
    assert (props["replicas"]["minimum"], props["queueTimeoutSeconds"]["minimum"]) == (1, 1)
    assert {k: v["default"] for k, v in props["weights"]["properties"].items()} == {
        "queue": 1.0,
        "kv": 1.0,
        "prefix": 2.0,
        "lora": 1.0,
    }
    # <name>-router names a Service (a DNS-1035 label of at most 63 characters).
    (rule,) = [r for r in schema["x-kubernetes-validations"] if "router" in r["rule"]]
    assert rule["rule"].endswith("size(self.metadata.name) <= 56")
