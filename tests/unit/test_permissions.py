"""The operator's permissions (operator/permissions.py): the checks it makes at start for each scope,
the message it exits with, and the chart's ClusterRole generated from the same list."""

from __future__ import annotations

from conveyor.operator.chart import RBAC_PATH, rbac_with_rules
from conveyor.operator.permissions import RULES, Check, missing_message, peering_crd, required_checks


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
        if not (rule.peering and not rule.cluster_scoped) and not rule.patterns
        for group in rule.api_groups
        for resource in rule.resources
        for verb in rule.verbs
    }
    assert {(c.verb, c.group, c.resource) for c in checks} == expected
    assert len(checks) == len(expected)
    assert all(c.namespace == "" for c in checks)
    assert Check("watch", "kopf.dev", "clusterkopfpeerings") in checks


def test_a_pattern_needs_its_namespaced_permissions_in_every_namespace() -> None:
    """A glob matches namespaces created later too: what it needs is asked cluster-wide, and kopf's
    watch of namespaces is needed (not for named namespaces)."""
    checks = required_checks(["team-*", "llm"], peering=True)
    assert {c.namespace for c in checks if c.resource == "deployments"} == {"", "llm"}
    assert Check("watch", "", "namespaces") in checks
    assert Check("patch", "kopf.dev", "kopfpeerings", "") in checks
    assert not any(c.resource == "clusterkopfpeerings" for c in checks)
    assert not any(c.resource == "namespaces" for c in required_checks(["llm"], peering=True))
    assert not any(c.resource == "namespaces" for c in required_checks([], peering=True))
    assert peering_crd([]) == "clusterkopfpeerings.kopf.dev"
    assert peering_crd(["llm"]) == "kopfpeerings.kopf.dev"


def test_the_exit_message_names_each_missing_verb_and_resource_and_the_fix() -> None:
    message = missing_message(
        [
            Check("watch", "serving.conveyor.dev", "inferenceservices", "llm"),
            Check("list", "", "nodes"),
            Check("patch", "serving.conveyor.dev", "inferenceservices/status", ""),
        ],
        "system:serviceaccount:ops:conveyor",
    )
    lines = message.splitlines()
    assert lines[0] == (
        "the operator's identity (system:serviceaccount:ops:conveyor) lacks 3 permission(s) it needs:"
    )
    assert lines[1] == "  - list nodes"
    assert lines[2] == "  - patch inferenceservices.serving.conveyor.dev/status in every namespace"
    assert lines[3] == "  - watch inferenceservices.serving.conveyor.dev in namespace llm"
    assert "rbac.create=true" in lines[4]
