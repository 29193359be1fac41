"""The tree's ledger, pure: a parent's status.children, what a child may be admitted with, and what
a child's end moves from reserved to spent. Each change is one compare-and-swap on the parent's
status (children/capability.py), so a child is admitted once and settled once, whatever crashes."""

from __future__ import annotations

from tether.api.models import MAX_STATUS_NUMBER, ChildEntry, ChildrenStatus, Usage, WorkerRun
from tether.core.accounting import attempts_usage, sum_usage, tree_held


def ledger(parent: WorkerRun) -> ChildrenStatus:
    return parent.status.children.clone() if parent.status.children is not None else ChildrenStatus()


def live_entry(parent: WorkerRun, child_uid: str) -> ChildEntry | None:
    t = parent.status.children
    return next((e for e in t.live if e.uid == child_uid), None) if t is not None else None


def own_spending(parent: WorkerRun, reported: Usage | None = None) -> Usage:
    """What the parent itself spent: its attempts as its status has them, its current attempt at
    least what its worker last reported on its Lease (folded into the status at a bounded rate)."""
    folded = attempts_usage(parent.status)
    cur = parent.status.current()
    if reported is None or cur is None or cur.outcome is not None:
        return folded
    had = cur.usage or Usage()
    return Usage(cents=folded.cents + max(0, reported.cents - had.cents),
                 tokens=folded.tokens + max(0, reported.tokens - had.tokens))


def tree_left(parent: WorkerRun, reported: Usage | None = None) -> tuple[int | None, int | None]:
    """(cents, tokens) the parent's caps leave for a new child: its cap, less its own spending
    (`reported`: its current attempt's latest report), less what its children hold. None: no such cap."""
    budget = parent.spec.budget
    own, held = own_spending(parent, reported), tree_held(parent.status)
    cap_cents = budget.cap_cents if budget is not None else None
    cap_tokens = budget.max_tokens if budget is not None else None
    return (None if cap_cents is None else cap_cents - own.cents - held.cents,
            None if cap_tokens is None else cap_tokens - own.tokens - held.tokens)


def share_of(child: WorkerRun) -> Usage:
    """What a child reserves of its tree: its own caps (a missing cap reserves nothing of that kind)."""
    budget = child.spec.budget
    return Usage(cents=(budget.cap_cents or 0) if budget is not None else 0,
                 tokens=(budget.max_tokens or 0) if budget is not None else 0)


def admitted(parent: WorkerRun, child: WorkerRun) -> ChildrenStatus:
    """The parent's ledger with `child` admitted (it must not be live in it already)."""
    t, share = ledger(parent), share_of(child)
    t.admitted += 1
    t.reserved_cents = min(t.reserved_cents + share.cents, MAX_STATUS_NUMBER)
    t.reserved_tokens = min(t.reserved_tokens + share.tokens, MAX_STATUS_NUMBER)
    t.live.append(ChildEntry(name=child.metadata.name, uid=child.metadata.uid, reserved_cents=share.cents,
                             reserved_tokens=share.tokens))
    return t


def tree_spent(run: WorkerRun) -> Usage:
    """What a run and its whole subtree spent: its attempts, and its children that ended."""
    t = run.status.children
    return sum_usage([attempts_usage(run.status), Usage(cents=t.spent_cents, tokens=t.spent_tokens) if t else None])


def settled(parent: WorkerRun, child: WorkerRun) -> ChildrenStatus | None:
    """The parent's ledger with the ended `child` settled: its reservation released, what its
    subtree spent counted; None when it is not live there (settled before, or never admitted)."""
    entry = live_entry(parent, child.metadata.uid)
    if entry is None:
        return None
    t, spent = ledger(parent), tree_spent(child)
    t.live = [e for e in t.live if e.uid != entry.uid]
    t.reserved_cents = max(0, t.reserved_cents - entry.reserved_cents)
    t.reserved_tokens = max(0, t.reserved_tokens - entry.reserved_tokens)
    t.spent_cents = min(t.spent_cents + spent.cents, MAX_STATUS_NUMBER)
    t.spent_tokens = min(t.spent_tokens + spent.tokens, MAX_STATUS_NUMBER)
    return t
