"""The worker identity of a run: ServiceAccount, Role and RoleBinding.

With the namespace identity (the default, where the admission policy scopes each pod's token
to its own run) a pod-backed run uses the namespace's objects, created once per namespace;
otherwise one set per run: the operator makes a pod run's before its pod, the gateway an External
run's at its first claim (its tool claims are minted for it; a grant writes only the status and
the Lease).
Objects left by a deleted run of the same name are not adopted: they belong to the
old run's UID (and garbage collection would delete them under the new run). Nor is an object of
that name that no run made: the run would act as someone else's account.
"""

from __future__ import annotations

from typing import Any

from collections import OrderedDict

from tether.api.models import WorkerRun
from tether.kube import resources
from tether.kube.client import Conflict, Forbidden, KubeClient

# Run UIDs (and namespaces) remembered as ready; forgetting one costs a create answered 409 and a read.
READY_CACHE = 65536


class IdentityTaken(Conflict):
    """An object of the name Tether would make for the run exists and was not made for it."""


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


def left_by_a_run(obj: dict[str, Any]) -> bool:
    """Owned by a WorkerRun (garbage collection takes it with that run)."""
    return any(ref.get("kind") == "WorkerRun" and str(ref.get("apiVersion", "")).startswith("tether.dev/")
               for ref in obj.get("metadata", {}).get("ownerReferences") or [])


class WorkerIdentity:
    def __init__(self, kube: KubeClient, shared: bool = True) -> None:
        self.kube = kube
        self.shared = shared
        self._ready: OrderedDict[str, None] = OrderedDict()  # run UIDs, and namespaces, whose objects exist

    def forget(self, uid: str) -> None:
        self._ready.pop(uid, None)

    def forget_namespace(self, ns: str) -> None:
        """The namespace's objects may be gone (deleted by someone, or the namespace re-created):
        the next ensure creates what is missing."""
        self._ready.pop(f"ns:{ns}", None)

    def _remember(self, key: str) -> None:
        self._ready[key] = None
        while len(self._ready) > READY_CACHE:
            self._ready.popitem(last=False)

    async def ensure(self, run: WorkerRun) -> None:
        ns, uid = run.metadata.namespace, run.metadata.uid
        if resources.shares_namespace_identity(run, self.shared):
            if f"ns:{ns}" not in self._ready:
                for path, obj in resources.build_namespace_worker_rbac(ns):
                    await self._ensure_one(path, obj, None)
                self._remember(f"ns:{ns}")
            return
        if uid in self._ready:
            return
        for path, obj in resources.build_worker_rbac(run):
            await self._ensure_one(path, obj, uid)
        self._remember(uid)

    async def _ensure_one(self, path: str, obj: dict[str, Any], uid: str | None) -> None:
        for _ in range(3):
            try:
                await self.kube.create(path, obj)
                return
            except Conflict:
                existing = await self.kube.get_object(f"{path}/{obj['metadata']['name']}")
                if existing is None:
                    continue  # deleted in between: create again
                if uid is None and obj["kind"] == "Role" and existing.get("rules") != obj["rules"]:
                    # The namespace's Role of an older version: it gets what this one grants (a
                    # compare-and-swap on what was read; a conflict reads again).
                    try:
                        await self.kube.merge_patch(f"{path}/{obj['metadata']['name']}", {
                            "metadata": {"resourceVersion": existing["metadata"]["resourceVersion"]},
                            "rules": obj["rules"]}, f"update the worker Role of {obj['metadata']['namespace']}")
                    except Conflict:
                        continue
                    return
                if uid is None or owned_by(existing, uid):
                    return  # ours, or the namespace's
                if not left_by_a_run(existing):
                    # Someone's own object under the name Tether would make (say an admin's ServiceAccount
                    # `ci-worker`, and a run named `ci`): never adopted, or the run would act as it.
                    kind, name = obj["kind"], obj["metadata"]["name"]
                    raise IdentityTaken(409, (
                        f"{kind} {name} exists and was not made for this run: Tether runs a worker only as an "
                        f"account it made for the run (or the namespace's). Rename the run, or delete the {kind}"),
                        "ensure worker identity")
                # Left by a deleted run of the same name: replace it, or GC takes it from us. Without
                # the right to delete it (the chart grants none), garbage collection will: busy till then.
                try:
                    await self.kube.delete_object(f"{path}/{obj['metadata']['name']}", existing["metadata"]["uid"])
                except Forbidden:
                    raise Conflict(409, f"{obj['kind']} {obj['metadata']['name']} was left by a deleted run of "
                                        "the same name; garbage collection removes it", "ensure worker rbac") from None
        raise Conflict(409, f"{path}/{obj['metadata']['name']} keeps reappearing", "ensure worker rbac")
