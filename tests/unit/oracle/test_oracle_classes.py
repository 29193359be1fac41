"""Invariant 13: what a run took from its WorkerClass is fixed from its first grant."""

from __future__ import annotations

import pytest

from testkit.oracle import judge
from tests.unit.oracle.test_oracle import Log, Run, facts, invariants

pytestmark = pytest.mark.unit

TAKEN = {"name": "tools", "defaults": {"lease": {"durationSeconds": 8, "renewIntervalSeconds": 1}}}


def classed(log: Log) -> tuple[Run, str]:
    run = Run(log)
    run.spec = {"className": "tools"}  # its lease is its class's
    run.write(phase="Pending", **{"class": TAKEN})
    run.status["class"] = TAKEN
    pod = run.grant()
    run.renew(pod)
    return run, pod


def test_a_run_that_keeps_what_it_took_passes() -> None:
    log = Log()
    run, pod = classed(log)
    run.publish(pod)
    run.end("Succeeded", "Succeeded")
    verdict = judge(log.records, facts(run))
    assert verdict.ok, verdict.violations
    assert verdict.stats["runs granted with a class"] == 1


def test_a_class_recorded_anew_after_the_grant_is_caught() -> None:
    log = Log()
    run, pod = classed(log)
    run.write(**{"class": {"name": "tools", "defaults": {"lease": {"durationSeconds": 12, "renewIntervalSeconds": 1}}}})
    assert 13 in invariants(judge(log.records, facts(run)))


def test_a_lease_granted_with_another_duration_is_caught() -> None:
    log = Log()
    run, pod = classed(log)
    run.end("LeaseLost", "Backoff")
    run.grant()
    lease = log.records[-2].response_object  # the second grant's Lease write
    assert lease is not None and lease["spec"]["leaseDurationSeconds"] == 8
    ok = judge(log.records, facts(run))
    assert 13 not in invariants(ok), ok.violations
    # The same history with the second grant's Lease written for a 12 s lease (the class as edited).
    lease["spec"]["leaseDurationSeconds"] = 12
    assert 13 in invariants(judge(log.records, facts(run)))


def test_a_run_granted_with_another_class_than_it_names_is_caught() -> None:
    log = Log()
    run = Run(log)
    run.spec = {"className": "tools"}
    run.grant()  # granted with no status.class at all, though it names one
    assert 13 in invariants(judge(log.records, facts(run)))
