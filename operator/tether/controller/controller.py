"""The WorkerRun controller, assembled: the cache, its wakes, two work queues (runs, and pods
of deleted runs) each with its reconcile loop, the executor and the confirmer, the namespace
sweeper. Watch events come in through the on_* methods (from kopf's handlers and the sweeper's
relists); they only update the cache and queue the keys that wakes.py names.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import dataclass
from typing import Any, Callable

from tether.controller.budgets import BudgetBook
from tether.controller.cache import RunCache
from tether.controller.confirm import Confirmer
from tether.controller.execute import Executor
from tether.controller.leader import Leadership
from tether.controller.loop import ReconcileLoop
from tether.controller.queues import QueueBook
from tether.controller.rbac import WorkerRbac
from tether.controller.runs import RunReconciler
from tether.controller.strays import StrayReconciler
from tether.controller.sweeper import NamespaceSweeper
from tether.controller.views import RunKey
from tether.controller.wakes import Wake, Wakes
from tether.controller.workqueue import ExponentialBackoff, WorkQueue
from tether.api.models import MAX_ATTEMPT_HISTORY
from tether.core.observe import BOOST_SECONDS
from tether.kube.client import KubeClient

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
                 namespace_identity: bool = True, boost_seconds: float = BOOST_SECONDS,
                 attempt_history: int = MAX_ATTEMPT_HISTORY) -> None:
        self.kube = kube
        self.clock = clock or Clock()
        self.cache = RunCache(self.clock.now, self.clock.mono)
        self.leadership = Leadership(may_act)
        self.budgets = BudgetBook(kube, self.clock.now, self.leadership)
        self.rbac = WorkerRbac(kube, shared=namespace_identity)
        self.queues = QueueBook(kube, self.clock.now, boost_seconds)
        self.wakes = Wakes(self.cache, self.budgets, self.queues, fold_interval, self.rbac.forget)
        kube.write_gate = self.leadership.check  # every write, after its rate-limit wait too
        self.queue: WorkQueue[RunKey] = WorkQueue(ExponentialBackoff(base=0.05, cap=300.0), self.clock.mono, "workerrun")
        self.stray_queue: WorkQueue[RunKey] = WorkQueue(ExponentialBackoff(base=0.05, cap=300.0), self.clock.mono,
                                                        "workerrun_strays")
        self.sweeper = NamespaceSweeper(kube, self.cache, self.budgets, self.feed, self.rbac.forget_namespace)
        self.executor = Executor(kube, self.cache, self.budgets, self.rbac, self.leadership, self.sweeper.mark,
                                 self.feed, self.queues)
        confirmer = Confirmer(kube, self.cache, self.executor, self._report, self.sweeper.mark, self.feed)
        self.reconciler = RunReconciler(kube, self.cache, self.budgets, self.executor, confirmer, self.sweeper,
                                        self.leadership, fold_interval, self._report, self.stray_queue.add,
                                        attempt_history)
        self.loop = ReconcileLoop("workerrun", self.reconciler, self.queue, workers)
        strays = StrayReconciler(kube, self.cache, self.leadership, lambda body: self.on_run("MODIFIED", body))
        self.stray_loop = ReconcileLoop("workerrun_strays", strays, self.stray_queue, STRAY_WORKERS)
        self._tasks: list[asyncio.Task[None]] = []

    def _report(self, *args: Any, **kwargs: Any) -> None:
        self.loop.report(*args, **kwargs)

    # --- life cycle ----------------------------------------------------------------

    def start(self) -> None:
        """Starts the loops and the API health probe (in the running event loop)."""
        if self._tasks:
            return
        self.loop.start()
        self.stray_loop.start()
        self._tasks.append(asyncio.create_task(self.kube.health.probe_forever(self.kube.ready), name="api probe"))
        self._tasks.append(asyncio.create_task(self._mark_checks_forever(), name="admission checks"))

    async def _mark_checks_forever(self, every: float = 5.0) -> None:
        """Tether's AdmissionChecks not yet Active are marked by whichever replica leads, also one
        that came to lead after their last event (or whose first try failed)."""
        while True:
            await asyncio.sleep(every)
            if self.queues.unmarked and self.leadership.may_act():
                await self.queues.mark_active()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.loop.stop()
        await self.stray_loop.stop()
        await self.sweeper.stop()
        await self.executor.stop()
        await self.budgets.stop()

    # --- watch events: cache and queue, nothing else -----------------------------------

    def on_run(self, event_type: str | None, body: dict[str, Any]) -> None:
        self._wake(self.wakes.on_run(event_type, body))

    def on_lease(self, event_type: str | None, body: dict[str, Any]) -> None:
        self._wake(self.wakes.on_lease(event_type, body))

    def on_pod(self, event_type: str | None, body: dict[str, Any]) -> None:
        self._wake(self.wakes.on_pod(event_type, body))

    def on_budget(self, event_type: str | None, body: dict[str, Any]) -> None:
        self._wake(self.wakes.on_budget(event_type, body))

    def on_approval(self, event_type: str | None, body: dict[str, Any]) -> None:
        self._wake(self.wakes.on_approval(event_type, body))

    def on_workload(self, event_type: str | None, body: dict[str, Any]) -> None:
        self._wake(self.wakes.on_workload(event_type, body))

    def on_local_queue(self, event_type: str | None, body: dict[str, Any]) -> None:
        self._wake(self.wakes.on_local_queue(event_type, body))

    async def on_admission_check(self, event_type: str | None, body: dict[str, Any]) -> None:
        if await self.queues.on_admission_check(event_type, body, self.leadership.may_act()):
            self._wake(self.wakes.queued())

    def feed(self, kind: str, event_type: str, body: dict[str, Any]) -> None:
        """An object read by the operator itself, as a watch event of its kind: the namespace
        sweeper's relists, and a run's fresh GET ("run-read": newer than anything cached)."""
        if kind == "run-read":
            self._wake(self.wakes.on_run(event_type, body, read=True))
            return
        {"run": self.on_run, "lease": self.on_lease, "pod": self.on_pod, "budget": self.on_budget}[kind](event_type, body)

    def _wake(self, wakes: list[Wake]) -> None:
        for w in wakes:
            queue = self.stray_queue if w.strays else self.queue
            if w.new_spec:
                queue.forget(w.key)  # an error backoff of the old spec no longer applies
            if w.fold and queue.backoff.failures(w.key):
                continue  # never cut an error backoff short
            if w.after > 0:
                queue.add_after(w.key, w.after)
            else:
                queue.add(w.key)

    # --- views for metrics -----------------------------------------------------------

    def phase_counts(self) -> dict[tuple[str, str], int]:
        return self.cache.phase_counts()

    def pending_approvals(self) -> dict[tuple[str, str], tuple[int, float | None]]:
        return self.cache.pending_approvals()

    def api_available(self) -> bool:
        return self.kube.health.available_since is not None

    def heartbeat_ages(self) -> list[tuple[str, str, float]]:
        return self.cache.heartbeat_ages()
