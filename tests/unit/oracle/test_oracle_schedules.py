"""Invariant 14 on synthetic audit logs: a slot's run created twice, a lastScheduleTime that goes
back, and a slot passed over without a record are each caught; a clean history (slots started,
one skipped by name, missed ones counted) passes."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

from testkit.oracle_schedules import judge_schedules
from tests.unit.oracle.test_oracle import NS, OPERATOR, Log

START = 1796671200  # a multiple of 5 (Unix seconds)


def _iso(epoch: int) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _create(log: Log, slot: int, code: int = 201) -> None:
    name = f"sched-{slot}"
    log._event("create", "workerruns", name, OPERATOR, code, None, group="tether.dev",
               request={"metadata": {"name": name, "labels": {"tether.dev/schedule": "sched"}}})


def _status(log: Log, last: int, skipped: tuple[int, str] | None = None, count: int = 0) -> dict[str, Any]:
    status: dict[str, Any] = {"lastScheduleTime": _iso(last), "skippedCount": count}
    if skipped is not None:
        status["lastSkipped"] = {"scheduledTime": _iso(skipped[0]), "reason": skipped[1], "message": "-"}
    body = {"metadata": {"name": "sched", "namespace": NS, "resourceVersion": log._next_rv()}, "status": status}
    log._event("update", "workerrunschedules", "sched", OPERATOR, 200, body, "status", "tether.dev")
    return body


def _judge(log: Log, final: dict[str, Any]) -> list[tuple[int, str, str]]:
    found: list[tuple[int, str, str]] = []
    judge_schedules(log.records, NS, {"sched": (5, final)}, found, Counter())
    return found


def _clean(log: Log) -> dict[str, Any]:
    _create(log, START)
    _status(log, START)
    _create(log, START + 5)
    _create(log, START + 5, code=409)  # a retry after a crash: AlreadyExists, not a second run
    _status(log, START + 5)
    _status(log, START + 10, skipped=(START + 10, "Suspended"), count=1)
    # Downtime: three slots missed, the latest started, two counted.
    _create(log, START + 25)
    return _status(log, START + 25, skipped=(START + 10, "Suspended"), count=3)


def test_a_clean_history_passes() -> None:
    log = Log()
    assert _judge(log, _clean(log)) == []


def test_a_slots_run_created_twice_is_caught() -> None:
    log = Log()
    final = _clean(log)
    _create(log, START + 5)  # landed after the history limit deleted the first one
    assert [(v[0], v[1]) for v in _judge(log, final)] == [(14, f"sched-{START + 5}")]


def test_a_last_schedule_time_that_goes_back_is_caught() -> None:
    log = Log()
    _clean(log)
    final = _status(log, START + 5, count=3)
    assert any("went back" in v[2] for v in _judge(log, final))


def test_a_slot_passed_over_without_a_record_is_caught() -> None:
    log = Log()
    _create(log, START)
    _status(log, START)
    final = _status(log, START + 10)  # START + 5: no run, no skip named, nothing counted
    found = _judge(log, final)
    assert len(found) == 1 and "neither started nor recorded" in found[0][2] and str(START + 5) in found[0][2]


def test_a_slot_both_started_and_recorded_as_skipped_is_caught() -> None:
    log = Log()
    _create(log, START)
    _status(log, START)
    _create(log, START + 5)  # its status write lost; the next pass did not see the run: "forbidden by itself"
    final = _status(log, START + 5, skipped=(START + 5, "ConcurrencyForbid"), count=1)
    assert any("both started and recorded as skipped" in v[2] for v in _judge(log, final))
