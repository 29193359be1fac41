"""WorkerRunSchedule as a capability (controller.capability): the kind watched, a store of schedules,
an index of runs by the schedule their name derives from, and the schedule reconciler, woken by its
schedule's events, by its runs' events, and at each slot. Nothing of it enters the run pipeline: a
schedule's runs are WorkerRuns like any other. Registered by one line in tether/capabilities.py."""

from __future__ import annotations

from typing import Any

from tether.api.models import GROUP, VERSION
from tether.controller.capability import Attached, Context, Source
from tether.controller.manager import Wake, Watch
from tether.controller.store import Store
from tether.core.capability import Rules
from tether.schedules.api import SCHEDULE_PLURAL
from tether.schedules.reconciler import BY_SCHEDULE, ScheduleKey, ScheduleReconciler, run_schedule

# The reconciler's name: its work queue's and its metrics' label.
NAME = "workerrunschedule"
# Few schedules, each pass a handful of writes.
WORKERS = 2


class Schedules:
    name = "schedules"
    rules = Rules()
    sources = (Source("schedule", GROUP, VERSION, SCHEDULE_PLURAL),)

    def attach(self, ctx: Context) -> Attached:
        schedules: Store[ScheduleKey] = Store(ctx.cache.mono)
        ctx.cache.runs.add_index(BY_SCHEDULE, run_schedule)

        def on_schedule(event_type: str | None, body: dict[str, Any]) -> ScheduleKey | None:
            meta = body["metadata"]
            key = (str(meta["namespace"]), str(meta["name"]))
            if event_type == "DELETED":
                schedules.remove(key)
                return None  # its runs go with it (owner references)
            return key if schedules.put(key, body) else None

        def budget_of(ns: str, spec: dict[str, Any]) -> str | None:
            """The WorkerBudget a run of this spec draws on, its class's default applied."""
            run, _ = ctx.cache.classes.run_of({"metadata": {"name": "-", "namespace": ns}, "spec": spec})
            ref = run.spec.budget.budget_ref if run.spec.budget is not None else None
            return ref.name if ref is not None else None

        reconciler = ScheduleReconciler(ctx.kube, schedules, ctx.cache.runs, ctx.budgets.get, budget_of,
                                        ctx.leadership, ctx.now, ctx.manager.feed)
        ctx.manager.observe("schedule", on_schedule)
        ctx.manager.register(NAME, reconciler, WORKERS, [
            Watch("schedule", lambda key: [Wake(key)]),
            # A run of the schedule changed (ended, deleted): its schedule decides again.
            Watch("run", lambda change: [Wake(k)] if (k := _schedule_of(change.key)) in schedules else []),
        ], key_field="schedule")
        return Attached()


def _schedule_of(run_key: tuple[str, str]) -> ScheduleKey | None:
    return run_schedule({"metadata": {"namespace": run_key[0], "name": run_key[1]}})


CAPABILITY = Schedules()
