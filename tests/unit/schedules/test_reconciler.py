"""The schedule reconciler against the one fake API (testkit/fakeapi.py), the operator's real client
and the controller's real stores: what lands between its reads and its writes. A cache not listed
yet after a restart, a pass whose status write was lost, a run made meanwhile by another replica, a
name taken by someone else's run."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest

from tether.controller.controller import Clock, RunController
from tether.controller.errors import Again
from tether.kube.paths import run_path
from tether.schedules.api import slot_run_name
from tether.schedules.capability import CAPABILITY as SCHEDULES, NAME
from tether.schedules.paths import schedule_path
from testkit.fakeapi import FakeApi

U = dt.timezone.utc
SLOT = dt.datetime(2026, 12, 7, 12, 0, tzinfo=U)
PREVIOUS = SLOT - dt.timedelta(minutes=5)
NOW = SLOT + dt.timedelta(seconds=1)
KEY = ("ns", "nightly")


def _schedule(policy: str) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunSchedule",
            "metadata": {"name": "nightly", "namespace": "ns", "creationTimestamp": "2026-12-07T11:00:00Z"},
            "spec": {"schedule": "*/5 * * * *", "concurrencyPolicy": policy,
                     "runTemplate": {"spec": {"executor": "External"}}},
            "status": {"lastScheduleTime": PREVIOUS.strftime("%Y-%m-%dT%H:%M:%SZ")}}


def _run(api: FakeApi, slot: dt.datetime, owner_uid: str, phase: str = "Running") -> dict[str, Any]:
    name = slot_run_name("nightly", slot)
    return api.put(run_path("ns", name), {
        "apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
        "metadata": {"name": name, "namespace": "ns", "labels": {"tether.dev/schedule": "nightly"},
                     "annotations": {"tether.dev/scheduled-at": slot.strftime("%Y-%m-%dT%H:%M:%SZ")},
                     "ownerReferences": [{"kind": "WorkerRunSchedule", "name": "nightly", "uid": owner_uid,
                                          "controller": True}]},
        "spec": {"executor": "External"}, "status": {"phase": phase}})


def _setup(policy: str) -> tuple[FakeApi, RunController, dict[str, Any]]:
    api = FakeApi(now=lambda: NOW)
    ctl = RunController(api.client(), clock=Clock(now=lambda: NOW, mono=lambda: 0.0), capabilities=(SCHEDULES,))
    schedule = api.put(schedule_path(*KEY), _schedule(policy))
    ctl.feed("schedule", "ADDED", schedule)
    return api, ctl, schedule


def _pass(ctl: RunController) -> Any:
    reconciler = ctl.manager._registered[NAME].loop.reconciler
    return asyncio.run(reconciler.reconcile(KEY))


def _passes(ctl: RunController, n: int = 4) -> None:
    """Passes as the loop makes them: one sent back (Again) is decided again, on what it learned."""
    for _ in range(n):
        try:
            _pass(ctl)
            return
        except Again:
            continue
    raise AssertionError("the pass never settled")


def test_after_a_restart_a_cache_without_the_active_run_never_starts_a_second_under_forbid() -> None:
    api, ctl, schedule = _setup("Forbid")
    _run(api, PREVIOUS, schedule["metadata"]["uid"])  # on the server, not listed by this operator yet
    with pytest.raises(Again):
        _pass(ctl)
    _passes(ctl)
    assert not [c for c in api.asked("workerruns", writes=True) if c.startswith("POST")]
    status = api.get(schedule_path(*KEY))["status"]  # type: ignore[index]
    assert status["lastSkipped"]["reason"] == "ConcurrencyForbid"


@pytest.mark.parametrize("policy", ["Replace", "Forbid"])
def test_a_slot_whose_run_was_made_before_its_status_write_was_lost_is_neither_made_again_nor_stopped(
        policy: str) -> None:
    api, ctl, schedule = _setup(policy)
    made = _run(api, SLOT, schedule["metadata"]["uid"])
    ctl.feed("run", "ADDED", made)
    _passes(ctl)
    assert api.asked("workerruns", writes=True) == []  # no create, no stop
    status = api.get(schedule_path(*KEY))["status"]  # type: ignore[index]
    assert status["lastScheduleTime"] == "2026-12-07T12:00:00Z" and "lastSkipped" not in status


def test_a_run_another_replica_made_meanwhile_is_the_slots_one_run() -> None:
    api, ctl, schedule = _setup("Allow")

    def replica(req: Any) -> tuple[int, dict[str, Any]] | None:
        if req.method == "POST" and req.path.endswith("/workerruns") and api.get(run_path("ns", slot_run_name("nightly", SLOT))) is None:
            _run(api, SLOT, schedule["metadata"]["uid"])  # lands first
        return None

    api.before(replica)
    _passes(ctl)
    runs = [p for p in api.objects if p.startswith(run_path("ns") + "/")]
    assert runs == [run_path("ns", slot_run_name("nightly", SLOT))]
    assert api.get(schedule_path(*KEY))["status"]["lastScheduleTime"] == "2026-12-07T12:00:00Z"  # type: ignore[index]


def test_a_slot_name_someone_else_took_is_skipped_and_their_run_left_alone() -> None:
    api, ctl, _ = _setup("Replace")
    squatter = _run(api, SLOT, "someone-else")
    ctl.feed("run", "ADDED", squatter)
    _passes(ctl)
    assert api.asked("workerruns", writes=True) == []  # neither created over, stopped nor deleted
    assert api.get(schedule_path(*KEY))["status"]["lastSkipped"]["reason"] == "NameTaken"  # type: ignore[index]


def test_a_schedule_changed_since_the_decision_is_decided_again() -> None:
    api, ctl, schedule = _setup("Allow")
    edited = {**schedule, "spec": {**schedule["spec"], "suspend": True}}
    api.put(schedule_path(*KEY), edited)  # the watch has not brought it yet
    with pytest.raises(Again):
        _pass(ctl)
    _passes(ctl)
    assert api.asked("workerruns", writes=True) == []
    assert api.get(schedule_path(*KEY))["status"]["lastSkipped"]["reason"] == "Suspended"  # type: ignore[index]
