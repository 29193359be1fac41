"""Invariant 16: a run whose budget says onExhausted: Pause is paused, never ended, for its cap; and
invariant 10 lets such a run (and only such a run) say BudgetPaused while a worker holds it."""

from __future__ import annotations

from typing import Any

import pytest

from testkit.oracle import TrialFacts, judge
from tests.unit.oracle.test_oracle import NS, Log, Run, facts, invariants

pytestmark = pytest.mark.unit
PAUSE = {"capCents": 4, "onExhausted": "Pause"}


def _paused(status: str, reason: str) -> list[dict[str, Any]]:
    return [{"type": "Suspended", "status": status, "reason": reason}]


def test_a_run_paused_at_its_cap_and_resumed_when_raised_passes_and_is_counted() -> None:
    log = Log()
    run = Run(log)
    run.spec["budget"] = dict(PAUSE)
    pod = run.grant()
    run.renew(pod)
    run.write(phase="Running", conditions=_paused("True", "BudgetPaused"))
    run.spec["budget"]["capCents"] = 1000
    run.write(conditions=_paused("False", "Resumed"))
    run.publish(pod)
    run.end("Succeeded", "Succeeded")
    verdict = judge(log.records, facts(run))
    assert verdict.ok, verdict.violations
    assert verdict.stats["runs paused for their budget"] == 1 and verdict.stats["budget pauses resumed"] == 1


@pytest.mark.parametrize("phase", ["BudgetExceeded", "Backoff"])
def test_a_pausing_run_ended_budget_exceeded_is_caught(phase: str) -> None:
    log = Log()
    run = Run(log)
    run.spec["budget"] = dict(PAUSE)
    run.grant()
    run.end("BudgetExceeded", phase)
    assert 16 in invariants(judge(log.records, facts(run)))


def test_a_run_that_stops_at_its_cap_may_end_budget_exceeded() -> None:
    log = Log()
    run = Run(log)
    run.spec["budget"] = {"capCents": 4}
    run.grant()
    run.end("BudgetExceeded", "BudgetExceeded")
    assert 16 not in invariants(judge(log.records, facts(run)))


def _final(budget: dict[str, Any], holder: str | None, suspend: bool = False) -> dict[str, Any]:
    return {"metadata": {"name": "r", "namespace": NS, "uid": "u1", "generation": 2},
            "spec": {"suspend": suspend, "budget": budget},
            "status": {"phase": "Running", "holder": holder, "observedGeneration": 2,
                       "conditions": _paused("True", "BudgetPaused")}}


@pytest.mark.parametrize(("final", "caught"), [
    (_final(PAUSE, "r-a1"), False),
    (_final({"capCents": 4}, "r-a1"), True),  # a run that stops at its cap never pauses for it
    (_final(PAUSE, None), True),  # nobody holds it: nothing to pause
    (_final(PAUSE, "r-a1", suspend=True), True),  # suspended: WorkerPaused says so
], ids=["pausing", "stopping-run", "unheld", "suspended"])
def test_10_budget_paused_is_said_only_by_a_held_run_whose_budget_pauses(final: dict[str, Any], caught: bool) -> None:
    verdict = judge([], TrialFacts(namespace=NS, runs=[final]))
    assert (10 in invariants(verdict)) == caught, verdict.violations
