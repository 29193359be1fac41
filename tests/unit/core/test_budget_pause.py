"""spec.budget.onExhausted: Pause, by tables on an injected clock: a held run whose cap or WorkerBudget
is reached is told to pause (as spec.suspend does) instead of stopped, says why and what to raise
(condition Suspended and Ready's reason BudgetPaused, an Event when it turns), holds its progress
clock, and goes on when there is room again; Stop (the default) is unchanged."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from tether.api.models import Phase, Remaining, Usage
from tether.core.actions import EnsureSignals, Revoke, WriteStatus
from tether.core.decide import decide
from tether.core.enforcement import signals_for
from tether.core.liveness import progress_held
from tether.core.observe import BudgetObservation
from tests.unit.core.test_decide import T0, held, lease, observe, pod, run

PAUSE = {"budget": {"capCents": 100, "onExhausted": "Pause"}, "stopGraceSeconds": 5}


def running() -> dict[str, Any]:
    """A held run as its grant left it (Ready says Running)."""
    return held(conditions=[{"type": "Ready", "status": "False", "reason": "Running", "message": "job-a1 runs",
                             "lastTransitionTime": T0.isoformat()}])


def passes(spec: dict[str, Any], status: dict[str, Any], usage: Usage, budget: BudgetObservation | None = None,
           now: dt.datetime = T0, told_paused: bool = False) -> tuple[Any, list[Any]]:
    """The run's status after its passes settle (each write applied), and every action asked."""
    r, asked = run(spec, status=status), []
    for _ in range(4):
        # The Lease carries what the worker was told before this (not paused), to see what it is told now.
        told = signals_for(r.spec, r.status, None, budget_paused=told_paused)
        d = decide(observe(r, lease(usage=usage, signals=told), (pod(),), now=now, budget=budget))
        asked += d.actions
        writes = [a.status_write if isinstance(a, Revoke) else a for a in d.actions if isinstance(a, (WriteStatus, Revoke))]
        if not writes:
            return r, asked
        r = run(spec, status=writes[-1].status.dump())
    return r, asked


def signals(actions: list[Any]) -> dict[str, Any]:
    return json.loads([a for a in actions if isinstance(a, EnsureSignals)][-1].signals)


def cond(r: Any, type_: str) -> tuple[str, str, str]:
    c = next(c for c in r.status.conditions if c.type == type_)
    return c.status, c.reason, c.message or ""


def test_a_cap_reached_pauses_the_worker_and_says_what_to_raise() -> None:
    r, asked = passes(PAUSE, running(), Usage(cents=100))
    sig = signals(asked)
    assert sig["paused"] is True and sig["stop"] is False  # told to pause, not to stop
    assert not any(isinstance(a, Revoke) for a in asked) and r.status.phase == Phase.RUNNING
    assert r.status.stop_requested_at is None and r.status.holder == "job-a1"  # it keeps its lease
    status, reason, message = cond(r, "Suspended")
    assert (status, reason) == ("True", "BudgetPaused") and "cap of 100 cents reached" in message
    assert "raise spec.budget.capCents" in message
    assert cond(r, "Ready")[1] == "BudgetPaused"
    events = [e for a in asked if isinstance(a, WriteStatus) for e in a.events]
    assert [e.reason for e in events] == ["BudgetPaused"]
    assert progress_held(r)  # no progress is owed while it pauses
    # Asked again (a later heartbeat at the same spend): said once.
    again, more = passes(PAUSE, r.status.model_dump(mode="json", by_alias=True, exclude_none=True), Usage(cents=100))
    assert not [e for a in more if isinstance(a, WriteStatus) for e in a.events]


def test_raising_the_cap_resumes_it_where_it_stood() -> None:
    paused, _ = passes(PAUSE, running(), Usage(cents=100))
    raised = {**PAUSE, "budget": {"capCents": 150, "onExhausted": "Pause"}}
    r, asked = passes(raised, paused.status.model_dump(mode="json", by_alias=True, exclude_none=True), Usage(cents=100),
                      told_paused=True)
    assert signals(asked)["paused"] is False and r.status.attempt == 1 and r.status.holder == "job-a1"
    assert cond(r, "Suspended")[:2] == ("False", "Resumed") and "room in the budget" in cond(r, "Suspended")[2]
    assert not progress_held(r)


def test_an_exhausted_workerbudget_pauses_until_its_period_rolls_over() -> None:
    spec = {"budget": {"budgetRef": {"name": "team"}, "onExhausted": "Pause"}}
    budget = BudgetObservation(name="team", exhausted=True, remaining=Remaining(cents=0, tokens=0),
                               charged=Usage(cents=40), next_reset_seconds=600)
    r, asked = passes(spec, running(), Usage(cents=40), budget)
    assert signals(asked)["paused"] is True and r.status.phase == Phase.RUNNING
    assert "wait for its period to roll over" in cond(r, "Suspended")[2]
    d = decide(observe(r, lease(usage=Usage(cents=40)), (pod(),), budget=budget))
    assert d.requeue_after is not None and d.requeue_after <= 600  # decided again when it rolls over


def test_stop_the_default_still_ends_the_run() -> None:
    spec = {"budget": {"capCents": 100}, "stopGraceSeconds": 5}
    _, asked = passes(spec, running(), Usage(cents=100))
    assert signals(asked)["stop"] is True and signals(asked)["paused"] is False


def test_kubectl_tether_and_the_console_show_a_paused_run_and_what_it_waits_for() -> None:
    """What the decision wrote, as the two places users look first render it: the pause and what to
    raise lead, before the phase (which stays Running: the worker keeps its lease)."""
    from tether import plugin
    from tether.console import views
    r, _ = passes(PAUSE, running(), Usage(cents=100))
    body = {"metadata": {"namespace": "ns", "name": "job", "uid": "u1"}, "spec": PAUSE,
            "status": r.status.model_dump(mode="json", by_alias=True, exclude_none=True)}
    lines = plugin.status_lines(body, None, T0)
    assert lines[0].startswith("ns/job: Running (BudgetPaused)"), lines
    assert "raise spec.budget.capCents" in lines[1] and "cap of 100 cents reached" in lines[1], lines
    summary = views.run_fragments("", body, [], [], T0, None)["summary"]
    assert summary.startswith('<span class="why"><b>BudgetPaused</b>: ') and "raise spec.budget.capCents" in summary
