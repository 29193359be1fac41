"""The WorkerBudget refresh reconciler, driven through the operator's own manager and reconcile
loop: what wakes it, how it rests after a lost race, and what it keeps of a deleted budget."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from tether import metrics
from tether.api.models import WorkerRun
from tether.controller import budget_refresh
from tether.controller.controller import Clock, RunController
from tether.kube.paths import budget_path
from testkit.fakeapi import FakeApi, Request

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


PATH = budget_path("ns", "team")
WRITE = f"PUT {PATH}/status"


def _api(body: dict[str, Any], conflicts: int = 0) -> FakeApi:
    """The budget in the fake API; the first `conflicts` status writes meet a charge that landed
    between the refresh's read and its write (a new version, the same period)."""
    api = FakeApi(now=lambda: NOW)
    api.put(PATH, body)
    left = [conflicts]

    def charge_lands(req: Request) -> None:
        if req.call == WRITE and left[0]:
            left[0] -= 1
            held = api.get(PATH)
            assert held is not None
            api.put(PATH, held)
        return None

    api.before(charge_lands)
    return api


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
    api = _api(_budget("5", period_start=YESTERDAY))

    async def go() -> None:
        ctl = RunController(api.client(), clock=Clock(now=lambda: NOW))
        refresh = ctl.manager.queues()[budget_refresh.NAME]
        ctl.budgets.cache.store(("ns", "team"), api.get(PATH))  # type: ignore[arg-type]  # cached, not via an event
        assert len(refresh) == 0
        await ctl.budgets.observe(_run(), NOW)
        assert list(refresh._queue) == [("ns", "team")], "the run's observe did not wake the refresh"
        ctl.manager._registered[budget_refresh.NAME].loop.start()
        for _ in range(100):
            if api.landed(WRITE):
                break
            await asyncio.sleep(0.01)
        await ctl.manager.stop()

    asyncio.run(go())
    held = api.get(PATH)
    assert api.landed(WRITE) == 1 and held is not None and held["status"]["periodStart"] == "2026-03-02T00:00:00Z"


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
    api = _api(_budget("5", period_start=YESTERDAY), conflicts=2)

    async def go() -> int:
        ctl = RunController(api.client(), clock=Clock(now=lambda: NOW))
        reg = ctl.manager._registered[budget_refresh.NAME]
        reg.loop.start()
        ctl.feed("budget", "ADDED", api.get(PATH))  # type: ignore[arg-type]  # due: a new period
        for _ in range(300):
            if api.landed(WRITE):
                break
            await asyncio.sleep(0.01)
        await _settled(reg.queue)
        ctl.feed("budget", "MODIFIED", api.get(PATH))  # type: ignore[arg-type]  # the watch brings our write
        woken = len(reg.queue) + reg.queue.pending_timers()
        await ctl.manager.stop()
        return woken

    errors = _errors()
    woken = asyncio.run(go())
    assert _errors() == errors, "a lost race counted as a reconcile error"
    # Two conflicts, one write, then nothing more.
    assert (api.asked("workerbudgets", writes=True).count("PUT workerbudgets/team/status"), api.landed(WRITE),
            api.calls.count(f"GET {PATH}"), woken) == (3, 1, 3, 0), api.calls


def test_a_deleted_budget_leaves_no_state_in_its_reconciler() -> None:
    """exists() is the cache: a refresh after the deletion finds nothing and drops the key's timers
    and backoff."""
    async def go() -> tuple[int, int]:
        api = _api(_budget("5", period_start=YESTERDAY), conflicts=1)
        ctl = RunController(api.client(), clock=Clock(now=lambda: NOW))
        reg = ctl.manager._registered[budget_refresh.NAME]
        reg.loop.start()
        body = api.get(PATH)
        assert body is not None
        ctl.feed("budget", "ADDED", body)
        for _ in range(100):
            if reg.queue.pending_timers():
                break  # the conflict's retry is scheduled
            await asyncio.sleep(0.005)
        ctl.feed("budget", "DELETED", body)
        del api.objects[PATH]
        await _settled(reg.queue)
        state = reg.queue.pending_timers() + reg.queue.backoff.failures(("ns", "team"))
        problems = len(reg.loop._problem) + len(reg.loop._streak)
        await ctl.manager.stop()
        return state, problems

    assert asyncio.run(go()) == (0, 0)
