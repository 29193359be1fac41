"""Usage bookkeeping: what a run has spent, when the worker's reports reach its status (folds,
at a bounded rate), settling the last report that arrived during a revocation, and charging
the budget so that every cent is charged exactly once.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from tether.api.models import MAX_ATTEMPT_HISTORY, MAX_STATUS_NUMBER, Checkpoint, Usage, WorkerRunStatus
from tether.core.actions import Action, ChargeBudget, Change, ReleaseCharge, WriteStatus
from tether.core.observe import Observed, current_lease

# status.checkpoint.cursor's maxLength in the CRD. Lease annotations admit far longer values, and
# a status write carrying one would be refused (422) on every pass.
MAX_CURSOR_LENGTH = 1024


def sum_usage(items: Iterable[Usage | None]) -> Usage:
    cents = tokens = 0
    for u in items:
        if u is not None:
            cents += u.cents
            tokens += u.tokens
    # Saturates at the CRD's maximum: 100 attempts of the largest plausible report exceed it,
    # and a status carrying more would be refused on every write.
    return Usage(cents=min(cents, MAX_STATUS_NUMBER), tokens=min(tokens, MAX_STATUS_NUMBER))


def earlier_usage(s: WorkerRunStatus) -> Usage:
    """What attempts that already ended reported (those trimmed from the history included)."""
    return sum_usage([s.trimmed_usage, *(a.usage for a in s.attempts if a.outcome is not None)])


def attempts_usage(s: WorkerRunStatus) -> Usage:
    """What every attempt recorded, trimmed ones included: the run's status.usage."""
    return sum_usage([s.trimmed_usage, *(a.usage for a in s.attempts)])


def tree_held(s: WorkerRunStatus) -> Usage:
    """What a parent's children hold of its caps (status.children): the caps of the live ones and
    what the ended ones spent. The parent's own spending has the rest (docs/children.md)."""
    t = s.children
    if t is None:
        return Usage()
    return sum_usage([Usage(cents=t.reserved_cents, tokens=t.reserved_tokens),
                      Usage(cents=t.spent_cents, tokens=t.spent_tokens)])


def keep_history(s: WorkerRunStatus, limit: int = MAX_ATTEMPT_HISTORY) -> None:
    """Bounds the attempt history to `limit` records, moving what a dropped attempt spent into
    status.trimmedUsage. Only ended attempts are dropped (the newest, which settling may still
    raise, always stays)."""
    drop = len(s.attempts) - max(1, min(limit, MAX_ATTEMPT_HISTORY))
    if drop > 0:
        s.trimmed_usage = sum_usage([s.trimmed_usage, *(a.usage for a in s.attempts[:drop])])
        s.attempts = s.attempts[drop:]


def run_usage(o: Observed) -> Usage:
    """Everything the run has reported: ended attempts plus the current one's latest report."""
    lease = current_lease(o)
    return sum_usage([earlier_usage(o.run.status), lease.usage if lease is not None else None])


def reported_cursor(o: Observed) -> str | None:
    """The checkpoint on the Lease, or the one already recorded when the Lease has none or one
    too long to record (ignored like a malformed usage report)."""
    recorded = o.run.status.checkpoint.cursor if o.run.status.checkpoint else None
    cursor = o.lease.checkpoint if o.lease is not None else None
    return cursor if cursor and len(cursor) <= MAX_CURSOR_LENGTH else recorded


def unfolded(o: Observed, total: Usage) -> bool:
    """The Lease reports usage or a checkpoint the run's status does not show yet."""
    s = o.run.status
    return total != (s.usage or Usage()) or reported_cursor(o) != (s.checkpoint.cursor if s.checkpoint else None)


def fold_wait(o: Observed) -> float:
    """Seconds until the next fold may be written (<= 0: now). Heartbeats cost no WorkerRun
    writes: what they report reaches the status at most once per fold interval."""
    folded_at = o.run.status.folded_at
    return 0.0 if folded_at is None else o.fold_interval - (o.now - folded_at).total_seconds()


def settle_usage(o: Observed, s: WorkerRunStatus, now: dt.datetime) -> bool:
    """Picks up what the last holder reported between the revocation's status write and the
    lease being cleared: the cleared lease keeps its final usage report and checkpoint, and
    nothing is written after it (a grant drops both from the Lease). Updates `s`; returns True
    when it changed."""
    last = s.attempts[-1] if s.attempts else None
    lease = o.lease
    if s.holder is not None or last is None or last.outcome is None or lease is None or \
            lease.holder is not None or lease.fence != s.fence:
        return False
    changed = False
    cursor = reported_cursor(o)
    if cursor and (s.checkpoint is None or s.checkpoint.cursor != cursor):
        s.checkpoint = Checkpoint(cursor=cursor, time=now)
        changed = True
    have = last.usage or Usage()
    if lease.usage is not None and (lease.usage.cents > have.cents or lease.usage.tokens > have.tokens):
        last.usage = Usage(cents=max(have.cents, lease.usage.cents), tokens=max(have.tokens, lease.usage.tokens))
        s.usage = attempts_usage(s)
        changed = True
    return changed


def charged_so_far(o: Observed) -> Usage:
    """What the budget holds for this run: its mark, or, once the mark left the ledger, what the
    run recorded (status.charged) before it did."""
    mark = o.budget.charged if o.budget is not None else Usage()  # zero without a mark
    recorded = o.run.status.charged or Usage()
    return Usage(cents=max(mark.cents, recorded.cents), tokens=max(mark.tokens, recorded.tokens))


def _covers(charged: Usage, total: Usage) -> bool:
    return charged.cents >= total.cents and charged.tokens >= total.tokens


def charge_due(o: Observed, total: Usage | None) -> ChargeBudget | None:
    """A charge of the run's total, if its budget has not seen all of it yet."""
    b = o.budget
    if b is None or b.missing or total is None or _covers(charged_so_far(o), total):
        return None
    return ChargeBudget(budget=b.name, total=total)


def charge_finished(o: Observed) -> Action | None:
    """What a finished run still owes its budget: a charge until the budget has every cent, then
    one status write recording that and the amount (the TTL waits for it). None: nothing is owed."""
    run, s = o.run, o.run.status
    if run.spec.budget is None or run.spec.budget.budget_ref is None or o.budget is None or \
            o.budget.missing or s.budget_charged:
        return None
    total = s.usage or Usage()
    charged = charged_so_far(o)
    if _covers(charged, total):
        status = s.clone()
        status.budget_charged = True
        status.charged = Usage(cents=max(charged.cents, total.cents), tokens=max(charged.tokens, total.tokens))
        return WriteStatus(status=status, change=Change.BUDGET_CHARGED)
    return ChargeBudget(budget=o.budget.name, total=total)


def release_due(o: Observed) -> ReleaseCharge | None:
    """A run charged in full, with the amount on its own status, leaves the budget's ledger: the
    ledger's size follows the live runs, not the history. A charge after that (late usage
    settled) starts from status.charged, so nothing is charged twice."""
    b, s = o.budget, o.run.status
    if b is None or b.missing or not b.marked or not s.budget_charged or s.charged is None:
        return None
    if not _covers(s.charged, b.charged):
        return None  # the mark holds more than the run recorded: record it first (charge_finished)
    return ReleaseCharge(budget=b.name)
