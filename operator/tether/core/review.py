"""Review gates: a run that waits for a person's decision (spec.review, WorkerRunApproval).

Only the start gate so far: a run with spec.review.start starts no attempt until an approval with
gate Start approves it; a denial, or no decision within startTimeoutSeconds, ends it Rejected.
"""

from __future__ import annotations

import datetime as dt

from tether.api import constants as c
from tether.api.conditions import get_condition, set_condition
from tether.api.models import Phase
from tether.core.actions import Decision, Event
from tether.core.lifecycle import StatusBuilder
from tether.core.observe import ApprovalObservation, Observed

GATE_START = "Start"
PENDING_MESSAGE = "waiting for a WorkerRunApproval with gate Start"


def decision_on(o: Observed, gate: str) -> ApprovalObservation | None:
    """The decision on `gate`, from the approvals that are this run's: naming its UID, or naming only
    its name and made after it was created (never one made for a deleted namesake), and made before
    the gate's deadline (both times are the API server's). Any Deny wins over any Approve: a denial
    is final, whatever order the operator happens to see them in."""
    run = o.run.metadata
    timeout = o.run.spec.review.start_timeout_seconds if gate == GATE_START else None
    deadline = (run.creation_timestamp + dt.timedelta(seconds=timeout)
                if timeout is not None and run.creation_timestamp is not None else None)
    mine = [a for a in o.approvals if a.gate == gate
            and (a.run_uid == run.uid if a.run_uid else run.creation_timestamp is None or a.created >= run.creation_timestamp)
            and (deadline is None or a.created <= deadline)]
    return min(mine, key=lambda a: (a.decision != "Deny", a.created, a.name), default=None)


def _said(a: ApprovalObservation, verb: str) -> str:
    return f"{verb} by {a.approver}" + (f": {a.reason}" if a.reason else "")


def start_allowed(o: Observed, b: StatusBuilder, d: Decision) -> bool:
    """True when an attempt may start as far as review goes: no start gate, approved before (an
    attempt exists), or approved now (Approved=True joins the grant's status write). Otherwise
    the run waits (AwaitingApproval) or ends (Rejected), and this returns False."""
    run, s = o.run, o.run.status
    if not run.spec.review.start or s.attempt > 0:
        return True
    gen = run.metadata.generation
    decided = decision_on(o, GATE_START)
    if decided is not None:
        # For the time-to-decision metric: from the run's creation, when its wait began.
        created = run.metadata.creation_timestamp or decided.created
        b.details["approvalSeconds"] = max(0.0, (decided.created - created).total_seconds())
    if decided is not None and decided.decision == "Approve":
        b.details["approval"] = "Approve"
        message = _said(decided, "approved")
        b.status.conditions = set_condition(b.status.conditions, c.COND_APPROVED, "True", "Approved", message,
                                            gen, o.now)
        b.events.append(Event("Normal", c.EV_APPROVED, f"start {message}"))
        return True
    if decided is not None:
        b.details["approval"] = "Deny"
        _reject(b, d, "Denied", f"start {_said(decided, 'denied')}", gen, o)
        return False
    timeout = run.spec.review.start_timeout_seconds
    if timeout is not None:
        waited = (o.now - (run.metadata.creation_timestamp or o.now)).total_seconds()
        if waited >= timeout:
            b.details.update(approval="TimedOut", approvalSeconds=waited)
            _reject(b, d, "TimedOut", f"no decision on the start gate within startTimeoutSeconds={timeout}", gen, o)
            return False
        d.wake(timeout - waited)
    approved = get_condition(s.conditions, c.COND_APPROVED)
    if s.phase != Phase.AWAITING_APPROVAL or approved is None or approved.reason != "Pending" or \
            s.observed_generation != gen:  # an edit while waiting is observed (Argo reads it)
        b.status.conditions = set_condition(b.status.conditions, c.COND_APPROVED, "False", "Pending",
                                            PENDING_MESSAGE, gen, o.now)
        b.set_phase(Phase.AWAITING_APPROVAL, PENDING_MESSAGE)
        b.events.append(Event("Normal", c.EV_APPROVAL_PENDING, PENDING_MESSAGE))
        d.actions.append(b.write())
    return False


def _reject(b: StatusBuilder, d: Decision, reason: str, message: str, generation: int, o: Observed) -> None:
    b.status.conditions = set_condition(b.status.conditions, c.COND_APPROVED, "False", reason, message,
                                        generation, o.now)
    b.set_phase(Phase.REJECTED, message)
    b.events.append(Event("Warning", c.EV_REJECTED, message))
    d.actions.append(b.write())
