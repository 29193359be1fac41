"""What wakes what: each event updates the cache once (an observer, returning what changed), and
each reconciler's declared watches map that change to its keys.

The one place where it is written down which change concerns which run: a run's own events; a
Lease's new holder, first renewal or request (at once), new progress or spending (within one
fold interval), a cap or the budget reached (at once, by the usage alarm); a pod's change; a
budget's new limit, period or exhaustion (all its runs) or a charge (the runs waiting to be
admitted); an approval (the run it names); a WorkerClass (the runs not pinned to it yet); and
what each capability declares (Kueue's: tether/kueue/capability.py). The stray queue is woken by
a run's deletion (or its replacement by a namesake) and by pods left of deleted runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tether import metrics, protocol
from tether.api.models import TERMINAL_PHASES
from tether.api.workerclass import pinned
from tether.controller.budgets import BudgetBook
from tether.controller.cache import RunCache
from tether.controller.manager import Manager, Wake, Watch
from tether.controller.views import ApprovalView, BudgetKey, BudgetView, LeaseView, PodView, RunKey, RunView


@dataclass(frozen=True)
class RunChange:
    key: RunKey
    deleted: bool = False
    new_spec: bool = False  # its generation moved, or a namesake replaced it
    replaced: bool = False  # a namesake replaced it without a DELETED event (a relist)


@dataclass(frozen=True)
class LeaseChange:
    key: RunKey
    urgent: bool  # a new holder, renewal or request, or a cap or the budget reached
    progressed: bool  # new progress or spending only


@dataclass(frozen=True)
class PodChange:
    key: RunKey
    changed: bool
    strays: bool  # the key holds pods of a deleted run


@dataclass(frozen=True)
class BudgetChange:
    key: BudgetKey
    runs: list[RunKey]  # the runs the change concerns
    refresh_due: bool


class Observers:
    """The cache's side of every event: store it, and say what changed (None: nothing did)."""

    def __init__(self, cache: RunCache, budgets: BudgetBook, forgotten: Callable[[str], None]) -> None:
        self.cache, self.budgets = cache, budgets
        self.forgotten = forgotten  # a run's UID is gone: what others keep of it goes too (its RBAC)

    def register(self, manager: Manager) -> None:
        manager.observe("run", self.on_run)
        manager.observe("run-read", lambda t, body: self.on_run(t, body, read=True), watched_as="run")
        manager.observe("lease", self.on_lease)
        manager.observe("pod", self.on_pod)
        manager.observe("budget", self.on_budget)
        manager.observe("approval", lambda t, body: ApprovalView(body).run_key)
        manager.observe("workerclass", self.on_class)

    def on_run(self, event_type: str | None, body: dict[str, Any], read: bool = False) -> RunChange | None:
        """A run's event (`read`: our own GET's answer, the newest there is)."""
        run = RunView(body)
        if event_type == "DELETED":
            self.cache.drop_run(body)
            self.forgotten(run.uid)
            return RunChange(run.key, deleted=True)
        stored = self.cache.read_run(body) if read else self.cache.put_run(body)
        if not stored.stored:
            return None
        if stored.replaced is not None:
            self.forgotten(stored.replaced)
        return RunChange(run.key, new_spec=stored.new_spec or stored.replaced is not None,
                         replaced=stored.replaced is not None)

    def on_lease(self, event_type: str | None, body: dict[str, Any]) -> LeaseChange | None:
        lease = LeaseView(body)
        key, uid = lease.run_key, lease.controller_uid
        if key is None or uid is None:
            return None
        tracker = self.cache.leases
        before = tracker.get(uid)
        if event_type == "DELETED":
            tracker.forget(uid)
            changed = True
        else:
            mono = self.cache.mono()
            changed = tracker.observe(uid, body, mono)
            seen = tracker.get(uid)
            renewed = lease.renew_time
            if event_type is not None and renewed and seen is not None and seen.last_change == mono:
                # A renewal (not a signal update by the operator) just arrived by watch.
                lag = self.cache.now() - protocol.parse_time(renewed)  # type: ignore[operator]  # renewed is set here
                metrics.WATCH_LAG.observe(max(0.0, lag.total_seconds()))
        if key not in self.cache.runs:
            return None
        after = tracker.get(uid)
        alarm = self.cache.decisions.alarms.get(key)
        if alarm is not None and after is not None and after.usage is not None and alarm.reached(after.usage):
            return LeaseChange(key, urgent=True, progressed=False)  # act now, not at the next fold
        progressed = before is not None and after is not None and \
            (before.usage, before.checkpoint) != (after.usage, after.checkpoint)
        return LeaseChange(key, urgent=changed, progressed=progressed)

    def on_pod(self, event_type: str | None, body: dict[str, Any]) -> PodChange | None:
        key = PodView(body).run_key
        if key is None:
            return None
        if event_type == "DELETED":
            self.cache.drop_pod(body)
            changed = True
        else:
            changed = self.cache.put_pod(body)
        return PodChange(key, changed, bool(self.cache.strays(key)))

    def on_budget(self, event_type: str | None, body: dict[str, Any]) -> BudgetChange:
        meta = body["metadata"]
        before = self.budgets.cache.get((meta["namespace"], meta["name"]))
        key, due = self.budgets.on_event(event_type, body)
        # A charge (every fold of every run on it) concerns only runs waiting to be admitted; a
        # new limit or period, or the budget running out or coming back, concerns all its runs.
        # Held runs see the spending of others at their own next pass (at most a fold interval).
        everyone = event_type == "DELETED" or before is None or BudgetView(before).gate != BudgetView(body).gate
        runs = [k for k in self.cache.budget_runs(key)
                if (run := self.cache.run(k)) is not None and (everyone or run.holder is None)]
        return BudgetChange(key, runs, due)

    def on_class(self, event_type: str | None, body: dict[str, Any]) -> list[RunKey]:
        """A WorkerClass changed: the runs not pinned yet that name it, or name none (it may be, or
        have been, the default class)."""
        name = self.cache.classes.on_event(event_type, body)
        if name is None:
            return []
        return [key for key, run_body in list(self.cache.runs.items())
                if not pinned(run_body) and (run := RunView(run_body)).spec.get("className") in (name, None, "")
                and run.phase not in TERMINAL_PHASES]


def run_watches(fold_interval: float) -> list[Watch[Any]]:
    """The run reconciler's watches: its runs (For), their Leases and pods (Owns), and the budgets,
    approvals and WorkerClasses that concern them (Watches, mapped); a capability adds its own."""

    def lease(change: LeaseChange) -> list[Wake[RunKey]]:
        if change.urgent:
            return [Wake(change.key)]
        # New progress or spending reaches the status within one fold interval, not only at the
        # next lapse check a lease later.
        return [Wake(change.key, after=fold_interval, fold=True)] if change.progressed else []

    return [
        Watch("run", lambda ch: [Wake(ch.key, new_spec=ch.new_spec)]),
        Watch("lease", lease),
        Watch("pod", lambda ch: [Wake(ch.key)] if ch.changed else []),
        Watch("budget", lambda ch: [Wake(k) for k in ch.runs]),
        Watch("approval", lambda key: [Wake(key)]),
        Watch("workerclass", lambda keys: [Wake(k) for k in keys]),
    ]


def stray_watches() -> list[Watch[Any]]:
    """The stray queue's: a deleted (or replaced) run leaves its pods to it, as do pods found left."""
    return [
        Watch("run", lambda ch: [Wake(ch.key)] if ch.deleted or ch.replaced else []),
        Watch("pod", lambda ch: [Wake(ch.key)] if ch.strays else []),
    ]
