"""Runs past their attempts: a run being deleted (held by Tether's finalizer until its books
are closed), a finished run (charge, then TTL), and pods of attempts that ended.
"""

from __future__ import annotations

from tether.api.models import AttemptRecord, Outcome
from tether.core.accounting import charge_finished, release_due
from tether.core.actions import ClearLease, Decision, DeletePod, DeleteRun, ReleasePod, RemoveFinalizer
from tether.core.capability import Rules
from tether.core.lifecycle import StatusBuilder, revoke
from tether.core.observe import Observed, PodObservation

# The gateway mints tool-claim tokens for 10 minutes, and never once the run's status has moved on
# (the attempt's end); kube-apiserver accepts them a minute past expiry (JWT leeway) and caches a
# success for 10 s. An attempt that ended longer ago than that, plus a margin, has no live token.
TOOL_CLAIM_TOKEN_SECONDS = 600.0 + 60.0 + 10.0 + 50.0


def revocation_unfinished(o: Observed) -> bool:
    """Nobody holds the run, yet a revocation's later steps may be missing: the Lease still names
    a holder (interrupted after the status write), or an External attempt ended recently and this
    operator has not seen its tool-claim Secret deleted (interrupted after the Lease clear: the
    Secret's tokens work until it goes). ClearLease finishes both."""
    if o.lease is not None and o.lease.holder is not None:
        return True
    last = o.run.status.current()
    return (o.run.spec.executor == "External" and not o.tool_claims_cleared and last is not None
            and last.ended_at is not None and (o.now - last.ended_at).total_seconds() < TOOL_CLAIM_TOKEN_SECONDS)


def pods_may_run(o: Observed, d: Decision) -> bool:
    """Some pod of the run may still run (see PodObservation.may_still_run); if one was deleted,
    the decision wakes when it is given up on (its own events wake it sooner)."""
    running = [p for p in o.pods if p.may_still_run(o.now)]
    for pod in running:
        due = pod.given_up_in(o.now)
        if due is not None:
            d.wake(due)
    return bool(running)


# A pod of an attempt that already ended is left this long to exit on its own
# after success; failed or revoked attempts' pods are deleted at once.
POD_EXIT_GRACE_SECONDS = 30.0


def decide_deleting(o: Observed, d: Decision, capabilities: tuple[Rules, ...] = ()) -> None:
    """A deleted run (held by Tether's finalizer) ends its attempt, settles and charges its usage,
    releases its pods, lets each capability finish what it holds, and only then lets go."""
    s = o.run.status
    b = StatusBuilder(o)
    if s.holder is not None:
        outcome, message = ((Outcome.SUCCEEDED, "the holder published its result") if s.result is not None
                            else (Outcome.CANCELLED, "the WorkerRun is being deleted"))
        b.end_attempt(outcome, message)
        b.finish_after(outcome, message, None)
        d.actions.append(revoke(o, b, s.current()))
        return
    if revocation_unfinished(o):
        d.actions.append(ClearLease(fence=s.fence))
        return
    if b.settle_usage():
        d.actions.append(b.write())
        return
    # Charged in full and recorded on the run (budgetCharged) before the mark leaves the ledger,
    # so a retried deletion never charges twice.
    d.add(charge_finished(o))
    if d.actions:
        return
    d.add(release_due(o))
    if d.actions:
        return
    for pod in o.pods:
        if not pod.terminated and not pod.deleting:
            d.actions.append(DeletePod(pod.name))
        if pod.has_finalizer:
            d.actions.append(ReleasePod(pod.name))
    if d.actions:
        return
    if any(rules.deleting(o, d) for rules in capabilities):
        return
    d.actions.append(RemoveFinalizer())


def decide_finished(o: Observed, d: Decision) -> None:
    run, s = o.run, o.run.status
    if revocation_unfinished(o):
        # A crash between the status write and the last step. The books close only after it: the
        # cleared Lease holds the worker's final report, which settle_usage then records.
        d.actions.append(ClearLease(fence=s.fence))
        d.again()
        return
    b = StatusBuilder(o)
    if b.settle_usage():
        d.actions.append(b.write())
        return
    owed = charge_finished(o) or release_due(o)
    if owed is not None:
        d.actions.append(owed)
        return  # TTL waits until every cent is charged
    ttl = run.spec.ttl_seconds_after_finished
    if ttl is not None and s.finished_at is not None:
        # Seconds arithmetic, not finishedAt + ttl: a datetime that far out would overflow.
        due = ttl - (o.now - s.finished_at).total_seconds()
        if due <= 0:
            d.actions.append(DeleteRun())
        else:
            d.wake(due)


def record_exit_codes(o: Observed, d: Decision) -> bool:
    """An attempt ends when its pod is deleted, not when its containers stop: the next attempt need
    not wait out a grace period (fencing keeps the old worker harmless). The exit code comes later
    (143 for SIGTERM, 137 when the grace period ran out) and is added to the ended attempt's record
    here, while Tether's finalizer keeps the pod. True when it wrote."""
    by_attempt = {a.attempt: a for a in o.run.status.attempts}
    late = {pod.attempt: pod.exit_code for pod in o.pods
            if pod.has_finalizer and pod.terminated and pod.exit_code is not None
            and (record := by_attempt.get(pod.attempt)) is not None
            and record.ended_at is not None and record.exit_code is None}
    if not late:
        return False
    b = StatusBuilder(o)
    for record in b.status.attempts:
        if record.attempt in late:
            record.exit_code = late[record.attempt]
    d.actions.append(b.write())
    d.again()
    return True


def _exit_status_pending(o: Observed, pod: PodObservation, record: AttemptRecord | None) -> float | None:
    """Seconds left to wait for a deleted pod's exit status (see record_exit_codes), or None."""
    if record is None or record.exit_code is not None:
        return None
    left = pod.given_up_in(o.now)
    return left if left else None


def housekeep_pods(o: Observed, d: Decision) -> None:
    """Pods of attempts that no longer hold the run: delete the running ones, release the rest
    (a deleted one once its exit status is known)."""
    s = o.run.status
    by_attempt = {a.attempt: a for a in s.attempts}
    for pod in o.pods:
        if s.holder is not None and pod.attempt == s.attempt:
            continue
        record = by_attempt.get(pod.attempt)
        if pod.deleting and not pod.terminated and pod.has_finalizer and \
                (pending := _exit_status_pending(o, pod, record)) is not None:
            d.wake(pending)
            continue
        if not pod.terminated and not pod.deleting:
            ended_for = 0.0 if record is None or record.ended_at is None else (o.now - record.ended_at).total_seconds()
            succeeded = record is not None and record.outcome == Outcome.SUCCEEDED
            if succeeded and ended_for < POD_EXIT_GRACE_SECONDS:
                d.wake(POD_EXIT_GRACE_SECONDS - ended_for)
            else:
                d.actions.append(DeletePod(pod.name))
        elif pod.has_finalizer and (pod.terminated or pod.deleting):
            d.actions.append(ReleasePod(pod.name))
