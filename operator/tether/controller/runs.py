"""Per-run reconcile loops: observations in, decide(), actions out.

Watch events (delivered by the kopf handlers) only update in-memory
observations and wake the run's own asyncio task; the task decides and acts.
Each run sleeps until its next deadline (lease lapse, backoff, TTL), so there
is no periodic sweep over all runs, and a heartbeat wakes nobody unless it
changes what is decided.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import ValidationError

from tether import metrics
from tether.api import constants as c
from tether.api.models import Usage, WorkerBudget, WorkerRun
from tether.controller.leases import LeaseTracker
from tether.core import budget as budgets
from tether.core.decide import (
    Action,
    BudgetObservation,
    ChargeBudget,
    ClearLease,
    DeletePod,
    DeleteRun,
    EnsureLease,
    EnsurePod,
    EnsureSignals,
    Observed,
    PodObservation,
    ReleasePod,
    WriteStatus,
    decide,
)
from tether.kube import resources
from tether.kube.client import Conflict, Invalid, KubeClient, NotFound

log = logging.getLogger("tether.controller")

ERROR_RETRY_SECONDS = (1.0, 30.0)


@dataclass
class Clock:
    """Injected clocks: wall time for status timestamps, monotonic time for lapses."""

    now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc)
    mono: Callable[[], float] = time.monotonic


@dataclass
class RunEntry:
    key: str
    run: dict[str, Any] | None = None
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    rbac_ready: bool = False
    errors: int = 0
    usage_alarm: Usage | None = None
    budget: str | None = None  # key of the WorkerBudget it draws from


def _key(ns: str, name: str) -> str:
    return f"{ns}/{name}"


def _fence(body: dict[str, Any] | None) -> int:
    return int(((body or {}).get("status") or {}).get("fence") or 0)


def _pod_observation(pod: dict[str, Any]) -> PodObservation | None:
    meta, status = pod["metadata"], pod.get("status", {}) or {}
    try:
        attempt = int(meta.get("labels", {}).get(c.LABEL_ATTEMPT, ""))
    except ValueError:
        return None
    exit_code = None
    for cs in status.get("containerStatuses", []) or []:
        term = (cs.get("state") or {}).get("terminated")
        if term is not None:
            exit_code = term.get("exitCode")
            break
    return PodObservation(name=meta["name"], attempt=attempt, phase=status.get("phase", "Pending"),
                          exit_code=exit_code, deleting=bool(meta.get("deletionTimestamp")),
                          has_finalizer=c.POD_FINALIZER in (meta.get("finalizers") or []))


class RunController:
    def __init__(self, kube: KubeClient, clock: Clock | None = None, fold_interval: float = 10.0,
                 may_act: Callable[[], bool] = lambda: True) -> None:
        self.kube = kube
        self.may_act = may_act
        self.clock = clock or Clock()
        self.fold_interval = fold_interval
        self.leases = LeaseTracker()
        self.entries: dict[str, RunEntry] = {}
        self.budgets: dict[str, dict[str, Any]] = {}
        self._background: set[asyncio.Task[Any]] = set()

    # --- watch events --------------------------------------------------------

    def _entry(self, key: str) -> RunEntry:
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = RunEntry(key=key)
        return entry

    def on_run(self, event_type: str | None, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        entry = self._entry(_key(meta["namespace"], meta["name"]))
        if event_type == "DELETED":
            entry.run = None
            self.leases.forget(entry.key)
            entry.wake.set()
            return
        if entry.run is not None:
            if meta.get("resourceVersion") == entry.run["metadata"].get("resourceVersion"):
                return
            if meta.get("uid") == entry.run["metadata"].get("uid") and _fence(body) < _fence(entry.run):
                return  # older than what our own write returned
        entry.run = body
        self._ensure_loop(entry)
        entry.wake.set()

    def on_lease(self, event_type: str | None, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        run_name = (meta.get("labels") or {}).get(c.LABEL_RUN)
        if not run_name:
            return
        key = _key(meta["namespace"], run_name)
        if event_type == "DELETED":
            self.leases.forget(key)
            changed = True
        else:
            changed = self.leases.observe(key, body, self.clock.mono())
        entry = self.entries.get(key)
        if entry is None:
            return
        tracked = self.leases.get(key)
        alarm = entry.usage_alarm
        if alarm is not None and tracked is not None and tracked.usage is not None and \
                (tracked.usage.cents >= alarm.cents or tracked.usage.tokens >= alarm.tokens):
            changed = True  # a cap or the budget is reached: act now, not at the next fold
        if changed:
            entry.wake.set()

    def on_budget(self, event_type: str | None, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        key = _key(meta["namespace"], meta["name"])
        if event_type == "DELETED":
            self.budgets.pop(key, None)
        else:
            self.budgets[key] = body
            self._spawn(self._refresh_budget(meta["namespace"], meta["name"]))
        # Runs that draw from it may be admitted now (limit raised, period rolled over).
        for entry in self.entries.values():
            if entry.budget == key and entry.run is not None:
                entry.wake.set()
                self._ensure_loop(entry)

    def on_pod(self, event_type: str | None, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        run_name = (meta.get("labels") or {}).get(c.LABEL_RUN)
        if not run_name:
            return
        entry = self._entry(_key(meta["namespace"], run_name))
        before = entry.pods.get(meta["name"])
        if event_type == "DELETED":
            entry.pods.pop(meta["name"], None)
        else:
            entry.pods[meta["name"]] = body
        if before is None or event_type == "DELETED" or _pod_observation(before) != _pod_observation(body):
            entry.wake.set()
            if entry.run is not None:
                self._ensure_loop(entry)

    # --- loops ---------------------------------------------------------------

    def _ensure_loop(self, entry: RunEntry) -> None:
        if entry.task is None or entry.task.done():
            entry.task = asyncio.create_task(self._loop(entry), name=f"run {entry.key}")

    async def stop(self) -> None:
        tasks = [e.task for e in self.entries.values() if e.task is not None] + list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self, entry: RunEntry) -> None:
        while entry.run is not None:
            entry.wake.clear()
            began = time.monotonic()
            try:
                requeue = await self._reconcile(entry)
                entry.errors = 0
                metrics.RECONCILE_TOTAL.labels("workerrun", "success" if requeue is None else "requeue").inc()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one run's failure must not stop the others
                metrics.RECONCILE_TOTAL.labels("workerrun", "error").inc()
                metrics.RECONCILE_ERRORS.labels("workerrun").inc()
                entry.errors += 1
                requeue = min(ERROR_RETRY_SECONDS[1], ERROR_RETRY_SECONDS[0] * 2 ** (entry.errors - 1))
                log.exception("reconcile failed; retrying", extra={"run": entry.key, "retryIn": requeue})
            finally:
                metrics.RECONCILE_TIME.labels("workerrun").observe(time.monotonic() - began)
            if requeue == 0:
                continue
            if requeue is None and self._idle(entry) and not entry.wake.is_set():
                break  # an event that arrived while reconciling set `wake`: go round once more
            try:
                await asyncio.wait_for(entry.wake.wait(), timeout=requeue)
            except asyncio.TimeoutError:
                pass
        if entry.run is None and not entry.pods:
            self.entries.pop(entry.key, None)

    def _idle(self, entry: RunEntry) -> bool:
        """A finished run with nothing left to clean up needs no task until something changes."""
        phase = ((entry.run or {}).get("status") or {}).get("phase")
        return phase in {"Succeeded", "Failed", "Lost", "Cancelled", "BudgetExceeded", "DeadlineExceeded"}

    async def _reconcile(self, entry: RunEntry) -> float | None:
        assert entry.run is not None
        try:
            run = WorkerRun.model_validate(entry.run)
        except ValidationError as exc:
            log.error("cannot read run; waiting for a change", extra={"run": entry.key, "error": str(exc)})
            return None
        pods = tuple(p for p in (_pod_observation(b) for b in entry.pods.values()) if p is not None)
        now = self.clock.now()
        observed = Observed(run=run, lease=self.leases.get(entry.key), pods=pods, now=now, mono=self.clock.mono(),
                            budget=await self._budget_observation(entry, run, now), fold_interval=self.fold_interval)
        decision = decide(observed)
        entry.usage_alarm = decision.usage_alarm
        if not decision.actions:
            return decision.requeue_after
        if not self.may_act():
            log.warning("not the leader: not acting", extra={"run": entry.key, "event": "not_leader"})
            return 1.0
        if not await self._still_current(entry, decision.actions):
            return 0
        for action in decision.actions:
            if not await self._execute(entry, run, action):
                return 0
            if isinstance(action, WriteStatus) and entry.run is not None:
                run = WorkerRun.model_validate(entry.run)
        return decision.requeue_after

    async def _refresh_budget(self, ns: str, name: str) -> None:
        """Keeps a budget's status current (remaining, period, Exhausted) when nothing is charged."""
        try:
            body = await self.kube.get_budget(ns, name)
            if body is None:
                return
            budget = WorkerBudget.model_validate(body)
            status = budgets.refresh(budget, self.clock.now())
            if status.dump() == budget.status.dump():
                return
            body["status"] = status.dump()
            self.budgets[_key(ns, name)] = await self.kube.replace_budget_status(body)
        except (Conflict, NotFound):
            pass  # a newer version arrives by watch and triggers another refresh
        except Exception as exc:  # noqa: BLE001 - best effort; charges refresh it too
            log.warning("budget refresh failed", extra={"budget": f"{ns}/{name}", "error": str(exc)})

    async def _budget_observation(self, entry: RunEntry, run: WorkerRun, now: dt.datetime) -> BudgetObservation | None:
        ref = run.spec.budget.budget_ref if run.spec.budget else None
        if ref is None:
            return None
        key = _key(run.metadata.namespace, ref.name)
        entry.budget = key
        body = self.budgets.get(key)
        if body is None:
            # Not seen by the watch (yet): ask, so a starting operator does not think it missing.
            body = await self.kube.get_budget(run.metadata.namespace, ref.name)
            if body is None:
                return BudgetObservation(name=ref.name, missing=True)
            self.budgets[key] = body
        budget = WorkerBudget.model_validate(body)
        status = budgets.refresh(budget, now)
        if status.period_start != budget.status.period_start:
            self._spawn(self._refresh_budget(run.metadata.namespace, ref.name))
        start = budgets.period_start(now, budget.spec)
        next_reset = None
        if start is not None:
            probe = now
            while budgets.period_start(probe, budget.spec) == start:
                probe += dt.timedelta(hours=1)
            next_reset = (budgets.period_start(probe, budget.spec) - now).total_seconds()  # type: ignore[operator]
        return BudgetObservation(
            name=ref.name, exhausted=budgets.exhausted(budget.spec, status.spent),
            remaining=status.remaining or Usage(), charged=budgets.charged(budget, run.metadata.uid),
            next_reset_seconds=next_reset)

    async def _still_current(self, entry: RunEntry, actions: list[Action]) -> bool:
        """Guards against acting on stale observations.

        A lapse is confirmed with a fresh GET of the Lease (a stalled watch must
        not make every worker look dead), and repairs that are not preceded by
        a status write (after a crash) are confirmed with a fresh GET of the run.
        """
        assert entry.run is not None
        meta = entry.run["metadata"]
        if any(isinstance(a, WriteStatus) and a.ends_attempt for a in actions):
            # Confirm a lapse (a stalled watch must not kill workers) and pick up the
            # final usage report before the attempt's books are closed.
            lease = await self.kube.get_lease(meta["namespace"], meta["name"])
            tracked = self.leases.get(entry.key)
            if lease is not None and (tracked is None or
                                      lease["metadata"]["resourceVersion"] != tracked.resource_version):
                self.leases.observe(entry.key, lease, self.clock.mono())
                log.info("the lease moved; deciding again", extra={"run": entry.key, "event": "lease_refreshed"})
                return False
        if not any(isinstance(a, WriteStatus) for a in actions) and \
                any(isinstance(a, (EnsureLease, EnsurePod, ChargeBudget)) for a in actions):
            try:
                fresh = await self.kube.get_run(meta["namespace"], meta["name"])
            except NotFound:
                entry.run = None
                return False
            if fresh["metadata"]["resourceVersion"] != meta["resourceVersion"]:
                entry.run = fresh
                return False
        return True

    # --- actions -------------------------------------------------------------

    def _log(self, msg: str, run: WorkerRun, event: str, level: int = logging.INFO, **extra: Any) -> None:
        s = run.status
        log.log(level, msg, extra={
            "event": event, "run": run.key, "attempt": s.attempt, "fence": s.fence, "holder": s.holder,
            "leaseDeadline": s.lease_expires_at.isoformat() if s.lease_expires_at else None, **extra})

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_event(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        try:
            await self.kube.post_event(body, type_, reason, message)
        except Exception as exc:  # noqa: BLE001 - events are best effort
            log.warning("event not posted", extra={"reason": reason, "error": str(exc)})

    async def _execute(self, entry: RunEntry, run: WorkerRun, action: Action) -> bool:
        ns, name = run.metadata.namespace, run.metadata.name
        now = self.clock.now()
        try:
            if isinstance(action, WriteStatus):
                return await self._write_status(entry, run, action)
            if isinstance(action, EnsureLease):
                return await self._set_lease(entry, run, action.holder, action.fence, action.duration_seconds, now,
                                             action.signals)
            if isinstance(action, ClearLease):
                return await self._set_lease(entry, run, None, action.fence, run.spec.lease.duration_seconds, now, "")
            if isinstance(action, EnsurePod):
                await self._ensure_pod(entry, run, action)
            elif isinstance(action, DeletePod):
                await self.kube.delete_pod(ns, action.name)
                self._log("pod deleted", run, "pod_deleted", pod=action.name)
            elif isinstance(action, ReleasePod):
                await self.kube.remove_finalizer(ns, action.name, c.POD_FINALIZER)
            elif isinstance(action, EnsureSignals):
                written = await self.kube.patch_lease_signals(ns, name, action.fence, action.signals)
                self.leases.observe(entry.key, written, self.clock.mono())
            elif isinstance(action, ChargeBudget):
                return await self._charge(entry, run, action)
            elif isinstance(action, DeleteRun):
                await self.kube.delete_run(ns, name, run.metadata.uid)
                self._log("finished run deleted (ttlSecondsAfterFinished)", run, "run_deleted")
            return True
        except (Conflict, Invalid):
            # Invalid: a JSON-patch test failed (the lease moved on); decide again.
            return False

    async def _charge(self, entry: RunEntry, run: WorkerRun, action: ChargeBudget) -> bool:
        """CAS on the budget's status; the per-run mark makes a repeated charge add nothing."""
        ns = run.metadata.namespace
        for _ in range(10):
            body = await self.kube.get_budget(ns, action.budget)
            if body is None:
                return False
            budget = WorkerBudget.model_validate(body)
            status = budgets.apply_charge(budget, run.metadata.uid, run.metadata.name, action.total, self.clock.now())
            before = budgets.charged(budget, run.metadata.uid)
            body["status"] = status.dump()
            try:
                written = await self.kube.replace_budget_status(body)
            except Conflict:
                continue  # another run charged first: re-read and apply our difference again
            self.budgets[_key(ns, action.budget)] = written
            metrics.BUDGET_CHARGED_CENTS.labels(ns, action.budget).inc(max(0, action.total.cents - before.cents))
            metrics.BUDGET_CHARGED_TOKENS.labels(ns, action.budget).inc(max(0, action.total.tokens - before.tokens))
            self._log("usage charged", run, "budget_charged", budget=action.budget,
                      cents=action.total.cents - before.cents, tokens=action.total.tokens - before.tokens)
            return True
        return False

    async def _write_status(self, entry: RunEntry, run: WorkerRun, action: WriteStatus) -> bool:
        assert entry.run is not None
        body = copy.deepcopy(entry.run)
        body["status"] = action.status.dump()
        meta = body["metadata"]
        try:
            entry.run = await self.kube.replace_run_status(body)
        except (Conflict, NotFound):
            # Someone else wrote first (a worker's result, a spec change): decide again on fresh data.
            try:
                entry.run = await self.kube.get_run(meta["namespace"], meta["name"])
            except NotFound:
                entry.run = None
            return False
        written = WorkerRun.model_validate(entry.run)
        self._count(action, written)
        if action.log:
            self._log(f"run {written.status.phase.value if written.status.phase else ''}", written, action.log,
                      **dict(action.log_fields))
        for ev in action.events:
            self._spawn(self._post_event(entry.run, ev.type, ev.reason, ev.message))
        return True

    @staticmethod
    def _count(action: WriteStatus, written: WorkerRun) -> None:
        if action.log == "job_claimed":
            metrics.ATTEMPTS_STARTED.inc()
            if written.status.attempt > 1:
                metrics.REGRANTS.inc()
        if action.ends_attempt:
            ended = [a for a in written.status.attempts if a.outcome is not None]
            if ended:
                metrics.ATTEMPTS_ENDED.labels(ended[-1].outcome.value).inc()  # type: ignore[union-attr]
        if action.log == "heartbeat_lost":
            metrics.LEASE_LAPSES.inc()
            silence = dict(action.log_fields).get("silenceSeconds")
            if isinstance(silence, (int, float)):
                metrics.LAPSE_DETECTION.observe(float(silence))

    async def _set_lease(self, entry: RunEntry, run: WorkerRun, holder: str | None, fence: int, duration: int,
                         now: dt.datetime, signals: str) -> bool:
        ns, name = run.metadata.namespace, run.metadata.name
        for _ in range(5):
            current = await self.kube.get_lease(ns, name)
            if holder is not None and run.spec.executor == "External" and not entry.rbac_ready:
                await self._ensure_worker_rbac(entry, run)  # the gateway's tool claims use this account
            if current is None:
                if holder is None:
                    return True
                written = await self.kube.create_lease(resources.build_lease(run, holder, fence, duration, now, signals))
                self.leases.observe(entry.key, written, self.clock.mono())
                return True
            spec = current.get("spec", {}) or {}
            have = spec.get("leaseTransitions") or 0
            if have > fence:
                # Never move a lease's fence backwards, whatever a stale decision says.
                self._log("lease already has a higher fence", run, "lease_fence_ahead", logging.WARNING, leaseFence=have)
                return False
            if spec.get("holderIdentity") == holder and have == fence:
                self.leases.observe(entry.key, current, self.clock.mono())
                return True
            try:
                written = await self.kube.replace_lease(
                    resources.regrant_lease(current, holder, fence, duration, now, signals))
            except Conflict:
                continue  # the old holder renewed in between; our write must still win
            self.leases.observe(entry.key, written, self.clock.mono())
            previous = spec.get("holderIdentity")
            if previous and previous != holder and run.spec.executor == "External":
                # Every tool credential of the old attempt is bound to this Secret: it dies with it.
                await self.kube.delete_secret(ns, f"{previous}-toolclaim")
            return True
        return False

    async def _ensure_worker_rbac(self, entry: RunEntry, run: WorkerRun) -> None:
        for path, obj in resources.build_worker_rbac(run):
            await self.kube.apply(path, obj)
        entry.rbac_ready = True

    async def _ensure_pod(self, entry: RunEntry, run: WorkerRun, action: EnsurePod) -> None:
        ns = run.metadata.namespace
        if not entry.rbac_ready:
            await self._ensure_worker_rbac(entry, run)
        pod = resources.build_pod(run, action.name, action.attempt, action.fence, action.holder)
        try:
            created = await self.kube.create_pod(pod)
            self._log("pod created", run, "pod_created", pod=action.name)
        except Conflict:
            # Same deterministic name: the pod from before a crash. Adopt it.
            existing = await self.kube.get_pod(ns, action.name)
            if existing is None:
                raise
            created = existing
            self._log("pod adopted", run, "pod_adopted", pod=action.name)
        entry.pods[action.name] = created
