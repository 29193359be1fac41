"""A read that finds an object absent says so of the moment it was answered, not of the moment its
answer is handled: what the watch brought in between is newer and stays. Found by the fault trials
(seed 82089): the operator's GET of a deleted run answered 404 while the user re-created the run;
the watch delivered the new run first, and the 404 then dropped *it*, so it was never reconciled."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import time
from typing import Any, Callable

from tether.controller import sweeper
from tether.controller.budgets import BudgetBook
from tether.controller.cache import RunCache
from tether.controller.controller import RunController
from tether.kube.paths import budget_path, run_path
from testkit.fakeapi import FakeApi, Request
from tests.unit.controller.test_controller_review import KEY, _run_a
from tests.unit.controller.test_namesake_and_revocation import T0, _new_run, _old_pod, controller

GONE = (404, {"kind": "Status", "code": 404, "reason": "NotFound", "message": "gone"})
Answer = tuple[int, dict[str, Any]]


def _while_asked(api: FakeApi, method: str, path: str, race: Callable[[], Answer | None]) -> None:
    """The first time the API is asked `method path`, `race` runs while the request is on its way
    (what the watch delivers meanwhile) and may answer for the server."""
    def hook(req: Request) -> Answer | None:
        if (req.method, req.path) != (method, path):
            return None
        api.hooks.remove(hook)
        return race()

    api.before(hook)


def _lists(api: FakeApi, answers: Callable[[str], list[dict[str, Any]] | None]) -> None:
    """Every list the API is asked for is answered by `answers(path)` (None: as the API holds it)."""
    def hook(req: Request) -> Answer | None:
        if req.method != "GET" or req.path.rsplit("/", 1)[-1] not in ("workerruns", "pods", "leases", "workerbudgets"):
            return None
        items = answers(req.path)
        return None if items is None else (200, {"kind": "List", "metadata": {}, "items": items})

    api.before(hook)


def test_a_run_re_created_while_a_read_of_the_old_one_was_answered_404_is_kept() -> None:
    async def go() -> RunController:
        api = FakeApi()
        ctl = controller(api)
        ctl.on_run("ADDED", _run_a())

        def gone_then_recreated() -> Answer:
            ctl.on_run("DELETED", _run_a())  # the old run goes ...
            ctl.on_run("ADDED", _new_run())  # ... and its namesake's ADDED lands before our 404 is handled
            return GONE

        _while_asked(api, "GET", run_path(*KEY), gone_then_recreated)
        await ctl.executor.refresh(KEY)
        return ctl

    ctl = asyncio.run(go())
    kept = ctl.cache.run(KEY)
    assert kept is not None and kept.uid == "run-NEW"


def test_a_run_the_404_was_about_is_still_dropped() -> None:
    async def go() -> RunController:
        ctl = controller(FakeApi())  # the API holds no such run
        ctl.on_run("ADDED", _run_a())
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

    api = FakeApi()

    def answered_then_watched(path: str) -> list[dict[str, Any]] | None:
        if path.endswith("workerruns"):
            # Answered without the run; the watch brings it (and its pod) right after.
            cache.put_run(copy.deepcopy(_new_run()))
            pod = _old_pod()
            pod["metadata"].update(uid="pod-new", ownerReferences=[{**pod["metadata"]["ownerReferences"][0],
                                                                    "uid": "run-NEW"}])
            cache.put_pod(pod)
        return None

    _lists(api, answered_then_watched)

    async def go() -> None:
        kube = api.client()
        sweep = sweeper.NamespaceSweeper(kube, cache, BudgetBook(kube, lambda: T0), feed, lambda ns: None)
        await sweep._relist_now("ns")

    asyncio.run(go())
    assert cache.run(KEY) is not None and "job-a1" in cache.pods_of(KEY), fed


# --- found by a review of the first fix: the same class at every read ------------------


def _ctl(api: FakeApi) -> RunController:
    return controller(api)


def test_get_answer_older_than_the_watch_overwrites_it() -> None:
    """GET answered with rv 3; the watch then brings rv 4 (spec.suspend set); the GET's answer is handled last."""
    async def go() -> RunController:
        api = FakeApi()
        ctl = _ctl(api)
        ctl.on_run("ADDED", _run_a())

        def racing() -> Answer:
            newer = _run_a(); newer["metadata"].update(resourceVersion="4", generation=2); newer["spec"]["suspend"] = True
            ctl.on_run("MODIFIED", newer)
            return 200, _run_a()  # the GET was answered before that change

        _while_asked(api, "GET", run_path(*KEY), racing)
        await ctl.executor.refresh(KEY)
        return ctl
    ctl = asyncio.run(go())
    assert ctl.cache.run(KEY).resource_version == "4", ctl.cache.run(KEY).resource_version


def test_get_answer_revives_a_run_the_watch_saw_deleted() -> None:
    async def go() -> RunController:
        api = FakeApi()
        ctl = _ctl(api)
        ctl.on_run("ADDED", _run_a())

        def racing() -> Answer:
            ctl.on_run("DELETED", _run_a())
            return 200, _run_a()

        _while_asked(api, "GET", run_path(*KEY), racing)
        await ctl.executor.refresh(KEY)
        return ctl
    assert asyncio.run(go()).cache.run(KEY) is None


def test_get_of_old_run_replaces_the_namesake_the_watch_brought() -> None:
    async def go() -> RunController:
        api = FakeApi()
        ctl = _ctl(api)
        ctl.on_run("ADDED", _run_a())

        def racing() -> Answer:
            ctl.on_run("DELETED", _run_a()); ctl.on_run("ADDED", _new_run())
            return 200, _run_a()  # answered before the deletion

        _while_asked(api, "GET", run_path(*KEY), racing)
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
    api = FakeApi()  # the budget is gone by the time anyone asks again

    def racing() -> Answer:
        book.on_event("ADDED", _budget()); book.on_event("DELETED", _budget())
        return 200, _budget()  # answered before the deletion

    _while_asked(api, "GET", budget_path("ns", "b"), racing)
    book = BudgetBook(api.client(), lambda: T0)

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
    api = FakeApi()
    api.put("/api/v1/namespaces/ns", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": "ns", "uid": "ns-1", "deletionTimestamp": "2026-11-29T12:00:00Z", "finalizers": ["kubernetes"]}})

    def recreated() -> None:
        # Gone and created again (watched by kopf again), holding its new run (what a real list answers).
        api.put("/api/v1/namespaces/ns", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns", "uid": "ns-2"}})
        api.put(run_path(*KEY), _new_run())
        return None

    _while_asked(api, "GET", "/api/v1/namespaces/ns", lambda: None)  # the first read: being deleted
    api.before(lambda req: recreated() if api.calls.count("GET /api/v1/namespaces/ns") == 2 and
               req.call == "GET /api/v1/namespaces/ns" else None)

    async def go() -> None:
        kube = api.client()
        sw = sweeper.NamespaceSweeper(kube, cache, BudgetBook(kube, lambda: T0), feed, lambda ns: None)
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
    api = FakeApi()

    def listed(path: str) -> list[dict[str, Any]]:
        if path.endswith("pods"):
            cache.drop_pod(_old_pod())  # listed, then deleted: the DELETED is handled first
            return [_old_pod()]
        return [_run_a()] if path.endswith("workerruns") else []

    _lists(api, listed)

    async def go() -> None:
        kube = api.client()
        sw = sweeper.NamespaceSweeper(kube, cache, BudgetBook(kube, lambda: T0), feed, lambda ns: None)
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
    api = FakeApi()
    api.put("/api/v1/namespaces/ns", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns", "uid": "ns-2"}})
    api.put(run_path(*KEY), _new_run())

    async def go() -> None:
        kube = api.client()
        sw = sweeper.NamespaceSweeper(kube, cache, BudgetBook(kube, lambda: T0), feed, lambda ns: None)
        await sw._sweep_until_gone("ns")
    asyncio.run(go())
    assert cache.run(KEY) is not None
