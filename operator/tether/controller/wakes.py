"""What wakes what: each watch event updates the cache and names the keys to reconcile.

The one place where it is written down which change concerns which run: a run's own events; a
Lease's new holder, first renewal or request (at once), new progress or spending (within one
fold interval), a cap or the budget reached (at once, by the usage alarm); a pod's change; a
budget's new limit, period or exhaustion (all its runs) or a charge (the runs waiting to be
admitted); an approval (the run it names); a stray pod (the stray queue); a Kueue Workload (the
run that controls it), a LocalQueue (its queued runs not holding yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tether import metrics, protocol
from tether.controller.budgets import BudgetBook
from tether.controller.cache import RunCache
from tether.controller.queues import QueueBook
from tether.controller.views import ApprovalView, BudgetView, LeaseView, PodView, RunKey, RunView


@dataclass(frozen=True)
class Wake:
    key: RunKey
    after: float = 0.0  # seconds from now (0: at once)
    strays: bool = False  # the stray-pod queue rather than the run's
    # A fold timer: one per run however many heartbeats, and never cutting an error backoff short.
    fold: bool = False
    new_spec: bool = False  # the run's generation moved: its error backoff starts over


class Wakes:
    def __init__(self, cache: RunCache, budgets: BudgetBook, queues: QueueBook, fold_interval: float,
                 forgotten: Callable[[str], None]) -> None:
        self.cache, self.budgets, self.queues, self.fold_interval = cache, budgets, queues, fold_interval
        self.forgotten = forgotten  # a run's UID is gone: what others keep of it goes too (its RBAC)

    def on_run(self, event_type: str | None, body: dict[str, Any], read: bool = False) -> list[Wake]:
        """A run's event (`read`: our own GET's answer, the newest there is)."""
        run = RunView(body)
        if event_type == "DELETED":
            self.cache.drop_run(body)
            self.forgotten(run.uid)
            # What is left of it (pods) is released by the stray queue; the run's own pass drops its state.
            return [Wake(run.key), Wake(run.key, strays=True)]
        stored = self.cache.read_run(body) if read else self.cache.put_run(body)
        if not stored.stored:
            return []
        wakes = [Wake(run.key, new_spec=stored.new_spec or stored.replaced is not None)]
        if stored.replaced is not None:
            # A namesake replaced it without a DELETED event (a relist): the old run's pods are strays.
            self.forgotten(stored.replaced)
            wakes.append(Wake(run.key, strays=True))
        return wakes

    def on_lease(self, event_type: str | None, body: dict[str, Any]) -> list[Wake]:
        lease = LeaseView(body)
        key, uid = lease.run_key, lease.controller_uid
        if key is None or uid is None:
            return []
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
            return []
        after = tracker.get(uid)
        alarm = self.cache.alarms.get(key)
        if alarm is not None and after is not None and after.usage is not None and alarm.reached(after.usage):
            return [Wake(key)]  # a cap or the budget is reached: act now, not at the next fold
        if changed:
            return [Wake(key)]
        if before is not None and after is not None and \
                (before.usage, before.checkpoint) != (after.usage, after.checkpoint):
            # New progress or spending reaches the status within one fold interval, not only at
            # the next lapse check a lease later.
            return [Wake(key, after=self.fold_interval, fold=True)]
        return []

    def on_pod(self, event_type: str | None, body: dict[str, Any]) -> list[Wake]:
        pod = PodView(body)
        key = pod.run_key
        if key is None:
            return []
        if event_type == "DELETED":
            self.cache.drop_pod(body)
            changed = True
        else:
            changed = self.cache.put_pod(body)
        wakes = [Wake(key)] if changed else []
        if self.cache.strays(key):
            wakes.append(Wake(key, strays=True))
        return wakes

    def on_budget(self, event_type: str | None, body: dict[str, Any]) -> list[Wake]:
        meta = body["metadata"]
        before = self.budgets.cache.get((meta["namespace"], meta["name"]))
        budget = self.budgets.on_event(event_type, body)
        # A charge (every fold of every run on it) concerns only runs waiting to be admitted; a
        # new limit or period, or the budget running out or coming back, concerns all its runs.
        # Held runs see the spending of others at their own next pass (at most a fold interval).
        everyone = event_type == "DELETED" or before is None or BudgetView(before).gate != BudgetView(body).gate
        return [Wake(key) for key in list(self.cache.budget_runs.get(budget, ()))
                if (run := self.cache.run(key)) is not None and (everyone or run.holder is None)]

    def on_approval(self, event_type: str | None, body: dict[str, Any]) -> list[Wake]:
        """An approval was made (or removed): decide again for the run it names."""
        key = ApprovalView(body).run_key
        return [Wake(key)] if key is not None else []

    def on_workload(self, event_type: str | None, body: dict[str, Any]) -> list[Wake]:
        """A run's Workload changed (admitted, evicted, finished): decide again for that run."""
        key = self.queues.on_workload(event_type, body)
        return [Wake(key)] if key is not None and key in self.cache.runs else []

    def on_local_queue(self, event_type: str | None, body: dict[str, Any]) -> list[Wake]:
        """A LocalQueue's ClusterQueue is named in its runs' Queued message."""
        self.queues.on_local_queue(event_type, body)
        return self.queued((body.get("metadata") or {}).get("namespace"))

    def queued(self, namespace: str | None = None) -> list[Wake]:
        """The runs waiting for Kueue (in `namespace`, or everywhere): a check they may wait on
        changed, or where they wait."""
        return [Wake(key) for key in list(self.cache.runs) if namespace in (None, key[0])
                and (run := self.cache.run(key)) is not None and run.holder is None
                and run.phase in ("Queued", "Pending")]
