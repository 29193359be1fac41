"""The WorkerRun reconciler: one pass reads top to bottom as finalizer -> gather -> decide ->
confirm -> execute.

- finalizer: a run Tether has not taken hold of yet gets its finalizer first (deleting it must
  end its attempt and settle its books);
- gather: one immutable Snapshot of the cache, plus what a decision needs read fresh (the
  budget, approvals while a gate is open), into the core's Observed;
- decide: the pure core, with both clocks injected;
- confirm: the fresh reads the actions declared they rest on;
- execute: each action's executor in order; every write is conditional on the snapshot, and
  the first failure ends the pass (the next one decides again from fresh data).
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Sequence

from pydantic import ValidationError

from tether import tracing
from tether.api import constants as c
from tether.api.conditions import get_condition, set_condition
from tether.api.workerclass import pinned
from tether.controller.budgets import BudgetBook
from tether.controller.cache import RunCache
from tether.controller.confirm import Confirmer
from tether.controller.errors import Again, Inconclusive, NotLeader, SpecError
from tether.controller.execute import Executor
from tether.controller.leader import Leadership
from tether.controller.loop import Result
from tether.controller.snapshot import Snapshot, approval_observation
from tether.controller.sweeper import NamespaceSweeper
from tether.controller.views import ApprovalView, RunKey
from tether.api.models import WorkerRun
from tether.core.capability import Rules
from tether.core.decide import Observed, decide
from tether.core.liveness import progress_held
from tether.core.observe import ApprovalObservation
from tether.core.review import needs_approvals
from tether.kube import support
from tether.kube.client import ApiError, KubeClient
from tether.kube.paths import approval_path, class_path

log = logging.getLogger("tether.controller")

# The loop's once-per-change problem log (ReconcileLoop.report).
Report = Callable[..., None]
Observe = Callable[[WorkerRun], Awaitable[object | None]]


class RunReconciler:
    def __init__(self, kube: KubeClient, cache: RunCache, budgets: BudgetBook, executor: Executor,
                 confirmer: Confirmer, sweeper: NamespaceSweeper, leadership: Leadership, fold_interval: float,
                 report: Report, wake_strays: Callable[[RunKey], None], attempt_history: int,
                 capabilities: Sequence[tuple[Rules, Observe]] = ()) -> None:
        self.kube, self.cache, self.budgets = kube, cache, budgets
        self.executor, self.confirmer, self.sweeper = executor, confirmer, sweeper
        self.leadership, self.fold_interval, self.report = leadership, fold_interval, report
        self.wake_strays, self.attempt_history = wake_strays, attempt_history
        # Each capability's say in the decision and its slice of the observation (controller.capability).
        self.rules = tuple(rules for rules, _ in capabilities)
        self.observers = tuple(observe for _, observe in capabilities)
        self._whole_approval_lists = False  # the server refused a field selector once (said once)

    def exists(self, key: RunKey) -> bool:
        self.cache.forget_key(key)
        return self.cache.holds(key)

    async def reconcile(self, key: RunKey) -> Result:
        # Ended on every path: a result, a retry the loop schedules (Again...), an error, a cancel.
        with tracing.reconcile_span(*key, benign=(Again, Inconclusive, NotLeader)) as span:
            result = await self._reconcile(key)
            span.set_attribute("tether.reconcile.result", "acted" if result.acted else "idle")
            return result

    async def _reconcile(self, key: RunKey) -> Result:
        body = self.cache.runs.get(key)
        if not self.cache.classes.synced and body is not None and not pinned(body):
            await self.cache.classes.sync(lambda: self.kube.list_objects(class_path()))
            if self.cache.classes.unlisted is not None:  # the run waits (ClassesUnknown); said once
                self.report(key, "WorkerClasses not listed; runs not started yet wait", "classes_unlisted",
                            self.cache.classes.unlisted, logging.WARNING)
        try:
            snap = self.cache.snapshot(key)
        except ValidationError as exc:
            self.report(key, "cannot read run; waiting for a change", "run_unreadable", str(exc), logging.ERROR)
            return Result()
        if self.cache.strays(key):
            self.wake_strays(key)  # however they came to be strays, they are released
        if snap is None:
            return Result()
        tracing.on_snapshot(snap.run)
        try:
            return await self._pass(snap)
        except SpecError as exc:
            await self._record_refusal(key, exc)
            raise

    async def _pass(self, snap: Snapshot) -> Result:
        self.leadership.check()
        if snap.run.metadata.deletion_timestamp is None and c.RUN_FINALIZER not in snap.run.metadata.finalizers:
            await self.executor.add_finalizer(snap)
            return Result(acted=True)
        decision = decide(await self._gather(snap), self.rules)
        tracing.on_decision(decision.actions)
        log.debug("decided", extra={"run": "/".join(snap.key), "event": "decided",
                                    "requeueAfter": decision.requeue_after,
                                    "actions": [type(a).__name__ for a in decision.actions]})
        if decision.usage_alarm is not None:
            self.cache.decisions.alarms[snap.key] = decision.usage_alarm
        else:
            self.cache.decisions.alarms.pop(snap.key, None)
        if not decision.actions:
            return Result(decision.requeue_after, decision.again_now)
        snap = await self.confirmer.confirm(snap, decision)
        for action in decision.actions:
            snap = await self.executor.run(snap, action)
        return Result(decision.requeue_after, acted=True)

    async def _gather(self, snap: Snapshot) -> Observed:
        now, mono = self.cache.now(), self.cache.mono()
        run, uid = snap.run, snap.uid
        if progress_held(run):
            self.cache.decisions.progress_held_at[uid] = mono
        parts = {type(part): part for observe in self.observers if (part := await observe(run)) is not None}
        return Observed(parts=parts, run=run, run_class=snap.run_class, lease=snap.lease, pods=snap.pods, foreign_pods=snap.foreign_pods,
                        tool_claims_cleared=self.cache.tool_claims_cleared.get(uid) == run.status.fence,
                        pod_refusal=self.cache.pod_refusals.get(uid),
                        now=now, mono=mono, budget=await self.budgets.observe(run, now),
                        fold_interval=self.fold_interval, attempt_history=self.attempt_history,
                        api_available_since=self.kube.health.available_since,
                        namespace_terminating=self.sweeper.terminating(run.metadata.namespace),
                        approvals=await self._approvals(snap), progress_held_at=self.cache.decisions.progress_held_at.get(uid))

    async def _approvals(self, snap: Snapshot) -> tuple[ApprovalObservation, ...] | None:
        """The approvals naming a run with an open gate (the only state that reads them), read fresh
        from the API server rather than from a watch cache: after a restart or a failover the cache
        may not have listed them all yet, or may still hold a deleted one, and a grant or a
        rejection decided from it cannot be taken back. None when the list fails: the pass decides
        no gate, and everything else (lapses, stops, deadlines) goes on. A server that does not
        serve CRD field selectors (older than Tether supports) answers 400: the namespace's
        approvals are listed whole then, and filtered here, so gates are still decided."""
        run = snap.run
        if not needs_approvals(run, snap.lease):
            return ()
        path = approval_path(run.metadata.namespace)
        try:
            try:
                items = await self.kube.list_objects(path, field_selector=f"spec.runRef.name={run.metadata.name}")
            except ApiError as exc:
                if not support.unsupported_field_selector(exc.status, exc.message):
                    raise
                if not self._whole_approval_lists:
                    self._whole_approval_lists = True
                    log.warning(f"{support.FIELD_SELECTORS}: listing each namespace's approvals whole",
                                extra={"event": "field_selectors_unsupported"})
                items = await self.kube.list_objects(path)
        except ApiError as exc:
            log.warning("approvals not listed; no gate decided this pass",
                        extra={"run": run.key, "event": "approvals_unlisted", "status": exc.status})
            return None
        return tuple(a for body in items if ApprovalView(body).run_key == snap.key
                     and (a := approval_observation(body)) is not None)

    async def _record_refusal(self, key: RunKey, exc: SpecError) -> None:
        """Records a refusal on the run (condition and Event) once per distinct message,
        conditional on the run as read, like every other status write."""
        snap = self.cache.snapshot(key)
        if snap is None or not self.leadership.may_act():
            return
        run = snap.run
        message = f"{exc.api_error.what}: {exc.api_error.message}"[:1024]
        current = get_condition(run.status.conditions, c.COND_STALLED)
        if current is not None and current.status == "True" and current.reason == exc.reason and \
                current.message == message:
            return
        status = run.status.clone()
        status.conditions = set_condition(status.conditions, c.COND_STALLED, "True", exc.reason, message,
                                          run.metadata.generation, self.cache.now())
        try:
            written = await self.kube.replace_run_status({**snap.body, "status": status.dump()})
        except ApiError:
            return  # recorded on a later pass
        self.cache.written_run(snap, written)
        self.executor.post_event(written, "Warning", exc.reason, message)
