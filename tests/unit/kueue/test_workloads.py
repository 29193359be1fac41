"""The Workload of a queued run and the writes Kueue expects on it (kueue.workloads): what goes into
the Workload from the run's labels, and what a quota release leaves for Kueue's own bookkeeping."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from tether.kueue.api import LABEL_MAX_EXEC_TIME, max_exec_seconds
from tests.unit.core.test_decide import T0, run
from tests.unit.kueue.test_decide import ADMISSION, QUEUE, cond
from tether.kueue.workloads import released_status, workload_body


@pytest.mark.parametrize(("value", "seconds"), [
    ("3600", 3600), ("1", 1), ("2147483647", 2147483647),
    # What the admission policy refuses, found on a run made before it was installed: no limit.
    ("0", None), ("0600", None), ("-5", None), ("ten", None), ("", None), ("2147483648", None), ("٣", None),
    ("1e3", None), (" 60", None),
])
def test_the_maximum_execution_time_label_read_as_the_policy_admits_it(value: str, seconds: int | None) -> None:
    assert max_exec_seconds({LABEL_MAX_EXEC_TIME: value}) == seconds
    assert max_exec_seconds({}) is None


def test_the_workload_carries_the_runs_maximum_execution_time() -> None:
    timed = workload_body(run(labels={**QUEUE, LABEL_MAX_EXEC_TIME: "90"}), "wl", "team-a", None, "sha256:x")
    assert timed["spec"]["maximumExecutionTimeSeconds"] == 90
    plain = workload_body(run(labels=QUEUE), "wl", "team-a", None, "sha256:x")
    assert "maximumExecutionTimeSeconds" not in plain["spec"]


def _evicted(admitted_since: dt.datetime, accumulated: int | None) -> dict[str, Any]:
    status: dict[str, Any] = {"admission": ADMISSION, "conditions": [
        cond("QuotaReserved", "True"), {**cond("Admitted", "True"), "lastTransitionTime": admitted_since.isoformat()},
        cond("Evicted", "True", "Preempted")]}
    if accumulated is not None:
        status["accumulatedPastExecutionTimeSeconds"] = accumulated
    return {"metadata": {"name": "wl", "generation": 1}, "status": status}


@pytest.mark.parametrize(("accumulated", "total"), [(None, 100), (10, 110)])
def test_a_release_adds_the_admitted_time_up_as_kueue_does(accumulated: int | None, total: int) -> None:
    """Kueue adds an admission's length to accumulatedPastExecutionTimeSeconds when Admitted turns
    False in its own writes; Tether's release turns it False, so it adds it: a run evicted and
    readmitted does not get its whole maximum execution time again."""
    out = released_status(_evicted(T0, accumulated), T0 + dt.timedelta(seconds=100))
    assert out["accumulatedPastExecutionTimeSeconds"] == total
    assert {c["type"]: c["status"] for c in out["conditions"]}["Admitted"] == "False"
    assert "admission" not in out


def test_a_release_of_a_workload_not_admitted_adds_nothing() -> None:
    wl = _evicted(T0, 7)
    wl["status"]["conditions"][1]["status"] = "False"
    assert released_status(wl, T0 + dt.timedelta(seconds=100))["accumulatedPastExecutionTimeSeconds"] == 7
