"""One executor per action of the core, each a small step that returns the snapshot the next
one works from. Every write checks leadership first; every write that depends on ownership is a
compare-and-swap, and a lost one refreshes the cache and asks for a new decision (`cas`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, TypeVar

from tether import metrics, tracing
from tether.api import constants as c
from tether.api.models import Usage, WorkerRun
from tether.api.workerclass import class_name
from tether.controller.budgets import BudgetBook
from tether.controller.capability import Attached
from tether.controller.cache import RunCache
from tether.controller.errors import Again, SpecError
from tether.controller.leader import Leadership
from tether.controller.lease_writer import LeaseWriter
from tether.controller.rbac import WorkerRbac
from tether.controller.snapshot import Snapshot
from tether.controller.sweeper import Feed
from tether.controller.views import RunKey
from tether.core.observe import PodRefusal
from tether.core.actions import (
    Action,
    Change,
    ChargeBudget,
    ClearLease,
    DeletePod,
    DeleteRun,
    EnsureLease,
    EnsurePod,
    EnsureSignals,
    ReleaseCharge,
    ReleasePod,
    RemoveFinalizer,
    Revoke,
    WriteStatus,
)
from tether.api.models import Outcome
from tether.kube import resources
from tether.kube.client import Conflict, Forbidden, Invalid, KubeClient, NotFound
from tether import protocol

log = logging.getLogger("tether.controller")
T = TypeVar("T")

# The log's name for what a status write changed (the core names facts, not log lines; tests
# and dashboards grep these names, so they stay stable).
LOG_EVENTS: dict[Change, str] = {
    Change.GRANTED: "job_claimed",
    Change.RENEWED: "heartbeat_ok",
    Change.STOP_REQUESTED: "stop_requested",
    Change.LEASE_TAMPERED: "lease_tampered",
    Change.FENCE_EXHAUSTED: "fence_exhausted",
    Change.BUDGET_CHARGED: "budget_charged",
}
ENDED_LOG_EVENTS: dict[Outcome, str] = {
    Outcome.LEASE_LOST: "heartbeat_lost",
    Outcome.SUCCEEDED: "job_succeeded",
    Outcome.CANCELLED: "job_cancelled",
    Outcome.DEADLINE_EXCEEDED: "deadline_exceeded",
}


def log_event(write: WriteStatus) -> str:
    """The log event name of a status write ("": the write is not logged)."""
    if write.change is Change.ATTEMPT_ENDED:
        return ENDED_LOG_EVENTS.get(write.ended, "attempt_ended") if write.ended else "attempt_ended"
    return LOG_EVENTS.get(write.change, "") if write.change else ""


def log_run(msg: str, run: WorkerRun, event: str, level: int = logging.INFO, **extra: Any) -> None:
    s = run.status
    log.log(level, msg, extra={
        "event": event, "run": run.key, "attempt": s.attempt, "fence": s.fence, "holder": s.holder,
        "leaseDeadline": s.lease_expires_at.isoformat() if s.lease_expires_at else None, **extra})


async def cas(write: Awaitable[T], refresh: Callable[[], Awaitable[object]], what: str) -> T:
    """A compare-and-swap, or: someone else wrote first (a worker's result, a spec change, a
    deletion), so refresh the cache and decide again on fresh data."""
    try:
        return await write
    except (Conflict, NotFound):
        await refresh()
        raise Again(f"{what} conflicted") from None


class Executor:
    def __init__(self, kube: KubeClient, cache: RunCache, budgets: BudgetBook, rbac: WorkerRbac,
                 leadership: Leadership, mark_terminating: Callable[[str], None], feed: Feed) -> None:
        self.kube, self.cache, self.budgets, self.rbac = kube, cache, budgets, rbac
        self.leadership, self.mark_terminating, self.feed = leadership, mark_terminating, feed
        self.leases = LeaseWriter(kube, cache, leadership, self.refusable)
        self._background: set[asyncio.Task[Any]] = set()
        self._steps: dict[type, Callable[[Snapshot, Any], Awaitable[Snapshot]]] = {
            WriteStatus: self.write_status, Revoke: self.revoke, EnsureLease: self.ensure_lease,
            ClearLease: self.clear_lease, EnsurePod: self.ensure_pod, DeletePod: self.delete_pod,
            ReleasePod: self.release_pod, EnsureSignals: self.ensure_signals, ChargeBudget: self.charge,
            ReleaseCharge: self.release_charge, DeleteRun: self.delete_run, RemoveFinalizer: self.remove_finalizer,
        }
        # What each capability hears of a status write it made (its metrics).
        self._written: list[Callable[[WriteStatus, WorkerRun], None]] = []

    def add(self, attached: Attached) -> None:
        """A capability's executors (controller.capability)."""
        clash = set(attached.steps) & set(self._steps)
        if clash:
            raise ValueError(f"actions executed twice: {sorted(t.__name__ for t in clash)}")
        self._steps.update(attached.steps)
        self._written.append(attached.written)

    async def run(self, snap: Snapshot, action: Action) -> Snapshot:
        self.leadership.check()
        return await self._steps[type(action)](snap, action)

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    # --- the run ---------------------------------------------------------------

    async def refresh(self, key: RunKey) -> dict[str, Any] | None:
        """The run read fresh (None: it is gone), fed to the controller like a watch event, so
        what follows from it (a deletion's strays, a new spec's backoff reset) is woken as usual.
        The answer counts only for what the watch did not change since the GET was sent: a 404
        drops only the run cached before, and a body revives nothing (stamps.py)."""
        mark = self.cache.stamps.mark()
        try:
            fresh: dict[str, Any] | None = await self.kube.get_run(*key)
        except NotFound:
            fresh = None
        if fresh is not None:
            if self.cache.stamps.before(key, mark):  # else the watch brought as new or newer, or the deletion
                self.feed("run-read", "MODIFIED", fresh)
        elif (gone := self.cache.run_cached_before(key, mark)) is not None:
            self.feed("run", "DELETED", gone)
        return fresh

    async def write_status(self, snap: Snapshot, action: WriteStatus) -> Snapshot:
        # The snapshot's own metadata: its resourceVersion is the compare-and-swap precondition.
        written = await cas(self.kube.replace_run_status({**snap.body, "status": action.status.dump()}),
                            lambda: self.refresh(snap.key), "status write")
        snap = self.cache.written_run(snap, written)
        _count(action, snap.run)
        for written_by in self._written:
            written_by(action, snap.run)
        tracing.on_status_written(snap.run, action.grants, action.ends_attempt)
        event = log_event(action)
        if event:
            log_run(f"run {snap.run.status.phase.value if snap.run.status.phase else ''}", snap.run, event,
                    **action.details.log_fields())
        for ev in action.events:
            self.post_event(written, ev.type, ev.reason, ev.message)
        return snap

    async def set_finalizers(self, snap: Snapshot, finalizers: list[str], what: str) -> Snapshot:
        self.leadership.check()
        meta = snap.body["metadata"]
        written = await cas(self.kube.set_run_finalizers(meta["namespace"], meta["name"], snap.resource_version,
                                                         finalizers), lambda: self.refresh(snap.key), what)
        return self.cache.written_run(snap, written)

    async def add_finalizer(self, snap: Snapshot) -> Snapshot:
        """Deleting a run must end its attempt and settle its books first: hold it with a finalizer."""
        return await self.set_finalizers(snap, [*snap.run.metadata.finalizers, c.RUN_FINALIZER], "finalizer write")

    async def remove_finalizer(self, snap: Snapshot, action: RemoveFinalizer) -> Snapshot:
        snap = await self.set_finalizers(snap, [f for f in snap.run.metadata.finalizers if f != c.RUN_FINALIZER],
                                         "finalizer removal")
        log_run("run released for deletion: attempt ended, usage charged, pods released", snap.run, "run_finalized")
        return snap

    async def delete_run(self, snap: Snapshot, action: DeleteRun) -> Snapshot:
        await cas(self.kube.delete_run(snap.run.metadata.namespace, snap.run.metadata.name, snap.uid,
                                       snap.resource_version), lambda: self.refresh(snap.key), "TTL deletion")
        log_run("finished run deleted (ttlSecondsAfterFinished)", snap.run, "run_deleted")
        return snap

    # --- the Lease ---------------------------------------------------------------

    async def revoke(self, snap: Snapshot, action: Revoke) -> Snapshot:
        """Revocation in the protocol's order: status (the fence moves), Lease (cleared at the new
        fence), pods, tool-claim Secrets. The first failure raises and stops it. Every step is
        idempotent: a pass interrupted after the status write finds no holder and a Lease that
        still names one, clears it (ClearLease, which deletes the tool claims too), and deletes
        the pod as one of an ended attempt."""
        snap = await self.write_status(snap, action.status_write)
        self.leadership.check()
        await self.leases.write(snap, None, action.fence, snap.run.spec.lease.duration_seconds, "")
        for name in action.pods_to_delete:
            snap = await self.run(snap, DeletePod(name))
        for holder in action.tool_claim_holders:
            self.leadership.check()
            await self.delete_tool_claims(snap, holder)
        return snap

    async def ensure_lease(self, snap: Snapshot, action: EnsureLease) -> Snapshot:
        # An External run's account (its tool claims') is the gateway's to make, at its first claim.
        lost = await self.leases.write(snap, action.holder, action.fence, action.duration_seconds, action.signals)
        await self.delete_tool_claims(snap, lost)  # and every ended attempt's, as a clearing does
        return snap

    async def clear_lease(self, snap: Snapshot, action: ClearLease) -> Snapshot:
        lost = await self.leases.write(snap, None, action.fence, snap.run.spec.lease.duration_seconds, "")
        await self.delete_tool_claims(snap, lost)
        return snap

    async def ensure_signals(self, snap: Snapshot, action: EnsureSignals) -> Snapshot:
        ns, name = snap.run.metadata.namespace, snap.run.metadata.name
        try:
            written = await self.kube.patch_lease_signals(ns, name, action.fence, action.signals)
        except (Invalid, NotFound):
            raise Again("the lease moved on") from None  # the `test` failed: the lease moved on
        based = snap.lease.resource_version if snap.lease is not None else None
        self.cache.leases.observe(snap.uid, written, self.cache.mono(), written_over=based)
        return snap

    async def delete_tool_claims(self, snap: Snapshot, previous: str | None) -> None:
        """Every tool credential of an ended External attempt is bound to its Secret: it dies with it.
        Idempotent: a revocation that finds the Lease already cleared still deletes it."""
        if snap.run.spec.executor != "External":
            return
        ns = snap.run.metadata.namespace
        holders = {previous} if previous else set()
        holders.update(a.holder for a in snap.run.status.attempts if a.outcome is not None and a.holder)
        for holder in holders:
            self.leadership.check()
            await self.kube.delete_secret(ns, f"{holder}-toolclaim")
        self.cache.tool_claims_cleared[snap.uid] = snap.run.status.fence

    # --- pods --------------------------------------------------------------------

    async def ensure_pod(self, snap: Snapshot, action: EnsurePod) -> Snapshot:
        run = snap.run
        ns = run.metadata.namespace
        await self.ensure_rbac(snap)
        pod = resources.build_pod(run, action.name, action.attempt, action.fence, action.holder,
                                  shared=self.rbac.shared)
        self.leadership.check()
        mark = self.cache.stamps.mark()
        try:
            created = await self.refusable(self.kube.create_pod(pod), "PodRefused", ns)
            log_run("pod created", run, "pod_created", pod=action.name)
        except SpecError as exc:
            self.rbac.forget_namespace(ns)  # e.g. its worker ServiceAccount was deleted: made again next time
            if isinstance(exc.api_error, Forbidden) and not exc.api_error.refuses_the_object:
                raise  # recorded (Stalled) and tried again: the same pod may be admitted later
            # The attempt did not start: told to the core, whose next decision ends it (PodRefused).
            message = exc.api_error.message[:1024]
            self.cache.pod_refusals[snap.uid] = PodRefusal(fence=action.fence, pod=action.name, message=message)
            log_run("pod refused", run, "pod_refused", logging.WARNING, pod=action.name, error=message)
            raise Again("the attempt's pod was refused") from None
        except Conflict:
            # Same deterministic name: the pod from before a crash. Adopt it, if it is this run's.
            existing = await self.kube.get_pod(ns, action.name)
            if existing is None:
                raise Again("the pod vanished") from None
            if protocol.controller_uid(existing) != snap.uid:
                if self.cache.pod_read_current(existing, mark):
                    self.feed("pod", "MODIFIED", existing)  # a stray of a deleted namesake: the stray queue releases it
                raise Again("a namesake's pod is in the way") from None
            created = existing
            log_run("pod adopted", run, "pod_adopted", pod=action.name)
        if self.cache.pod_read_current(created, mark):  # else the watch already has it, or newer
            self.cache.put_pod(created)
        return snap

    async def delete_pod(self, snap: Snapshot, action: DeletePod) -> Snapshot:
        uid = self.cache.pod_uid(snap.key, action.name)
        self.cache.pod_written(snap.key, action.name,
                               await self.kube.delete_pod(snap.run.metadata.namespace, action.name, uid=uid))
        log_run("pod deleted", snap.run, "pod_deleted", pod=action.name)
        return snap

    async def release_pod(self, snap: Snapshot, action: ReleasePod) -> Snapshot:
        uid = self.cache.pod_uid(snap.key, action.name)
        self.cache.pod_written(snap.key, action.name, await self.kube.remove_finalizer(
            snap.run.metadata.namespace, action.name, c.POD_FINALIZER, uid=uid))
        return snap

    async def ensure_rbac(self, snap: Snapshot) -> None:
        self.leadership.check()
        try:
            await self.rbac.ensure(snap.run)
        except Invalid as exc:
            self.rbac.forget_namespace(snap.run.metadata.namespace)
            raise SpecError("WorkerIdentityRefused", exc) from None

    async def refusable(self, call: Awaitable[dict[str, Any]], reason: str, ns: str) -> dict[str, Any]:
        """Turns the API server's refusal of an object built from the spec into a SpecError
        (recorded, backed off), and learns from a namespace that is being deleted."""
        try:
            return await call
        except Invalid as exc:
            raise SpecError(reason, exc) from None
        except Forbidden as exc:
            if exc.namespace_terminating:
                self.mark_terminating(ns)
            raise SpecError(reason, exc) from None

    # --- budgets -------------------------------------------------------------------

    async def charge(self, snap: Snapshot, action: ChargeBudget) -> Snapshot:
        async def baseline() -> Usage | None:
            # The snapshot may predate the run's own record of its charge (a watch event older
            # than our write, another replica): the baseline comes from a fresh read.
            fresh = await self.refresh(snap.key)
            if fresh is None or fresh["metadata"].get("uid") != snap.uid:
                return None
            return WorkerRun.model_validate(fresh).status.charged or Usage()

        added = await self.budgets.charge(snap.run, action.budget, action.total, baseline)
        if added is None:
            raise Again("the budget could not be charged")
        log_run("usage charged", snap.run, "budget_charged", budget=action.budget, cents=added.cents, tokens=added.tokens)
        return snap

    async def release_charge(self, snap: Snapshot, action: ReleaseCharge) -> Snapshot:
        if not await self.budgets.release(snap.run, action.budget):
            raise Again("the budget kept changing")
        log_run("charge released from the budget's ledger", snap.run, "budget_charge_released", budget=action.budget)
        return snap

    # --- events --------------------------------------------------------------------

    def post_event(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Best effort, in the background: an Event never holds up or fails a pass."""
        async def post() -> None:
            try:
                await self.kube.post_event(body, type_, reason, message)
            except Exception as exc:  # noqa: BLE001 - events are best effort
                log.warning("event not posted", extra={"reason": reason, "error": str(exc)})

        task = asyncio.create_task(post())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _count(action: WriteStatus, written: WorkerRun) -> None:
    ns = written.metadata.namespace or ""
    cls = class_name(written)
    if action.grants:
        metrics.ATTEMPTS_STARTED.labels(ns, cls).inc()
        if written.status.attempt > 1:
            metrics.REGRANTS.labels(ns, cls).inc()
    if action.ends_attempt:
        ended = [a for a in written.status.attempts if a.outcome is not None]
        if ended:
            metrics.ATTEMPTS_ENDED.labels(ns, cls, ended[-1].outcome.value).inc()  # type: ignore[union-attr]
    details = action.details
    for gate, decision, seconds in details.approvals:
        metrics.APPROVAL_DECISION.labels(ns, gate, decision).observe(seconds)
    if action.lapse:
        metrics.LEASE_LAPSES.labels(ns, cls).inc()
        if details.silence_seconds is not None:
            metrics.LAPSE_DETECTION.labels(ns, cls).observe(details.silence_seconds)
