"""The Helm chart's values (charts/conveyor/values.yaml) as pydantic models, and the chart's generated files.

`ChartValues` is the one description of every value: its type, bounds and meaning. `make generate`
(`python -m conveyor.operator.chart`) writes from it `charts/conveyor/values.schema.json` (Helm validates
`helm install/upgrade/lint/template` values against it, so a wrong type fails with the value's path), and
from operator/permissions.py the ClusterRole's rules in `templates/rbac.yaml`; the docs' Helm values page
is generated from `values_table` (hack/docs_reference.py). Tests fail when any of them is stale or when
values.yaml does not validate.

The PrometheusRule's latency objectives must be bucket bounds of the server's histograms (a burn rate
reads the `le` bucket at the objective), so their allowed values are the server's buckets as Prometheus
labels them; that is why this module imports the server's metrics module (run it with conveyor[server]).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema
from pydantic.alias_generators import to_camel

from conveyor.operator.permissions import RULES_BEGIN, RULES_END, chart_rules
from conveyor.operator.spec import DNS1123_SUBDOMAIN, LABEL_KEY, LABEL_VALUE
from conveyor.server.api.metrics import ITL_BUCKETS, LATENCY_BUCKETS

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "conveyor"
SCHEMA_PATH = CHART / "values.schema.json"
RBAC_PATH = CHART / "templates" / "rbac.yaml"

# Objectives a burn-rate alert can read: the bucket bounds of the TTFT and TPOT histograms. The
# PrometheusRule template writes them as Prometheus' client labels them (`le="1.0"`), which
# test_chart_values.py checks against prometheus_client's own formatting.
# `helm --set x=0.5` passes a string, `-f values.yaml` a number: both are accepted.
TTFT_OBJECTIVES = tuple(float(b) for b in LATENCY_BUCKETS)
TPOT_OBJECTIVES = tuple(float(b) for b in ITL_BUCKETS)


def _spellings(bounds: tuple[float, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(text for b in bounds for text in (f"{b:g}", repr(b))))


TtftObjective = Literal[TTFT_OBJECTIVES] | Literal[_spellings(TTFT_OBJECTIVES)]  # type: ignore[valid-type]
TpotObjective = Literal[TPOT_OBJECTIVES] | Literal[_spellings(TPOT_OBJECTIVES)]  # type: ignore[valid-type]

Port = Annotated[int, Field(ge=1, le=65535)]
# Label keys and values as Kubernetes validates them (the operator's own rules, operator/spec.py).
LabelMap = Annotated[
    dict[
        Annotated[str, StringConstraints(pattern=LABEL_KEY, max_length=317)],
        Annotated[str, StringConstraints(pattern=LABEL_VALUE)],
    ],
    WithJsonSchema(
        {
            "type": "object",
            "propertyNames": {"pattern": LABEL_KEY, "maxLength": 317},
            "additionalProperties": {"type": "string", "pattern": LABEL_VALUE},
        }
    ),
]
OptionalName = Annotated[str, StringConstraints(pattern=f"^$|{DNS1123_SUBDOMAIN}", max_length=253)]
# KEDA's authModes: one or more of these, comma-separated (the operator's --keda-auth-modes).
AUTH_MODES = r"^((bearer|basic|tls|custom)(,(bearer|basic|tls|custom))*)?$"
Duration = Annotated[str, StringConstraints(pattern=r"^([0-9]+(ms|s|m|h|d|w|y))+$")]
# A Kubernetes object given as-is (affinity, a security context, resources): the API server checks it.
KubeObject = dict[str, Any]


class _Values(BaseModel):
    """camelCase keys as values.yaml spells them; an unknown key is an error (a typo must not be ignored)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class ImageValues(_Values):
    repository: str = Field(min_length=1, description="Image repository.")
    tag: str = Field(default="", description="Image tag; empty: the chart's appVersion.")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )


class ServerImageValues(_Values):
    repository: str = Field(
        default="ghcr.io/conveyor-dev/conveyor-server",
        min_length=1,
        description="Server image of InferenceServices that set no `spec.image` (`conveyor operator --server-image`).",
    )
    tag: str = Field(default="", description="Its tag; empty: the chart's appVersion.")


class ServiceAccountValues(_Values):
    create: bool = Field(default=True, description="Create the operator's ServiceAccount.")
    name: OptionalName = Field(
        default="", description="Its name; empty: the release's full name (required when create is false)."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, description="Annotations, e.g. for workload identity."
    )


class RbacValues(_Values):
    create: bool = Field(
        default=True,
        description="Create the ClusterRole and binding with exactly the verbs the operator uses.",
    )


class ServiceMonitorValues(_Values):
    enabled: bool = Field(
        default=False, description="A ServiceMonitor for the operator's metrics (Prometheus Operator)."
    )
    labels: LabelMap = Field(
        default_factory=dict, description="Its extra labels, for a Prometheus' serviceMonitorSelector."
    )
    interval: Duration = Field(default="30s", description="Scrape interval.")


class MetricsValues(_Values):
    port: int = Field(
        default=8081,
        ge=0,
        le=65535,
        description="Port of the operator's /metrics (autoscaling decisions, query errors); 0 turns them off.",
    )
    service_monitor: ServiceMonitorValues = Field(default_factory=ServiceMonitorValues)


class AutoscalerValues(_Values):
    prometheus_url: str = Field(
        default="",
        pattern=r"^(https?://.+)?$",
        description="Prometheus the builtin autoscaler queries and KEDA's triggers point at; empty: autoscaled "
        "InferenceServices hold their replicas with MetricsAvailable=False.",
    )
    interval_seconds: float = Field(
        default=15, gt=0, description="Seconds between two autoscaler steps of one resource."
    )


class KedaValues(_Values):
    prometheus_url: str = Field(
        default="",
        pattern=r"^(https?://.+)?$",
        description="The Prometheus KEDA's triggers query (`autoscaling.engine: keda`); empty: autoscaler.prometheusUrl.",
    )
    authentication: str = Field(
        default="",
        pattern=r"^(((TriggerAuthentication|ClusterTriggerAuthentication)/)?[a-z0-9]([-.a-z0-9]*[a-z0-9])?)?$",
        description="[ClusterTriggerAuthentication/]NAME holding that Prometheus' credentials; empty: none.",
    )
    auth_modes: str = Field(
        default="",
        pattern=AUTH_MODES,
        description="KEDA's authModes for those credentials: bearer, tls,basic ...",
    )
    polling_interval_seconds: int = Field(default=15, ge=1, description="Seconds between KEDA's queries.")


class PrometheusRuleValues(_Values):
    enabled: bool = Field(
        default=False, description="A PrometheusRule with the alerts below (Prometheus Operator)."
    )
    labels: LabelMap = Field(
        default_factory=dict, description="Its extra labels, for a Prometheus' ruleSelector."
    )
    objective: float = Field(
        default=0.99,
        gt=0,
        lt=1,
        description="Share of requests that must meet the TTFT and TPOT objectives; the alerts fire on a "
        "multiwindow burn rate of the rest (Google SRE workbook, ch. 5).",
    )
    ttft_seconds: TtftObjective = Field(
        default=1.0, description="TTFT objective in seconds, a bucket bound of the server's TTFT histogram."
    )
    tpot_seconds: TpotObjective = Field(
        default=0.1, description="TPOT objective in seconds, a bucket bound of the server's TPOT histogram."
    )
    kv_cache_usage: float = Field(
        default=0.95,
        gt=0,
        le=1,
        description="Alert when a server's KV cache stays above this share for 15 min.",
    )
    queue_depth: int = Field(
        default=8,
        ge=1,
        description="Alert when a server's waiting requests stay above this and keep growing.",
    )


class DashboardValues(_Values):
    enabled: bool = Field(
        default=False, description="A ConfigMap holding the Grafana dashboard (dashboards/conveyor.json)."
    )
    labels: LabelMap = Field(
        default_factory=lambda: {"grafana_dashboard": "1"},
        description="Its labels; Grafana's dashboard sidecar (kube-prometheus-stack) loads ConfigMaps labelled so.",
    )
    namespace: OptionalName = Field(
        default="", description="Its namespace (Grafana's); empty: the release's."
    )


class PrometheusAdapterValues(_Values):
    rules_config_map: bool = Field(
        default=False,
        description="A ConfigMap of the Prometheus Adapter rules `autoscaling.engine: hpa` needs "
        "(prometheus-adapter.values.yaml), for the adapter's `rules.existing`.",
    )


class NetworkPolicyValues(_Values):
    enabled: bool = Field(
        default=False,
        description="The operator renders a NetworkPolicy per InferenceService: only its router, pods of its "
        "namespace and the peers below reach the server pods (`conveyor operator --network-policy-from`).",
    )
    from_: list[Annotated[KubeObject, Field(min_length=1)]] = Field(
        default_factory=list,
        alias="from",
        description="Extra NetworkPolicyPeers allowed in, e.g. Prometheus' namespace or an ingress gateway.",
    )


class HelmTestValues(_Values):
    inference_service: str = Field(
        default="",
        pattern=r"^([a-z0-9-]+/[a-z0-9-]+)?$",
        description="NAMESPACE/NAME of an InferenceService that `helm test` sends one chat request to; empty: no test.",
    )


class ChartValues(_Values):
    """Every value of the conveyor chart."""

    model_config = ConfigDict(title="conveyor chart values")

    image: ImageValues = Field(
        default_factory=lambda: ImageValues(repository="ghcr.io/conveyor-dev/conveyor-operator"),
        description="The operator's image (images/operator.Dockerfile).",
    )
    image_pull_secrets: list[KubeObject] = Field(
        default_factory=list, description="Secrets for pulling the operator's image, e.g. [{name: regcred}]."
    )
    server_image: ServerImageValues = Field(default_factory=ServerImageValues)
    watch_namespaces: list[Annotated[str, StringConstraints(pattern=r"^[-a-z0-9*?\[\]]{1,63}$")]] = Field(
        default_factory=list,
        description="Namespaces whose InferenceServices the operator reconciles (glob patterns only with one "
        "replica: peering needs a KopfPeering in each namespace); empty: all.",
    )
    replica_count: int = Field(
        default=1,
        ge=1,
        description="Operator replicas; above 1 they elect one active replica through a kopf peering object the chart creates.",
    )
    peering: str = Field(
        default="",
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        description="Name of that peering object; empty: the release's full name. Set it to peer a single replica too.",
    )
    service_account: ServiceAccountValues = Field(default_factory=ServiceAccountValues)
    rbac: RbacValues = Field(default_factory=RbacValues)
    liveness_port: Port = Field(default=8080, description="kopf's liveness endpoint, probed by the kubelet.")
    metrics: MetricsValues = Field(default_factory=MetricsValues)
    autoscaler: AutoscalerValues = Field(default_factory=AutoscalerValues)
    keda: KedaValues = Field(default_factory=KedaValues)
    service_monitor_labels: LabelMap = Field(
        default_factory=dict,
        description="Extra labels on the ServiceMonitor of every InferenceService, e.g. {release: kube-prometheus-stack}.",
    )
    prometheus_rule: PrometheusRuleValues = Field(default_factory=PrometheusRuleValues)
    dashboard: DashboardValues = Field(default_factory=DashboardValues)
    prometheus_adapter: PrometheusAdapterValues = Field(default_factory=PrometheusAdapterValues)
    network_policy: NetworkPolicyValues = Field(default_factory=NetworkPolicyValues)
    helm_test: HelmTestValues = Field(default_factory=HelmTestValues)
    resources: KubeObject = Field(
        default_factory=lambda: {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"memory": "512Mi"},
        },
        description="The operator container's resources.",
    )
    pod_annotations: dict[str, str] = Field(
        default_factory=dict, description="Extra annotations on the operator's pods."
    )
    pod_labels: LabelMap = Field(default_factory=dict, description="Extra labels on the operator's pods.")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="The operator pods' nodeSelector."
    )
    tolerations: list[KubeObject] = Field(default_factory=list, description="The operator pods' tolerations.")
    affinity: KubeObject = Field(default_factory=dict, description="The operator pods' affinity.")
    priority_class_name: OptionalName = Field(default="", description="The operator pods' priorityClassName.")
    pod_security_context: KubeObject = Field(
        default_factory=lambda: {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        description="The operator pods' securityContext (the image's user is 10001).",
    )
    security_context: KubeObject = Field(
        default_factory=lambda: {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        description="The operator container's securityContext.",
    )
    log_level: Literal["info", "debug"] = Field(default="info", description="Operator log level.")
    global_: KubeObject = Field(
        default_factory=dict, alias="global", description="Helm's values shared with subcharts."
    )


def values_schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) of the chart's values, as Helm reads it from values.schema.json."""
    schema = ChartValues.model_json_schema(by_alias=True, mode="validation")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def schema_text() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"


def _rows(model: type[BaseModel], prefix: str, defaults: Any) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        value = getattr(defaults, name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if field.description:
                rows.append((f"{prefix}{key}", "", field.description))
            rows += _rows(annotation, f"{prefix}{key}.", value)
            continue
        shown = value.model_dump(by_alias=True) if isinstance(value, BaseModel) else value
        rows.append((f"{prefix}{key}", json.dumps(shown), field.description or ""))
    return rows


def values_table() -> str:
    """The values table of the docs' Helm values page: every value with its default and meaning."""
    lines = ["| Value | Default | Meaning |", "|---|---|---|"]
    for key, default, meaning in _rows(ChartValues, "", ChartValues()):
        if key == "global":
            continue
        cell = f"`{default}`" if default else ""
        lines.append(f"| `{key}` | {cell} | {meaning.replace('|', '/')} |")
    return "\n".join(lines)


def rbac_with_rules(template: str) -> str:
    """charts/conveyor/templates/rbac.yaml text with the ClusterRole's rules between their markers
    replaced by those of operator/permissions.py (the list the operator checks at start)."""
    pattern = re.compile(re.escape(RULES_BEGIN) + r".*?" + re.escape(RULES_END), re.S)
    if not pattern.search(template):
        raise ValueError(f"{RBAC_PATH.name} has no {RULES_BEGIN.strip()!r} ... {RULES_END.strip()!r} block")
    return pattern.sub(lambda _: f"{RULES_BEGIN}\n{chart_rules()}\n{RULES_END}", template)


def main(argv: list[str] | None = None) -> int:
    """Regenerate charts/conveyor/values.schema.json and the ClusterRole's rules in
    charts/conveyor/templates/rbac.yaml."""
    parser = argparse.ArgumentParser(prog="python -m conveyor.operator.chart", description=main.__doc__)
    parser.parse_args(argv)
    SCHEMA_PATH.write_text(schema_text())
    RBAC_PATH.write_text(rbac_with_rules(RBAC_PATH.read_text()))
    print(f"wrote {SCHEMA_PATH.relative_to(REPO)} and the rules in {RBAC_PATH.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
