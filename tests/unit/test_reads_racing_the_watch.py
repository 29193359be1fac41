"""A read that finds an object absent says so of the moment it was answered, not of the moment its
answer is handled: what the watch brought in between is newer and stays. Found by the fault trials
(seed 82089): the operator's GET of a deleted run answered 404 while the user re-created the run;
the watch delivered the new run first, and the 404 then dropped *it*, so it was never reconciled."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import time
from typing import Any

from tether.controller import sweeper
from tether.controller.budgets import BudgetBook
from tether.controller.cache import RunCache
from tether.controller.controller import Clock, RunController
from tether.kube.client import NotFound
from tests.unit.test_controller_review import KEY, Kube, _run_a
from tests.unit.test_namesake_and_revocation import T0, _new_run, _old_pod


def test_a_run_re_created_while_a_read_of_the_old_one_was_answered_404_is_kept() -> None:
    async def go() -> RunController:
        ctl = RunController(Kube({}), clock=Clock(now=lambda: T0, mono=lambda: 100.0))  # type: ignore[arg-type]
        ctl.on_run("ADDED", _run_a())

        async def gone_then_recreated(*_: Any) -> dict[str, Any]:
            ctl.on_run("DELETED", _run_a())  # the old run goes ...
            ctl.on_run("ADDED", _new_run())  # ... and its namesake's ADDED lands before our 404 is handled
            raise NotFound(404, "gone", "get run")

        ctl.kube.get_run = gone_then_recreated  # type: ignore[attr-defined]
        await ctl.executor.refresh(KEY)
        return ctl

    ctl = asyncio.run(go())
    kept = ctl.cache.run(KEY)
    assert kept is not None and kept.uid == "run-NEW"


def test_a_run_the_404_was_about_is_still_dropped() -> None:
    async def go() -> RunController:
        ctl = RunController(Kube({}), clock=Clock(now=lambda: T0, mono=lambda: 100.0))  # type: ignore[arg-type]
        ctl.on_run("ADDED", _run_a())

        async def gone(*_: Any) -> dict[str, Any]:
            raise NotFound(404, "gone", "get run")

        ctl.kube.get_run = gone  # type: ignore[attr-defined]
        await ctl.executor.refresh(KEY)
        return ctl

    assert asyncio.run(go()).cache.run(KEY) is None


def test_a_sweep_relist_drops_only_what_was_cached_before_it_listed() -> None:
    """The sweeper lists runs, then pods, Leases and budgets: a run or pod the watch brought after its
    list was answered is not 'gone' because that list lacks it."""
    cache = RunCache(lambda: dt.datetime.now(dt.timezone.utc), time.monotonic)
    fed: list[tuple[str, str, str]] = []

    def feed(kind: str, event_type: str, body: dict[str, Any]) -> None:
        fed.append((kind, event_type, body["metadata"]["uid"]))
        if kind == "run":
            (cache.drop_run if event_type == "DELETED" else cache.put_run)(body)
        elif kind == "pod":
            cache.drop_pod(body) if event_type == "DELETED" else cache.put_pod(body)

    class ListKube:
        async def list_objects(self, path: str, *a: Any, **k: Any) -> list[dict[str, Any]]:
            if "workerruns" in path:
                # Answered without the run; the watch brings it (and its pod) right after.
                cache.put_run(copy.deepcopy(_new_run()))
                pod = _old_pod()
                pod["metadata"].update(uid="pod-new", ownerReferences=[{**pod["metadata"]["ownerReferences"][0],
                                                                        "uid": "run-NEW"}])
                cache.put_pod(pod)
            return []

    async def go() -> None:
        sweep = sweeper.NamespaceSweeper(ListKube(), cache, BudgetBook(ListKube(), lambda: T0),  # type: ignore[arg-type]
                                         feed, lambda ns: None)
        await sweep._relist_now("ns")

    asyncio.run(go())
    assert cache.run(KEY) is not None and "job-a1" in cache.pods.get(KEY, {}), fed
