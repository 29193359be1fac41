"""The start gate (spec.review.start) as a table: what decide does with each state of approvals."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from tether.api.models import Phase
from tether.core.decide import decide
from tether.core.observe import ApprovalObservation
from tests.unit.core.test_decide import T0, cond, kinds, observe, run, status_of

CREATED = T0 - dt.timedelta(minutes=10)


def gated(timeout: int | None = None, status: dict[str, Any] | None = None) -> Any:
    review: dict[str, Any] = {"start": True}
    if timeout is not None:
        review["startTimeoutSeconds"] = timeout
    return run(spec={"review": review}, status=status, creationTimestamp=CREATED.isoformat())


def approval(decision: str, minutes: float = -1, gate: str = "Start", uid: str | None = None,
             name: str = "a", seconds: int = 0) -> ApprovalObservation:
    return ApprovalObservation(name=name, gate=gate, decision=decision, approver="alice", reason="looked fine",
                               created=T0 + dt.timedelta(minutes=minutes, seconds=seconds), run_uid=uid)


@pytest.mark.parametrize("approvals, phase, approved", [
    # nothing decided: wait, say so (kstatus InProgress via Reconciling; Argo Suspended)
    ((), Phase.AWAITING_APPROVAL, ("False", "Pending")),
    # an approval for another gate or request does not count
    ((approval("Approve", gate="Result"), approval("Approve", gate="refund")), Phase.AWAITING_APPROVAL,
     ("False", "Pending")),
    # made for a deleted namesake (before this run existed, no UID): never this run's
    ((approval("Approve", minutes=-20),), Phase.AWAITING_APPROVAL, ("False", "Pending")),
    # made in the second this run was created, naming only the name: creation times have whole
    # seconds, so it may be a deleted namesake's (deleted and re-created in that second): not this run's
    ((approval("Approve", minutes=-10),), Phase.AWAITING_APPROVAL, ("False", "Pending")),
    # from the next second on a name-only approval counts; one naming the UID counts whenever made
    ((approval("Approve", minutes=-10, seconds=1),), Phase.STARTING, ("True", "Approved")),
    ((approval("Approve", minutes=-10, uid="u-1"),), Phase.STARTING, ("True", "Approved")),
    # naming another run's UID
    ((approval("Approve", uid="u-other"),), Phase.AWAITING_APPROVAL, ("False", "Pending")),
    # approved: the first attempt is granted in the same write
    ((approval("Approve"),), Phase.STARTING, ("True", "Approved")),
    ((approval("Approve", minutes=-20, uid="u-1"),), Phase.STARTING, ("True", "Approved")),
    # denied: the run ends Rejected
    ((approval("Deny"),), Phase.REJECTED, ("False", "Denied")),
    # a denial is final: any Deny wins, whatever came after it or the order it is seen in
    ((approval("Deny", minutes=-2, name="x"), approval("Approve", minutes=-1, name="y")), Phase.REJECTED,
     ("False", "Denied")),
    ((approval("Approve", minutes=-2, name="x"), approval("Deny", minutes=-1, name="y")), Phase.REJECTED,
     ("False", "Denied")),
])
def test_the_start_gate(approvals: tuple[ApprovalObservation, ...], phase: Phase, approved: tuple[str, str]) -> None:
    o = observe(gated(), None)
    d = decide(o.__class__(**{**o.__dict__, "approvals": approvals}))
    s = status_of(d.actions)
    assert s.phase == phase
    assert cond(s, "Approved") == approved
    assert ("EnsureLease" in kinds(d.actions)) == (phase == Phase.STARTING)
    if phase == Phase.REJECTED:
        assert cond(s, "Stalled")[0] == "True" and s.finished_at == T0 and s.attempt == 0
    # What the time-to-decision metric observes: the decision, once, with the wait since creation.
    write = next(a for a in d.actions if type(a).__name__ == "WriteStatus")
    details = write.details.log_fields()
    if phase == Phase.AWAITING_APPROVAL:
        assert "approvals" not in details
    else:
        [(gate, decision, seconds)] = details["approvals"]
        assert (gate, decision) == ("Start", "Approve" if phase == Phase.STARTING else "Deny")
        assert seconds >= 0
    # The gate is on record: pending while it waits, then with the decision and who made it.
    [req] = s.review.requests
    assert (req.gate, req.attempt, req.requested_at) == ("Start", 0, CREATED)
    assert req.decision == {Phase.AWAITING_APPROVAL: None, Phase.STARTING: "Approve", Phase.REJECTED: "Deny"}[phase]
    assert req.approver == (None if phase == Phase.AWAITING_APPROVAL else "alice")


def test_waiting_writes_once_then_waits_quietly() -> None:
    o = observe(gated(), None)
    first = status_of(decide(o).actions)
    again = decide(observe(gated(status=first.model_dump(by_alias=True, mode="json", exclude_none=True)), None))
    assert again.actions == []


def test_no_decision_within_the_timeout_rejects() -> None:
    waiting = decide(observe(gated(timeout=900), None))  # created 10 min ago: 5 min left
    assert status_of(waiting.actions).phase == Phase.AWAITING_APPROVAL
    assert waiting.requeue_after == pytest.approx(300)
    late = decide(observe(gated(timeout=600), None))
    s = status_of(late.actions)
    assert s.phase == Phase.REJECTED and cond(s, "Approved") == ("False", "TimedOut")


def test_a_run_approved_once_needs_no_approval_for_its_retries() -> None:
    st = {"phase": "Backoff", "attempt": 1, "fence": 2, "observedGeneration": 1, "startedAt": T0.isoformat(),
          "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "outcome": "PodFailed",
                        "startedAt": T0.isoformat(), "endedAt": T0.isoformat()}],
          "nextAttemptAt": T0.isoformat()}
    d = decide(observe(gated(status=st), None))  # the approval is gone by now: still no gate
    assert "EnsureLease" in kinds(d.actions)


def test_a_name_only_approval_of_the_creation_second_is_named_as_not_counted() -> None:
    # It would otherwise be ignored in silence: the run says which approval and what to do.
    o = observe(gated(), None)
    d = decide(o.__class__(**{**o.__dict__, "approvals": (approval("Approve", minutes=-10, name="early"),)}))
    s = status_of(d.actions)
    message = next(c.message for c in s.conditions if c.type == "Approved")
    assert s.phase == Phase.AWAITING_APPROVAL and "not counted: early" in message and "spec.runRef.uid" in message
