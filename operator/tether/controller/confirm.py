"""The confirmer: the fresh reads a decision's actions declared (core.actions.Confirm), made
before the first action runs. A read that contradicts the decision sends it back (`Again`, with
the cache updated from the read); one that cannot judge a lapse in time is `Inconclusive`."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable

from tether import protocol
from tether.api import constants as c
from tether.controller.cache import RunCache
from tether.controller.capability import Attached, Check
from tether.controller.errors import Again, Inconclusive, SpecError
from tether.controller.execute import Executor
from tether.controller.snapshot import Snapshot, pod_observation
from tether.controller.sweeper import Feed
from tether.controller.views import BudgetView, PodView
from tether.core.actions import Confirm, Decision, WriteStatus
from tether.core.liveness import mass_lapse
from tether.kube.client import Conflict, Forbidden, KubeClient, Unavailable
from tether.kube.health import SLOW_SECONDS
from tether.kube.paths import lease_path, namespace_path, pod_path

log = logging.getLogger("tether.controller")

Report = Callable[..., None]


@dataclass
class Pass:
    """One confirmation's decision and what its reads learned (per pass: reconciles run at once)."""

    decision: Decision
    lease_read_took: float = 0.0
    available_since: float | None = None


class Confirmer:
    def __init__(self, kube: KubeClient, cache: RunCache, executor: Executor, report: Report,
                 mark_terminating: Callable[[str], None], feed: Feed) -> None:
        self.kube, self.cache, self.executor, self.report = kube, cache, executor, report
        self.mark_terminating, self.feed = mark_terminating, feed
        self._checks: dict[enum.Enum, Callable[[Snapshot, Pass], Awaitable[Snapshot]]] = {
            Confirm.LEASE_FINAL: self.lease_final, Confirm.LAPSE: self.lapse,
            Confirm.LEASE_FOR_GRANT: self.lease_for_grant, Confirm.HOLDER_NAME_FREE: self.holder_name_free,
            Confirm.NAMESPACE_LIVE: self.namespace_live, Confirm.BOOKS: self.books, Confirm.LEDGER: self.ledger,
            Confirm.RUN_UNMOVED: self.run_unmoved, Confirm.PODS_GONE: self.pods_gone,
        }

    def add(self, attached: Attached) -> None:
        """A capability's fresh reads (controller.capability)."""
        for need, check in attached.checks.items():
            if need in self._checks:
                raise ValueError(f"{need} is confirmed twice")
            self._checks[need] = _checked(check)

    async def confirm(self, snap: Snapshot, decision: Decision) -> Snapshot:
        this = Pass(decision)
        for need in decision.confirmations():
            snap = await self._checks[need](snap, this)
        return snap

    def _moved(self, snap: Snapshot, lease: dict[str, Any] | None) -> bool:
        """The Lease read is this run's and newer than the one decided on: observe it."""
        if lease is None or protocol.controller_uid(lease) != snap.uid or (
                snap.lease is not None and lease["metadata"]["resourceVersion"] == snap.lease.resource_version):
            return False
        self.cache.leases.observe(snap.uid, lease, self.cache.mono())
        return True

    async def lease_final(self, snap: Snapshot, this: Pass) -> Snapshot:
        """Ending an attempt: the final usage report must be in the books. The read is timed, for
        LAPSE, which (if required) comes next and judges its timing."""
        ns, name = snap.run.metadata.namespace, snap.run.metadata.name
        this.available_since = self.kube.health.available_since
        try:
            lease, this.lease_read_took = await self.kube.timed_get(lease_path(ns, name), f"get lease {ns}/{name}")
        except Unavailable as exc:
            if Confirm.LAPSE in this.decision.confirmations():
                raise Inconclusive(f"lease read failed: {exc}", 1.0) from None
            raise
        if self._moved(snap, lease):
            raise Again("the lease moved")
        return snap

    async def lapse(self, snap: Snapshot, this: Pass) -> Snapshot:
        """A lapse is only real if that read was timely and met no outage, and is not one of many
        leases lapsing together (which points at the control plane or this operator's view of it,
        not at the workers: then a lapse must last a second full duration before it counts)."""
        since, took = this.available_since, this.lease_read_took
        if took > SLOW_SECONDS or since is None or self.kube.health.available_since != since:
            raise Inconclusive(f"the confirming read took {took:.1f}s or met an outage", 1.0)
        mono = self.cache.mono()
        overdue, active = self.cache.overdue(mono)
        assert snap.lease is not None  # a lapse is judged on an observed Lease
        silence = mono - snap.lease.last_change
        duration = snap.run.spec.lease.duration_seconds
        if mass_lapse(overdue, active) and silence < 2 * duration:
            self.report(snap.key, "many leases lapsed at once; suspecting the control plane, not the workers",
                        "mass_lapse_suspected", f"{overdue}/{active} overdue", logging.WARNING)
            raise Inconclusive(f"{overdue} of {active} leases overdue", 2 * duration - silence)
        return snap

    async def lease_for_grant(self, snap: Snapshot, this: Pass) -> Snapshot:
        """A Lease that still names an ended attempt (a revocation interrupted before its clear,
        seen by an operator whose cache lacks it, e.g. a new leader) must be cleared and its last
        report settled first, never overwritten. The grant's Lease write starts from this read."""
        if snap.run.status.fence == 0 and snap.lease is None:
            # A first grant: no attempt of this run ever had a Lease to leave uncleared. Whatever
            # Lease may exist (a deleted namesake's) makes the create conflict and is read then.
            return replace(snap, lease_read=(None,))
        ns, name = snap.run.metadata.namespace, snap.run.metadata.name
        lease = await self.kube.get_lease(ns, name)
        if self._moved(snap, lease):
            raise Again("the lease is not as the grant saw it")
        return replace(snap, lease_read=(lease,))

    async def holder_name_free(self, snap: Snapshot, this: Pass) -> Snapshot:
        """A deleted namesake's pod of the holder's name that the pod watch has not delivered
        (after a restart the run may be listed first): its worker would take the grant."""
        holder = _grant(this.decision).status.holder
        if not holder or (snap.key, holder) in self.cache.pods:
            return snap
        ns = snap.run.metadata.namespace
        mark = self.cache.stamps.mark()
        pod = await self.kube.get_pod(ns, holder)
        if pod is None or protocol.controller_uid(pod) == snap.uid:
            return snap
        if PodView(pod).run_key != snap.key:
            # Not a pod of any WorkerRun of this name: Tether will not touch it. Say so on the run.
            raise SpecError("PodNameTaken", Conflict(
                409, f"pod {ns}/{holder} exists and is not this run's; delete or rename it, or rename the run",
                f"pod {ns}/{holder}"))
        if self.cache.pod_read_current(pod, mark):
            self.feed("pod", "MODIFIED", pod)  # as the watch would have: the stray queue releases it
        raise Again(f"pod {holder} of another run exists")

    async def namespace_live(self, snap: Snapshot, this: Pass) -> Snapshot:
        """The namespace controller deletes pods first: a vanished pod there is no reason to retry."""
        ns = snap.run.metadata.namespace
        try:
            body = await self.kube.get_object(namespace_path(ns))
        except Forbidden:
            return snap  # without the right to look, the create's 403 is the signal
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.mark_terminating(ns)
            raise Again("the namespace is being deleted")
        return snap

    async def books(self, snap: Snapshot, this: Pass) -> Snapshot:
        """Before a run's books close (budgetCharged recorded, its mark released, the run deleted or
        let go), a final usage report the Lease still holds (a revocation's last renewal, seen
        late after a restart) must be settled first."""
        lease = await self.kube.get_lease(snap.run.metadata.namespace, snap.run.metadata.name)
        if self._moved(snap, lease):
            raise Again("the Lease is newer than the books closing on it")
        return snap

    async def ledger(self, snap: Snapshot, this: Pass) -> Snapshot:
        """The budget's cached view may be older than our own charge: read it fresh, or a mark
        would be left in its ledger forever."""
        ref = snap.run.spec.budget.budget_ref if snap.run.spec.budget else None
        if ref is None:
            return snap
        book = self.executor.budgets
        mark = book.stamps.mark()
        budget = await self.kube.get_budget(snap.run.metadata.namespace, ref.name)
        if budget is not None and BudgetView(budget).holds_mark_of(snap.uid):
            book.read((snap.run.metadata.namespace, ref.name), budget, mark)
            raise Again("the run's mark is still in the budget's ledger")
        return snap

    async def pods_gone(self, snap: Snapshot, this: Pass) -> Snapshot:
        """Before a queued run's quota is released (evicted, or the run ended): none of its pods
        may still run, read fresh and judged by the decision's own rule."""
        ns, name = snap.run.metadata.namespace, snap.run.metadata.name
        mark = self.cache.stamps.mark()
        pods = await self.kube.list_objects(pod_path(ns), label_selector=f"{c.LABEL_RUN}={name}")
        now = self.cache.now()
        live = [p for p in pods if protocol.controller_uid(p) == snap.uid
                and (seen := pod_observation(p)) is not None and seen.may_still_run(now)]
        for pod in live:
            if self.cache.pod_read_current(pod, mark):
                self.feed("pod", "MODIFIED", pod)
        if live:
            raise Again(f"pod {live[0]['metadata']['name']} of the run still runs")
        return snap

    async def run_unmoved(self, snap: Snapshot, this: Pass) -> Snapshot:
        """Repairs not preceded by a status write never act on a stale cache."""
        fresh = await self.executor.refresh(snap.key)
        if fresh is None or fresh["metadata"]["resourceVersion"] != snap.resource_version:
            raise Again("the run moved")
        return snap


def _grant(decision: Decision) -> WriteStatus:
    return next(a for a in decision.actions if isinstance(a, WriteStatus) and a.grants)


def _checked(check: Check) -> Callable[[Snapshot, Pass], Awaitable[Snapshot]]:
    async def confirm(snap: Snapshot, this: Pass) -> Snapshot:
        await check(snap, this.decision)
        return snap
    return confirm
