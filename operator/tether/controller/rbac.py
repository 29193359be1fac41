"""The worker identity of a run: ServiceAccount, Role and RoleBinding, created once per run.

Objects left by a deleted run of the same name are not adopted: they belong to the
old run's UID (and garbage collection would delete them under the new run).
"""

from __future__ import annotations

from typing import Any

from tether.api.models import WorkerRun
from tether.kube import resources
from tether.kube.client import Conflict, KubeClient


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


class WorkerRbac:
    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube
        self._ready: set[str] = set()  # run UIDs whose objects exist

    def forget(self, uid: str) -> None:
        self._ready.discard(uid)

    async def ensure(self, run: WorkerRun) -> None:
        uid = run.metadata.uid
        if uid in self._ready:
            return
        for path, obj in resources.build_worker_rbac(run):
            await self._ensure_one(path, obj, uid)
        self._ready.add(uid)

    async def _ensure_one(self, path: str, obj: dict[str, Any], uid: str) -> None:
        for _ in range(3):
            try:
                await self.kube.create(path, obj)
                return
            except Conflict:
                existing = await self.kube.get_object(f"{path}/{obj['metadata']['name']}")
                if existing is None:
                    continue  # deleted in between: create again
                if owned_by(existing, uid) or not existing["metadata"].get("ownerReferences"):
                    return  # ours, or the user's own (a template's ServiceAccount)
                # Left by a deleted run of the same name: replace it, or GC takes it from us.
                await self.kube.delete_object(f"{path}/{obj['metadata']['name']}", existing["metadata"]["uid"])
        raise Conflict(409, f"{path}/{obj['metadata']['name']} keeps reappearing", "ensure worker rbac")
