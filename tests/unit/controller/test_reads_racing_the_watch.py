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
from tests.unit.controller.test_controller_review import KEY, Kube, _run_a
from tests.unit.controller.test_namesake_and_revocation import T0, _new_run, _old_pod


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
    assert cache.run(KEY) is not None and "job-a1" in cache.pods_of(KEY), fed


# --- found by a review of the first fix: the same class at every read ------------------


def _ctl() -> RunController:
    return RunController(Kube({}), clock=Clock(now=lambda: T0, mono=lambda: 100.0))  # type: ignore[arg-type]


def test_get_answer_older_than_the_watch_overwrites_it() -> None:
    """GET answered with rv 3; the watch then brings rv 4 (spec.suspend set); the GET's answer is handled last."""
    async def go() -> RunController:
        ctl = _ctl()
        ctl.on_run("ADDED", _run_a())
        old = copy.deepcopy(ctl.cache.runs[KEY]); old = _run_a()
        async def racing(*_: Any) -> dict[str, Any]:
            newer = _run_a(); newer["metadata"].update(resourceVersion="4", generation=2); newer["spec"]["suspend"] = True
            ctl.on_run("MODIFIED", newer)
            return old
        ctl.kube.get_run = racing  # type: ignore[attr-defined]
        await ctl.executor.refresh(KEY)
        return ctl
    ctl = asyncio.run(go())
    assert ctl.cache.run(KEY).resource_version == "4", ctl.cache.run(KEY).resource_version


def test_get_answer_revives_a_run_the_watch_saw_deleted() -> None:
    async def go() -> RunController:
        ctl = _ctl()
        ctl.on_run("ADDED", _run_a())
        async def racing(*_: Any) -> dict[str, Any]:
            ctl.on_run("DELETED", _run_a())
            return _run_a()
        ctl.kube.get_run = racing  # type: ignore[attr-defined]
        await ctl.executor.refresh(KEY)
        return ctl
    assert asyncio.run(go()).cache.run(KEY) is None


def test_get_of_old_run_replaces_the_namesake_the_watch_brought() -> None:
    async def go() -> RunController:
        ctl = _ctl()
        ctl.on_run("ADDED", _run_a())
        async def racing(*_: Any) -> dict[str, Any]:
            ctl.on_run("DELETED", _run_a()); ctl.on_run("ADDED", _new_run())
            return _run_a()  # answered before the deletion
        ctl.kube.get_run = racing  # type: ignore[attr-defined]
        await ctl.executor.refresh(KEY)
        return ctl
    kept = asyncio.run(go()).cache.run(KEY)
    assert kept is not None and kept.uid == "run-NEW", kept and kept.uid


def _budget(rv: str = "1") -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget",
            "metadata": {"name": "b", "namespace": "ns", "uid": "b-1", "resourceVersion": rv},
            "spec": {"limitCents": 100}, "status": {}}


def test_budget_get_revives_a_budget_deleted_meanwhile() -> None:
    from tether.api.models import WorkerRun
    run = _new_run(); run["spec"]["budget"] = {"budgetRef": {"name": "b"}}
    wr = WorkerRun.model_validate(run)
    class K:
        raced = False
        async def get_budget(self, ns: str, name: str) -> dict[str, Any] | None:
            if K.raced:
                return None
            K.raced = True
            book.on_event("ADDED", _budget()); book.on_event("DELETED", _budget())
            return _budget()
    book = BudgetBook(K(), lambda: T0)  # type: ignore[arg-type]
    async def go() -> Any:
        return await book.observe(wr, T0)
    async def go2() -> Any:
        obs = await book.observe(wr, T0)
        return obs, dict(book.cache)
    try:
        obs = asyncio.run(go2())
        assert ("ns", "b") not in obs[1], obs
    except Exception as exc:  # noqa: BLE001
        obs = exc
    assert ("ns", "b") not in book.cache, (obs, book.cache)


def test_sweeper_final_relist_drops_runs_of_a_recreated_namespace() -> None:
    """The namespace is gone and re-created (new uid, not deleting); kopf watches it and delivered a run
    before the sweeper's next loop; the sweeper's final relist drops it."""
    cache = RunCache(lambda: dt.datetime.now(dt.timezone.utc), time.monotonic)
    fed: list[tuple[str, str]] = []
    def feed(kind: str, event_type: str, body: dict[str, Any]) -> None:
        fed.append((kind, event_type))
        if kind == "run":
            (cache.drop_run if event_type == "DELETED" else cache.put_run)(body)
    calls = {"n": 0}
    class K:
        async def get_object(self, path: str) -> dict[str, Any]:
            calls["n"] += 1
            if calls["n"] == 1:
                return {"metadata": {"name": "ns", "uid": "ns-1", "deletionTimestamp": "2026-11-29T12:00:00Z"}}
            return {"metadata": {"name": "ns", "uid": "ns-2"}}  # re-created, watched by kopf again
        async def list_objects(self, path: str, *a: Any, **k: Any) -> list[dict[str, Any]]:
            # The re-created namespace holds its new run (what a real list answers).
            return [_new_run()] if "workerruns" in path and calls["n"] >= 2 else []
    async def go() -> None:
        sw = sweeper.NamespaceSweeper(K(), cache, BudgetBook(K(), lambda: T0), feed, lambda ns: None)  # type: ignore[arg-type]
        orig = asyncio.sleep
        async def quick(_: float) -> None:
            cache.put_run(copy.deepcopy(_new_run()))  # the watch on the new namespace delivers its run
            await orig(0)
        sweeper.asyncio.sleep = quick  # type: ignore[attr-defined]
        try:
            await sw._sweep_until_gone("ns")
        finally:
            sweeper.asyncio.sleep = orig  # type: ignore[attr-defined]
    asyncio.run(go())
    assert cache.run(KEY) is not None, fed


def test_sweeper_relist_revives_a_pod_the_watch_saw_deleted() -> None:
    cache = RunCache(lambda: dt.datetime.now(dt.timezone.utc), time.monotonic)
    cache.put_run(copy.deepcopy(_run_a()))
    cache.put_pod(_old_pod())
    def feed(kind: str, event_type: str, body: dict[str, Any]) -> None:
        if kind == "pod":
            cache.drop_pod(body) if event_type == "DELETED" else cache.put_pod(body)
        elif kind == "run":
            (cache.drop_run if event_type == "DELETED" else cache.put_run)(body)
    class K:
        async def list_objects(self, path: str, *a: Any, **k: Any) -> list[dict[str, Any]]:
            if "pods" in path:
                cache.drop_pod(_old_pod())  # listed, then deleted: the DELETED is handled first
                return [_old_pod()]
            if "workerruns" in path:
                return [_run_a()]
            return []
    async def go() -> None:
        sw = sweeper.NamespaceSweeper(K(), cache, BudgetBook(K(), lambda: T0), feed, lambda ns: None)  # type: ignore[arg-type]
        await sw._relist_now("ns")
    asyncio.run(go())
    assert "job-a1" not in cache.pods_of(KEY)


def test_sweeper_started_for_a_namespace_that_is_not_being_deleted_drops_its_runs() -> None:
    """mark() came from a stale signal (a 403 'being terminated' answered for the namespace's previous
    incarnation); the namespace the sweeper reads is live: every run cached there is fed DELETED."""
    cache = RunCache(lambda: dt.datetime.now(dt.timezone.utc), time.monotonic)
    cache.put_run(copy.deepcopy(_new_run()))
    def feed(kind: str, event_type: str, body: dict[str, Any]) -> None:
        if kind == "run":
            (cache.drop_run if event_type == "DELETED" else cache.put_run)(body)
    class K:
        async def get_object(self, path: str) -> dict[str, Any]:
            return {"metadata": {"name": "ns", "uid": "ns-2"}}
        async def list_objects(self, path: str, *a: Any, **k: Any) -> list[dict[str, Any]]:
            return [_new_run()] if "workerruns" in path else []
    async def go() -> None:
        sw = sweeper.NamespaceSweeper(K(), cache, BudgetBook(K(), lambda: T0), feed, lambda ns: None)  # type: ignore[arg-type]
        await sw._sweep_until_gone("ns")
    asyncio.run(go())
    assert cache.run(KEY) is not None
