"""The operator's permissions (operator/permissions.py): the checks it makes at start for each scope,
the message it exits with, and the chart's ClusterRole generated from the same list."""

from __future__ import annotations

from conveyor.operator.chart import RBAC_PATH, rbac_with_rules
from conveyor.operator.permissions import RULES, Check, missing_message, required_checks


def test_chart_cluster_role_rules_are_generated_from_the_list() -> None:
    template = RBAC_PATH.read_text()
    assert rbac_with_rules(template) == template, "stale: run `make generate`"


def test_a_namespaced_operator_checks_its_namespaces_and_the_cluster_scoped_resources() -> None:
    checks = required_checks(["llm", "team-a"], peering=False)
    assert Check("watch", "serving.conveyor.dev", "inferenceservices", "llm") in checks
    assert Check("watch", "serving.conveyor.dev", "inferenceservices", "team-a") in checks
    assert Check("patch", "serving.conveyor.dev", "inferenceservices/status", "llm") in checks
    assert Check("patch", "apps", "deployments/scale", "team-a") in checks
    assert Check("create", "events.k8s.io", "events", "llm") in checks
    # Cluster-scoped resources are asked about once, without a namespace.
    assert Check("list", "", "nodes") in checks
    assert Check("watch", "apiextensions.k8s.io", "customresourcedefinitions") in checks
    assert not any(c.resource == "nodes" and c.namespace for c in checks)
    # Standalone: no peering object is read.
    assert not any(c.group == "kopf.dev" for c in checks)
    # Nothing is asked cluster-wide for a namespaced resource.
    assert not any(c.resource == "deployments" and not c.namespace for c in checks)


def test_every_rule_verb_is_checked_once_cluster_wide() -> None:
    checks = required_checks([], peering=True)
    expected = {
        (verb, group, resource)
        for rule in RULES
        if not (rule.peering and not rule.cluster_scoped)
        for group in rule.api_groups
        for resource in rule.resources
        for verb in rule.verbs
    }
    assert {(c.verb, c.group, c.resource) for c in checks} == expected
    assert len(checks) == len(expected)
    assert all(c.namespace == "" for c in checks)
    assert Check("watch", "kopf.dev", "clusterkopfpeerings") in checks


def test_patterns_are_checked_in_the_namespaces_they_match_now() -> None:
    checks = required_checks(["team-*"], peering=True, existing_namespaces=["team-a", "team-b", "prod"])
    namespaces = {c.namespace for c in checks if c.resource == "deployments"}
    assert namespaces == {"team-a", "team-b"}
    assert Check("patch", "kopf.dev", "kopfpeerings", "team-b") in checks
    assert not any(c.resource == "clusterkopfpeerings" for c in checks)


def test_the_exit_message_names_each_missing_verb_and_resource_and_the_fix() -> None:
    message = missing_message(
        [
            Check("watch", "serving.conveyor.dev", "inferenceservices", "llm"),
            Check("list", "", "nodes"),
        ],
        "system:serviceaccount:ops:conveyor",
    )
    lines = message.splitlines()
    assert lines[0] == (
        "the operator's identity (system:serviceaccount:ops:conveyor) lacks 2 permission(s) it needs:"
    )
    assert lines[1] == "  - list nodes"
    assert lines[2] == "  - watch inferenceservices.serving.conveyor.dev in namespace llm"
    assert "rbac.create=true" in lines[3]
