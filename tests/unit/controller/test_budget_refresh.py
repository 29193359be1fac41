"""The WorkerBudget refresh reconciler, driven through the operator's own manager and reconcile
loop: what wakes it, how it rests after a lost race, and what it keeps of a deleted budget."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import types
from typing import Any

from tether import metrics
from tether.api.models import WorkerRun
from tether.controller import budget_refresh
from tether.controller.controller import Clock, RunController
from tether.kube.client import Conflict

NOW = dt.datetime(2026, 3, 2, 12, tzinfo=dt.timezone.utc)
YESTERDAY = "2026-03-01T00:00:00Z"


def _budget(rv: str, period_start: str = "2026-03-02T00:00:00Z") -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget",
            "metadata": {"name": "team", "namespace": "ns", "uid": "b1", "generation": 1, "resourceVersion": rv},
            "spec": {"limitCents": 100, "period": "Daily"},
            "status": {"observedGeneration": 1, "periodStart": period_start, "spent": {"cents": 40, "tokens": 0},
                       "remaining": {"cents": 60},
                       "conditions": [{"type": "Exhausted", "status": "False", "reason": "WithinLimit",
                                       "message": "spending is within the limit", "observedGeneration": 1,
                                       "lastTransitionTime": "2026-03-01T00:00:00Z"}]}}


class _Kube:
    def __init__(self, body: dict[str, Any], conflicts: int = 0) -> None:
        self.body, self.conflicts, self.gets, self.puts = body, conflicts, 0, []  # type: ignore[var-annotated]
        self.health = types.SimpleNamespace()

    async def get_budget(self, ns: str, name: str) -> dict[str, Any] | None:
        self.gets += 1
        return copy.deepcopy(self.body) if self.body is not None else None

    async def replace_budget_status(self, body: dict[str, Any]) -> dict[str, Any]:
        if body["metadata"]["resourceVersion"] != self.body["metadata"]["resourceVersion"]:
            raise Conflict(409, "Conflict", "stale")
        if self.conflicts:
            self.conflicts -= 1
            # a charge lands between the refresh's GET and its PUT: a new version, same period
            self.body["metadata"]["resourceVersion"] = str(int(self.body["metadata"]["resourceVersion"]) + 1)
            raise Conflict(409, "Conflict", "the object has been modified")
        self.body = copy.deepcopy(body)
        self.body["metadata"]["resourceVersion"] = str(int(body["metadata"]["resourceVersion"]) + 1)
        self.puts.append(self.body)
        return copy.deepcopy(self.body)

    async def post_event(self, *a: Any) -> None:
        return None


def _run() -> WorkerRun:
    return WorkerRun.model_validate({
        "metadata": {"name": "r", "namespace": "ns", "uid": "u-r", "generation": 1, "resourceVersion": "1"},
        "spec": {"template": {"spec": {"containers": [{"name": "w", "command": ["w"]}]}},
                 "budget": {"budgetRef": {"name": "team"}}},
        "status": {}})


def _errors() -> float:
    return metrics.REGISTRY.get_sample_value("controller_runtime_reconcile_errors_total",
                                             {"controller": budget_refresh.NAME}) or 0.0


def test_a_run_that_notices_the_period_rolled_over_gets_the_budget_refreshed() -> None:
    """BudgetBook.observe (a run's pass) notices the budget's period rolled over: it wakes the
    refresh reconciler, whose loop writes the new period (with no run charging the budget)."""
    async def go() -> _Kube:
        kube = _Kube(_budget("5", period_start=YESTERDAY))
        ctl = RunController(kube, clock=Clock(now=lambda: NOW))  # type: ignore[arg-type]
        refresh = ctl.manager.queues()[budget_refresh.NAME]
        ctl.budgets.cache.store(("ns", "team"), copy.deepcopy(kube.body))  # cached, not via an event
        assert len(refresh) == 0
        await ctl.budgets.observe(_run(), NOW)
        assert list(refresh._queue) == [("ns", "team")], "the run's observe did not wake the refresh"
        ctl.manager._registered[budget_refresh.NAME].loop.start()
        for _ in range(100):
            if kube.puts:
                break
            await asyncio.sleep(0.01)
        await ctl.manager.stop()
        return kube

    kube = asyncio.run(go())
    assert [p["status"]["periodStart"] for p in kube.puts] == ["2026-03-02T00:00:00Z"]


async def _settled(queue: Any) -> None:
    """Until the queue has nothing waiting, in process or timed (bounded)."""
    for _ in range(500):
        if len(queue) == 0 and not queue.in_progress() and not queue.pending_timers():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the refresh queue never settled")


def test_a_refresh_that_loses_a_race_is_retried_without_counting_an_error_and_then_rests() -> None:
    """A Conflict (a charge wrote between the refresh's GET and PUT) is a race, not a failure: the
    loop retries from a fresh read without counting a reconcile error (an alert reads that counter),
    writes by compare-and-swap once, and the watch bringing that write wakes nothing more."""
    async def go() -> tuple[_Kube, int, int]:
        kube = _Kube(_budget("5", period_start=YESTERDAY), conflicts=2)
        ctl = RunController(kube, clock=Clock(now=lambda: NOW))  # type: ignore[arg-type]
        reg = ctl.manager._registered[budget_refresh.NAME]
        reg.loop.start()
        ctl.feed("budget", "ADDED", copy.deepcopy(kube.body))  # due: a new period
        for _ in range(300):
            if kube.puts:
                break
            await asyncio.sleep(0.01)
        await _settled(reg.queue)
        ctl.feed("budget", "MODIFIED", copy.deepcopy(kube.puts[-1]))  # the watch brings our write
        woken = len(reg.queue) + reg.queue.pending_timers()
        gets = kube.gets
        await ctl.manager.stop()
        return kube, gets, woken

    errors = _errors()
    kube, gets, woken = asyncio.run(go())
    assert _errors() == errors, "a lost race counted as a reconcile error"
    assert (len(kube.puts), gets, woken) == (1, 3, 0)  # two conflicts, one write, then nothing more


def test_a_deleted_budget_leaves_no_state_in_its_reconciler() -> None:
    """exists() is the cache: a refresh after the deletion finds nothing and drops the key's timers
    and backoff."""
    async def go() -> tuple[int, int]:
        kube = _Kube(_budget("5", period_start=YESTERDAY), conflicts=1)
        ctl = RunController(kube, clock=Clock(now=lambda: NOW))  # type: ignore[arg-type]
        reg = ctl.manager._registered[budget_refresh.NAME]
        reg.loop.start()
        ctl.feed("budget", "ADDED", copy.deepcopy(kube.body))
        for _ in range(100):
            if reg.queue.pending_timers():
                break  # the conflict's retry is scheduled
            await asyncio.sleep(0.005)
        ctl.feed("budget", "DELETED", copy.deepcopy(kube.body))
        kube.body = None  # type: ignore[assignment]
        await _settled(reg.queue)
        state = reg.queue.pending_timers() + reg.queue.backoff.failures(("ns", "team"))
        problems = len(reg.loop._problem) + len(reg.loop._streak)
        await ctl.manager.stop()
        return state, problems

    assert asyncio.run(go()) == (0, 0)
