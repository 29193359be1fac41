"""The controller's shape as a contract: what each decision must confirm before it acts, the work
queue's metrics on the injected clock, and what wakes the stray-pod queue."""

from __future__ import annotations

import types

import asyncio
from typing import Any

import pytest

from tether import metrics
from tether.api import constants as c
from tether.api.models import Usage, WorkerRunStatus
from tether.controller.controller import Clock, RunController
from tether.controller.workqueue import WorkQueue
from tether.core.actions import (
    Change,
    ChargeBudget,
    Confirm,
    Decision,
    DeleteRun,
    EnsureLease,
    EnsurePod,
    EnsureSignals,
    ReleaseCharge,
    RemoveFinalizer,
    Revoke,
    WriteStatus,
)

GRANT = WriteStatus(status=WorkerRunStatus(attempt=2, fence=3, holder="job-a2"), grants=True)
FIRST_GRANT = WriteStatus(status=WorkerRunStatus(attempt=1, fence=1, holder="job-a1"), grants=True)
FOLD = WriteStatus(status=WorkerRunStatus(attempt=1, fence=1, holder="job-a1"))
LAPSE = Revoke(status_write=WriteStatus(status=WorkerRunStatus(fence=2), lapse=True))
STOP = Revoke(status_write=WriteStatus(status=WorkerRunStatus(fence=2)))
CHARGE = ChargeBudget(budget="team", total=Usage(cents=1))
LEASE = EnsureLease(holder="job-a1", fence=1, duration_seconds=20)
POD = EnsurePod(name="job-a1", attempt=1, fence=1, holder="job-a1")


@pytest.mark.parametrize("actions, confirmations", [
    ([FIRST_GRANT, LEASE, POD], [Confirm.LEASE_FOR_GRANT, Confirm.HOLDER_NAME_FREE]),
    ([GRANT, LEASE, POD], [Confirm.LEASE_FOR_GRANT, Confirm.HOLDER_NAME_FREE, Confirm.NAMESPACE_LIVE]),
    ([LAPSE, CHARGE], [Confirm.LEASE_FINAL, Confirm.LAPSE]),  # the charge follows the revocation's CAS
    ([STOP], [Confirm.LEASE_FINAL]),
    ([LEASE, POD], [Confirm.RUN_UNMOVED]),  # a repair no status write precedes
    ([CHARGE, FOLD], [Confirm.RUN_UNMOVED]),  # before the write, the run is not pinned yet
    ([FOLD, CHARGE, EnsureSignals(fence=1, signals="")], []),
    ([WriteStatus(status=WorkerRunStatus(), change=Change.BUDGET_CHARGED)], [Confirm.BOOKS]),
    ([ReleaseCharge(budget="team")], [Confirm.BOOKS, Confirm.RUN_UNMOVED]),
    ([DeleteRun()], [Confirm.BOOKS, Confirm.LEDGER]),
    ([RemoveFinalizer()], [Confirm.BOOKS, Confirm.LEDGER]),
])
def test_each_decision_confirms_what_its_actions_rest_on(actions: list[Any], confirmations: list[Confirm]) -> None:
    assert list(Decision(actions=actions).confirmations()) == confirmations


def _sample(name: str, labels: dict[str, str]) -> float:
    value = metrics.REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_the_work_queue_times_its_metrics_on_the_injected_clock() -> None:
    now = [1000.0]

    async def go() -> tuple[float, float, float, float]:
        queue: WorkQueue[str] = WorkQueue(mono=lambda: now[0], name="shape-test")
        queue.add("a")
        queue.add("a")  # already waiting: one add counted, one key queued
        now[0] += 2.0
        key = await queue.get()
        assert key == "a"
        now[0] += 3.0
        longest = metrics.REGISTRY.get_sample_value("workqueue_longest_running_processor_seconds",
                                                    {"name": "shape-test"})
        queue.done(key)
        queue.add_rate_limited("a")
        queue.shutdown()
        return (_sample("workqueue_adds_total", {"name": "shape-test"}),
                _sample("workqueue_queue_duration_seconds_sum", {"name": "shape-test"}),
                _sample("workqueue_work_duration_seconds_sum", {"name": "shape-test"}), longest or 0.0)

    adds, waited, worked, longest = asyncio.run(go())
    assert (adds, waited, worked, longest) == (1.0, 2.0, 3.0, 3.0)
    assert _sample("workqueue_retries_total", {"name": "shape-test"}) == 1.0
    assert _sample("workqueue_depth", {"name": "shape-test"}) == 0.0


def _pod(owner: str) -> dict[str, Any]:
    return {"metadata": {"name": "job-a1", "namespace": "ns", "uid": "p1", "resourceVersion": "3",
                         "labels": {c.LABEL_RUN: "job", c.LABEL_ATTEMPT: "1"}, "finalizers": [c.POD_FINALIZER],
                         "ownerReferences": [{"kind": "WorkerRun", "name": "job", "uid": owner, "controller": True}]},
            "status": {"phase": "Running"}}


def test_only_pods_of_deleted_runs_wake_the_stray_queue() -> None:
    async def go() -> tuple[int, int, int]:
        ctl = RunController(types.SimpleNamespace(), clock=Clock())  # type: ignore[arg-type]  # no I/O here
        ctl.on_run("ADDED", {"metadata": {"name": "job", "namespace": "ns", "uid": "live", "resourceVersion": "1"},
                             "spec": {}, "status": {}})
        ctl.on_pod("ADDED", _pod("live"))
        live = len(ctl.stray_queue)
        ctl.on_pod("MODIFIED", {**_pod("gone"), "metadata": {**_pod("gone")["metadata"], "resourceVersion": "4"}})
        stray = len(ctl.stray_queue)
        ctl.on_run("DELETED", {"metadata": {"name": "job", "namespace": "ns", "uid": "live"}})
        after_delete = len(ctl.stray_queue)
        ctl.queue.shutdown()
        ctl.stray_queue.shutdown()
        return live, stray, after_delete

    assert asyncio.run(go()) == (0, 1, 1)
