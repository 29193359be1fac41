"""Child runs of External parents (docs/children.md): the gateway creates and reads them in the
name of the attempt its caller drives, as a pod's worker does with its own token. The body is the
gateway's (tether.children.bodies), never the worker's: name, parentRef (the attempt's holder and
fence, the run's class and depth), label, owner reference and digest follow from the run as read.
The operator reads the parent again before the child's first attempt (StaleParent), so an attempt
revoked between the gateway's check and this create still runs nothing."""

from __future__ import annotations

from typing import Any

from tether import protocol
from tether.children.api import is_child_of, spawn_digest
from tether.children.bodies import Parent, child_body, with_parent
from tether.gateway import models as m
from tether.gateway.failure import Failure
from tether.kube.client import ApiError, Conflict, Forbidden, Invalid, KubeClient, NotFound
from tether.kube.paths import run_path

# A child deleted between the create's 409 and the read is made again, this often at most.
TRIES = 3


def _refused(message: str) -> Failure:
    return Failure(422, "SpawnRefused", message)


def _of_parent(child: dict[str, Any], parent: dict[str, Any]) -> bool:
    return is_child_of(child, parent["metadata"]["name"], parent["metadata"]["uid"])


async def spawn(kube: KubeClient, parent: dict[str, Any], ask: m.SpawnRequest) -> dict[str, Any]:
    """The child for `ask.key` (and generation): created now, or the run of that name as it is (the
    worker judges whose it is and what it was asked for, as a pod's spawn does)."""
    of = Parent.of(parent)
    if of.class_name is None:
        raise _refused(f"run {of.name} is of no WorkerClass: only a run whose class lists the classes it may "
                       "spawn (bounds.childClasses) spawns children")
    if "parentRef" in ask.spec:
        raise Failure(422, "MalformedBody", "spec.parentRef is the gateway's to set", "spec.parentRef")
    if not isinstance(ask.spec.get("className"), str):
        raise _refused("a child names its class (spec.className)")
    if not isinstance(ask.spec.get("budget", {}), dict):
        raise Failure(422, "MalformedBody", "spec.budget: an object (capCents, maxTokens, budgetRef)", "spec.budget")
    try:
        spec = with_parent(of, ask.spec)
    except ValueError as exc:
        raise _refused(str(exc)) from exc
    ns = parent["metadata"]["namespace"]
    # The digest is of what the worker sent, which it can compute (it cannot read the parent).
    body = child_body(of, ns, ask.holder, ask.fence, ask.key, ask.generation, spec, spawn_digest(ask.spec))
    name = body["metadata"]["name"]
    for _ in range(TRIES):
        try:
            return {"child": await kube.create(run_path(ns), body)}
        except (Invalid, Forbidden) as exc:
            raise _refused(f"the API server refused child run {name}: {exc.message}") from exc
        except Conflict:
            try:
                found = await kube.get_run(ns, name)
            except NotFound:
                continue  # deleted since: make it again
        except ApiError as exc:
            if protocol.too_large(exc.status, exc.body):
                raise _refused(f"the API server refused child run {name} as too large: {exc.message}") from exc
            raise
        if not _of_parent(found, parent):
            # Someone's run of that very name: not this run's to hand out (nor to read through `child`).
            raise Failure(409, "SpawnConflict", f"{name} exists and is not a child of {of.name}")
        return {"child": found}
    raise Failure(503, "Busy", f"child run {name} kept being deleted as it was made; retry",
                  headers={"Retry-After": "1"})


async def read(kube: KubeClient, parent: dict[str, Any], name: str) -> dict[str, Any]:
    """One of the parent's children as it is now; ChildNotFound for any other run or none."""
    ns = parent["metadata"]["namespace"]
    try:
        child = await kube.get_run(ns, name)
    except NotFound:
        child = None
    if child is None or not _of_parent(child, parent):
        raise Failure(404, "ChildNotFound", f"workerrun {ns}/{name} is not a child of {parent['metadata']['name']}")
    return {"child": child}
