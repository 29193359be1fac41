"""The result gate (spec.review.result) and a worker's named requests, as tables over decide."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import replace
from typing import Any

import pytest

from tether import protocol
from tether.api.models import Outcome, Phase, WorkerRunStatus
from tether.core.decide import decide, desired_signals
from tether.core.observe import ApprovalObservation, Observed
from tests.unit.core.test_decide import T0, cond, held, kinds, lease, observe, pod, run, status_of

pytestmark = pytest.mark.unit

RESULT = {"answer": 42}


def reviewed(status: dict[str, Any], timeout: int | None = None, **spec: Any) -> Any:
    review: dict[str, Any] = {"result": True}
    if timeout is not None:
        review["resultTimeoutSeconds"] = timeout
    return run(spec={"review": review, **spec}, status=status)


def approval(decision: str, gate: str = "Result", minutes: float = 1, attempt: int | None = 1,
             name: str = "a", reason: str = "checked") -> ApprovalObservation:
    return ApprovalObservation(name=name, gate=gate, decision=decision, approver="alice", reason=reason,
                               created=T0 + dt.timedelta(minutes=minutes), attempt=attempt)


def dumped(s: WorkerRunStatus) -> dict[str, Any]:
    return s.model_dump(by_alias=True, mode="json", exclude_none=True)


def published(attempt: int = 1) -> Observed:
    return observe(reviewed(held(attempt, result=RESULT)), lease(attempt), now=T0)


def awaiting(attempt: int = 1, timeout: int | None = None, **spec: Any) -> dict[str, Any]:
    """The status after the holder of `attempt` published and its result went to review."""
    status = held(attempt, result=RESULT)
    for _ in range(3):  # a first pass may record something else first (a moved deadline)
        status = dumped(status_of(decide(observe(reviewed(status, timeout, **spec), lease(attempt), now=T0)).actions))
        if status["phase"] == "AwaitingReview":
            return status
    raise AssertionError(status)


def at(status: dict[str, Any], approvals: tuple[ApprovalObservation, ...] = (), minutes: float = 2,
       timeout: int | None = None, **spec: Any) -> Observed:
    o = observe(reviewed(status, timeout, **spec), None, now=T0 + dt.timedelta(minutes=minutes))
    return replace(o, approvals=approvals)


# --- the result gate ----------------------------------------------------------------


def test_a_published_result_ends_the_attempt_and_waits_for_review() -> None:
    d = decide(published())
    assert kinds(d.actions) == ["Revoke"]
    assert d.actions[0].pods_to_delete == ()  # the worker published: its pod finishes by itself
    s = status_of(d.actions)
    assert (s.phase, s.holder, s.fence, s.result) == (Phase.AWAITING_REVIEW, None, 2, RESULT)
    assert s.attempts[-1].outcome == Outcome.SUCCEEDED
    assert cond(s, "Approved") == ("False", "Pending")
    assert cond(s, "Reconciling")[0] == "True" and cond(s, "Ready")[0] == "False"  # kstatus: InProgress
    [req] = s.review.requests
    assert (req.gate, req.attempt, req.requested_at, req.decision) == ("Result", 1, T0, None)


@pytest.mark.parametrize("approvals, phase, approved", [
    ((), Phase.AWAITING_REVIEW, None),
    # another gate's decision, or one for another attempt, does not decide this result
    ((approval("Approve", gate="Start"), approval("Approve", gate="refund")), Phase.AWAITING_REVIEW, None),
    ((approval("Approve", attempt=2),), Phase.AWAITING_REVIEW, None),
    # one naming no attempt decides nothing, whenever it was made (the CRD refuses new ones)
    ((approval("Approve", attempt=None),), Phase.AWAITING_REVIEW, None),
    ((approval("Approve", minutes=-1, attempt=None),), Phase.AWAITING_REVIEW, None),
    ((approval("Approve"),), Phase.SUCCEEDED, ("True", "Approved")),
    # bound to the attempt, even one made before the result (a pre-approval of that attempt)
    ((approval("Approve", minutes=-1),), Phase.SUCCEEDED, ("True", "Approved")),
    # denied: the retry rules decide (attempts remain: Backoff)
    ((approval("Deny", reason="cite your sources"),), Phase.BACKOFF, ("False", "Denied")),
    ((approval("Approve", name="x"), approval("Deny", name="y", minutes=1.5)), Phase.BACKOFF, ("False", "Denied")),
])
def test_the_result_gate(approvals: tuple[ApprovalObservation, ...], phase: Phase,
                         approved: tuple[str, str] | None) -> None:
    d = decide(at(awaiting(), approvals))
    if phase == Phase.AWAITING_REVIEW:
        assert d.actions == []  # waiting costs no writes
        return
    s = status_of(d.actions)
    assert s.phase == phase and cond(s, "Approved") == approved
    req = s.review.find("Result", 1)
    assert req is not None and req.approver == "alice"
    if phase == Phase.SUCCEEDED:
        assert s.result == RESULT and req.decision == "Approve" and s.attempts[-1].outcome == Outcome.SUCCEEDED
        assert cond(s, "Ready") == ("True", "Succeeded")
    else:
        assert s.result is None and req.decision == "Deny"
        assert s.attempts[-1].outcome == Outcome.RESULT_REJECTED
        assert s.review.feedback == "cite your sources" if len(approvals) == 1 else s.review.feedback
        assert s.next_attempt_at is not None and "EnsureLease" not in kinds(d.actions)


def test_a_denied_result_gives_its_reason_to_the_next_attempt() -> None:
    denied = status_of(decide(at(awaiting(), (approval("Deny", reason="cite your sources"),))).actions)
    later = observe(reviewed(dumped(denied)), None, now=denied.next_attempt_at)
    d = decide(later)
    assert kinds(d.actions) == ["WriteStatus", "EnsureLease", "EnsurePod"]
    s = status_of(d.actions)
    assert (s.attempt, s.holder) == (2, "job-a2")
    assert s.review.feedback == "cite your sources"
    # The pod's environment carries it (kube/resources.py reads the run's status).
    from tether.kube.resources import worker_env
    env = {e["name"]: e["value"] for e in worker_env(reviewed(dumped(s)), "job-a2", 2, s.fence)}
    assert env["TETHER_REVIEW_FEEDBACK"] == "cite your sources"


def test_the_retry_rules_decide_after_a_denial() -> None:
    rules = {"retry": {"maxAttempts": 3, "rules": [{"action": "FailRun", "onReasons": ["ResultRejected"]}]}}
    s = status_of(decide(at(awaiting(**rules), (approval("Deny"),), **rules)).actions)
    assert s.phase == Phase.FAILED and s.error is not None and s.error.code == "ResultRejected"
    # Out of attempts: Failed too.
    last = status_of(decide(at(awaiting(attempt=3), (approval("Deny", attempt=3),))).actions)
    assert last.phase == Phase.FAILED


def test_an_unreviewed_result_times_out_rejected_and_keeps_its_result() -> None:
    waiting = awaiting(timeout=600)
    d = decide(at(waiting, minutes=5, timeout=600))
    assert d.actions == [] and d.requeue_after == pytest.approx(300)
    s = status_of(decide(at(waiting, minutes=10, timeout=600)).actions)
    assert s.phase == Phase.REJECTED and cond(s, "Approved") == ("False", "TimedOut")
    assert s.result == RESULT and s.review.find("Result", 1).decision == "TimedOut"
    # An approval made after the deadline does not count.
    late = status_of(decide(at(waiting, (approval("Approve", minutes=11),), minutes=12, timeout=600)).actions)
    assert late.phase == Phase.REJECTED


def test_the_run_deadline_does_not_cut_a_result_under_review() -> None:
    waiting = awaiting(deadlineSeconds=60)
    d = decide(at(waiting, minutes=30, deadlineSeconds=60))
    assert d.actions == []


def test_stopping_a_run_under_review_cancels_it_and_withdraws_the_gate() -> None:
    s = status_of(decide(at(awaiting(), stop=True)).actions)
    assert s.phase == Phase.CANCELLED and s.review.find("Result", 1).decision == "Withdrawn"


def test_without_the_gate_a_result_ends_the_run_at_once() -> None:
    o = observe(run(status=held(1, result=RESULT)), lease(1))
    assert status_of(decide(o).actions).phase == Phase.SUCCEEDED


# --- a worker's named requests --------------------------------------------------------


def asking(*names: str, timeout: int | None = None, attempt: int = 1, status: dict[str, Any] | None = None,
           approvals: tuple[ApprovalObservation, ...] = (), minutes: float = 0) -> Observed:
    reqs = tuple(protocol.ApprovalRequest(name=n, details=f"{n} 30 EUR", timeout_seconds=timeout) for n in names)
    st = status or held(attempt)
    o = observe(run(status=st), lease(attempt, requests=reqs), pods=(pod(attempt),),
                now=T0 + dt.timedelta(minutes=minutes))
    return replace(o, approvals=approvals)


def signals(d: Any) -> dict[str, Any]:
    """The signals the decision writes to the Lease ({} when they stay as they are)."""
    ensure = next((a for a in d.actions if type(a).__name__ == "EnsureSignals"), None)
    return json.loads(ensure.signals) if ensure is not None else {}


def test_a_request_is_recorded_and_decided_for_its_own_attempt() -> None:
    d = decide(asking("refund", timeout=600))
    s = status_of(d.actions)
    [req] = s.review.requests
    assert (req.gate, req.attempt, req.details, req.decision) == ("refund", 1, "refund 30 EUR", None)
    assert req.deadline == T0 + dt.timedelta(seconds=600)
    assert s.phase == Phase.RUNNING and s.holder == "job-a1"  # the attempt goes on
    assert "decisions" not in signals(d)
    recorded = dumped(s)
    # Approved: recorded and told to the worker in the same pass (signals after the status write).
    d2 = decide(asking("refund", timeout=600, status=recorded, approvals=(approval("Approve", gate="refund"),),
                       minutes=2))
    assert kinds(d2.actions)[-2:] == ["WriteStatus", "EnsureSignals"]
    assert status_of(d2.actions).review.find("refund", 1).decision == "Approve"
    assert signals(d2)["decisions"] == {"refund": {"decision": "Approve", "reason": "checked", "approver": "alice"}}


def test_a_request_times_out_and_the_worker_is_told() -> None:
    recorded = dumped(status_of(decide(asking("refund", timeout=60)).actions))
    d = decide(asking("refund", timeout=60, status=recorded, minutes=0.5))
    assert not any(type(a).__name__ == "WriteStatus" for a in d.actions) and d.requeue_after <= 30
    d = decide(asking("refund", timeout=60, status=recorded, minutes=1))
    assert status_of(d.actions).review.find("refund", 1).decision == "TimedOut"
    assert signals(d)["decisions"]["refund"]["decision"] == "TimedOut"


def test_a_decision_never_reaches_another_attempt() -> None:
    # Attempt 1 asked for "refund" and ended with it pending: Withdrawn. Attempt 2 asks again; an
    # approval bound to attempt 1, or made before attempt 2 asked, decides nothing for it.
    first = dumped(status_of(decide(asking("refund")).actions))
    ended = status_of(decide(observe(run(status=first), lease(1), pods=(), now=T0 + dt.timedelta(minutes=1),
                                     mono=1000.0)).actions)
    assert ended.review.find("refund", 1).decision == "Withdrawn"
    second = held(2)
    second["review"] = dumped(ended)["review"]
    stale = (approval("Approve", gate="refund", attempt=1, minutes=3), approval("Approve", gate="refund", minutes=1))
    d = decide(asking("refund", attempt=2, status=second, approvals=stale, minutes=2))
    s = status_of(d.actions)
    assert s.review.find("refund", 2).decision is None
    assert "decisions" not in signals(d)


def test_a_decision_made_for_a_withdrawn_request_is_not_applied() -> None:
    first = dumped(status_of(decide(asking("refund")).actions))
    ended = status_of(decide(observe(run(status=first), lease(1), now=T0 + dt.timedelta(minutes=1),
                                     mono=1000.0)).actions)
    later = replace(observe(run(status=dumped(ended)), None, now=T0 + dt.timedelta(minutes=2)),
                    approvals=(approval("Approve", gate="refund", attempt=1),))
    for action in decide(later).actions:
        if type(action).__name__ == "WriteStatus":
            assert action.status.review.find("refund", 1).decision == "Withdrawn"


def test_requests_fill_the_record_without_dropping_a_pending_gate() -> None:
    many = [f"r{i}" for i in range(protocol.MAX_REQUESTS_PER_ATTEMPT)]
    old = [{"gate": f"o{i}", "attempt": 0, "requestedAt": T0.isoformat(), "decision": "Approve"} for i in range(45)]
    st = held(1, review={"requests": old})
    s = status_of(decide(asking(*many, status=st)).actions)
    assert len(s.review.requests) == 50
    assert {r.gate for r in s.review.pending()} == set(many)


def test_signals_without_decisions_are_unchanged() -> None:
    o = observe(run(status=held(1)), lease(1))
    assert "decisions" not in json.loads(desired_signals(o, None))


def test_approvals_that_could_not_be_listed_decide_no_gate_and_block_nothing_else() -> None:
    # The list failed (approvals None): a result under review waits, even past its deadline...
    waiting = awaiting(timeout=60)
    d = decide(replace(at(waiting, minutes=5, timeout=60), approvals=None))
    assert d.actions == [] and d.requeue_after is not None
    # ...a start gate neither starts nor times out...
    gated = run(spec={"review": {"start": True, "startTimeoutSeconds": 1}}, status={},
                creationTimestamp=(T0 - dt.timedelta(hours=1)).isoformat())
    assert not any(type(a).__name__ in ("EnsureLease", "WriteStatus") for a in
                   decide(replace(observe(gated, None), approvals=None)).actions)
    # ...and a held attempt's lapse is still judged.
    lapsed = replace(asking("refund", minutes=1), approvals=None, mono=1000.0)
    assert status_of(decide(lapsed).actions).attempts[-1].outcome == Outcome.LEASE_LOST


def test_the_sdk_refuses_requests_the_control_plane_would_refuse() -> None:
    from tether.worker.run import WorkerRun

    class Never:
        def renew(self, *a: Any, **k: Any) -> Any:
            raise AssertionError("nothing is sent")

    w = WorkerRun(name="r", namespace="ns", holder="r-a1", fence=1, attempt=1, lease_duration=20,
                  renew_interval=5, transport=Never())  # type: ignore[arg-type]
    for name, details, timeout in (("a" * 63 + "\n", "", None), ("Refund", "", None), ("start", "", None),
                                   ("ok", "x" * 4097, None), ("ok", "", 0)):
        with pytest.raises(ValueError, match="approval request refused"):
            w.request_approval(name, details, timeout)
    for i in range(19):  # 19 x 1000 characters of 3 bytes, and 4096 more: over 65536 bytes
        w._requests[f"r{i}"] = protocol.ApprovalRequest(f"r{i}", "€" * 1000)
    with pytest.raises(ValueError, match="65536 bytes"):
        w.request_approval("one-more", "€" * 4096)


def test_the_requests_annotation_is_what_every_sdk_writes() -> None:
    """sdk/vectors/approvals.json, which the TypeScript and Go SDKs check byte for byte, is what
    the protocol's own writer produces, and what the operator parses back."""
    from pathlib import Path

    vectors = json.loads((Path(__file__).resolve().parents[3] / "sdk/vectors/approvals.json").read_text())
    assert vectors["requestsAnnotation"]
    for v in vectors["requestsAnnotation"]:
        asks = {r["name"]: protocol.ApprovalRequest(r["name"], r.get("details", ""), r.get("timeoutSeconds"))
                for r in v["requests"]}
        assert protocol.requests_annotation(asks) == v["annotation"], v["name"]
        assert {r.name: r for r in protocol.parse_requests(v["annotation"])} == asks, v["name"]



def test_approvals_are_listed_only_while_a_gate_is_open_or_a_request_is_new() -> None:
    from tether.core.review import needs_approvals

    asked = lease(1, requests=(protocol.ApprovalRequest("refund", "x"),))
    new = run(status=held(1))
    assert needs_approvals(new, asked)  # a request not recorded yet
    recorded = status_of(decide(asking("refund")).actions)
    assert needs_approvals(run(status=dumped(recorded)), asked)  # pending
    decided = status_of(decide(asking("refund", status=dumped(recorded),
                                      approvals=(approval("Approve", gate="refund"),), minutes=1)).actions)
    assert not needs_approvals(run(status=dumped(decided)), asked)  # decided: no list on every fold
    assert not needs_approvals(run(status=held(1)), lease(1))


# --- issue 34 (6): the REASON column says a request waits for a person ----------------------


def _shown(status: dict[str, Any], reason: str = "Running") -> dict[str, Any]:
    """`status` with the conditions a held, running run shows (Ready's reason is the REASON column)."""
    when = T0.isoformat()
    return {**status, "conditions": [
        {"type": "Ready", "status": "False", "reason": reason, "message": "job-a1 renewed its lease",
         "lastTransitionTime": when},
        {"type": "Reconciling", "status": "True", "reason": "Running", "message": "", "lastTransitionTime": when},
        {"type": "Stalled", "status": "False", "reason": "Running", "message": "", "lastTransitionTime": when}]}


def _reason(d: Any) -> tuple[str, str]:
    ready = next(x for x in status_of(d.actions).conditions if x.type == "Ready")
    return ready.reason, ready.message


def test_while_a_request_waits_the_runs_reason_says_so_and_goes_back_once_decided() -> None:
    asked = decide(asking("refund", "delete", timeout=600, status=_shown(held(1))))
    assert _reason(asked) == ("AwaitingApproval", "job-a1 waits for a WorkerRunApproval with gate refund, delete")
    s = status_of(asked.actions)
    # kstatus as before: in progress (Reconciling=True, Ready=False); the phase stays Running.
    assert (s.phase, cond(s, "Reconciling")[0], cond(s, "Ready")[0], cond(s, "Stalled")[0]) == \
        (Phase.RUNNING, "True", "False", "False")
    one = decide(asking("refund", "delete", timeout=600, status=dumped(s),
                        approvals=(approval("Approve", gate="refund"),), minutes=1))
    assert _reason(one) == ("AwaitingApproval", "job-a1 waits for a WorkerRunApproval with gate delete")
    both = decide(asking("refund", "delete", timeout=600, status=dumped(status_of(one.actions)),
                         approvals=(approval("Approve", gate="refund"), approval("Deny", gate="delete")), minutes=2))
    assert _reason(both) == ("Running", "job-a1 holds the lease")
    timed_out = decide(asking("refund", "delete", timeout=600, status=dumped(s), minutes=11))
    assert _reason(timed_out) == ("Running", "job-a1 holds the lease")
    # A paused worker says WorkerPaused (it does not go on, whatever is decided); an attempt that
    # ends withdraws its requests, and the run shows its next phase.
    paused = replace(asking("refund", "delete", status=dumped(s)), run=run(spec={"suspend": True}, status=dumped(s)))
    assert _reason(decide(paused))[0] == "WorkerPaused"
    ended = status_of(decide(replace(asking("refund", "delete", status=dumped(s), minutes=1), mono=1000.0)).actions)
    assert ended.review.find("refund", 1).decision == "Withdrawn"
    assert (ended.phase, cond(ended, "Ready")[1]) == (Phase.BACKOFF, "Backoff")


def test_a_run_that_shows_no_wait_for_a_pending_request_is_corrected() -> None:
    """A request recorded while Ready said Running (an operator before this fix) is said on the next pass."""
    pending = dumped(status_of(decide(asking("refund", status=held(1))).actions))
    d = decide(asking("refund", status=_shown(pending)))
    assert kinds(d.actions) == ["WriteStatus"] and _reason(d)[0] == "AwaitingApproval"
    assert decide(asking("refund", status=dumped(status_of(d.actions)))).actions == []  # said once
