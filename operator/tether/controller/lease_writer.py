"""The one loop that writes a run's Lease: for a grant, a clearing and a revocation alike.

A compare-and-swap from the last read (the grant's confirmation, else a fresh GET); a conflict
reads again, since the writer must still win against an old holder's renewal. It never adopts a
Lease another (deleted) run of the same name left, never touches one no WorkerRun controls,
and never writes past a fence someone else moved ahead. It returns the holder that lost the
Lease by this write: what follows from that (its tool claims) is the caller's business.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from tether import protocol
from tether.controller.cache import RunCache
from tether.controller.errors import Again, SpecError
from tether.controller.leader import Leadership
from tether.controller.snapshot import Snapshot
from tether.kube import resources
from tether.kube.client import Conflict, KubeClient
from tether.kube.paths import lease_path

# Conflicts in a row before the pass gives up and decides again.
MAX_TRIES = 5

Refusable = Callable[[Awaitable[dict[str, Any]], str, str], Awaitable[dict[str, Any]]]


class LeaseWriter:
    def __init__(self, kube: KubeClient, cache: RunCache, leadership: Leadership, refusable: Refusable) -> None:
        self.kube, self.cache, self.leadership, self.refusable = kube, cache, leadership, refusable

    async def write(self, snap: Snapshot, holder: str | None, fence: int, duration: int, signals: str) -> str | None:
        """Writes the Lease for `holder` at `fence` (None: cleared). Returns who held it before,
        if this write took it from them."""
        run = snap.run
        ns, name = run.metadata.namespace, run.metadata.name
        read = snap.lease_read
        for _ in range(MAX_TRIES):
            self.leadership.check()
            current = read[0] if read is not None else await self.kube.get_lease(ns, name)
            read = None  # after a conflict, read again
            current = await self._ours(snap, current)
            if current is None:
                self.cache.leases.forget(snap.uid)  # what we knew of it is gone with it
                if holder is None:
                    return None
                lease = resources.build_lease(run, holder, fence, duration, self.cache.now(), signals)
                try:
                    written = await self.refusable(self.kube.create_lease(lease), "LeaseRefused", ns)
                except Conflict:
                    continue
                self._observe(snap, written, written_over=self._tracked(snap))
                return None
            spec = current.get("spec") or {}
            have, previous = spec.get("leaseTransitions") or 0, spec.get("holderIdentity")
            if have > fence:
                # Someone other than Tether moved the fence ahead: decide (revoke past it) on what is there.
                self._observe(snap, current)
                raise Again("the lease carries a foreign fence")
            if previous == holder and have == fence:
                self._observe(snap, current)
                return None
            lease = resources.regrant_lease(current, holder, fence, duration, self.cache.now(), signals)
            try:
                written = await self.refusable(self.kube.replace_lease(lease), "LeaseRefused", ns)
            except Conflict:
                continue  # the old holder renewed in between; our write must still win
            self._observe(snap, written, written_over=current["metadata"]["resourceVersion"])
            return previous if previous != holder else None
        raise Again("the lease kept changing")

    async def _ours(self, snap: Snapshot, current: dict[str, Any] | None) -> dict[str, Any] | None:
        """The Lease if this run controls it; None once a deleted namesake's is removed."""
        if current is None or protocol.controller_uid(current) == snap.uid:
            return current
        ns, name = snap.run.metadata.namespace, snap.run.metadata.name
        if protocol.controller_uid(current) is None:
            # Not Tether's (an application's own Lease of that name): never touch it.
            raise SpecError("LeaseConflict", Conflict(
                409, f"Lease {ns}/{name} exists and no WorkerRun controls it; rename the run or the Lease",
                f"lease {ns}/{name}"))
        self.leadership.check()
        await self.kube.delete_object(lease_path(ns, name), current["metadata"]["uid"])
        return None

    def _observe(self, snap: Snapshot, lease: dict[str, Any], written_over: str | None = None) -> None:
        self.cache.leases.observe(snap.uid, lease, self.cache.mono(), written_over)

    def _tracked(self, snap: Snapshot) -> str | None:
        seen = self.cache.leases.get(snap.uid)
        return seen.resource_version if seen is not None else None
