"""An attempt's life in the run's status: admission and grant, what ends an attempt, its
revocation, and retry or finish after it, with the rules those follow (retry rules, backoff,
terminal phases, the fence range). A Lease fence the run never issued is handled here too:
it is a revocation past that fence.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Any

from tether.api import constants as c
from tether.api.conditions import get_condition, phase_conditions, set_condition
from tether.api.models import (
    AttemptAdmission,
    AttemptRecord,
    Checkpoint,
    ErrorInfo,
    Outcome,
    Phase,
    ReviewRequest,
    ReviewStatus,
    Usage,
    WorkerRun,
    WorkerRunStatus,
)
from tether.core.accounting import attempts_usage, keep_history, reported_cursor, settle_usage
from tether.core.actions import Change, ClearLease, Decision, Event, Revoke, WriteDetails, WriteStatus
from tether.core.clock import after
from tether.core.enforcement import Stop, admission_refusal, over_limit, run_ends_at, stop_due
from tether.core.execution import execution_digest
from tether.core.observe import ForeignPod, Observed, PodObservation, current_lease

# status.fence and Lease.spec.leaseTransitions are int32 in the API: the largest fence there is.
MAX_FENCE = 2**31 - 1
# An attempt takes two fences: its grant and its revocation.
FENCES_PER_ATTEMPT = 2

REASON_FENCE_EXHAUSTED = "FenceExhausted"

_TERMINAL_OUTCOMES = {
    Outcome.SUCCEEDED: Phase.SUCCEEDED,
    Outcome.CANCELLED: Phase.CANCELLED,
    Outcome.BUDGET_EXCEEDED: Phase.BUDGET_EXCEEDED,
    Outcome.DEADLINE_EXCEEDED: Phase.DEADLINE_EXCEEDED,
}

_OUTCOME_EVENT = {
    Outcome.POD_REFUSED: c.EV_POD_REFUSED,
    Outcome.LEASE_LOST: c.EV_LEASE_LOST,
    Outcome.SUCCEEDED: c.EV_SUCCEEDED,
    Outcome.CANCELLED: c.EV_CANCELLED,
    Outcome.DEADLINE_EXCEEDED: c.EV_DEADLINE_EXCEEDED,
    Outcome.PREEMPTED: c.EV_PREEMPTED,
}


def holder_name(run: WorkerRun, attempt: int) -> str:
    """Deterministic per attempt, so a retried grant adopts instead of duplicating."""
    return f"{run.metadata.name}-a{attempt}"


def backoff_seconds(run: WorkerRun, ended_attempts: int) -> float:
    """initialSeconds × factor^(ended − 1), capped at maxSeconds. Compared in log space, because
    factor^n overflows a float long before the cap matters (factor 1e300 on the third failure)."""
    b = run.spec.retry.backoff
    initial, cap, exponent = b.initial_seconds, b.max_seconds, max(ended_attempts - 1, 0)
    if initial <= 0 or cap <= initial or exponent == 0 or b.factor <= 1:
        return float(max(0, min(cap, initial)))
    if exponent * math.log(b.factor) >= math.log(cap / initial):
        return float(cap)
    return float(min(cap, initial * b.factor ** exponent))


def retry_allowed(run: WorkerRun, outcome: Outcome, exit_code: int | None) -> bool:
    """First matching rule decides; without a match, failed attempts are retried."""
    for rule in run.spec.retry.rules:
        matched = False
        if rule.on_reasons is not None:
            matched = outcome in rule.on_reasons
        elif outcome == Outcome.PREEMPTED:
            continue  # a yielding worker's exit code says nothing of the work: only onReasons match it
        elif rule.on_exit_codes is not None and exit_code is not None:
            inside = exit_code in rule.on_exit_codes.values
            matched = inside if rule.on_exit_codes.operator == "In" else not inside
        if matched:
            return rule.action == "Retry"
    return True


def attempts_used(status: WorkerRunStatus) -> int:
    """The attempts that count against spec.retry.maxAttempts: all but those Kueue preempted."""
    return status.attempt - status.preemptions


# attempts[].error's bounds in the CRD: a copy, so a large error the worker published does not
# grow every later status write by its size again.
MAX_ERROR_CODE, MAX_ATTEMPT_ERROR_MESSAGE = 256, 4096
# The CRD's bound on status.attempt: maxAttempts (at most 100) plus attempts Kueue preempted.
MAX_ATTEMPT = 10000


def room_for_attempt(fence: int, attempt: int = 0) -> bool:
    """Whether another attempt's fences (its grant and its revocation) still fit after `fence`, and
    its number within the CRD's bound."""
    return fence <= MAX_FENCE - FENCES_PER_ATTEMPT and attempt < MAX_ATTEMPT


def review_of(status: WorkerRunStatus) -> ReviewStatus:
    """The status's review record, created when first needed."""
    if status.review is None:
        status.review = ReviewStatus()
    return status.review


RESULT_PENDING_MESSAGE = "the result waits for a WorkerRunApproval with gate Result"
# status.review.requests holds at most this many (the CRD's maxItems).
MAX_REVIEW_REQUESTS = 50


def open_request(review: ReviewStatus, req: ReviewRequest) -> ReviewRequest | None:
    """Adds a gate to the record, making room by dropping the oldest decided gates. None when
    every entry is pending (never: an attempt makes at most 20 requests, and a run's other pending
    gates are one Start or one Result): the record never outgrows what the CRD stores, since a
    status write it would make fail would block every other write of the run too."""
    while len(review.requests) >= MAX_REVIEW_REQUESTS:
        oldest = next((r for r in review.requests if r.decision is not None), None)
        if oldest is None:
            return None
        review.requests.remove(oldest)
    review.requests.append(req)
    return req



@dataclass(frozen=True)
class Ending:
    """How an attempt (or a run without one) ends."""

    outcome: Outcome
    message: str
    exit_code: int | None = None


def attempt_end(o: Observed, pod: PodObservation | None, stop: Stop | None) -> Ending | None:
    """What ended the current attempt, other than its lease: a result, a stop that was told and
    is over (the worker stopped, or stopGraceSeconds passed), an error, or its pod (refused by the
    API server, deleted or exited)."""
    s = o.run.status
    if s.result is not None:
        return Ending(Outcome.SUCCEEDED, "the holder published its result")
    # A refusal of this grant's pod (a pod that exists after all speaks for itself).
    refusal = o.pod_refusal if pod is None and o.pod_refusal is not None and o.pod_refusal.fence == s.fence else None
    if stop is not None and s.stop_requested_at is not None and (
            s.error is not None or refusal is not None or (pod is not None and (pod.terminated or pod.deleting))
            or o.now >= stop_due(o)):
        return Ending(stop.outcome, stop.reason, pod.exit_code if pod is not None else None)
    if s.error is not None:
        return Ending(Outcome.WORKER_FAILED, f"{s.error.code or 'error'}: {s.error.message or ''}".strip())
    if refusal is not None:
        # No worker ever ran: waiting out its startup grace would only claim a liveness nobody had.
        return Ending(Outcome.POD_REFUSED, f"the API server refused pod {refusal.pod}: {refusal.message}")
    if pod is not None and pod.deleting:
        return Ending(Outcome.POD_VANISHED, f"pod {pod.name} was deleted")
    if pod is not None and pod.terminated:
        return Ending(Outcome.POD_FAILED, f"pod {pod.name} exited with code {pod.exit_code} without a result",
                      pod.exit_code)
    return None


def _essence(status: WorkerRunStatus) -> dict[str, object]:
    body = status.dump()
    if body.get("review") == {"requests": []}:
        del body["review"]
    return body


class StatusBuilder:
    """Accumulates one status write for one decision, from a copy of the observed status."""

    def __init__(self, o: Observed) -> None:
        self.o = o
        self.run = o.run
        self.status = o.run.status.clone()
        self.events: list[Event] = []
        self.change: Change | None = None
        self.details = WriteDetails()
        self.ended: Outcome | None = None
        self.lapse = False
        self.grants = False
        # The admission the next grant runs under, set by a queue's gate (tether/kueue), and the
        # fresh reads that gate rests the grant on (core.capability).
        self.admission: AttemptAdmission | None = None
        self.rests_on: tuple[enum.Enum, ...] = ()
        # Why the holder is told to pause for its budget (enforcement.budget_pause), set by the held
        # pass; None: it is not.
        self.budget_pause: str | None = None

    @property
    def generation(self) -> int:
        return self.run.metadata.generation

    def set_phase(self, phase: Phase, message: str, lease_reason: str = "", reason: str = "") -> None:
        s = self.status
        s.phase = phase
        s.observed_generation = self.generation
        s.conditions = phase_conditions(s.conditions, phase, s.holder, message, self.generation,
                                        self.o.now, lease_reason, reason)
        if phase.terminal and s.finished_at is None:
            s.finished_at = self.o.now
        suspended = get_condition(s.conditions, c.COND_SUSPENDED)
        if phase.terminal and suspended is not None and suspended.status == "True":
            s.conditions = set_condition(s.conditions, c.COND_SUSPENDED, "False", phase.value,
                                         f"the run ended {phase.value}", self.generation, self.o.now)
        if phase.terminal:
            for req in s.review.pending() if s.review is not None else []:
                # A finished run has no open gate: a decision made now decides nothing.
                req.decision, req.decided_at, req.reason = "Withdrawn", self.o.now, f"the run ended {phase.value}"

    def mark_suspension(self) -> bool:
        """spec.suspend as users see it: a Suspended condition (True while set, False with reason
        Resumed once cleared) and an Event each time it turns; and Ready's reason while a worker
        holds the run (`_mark_held_reason`). Every write applies it; returns whether anything changed."""
        s, gen, now = self.status, self.generation, self.o.now
        if s.phase is None or s.phase.terminal:
            return False  # set_phase(terminal) has said it
        held, suspend = s.holder is not None, self.o.run.spec.suspend
        budget = self.budget_pause if held else None
        cond = get_condition(s.conditions, c.COND_SUSPENDED)
        before = list(s.conditions)
        if suspend or budget is not None:
            if suspend:
                reason = c.REASON_WORKER_PAUSED if held else c.EV_SUSPENDED
                message = (f"{s.holder} is told to pause (spec.suspend) and keeps its lease" if held
                           else "spec.suspend is set; no new attempt starts")
            else:
                reason, message = c.REASON_BUDGET_PAUSED, f"{s.holder} is told to pause and keeps its lease: {budget}"
            budgeted = reason == c.REASON_BUDGET_PAUSED  # its message says why, which may move
            if cond is None or (cond.status, cond.reason) != ("True", reason) or (budgeted and cond.message != message):
                # An Event when it turns (or turns from one kind of pause to the other), not when its reason moves.
                if cond is None or cond.status != "True" or (cond.reason == c.REASON_BUDGET_PAUSED) != budgeted:
                    self.events.append(Event("Warning" if budget is not None and not suspend else "Normal",
                                             c.REASON_BUDGET_PAUSED if budget is not None and not suspend
                                             else c.EV_SUSPENDED, message))
                s.conditions = set_condition(s.conditions, c.COND_SUSPENDED, "True", reason, message, gen, now)
        elif cond is not None and cond.status == "True":
            message = ("there is room in the budget again" if cond.reason == c.REASON_BUDGET_PAUSED
                       else "spec.suspend was cleared") + (f"; {s.holder} is told to go on" if held else "")
            s.conditions = set_condition(s.conditions, c.COND_SUSPENDED, "False", c.EV_RESUMED, message, gen, now)
            self.events.append(Event("Normal", c.EV_RESUMED, message))
        self._mark_held_reason()
        return s.conditions != before

    def _mark_held_reason(self) -> None:
        """Ready's reason (the REASON column) while a worker holds the run, whose phase stays Running
        (the worker keeps its lease): WorkerPaused while it is told to pause, else AwaitingApproval
        while a request it made waits for a person; the phase again once neither holds."""
        s = self.status
        ready = get_condition(s.conditions, c.COND_READY)
        if ready is None or s.phase is None:
            return
        held = s.holder is not None
        asks = [r.gate for r in (s.review.pending() if held and s.review is not None else [])
                if r.attempt == s.attempt and r.gate not in (c.GATE_START, c.GATE_RESULT)]
        paused = get_condition(s.conditions, c.COND_SUSPENDED)
        if held and self.o.run.spec.suspend:
            reason, message = c.REASON_WORKER_PAUSED, paused.message if paused is not None else ready.message
        elif held and self.budget_pause is not None:
            reason, message = c.REASON_BUDGET_PAUSED, paused.message if paused is not None else ready.message
        elif asks:
            reason, message = c.REASON_AWAITING_APPROVAL, \
                f"{s.holder} waits for a WorkerRunApproval with gate {', '.join(asks)}"
        elif ready.reason in (c.REASON_WORKER_PAUSED, c.REASON_BUDGET_PAUSED) and paused is not None:
            reason, message = s.phase.value, paused.message  # "spec.suspend was cleared; ... told to go on"
        elif ready.reason in (c.REASON_WORKER_PAUSED, c.REASON_BUDGET_PAUSED, c.REASON_AWAITING_APPROVAL):
            reason, message = s.phase.value, f"{s.holder} holds the lease" if held else ready.message
        else:
            return
        if (ready.reason, ready.message) != (reason, message):
            s.conditions = set_condition(s.conditions, c.COND_READY, ready.status, reason, message,
                                         self.generation, self.o.now)

    def note(self, **facts: Any) -> None:
        """Facts for the write's log line and metrics (WriteDetails' fields)."""
        self.details = replace(self.details, **facts)

    def write(self) -> WriteStatus:
        """The write of the status as built so far: a copy, so what is built after it (another
        write of the same decision) never changes an action already handed out. Whatever wrote it,
        the status says whether the run is suspended."""
        self.mark_suspension()
        if self.grants and self.admission is not None and not self.rests_on:
            # The gate that set the admission must rest the grant on a fresh read of it (a cached
            # admission may be one its queue took back): a grant without one is a bug, not a run.
            raise AssertionError("a grant under an admission must rest on a fresh read of it (rests_on)")
        return WriteStatus(status=self.status.clone(), events=tuple(self.events), change=self.change,
                           details=self.details, ended=self.ended, lapse=self.lapse,
                           grants=self.grants, rests_on=self.rests_on if self.grants else ())

    def changed(self) -> bool:
        """Whether there is anything to write: an Event, or a status other than the observed one
        (an empty review record, created on first use, is no change)."""
        return bool(self.events) or _essence(self.status) != _essence(self.o.run.status)

    def settle_usage(self) -> bool:
        """Books the last holder's final report and checkpoint (see accounting.settle_usage); an
        overspend already recorded follows it."""
        before = self.status.usage
        if not settle_usage(self.o, self.status, self.o.now):
            return False
        if self.status.usage == before:
            return True
        if self.status.budget_charged:
            # More usage than the budget was told of: it is owed again (charged before the TTL).
            self.status.budget_charged = False
        if self.status.overspend is not None:
            over = over_limit(self.o, self.status.usage or Usage())
            if over is not None:
                self.status.overspend = over[1]
        return True

    def end_attempt(self, outcome: Outcome, message: str, exit_code: int | None = None) -> None:
        """Revocation: the fence moves first, so nothing the old holder writes is accepted."""
        s, o = self.status, self.o
        lease = current_lease(o)
        self.ended, self.change = outcome, Change.ATTEMPT_ENDED
        s.fence += 1
        s.holder = None
        s.lease_expires_at = None
        cur = s.current()
        if cur is not None and cur.outcome is None:
            cur.outcome = outcome
            cur.ended_at = o.now
            cur.exit_code = exit_code
            cur.message = message
            if s.error is not None:  # while held, only the worker writes status.error
                cur.error = ErrorInfo(code=(s.error.code or "")[:MAX_ERROR_CODE] or None,
                                      message=(s.error.message or "")[:MAX_ATTEMPT_ERROR_MESSAGE] or None)
            if lease is not None and lease.usage is not None:
                cur.usage = lease.usage
        s.usage = attempts_usage(s)
        s.folded_at = o.now
        s.stop_requested_at = None
        attempt = cur.attempt if cur else s.attempt
        for req in (s.review.requests if s.review is not None else []):
            if req.attempt == attempt and req.decision is None:
                # Nobody is left to act on a decision: a later one must not reach another attempt.
                req.decision, req.decided_at, req.reason = "Withdrawn", o.now, f"attempt {attempt} ended"
        cursor = reported_cursor(o)
        if lease is not None and cursor and (s.checkpoint is None or s.checkpoint.cursor != cursor):
            s.checkpoint = Checkpoint(cursor=cursor, time=o.now)
        self.events.append(Event("Normal" if outcome == Outcome.SUCCEEDED else "Warning",
                                 _OUTCOME_EVENT.get(outcome, c.EV_ATTEMPT_ENDED),
                                 f"attempt {attempt} ended: {outcome.value}: {message}"))

    def finish_after(self, outcome: Outcome, message: str, exit_code: int | None, reviewed: bool = False) -> None:
        """After an attempt ended: retry (Backoff) or end the run; a result under review
        (spec.review.result) waits for its decision first (AwaitingReview)."""
        s, run = self.status, self.run
        if outcome == Outcome.SUCCEEDED and run.spec.review.result and not reviewed and s.result is not None:
            self.open_result_review()
            return
        terminal = _TERMINAL_OUTCOMES.get(outcome)
        if terminal is not None:
            self.set_phase(terminal, message, lease_reason=outcome.value)
            if terminal == Phase.SUCCEEDED:
                s.error = None
            elif s.error is None:
                s.error = ErrorInfo(code=outcome.value, message=message)
            return
        # A refused pod is the template's fault, not the worker's: Ready's reason (the REASON
        # column) says so through backoff and failure alike, with the API server's words.
        shown = outcome.value if outcome == Outcome.POD_REFUSED else ""
        if not retry_allowed(run, outcome, exit_code):
            self.fail(Phase.FAILED, f"retry rules end the run after {outcome.value}: {message}", outcome.value,
                      shown)
            return
        if outcome == Outcome.PREEMPTED:
            # Not a failure: back in the queue at once (Kueue's own requeue backoff applies).
            s.preemptions = min(s.preemptions + 1, MAX_ATTEMPT)
            why = f"attempt {s.attempt} preempted: {message}; queued again"
            s.conditions = set_condition(s.conditions, c.COND_ADMITTED, "False", Outcome.PREEMPTED.value, why,
                                         self.generation, self.o.now)
            self.set_phase(Phase.QUEUED, why, lease_reason=outcome.value, reason=Outcome.PREEMPTED.value)
            return
        used = attempts_used(s)
        if used >= run.spec.retry.max_attempts:
            phase = Phase.LOST if outcome == Outcome.LEASE_LOST else Phase.FAILED
            self.fail(phase, f"{used} of {run.spec.retry.max_attempts} attempts used; last: "
                             f"{outcome.value}: {message}", outcome.value, shown)
            return
        delay = backoff_seconds(run, used)
        s.next_attempt_at = after(self.o.now, delay)
        self.set_phase(Phase.BACKOFF, f"attempt {s.attempt + 1} in {delay:g}s after {outcome.value}: {message}",
                       lease_reason=outcome.value, reason=shown)
        self.events.append(Event("Normal", c.EV_BACKOFF, f"next attempt in {delay:g}s"))

    def open_result_review(self) -> ReviewRequest | None:
        """The published result waits for a person: AwaitingReview, Approved=False (Pending)."""
        s, o, run = self.status, self.o, self.run
        attempt = s.current().attempt if s.current() is not None else s.attempt  # type: ignore[union-attr]
        review = review_of(s)
        req = review.find(c.GATE_RESULT, attempt)
        if req is None:
            timeout = run.spec.review.result_timeout_seconds
            req = open_request(review, ReviewRequest(gate=c.GATE_RESULT, attempt=attempt, requested_at=o.now,
                                                     deadline=after(o.now, timeout) if timeout is not None else None))
        message = f"{RESULT_PENDING_MESSAGE} (attempt {attempt})"
        s.conditions = set_condition(s.conditions, c.COND_APPROVED, "False", "Pending", message,
                                     self.generation, o.now)
        self.set_phase(Phase.AWAITING_REVIEW, message)
        self.events.append(Event("Normal", c.EV_APPROVAL_PENDING, message))
        return req

    def conclude(self, ending: Ending) -> None:
        """Ends the held attempt and decides what follows. The worker's error is kept in the
        attempt record; status.error describes the run, so it stays only if this failure ends it."""
        error = self.status.error
        self.end_attempt(ending.outcome, ending.message, ending.exit_code)
        self.status.error = None
        self.finish_after(ending.outcome, ending.message, ending.exit_code)
        phase = self.status.phase
        if error is not None and phase is not None and phase.terminal and phase != Phase.SUCCEEDED:
            # An error the API server accepted from the worker is never replaced (a stop or a cap
            # that ends the run at the same time is in the phase and the attempt record).
            self.status.error = error

    def fail(self, phase: Phase, message: str, code: str, reason: str = "") -> None:
        s = self.status
        if s.error is None:
            s.error = ErrorInfo(code=code, message=message)
        self.set_phase(phase, message, lease_reason=code, reason=reason)
        self.events.append(Event("Warning", phase.value, message))

    def exhaust_fences(self, message: str) -> None:
        """No fence is left for another attempt (the API stores fences as int32): end the run
        Failed, with the reason on its conditions, rather than write a fence it would refuse."""
        s = self.status
        s.next_attempt_at = None
        s.error = ErrorInfo(code=REASON_FENCE_EXHAUSTED, message=message)
        self.set_phase(Phase.FAILED, message, lease_reason=REASON_FENCE_EXHAUSTED)
        for cond in (c.COND_FAILED, c.COND_STALLED):
            s.conditions = set_condition(s.conditions, cond, "True", REASON_FENCE_EXHAUSTED, message,
                                         self.generation, self.o.now)
        self.events.append(Event("Warning", REASON_FENCE_EXHAUSTED, message))
        self.change = Change.FENCE_EXHAUSTED

    def grant(self) -> tuple[str, int, int]:
        s, o, run = self.status, self.o, self.run
        attempt = s.attempt + 1
        holder = holder_name(run, attempt)
        s.fence += 1
        s.attempt = attempt
        s.holder = holder
        s.next_attempt_at = None
        s.error = None
        s.last_renew_time = None
        s.lease_expires_at = after(o.now, max(run.spec.lease.startup_grace_seconds,
                                              run.spec.lease.duration_seconds))
        if s.started_at is None:
            s.started_at = o.now
            s.ends_at = run_ends_at(run.spec, s.started_at)
        # Every later grant must run these fields (execution_gate.execution_allowed checked this one).
        s.execution_digest = s.execution_digest or execution_digest(run.spec)
        pod = holder if run.spec.executor == "Pod" else None
        s.attempts.append(AttemptRecord(attempt=attempt, fence=s.fence, holder=holder, pod=pod,
                                        started_at=o.now, admission=self.admission))
        keep_history(s, o.attempt_history)
        self.set_phase(Phase.STARTING, f"attempt {attempt} granted to {holder} with fence {s.fence}")
        self.events.append(Event("Normal", c.EV_ATTEMPT_STARTED,
                                 f"attempt {attempt} granted to {holder} with fence {s.fence}"))
        self.change = Change.GRANTED
        self.grants = True
        return holder, attempt, s.fence


def revoke(o: Observed, b: StatusBuilder, cur: AttemptRecord | None, keep_pod: bool = False) -> Revoke:
    """The revocation of attempt `cur`, whose end `b` has recorded. A succeeded attempt's pod is
    left to exit on its own (it published its result and is finishing)."""
    pods = () if cur is None or keep_pod else tuple(
        p.name for p in o.pods if p.attempt == cur.attempt and not p.deleting and not p.terminated)
    claims = (cur.holder,) if cur is not None and cur.holder and o.run.spec.executor == "External" else ()
    return Revoke(status_write=b.write(), pods_to_delete=pods, tool_claim_holders=claims)


def admit(o: Observed, b: StatusBuilder, d: Decision) -> bool:
    """Admission: a run whose cap or budget is exhausted waits, Admitted=False."""
    s, gen = o.run.status, o.run.metadata.generation
    refusal = admission_refusal(o)
    if refusal is None:
        b.status.conditions = set_condition(b.status.conditions, c.COND_ADMITTED, "True", "Admitted",
                                            "run admitted", gen, o.now)
        return True
    reason, message = refusal
    current, ready = get_condition(s.conditions, c.COND_ADMITTED), get_condition(s.conditions, c.COND_READY)
    # Said again when the run shows something else (e.g. it was suspended meanwhile and resumed).
    if current is None or current.status != "False" or current.reason != reason or s.phase is None or \
            ready is None or ready.reason != reason:
        b.status.conditions = set_condition(b.status.conditions, c.COND_ADMITTED, "False", reason, message,
                                            gen, o.now)
        b.set_phase(Phase.PENDING, message, reason=reason)
        b.events.append(Event("Warning", c.EV_BUDGET_EXCEEDED if reason == "BudgetExceeded" else reason, message))
        d.actions.append(b.write())
    if o.budget is not None and o.budget.next_reset_seconds is not None:
        d.wake(o.budget.next_reset_seconds)
    return False


def wait_for_namesake(o: Observed, b: StatusBuilder, d: Decision, blocker: ForeignPod) -> None:
    """The next holder's name is taken by a pod of a deleted run of the same name: wait it out, and
    say so on the run (Pending, LeaseHeld=False reason NamesakePodTerminating) and in an Event."""
    if blocker.token_dead_at is None:
        message = f"pod {blocker.name} of a deleted WorkerRun of this name is not deleted yet"
        d.wake(1.0)
    else:
        message = (f"pod {blocker.name} of a deleted WorkerRun of this name is terminating; its worker's token "
                   f"is accepted until {blocker.token_dead_at.isoformat(timespec='seconds')}")
        d.wake((blocker.token_dead_at - o.now).total_seconds())
    s = o.run.status
    if s.phase not in (None, Phase.PENDING):
        return  # a run in Backoff keeps its phase and timing; the wait only shifts its next attempt
    held = get_condition(s.conditions, c.COND_LEASE_HELD)
    if s.phase == Phase.PENDING and held is not None and held.reason == c.REASON_NAMESAKE_POD and \
            held.message == message:
        return
    b.set_phase(Phase.PENDING, message, lease_reason=c.REASON_NAMESAKE_POD)
    b.status.conditions = set_condition(b.status.conditions, c.COND_LEASE_HELD, "False", c.REASON_NAMESAKE_POD,
                                        message, o.run.metadata.generation, o.now)
    b.events.append(Event("Normal", c.REASON_NAMESAKE_POD, message))
    d.actions.append(b.write())


def foreign_fence(o: Observed) -> int | None:
    """The run's Lease carries a fence the run never issued: someone other than Tether wrote it."""
    lease = o.lease
    if lease is not None and lease.fence is not None and lease.fence > o.run.status.fence:
        return lease.fence
    return None


def decide_foreign_fence(o: Observed, d: Decision, lease_fence: int) -> None:
    """A foreign write to the Lease is an attack or a bug; either way nobody can be sure who owns
    the run. Converge: end the current attempt, move the run's fence past the Lease's, record it,
    and let the retry rules go on with a Lease rewritten by Tether. When no fence is left past
    it for another attempt, the run ends Failed instead."""
    s = o.run.status
    b = StatusBuilder(o)
    message = (f"the Lease carries fence {lease_fence}, ahead of the run's {s.fence}: "
               "it was written by someone other than Tether")
    cur = s.current()
    active = s.holder is not None
    # A result the API server accepted while the fence and holder were the run's stands: a later
    # foreign write to the Lease cannot undo it (and the work must not run again).
    ending = Ending(Outcome.SUCCEEDED, "the holder published its result") if s.result is not None \
        else Ending(Outcome.LEASE_LOST, message)
    if active:
        b.end_attempt(ending.outcome, ending.message)
        b.finish_after(ending.outcome, ending.message, None)
    b.status.fence = max(b.status.fence, min(lease_fence + 1, MAX_FENCE))
    b.change = Change.LEASE_TAMPERED
    exhausted = not room_for_attempt(b.status.fence) and not (b.status.phase is not None and b.status.phase.terminal)
    if exhausted:
        b.exhaust_fences(f"{message}; no fence is left for another attempt (the largest is {MAX_FENCE})")
    b.status.conditions = set_condition(b.status.conditions, c.COND_LEASE_HELD, "False", c.REASON_LEASE_TAMPERED,
                                        message, o.run.metadata.generation, o.now)
    b.events.append(Event("Warning", c.REASON_LEASE_TAMPERED, message))
    b.note(lease_fence=lease_fence)
    if active:
        d.actions.append(revoke(o, b, cur, keep_pod=ending.outcome == Outcome.SUCCEEDED))
    else:
        d.actions.append(b.write())
        d.actions.append(ClearLease(fence=b.status.fence))
