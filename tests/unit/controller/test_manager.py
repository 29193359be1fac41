"""The controller manager: named reconcilers with their own queues, woken only through the watches
they declared; the operator's controller registers runs, strays and budget refreshes on it."""

from __future__ import annotations

import asyncio
import datetime as dt
import types
from typing import Any

import pytest

from tether import metrics
from tether.controller import budget_refresh
from tether.controller.controller import RUNS, STRAYS, Clock, RunController
from tether.controller.loop import Result
from tether.controller.manager import Manager, Wake, Watch

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


class _Nothing:
    async def reconcile(self, key: Any) -> Result:
        return Result()

    def exists(self, key: Any) -> bool:
        return True


def _keys(manager: Manager, name: str) -> list[Any]:
    return list(manager.queues()[name]._queue)


def test_an_event_is_observed_once_and_each_watcher_maps_it_to_its_own_keys() -> None:
    seen: list[str] = []

    def observer(event_type: str | None, body: dict[str, Any]) -> str | None:
        seen.append(body["name"])
        return None if body["name"] == "quiet" else body["name"]

    m = Manager(mono=lambda: 0.0)
    m.observe("thing", observer)
    m.register("a", _Nothing(), 1, [Watch("thing", lambda name: [Wake(("a", name))])])
    m.register("b", _Nothing(), 1, [Watch("thing", lambda name: [Wake(("b", name))] if name == "x" else [])])
    m.feed("thing", "ADDED", {"name": "x"})
    m.feed("thing", "ADDED", {"name": "y"})
    m.feed("thing", "ADDED", {"name": "quiet"})
    assert seen == ["x", "y", "quiet"]
    assert _keys(m, "a") == [("a", "x"), ("a", "y")]
    assert _keys(m, "b") == [("b", "x")]


def test_a_read_of_a_kind_reaches_the_watches_of_the_kind_it_stands_for() -> None:
    m = Manager(mono=lambda: 0.0)
    m.observe("run", lambda t, body: body["name"])
    m.observe("run-read", lambda t, body: body["name"] + "!", watched_as="run")
    m.register("runs", _Nothing(), 1, [Watch("run", lambda name: [Wake(name)])])
    m.feed("run-read", "MODIFIED", {"name": "r"})
    assert _keys(m, "runs") == ["r!"]


def test_registration_refuses_a_second_name_and_a_watch_nothing_observes() -> None:
    m = Manager(mono=lambda: 0.0)
    m.observe("thing", lambda t, body: body)
    m.register("a", _Nothing(), 1, [Watch("thing", lambda c: [])])
    with pytest.raises(ValueError, match="registered already"):
        m.register("a", _Nothing(), 1, [])
    with pytest.raises(ValueError, match="nothing observes"):
        m.register("b", _Nothing(), 1, [Watch("pods", lambda c: [])])


@pytest.mark.parametrize("wake, failures, expect_queued, expect_timer, expect_failures", [
    (Wake("k"), 0, True, False, 0),
    (Wake("k", after=5.0), 0, False, True, 0),
    (Wake("k", after=5.0, fold=True), 0, False, True, 0),
    # A fold timer never cuts an error backoff short.
    (Wake("k", after=5.0, fold=True), 2, False, False, 2),
    # A new spec: the old spec's error backoff no longer applies.
    (Wake("k", new_spec=True), 2, True, False, 0),
    (Wake("k"), 2, True, False, 2),
])
def test_how_a_wake_enters_its_queue(wake: Wake[str], failures: int, expect_queued: bool, expect_timer: bool,
                                     expect_failures: int) -> None:
    async def go() -> None:  # (timers need a running loop)
        m = Manager(mono=lambda: 0.0)
        registered = m.register("a", _Nothing(), 1, [])
        for _ in range(failures):
            registered.queue.backoff.when("k")
        m.wake("a", [wake])
        assert ("k" in registered.queue._queue) == expect_queued
        assert ("k" in registered.queue._timers) == expect_timer
        assert registered.queue.backoff.failures("k") == expect_failures
        registered.queue.shutdown()

    asyncio.run(go())


def _run(name: str, budget: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"budget": {"budgetRef": {"name": budget}}} if budget else {}
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "resourceVersion": "1"},
            "spec": spec, "status": {}}


def test_the_operator_runs_three_reconcilers_each_woken_by_its_own_watches() -> None:
    ctl = RunController(types.SimpleNamespace(), clock=Clock(now=lambda: T0, mono=lambda: 0.0))  # type: ignore[arg-type]
    m = ctl.manager
    assert sorted(m.queues()) == sorted([RUNS, STRAYS, budget_refresh.NAME])
    ctl.feed("run", "ADDED", _run("r", budget="team"))
    assert (_keys(m, RUNS), _keys(m, STRAYS)) == ([("ns", "r")], [])
    ctl.feed("run", "DELETED", _run("r", budget="team"))
    assert _keys(m, STRAYS) == [("ns", "r")]
    # A budget never refreshed is due one: its refresh queue has it, the runs' queue is not woken for it.
    budget = {"metadata": {"name": "team", "namespace": "ns", "uid": "b", "resourceVersion": "1"},
              "spec": {"limitCents": 100}, "status": {}}
    ctl.feed("budget", "ADDED", budget)
    assert _keys(m, budget_refresh.NAME) == [("ns", "team")]


@pytest.mark.parametrize("raised, outcome", [
    (None, "done"),
    ("conflict", "again"),  # a charge wrote first: a race, decided again from a fresh read, not an error
    ("notfound", "done"),  # deleted since the read
])
def test_the_budget_refresh_reconciler_treats_a_lost_race_as_a_reason_to_look_again(raised: str | None,
                                                                                     outcome: str) -> None:
    from tether.controller.budget_refresh import BudgetRefresher
    from tether.controller.errors import Again
    from tether.kube.client import Conflict, NotFound

    calls: list[Any] = []

    class Book:
        cache: dict[Any, Any] = {}

        async def refresh(self, key: Any) -> None:
            calls.append(key)
            if raised == "conflict":
                raise Conflict(409, "Conflict", "the object has been modified")
            if raised == "notfound":
                raise NotFound(404, "NotFound", "gone")

    async def go() -> str:
        try:
            await BudgetRefresher(Book()).reconcile(("ns", "team"))  # type: ignore[arg-type]
        except Again:
            return "again"
        return "done"

    assert asyncio.run(go()) == outcome and calls == [("ns", "team")]


def test_a_refused_registration_leaves_nothing_behind() -> None:
    """A registration refused for a watch nothing observes leaves no queue that feed() fills and
    nothing drains, and does not take over the gauges of the queue of that name."""
    m = Manager(mono=lambda: 0.0)
    m.observe("thing", lambda t, body: body["name"])
    good = m.register("refused-test", _Nothing(), 1, [Watch("thing", lambda name: [Wake(name)])])
    m2 = Manager(mono=lambda: 0.0)
    m2.observe("thing", lambda t, body: body["name"])
    with pytest.raises(ValueError, match="nothing observes"):
        m2.register("refused-test", _Nothing(), 1,
                    [Watch("thing", lambda name: [Wake(name)]), Watch("pods", lambda c: [])])
    for i in range(5):
        m2.feed("thing", "ADDED", {"name": f"k{i}"})
    assert "refused-test" not in m2.queues()
    attached = [r.name for r, _ in m2._watches.get("thing", ())]
    good.queue.add("x")  # the real queue of that name holds one key
    depth = metrics.REGISTRY.get_sample_value("workqueue_depth", {"name": "refused-test"})
    assert (attached, depth) == ([], 1.0), f"orphan watch {attached}, depth gauge reads {depth}"
