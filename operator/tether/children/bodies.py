"""What a spawn makes: the parent a child names and the child's WorkerRun, built alike by a pod's
worker (tether.worker.spawning) and by the gateway for an External one (tether.gateway.children);
the TypeScript and Go SDKs pass the same vectors (sdk/vectors/children.json)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tether.api.models import API_VERSION
from tether.api.workerclass import effective_body
from tether.children.api import ANN_CHILD_KEY, ANN_SPAWN_DIGEST, LABEL_PARENT, child_name, spawn_digest

# A child rejected as a stale attempt's moves its key on, at most this often (each is a lost parent).
MAX_GENERATIONS = 16


@dataclass(frozen=True)
class Parent:
    """What a child's spec says of the run that spawns it, read once from the parent itself."""

    name: str
    uid: str
    class_name: str | None
    depth: int
    budget_ref: str | None
    capped_cents: bool
    capped_tokens: bool

    @staticmethod
    def of(run: Mapping[str, Any]) -> "Parent":
        """From the run as served, with what it took from its class applied (its caps and budget)."""
        run = effective_body(dict(run))
        meta, spec, status = run["metadata"], run.get("spec") or {}, run.get("status") or {}
        budget = spec.get("budget") or {}
        taken = (status.get("class") or {}).get("name")
        ref = spec.get("parentRef") or {}
        return Parent(name=meta["name"], uid=meta["uid"], class_name=taken, depth=int(ref.get("depth") or 0),
                      budget_ref=(budget.get("budgetRef") or {}).get("name"),
                      capped_cents=budget.get("capCents") is not None, capped_tokens=budget.get("maxTokens") is not None)

    @staticmethod
    def by_name(name: str, uid: str) -> "Parent":
        """All an External worker knows of its run (it cannot read it): the gateway, which can,
        builds the child's parentRef and its budget's parent part (with_parent) itself."""
        return Parent(name=name, uid=uid, class_name=None, depth=0, budget_ref=None, capped_cents=False,
                      capped_tokens=False)


def child_spec(parent: Parent, class_name: str | None, payload: Mapping[str, Any] | None, cap_cents: int | None,
               max_tokens: int | None, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The child's spec as the caller asked for it (the digest's input: it has no parentRef, which
    names the attempt and changes when a resumed attempt re-attaches)."""
    spec: dict[str, Any] = {"executor": "Pod", **dict(extra or {})}
    if class_name is not None:
        spec["className"] = class_name
    if payload is not None:
        spec["payload"] = dict(payload)
    budget = dict(spec.get("budget") or {})
    if cap_cents is not None:
        budget["capCents"] = cap_cents
    if max_tokens is not None:
        budget["maxTokens"] = max_tokens
    if budget:
        spec["budget"] = budget
    return with_parent(parent, spec)


def with_parent(parent: Parent, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The parent's part of a child's spec: its WorkerBudget unless the child names one, and a share
    of each cap the parent has (ValueError when the child names none)."""
    out, budget = dict(spec), dict(spec.get("budget") or {})
    if parent.budget_ref is not None:
        budget.setdefault("budgetRef", {"name": parent.budget_ref})
    if parent.capped_cents and "capCents" not in budget:
        raise ValueError(f"run {parent.name} has a cap in cents: a child names its share of it (cap_cents)")
    if parent.capped_tokens and "maxTokens" not in budget:
        raise ValueError(f"run {parent.name} has a token cap: a child names its share of it (max_tokens)")
    if budget:
        out["budget"] = budget
    return out


def child_body(parent: Parent, namespace: str, holder: str, fence: int, key: str, generation: int,
               spec: dict[str, Any], digest: str | None = None) -> dict[str, Any]:
    """The child WorkerRun; `digest` of what was asked (default: of `spec`; the gateway's is of the
    spec its worker sent, before with_parent, which the worker can compute)."""
    ref: dict[str, Any] = {"name": parent.name, "uid": parent.uid, "holder": holder, "fence": fence,
                           "depth": parent.depth + 1}
    if parent.class_name is not None:
        ref["className"] = parent.class_name
    return {"apiVersion": API_VERSION, "kind": "WorkerRun",
            "metadata": {"name": child_name(parent.name, parent.uid, key, generation), "namespace": namespace,
                         "labels": {LABEL_PARENT: parent.name},
                         "annotations": {ANN_CHILD_KEY: key, ANN_SPAWN_DIGEST: digest or spawn_digest(spec)},
                         "ownerReferences": [{"apiVersion": API_VERSION, "kind": "WorkerRun", "name": parent.name,
                                              "uid": parent.uid, "controller": True}]},
            "spec": {**spec, "parentRef": ref}}
