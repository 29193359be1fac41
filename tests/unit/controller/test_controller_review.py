"""Defects an adversarial review found in the restructured controller (issue 21), each a test
that failed before its fix: strays a relist or a refresh left behind, a late answer reviving a
deleted pod, a sweep that never ended, a charge lost after its fold, a name Tether does not own."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import types
from typing import Any

import pytest

from tether.api import constants as c
from tether.controller import sweeper
from tether.controller.budgets import BudgetBook
from tether.controller.cache import RunCache
from tether.controller.controller import Clock, RunController
from tether.controller.errors import SpecError
from tether.core.decide import ChargeBudget, WriteStatus, decide
from tests.unit.core.test_decide import held, lease, observe, run
from tests.unit.controller.test_namesake_and_revocation import T0, _held, _new_run, _old_pod, controller, fake_api
from tether.core.observe import BudgetObservation
from tether.api.models import Remaining, Usage

KEY = ("ns", "job")


def _run_a() -> dict[str, Any]:
    body = _new_run()
    body["metadata"].update(uid="run-OLD", resourceVersion="3")
    return body


def test_a_namesake_listed_in_place_of_a_run_makes_the_old_runs_pods_strays() -> None:
    """After a watch gap kopf relists without DELETED events: the cache sees namesake B replace A
    under the same key. A's pod must be released (it blocked B forever) and A's UID forgotten."""
    pod = _old_pod()
    pod["metadata"]["finalizers"] = [c.POD_FINALIZER]
    api = fake_api(_new_run(), pod)

    async def go() -> tuple[int, bool]:
        ctl = controller(api)
        ctl.on_run("ADDED", _run_a())
        ctl.cache.tool_claims_cleared["run-OLD"] = 2
        ctl.on_pod("ADDED", _held(api, pod))
        ctl.on_run(None, _held(api, _new_run()))  # the relist: B, and never a DELETED for A
        queued = len(ctl.stray_queue)
        await ctl.stray_loop.reconciler.reconcile(KEY)
        return queued, "run-OLD" in ctl.cache.tool_claims_cleared

    queued, remembered = asyncio.run(go())
    assert queued == 1 and not remembered
    assert "DELETE pods/job-a1" in api.asked("pods", writes=True)


def test_a_refresh_that_finds_the_run_gone_releases_its_pods() -> None:
    async def go() -> int:
        ctl = controller(fake_api())  # the API no longer has the run
        ctl.on_run("ADDED", _run_a())
        ctl.on_pod("ADDED", _old_pod())
        assert len(ctl.stray_queue) == 0  # its own run's pod
        await ctl.executor.refresh(KEY)
        return len(ctl.stray_queue)

    assert asyncio.run(go()) == 1


def test_a_late_answer_never_revives_a_pod_the_watch_saw_deleted() -> None:
    ctl = RunController(types.SimpleNamespace(), clock=Clock(now=lambda: T0, mono=lambda: 100.0))  # type: ignore[arg-type]
    pod = _old_pod(deleting=T0)
    pod["metadata"]["finalizers"] = []
    ctl.on_pod("ADDED", pod)
    ctl.on_pod("DELETED", pod)  # the watch: gone
    ctl.cache.pod_written(KEY, "job-a1", pod)  # then the answer to our finalizer removal
    assert not ctl.cache.pods_of(KEY) and not ctl.reconciler.exists(KEY)


def test_a_pod_gone_by_our_own_write_keeps_its_name_taken() -> None:
    """The answer says the pod is gone before the watch does: its name stays taken as by the watch."""
    ctl = RunController(types.SimpleNamespace(), clock=Clock(now=lambda: T0, mono=lambda: 100.0))  # type: ignore[arg-type]
    ctl.on_pod("ADDED", _old_pod(deleting=T0))
    ctl.cache.pod_written(KEY, "job-a1", None)
    ctl.on_run("ADDED", _new_run())
    snap = ctl.cache.snapshot(KEY)
    assert snap is not None and [p.name for p in snap.foreign_pods] == ["job-a1"]


def test_the_sweep_ends_when_the_namespace_is_re_created(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweeper, "SWEEP_SECONDS", 0.01)

    class NsKube:
        ns: dict[str, Any] = {"metadata": {"name": "ns", "uid": "old", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
        gets = 0

        async def get_object(self, path: str) -> dict[str, Any]:
            self.gets += 1
            return self.ns

        async def list_objects(self, *a: Any, **k: Any) -> list[dict[str, Any]]:
            return []

    async def go() -> tuple[bool, bool]:
        kube = NsKube()
        cache = RunCache(lambda: dt.datetime.now(dt.timezone.utc), time.monotonic)
        sweep = sweeper.NamespaceSweeper(kube, cache, BudgetBook(kube, lambda: T0), lambda *a: None,  # type: ignore[arg-type]
                                         lambda ns: None)
        sweep.mark("ns")
        for _ in range(100):  # until the sweep has seen the namespace being deleted (its UID)
            if kube.gets >= 2:
                break
            await asyncio.sleep(0.01)
        kube.ns = {"metadata": {"name": "ns", "uid": "new"}}  # deleted and created again between two sweeps
        for _ in range(100):
            if "ns" not in sweep._tasks:
                break
            await asyncio.sleep(0.01)
        running = "ns" in sweep._tasks
        await sweep.stop()
        return running, sweep.terminating("ns")

    assert asyncio.run(go()) == (False, False)


def test_a_charge_lost_after_its_fold_is_owed_on_the_next_pass() -> None:
    """The fold's status write landed, its charge did not (a kill, conflicts, a lost leadership):
    the next pass, with nothing new to fold, still charges what the budget has not seen."""
    status = held(attempt=1, usage={"cents": 9, "tokens": 0}, foldedAt=T0.isoformat())
    r = run(spec={"budget": {"budgetRef": {"name": "team"}}}, status=status)
    budget = BudgetObservation(name="team", remaining=Remaining(cents=100, tokens=100), charged=Usage(cents=4))
    d = decide(observe(r, lease(usage=Usage(cents=9)), budget=budget, now=T0 + dt.timedelta(seconds=1)))
    assert not any(isinstance(a, WriteStatus) for a in d.actions)
    assert ChargeBudget(budget="team", total=Usage(cents=9)) in d.actions


def test_a_pod_of_the_holders_name_that_no_run_of_this_name_owns_is_refused_visibly() -> None:
    """A pod named <run>-a1 that Tether did not make (no run label): the grant waits and says so
    (a SpecError: Stalled with the reason, an Event), instead of retrying silently forever."""
    async def go() -> None:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "job-a1", "namespace": "ns", "uid": "x"},
               "status": {}}
        api = fake_api(_new_run(), pod)
        ctl = controller(api)
        ctl.on_run("ADDED", _held(api, _new_run()))
        await ctl.cache.classes.sync(lambda: ctl.kube.list_objects("/apis/tether.dev/v1alpha1/workerclasses"))
        snap = ctl.cache.snapshot(KEY)
        assert snap is not None
        with pytest.raises(SpecError, match="not this run's"):
            await ctl.reconciler._pass(snap)

    asyncio.run(go())
