"""The WorkerRun controller: watch events fill a cache and queue keys; workers reconcile.

The shape is controller-runtime's:
- watch events (from the kopf handlers) only update the cache and add the run's key to a
  rate-limited work queue; a burst of events for one run is one reconcile;
- a bounded number of workers take keys; one key is never reconciled twice at once;
- a reconcile takes one immutable snapshot (run, lease observation, pods), decides, and
  every write it makes is conditional on that snapshot: the status PUT carries the
  snapshot's resourceVersion, never a newer one that arrived meanwhile;
- a conflict means "decide again from fresh data"; an error backs the key off
  exponentially; a timed pass (lease deadline, backoff, TTL) is `add_after`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable

from pydantic import ValidationError

from tether import metrics, protocol
from tether.api import constants as c
from tether.api.conditions import get_condition, set_condition
from tether.api.models import GROUP, VERSION, Outcome, Phase, Usage, WorkerRun
from tether.controller.budgets import BudgetBook
from tether.controller.leases import LeaseTracker
from tether.controller.rbac import WorkerRbac
from tether.controller.workqueue import ExponentialBackoff, WorkQueue
from tether.core.decide import (
    Action,
    Change,
    ChargeBudget,
    ClearLease,
    DeletePod,
    DeleteRun,
    EnsureLease,
    EnsurePod,
    EnsureSignals,
    ForeignPod,
    LeaseObservation,
    Observed,
    PodObservation,
    ReleaseCharge,
    ReleasePod,
    RemoveFinalizer,
    Revoke,
    UsageAlarm,
    WriteStatus,
    decide,
)
from tether.core.liveness import mass_lapse
from tether.core.observe import ApprovalObservation
from tether.core.review import needs_approvals
from tether.kube import resources
from tether.kube.client import (
    ApiError,
    Conflict,
    Forbidden,
    Invalid,
    KubeClient,
    NotFound,
    Unavailable,
    budget_path,
    lease_path,
    run_path,
)
from tether.kube.health import SLOW_SECONDS

log = logging.getLogger("tether.controller")

RunKey = tuple[str, str]  # (namespace, name)

# How long a namespace that refused a create as "being terminated" gets no new attempts.
TERMINATING_NAMESPACE_SECONDS = 30.0
# A reconcile that acted is followed at once by another pass; past this many passes in a
# row that all acted, the next ones back off (a decision that never converges must not spin).
MAX_ACTING_STREAK = 8
# How often a namespace being deleted (no longer watched by kopf) is listed.
SWEEP_SECONDS = 2.0

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


@dataclass
class Clock:
    """Injected clocks: wall time for status timestamps, monotonic time for lapses."""

    now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc)
    mono: Callable[[], float] = time.monotonic


@dataclass(frozen=True)
class Snapshot:
    """What one reconcile decided from. `body` is the run exactly as read: never mutated,
    and its resourceVersion is the precondition of the status write."""

    key: RunKey
    body: dict[str, Any]
    run: WorkerRun
    lease: LeaseObservation | None
    pods: tuple[PodObservation, ...]
    # Pods labelled for this run's name that another (deleted) run controls.
    foreign_pods: tuple[ForeignPod, ...] = ()
    # The Lease as this pass last read it ((None,): absent); None: not read. A write based on it
    # is still a compare-and-swap, so a stale read costs a conflict and a re-read, nothing more.
    lease_read: tuple[dict[str, Any] | None] | None = None

    @property
    def uid(self) -> str:
        return self.run.metadata.uid


class Again(Exception):
    """The snapshot is out of date (a conflict, a moved lease): decide again from fresh data."""


class Inconclusive(Exception):
    """A lapse could not be confirmed (slow or failed read, an outage): look again later."""

    def __init__(self, why: str, retry_in: float) -> None:
        super().__init__(why)
        self.retry_in = retry_in


class SpecError(Exception):
    """The API server refused an object built from the spec (422, 403 by policy): not transient."""

    def __init__(self, reason: str, api_error: ApiError) -> None:
        super().__init__(api_error.message)
        self.reason = reason
        self.api_error = api_error


# kube-apiserver accepts a pod-bound token until a minute (its JWT leeway) past the pod's
# deletionTimestamp, and caches a successful authentication for 10 s; 15 s more for clock skew.
BOUND_TOKEN_AFTER_DELETION = dt.timedelta(seconds=85)
# Once the pod is gone its token fails the API server's lookup, except from that 10 s cache and
# its pod lister's lag.
BOUND_TOKEN_AFTER_GONE = dt.timedelta(seconds=20)


def _budget_of(key: RunKey, run: dict[str, Any]) -> tuple[str, str]:
    ref = ((run.get("spec") or {}).get("budget") or {}).get("budgetRef") or {}
    return key[0], str(ref.get("name") or "")


def _budget_gate(budget: dict[str, Any]) -> tuple[Any, ...]:
    """What of a WorkerBudget decides whether runs may spend: its spec, period and exhaustion."""
    status = budget.get("status") or {}
    exhausted = next((x.get("status") for x in status.get("conditions") or [] if x.get("type") == "Exhausted"), None)
    return budget["metadata"].get("generation"), status.get("periodStart"), exhausted


def approval_observation(body: dict[str, Any]) -> ApprovalObservation | None:
    """A WorkerRunApproval as decide reads it (None for one the schema should have refused)."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    created = protocol.parse_time(meta.get("creationTimestamp"))
    ref = spec.get("runRef") or {}
    if created is None or not ref.get("name") or spec.get("decision") not in ("Approve", "Deny"):
        return None
    return ApprovalObservation(name=meta["name"], gate=str(spec.get("gate", "")), decision=spec["decision"],
                               approver=str(spec.get("approver", "")), reason=str(spec.get("reason") or ""),
                               created=created, run_uid=ref.get("uid") or None,
                               attempt=spec["attempt"] if isinstance(spec.get("attempt"), int) else None)


def foreign_pod(pod: dict[str, Any], gone_at: dt.datetime | None = None) -> ForeignPod:
    """A pod another run controls, and until when the API server may accept its bound token."""
    deleting = protocol.parse_time(pod["metadata"].get("deletionTimestamp"))
    dead_at = deleting + BOUND_TOKEN_AFTER_DELETION if deleting else None
    if gone_at is not None:
        dead_at = min(dead_at, gone_at + BOUND_TOKEN_AFTER_GONE) if dead_at else gone_at + BOUND_TOKEN_AFTER_GONE
    return ForeignPod(name=pod["metadata"]["name"], token_dead_at=dead_at)


# What the caches keep of a pod: what pod_observation, foreign_pod and the stray release read.
_POD_META = ("name", "namespace", "uid", "resourceVersion", "labels", "ownerReferences", "finalizers",
             "deletionTimestamp")
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def lean_run(body: dict[str, Any]) -> dict[str, Any]:
    """The run as cached: without managedFields and kubectl's copy of the last applied manifest,
    which together are about half of it. A status PUT of this body changes only the status (the
    subresource ignores the rest) and keeps the stored managedFields (omitted, not emptied)."""
    meta = body.get("metadata") or {}
    ann = meta.get("annotations") or {}
    if "managedFields" not in meta and LAST_APPLIED not in ann:
        return body
    slim = {k: v for k, v in meta.items() if k != "managedFields"}
    if LAST_APPLIED in ann:
        slim["annotations"] = {k: v for k, v in ann.items() if k != LAST_APPLIED}
    return {**body, "metadata": slim}


def lean_pod(body: dict[str, Any]) -> dict[str, Any]:
    """The pod as cached: its identity, owner, finalizers and how its containers ended (a full pod
    with managedFields is six times that; thousands of runs keep thousands of pods)."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    states = [{"state": cs.get("state")} for cs in status.get("containerStatuses") or []]
    return {"metadata": {k: meta[k] for k in _POD_META if k in meta},
            "status": {"phase": status.get("phase"), "containerStatuses": states}}


def pod_observation(pod: dict[str, Any]) -> PodObservation | None:
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
                          deletion_due=protocol.parse_time(meta.get("deletionTimestamp")),
                          has_finalizer=c.POD_FINALIZER in (meta.get("finalizers") or []))


def _fence(body: dict[str, Any] | None) -> int:
    return int(((body or {}).get("status") or {}).get("fence") or 0)


@dataclass
class _KeyState:
    """Per-run bookkeeping that is not an observation of the cluster."""

    usage_alarm: UsageAlarm | None = None
    acting_streak: int = 0
    last_problem: str = ""  # the last error logged, so each is logged once per change


class RunController:
    def __init__(self, kube: KubeClient, clock: Clock | None = None, fold_interval: float = 10.0,
                 may_act: Callable[[], bool] = lambda: True, workers: int = 16,
                 namespace_identity: bool = True) -> None:
        self.kube = kube
        self.may_act = may_act
        self.clock = clock or Clock()
        self.fold_interval = fold_interval
        self.workers = workers
        self.queue: WorkQueue[RunKey] = WorkQueue(ExponentialBackoff(base=0.05, cap=300.0))
        self.runs: dict[RunKey, dict[str, Any]] = {}
        self.pods: dict[RunKey, dict[str, dict[str, Any]]] = {}
        self.leases = LeaseTracker()  # keyed by the owning run's UID
        self.budgets = BudgetBook(kube, self.clock.now)
        self.rbac = WorkerRbac(kube, shared=namespace_identity)
        self.state: dict[RunKey, _KeyState] = {}
        # Run UID -> the run's fence when this operator last deleted its ended attempts' tool claims.
        self.tool_claims_cleared: dict[str, int] = {}
        self.terminating: dict[str, float] = {}
        # (namespace, budget name) -> the runs that draw on it (a budgetRef never changes).
        self.budget_runs: dict[tuple[str, str], set[RunKey]] = {}
        self._overdue_counted: tuple[float | None, tuple[int, int]] = (None, (0, 0))
        # Pods that were deleted, by (run key, name): (their controller's UID, as ForeignPod). A
        # namesake's pod can still act for a few seconds after it is gone (see foreign_pod).
        self.pod_tombstones: dict[tuple[RunKey, str], tuple[str | None, ForeignPod]] = {}  # namespace -> monotonic time it was seen terminating
        self._sweepers: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._dispatch: dict[type, Callable[[Snapshot, Any], Awaitable[Snapshot]]] = {
            WriteStatus: self._write_status,
            Revoke: self._revoke,
            EnsureLease: self._ensure_lease,
            ClearLease: self._clear_lease,
            EnsurePod: self._ensure_pod,
            DeletePod: self._delete_pod,
            ReleasePod: self._release_pod,
            EnsureSignals: self._ensure_signals,
            ChargeBudget: self._charge,
            ReleaseCharge: self._release_charge,
            DeleteRun: self._delete_run,
            RemoveFinalizer: self._remove_finalizer,
        }

    # --- life cycle ----------------------------------------------------------

    def start(self) -> None:
        """Starts the workers and the API health probe (in the running event loop)."""
        if self._tasks:
            return
        self._tasks = [asyncio.create_task(self._worker(), name=f"reconcile worker {i}") for i in range(self.workers)]
        self._tasks.append(asyncio.create_task(self.kube.health.probe_forever(self.kube.ready), name="api probe"))

    async def stop(self) -> None:
        self.queue.shutdown()
        tasks = self._tasks + list(self._background) + list(self._sweepers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.budgets.stop()

    def _state(self, key: RunKey) -> _KeyState:
        st = self.state.get(key)
        if st is None:
            st = self.state[key] = _KeyState()
        return st

    # --- watch events: cache and queue, nothing else ------------------------

    def on_run(self, event_type: str | None, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        cached = self.runs.get(key)
        if event_type == "DELETED":
            if cached is not None and cached["metadata"].get("uid") == meta.get("uid"):
                del self.runs[key]
                self.budget_runs.get(_budget_of(key, body), set()).discard(key)
            self.leases.forget(meta.get("uid", ""))
            self.rbac.forget(meta.get("uid", ""))
            self.tool_claims_cleared.pop(meta.get("uid", ""), None)
            self.queue.add(key)  # release what is left of it (pods)
            return
        if cached is not None:
            if meta.get("resourceVersion") == cached["metadata"].get("resourceVersion"):
                return
            if meta.get("uid") == cached["metadata"].get("uid") and _fence(body) < _fence(cached):
                return  # older than what our own write returned (the fence never decreases)
            if meta.get("generation") != cached["metadata"].get("generation"):
                self.queue.forget(key)  # a new spec: an error backoff of the old one no longer applies
        self.runs[key] = lean_run(body)
        self.budget_runs.setdefault(_budget_of(key, body), set()).add(key)
        self.queue.add(key)

    def on_lease(self, event_type: str | None, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        run_name = (meta.get("labels") or {}).get(c.LABEL_RUN)
        uid = protocol.controller_uid(body)
        if not run_name or uid is None:
            return
        key = (meta["namespace"], run_name)
        before = self.leases.get(uid)
        if event_type == "DELETED":
            self.leases.forget(uid)
            changed = True
        else:
            mono = self.clock.mono()
            changed = self.leases.observe(uid, body, mono)
            renewed = (body.get("spec") or {}).get("renewTime")
            seen = self.leases.get(uid)
            if event_type is not None and renewed and seen is not None and seen.last_change == mono:
                # A renewal (not a signal update by the operator) just arrived by watch.
                lag = self.clock.now() - protocol.parse_time(renewed)  # type: ignore[operator]  # renewed is set here
                metrics.WATCH_LAG.observe(max(0.0, lag.total_seconds()))
        tracked = self.leases.get(uid)
        if not changed and key in self.runs and before is not None and tracked is not None and \
                (before.usage, before.checkpoint) != (tracked.usage, tracked.checkpoint) and \
                not self.queue.backoff.failures(key):  # never cut an error backoff short
            # New progress or spending reaches the status within one fold interval (one timer per
            # run, however many heartbeats), not only at the next lapse check a lease later.
            self.queue.add_after(key, self.fold_interval)
        alarm = self.state[key].usage_alarm if key in self.state else None
        if alarm is not None and tracked is not None and tracked.usage is not None and alarm.reached(tracked.usage):
            changed = True  # a cap or the budget is reached: act now, not at the next fold
        if changed and key in self.runs:
            self.queue.add(key)

    def on_budget(self, event_type: str | None, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        before = self.budgets.cache.get((meta["namespace"], meta["name"]))
        budget = self.budgets.on_event(event_type, body)
        # A charge (every fold of every run on it) concerns only runs waiting to be admitted; a
        # new limit or period, or the budget running out or coming back, concerns all its runs.
        # Held runs see the spending of others at their own next pass (at most a fold interval).
        everyone = event_type == "DELETED" or before is None or _budget_gate(before) != _budget_gate(body)
        for key in list(self.budget_runs.get(budget, ())):
            run = self.runs.get(key)
            if run is not None and (everyone or not (run.get("status") or {}).get("holder")):
                self.queue.add(key)

    def on_pod(self, event_type: str | None, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        run_name = (meta.get("labels") or {}).get(c.LABEL_RUN)
        if not run_name:
            return
        key = (meta["namespace"], run_name)
        pods = self.pods.setdefault(key, {})
        before = pods.get(meta["name"])
        if event_type == "DELETED":
            pods.pop(meta["name"], None)
            if not pods:
                del self.pods[key]
            now = self.clock.now()
            for k in [k for k, (_, tomb) in self.pod_tombstones.items() if (tomb.token_dead_at or now) <= now]:
                del self.pod_tombstones[k]
            self.pod_tombstones[(key, meta["name"])] = (protocol.controller_uid(body), foreign_pod(body, now))
        else:
            pods[meta["name"]] = lean_pod(body)
        if before is None or event_type == "DELETED" or pod_observation(before) != pod_observation(body):
            self.queue.add(key)

    async def _approvals(self, snap: Snapshot) -> tuple[ApprovalObservation, ...] | None:
        """The approvals naming a run with an open gate (the only state that reads them), read fresh
        from the API server rather than from a watch cache: after a restart or a failover the cache
        may not have listed them all yet, or may still hold a deleted one, and a grant or a
        rejection decided from it cannot be taken back. None when the list fails: the pass decides
        no gate, and everything else (lapses, stops, deadlines) goes on."""
        run = snap.run
        if not needs_approvals(run, snap.lease):
            return ()
        try:
            items = await self.kube.list_objects(
                f"/apis/{GROUP}/{VERSION}/namespaces/{run.metadata.namespace}/workerrunapprovals",
                field_selector=f"spec.runRef.name={run.metadata.name}")
        except ApiError as exc:
            log.warning("approvals not listed; no gate decided this pass",
                        extra={"run": f"{run.metadata.namespace}/{run.metadata.name}", "event": "approvals_unlisted",
                               "status": exc.status})
            return None
        return tuple(a for body in items if ((body.get("spec") or {}).get("runRef") or {}).get("name") == run.metadata.name
                     and (a := approval_observation(body)) is not None)

    def on_approval(self, event_type: str | None, body: dict[str, Any]) -> None:
        """An approval was made (or removed): decide again for the run it names."""
        run_name = ((body.get("spec") or {}).get("runRef") or {}).get("name")
        if run_name:
            self.queue.add((body["metadata"]["namespace"], run_name))

    # --- workers -------------------------------------------------------------

    async def _worker(self) -> None:
        while (key := await self.queue.get()) is not None:
            began = time.monotonic()
            try:
                await self._process(key)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a worker must outlive any bug in error handling
                log.exception("reconcile worker caught an error", extra={"run": "/".join(key),
                                                                         "event": "reconcile_bug"})
                self.queue.add_rate_limited(key)
            finally:
                self.queue.done(key)
                metrics.RECONCILE_TIME.labels("workerrun").observe(time.monotonic() - began)

    async def _process(self, key: RunKey) -> None:
        st = self._state(key)
        try:
            requeue, acted = await self._reconcile(key)
        except asyncio.CancelledError:
            raise
        except Again as exc:
            metrics.RECONCILE_TOTAL.labels("workerrun", "requeue").inc()
            delay = self.queue.add_rate_limited(key)
            log.debug("deciding again", extra={"run": "/".join(key), "event": "reconcile_again",
                                               "reason": str(exc), "retryIn": round(delay, 3)})
            if self.queue.backoff.failures(key) == MAX_ACTING_STREAK:
                self._problem(key, "the run's state keeps moving under its reconciles", "reconcile_churn",
                              str(exc), logging.WARNING)
            return
        except Inconclusive as exc:
            metrics.RECONCILE_TOTAL.labels("workerrun", "requeue").inc()
            self._problem(key, "lapse not judged yet", "lapse_inconclusive", str(exc), logging.INFO)
            self.queue.add_after(key, exc.retry_in)
            return
        except SpecError as exc:
            metrics.RECONCILE_TOTAL.labels("workerrun", "error").inc()
            metrics.RECONCILE_ERRORS.labels("workerrun").inc()
            delay = self.queue.add_rate_limited(key)
            self._problem(key, "the API server refused an object built from the spec", "reconcile_refused",
                          str(exc), logging.WARNING, retryIn=round(delay, 3), reason=exc.reason)
            await self._record_refusal(key, exc)
            return
        except (Unavailable, Conflict, NotFound) as exc:
            metrics.RECONCILE_TOTAL.labels("workerrun", "error").inc()
            metrics.RECONCILE_ERRORS.labels("workerrun").inc()
            delay = self.queue.add_rate_limited(key)
            self._problem(key, "reconcile failed; retrying", "reconcile_failed", str(exc), logging.WARNING,
                          retryIn=round(delay, 3))
            return
        except Exception as exc:  # noqa: BLE001 - a bug: log its traceback, keep the other runs going
            metrics.RECONCILE_TOTAL.labels("workerrun", "error").inc()
            metrics.RECONCILE_ERRORS.labels("workerrun").inc()
            delay = self.queue.add_rate_limited(key)
            if st.last_problem != f"bug:{exc}":
                st.last_problem = f"bug:{exc}"
                log.exception("reconcile failed unexpectedly; retrying",
                              extra={"run": "/".join(key), "retryIn": round(delay, 3), "event": "reconcile_bug"})
            return
        metrics.RECONCILE_TOTAL.labels("workerrun", "success" if requeue is None else "requeue").inc()
        if st.last_problem:
            log.info("reconcile succeeded again", extra={"run": "/".join(key), "event": "reconcile_recovered"})
            st.last_problem = ""
        if acted:
            st.acting_streak += 1
            if st.acting_streak > MAX_ACTING_STREAK:
                self.queue.add_rate_limited(key)
            else:
                self.queue.add(key)  # one more pass on the state our writes produced
            return
        st.acting_streak = 0
        self.queue.forget(key)
        if requeue is not None:
            self.queue.add_after(key, requeue)
        if key not in self.runs and key not in self.pods:
            self.state.pop(key, None)
            self.queue.drop(key)

    def _problem(self, key: RunKey, msg: str, event: str, detail: str, level: int, **extra: Any) -> None:
        """Logs a problem once per change, not on every retry."""
        st = self._state(key)
        if st.last_problem == f"{event}:{detail}":
            return
        st.last_problem = f"{event}:{detail}"
        log.log(level, msg, extra={"run": "/".join(key), "event": event, "error": detail[:500], **extra})

    # --- one reconcile -------------------------------------------------------

    def snapshot(self, key: RunKey) -> Snapshot | None:
        body = self.runs.get(key)
        if body is None:
            return None
        run = WorkerRun.model_validate(body)
        mine = {n: b for n, b in self.pods.get(key, {}).items() if protocol.controller_uid(b) == run.metadata.uid}
        pods = tuple(p for p in map(pod_observation, mine.values()) if p is not None)
        live = self.pods.get(key, {})
        foreign = tuple(foreign_pod(b) for n, b in live.items() if n not in mine) + tuple(
            tomb for (k, n), (owner, tomb) in self.pod_tombstones.items()
            if k == key and n not in live and owner != run.metadata.uid)
        return Snapshot(key=key, body=body, run=run, lease=self.leases.get(run.metadata.uid), pods=pods,
                        foreign_pods=foreign)

    async def _reconcile(self, key: RunKey) -> tuple[float | None, bool]:
        """Returns (seconds until the next timed pass or None, whether to pass again at once:
        something was written, or the decision asked for it)."""
        try:
            snap = self.snapshot(key)
        except ValidationError as exc:
            self._problem(key, "cannot read run; waiting for a change", "run_unreadable", str(exc), logging.ERROR)
            return None, False
        released = await self._release_strays(key, snap)
        if snap is None:
            return None, released
        if not self.may_act():
            return 1.0, False
        if snap.run.metadata.deletion_timestamp is None and c.RUN_FINALIZER not in snap.run.metadata.finalizers:
            await self._add_finalizer(snap)
            return None, True
        ns = snap.run.metadata.namespace
        now, mono = self.clock.now(), self.clock.mono()
        observed = Observed(run=snap.run, lease=snap.lease, pods=snap.pods, foreign_pods=snap.foreign_pods,
                            tool_claims_cleared=self.tool_claims_cleared.get(snap.uid) == snap.run.status.fence,
                            now=now, mono=mono,
                            budget=await self.budgets.observe(snap.run, now), fold_interval=self.fold_interval,
                            api_available_since=self.kube.health.available_since,
                            namespace_terminating=mono - self.terminating.get(ns, -1e18) < TERMINATING_NAMESPACE_SECONDS,
                            approvals=await self._approvals(snap))
        decision = decide(observed)
        log.debug("decided", extra={"run": "/".join(key), "event": "decided", "requeueAfter": decision.requeue_after,
                                    "actions": [type(a).__name__ for a in decision.actions]})
        self._state(key).usage_alarm = decision.usage_alarm
        if not decision.actions:
            return decision.requeue_after, decision.again_now
        snap = await self._confirm(snap, decision.actions)
        for action in decision.actions:
            snap = await self._dispatch[type(action)](snap, action)
        return decision.requeue_after, True

    async def _release_strays(self, key: RunKey, snap: Snapshot | None) -> bool:
        """Pods labelled for this run name that no live run owns (the run was deleted, or a namesake
        replaced it): delete them and drop Tether's finalizer, so nothing hangs in Terminating."""
        uid = snap.uid if snap is not None else None
        # Only pods a (deleted) WorkerRun controls, and only those that still need us: a pod already
        # deleting without our finalizer is the kubelet's business, and must not block the new run.
        strays = [p for p in self.pods.get(key, {}).values()
                  if protocol.controller_uid(p) not in (None, uid)
                  and (not p["metadata"].get("deletionTimestamp")
                       or c.POD_FINALIZER in (p["metadata"].get("finalizers") or []))]
        if not strays or not self.may_act():
            return False
        if snap is None:
            # The cache may simply not have seen the run yet: ask before releasing anything.
            try:
                fresh = await self.kube.get_run(*key)
            except NotFound:
                fresh = None
            if fresh is not None:
                self.on_run("ADDED", fresh)
                raise Again("the run exists after all")
        for pod in strays:
            name = pod["metadata"]["name"]
            if not pod["metadata"].get("deletionTimestamp"):
                await self.kube.delete_pod(key[0], name)
            self._pod_written(key, name, await self.kube.remove_finalizer(key[0], name, c.POD_FINALIZER))
            log.info("released a pod of a deleted run", extra={"run": "/".join(key), "pod": name,
                                                              "event": "stray_pod_released"})
        return True

    async def _add_finalizer(self, snap: Snapshot) -> None:
        """Deleting a run must end its attempt and settle its books first: hold it with a finalizer."""
        meta = snap.body["metadata"]
        try:
            written = await self.kube.set_run_finalizers(
                meta["namespace"], meta["name"], meta["resourceVersion"],
                list(snap.run.metadata.finalizers) + [c.RUN_FINALIZER])
        except (Conflict, NotFound):
            await self._refresh_run(snap.key)
            raise Again("finalizer write conflicted") from None
        self._store_written(snap, written)

    async def _confirm(self, snap: Snapshot, actions: list[Action]) -> Snapshot:
        """Checks what a decision rests on before acting on it.

        Ending an attempt re-reads the Lease: the final usage report must be in the books, and a
        lapse is only real if a fresh, timely read shows no renewal. A grant re-reads it too: a
        Lease that still names an ended attempt (a revocation interrupted before its clear, seen
        by an operator whose cache lacks it, e.g. a new leader) must be cleared and its last
        report settled first, never overwritten. Repairs that are not preceded by a status write
        re-read the run, so they never act on a stale cache.
        """
        ns, name = snap.run.metadata.namespace, snap.run.metadata.name
        ending = next((a.status_write for a in actions if isinstance(a, Revoke)), None)
        if ending is not None:
            since = self.kube.health.available_since
            try:
                lease, took = await self.kube.timed_get(lease_path(ns, name), f"get lease {ns}/{name}")
            except Unavailable as exc:
                if ending.lapse:
                    raise Inconclusive(f"lease read failed: {exc}", 1.0) from None
                raise
            if lease is not None and protocol.controller_uid(lease) == snap.uid and (
                    snap.lease is None or lease["metadata"]["resourceVersion"] != snap.lease.resource_version):
                self.leases.observe(snap.uid, lease, self.clock.mono())
                raise Again("the lease moved")
            if ending.lapse:
                if took > SLOW_SECONDS or since is None or self.kube.health.available_since != since:
                    raise Inconclusive(f"the confirming read took {took:.1f}s or met an outage", 1.0)
                self._check_mass_lapse(snap)
        grant = next((a for a in actions if isinstance(a, WriteStatus) and a.grants), None)
        if grant is not None and snap.run.status.fence == 0 and snap.lease is None:
            # A first grant: no attempt of this run ever had a Lease to leave uncleared. Whatever
            # Lease may exist (a deleted namesake's) makes the create conflict and is read then.
            snap = replace(snap, lease_read=(None,))
        elif grant is not None:
            lease = await self.kube.get_lease(ns, name)
            if lease is not None and protocol.controller_uid(lease) == snap.uid and (
                    snap.lease is None or lease["metadata"]["resourceVersion"] != snap.lease.resource_version):
                self.leases.observe(snap.uid, lease, self.clock.mono())
                raise Again("the lease is not as the grant saw it")
            snap = replace(snap, lease_read=(lease,))  # the grant's Lease write starts from this read
        if grant is not None and grant.status.holder and grant.status.holder not in self.pods.get(snap.key, {}):
            # A deleted namesake's pod of the holder's name that the pod watch has not delivered
            # (after a restart the run may be listed first): its worker would take the grant.
            pod = await self.kube.get_pod(ns, grant.status.holder)
            if pod is not None and protocol.controller_uid(pod) != snap.uid:
                self.on_pod("MODIFIED", pod)
                if grant.status.holder in self.pods.get(snap.key, {}):
                    raise Again(f"pod {grant.status.holder} of another run exists")
        if grant is not None and grant.status.attempt > 1 and await self._namespace_terminating(ns):
            # The namespace controller deletes pods first: a vanished pod there is no reason to retry.
            self._mark_terminating(ns)
            raise Again("the namespace is being deleted")
        closing = any(isinstance(a, (ReleaseCharge, DeleteRun, RemoveFinalizer)) or
                      (isinstance(a, WriteStatus) and a.change == Change.BUDGET_CHARGED) for a in actions)
        if closing:
            await self._books_closed(snap, actions)
        if not any(isinstance(a, (WriteStatus, Revoke)) for a in actions) and \
                any(isinstance(a, (EnsureLease, EnsurePod, ChargeBudget, ReleaseCharge)) for a in actions):
            fresh = await self._refresh_run(snap.key)
            if fresh is None or fresh["metadata"]["resourceVersion"] != snap.body["metadata"]["resourceVersion"]:
                raise Again("the run moved")
        return snap

    async def _books_closed(self, snap: Snapshot, actions: list[Action]) -> None:
        """Before a run's books close (budgetCharged recorded, its mark released, the run deleted or
        let go), what they rest on is read fresh: the Lease — a final usage report it still holds
        (a revocation's last renewal, seen late after a restart) must be settled first — and the
        budget, whose cached view may be older than our own charge (a mark left behind forever)."""
        ns, name = snap.run.metadata.namespace, snap.run.metadata.name
        lease = await self.kube.get_lease(ns, name)
        if lease is not None and protocol.controller_uid(lease) == snap.uid and (
                snap.lease is None or lease["metadata"]["resourceVersion"] != snap.lease.resource_version):
            self.leases.observe(snap.uid, lease, self.clock.mono())
            raise Again("the Lease is newer than the books closing on it")
        ref = snap.run.spec.budget.budget_ref if snap.run.spec.budget else None
        if ref is None or not any(isinstance(a, (DeleteRun, RemoveFinalizer)) for a in actions):
            return
        budget = await self.kube.get_budget(ns, ref.name)
        if budget is not None and snap.uid in ((budget.get("status") or {}).get("charges") or {}):
            self.budgets.on_event("MODIFIED", budget)
            raise Again("the run's mark is still in the budget's ledger")

    async def _namespace_terminating(self, ns: str) -> bool:
        try:
            body = await self.kube.get_object(f"/api/v1/namespaces/{ns}")
        except Forbidden:
            return False  # without the right to look, the create's 403 is the signal
        return body is None or bool(body["metadata"].get("deletionTimestamp"))

    def _mark_terminating(self, ns: str) -> None:
        self.terminating[ns] = self.clock.mono()
        self.rbac.forget_namespace(ns)  # a namespace re-created under that name starts empty
        if ns not in self._sweepers:
            task = asyncio.create_task(self._sweep(ns), name=f"sweep {ns}")
            self._sweepers[ns] = task
            task.add_done_callback(lambda _: self._sweepers.pop(ns, None))

    async def _sweep(self, ns: str) -> None:
        """kopf stops watching a namespace once it is being deleted, yet its runs still need their
        cleanup (our finalizer holds them). Until the namespace is gone, list what is left there
        every few seconds and feed it to the cache as the watch would have."""
        while True:
            try:
                if await self.kube.get_object(f"/api/v1/namespaces/{ns}") is None:
                    break
                runs = await self.kube.list_objects(run_path(ns))
                pods = await self.kube.list_objects(f"/api/v1/namespaces/{ns}/pods", c.LABEL_RUN)
                leases = await self.kube.list_objects(lease_path(ns), c.LABEL_RUN)
                budgets = await self.kube.list_objects(budget_path(ns))
            except (Unavailable, Forbidden, NotFound) as exc:
                log.warning("cannot list a namespace being deleted", extra={"namespace": ns, "error": str(exc)})
            else:
                self._replace_namespace(ns, runs, pods, leases)
                listed = {b["metadata"]["name"] for b in budgets}
                for (bns, name), body in list(self.budgets.cache.items()):
                    if bns == ns and name not in listed:
                        self.budgets.on_event("DELETED", body)
            self.terminating[ns] = self.clock.mono()
            await asyncio.sleep(SWEEP_SECONDS)
        self._replace_namespace(ns, [], [], [])
        self.terminating.pop(ns, None)  # a namespace of that name created later starts afresh

    def _replace_namespace(self, ns: str, runs: list[dict[str, Any]], pods: list[dict[str, Any]],
                           leases: list[dict[str, Any]]) -> None:
        """Like an informer's relist: what is listed is current, what is not listed is gone."""
        for body in runs:
            self.on_run("MODIFIED", body)
        listed = {r["metadata"]["name"] for r in runs}
        for (rns, name), body in list(self.runs.items()):
            if rns == ns and name not in listed:
                self.on_run("DELETED", body)
        for body in leases:
            self.on_lease("MODIFIED", body)
        for body in pods:
            self.on_pod("MODIFIED", body)
        listed = {p["metadata"]["name"] for p in pods}
        for key, cached in list(self.pods.items()):
            if key[0] == ns:
                for name, body in list(cached.items()):
                    if name not in listed:
                        self.on_pod("DELETED", body)

    def _check_mass_lapse(self, snap: Snapshot) -> None:
        """Many leases lapsing together points at the control plane or this operator's view of it,
        not at the workers: then a lapse must last a second full duration before it counts."""
        mono = self.clock.mono()
        overdue, active = self._overdue(mono)
        assert snap.lease is not None
        silence = mono - snap.lease.last_change
        duration = snap.run.spec.lease.duration_seconds
        if mass_lapse(overdue, active) and silence < 2 * duration:
            self._problem(snap.key, "many leases lapsed at once; suspecting the control plane, not the workers",
                          "mass_lapse_suspected", f"{overdue}/{active} overdue", logging.WARNING)
            raise Inconclusive(f"{overdue} of {active} leases overdue", 2 * duration - silence)

    def _overdue(self, mono: float) -> tuple[int, int]:
        """(overdue, active) leases, counted at most once a second: a scan of every run per lapse
        cost 5% of the operator's CPU at 5,000 runs."""
        at, counts = self._overdue_counted
        if at is not None and 0 <= mono - at < 1.0:
            return counts
        active = overdue = 0
        for body in self.runs.values():
            holder = (body.get("status") or {}).get("holder")
            if not holder:
                continue
            active += 1
            lease = self.leases.get(body["metadata"].get("uid", ""))
            duration = ((body.get("spec") or {}).get("lease") or {}).get("durationSeconds", 0)
            if lease is not None and lease.holder == holder and mono - lease.last_change >= duration:
                overdue += 1
        self._overdue_counted = (mono, (overdue, active))
        return overdue, active

    async def _refresh_run(self, key: RunKey) -> dict[str, Any] | None:
        try:
            fresh = await self.kube.get_run(*key)
        except NotFound:
            gone = self.runs.get(key)
            if gone is not None:
                self.on_run("DELETED", gone)
            return None
        self.on_run("MODIFIED", fresh)
        self.runs[key] = lean_run(fresh)  # a GET is the newest view, even if its fence looks lower
        self.budget_runs.setdefault(_budget_of(key, fresh), set()).add(key)
        return fresh

    def _store_written(self, snap: Snapshot, written: dict[str, Any]) -> Snapshot:
        """Our write succeeded against the snapshot, so nothing came between the two: cache the
        result unless the watch already brought it (or something newer)."""
        cached = self.runs.get(snap.key)
        if cached is not None and cached["metadata"].get("resourceVersion") == \
                snap.body["metadata"].get("resourceVersion"):
            self.runs[snap.key] = lean_run(written)  # (never re-adds a run whose deletion was seen meanwhile)
        return replace(snap, body=written, run=WorkerRun.model_validate(written))

    # --- actions: each returns the snapshot the next action works from -------

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

    async def _write_status(self, snap: Snapshot, action: WriteStatus) -> Snapshot:
        # The snapshot's own metadata: its resourceVersion is the compare-and-swap precondition.
        body = {**snap.body, "status": action.status.dump()}
        try:
            written = await self.kube.replace_run_status(body)
        except (Conflict, NotFound):
            # Someone else wrote first (a worker's result, a spec change): decide again on fresh data.
            await self._refresh_run(snap.key)
            raise Again("status write conflicted") from None
        snap = self._store_written(snap, written)
        self._count(action, snap.run)
        event = log_event(action)
        if event:
            self._log(f"run {snap.run.status.phase.value if snap.run.status.phase else ''}", snap.run, event,
                      **dict(action.details))
        for ev in action.events:
            self._spawn(self._post_event(written, ev.type, ev.reason, ev.message))
        return snap

    @staticmethod
    def _count(action: WriteStatus, written: WorkerRun) -> None:
        if action.grants:
            metrics.ATTEMPTS_STARTED.inc()
            if written.status.attempt > 1:
                metrics.REGRANTS.inc()
        if action.ends_attempt:
            ended = [a for a in written.status.attempts if a.outcome is not None]
            if ended:
                metrics.ATTEMPTS_ENDED.labels(ended[-1].outcome.value).inc()  # type: ignore[union-attr]
        for gate, decision, seconds in dict(action.details).get("approvals") or ():  # type: ignore[attr-defined]
            metrics.APPROVAL_DECISION.labels(gate, decision).observe(seconds)
        if action.lapse:
            metrics.LEASE_LAPSES.inc()
            silence = dict(action.details).get("silenceSeconds")
            if isinstance(silence, (int, float)):
                metrics.LAPSE_DETECTION.observe(float(silence))

    async def _ensure_lease(self, snap: Snapshot, action: EnsureLease) -> Snapshot:
        if snap.run.spec.executor == "External":
            await self._rbac(snap)  # the gateway's tool claims use the worker's account
        await self._set_lease(snap, action.holder, action.fence, action.duration_seconds, action.signals)
        return snap

    async def _clear_lease(self, snap: Snapshot, action: ClearLease) -> Snapshot:
        await self._set_lease(snap, None, action.fence, snap.run.spec.lease.duration_seconds, "")
        return snap

    async def _set_lease(self, snap: Snapshot, holder: str | None, fence: int, duration: int, signals: str,
                         tool_claims: bool = True) -> None:
        """Writes the Lease for `holder` at `fence` (None: clears it). A holder that loses the Lease
        loses its tool-claim Secret too, unless `tool_claims` is False (the caller deletes it later)."""
        run = snap.run
        ns, name = run.metadata.namespace, run.metadata.name
        now = self.clock.now()
        read = snap.lease_read
        for _ in range(5):
            current = read[0] if read is not None else await self.kube.get_lease(ns, name)
            read = None  # after a conflict, read again
            if current is not None and protocol.controller_uid(current) != snap.uid:
                if protocol.controller_uid(current) is None:
                    # Not Tether's (an application's own Lease of that name): never touch it.
                    raise SpecError("LeaseConflict", Conflict(
                        409, f"Lease {ns}/{name} exists and no WorkerRun controls it; rename the run or the Lease",
                        f"lease {ns}/{name}"))
                # Left by a deleted run of the same name: never adopt it.
                await self.kube.delete_object(lease_path(ns, name), current["metadata"]["uid"])
                current = None
            if current is None:
                self.leases.forget(snap.uid)  # what we knew of it is gone with it
                if holder is None:
                    if tool_claims:
                        await self._delete_tool_claim(snap, None)
                    return
                try:
                    written = await self._refusable(self.kube.create_lease(
                        resources.build_lease(run, holder, fence, duration, now, signals)), "LeaseRefused", ns)
                except Conflict:
                    continue
                self.leases.observe(snap.uid, written, self.clock.mono())
                return
            spec = current.get("spec", {}) or {}
            have = spec.get("leaseTransitions") or 0
            if have > fence:
                # Someone other than Tether moved the fence ahead: decide (revoke past it) on what is there.
                self.leases.observe(snap.uid, current, self.clock.mono())
                raise Again("the lease carries a foreign fence")
            previous = spec.get("holderIdentity")
            if previous == holder and have == fence:
                self.leases.observe(snap.uid, current, self.clock.mono())
                if holder is None and tool_claims:
                    await self._delete_tool_claim(snap, None)
                return
            try:
                written = await self._refusable(self.kube.replace_lease(
                    resources.regrant_lease(current, holder, fence, duration, now, signals)), "LeaseRefused", ns)
            except Conflict:
                continue  # the old holder renewed in between; our write must still win
            self.leases.observe(snap.uid, written, self.clock.mono())
            if previous != holder and tool_claims:
                await self._delete_tool_claim(snap, previous)
            return
        raise Again("the lease kept changing")

    async def _revoke(self, snap: Snapshot, action: Revoke) -> Snapshot:
        """Revocation in the protocol's order: status (the fence moves), Lease (cleared at the new
        fence), pods, tool-claim Secrets. The first failure raises and stops it. Every step is
        idempotent: a pass interrupted after the status write finds no holder and a Lease that
        still names one, clears it (ClearLease, which deletes the tool claims too), and deletes
        the pod as one of an ended attempt."""
        snap = await self._write_status(snap, action.status_write)
        await self._set_lease(snap, None, action.fence, snap.run.spec.lease.duration_seconds, "", tool_claims=False)
        for name in action.pods_to_delete:
            snap = await self._delete_pod(snap, DeletePod(name))
        for holder in action.tool_claim_holders:
            await self._delete_tool_claim(snap, holder)
        return snap

    async def _delete_tool_claim(self, snap: Snapshot, previous: str | None) -> None:
        """Every tool credential of an ended External attempt is bound to its Secret: it dies with it.
        Idempotent: a revocation that finds the Lease already cleared still deletes it."""
        if snap.run.spec.executor != "External":
            return
        ns = snap.run.metadata.namespace
        holders = {previous} if previous else set()
        holders.update(a.holder for a in snap.run.status.attempts if a.outcome is not None and a.holder)
        for holder in holders:
            await self.kube.delete_secret(ns, f"{holder}-toolclaim")
        self.tool_claims_cleared[snap.uid] = snap.run.status.fence

    async def _refusable(self, call: Awaitable[dict[str, Any]], reason: str, ns: str) -> dict[str, Any]:
        """Turns the API server's refusal of an object built from the spec into a SpecError
        (recorded, backed off), and learns from a namespace that is being deleted."""
        try:
            return await call
        except Invalid as exc:
            raise SpecError(reason, exc) from None
        except Forbidden as exc:
            if exc.namespace_terminating:
                self._mark_terminating(ns)
            raise SpecError(reason, exc) from None

    async def _rbac(self, snap: Snapshot) -> None:
        try:
            await self.rbac.ensure(snap.run)
        except Invalid as exc:
            self.rbac.forget_namespace(snap.run.metadata.namespace)
            raise SpecError("WorkerIdentityRefused", exc) from None

    async def _ensure_pod(self, snap: Snapshot, action: EnsurePod) -> Snapshot:
        run = snap.run
        ns = run.metadata.namespace
        await self._rbac(snap)
        pod = resources.build_pod(run, action.name, action.attempt, action.fence, action.holder,
                                  shared=self.rbac.shared)
        try:
            created = await self._refusable(self.kube.create_pod(pod), "PodRefused", ns)
            self._log("pod created", run, "pod_created", pod=action.name)
        except SpecError:
            self.rbac.forget_namespace(ns)  # e.g. its worker ServiceAccount was deleted: made again next time
            raise
        except Conflict:
            # Same deterministic name: the pod from before a crash. Adopt it, if it is this run's.
            existing = await self.kube.get_pod(ns, action.name)
            if existing is None:
                raise Again("the pod vanished") from None
            if protocol.controller_uid(existing) != snap.uid:
                self.on_pod("MODIFIED", existing)  # a stray of a deleted namesake: released next pass
                raise Again("a namesake's pod is in the way") from None
            created = existing
            self._log("pod adopted", run, "pod_adopted", pod=action.name)
        self.on_pod("ADDED", created)
        return snap

    async def _delete_pod(self, snap: Snapshot, action: DeletePod) -> Snapshot:
        self._pod_written(snap.key, action.name, await self.kube.delete_pod(snap.run.metadata.namespace, action.name))
        self._log("pod deleted", snap.run, "pod_deleted", pod=action.name)
        return snap

    async def _release_pod(self, snap: Snapshot, action: ReleasePod) -> Snapshot:
        self._pod_written(snap.key, action.name, await self.kube.remove_finalizer(
            snap.run.metadata.namespace, action.name, c.POD_FINALIZER))
        return snap

    def _pod_written(self, key: RunKey, name: str, body: dict[str, Any] | None) -> None:
        """Our own write's answer updates the cache at once: the next pass must not act on the
        pod as it was (and in a namespace being deleted, no watch event will follow)."""
        if body is not None:
            self.on_pod("MODIFIED", body)
            return
        pods = self.pods.get(key, {})
        pods.pop(name, None)
        if not pods:
            self.pods.pop(key, None)

    async def _ensure_signals(self, snap: Snapshot, action: EnsureSignals) -> Snapshot:
        ns, name = snap.run.metadata.namespace, snap.run.metadata.name
        try:
            written = await self.kube.patch_lease_signals(ns, name, action.fence, action.signals)
        except (Invalid, NotFound):
            raise Again("the lease moved on") from None  # the `test` failed: the lease moved on
        self.leases.observe(snap.uid, written, self.clock.mono())
        return snap

    async def _charge(self, snap: Snapshot, action: ChargeBudget) -> Snapshot:
        async def baseline() -> Usage | None:
            # The snapshot may predate the run's own record of its charge (a watch event older
            # than our write, another replica): the baseline comes from a fresh read.
            fresh = await self._refresh_run(snap.key)
            if fresh is None or fresh["metadata"].get("uid") != snap.uid:
                return None
            return WorkerRun.model_validate(fresh).status.charged or Usage()

        added = await self.budgets.charge(snap.run, action.budget, action.total, baseline)
        if added is None:
            raise Again("the budget could not be charged")
        self._log("usage charged", snap.run, "budget_charged", budget=action.budget,
                  cents=added.cents, tokens=added.tokens)
        return snap

    async def _release_charge(self, snap: Snapshot, action: ReleaseCharge) -> Snapshot:
        if not await self.budgets.release(snap.run, action.budget):
            raise Again("the budget kept changing")
        self._log("charge released from the budget's ledger", snap.run, "budget_charge_released",
                  budget=action.budget)
        return snap

    async def _delete_run(self, snap: Snapshot, action: DeleteRun) -> Snapshot:
        try:
            await self.kube.delete_run(snap.run.metadata.namespace, snap.run.metadata.name, snap.uid,
                                       snap.body["metadata"]["resourceVersion"])
        except Conflict:
            await self._refresh_run(snap.key)
            raise Again("the run changed after its TTL was judged") from None
        self._log("finished run deleted (ttlSecondsAfterFinished)", snap.run, "run_deleted")
        return snap

    async def _remove_finalizer(self, snap: Snapshot, action: RemoveFinalizer) -> Snapshot:
        meta = snap.body["metadata"]
        try:
            written = await self.kube.set_run_finalizers(
                meta["namespace"], meta["name"], meta["resourceVersion"],
                [f for f in snap.run.metadata.finalizers if f != c.RUN_FINALIZER])
        except (Conflict, NotFound):
            await self._refresh_run(snap.key)
            raise Again("finalizer removal conflicted") from None
        self._log("run released for deletion: attempt ended, usage charged, pods released", snap.run,
                  "run_finalized")
        return self._store_written(snap, written)

    async def _record_refusal(self, key: RunKey, exc: SpecError) -> None:
        """Records a refusal on the run (condition and Event) once per distinct message,
        conditional on the run as read, like every other status write."""
        snap = self.snapshot(key)
        if snap is None:
            return
        run = snap.run
        message = f"{exc.api_error.what}: {exc.api_error.message}"[:1024]
        current = get_condition(run.status.conditions, c.COND_STALLED)
        if current is not None and current.status == "True" and current.reason == exc.reason and \
                current.message == message:
            return
        status = run.status.model_copy(deep=True)
        status.conditions = set_condition(status.conditions, c.COND_STALLED, "True", exc.reason, message,
                                          run.metadata.generation, self.clock.now())
        try:
            written = await self.kube.replace_run_status({**snap.body, "status": status.dump()})
        except ApiError:
            return  # recorded on a later pass
        self._store_written(snap, written)
        self._spawn(self._post_event(written, "Warning", exc.reason, message))

    # --- views for metrics ---------------------------------------------------

    # The two below are read by the metrics thread. dict.copy() takes the snapshot in one step;
    # list(d.items()) iterates, and a garbage collection inside it runs Python code (gc callbacks)
    # during which the event loop's thread can change the dict: "changed size during iteration".
    def phase_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for body in self.runs.copy().values():
            phase = (body.get("status") or {}).get("phase") or Phase.PENDING.value
            counts[phase] = counts.get(phase, 0) + 1
        return counts

    def pending_approvals(self) -> dict[str, int]:
        """Gates waiting for a person, by kind: Start, Result, or Request (a worker's)."""
        counts = {c.GATE_START: 0, c.GATE_RESULT: 0, "Request": 0}
        for body in self.runs.copy().values():
            for req in (((body.get("status") or {}).get("review") or {}).get("requests") or []):
                if "decision" not in req:
                    gate = req.get("gate")
                    kind = gate if gate in (c.GATE_START, c.GATE_RESULT) else "Request"
                    counts[kind] += 1
        return counts

    def heartbeat_ages(self) -> list[tuple[str, str, float]]:
        now = self.clock.mono()
        out = []
        for (ns, name), body in self.runs.copy().items():
            holder = (body.get("status") or {}).get("holder")
            lease = self.leases.get(body["metadata"].get("uid", ""))
            if holder and lease is not None and lease.holder == holder:
                out.append((ns, name, max(0.0, now - lease.last_change)))
        return out
