"""Review gates: a run that waits for a person's decision (spec.review, WorkerRunApproval).

Three kinds of gate, one record (status.review.requests) and one rule for which approval decides:
- Start (spec.review.start): no attempt starts until approved; a denial or a timeout ends the run
  Rejected.
- Result (spec.review.result): a published result waits (AwaitingReview); approved, the run
  Succeeded; denied, the attempt ends ResultRejected and the retry rules decide, the next attempt
  receiving the reason; unreviewed in time, the run ends Rejected.
- A worker's named request (request_approval): the attempt goes on; the decision (or TimedOut)
  reaches the worker on its Lease's signals, for its own attempt only.
"""

from __future__ import annotations

import datetime as dt

from tether import protocol
from tether.api import constants as c
from tether.api.conditions import get_condition, set_condition
from tether.api.models import ObjectMeta, Outcome, Phase, ReviewRequest, ReviewStatus, WorkerRun
from tether.core.actions import Decision, Event
from tether.core.clock import after
from tether.core.execution import execution_digest
from tether.core.lifecycle import RESULT_PENDING_MESSAGE, StatusBuilder, open_request, review_of
from tether.core.observe import ApprovalObservation, LeaseObservation, Observed

GATE_START, GATE_RESULT = c.GATE_START, c.GATE_RESULT
# Seconds until a pass whose approvals could not be listed tries again.
APPROVALS_UNKNOWN_RETRY = 5.0
PENDING_MESSAGE = "waiting for a WorkerRunApproval with gate Start"


def decision_on(o: Observed, req: ReviewRequest) -> ApprovalObservation | None:
    """The decision on gate `req`, from the approvals that are this run's and this gate's:
    - the run's (see `_names_run`);
    - this gate's: the same gate and, but for Start (a run has one, so any attempt an approval of
      Start names is that gate's), the same attempt (spec.attempt, which the CRD requires for other
      gates). Never by time: creationTimestamps have whole seconds, and an approval made for one
      attempt's gate in the second the next attempt's opened would decide both;
    - in time: made before the gate's deadline.
    Any Deny wins over any Approve: a denial is final, whatever order the operator sees them in."""
    run = o.run.metadata
    mine = [a for a in o.approvals or () if a.gate == req.gate and _names_run(a, run)
            and (req.gate == GATE_START or a.attempt == req.attempt)
            and (req.deadline is None or a.created <= req.deadline)]
    return min(mine, key=lambda a: (a.decision != "Deny", a.created, a.name), default=None)


def _names_run(a: ApprovalObservation, run: ObjectMeta) -> bool:
    """Whether approval `a` is this run's: it names the run's UID, or it names only the name and
    was made from the second after the run's creation on. Creation times have whole seconds: a
    name-only approval made in the run's own creation second may have been made for a namesake
    deleted in that second, so it counts only for a run created in an earlier second."""
    if a.run_uid:
        return a.run_uid == run.uid
    return run.creation_timestamp is None or a.created > run.creation_timestamp


def needs_approvals(run: WorkerRun, lease: LeaseObservation | None) -> bool:
    """Whether deciding the run may read its approvals: a gate is open or about to open."""
    s = run.status
    if s.phase is not None and s.phase.terminal:
        return False
    if run.spec.review.start and s.attempt == 0:
        return True
    review = s.review or ReviewStatus()
    # Not for a request already decided: a worker's requests stay on its Lease for the whole attempt,
    # and a list per pass for them would be a cost on every fold of a long-running run.
    unseen = lease is not None and any(review.find(r.name, s.attempt) is None for r in lease.requests)
    return s.phase == Phase.AWAITING_REVIEW or bool(review.pending()) or unseen


def _said(a: ApprovalObservation, verb: str) -> str:
    return f"{verb} by {a.approver}" + (f": {a.reason}" if a.reason else "")


def _record(req: ReviewRequest, decision: str, now: dt.datetime, a: ApprovalObservation | None = None,
            reason: str | None = None) -> None:
    req.decision = decision  # type: ignore[assignment]
    req.decided_at = now
    req.approver = a.approver if a is not None else None
    req.reason = (a.reason or None) if a is not None else reason


def _apply(o: Observed, b: StatusBuilder, req: ReviewRequest, decided: ApprovalObservation, what: str) -> str:
    """Records a decision on a Start or Result gate: the request, the Approved condition, an Event
    and the metric. Returns the message ("result approved by alice: ...")."""
    approve = decided.decision == "Approve"
    _metric(b, req.gate, decided.decision, (decided.created - req.requested_at).total_seconds())
    _record(req, decided.decision, o.now, decided)
    message = f"{what} {_said(decided, 'approved' if approve else 'denied')}"
    b.status.conditions = set_condition(b.status.conditions, c.COND_APPROVED, "True" if approve else "False",
                                        "Approved" if approve else "Denied", message, o.run.metadata.generation,
                                        o.now)
    b.events.append(Event("Normal", c.EV_APPROVED, message) if approve
                    else Event("Warning", c.EV_RESULT_DENIED, message))
    return message


def _metric(b: StatusBuilder, gate: str, decision: str, seconds: float) -> None:
    """For tether_approval_decision_seconds{gate,decision}, observed once the write lands."""
    b.note(approvals=(*b.details.approvals, (gate, decision, max(0.0, seconds))))


# --- Start ------------------------------------------------------------------------


def _start_request(o: Observed) -> ReviewRequest:
    """The start gate's request. It opened when the run was created (the API server's time): its
    deadline and the approvals that count are measured from there."""
    run = o.run
    created = run.metadata.creation_timestamp or o.now
    timeout = run.spec.review.start_timeout_seconds
    return ReviewRequest(gate=GATE_START, attempt=0, requested_at=created,
                         deadline=after(created, timeout) if timeout is not None else None,
                         execution_digest=execution_digest(run.spec))  # what an approval approves


def start_approved(o: Observed) -> bool:
    """Whether the start gate holds no attempt back now: none, an attempt started, or an approval
    decides it Approve (what start_allowed will find)."""
    run, s = o.run, o.run.status
    if not run.spec.review.start or s.attempt > 0:
        return True
    decided = decision_on(o, review_of(s).find(GATE_START, 0) or _start_request(o))
    return decided is not None and decided.decision == "Approve"


def start_allowed(o: Observed, b: StatusBuilder, d: Decision) -> bool:
    """True when an attempt may start as far as review goes: no start gate, approved before (an
    attempt exists), or approved now (Approved=True joins the grant's status write). Otherwise
    the run waits (AwaitingApproval) or ends (Rejected), and this returns False."""
    run, s = o.run, o.run.status
    if not run.spec.review.start or s.attempt > 0:
        return True
    gen = run.metadata.generation
    review = review_of(b.status)
    created, timeout = run.metadata.creation_timestamp or o.now, run.spec.review.start_timeout_seconds
    req = review.find(GATE_START, 0) or open_request(review, _start_request(o))
    if req is None or o.approvals is None:
        d.wake(APPROVALS_UNKNOWN_RETRY)  # approvals unknown (the list failed): decide nothing yet
        return False
    decided = decision_on(o, req)
    if decided is not None and decided.decision == "Approve":
        _apply(o, b, req, decided, "start")
        return True
    if decided is not None:
        _metric(b, GATE_START, "Deny", (decided.created - created).total_seconds())
        _record(req, "Deny", o.now, decided)
        _reject(b, d, "Denied", f"start {_said(decided, 'denied')}", o)
        return False
    if req.deadline is not None:
        if o.now >= req.deadline:
            _metric(b, GATE_START, "TimedOut", (o.now - created).total_seconds())
            _record(req, "TimedOut", o.now, reason=f"startTimeoutSeconds={timeout}")
            _reject(b, d, "TimedOut", f"no decision on the start gate within startTimeoutSeconds={timeout}", o)
            return False
        d.wake((req.deadline - o.now).total_seconds())
    approved = get_condition(s.conditions, c.COND_APPROVED)
    message = _pending_message(o)
    if s.phase != Phase.AWAITING_APPROVAL or approved is None or approved.reason != "Pending" or \
            approved.message != message or s.observed_generation != gen or s.review is None or \
            s.review.find(GATE_START, 0) is None:
        # An edit while waiting is observed too (Argo CD reads observedGeneration).
        b.status.conditions = set_condition(b.status.conditions, c.COND_APPROVED, "False", "Pending", message,
                                            gen, o.now)
        b.set_phase(Phase.AWAITING_APPROVAL, message)
        b.events.append(Event("Normal", c.EV_APPROVAL_PENDING, message))
        d.actions.append(b.write())
    return False


def _pending_message(o: Observed) -> str:
    """Why the start gate still waits; it names the approvals that do not count only because they
    name just the run's name and were made in its creation second (see `_names_run`)."""
    created = o.run.metadata.creation_timestamp
    same_second = sorted(a.name for a in o.approvals or ()
                         if a.gate == GATE_START and not a.run_uid and a.created == created)
    if not same_second:
        return PENDING_MESSAGE
    return (f"{PENDING_MESSAGE}; not counted: {', '.join(same_second)} (naming only the run's name, made in the "
            "second the run was created, so possibly for a deleted namesake; name spec.runRef.uid)")


def _reject(b: StatusBuilder, d: Decision, reason: str, message: str, o: Observed) -> None:
    gen = o.run.metadata.generation
    b.status.conditions = set_condition(b.status.conditions, c.COND_APPROVED, "False", reason, message, gen, o.now)
    b.set_phase(Phase.REJECTED, message)
    b.events.append(Event("Warning", c.EV_REJECTED, message))
    d.actions.append(b.write())


# --- Result -----------------------------------------------------------------------


def decide_result_review(o: Observed, b: StatusBuilder, d: Decision) -> None:
    """The run waits in AwaitingReview with the result its last attempt published (the attempt
    ended when it published: nobody holds the run). Approve: Succeeded. Deny: that attempt ends
    ResultRejected, the result is cleared, and the retry rules decide; the reason goes to the next
    attempt. No decision by the deadline: Rejected, the result kept but never accepted."""
    s = o.run.status
    review = review_of(b.status)
    req = review.find(GATE_RESULT, s.attempt)
    if req is None:  # opened by finish_after in the same write that set AwaitingReview: repair
        b.open_result_review()
        d.actions.append(b.write())
        return
    if o.approvals is None:
        d.wake(APPROVALS_UNKNOWN_RETRY)  # approvals unknown (the list failed): decide nothing yet
        return
    decided = decision_on(o, req)
    waited = (o.now - req.requested_at).total_seconds()
    if decided is not None and decided.decision == "Approve":
        message = _apply(o, b, req, decided, "result")
        b.finish_after(Outcome.SUCCEEDED, message, None, reviewed=True)
        d.actions.append(b.write())
        return
    if decided is not None:
        message = _apply(o, b, req, decided, "result")
        b.status.result = None
        review.feedback = (decided.reason or f"denied by {decided.approver}")[:protocol.MAX_REQUEST_DETAILS]
        cur = b.status.current()
        if cur is not None and cur.attempt == req.attempt:
            cur.outcome, cur.message = Outcome.RESULT_REJECTED, message
        b.finish_after(Outcome.RESULT_REJECTED, message, None)
        d.actions.append(b.write())
        if b.status.next_attempt_at is not None:
            d.wake((b.status.next_attempt_at - o.now).total_seconds())
        return
    if req.deadline is not None:
        if o.now >= req.deadline:
            timeout = o.run.spec.review.result_timeout_seconds
            _metric(b, GATE_RESULT, "TimedOut", waited)
            _record(req, "TimedOut", o.now, reason=f"resultTimeoutSeconds={timeout}")
            _reject(b, d, "TimedOut", f"no decision on the result within resultTimeoutSeconds={timeout}", o)
            return
        d.wake((req.deadline - o.now).total_seconds())
    if s.observed_generation != o.run.metadata.generation:
        # An edit while the result waits is observed too (Argo CD reads observedGeneration).
        b.set_phase(Phase.AWAITING_REVIEW, f"{RESULT_PENDING_MESSAGE} (attempt {req.attempt})")
        d.actions.append(b.write())


# --- a worker's named requests ---------------------------------------------------------


def track_requests(o: Observed, b: StatusBuilder, d: Decision, lease: LeaseObservation) -> bool:
    """Records the requests the holder made on its Lease (the API server took them only from the
    holder of this fence), and decides those of this attempt: approved, denied or timed out.
    Returns True when the status changed (the decision reaches the worker in its signals)."""
    s = b.status
    attempt = s.attempt
    review = review_of(s)
    changed = False
    made = sum(1 for r in review.requests if r.attempt == attempt and r.gate not in (GATE_START, GATE_RESULT))
    for ask in lease.requests:
        # At most MAX_REQUESTS_PER_ATTEMPT in all, however often a worker renames its requests.
        if review.find(ask.name, attempt) is None and made < protocol.MAX_REQUESTS_PER_ATTEMPT:
            deadline = after(o.now, ask.timeout_seconds) if ask.timeout_seconds is not None else None
            if open_request(review, ReviewRequest(gate=ask.name, attempt=attempt, requested_at=o.now,
                                                  deadline=deadline, details=ask.details or None)) is None:
                break
            made += 1
            b.events.append(Event("Normal", c.EV_APPROVAL_PENDING, f"attempt {attempt} asks for approval of "
                                                                    f"{ask.name!r}: {ask.details}"[:1024]))
            changed = True
    if o.approvals is None:
        return changed  # approvals unknown (the list failed): decide nothing, time nothing out
    for req in review.requests:
        if req.attempt != attempt or req.decision is not None or req.gate in (GATE_START, GATE_RESULT):
            continue
        decided = decision_on(o, req)
        if decided is not None:
            _metric(b, "Request", decided.decision, (decided.created - req.requested_at).total_seconds())
            _record(req, decided.decision, o.now, decided)
            approve = decided.decision == "Approve"
            b.events.append(Event("Normal" if approve else "Warning",
                                  c.EV_APPROVED if approve else c.EV_APPROVAL_DENIED,
                                  f"{req.gate!r} of attempt {attempt} "
                                  f"{_said(decided, 'approved' if approve else 'denied')}"))
            changed = True
        elif req.deadline is not None and o.now >= req.deadline:
            _metric(b, "Request", "TimedOut", (o.now - req.requested_at).total_seconds())
            _record(req, "TimedOut", o.now, reason="no decision in time")
            b.events.append(Event("Warning", c.EV_APPROVAL_TIMED_OUT,
                                  f"{req.gate!r} of attempt {attempt}: no decision in time"))
            changed = True
        elif req.deadline is not None:
            d.wake((req.deadline - o.now).total_seconds())
    return changed
