"""The pure heart of the operator: decide(observed) -> Decision.

No I/O and no clock reads: the wall clock (`now`, for timestamps and deadlines) and the
monotonic clock (`mono`, for lease lapses) come in with the observation. This module only
composes the concerns, each in its own module:

- observe.py: what a decision sees;          actions.py: what it asks for;
- lifecycle.py: grant, end, retry, finish;    liveness.py: lapse and progress deadlines;
- accounting.py: usage, folds, charges;       enforcement.py: deadline, caps, budget, signals;
- cleanup.py: deleted and finished runs, pods of ended attempts;
- capability.py: what a capability's package (Kueue's: tether/kueue) adds: its gates, its stop,
  what it hears of every pass, what a deleted run waits for.

The names other modules import from here are re-exported below.
"""

from __future__ import annotations

import datetime as dt
from typing import Callable

from tether.api import constants as c
from tether.api.models import AttemptRecord, Checkpoint, Outcome, Phase, Usage
from tether.core.accounting import charge_due, fold_wait, reported_cursor, run_usage, unfolded
from tether.core.actions import (
    MAX_REQUEUE_SECONDS,
    Action,
    Change,
    ChargeBudget,
    ClearLease,
    Decision,
    DeletePod,
    DeleteRun,
    EnsureLease,
    EnsurePod,
    EnsureSignals,
    Event,
    ReleaseCharge,
    ReleasePod,
    RemoveFinalizer,
    Revoke,
    UsageAlarm,
    WriteStatus,
)
from tether.core.cleanup import (
    decide_deleting,
    decide_finished,
    housekeep_pods,
    record_exit_codes,
    revocation_unfinished,
)
from tether.core.capability import Rules
from tether.core.class_gate import class_allows
from tether.core.clock import after
from tether.core.enforcement import (
    Stop,
    budget_pause,
    desired_signals,
    run_ends_at,
    signals_for,
    stop_due,
    stop_for,
    usage_alarm,
    yield_by,
)
from tether.core.execution_gate import execution_allowed
from tether.core.lifecycle import (
    Ending,
    StatusBuilder,
    admit,
    attempt_end,
    backoff_seconds,
    decide_foreign_fence,
    foreign_fence,
    holder_name,
    revoke,
    room_for_attempt,
    wait_for_namesake,
)
from tether.core.liveness import judge, never_leased_wait
from tether.core.review import decide_result_review, start_allowed, track_requests
from tether.core.observe import (
    BudgetObservation,
    ForeignPod,
    LeaseObservation,
    Observed,
    PodObservation,
    PodRefusal,
    current_lease,
)

__all__ = [
    "MAX_REQUEUE_SECONDS", "Action", "BudgetObservation", "Change", "ChargeBudget", "ClearLease", "Decision",
    "DeletePod", "DeleteRun", "EnsureLease", "EnsurePod", "EnsureSignals", "Event", "ForeignPod", "LeaseObservation",
    "Observed", "PodObservation", "PodRefusal", "ReleaseCharge", "ReleasePod", "RemoveFinalizer", "Revoke", "UsageAlarm",
    "WriteStatus", "after", "backoff_seconds", "decide", "desired_signals",
]


Gate = Callable[[Observed, StatusBuilder, Decision], bool]


def gates(capabilities: tuple[Rules, ...]) -> tuple[Gate, ...]:
    """What a run nobody holds passes before its grant, in order; each gate that holds it back
    says why (in the status and the decision) and ends the pass. A queue's place comes first
    (a queued run waits in line whatever else holds it), its admission last."""
    return (class_allows, *(r.enter for r in capabilities), start_allowed, execution_allowed, admit,
            *(r.admit for r in capabilities))


def decide(o: Observed, capabilities: tuple[Rules, ...] = ()) -> Decision:
    d = Decision()
    ahead = foreign_fence(o)
    if ahead is not None:
        decide_foreign_fence(o, d, ahead)
    elif o.run.metadata.deletion_timestamp is not None:
        decide_deleting(o, d, capabilities)
    elif not record_exit_codes(o, d):
        housekeep_pods(o, d)
        if o.run.status.phase is not None and o.run.status.phase.terminal:
            decide_finished(o, d)
        else:
            _decide_unfinished(o, d, capabilities)
        for rules in capabilities:
            rules.after(o, d)
    return d


def _decide_unfinished(o: Observed, d: Decision, capabilities: tuple[Rules, ...]) -> None:
    run, s = o.run, o.run.status
    b = StatusBuilder(o)
    active = s.holder is not None
    cur = s.current()

    # endsAt follows a changed deadlineSeconds (a control field, mutable while the run is active).
    ends_at = run_ends_at(run.spec, s.started_at)
    b.status.ends_at = ends_at

    # The whole-run deadline ends the run whatever the worker does, except publish a result
    # first: one the API server accepted (its fence and holder were current) ends the attempt
    # Succeeded, however late this pass comes. A stop without a worker to tell ends it at once.
    # A result under review (AwaitingReview) stands too: its gate has its own timeout.
    accepted = s.result is not None
    ending: Ending | None = None
    if ends_at is not None and o.now >= ends_at and not accepted:
        ending = Ending(Outcome.DEADLINE_EXCEEDED, f"deadlineSeconds={run.spec.deadline_seconds} passed")
    elif run.spec.stop and not active:
        ending = Ending(Outcome.CANCELLED, "spec.stop is set")
    if ending is not None:
        if active:
            b.end_attempt(ending.outcome, ending.message)
        b.finish_after(ending.outcome, ending.message, None)
        d.actions.append(revoke(o, b, cur) if active else b.write())
        d.add(charge_due(o, b.status.usage))
        return
    if ends_at != s.ends_at:
        # Record the moved deadline first, then decide again from the written status (the
        # worker's signals carry the new endsAt from that pass on).
        d.actions.append(b.write())
        d.again()
        return
    if ends_at is not None and not accepted:
        d.wake((ends_at - o.now).total_seconds())

    if active and cur is not None:
        _decide_held(o, b, d, cur, capabilities)
    else:
        _decide_unheld(o, b, d, capabilities)


def _decide_unheld(o: Observed, b: StatusBuilder, d: Decision, capabilities: tuple[Rules, ...]) -> None:
    """Nobody holds the run: finish an interrupted revocation (the lease still names the old
    holder), settle the last attempt's books, then start an attempt unless held back."""
    run, s = o.run, o.run.status
    if revocation_unfinished(o):
        d.actions.append(ClearLease(fence=s.fence))
        d.again()
        return
    if b.settle_usage():
        d.actions.append(b.write())
        d.add(charge_due(o, b.status.usage))
        return
    if s.phase == Phase.AWAITING_REVIEW:
        decide_result_review(o, b, d)
        return
    if run.spec.suspend:
        if s.phase != Phase.SUSPENDED or s.observed_generation != run.metadata.generation:
            # (A spec changed while suspended is observed too: kstatus waits on observedGeneration.)
            b.set_phase(Phase.SUSPENDED, "spec.suspend is set; no new attempt starts")
        b.mark_suspension()
        if b.changed():
            d.actions.append(b.write())
        return
    if b.mark_suspension() or s.phase == Phase.SUSPENDED:
        # Resumed: said first, and no longer Suspended (what held it back before says so again on
        # the next pass, which starts the attempt if nothing does).
        if s.phase == Phase.SUSPENDED:
            b.set_phase(Phase.PENDING, "spec.suspend was cleared")
        d.actions.append(b.write())
        d.again()
        return
    if s.phase == Phase.BACKOFF and s.next_attempt_at is not None and o.now < s.next_attempt_at:
        d.wake((s.next_attempt_at - o.now).total_seconds())
        return
    if o.namespace_terminating:
        d.wake(30.0)  # its runs are about to be deleted: starting attempts there only fails
        return
    if not all(gate(o, b, d) for gate in gates(capabilities)):
        return
    blocker = next((p for p in o.foreign_pods if p.name == holder_name(run, s.attempt + 1)), None)
    if blocker is not None and (blocker.token_dead_at is None or o.now < blocker.token_dead_at):
        # A deleted namesake's pod of that name: its worker, with a token the API server still
        # accepts, would take the new holder for its own. Bounded: grace period plus a minute.
        wait_for_namesake(o, b, d, blocker)
        return
    if not room_for_attempt(s.fence, s.attempt):
        b.exhaust_fences(f"fence {s.fence}, attempt {s.attempt}: no room for another attempt's grant and revocation")
        d.actions.append(b.write())
        return
    holder, attempt, fence = b.grant()
    d.actions.append(b.write())
    d.actions.append(EnsureLease(holder=holder, fence=fence, duration_seconds=run.spec.lease.duration_seconds,
                                 signals=signals_for(run.spec, b.status, None)))
    if run.spec.executor == "Pod":
        d.actions.append(EnsurePod(name=holder, attempt=attempt, fence=fence, holder=holder))
    d.wake(max(run.spec.lease.startup_grace_seconds, run.spec.lease.duration_seconds))


def _decide_held(o: Observed, b: StatusBuilder, d: Decision, cur: AttemptRecord,
                 capabilities: tuple[Rules, ...]) -> None:
    """The run has a holder: end its attempt if something ended it, else repair an interrupted
    grant, or keep the status and the worker's signals up to date."""
    run, s = o.run, o.run.status
    assert s.holder is not None
    pod = o.pod_of(cur.attempt)
    total = run_usage(o)
    d.usage_alarm = usage_alarm(o)
    # A stop (spec.stop, or a cap or budget crossed) is first told to the worker; its
    # attempt ends when it stops, or when stopGraceSeconds have passed.
    stop = stop_for(o, total) or next((told for r in capabilities if (told := r.stop(o)) is not None), None)
    b.budget_pause = budget_pause(o, total) if stop is None else None
    if b.budget_pause is not None and o.budget is not None and o.budget.next_reset_seconds is not None:
        d.wake(o.budget.next_reset_seconds)  # the budget's period rolls over: room again
    ending = attempt_end(o, pod, stop)
    lease = current_lease(o)
    if ending is None and lease is not None:
        verdict = judge(run, lease, o.mono, o.api_available_since, o.progress_held_at)
        if verdict.lapsed:
            if stop is not None and s.stop_requested_at is not None:
                # Told to stop, the worker went away: the stop is over, as when a pod exits. (An
                # External worker has no pod to exit; ending LeaseLost would retry a stopped run.)
                ending = Ending(stop.outcome, f"{stop.reason}; no renewal observed for "
                                              f"{run.spec.lease.duration_seconds}s since")
            else:
                ending = Ending(Outcome.LEASE_LOST, f"no renewal observed for {run.spec.lease.duration_seconds}s")
            b.note(silence_seconds=round(verdict.silence, 3))
            b.lapse = True
        elif verdict.stalled:
            ending = Ending(Outcome.STALLED,
                            f"alive, but no new checkpoint for {run.spec.progress_deadline_seconds}s "
                            "(progressDeadlineSeconds)")
        elif verdict.recheck_in is not None:
            d.wake(verdict.recheck_in)
    elif ending is None:
        # No Lease names the holder: a grant interrupted before its Lease write, repaired below. A
        # repair that keeps failing (the Lease refused) must not hold the run forever.
        wait = never_leased_wait(run, cur, o.now, o.mono, o.api_available_since)
        if wait is None:
            ending = Ending(Outcome.LEASE_LOST, f"its Lease was not written within "
                                                f"{max(run.spec.lease.startup_grace_seconds, run.spec.lease.duration_seconds)}s of the grant")
        else:
            d.wake(wait)

    if ending is not None:
        if ending.outcome == Outcome.BUDGET_EXCEEDED and stop is not None and stop.overspend is not None:
            b.status.overspend = stop.overspend
            ending = Ending(ending.outcome, f"{ending.message}; overspend {stop.overspend.cents} cents, "
                                            f"{stop.overspend.tokens} tokens", ending.exit_code)
        if ending.outcome == Outcome.PREEMPTED and stop is not None and stop.eviction is not None:
            b.note(eviction_reason=stop.eviction)
        b.conclude(ending)
        d.actions.append(revoke(o, b, cur, keep_pod=ending.outcome == Outcome.SUCCEEDED))
        d.add(charge_due(o, b.status.usage))
        if b.status.phase == Phase.BACKOFF:
            if b.status.next_attempt_at is None:
                d.again()
            else:
                d.wake((b.status.next_attempt_at - o.now).total_seconds())
        return

    # Still held. Repair a grant interrupted by a crash (status written, lease or pod not).
    if lease is None:
        d.actions.append(EnsureLease(holder=s.holder, fence=s.fence,
                                     duration_seconds=run.spec.lease.duration_seconds,
                                     signals=desired_signals(o, None)))
    if run.spec.executor == "Pod" and pod is None:
        d.actions.append(EnsurePod(name=cur.pod or s.holder, attempt=cur.attempt, fence=s.fence, holder=s.holder))
    if lease is None:
        d.wake(1.0)
        return
    _keep_held(o, b, d, lease, stop, total)


def _keep_held(o: Observed, b: StatusBuilder, d: Decision, lease: LeaseObservation, stop: Stop | None,
               total: Usage) -> None:
    """The attempt goes on: tell the worker to stop if it must, record its first renewal, fold
    its reports at a bounded rate, and keep its signals current."""
    run, s = o.run, o.run.status
    if stop is not None and s.stop_requested_at is None:
        b.status.stop_requested_at = o.now
        told = {Outcome.BUDGET_EXCEEDED: c.EV_BUDGET_EXCEEDED, Outcome.PREEMPTED: c.EV_PREEMPTED}
        b.events.append(Event("Warning", told.get(stop.outcome, c.EV_STOP_REQUESTED),
                              f"{s.holder} told to {'yield' if stop.outcome == Outcome.PREEMPTED else 'stop'}: "
                              f"{stop.reason}"))
        b.change = Change.STOP_REQUESTED
        b.note(reason=stop.reason)
    if stop is not None:
        d.wake((stop_due(o) - o.now).total_seconds())
    elif s.stop_requested_at is not None:
        # The stop was withdrawn (spec.stop cleared, the cap raised, the budget's period reset).
        # A stop that comes back later is told afresh, with its full grace.
        b.status.stop_requested_at = None
        b.events.append(Event("Normal", c.EV_STOP_WITHDRAWN, f"{s.holder} is no longer told to stop"))
    if s.phase != Phase.RUNNING and lease.renewed:
        b.status.last_renew_time = o.now
        b.status.lease_expires_at = after(o.now, run.spec.lease.duration_seconds)
        b.set_phase(Phase.RUNNING, f"{s.holder} renewed its lease", lease_reason="LeaseRenewed")
        b.events.append(Event("Normal", c.EV_LEASE_RENEWED, f"{s.holder} renewed its lease; running"))
        b.change = b.change or Change.RENEWED
    track_requests(o, b, d, lease)
    if unfolded(o, total):
        wait = fold_wait(o)
        if wait <= 0:
            b.status.usage = total
            cursor = reported_cursor(o)
            if cursor and (s.checkpoint is None or s.checkpoint.cursor != cursor):
                b.status.checkpoint = Checkpoint(cursor=cursor, time=o.now)
            b.status.folded_at = o.now
        else:
            d.wake(wait)
    if s.observed_generation != run.metadata.generation and not b.changed():
        b.set_phase(s.phase or Phase.STARTING, f"{s.holder} holds the lease",
                    lease_reason="LeaseRenewed" if s.phase == Phase.RUNNING else "AttemptStarted")
    b.mark_suspension()
    if b.changed():
        if lease.renewed:
            # Refreshed on every status write (folds come at a bounded rate), never by their own
            # write: heartbeats cost no WorkerRun writes. The time is when *this operator* saw it.
            seen = o.now - dt.timedelta(seconds=max(0.0, o.mono - lease.last_change))
            b.status.last_renew_time = seen
            b.status.lease_expires_at = seen + dt.timedelta(seconds=run.spec.lease.duration_seconds)
        d.actions.append(b.write())
    # What the budget has not seen yet, derived from the status rather than from this fold: a
    # charge that failed after its fold was written is owed again on the next pass.
    d.add(charge_due(o, b.status.usage))
    # From the status being written: a decision recorded now reaches the worker with it.
    signals = signals_for(run.spec, b.status, stop.reason if stop is not None else None,
                          yield_by(o, stop, b.status.stop_requested_at), budget_paused=b.budget_pause is not None)
    if signals != lease.signals:
        d.actions.append(EnsureSignals(fence=s.fence, signals=signals))
