"""The fleet gauges exported per controller (metrics.export) and the work-queue gauges: nothing of a
stopped controller is exported, and scrapes on the metrics thread never fail."""

from __future__ import annotations

import asyncio
import threading
import types
from typing import Any

import pytest
from prometheus_client import generate_latest

from tether import metrics
from tether.controller.controller import RUNS, Clock, RunController


class _Fleet:
    """A running controller as the fleet gauges see it; its first read blocks until released."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.stopped = False

    def phase_counts(self) -> dict[tuple[str, str, str], int]:
        self.entered.set()
        self.release.wait(5)
        return {("review-ns", "Running", ""): 1}

    def class_labels(self) -> dict[str, dict[str, str]]:
        return {"tool-call": {"tool": "search"}}

    def pending_approvals(self) -> dict[tuple[str, str], tuple[int, float | None]]:
        return {}

    def heartbeat_ages(self) -> list[tuple[str, str, float]]:
        return [("review-ns", "r", 5.0)]

    def api_available(self) -> bool:
        return True

    def budget_bodies(self) -> dict[tuple[str, str], dict[str, Any]]:
        return {("review-ns", "team"): {"spec": {"limitCents": 100}, "status": {"spent": {"cents": 7}}}}


def test_a_scrape_under_way_when_the_controller_stops_reads_nothing_more_of_it() -> None:
    """kopf's cleanup stops exporting, then stops the controller. A scrape that started just before
    (prometheus copies the collector list under its lock, then collects outside it) must export
    nothing it read of the controller after that."""
    fleet = _Fleet()
    stop = metrics.export(fleet)
    out: list[str] = []
    scrape = threading.Thread(target=lambda: out.append(generate_latest(metrics.REGISTRY).decode()))
    scrape.start()
    try:
        assert fleet.entered.wait(5), "the scrape never reached the fleet gauges"
        stop()  # handlers.stop_exporting(memo) ...
        fleet.stopped = True  # ... then `await ctl.stop()` returns
    finally:
        fleet.release.set()
        scrape.join(5)
    text = out[0]
    leaked = [line for line in text.splitlines()
              if line.startswith(("tether_heartbeat_age_seconds{", "tether_budget_spent_cents{",
                                  "tether_budget_limit_cents{", "tether_apiserver_available "))]
    assert leaked == [], f"read from the controller after its stop, and exported: {leaked}"


def test_a_stopped_controllers_work_queue_gauges_are_not_exported() -> None:
    """Once the controller stops, its queues' gauges go (they reported the keys left in a queue
    nothing drains any more, until the process exited)."""
    async def go() -> None:
        ctl = RunController(types.SimpleNamespace(), clock=Clock())  # type: ignore[arg-type]  # no I/O
        for i in range(3):
            ctl.queue.add(("ns", f"r{i}"))
        await ctl.manager.stop()  # as ctl.stop(): every loop stops, every queue shuts down

    asyncio.run(go())
    depth = metrics.REGISTRY.get_sample_value("workqueue_depth", {"name": RUNS})
    assert depth in (None, 0.0), f"a stopped controller's queue still exported with depth {depth}"


def test_export_twice_raises_before_registering_anything_and_stop_is_clean() -> None:
    """A second export raises at its first family, leaving nothing half-registered; stopping the
    first leaves none of the fleet families, and a new controller exports again."""
    first = metrics.export(_Fleet())
    try:
        with pytest.raises(ValueError, match="Duplicated"):
            metrics.export(_Fleet())
    finally:
        first()
    names = {m.name for m in metrics.REGISTRY.collect()}
    assert not names & {"tether_workerruns", "tether_heartbeat_age_seconds", "tether_budget_spent_cents"}
    again = metrics.export(_Fleet())  # and export works again after a stop (a new controller)
    again()


def test_export_and_unexport_while_scrapes_run_never_fail_a_scrape() -> None:
    """Exporting and stopping while scrapes run never fails a scrape."""
    class Quick(_Fleet):
        def phase_counts(self) -> dict[tuple[str, str, str], int]:
            return {("review-ns", "Running", ""): 1}

    errors: list[BaseException] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            try:
                generate_latest(metrics.REGISTRY)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    threads = [threading.Thread(target=scrape) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(300):
            metrics.export(Quick())()
    finally:
        done.set()
        for t in threads:
            t.join(5)
    assert errors == []
