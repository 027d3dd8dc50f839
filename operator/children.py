"""One InferenceService's children on the cluster: the rendered objects applied all or none, and those
it no longer renders deleted (never someone else's). Every write is recorded as an Event in `events`,
in order, for the handler to post."""

from __future__ import annotations

from typing import Any

from conveyor.operator.cluster import (
    HPA,
    INFERENCE_POOL,
    NETWORK_POLICY,
    SCALED_OBJECT,
    SERVICE_MONITOR,
    ApplyError,
    ClusterAPI,
    configuration,
)
from conveyor.operator.events import Event, Write, written
from conveyor.operator.render import Owner, lora_config_map_name, router_name

CONFIG_MAP = ("v1", "ConfigMap")
# The router's objects, in deletion order: the ServiceAccount, applied first, is deleted last, so
# while it exists the others may, and once it is gone none is left (one read when the router is off).
_ROUTER_SERVICE_ACCOUNT = ("v1", "ServiceAccount")
_ROUTER_APIS = [
    SERVICE_MONITOR,
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    _ROUTER_SERVICE_ACCOUNT,
]


class Children:
    """The children of `owner`, written through `cluster`; `events` holds one Event per write."""

    def __init__(self, cluster: ClusterAPI, owner: Owner) -> None:
        self.cluster = cluster
        self.owner = owner
        self.events: list[Event] = []

    def apply(self, objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any] | None]:
        """Apply the rendered children, all or none: each is first applied as a dry run (validated and
        defaulted by the API server) and nothing is written unless all pass; then only those whose
        configuration would change are applied, and only those get a "created"/"updated" Event (a
        status write by a controller is not an update). Returns each object as stored, by (kind, name).
        Raises ApplyError naming the first object refused, or (409) one whose name an object controlled
        by someone else already has.

        One exception to "none": a new Role is created during the checks. RBAC's escalation check of a
        RoleBinding reads the Role it names, which a dry run of the Role does not store, so the
        RoleBinding's dry run would be refused; a Role alone grants nothing until it is bound."""
        cluster = self.cluster
        found = []
        for obj in objects:
            meta = obj["metadata"]
            live = cluster.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
            other = next(
                (
                    ref
                    for ref in (live or {}).get("metadata", {}).get("ownerReferences") or []
                    if ref.get("controller") and ref.get("uid") != self.owner.uid
                ),
                None,
            )
            if other is not None:
                raise ApplyError(
                    obj["kind"],
                    meta["name"],
                    409,
                    f"{meta['namespace']}/{meta['name']} already exists, controlled by {other.get('kind')} "
                    f"{other.get('name')}: rename one of them",
                )
            found.append((obj, live))
        checked = []
        for obj, live in found:
            if obj["kind"] == "Role" and live is None:
                stored = cluster.apply(obj)
                self._written("created", obj)
                checked.append((obj, stored, stored))
            else:
                checked.append((obj, live, cluster.apply(obj, dry_run=True)))
        stored_objects: dict[tuple[str, str], dict[str, Any] | None] = {}
        for obj, live, would_be in checked:
            stored = live
            meta = obj["metadata"]
            container, foreign_env, foreign_env_from = (
                _foreign_env(obj, would_be) if obj["kind"] == "Deployment" else ("", [], False)
            )
            foreign = foreign_env or foreign_env_from
            if live is None or configuration(live) != configuration(would_be) or foreign:
                stored = cluster.apply(obj)
                note = ""
                if foreign:
                    cluster.remove_env(
                        meta["namespace"], meta["name"], container, foreign_env, foreign_env_from
                    )
                    stored = cluster.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
                    removed = [f"env {', '.join(foreign_env)}"] if foreign_env else []
                    removed += ["envFrom"] if foreign_env_from else []
                    note = f" (removed {' and '.join(removed)}: not in the spec)"
                # Only a write that changed something is an update (the live object may have moved on
                # between the read and the dry run, e.g. a controller's status write).
                if live is None or foreign or configuration(live) != configuration(stored or {}):
                    self._written("created" if live is None else "updated", obj, note)
            stored_objects[(obj["kind"], meta["name"])] = stored
        return stored_objects

    def prune(self, rendered: list[dict[str, Any]], *, router_enabled: bool) -> None:
        """Delete what the owner rendered before and `rendered` no longer holds: an HPA or ScaledObject
        its autoscaling engine no longer uses, its NetworkPolicy once the operator renders none, the
        adapters' ConfigMap once `model.lora` is gone, and
        the router's objects once `router.enabled` is false."""
        apis = {(o["apiVersion"], o["kind"]) for o in rendered}
        for api in (HPA, SCALED_OBJECT, NETWORK_POLICY):
            if api in apis or (api == SCALED_OBJECT and not self.cluster.has_api(*api)):
                continue
            self._delete_owned(api, self.owner.name)
        if CONFIG_MAP not in apis:
            self._delete_owned(CONFIG_MAP, lora_config_map_name(self.owner.name))
        if not router_enabled:
            self._delete_router()

    def _written(self, action: Write, obj: dict[str, Any], note: str = "") -> None:
        meta = obj["metadata"]
        self.events.append(written(action, obj["kind"], meta["namespace"], meta["name"], note))

    def _owned(self, obj: dict[str, Any] | None) -> bool:
        return any(
            ref.get("uid") == self.owner.uid
            for ref in (obj or {}).get("metadata", {}).get("ownerReferences") or []
        )

    def _delete_owned(self, api: tuple[str, str], name: str) -> None:
        """Delete one object if the owner owns it."""
        namespace = self.owner.namespace
        if self._owned(self.cluster.get(*api, namespace, name)):
            self.cluster.delete(*api, namespace, name)
            self.events.append(written("deleted", api[1], namespace, name))

    def _delete_router(self) -> None:
        """Delete what `router.enabled` rendered (and the InferencePool that came with it)."""
        owner = self.owner
        if not self._owned(
            self.cluster.get(*_ROUTER_SERVICE_ACCOUNT, owner.namespace, router_name(owner.name))
        ):
            return
        if self.cluster.has_api(*INFERENCE_POOL):
            self._delete_owned(INFERENCE_POOL, owner.name)
        for api in _ROUTER_APIS:
            if api != SERVICE_MONITOR or self.cluster.has_api(*api):
                self._delete_owned(api, router_name(owner.name))


def _foreign_env(rendered: dict[str, Any], would_be: dict[str, Any]) -> tuple[str, list[str], bool]:
    """(container, its environment variables, whether an envFrom list) that someone else added to
    the rendered Deployment's container (the server's or the router's) with `kubectl set env` or a
    patch: server-side apply keeps them, so drift correction removes them explicitly. An envFrom
    the spec renders is ours and replaced whole by the apply."""
    name = rendered["spec"]["template"]["spec"]["containers"][0]["name"]

    def container(obj: dict[str, Any]) -> dict[str, Any]:
        containers = obj["spec"]["template"]["spec"].get("containers") or []
        return next((c for c in containers if c["name"] == name), {})

    ours, theirs = container(rendered), container(would_be)
    names = {e["name"] for e in ours.get("env") or []}
    env = [e["name"] for e in theirs.get("env") or [] if e["name"] not in names]
    return name, env, bool(theirs.get("envFrom")) and not ours.get("envFrom")
