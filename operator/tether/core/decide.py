"""The pure heart of the operator: decide(observed) -> Decision.

No I/O and no clock reads: the wall clock (`now`, for timestamps and
deadlines) and the monotonic clock (`mono`, for lease lapses) come in with the
observation. The Decision lists actions in the order they must run; the
executor stops at the first failed status write and decides again from
fresh observations, so every step is safe to repeat after a crash.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from tether.api import constants as c
from tether.api.conditions import get_condition, phase_conditions, set_condition
from tether.api.models import (
    MAX_STATUS_NUMBER,
    AttemptRecord,
    Checkpoint,
    ErrorInfo,
    Outcome,
    Phase,
    Signals,
    Usage,
    WorkerRun,
    WorkerRunStatus,
)
from tether.core.liveness import judge_from

# Progress reported on heartbeats reaches the run's status at most this often.
FOLD_INTERVAL_SECONDS = 10.0

# A pod of an attempt that already ended is left this long to exit on its own
# after success; failed or revoked attempts' pods are deleted at once.
POD_EXIT_GRACE_SECONDS = 30.0

# The longest requeue a decision asks for. Longer waits (a TTL of months, a deadline far
# away) are re-decided daily instead, so no executor timer is handed a delay beyond its range.
MAX_REQUEUE_SECONDS = 86400.0


# --- observations -----------------------------------------------------------


@dataclass(frozen=True)
class LeaseObservation:
    holder: str | None
    fence: int | None
    resource_version: str
    # Monotonic time when this operator first saw the current resourceVersion
    # (or wrote it). The worker's own timestamps are never used.
    last_change: float
    # Whether a resourceVersion written by the holder (not by the grant) was seen.
    renewed: bool
    checkpoint: str | None = None
    usage: Usage | None = None
    # Monotonic time the checkpoint last changed (progress), and the signals on the lease now.
    checkpoint_changed: float = 0.0
    signals: str | None = None


@dataclass(frozen=True)
class BudgetObservation:
    """The run's WorkerBudget, refreshed for `now` (period rolled over if due)."""

    name: str
    missing: bool = False
    exhausted: bool = False
    remaining: Usage = field(default_factory=Usage)
    charged: Usage = field(default_factory=Usage)  # this run's mark
    next_reset_seconds: float | None = None


@dataclass(frozen=True)
class PodObservation:
    name: str
    attempt: int
    phase: str
    exit_code: int | None = None
    deleting: bool = False
    has_finalizer: bool = True

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


@dataclass(frozen=True)
class Observed:
    run: WorkerRun
    lease: LeaseObservation | None
    pods: tuple[PodObservation, ...]
    now: dt.datetime
    mono: float
    budget: BudgetObservation | None = None
    # How often heartbeat-borne progress and usage may reach the run's status (bounded writes).
    fold_interval: float = FOLD_INTERVAL_SECONDS
    # Monotonic time since which the API server has answered this operator without a break
    # (None: unreachable now). No lapse is judged within a lease duration of it.
    api_available_since: float | None = float("-inf")
    # The namespace refused a create because it is being deleted: start no new attempt.
    namespace_terminating: bool = False


# --- actions ----------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class WriteStatus:
    """Replace status with a resourceVersion precondition (compare-and-swap)."""

    status: WorkerRunStatus
    events: tuple[Event, ...] = ()
    log: str = ""  # structured log event name, e.g. job_claimed
    log_fields: tuple[tuple[str, object], ...] = ()
    ends_attempt: bool = False  # the executor first re-reads the Lease for the final usage report
    lapse: bool = False  # ends the attempt for silence: the executor confirms it with a timely read
    grants: bool = False  # starts an attempt (bumps the fence and names a holder)


@dataclass(frozen=True)
class EnsureLease:
    holder: str
    fence: int
    duration_seconds: int
    signals: str = ""


@dataclass(frozen=True)
class ClearLease:
    fence: int


@dataclass(frozen=True)
class EnsurePod:
    name: str
    attempt: int
    fence: int
    holder: str


@dataclass(frozen=True)
class DeletePod:
    name: str


@dataclass(frozen=True)
class ReleasePod:
    """Remove Tether's finalizer: the attempt's end is recorded."""

    name: str


@dataclass(frozen=True)
class DeleteRun:
    pass


@dataclass(frozen=True)
class RemoveFinalizer:
    """Let a deleted run go: its attempt is ended, its usage charged, its pods released."""


@dataclass(frozen=True)
class EnsureSignals:
    """Write the control signals onto the current holder's Lease (tested fence)."""

    fence: int
    signals: str


@dataclass(frozen=True)
class ChargeBudget:
    """Charge the run's whole usage so far to its budget; the budget adds only what is new."""

    budget: str
    total: Usage


Action = (WriteStatus | EnsureLease | ClearLease | EnsurePod | DeletePod | ReleasePod | DeleteRun | EnsureSignals
          | ChargeBudget | RemoveFinalizer)


@dataclass
class Decision:
    actions: list[Action] = field(default_factory=list)
    # Decide again after this many seconds even if nothing changes (None: only on change).
    requeue_after: float | None = None
    # Wake up as soon as the current attempt's reported usage reaches this (a cap or budget).
    usage_alarm: Usage | None = None

    def wake(self, seconds: float) -> None:
        seconds = min(max(seconds, 0.0), MAX_REQUEUE_SECONDS)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


# --- helpers ----------------------------------------------------------------

# The last instant a datetime can hold. Timestamps computed past it saturate here (meaning
# "never") instead of raising OverflowError and failing every decision for the run.
END_OF_TIME = dt.datetime.max.replace(tzinfo=dt.timezone.utc)


def after(t: dt.datetime, seconds: float) -> dt.datetime:
    """t + seconds, saturating at END_OF_TIME."""
    if seconds >= (END_OF_TIME - t).total_seconds():
        return END_OF_TIME
    return t + dt.timedelta(seconds=seconds)


def run_ends_at(run: WorkerRun) -> dt.datetime | None:
    """status.endsAt as spec.deadlineSeconds says now: deadlineSeconds is a control field, so a
    changed deadline moves endsAt (counted from the first grant), and a removed one clears it."""
    started, deadline = run.status.started_at, run.spec.deadline_seconds
    return None if started is None or not deadline else after(started, deadline)


def holder_name(run: WorkerRun, attempt: int) -> str:
    """Deterministic per attempt, so a retried grant adopts instead of duplicating."""
    return f"{run.metadata.name}-a{attempt}"


def lapse_deadline(run: WorkerRun, lease: LeaseObservation, api_available_since: float | None = float("-inf")) -> float:
    """Monotonic time at which the current holder's lease counts as lapsed: a full duration of
    silence, and a full duration of the API server answering us (an outage hides renewals)."""
    spec = run.spec.lease
    renewed = lease.renewed or run.status.phase == Phase.RUNNING
    silence = spec.duration_seconds if renewed else max(spec.startup_grace_seconds, spec.duration_seconds)
    judge = judge_from(api_available_since, spec.duration_seconds)
    if judge is None:
        return math.inf
    return max(lease.last_change + silence, judge)


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
        elif rule.on_exit_codes is not None and exit_code is not None:
            inside = exit_code in rule.on_exit_codes.values
            matched = inside if rule.on_exit_codes.operator == "In" else not inside
        if matched:
            return rule.action == "Retry"
    return True


_TERMINAL_OUTCOMES = {
    Outcome.SUCCEEDED: Phase.SUCCEEDED,
    Outcome.CANCELLED: Phase.CANCELLED,
    Outcome.BUDGET_EXCEEDED: Phase.BUDGET_EXCEEDED,
    Outcome.DEADLINE_EXCEEDED: Phase.DEADLINE_EXCEEDED,
}

_OUTCOME_EVENT = {
    Outcome.LEASE_LOST: (c.EV_LEASE_LOST, "heartbeat_lost"),
    Outcome.SUCCEEDED: (c.EV_SUCCEEDED, "job_succeeded"),
    Outcome.CANCELLED: (c.EV_CANCELLED, "job_cancelled"),
    Outcome.DEADLINE_EXCEEDED: (c.EV_DEADLINE_EXCEEDED, "deadline_exceeded"),
}


class _Builder:
    """Accumulates one status write for one decision."""

    def __init__(self, o: Observed) -> None:
        self.o = o
        self.run = o.run
        self.status = o.run.status.model_copy(deep=True)
        self.events: list[Event] = []
        self.log = ""
        self.log_fields: dict[str, object] = {}
        self.ends_attempt = False
        self.lapse = False
        self.grants = False

    @property
    def generation(self) -> int:
        return self.run.metadata.generation

    def set_phase(self, phase: Phase, message: str, lease_reason: str = "") -> None:
        s = self.status
        s.phase = phase
        s.observed_generation = self.generation
        s.conditions = phase_conditions(s.conditions, phase, s.holder, message, self.generation,
                                        self.o.now, lease_reason)
        if phase.terminal and s.finished_at is None:
            s.finished_at = self.o.now

    def write(self) -> WriteStatus:
        return WriteStatus(status=self.status, events=tuple(self.events), log=self.log,
                           log_fields=tuple(self.log_fields.items()), ends_attempt=self.ends_attempt,
                           lapse=self.lapse, grants=self.grants)

    def end_attempt(self, outcome: Outcome, message: str, exit_code: int | None = None) -> None:
        """Revocation: the fence moves first, so nothing the old holder writes is accepted."""
        s, o = self.status, self.o
        self.ends_attempt = True
        s.fence += 1
        s.holder = None
        s.lease_expires_at = None
        cur = s.current()
        if cur is not None and cur.outcome is None:
            cur.outcome = outcome
            cur.ended_at = o.now
            cur.exit_code = exit_code
            cur.message = message
            if _lease_is_current(o) and o.lease is not None and o.lease.usage is not None:
                cur.usage = o.lease.usage
        s.usage = sum_usage(a.usage for a in s.attempts)
        s.folded_at = o.now
        s.stop_requested_at = None
        cursor = reported_cursor(o)
        if _lease_is_current(o) and cursor and (s.checkpoint is None or s.checkpoint.cursor != cursor):
            s.checkpoint = Checkpoint(cursor=cursor, time=o.now)
        reason, log = _OUTCOME_EVENT.get(outcome, (c.EV_ATTEMPT_ENDED, "attempt_ended"))
        attempt = cur.attempt if cur else s.attempt
        self.events.append(Event("Normal" if outcome == Outcome.SUCCEEDED else "Warning", reason,
                                 f"attempt {attempt} ended: {outcome.value}: {message}"))
        self.log = log

    def finish_after(self, outcome: Outcome, message: str, exit_code: int | None) -> None:
        """After an attempt ended: retry (Backoff) or end the run."""
        s, run = self.status, self.run
        terminal = _TERMINAL_OUTCOMES.get(outcome)
        if terminal is not None:
            self.set_phase(terminal, message, lease_reason=outcome.value)
            if terminal == Phase.SUCCEEDED:
                s.error = None
            elif s.error is None:
                s.error = ErrorInfo(code=outcome.value, message=message)
            return
        if not retry_allowed(run, outcome, exit_code):
            self._fail(Phase.FAILED, f"retry rules end the run after {outcome.value}: {message}", outcome)
            return
        if s.attempt >= run.spec.retry.max_attempts:
            phase = Phase.LOST if outcome == Outcome.LEASE_LOST else Phase.FAILED
            self._fail(phase, f"{s.attempt} of {run.spec.retry.max_attempts} attempts used; last: "
                              f"{outcome.value}: {message}", outcome)
            return
        delay = backoff_seconds(run, s.attempt)
        s.next_attempt_at = after(self.o.now, delay)
        self.set_phase(Phase.BACKOFF, f"attempt {s.attempt + 1} in {delay:g}s after {outcome.value}",
                       lease_reason=outcome.value)
        self.events.append(Event("Normal", c.EV_BACKOFF, f"next attempt in {delay:g}s"))

    def _fail(self, phase: Phase, message: str, outcome: Outcome) -> None:
        s = self.status
        if s.error is None:
            s.error = ErrorInfo(code=outcome.value, message=message)
        self.set_phase(phase, message, lease_reason=outcome.value)
        self.events.append(Event("Warning", phase.value, message))

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
            s.ends_at = run_ends_at(run.model_copy(update={"status": s}))
        pod = holder if run.spec.executor == "Pod" else None
        s.attempts.append(AttemptRecord(attempt=attempt, fence=s.fence, holder=holder, pod=pod,
                                        started_at=o.now))
        # Keep the history bounded (the CRD allows 100 entries).
        s.attempts = s.attempts[-100:]
        self.set_phase(Phase.STARTING, f"attempt {attempt} granted to {holder} with fence {s.fence}")
        self.events.append(Event("Normal", c.EV_ATTEMPT_STARTED,
                                 f"attempt {attempt} granted to {holder} with fence {s.fence}"))
        self.log = "job_claimed"
        self.grants = True
        return holder, attempt, s.fence


# --- usage, limits, signals -------------------------------------------------


# status.checkpoint.cursor's maxLength in the CRD. Lease annotations admit far longer values, and
# a status write carrying one would be refused (422) on every pass.
MAX_CURSOR_LENGTH = 1024


def reported_cursor(o: Observed) -> str | None:
    """The checkpoint on the Lease, or the one already recorded when the Lease has none or one
    too long to record (ignored like a malformed usage report)."""
    recorded = o.run.status.checkpoint.cursor if o.run.status.checkpoint else None
    cursor = o.lease.checkpoint if o.lease is not None else None
    return cursor if cursor and len(cursor) <= MAX_CURSOR_LENGTH else recorded


def sum_usage(items: Iterable[Usage | None]) -> Usage:
    cents = tokens = 0
    for u in items:
        if u is not None:
            cents += u.cents
            tokens += u.tokens
    # Saturates at the CRD's maximum: 100 attempts of the largest plausible report exceed it,
    # and a status carrying more would be refused on every write.
    return Usage(cents=min(cents, MAX_STATUS_NUMBER), tokens=min(tokens, MAX_STATUS_NUMBER))


def _lease_is_current(o: Observed) -> bool:
    s = o.run.status
    return o.lease is not None and s.holder is not None and o.lease.holder == s.holder and o.lease.fence == s.fence


def earlier_usage(s: WorkerRunStatus) -> Usage:
    """What attempts that already ended reported."""
    return sum_usage(a.usage for a in s.attempts if a.outcome is not None)


def run_usage(o: Observed) -> Usage:
    """Everything the run has reported: ended attempts plus the current one's latest report."""
    current = o.lease.usage if _lease_is_current(o) and o.lease is not None else None
    return sum_usage([earlier_usage(o.run.status), current])


def over_limit(o: Observed, total: Usage) -> tuple[str, Usage] | None:
    """(why, overspend) when the run's cap or its budget is reached. `why` goes onto the Lease as
    the stop reason, so it names the limit, not the live total (which would rewrite the Lease
    on every heartbeat)."""
    budget = o.run.spec.budget
    if budget is not None:
        if budget.cap_cents is not None and total.cents >= budget.cap_cents:
            return (f"cap of {budget.cap_cents} cents reached",
                    Usage(cents=total.cents - budget.cap_cents, tokens=0))
        if budget.max_tokens is not None and total.tokens >= budget.max_tokens:
            return (f"cap of {budget.max_tokens} tokens reached",
                    Usage(cents=0, tokens=total.tokens - budget.max_tokens))
    b = o.budget
    if b is not None and not b.missing:
        over_c = max(0, total.cents - b.charged.cents) - b.remaining.cents
        over_t = max(0, total.tokens - b.charged.tokens) - b.remaining.tokens
        if b.exhausted or over_c >= 0 or over_t >= 0:
            return (f"WorkerBudget {b.name} is exhausted", Usage(cents=max(0, over_c), tokens=max(0, over_t)))
    return None


def usage_alarm(o: Observed) -> Usage | None:
    """The current attempt's own usage at which a cap or the budget is reached."""
    earlier = earlier_usage(o.run.status)
    big = 2**62
    cents, tokens = big, big
    budget = o.run.spec.budget
    if budget is not None:
        if budget.cap_cents is not None:
            cents = min(cents, budget.cap_cents - earlier.cents)
        if budget.max_tokens is not None:
            tokens = min(tokens, budget.max_tokens - earlier.tokens)
    b = o.budget
    if b is not None and not b.missing:
        cents = min(cents, b.remaining.cents + b.charged.cents - earlier.cents)
        tokens = min(tokens, b.remaining.tokens + b.charged.tokens - earlier.tokens)
    if cents == big and tokens == big:
        return None
    return Usage(cents=max(cents, 0), tokens=max(tokens, 0))


def desired_signals(o: Observed, stop_reason: str | None) -> str:
    run, s = o.run, o.run.status
    budget = run.spec.budget
    earlier = earlier_usage(s)
    sig = Signals(stop=stop_reason is not None, reason=stop_reason, paused=run.spec.suspend, ends_at=s.ends_at,
                  cap_cents=budget.cap_cents if budget else None, cap_tokens=budget.max_tokens if budget else None,
                  base_cents=earlier.cents, base_tokens=earlier.tokens)
    return json.dumps(sig.dump(), sort_keys=True, separators=(",", ":"))


# --- the decision -----------------------------------------------------------


def decide(o: Observed) -> Decision:
    run, s = o.run, o.run.status
    d = Decision()
    ahead = _foreign_fence(o)
    if ahead is not None:
        _decide_foreign_fence(o, d, ahead)
        return d
    if run.metadata.deletion_timestamp is not None:
        _decide_deleting(o, d)
        return d
    _housekeep_pods(o, d)

    if s.phase is not None and s.phase.terminal:
        _decide_finished(o, d)
        return d

    b = _Builder(o)
    active = s.holder is not None
    cur = s.current()

    # endsAt follows a changed deadlineSeconds (a control field, mutable while the run is active).
    ends_at = run_ends_at(run)
    b.status.ends_at = ends_at

    # The whole-run deadline ends the run whatever the worker does; a stop without a
    # worker to tell ends it at once.
    ending: tuple[Outcome, str] | None = None
    if ends_at is not None and o.now >= ends_at:
        ending = (Outcome.DEADLINE_EXCEEDED, f"deadlineSeconds={run.spec.deadline_seconds} passed")
    elif run.spec.stop and not active:
        ending = (Outcome.CANCELLED, "spec.stop is set")
    if ending is not None:
        outcome, message = ending
        if active:
            b.end_attempt(outcome, message)
        b.finish_after(outcome, message, None)
        d.actions.append(b.write())
        if active:
            _revoke_followups(o, d, b.status.fence, cur)
        _charge_if_due(o, d, b.status.usage)
        return d
    if ends_at != s.ends_at:
        # Record the moved deadline first, then decide again from the written status (the
        # worker's signals carry the new endsAt from that pass on).
        d.actions.append(b.write())
        d.wake(0)
        return d
    if ends_at is not None:
        d.wake((ends_at - o.now).total_seconds())

    if active and cur is not None:
        _decide_active(o, b, d, cur)
        return d

    # Nobody holds the run: finish an interrupted revocation (the lease still names the old
    # holder), settle the last attempt's books, then start an attempt unless held back.
    if o.lease is not None and o.lease.holder is not None:
        d.actions.append(ClearLease(fence=s.fence))
        d.wake(0)
        return d
    if _settle_usage(o, b):
        d.actions.append(b.write())
        _charge_if_due(o, d, b.status.usage)
        return d
    if run.spec.suspend:
        if s.phase != Phase.SUSPENDED:
            b.set_phase(Phase.SUSPENDED, "spec.suspend is set; no new attempt starts")
            b.events.append(Event("Normal", c.EV_SUSPENDED, "run suspended"))
            d.actions.append(b.write())
        return d
    if s.phase == Phase.BACKOFF and s.next_attempt_at is not None and o.now < s.next_attempt_at:
        d.wake((s.next_attempt_at - o.now).total_seconds())
        return d
    if o.namespace_terminating:
        d.wake(30.0)  # its runs are about to be deleted: starting attempts there only fails
        return d
    if not _admit(o, b, d):
        return d
    holder, attempt, fence = b.grant()
    d.actions.append(b.write())
    granted = Observed(run=run.model_copy(update={"status": b.status}), lease=None, pods=o.pods, now=o.now,
                       mono=o.mono, budget=o.budget)
    d.actions.append(EnsureLease(holder=holder, fence=fence, duration_seconds=run.spec.lease.duration_seconds,
                                 signals=desired_signals(granted, None)))
    if run.spec.executor == "Pod":
        d.actions.append(EnsurePod(name=holder, attempt=attempt, fence=fence, holder=holder))
    d.wake(max(run.spec.lease.startup_grace_seconds, run.spec.lease.duration_seconds))
    return d


def _admit(o: Observed, b: _Builder, d: Decision) -> bool:
    """Admission: a run whose cap or budget is exhausted waits, Admitted=False."""
    s, gen = o.run.status, o.run.metadata.generation
    reason, message = "", ""
    if o.budget is not None and o.budget.missing:
        reason, message = "BudgetNotFound", f"WorkerBudget {o.budget.name} does not exist"
    else:
        over = over_limit(o, run_usage(o))
        if over is not None:
            reason, message = "BudgetExceeded", f"not launched: {over[0]}"
    if not reason:
        b.status.conditions = set_condition(b.status.conditions, c.COND_ADMITTED, "True", "Admitted",
                                            "run admitted", gen, o.now)
        return True
    current = get_condition(s.conditions, c.COND_ADMITTED)
    if current is None or current.status != "False" or current.reason != reason or s.phase is None:
        b.status.conditions = set_condition(b.status.conditions, c.COND_ADMITTED, "False", reason, message,
                                            gen, o.now)
        b.set_phase(Phase.PENDING, message)
        b.events.append(Event("Warning", c.EV_BUDGET_EXCEEDED if reason == "BudgetExceeded" else reason, message))
        d.actions.append(b.write())
    if o.budget is not None and o.budget.next_reset_seconds is not None:
        d.wake(o.budget.next_reset_seconds)
    return False


def _foreign_fence(o: Observed) -> int | None:
    """The run's Lease carries a fence the run never issued: someone other than Tether wrote it."""
    lease = o.lease
    if lease is not None and lease.fence is not None and lease.fence > o.run.status.fence:
        return lease.fence
    return None


def _decide_foreign_fence(o: Observed, d: Decision, lease_fence: int) -> None:
    """A foreign write to the Lease is an attack or a bug; either way nobody can be sure who owns
    the run. Converge: end the current attempt, move the run's fence past the Lease's, record it,
    and let the retry rules go on with a Lease rewritten by Tether."""
    s = o.run.status
    b = _Builder(o)
    message = (f"the Lease carries fence {lease_fence}, ahead of the run's {s.fence}: "
               "it was written by someone other than Tether")
    cur = s.current()
    active = s.holder is not None
    if active:
        b.end_attempt(Outcome.LEASE_LOST, message)
        b.finish_after(Outcome.LEASE_LOST, message, None)
    b.status.fence = max(b.status.fence, lease_fence + 1)
    b.status.conditions = set_condition(b.status.conditions, c.COND_LEASE_HELD, "False", c.REASON_LEASE_TAMPERED,
                                        message, o.run.metadata.generation, o.now)
    b.events.append(Event("Warning", c.REASON_LEASE_TAMPERED, message))
    b.log, b.log_fields["leaseFence"] = "lease_tampered", lease_fence
    d.actions.append(b.write())
    if active:
        _revoke_followups(o, d, b.status.fence, cur)
    else:
        d.actions.append(ClearLease(fence=b.status.fence))


def _decide_deleting(o: Observed, d: Decision) -> None:
    """A deleted run (held by Tether's finalizer) ends its attempt, settles and charges its usage,
    releases its pods, and only then lets go."""
    s = o.run.status
    b = _Builder(o)
    if s.holder is not None:
        cur = s.current()
        outcome, message = ((Outcome.SUCCEEDED, "the holder published its result") if s.result is not None
                            else (Outcome.CANCELLED, "the WorkerRun is being deleted"))
        b.end_attempt(outcome, message)
        b.finish_after(outcome, message, None)
        d.actions.append(b.write())
        _revoke_followups(o, d, b.status.fence, cur)
        return
    if o.lease is not None and o.lease.holder is not None:
        d.actions.append(ClearLease(fence=s.fence))
        return
    if _settle_usage(o, b):
        d.actions.append(b.write())
        return
    _charge_if_due(o, d, s.usage)
    if d.actions:
        return
    for pod in o.pods:
        if not pod.terminated and not pod.deleting:
            d.actions.append(DeletePod(pod.name))
        if pod.has_finalizer:
            d.actions.append(ReleasePod(pod.name))
    if not d.actions:
        d.actions.append(RemoveFinalizer())


def _decide_finished(o: Observed, d: Decision) -> None:
    run, s = o.run, o.run.status
    if o.lease is not None and o.lease.holder is not None:
        d.actions.append(ClearLease(fence=s.fence))  # a crash between status and lease writes
    b = _Builder(o)
    if _settle_usage(o, b):
        d.actions.append(b.write())
        return
    needs_charge = run.spec.budget is not None and run.spec.budget.budget_ref is not None \
        and o.budget is not None and not o.budget.missing and not s.budget_charged
    if needs_charge:
        total = s.usage or Usage()
        assert o.budget is not None
        if o.budget.charged.cents >= total.cents and o.budget.charged.tokens >= total.tokens:
            status = s.model_copy(deep=True)
            status.budget_charged = True
            d.actions.append(WriteStatus(status=status, log="budget_charged"))
        else:
            d.actions.append(ChargeBudget(budget=o.budget.name, total=total))
        return  # TTL waits until every cent is charged
    ttl = run.spec.ttl_seconds_after_finished
    if ttl is not None and s.finished_at is not None:
        # Seconds arithmetic, not finishedAt + ttl: a datetime that far out would overflow.
        due = ttl - (o.now - s.finished_at).total_seconds()
        if due <= 0:
            d.actions.append(DeleteRun())
        else:
            d.wake(due)


def _settle_usage(o: Observed, b: _Builder) -> bool:
    """Picks up usage the last holder reported between the revocation's status write and the
    lease being cleared: the cleared lease keeps its final report, and nothing is written
    after it. Returns True when the status changed."""
    s = b.status
    last = s.attempts[-1] if s.attempts else None
    lease = o.lease
    if s.holder is not None or last is None or last.outcome is None or lease is None or \
            lease.holder is not None or lease.fence != s.fence or lease.usage is None:
        return False
    have = last.usage or Usage()
    if lease.usage.cents <= have.cents and lease.usage.tokens <= have.tokens:
        return False
    last.usage = Usage(cents=max(have.cents, lease.usage.cents), tokens=max(have.tokens, lease.usage.tokens))
    s.usage = sum_usage(a.usage for a in s.attempts)
    if s.overspend is not None:
        over = over_limit(o, s.usage)
        if over is not None:
            s.overspend = over[1]
    return True


def _charge_if_due(o: Observed, d: Decision, total: Usage | None) -> None:
    b = o.budget
    if b is None or b.missing or total is None:
        return
    if total.cents > b.charged.cents or total.tokens > b.charged.tokens:
        d.actions.append(ChargeBudget(budget=b.name, total=total))


def _decide_active(o: Observed, b: _Builder, d: Decision, cur: AttemptRecord) -> None:
    run, s = o.run, o.run.status
    assert s.holder is not None
    pod = next((p for p in o.pods if p.attempt == cur.attempt), None)
    total = run_usage(o)
    d.usage_alarm = usage_alarm(o)

    # A stop (spec.stop, or a cap or budget crossed) is first told to the worker; its
    # attempt ends when it stops, or when stopGraceSeconds have passed.
    stop: tuple[Outcome, str] | None = None
    over = over_limit(o, total)
    if run.spec.stop:
        stop = (Outcome.CANCELLED, "spec.stop is set")
    elif over is not None:
        stop = (Outcome.BUDGET_EXCEEDED, over[0])

    ended: tuple[Outcome, str, int | None] | None = None
    if s.result is not None:
        ended = (Outcome.SUCCEEDED, "the holder published its result", None)
    elif stop is not None and s.stop_requested_at is not None and (
            s.error is not None or (pod is not None and (pod.terminated or pod.deleting))
            or o.now >= after(s.stop_requested_at, run.spec.stop_grace_seconds)):
        ended = (stop[0], stop[1], pod.exit_code if pod is not None else None)
    elif s.error is not None:
        ended = (Outcome.WORKER_FAILED, f"{s.error.code or 'error'}: {s.error.message or ''}".strip(), None)
    elif pod is not None and pod.deleting:
        ended = (Outcome.POD_VANISHED, f"pod {pod.name} was deleted", None)
    elif pod is not None and pod.terminated:
        ended = (Outcome.POD_FAILED, f"pod {pod.name} exited with code {pod.exit_code} without a result",
                 pod.exit_code)

    lease_ok = _lease_is_current(o)
    if ended is None and lease_ok:
        assert o.lease is not None
        deadline = lapse_deadline(run, o.lease, o.api_available_since)
        pd = run.spec.progress_deadline_seconds
        judge = judge_from(o.api_available_since, run.spec.lease.duration_seconds)
        if o.mono >= deadline:
            ended = (Outcome.LEASE_LOST, f"no renewal observed for {run.spec.lease.duration_seconds}s", None)
            b.log_fields["silenceSeconds"] = round(o.mono - o.lease.last_change, 3)
            b.lapse = True
        elif pd is not None and o.lease.renewed and judge is not None and \
                o.mono >= max(o.lease.checkpoint_changed + pd, judge):
            ended = (Outcome.STALLED, f"alive, but no new checkpoint for {pd}s (progressDeadlineSeconds)", None)
        elif math.isinf(deadline):
            # The API server is unreachable: look again after a lease duration (no sooner is useful:
            # once it answers, a full duration must pass before anything is judged).
            d.wake(run.spec.lease.duration_seconds)
        else:
            d.wake(deadline - o.mono)
            if pd is not None:
                d.wake(max(o.lease.checkpoint_changed + pd, judge or 0.0) - o.mono)

    if ended is not None:
        outcome, message, exit_code = ended
        if outcome == Outcome.BUDGET_EXCEEDED and over is not None:
            b.status.overspend = over[1]
            message = f"{message}; overspend {over[1].cents} cents, {over[1].tokens} tokens"
        b.end_attempt(outcome, message, exit_code)
        # The worker's error is kept in the attempt record; status.error describes the run,
        # so it stays only if this failure ends the run.
        b.status.error = None
        b.finish_after(outcome, message, exit_code)
        if outcome == Outcome.WORKER_FAILED and b.status.phase == Phase.FAILED:
            b.status.error = s.error
        d.actions.append(b.write())
        _revoke_followups(o, d, b.status.fence, cur, keep_pod=outcome == Outcome.SUCCEEDED)
        _charge_if_due(o, d, b.status.usage)
        if b.status.phase == Phase.BACKOFF:
            d.wake(0 if b.status.next_attempt_at is None else
                   (b.status.next_attempt_at - o.now).total_seconds())
        return

    # Still held. Repair a grant interrupted by a crash (status written, lease or pod not).
    if not lease_ok:
        d.actions.append(EnsureLease(holder=s.holder, fence=s.fence,
                                     duration_seconds=run.spec.lease.duration_seconds,
                                     signals=desired_signals(o, None)))
    if run.spec.executor == "Pod" and pod is None:
        d.actions.append(EnsurePod(name=cur.pod or s.holder, attempt=cur.attempt, fence=s.fence, holder=s.holder))
    if not lease_ok:
        d.wake(1.0)
        return
    assert o.lease is not None

    signals = desired_signals(o, stop[1] if stop is not None else None)
    write = False
    if stop is not None and s.stop_requested_at is None:
        b.status.stop_requested_at = o.now
        b.events.append(Event("Warning", c.EV_BUDGET_EXCEEDED if stop[0] == Outcome.BUDGET_EXCEEDED
                              else c.EV_STOP_REQUESTED, f"{s.holder} told to stop: {stop[1]}"))
        b.log, b.log_fields["reason"] = "stop_requested", stop[1]
        write = True
    if stop is not None:
        requested = b.status.stop_requested_at or o.now
        d.wake((after(requested, run.spec.stop_grace_seconds) - o.now).total_seconds())
    if s.phase != Phase.RUNNING and o.lease.renewed:
        b.status.last_renew_time = o.now
        b.status.lease_expires_at = after(o.now, run.spec.lease.duration_seconds)
        b.set_phase(Phase.RUNNING, f"{s.holder} renewed its lease", lease_reason="LeaseRenewed")
        b.events.append(Event("Normal", c.EV_LEASE_RENEWED, f"{s.holder} renewed its lease; running"))
        b.log = b.log or "heartbeat_ok"
        write = True
    if _fold_due(o, total):
        b.status.usage = total
        cursor = reported_cursor(o)
        if cursor and (s.checkpoint is None or s.checkpoint.cursor != cursor):
            b.status.checkpoint = Checkpoint(cursor=cursor, time=o.now)
        b.status.folded_at = o.now
        write = True
        _charge_if_due(o, d, total)
    elif s.folded_at is not None and (total != (s.usage or Usage()) or
                                      reported_cursor(o) != (s.checkpoint.cursor if s.checkpoint else None)):
        d.wake(o.fold_interval - (o.now - s.folded_at).total_seconds())
    if s.observed_generation != run.metadata.generation and not write:
        b.set_phase(s.phase or Phase.STARTING, f"{s.holder} holds the lease",
                    lease_reason="LeaseRenewed" if s.phase == Phase.RUNNING else "AttemptStarted")
        write = True
    if write:
        if o.lease.renewed:
            # Refreshed on every status write (folds come at a bounded rate), never by their own
            # write: heartbeats cost no WorkerRun writes. The time is when *this operator* saw it.
            seen = o.now - dt.timedelta(seconds=max(0.0, o.mono - o.lease.last_change))
            b.status.last_renew_time = seen
            b.status.lease_expires_at = seen + dt.timedelta(seconds=run.spec.lease.duration_seconds)
        d.actions.append(b.write())
    if signals != o.lease.signals:
        d.actions.append(EnsureSignals(fence=s.fence, signals=signals))


def _fold_due(o: Observed, total: Usage) -> bool:
    """New usage or checkpoint on the lease, and the last fold long enough ago (bounded status writes)."""
    s, lease = o.run.status, o.lease
    assert lease is not None
    changed = total != (s.usage or Usage()) or \
        reported_cursor(o) != (s.checkpoint.cursor if s.checkpoint else None)
    if not changed:
        return False
    return s.folded_at is None or (o.now - s.folded_at).total_seconds() >= o.fold_interval


def _revoke_followups(o: Observed, d: Decision, fence: int, cur: AttemptRecord | None,
                      keep_pod: bool = False) -> None:
    d.actions.append(ClearLease(fence=fence))
    if cur is None:
        return
    for pod in o.pods:
        if pod.attempt == cur.attempt and not pod.deleting and not pod.terminated and not keep_pod:
            d.actions.append(DeletePod(pod.name))


def _housekeep_pods(o: Observed, d: Decision) -> None:
    """Pods of attempts that no longer hold the run: delete the running ones, release the rest."""
    s = o.run.status
    by_attempt = {a.attempt: a for a in s.attempts}
    for pod in o.pods:
        if s.holder is not None and pod.attempt == s.attempt:
            continue
        record = by_attempt.get(pod.attempt)
        if not pod.terminated and not pod.deleting:
            ended_for = 0.0 if record is None or record.ended_at is None else (o.now - record.ended_at).total_seconds()
            succeeded = record is not None and record.outcome == Outcome.SUCCEEDED
            if succeeded and ended_for < POD_EXIT_GRACE_SECONDS:
                d.wake(POD_EXIT_GRACE_SECONDS - ended_for)
            else:
                d.actions.append(DeletePod(pod.name))
        elif pod.has_finalizer and (pod.terminated or pod.deleting):
            d.actions.append(ReleasePod(pod.name))
