"""The WorkerRun controller, assembled: the cache and its observers, a manager of named reconcilers
(runs; pods of deleted runs; WorkerBudget refreshes; and those of each capability), each with its
own work queue and declared watches (wakes.py), the executor and the confirmer, the namespace
sweeper, and the capabilities handed in (controller.capability: Kueue's is one). Watch events
come in through `feed` (from kopf's handlers, the sweeper's relists and the operator's own reads);
they only update the cache and queue the keys that the watches name.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tether.controller import budget_refresh
from tether.controller.budget_refresh import BudgetRefresher
from tether.controller.budgets import BudgetBook
from tether.controller.capability import Attached, Capability, Context
from tether.controller.cache import RunCache
from tether.controller.confirm import Confirmer
from tether.controller.execute import Executor
from tether.controller.leader import Leadership
from tether.controller.manager import Manager, Wake
from tether.controller.rbac import WorkerRbac
from tether.controller.runs import RunReconciler
from tether.controller.pods_of_deleted_runs import StrayReconciler
from tether.controller.sweeper import NamespaceSweeper
from tether.controller.wakes import Observers, run_watches, stray_watches
from tether.api.models import MAX_ATTEMPT_HISTORY
from tether.kube.client import KubeClient

# The reconcilers' names: their work queues' and their metrics' label.
RUNS, STRAYS = "workerrun", "workerrun_strays"
# Workers releasing stray pods: rare, and each release is two writes.
STRAY_WORKERS = 2


@dataclass
class Clock:
    """Injected clocks: wall time for status timestamps, monotonic time for lapses and queues."""

    now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc)
    mono: Callable[[], float] = time.monotonic


class RunController:
    def __init__(self, kube: KubeClient, clock: Clock | None = None, fold_interval: float = 10.0,
                 may_act: Callable[[], bool] = lambda: True, workers: int = 16,
                 namespace_identity: bool = True, attempt_history: int = MAX_ATTEMPT_HISTORY,
                 capabilities: Sequence[Capability] = ()) -> None:
        self.kube = kube
        self.clock = clock or Clock()
        self.cache = RunCache(self.clock.now, self.clock.mono)
        self.leadership = Leadership(may_act)
        self.budgets = BudgetBook(kube, self.clock.now, self.leadership)
        self.rbac = WorkerRbac(kube, shared=namespace_identity)
        self.observers = Observers(self.cache, self.budgets, self.rbac.forget)
        kube.write_gate = self.leadership.check  # every write, after its rate-limit wait too
        self.manager = Manager(self.clock.mono)
        self.observers.register(self.manager)
        self.sweeper = NamespaceSweeper(kube, self.cache, self.budgets, self.feed, self.rbac.forget_namespace)
        self.executor = Executor(kube, self.cache, self.budgets, self.rbac, self.leadership, self.sweeper.mark,
                                 self.feed)
        confirmer = Confirmer(kube, self.cache, self.executor, self._report, self.sweeper.mark, self.feed)
        # Each capability attaches before the run reconciler is registered: its watches are declared.
        context = Context(kube, self.cache, self.manager, self.leadership, self.clock.now, self.executor.refusable,
                          self.budgets.cache)
        self.capabilities: list[tuple[Capability, Attached]] = []
        for capability in capabilities:
            attached = capability.attach(context)
            self.executor.add(attached)
            confirmer.add(attached)
            self.capabilities.append((capability, attached))
        self.reconciler = RunReconciler(kube, self.cache, self.budgets, self.executor, confirmer, self.sweeper,
                                        self.leadership, fold_interval, self._report,
                                        lambda key: self.manager.wake(STRAYS, [Wake(key)]), attempt_history,
                                        [(c.rules, a.observe) for c, a in self.capabilities])
        runs = self.manager.register(RUNS, self.reconciler, workers,
                                     [*run_watches(fold_interval), *(w for _, a in self.capabilities for w in a.run_watches)])
        strays = self.manager.register(
            STRAYS, StrayReconciler(kube, self.cache, self.leadership, lambda body: self.feed("run", "MODIFIED", body)),
            STRAY_WORKERS, stray_watches())
        self.manager.register(budget_refresh.NAME, BudgetRefresher(self.budgets), budget_refresh.WORKERS,
                              budget_refresh.watches(), key_field="budget")
        self.budgets.wake_refresh = lambda key: self.manager.wake(budget_refresh.NAME, [Wake(key)])
        self.queue, self.loop = runs.queue, runs.loop
        self.stray_queue, self.stray_loop = strays.queue, strays.loop
        self._tasks: list[asyncio.Task[None]] = []

    def _report(self, *args: Any, **kwargs: Any) -> None:
        self.loop.report(*args, **kwargs)

    # --- life cycle ----------------------------------------------------------------

    def start(self) -> None:
        """Starts the loops and the API health probe (in the running event loop)."""
        if self._tasks:
            return
        self.manager.start()
        self._tasks.append(asyncio.create_task(self.kube.health.probe_forever(self.kube.ready), name="api probe"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.manager.stop()
        for _, attached in self.capabilities:
            if attached.stop is not None:
                await attached.stop()
        await self.sweeper.stop()
        await self.executor.stop()
        await self.budgets.stop()

    # --- watch events: cache and queue, nothing else -----------------------------------

    def on_run(self, event_type: str | None, body: dict[str, Any]) -> None:
        self.feed("run", event_type, body)

    def on_lease(self, event_type: str | None, body: dict[str, Any]) -> None:
        self.feed("lease", event_type, body)

    def on_pod(self, event_type: str | None, body: dict[str, Any]) -> None:
        self.feed("pod", event_type, body)

    def on_budget(self, event_type: str | None, body: dict[str, Any]) -> None:
        self.feed("budget", event_type, body)

    def feed(self, kind: str, event_type: str | None, body: dict[str, Any]) -> None:
        """An event of `kind` (wakes.Observers.register names them), from a watch or read by the
        operator itself: the namespace sweeper's relists, and a run's fresh GET ("run-read":
        newer than anything cached)."""
        self.manager.feed(kind, event_type, body)

    # --- views for metrics -----------------------------------------------------------

    def phase_counts(self) -> dict[tuple[str, str, str], int]:
        return self.cache.phase_counts()

    def class_labels(self) -> dict[str, dict[str, str]]:
        return {name: dict(known.model.spec.labels) for name, known in self.cache.classes.classes.copy().items()}

    def pending_approvals(self) -> dict[tuple[str, str], tuple[int, float | None]]:
        return self.cache.pending_approvals()

    def api_available(self) -> bool:
        return self.kube.health.available_since is not None

    def heartbeat_ages(self) -> list[tuple[str, str, float]]:
        return self.cache.heartbeat_ages()

    def budget_bodies(self) -> dict[tuple[str, str], dict[str, Any]]:
        return self.budgets.cache.copy()
