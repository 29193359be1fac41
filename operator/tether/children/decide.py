"""Child runs in the pure decision (core.capability.Rules): before a child's first attempt, the
parent read fresh must show the attempt that spawned it still holding the parent, and the parent's
class and caps must allow it; the parent's ledger then admits it (one compare-and-swap on the
parent's status, children.actions.AdmitChild), or the child ends Rejected, nothing of it run. A
child whose parent ended, stops or is gone is stopped (with its stop grace) or cancelled; a child
that ended is settled into its parent's ledger once its books are closed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tether.api.models import Outcome, Phase, Usage, WorkerRun
from tether.api.workerclass import ClassBounds
from tether.children import ledger
from tether.children.api import ANN_CHILD_KEY, ANN_SUSPENDED_BY_PARENT
from tether.children.actions import AdmitChild, SettleChild, SuspendChild
from tether.core.actions import Decision, Event
from tether.core.capability import Rules
from tether.core.enforcement import Stop
from tether.core.cleanup import revocation_unfinished
from tether.core.lifecycle import StatusBuilder
from tether.core.observe import Observed

# A class that sets no bounds.maxChildren: its runs spawn at most this many (the CRD's maximum of
# status.children.live, so a parent's status stays small).
DEFAULT_MAX_CHILDREN = 100
MAX_DEPTH = 8

REASON_STALE_PARENT = "StaleParent"
REASON_PARENT_GONE = "ParentGone"
REASON_PARENT_MISMATCH = "ParentMismatch"
REASON_CLASS_NOT_ALLOWED = "ChildClassNotAllowed"
REASON_TOO_MANY = "TooManyChildren"
REASON_SHARE_REQUIRED = "ShareRequired"
REASON_TREE_BUDGET = "TreeBudgetExhausted"
REASON_BUDGET_MISMATCH = "BudgetMismatch"
REASON_PARENT_ENDED = "ParentEnded"


@dataclass(frozen=True)
class ParentRead:
    """A child's parent for this pass: read fresh (`body`, as the API server answered) before the
    child is admitted and when it is to be settled, else as the cache holds it. `parent` is None
    when no run of that name has the UID the child names (deleted, or a namesake)."""

    parent: WorkerRun | None
    body: dict[str, Any] | None
    fresh: bool
    bounds: ClassBounds | None = None  # the parent's class's, as the operator holds it; None: no class
    # What the parent's current attempt last reported on its Lease (as this operator saw it), which
    # its status folds in at a bounded rate: admission counts it.
    reported: Usage | None = None

    def knows_parent(self, attempt: int) -> bool:
        """Whether what it says of the parent can end the child: a fresh read, or the cache once the
        child was admitted or started (its parent was seen then; only a cached *absence* of a parent
        not yet seen could be the cache lagging, and that is read fresh)."""
        return self.fresh or self.parent is not None or attempt > 0


def parent_ended(parent: WorkerRun | None) -> str | None:
    """Why the children of `parent` must stop (None: they go on). A parent attempt that is lost is
    not a reason: its next attempt re-attaches to its children."""
    if parent is None:
        return "is gone"
    if parent.metadata.deletion_timestamp is not None:
        return "is being deleted"
    phase = parent.status.phase
    if phase is not None and phase.terminal:
        return f"ended {phase.value}"
    if parent.spec.stop:
        return "is stopping (spec.stop)"
    return None


def refusal(child: WorkerRun, read: ParentRead) -> tuple[str, str] | None:
    """(reason, message) when `child` may not be admitted into its parent's tree, judged on the
    parent read fresh; None when it may."""
    ref = child.spec.parent_ref
    parent = read.parent
    assert ref is not None
    if parent is None:
        return REASON_PARENT_GONE, f"parent WorkerRun {ref.name} (uid {ref.uid}) does not exist"
    s = parent.status
    if (s.holder, s.fence) != (ref.holder, ref.fence):
        now = f"{s.holder} at fence {s.fence}" if s.holder else "nobody"
        return REASON_STALE_PARENT, (f"spawned by {ref.holder} at fence {ref.fence}, which no longer holds "
                                     f"WorkerRun {ref.name} ({now} does): a stale attempt's child never runs")
    taken = s.class_.name if s.class_ is not None else None
    depth = (parent.spec.parent_ref.depth if parent.spec.parent_ref is not None else 0) + 1
    if ref.class_name != taken or ref.depth != depth:
        return REASON_PARENT_MISMATCH, (
            f"spec.parentRef says class {ref.class_name or 'none'} at depth {ref.depth}; parent {ref.name} is of "
            f"class {taken or 'none'}, so its children are at depth {depth}")
    # Only a run whose class lists what it may spawn spawns anything (a class the operator does not
    # know, deleted meanwhile, allows nothing: closed, not open).
    bounds = read.bounds
    if taken is None or bounds is None or not bounds.child_classes:
        why = (f"run {ref.name} has no WorkerClass" if taken is None else
               f"WorkerClass {taken} is not known to the operator" if bounds is None else
               f"WorkerClass {taken} lists no classes its runs may spawn")
        return REASON_CLASS_NOT_ALLOWED, f"{why}: only a run whose class sets bounds.childClasses spawns children"
    if child.spec.class_name not in bounds.child_classes:
        return REASON_CLASS_NOT_ALLOWED, (f"WorkerClass {taken} lets its runs spawn children of "
                                          f"{', '.join(bounds.child_classes)} only, not "
                                          f"{child.spec.class_name or 'none'}")
    if depth > min(bounds.max_depth or MAX_DEPTH, MAX_DEPTH):
        return REASON_PARENT_MISMATCH, f"a child at depth {depth} is deeper than its parent's class allows"
    most = bounds.max_children if bounds.max_children is not None else DEFAULT_MAX_CHILDREN
    t = ledger.ledger(parent)
    if t.admitted >= most:
        return REASON_TOO_MANY, (f"parent {ref.name} spawned {t.admitted} children, the most its class allows "
                                 f"({most}, bounds.maxChildren)")
    return _money(child, parent, read.reported)


def _money(child: WorkerRun, parent: WorkerRun, reported: Usage | None) -> tuple[str, str] | None:
    ref = child.spec.parent_ref
    assert ref is not None
    mine = parent.spec.budget.budget_ref if parent.spec.budget is not None else None
    theirs = child.spec.budget.budget_ref if child.spec.budget is not None else None
    if mine is not None and (theirs is None or theirs.name != mine.name):
        return REASON_BUDGET_MISMATCH, (f"parent {ref.name} draws on WorkerBudget {mine.name}; its children must "
                                        f"too (spec.budget.budgetRef), not {theirs.name if theirs else 'none'}")
    left_cents, left_tokens = ledger.tree_left(parent, reported)
    share = ledger.share_of(child)
    budget = child.spec.budget
    for kind, left, asked, field in (("cents", left_cents, share.cents, "capCents"),
                                     ("tokens", left_tokens, share.tokens, "maxTokens")):
        if left is None:
            continue
        if budget is None or (budget.cap_cents if kind == "cents" else budget.max_tokens) is None:
            return REASON_SHARE_REQUIRED, (f"parent {ref.name} has a cap in {kind}: a child names its share of the "
                                           f"tree in spec.budget.{field} ({max(left, 0)} left)")
        if asked > left:
            return REASON_TREE_BUDGET, (f"asks for {asked} {kind} (spec.budget.{field}); the tree of {ref.name} "
                                        f"has {max(left, 0)} left")
    return None


class ChildrenRules(Rules):
    name = "children"

    def enter(self, o: Observed, b: StatusBuilder, d: Decision) -> bool:
        ref = o.run.spec.parent_ref
        read = o.part(ParentRead)
        if ref is None or read is None:
            return True
        ended = parent_ended(read.parent)
        if ended is not None and read.knows_parent(o.run.status.attempt):
            _end_unheld(o, b, d, read, ended)
            return False
        if o.run.status.attempt > 0:
            return True  # admitted before its first attempt; a lost parent attempt changes nothing
        if read.parent is not None and ledger.live_entry(read.parent, o.run.metadata.uid) is not None:
            return True
        if not read.fresh:
            d.wake(1.0)  # the capability reads the parent fresh for an unadmitted child: next pass
            return False
        why = refusal(o.run, read)
        if why is not None:
            _end(b, d, Phase.REJECTED, *why)
            return False
        assert read.parent is not None and read.body is not None
        d.actions.append(AdmitChild(parent=read.parent.metadata.name, parent_uid=read.parent.metadata.uid,
                                    resource_version=read.parent.metadata.resource_version,
                                    children=ledger.admitted(read.parent, o.run)))
        d.again()
        return False

    def stop(self, o: Observed) -> Stop | None:
        ref, read = o.run.spec.parent_ref, o.part(ParentRead)
        if ref is None or read is None:
            return None
        ended = parent_ended(read.parent)
        return Stop(Outcome.CANCELLED, f"parent {ref.name} {ended}") if ended is not None else None

    def after(self, o: Observed, d: Decision) -> None:
        """An ended child whose books are closed (nothing else to do this pass: its last report
        settled, its Lease cleared; nobody holds it; its own children settled) moves from its parent's
        reserved to spent. A live one nobody holds whose parent ended is ended here too (a suspended
        run never reaches the gates), and a live one is suspended while its parent is (which reaches
        the grandchildren in turn), and resumed with it."""
        if d.actions or o.run.spec.parent_ref is None:
            return  # one write at a time: what follows comes on a pass with nothing else to do
        phase, s = o.run.status.phase, o.run.status
        if phase is not None and phase.terminal:
            if s.holder is None and not revocation_unfinished(o):
                _settle(o, d)
            return
        read = o.part(ParentRead)
        if read is None or not read.knows_parent(s.attempt):
            return
        ended = parent_ended(read.parent)
        if ended is not None:
            if s.holder is None:
                _end_unheld(o, StatusBuilder(o), d, read, ended)
            return  # a holder is stopped (Rules.stop)
        assert read.parent is not None
        mine = o.run.metadata.annotations.get(ANN_SUSPENDED_BY_PARENT) == "true"
        if read.parent.spec.suspend and not o.run.spec.suspend:
            d.actions.append(SuspendChild(suspend=True, resource_version=o.run.metadata.resource_version))
        elif not read.parent.spec.suspend and mine and o.run.spec.suspend:
            d.actions.append(SuspendChild(suspend=False, resource_version=o.run.metadata.resource_version))

    def deleting(self, o: Observed, d: Decision) -> bool:
        """A deleted child (its attempt ended, its books closed) leaves its parent's ledger before it
        goes: what it held returns to the tree, what it spent stays counted."""
        return _settle(o, d)


def _settle(o: Observed, d: Decision) -> bool:
    """Asks to settle the child into its parent's ledger, read fresh; True while that is to do."""
    read, run = o.part(ParentRead), o.run
    if read is None or read.parent is None or ledger.live_entry(read.parent, run.metadata.uid) is None:
        return False
    if not read.fresh or (run.status.children is not None and run.status.children.live):
        d.wake(5.0)  # its own children settle first (their spending is its subtree's); or read fresh
        return True
    children = ledger.settled(read.parent, run)
    assert children is not None
    spent = ledger.tree_spent(run)
    how = run.status.phase.value if run.status.phase is not None else "deleted"
    d.actions.append(SettleChild(parent=read.parent.metadata.name, parent_uid=read.parent.metadata.uid,
                                 resource_version=read.parent.metadata.resource_version, children=children,
                                 ended=f"child run {run.metadata.name} ({run.metadata.annotations.get(ANN_CHILD_KEY, '')}) "
                                       f"ended {how}, spent {spent.cents} cents and {spent.tokens} tokens"))
    return True


def _end_unheld(o: Observed, b: StatusBuilder, d: Decision, read: ParentRead, ended: str) -> None:
    """A child nobody holds whose parent ended: refused if it was never in the tree (as a stale
    spawn is), else cancelled."""
    ref = o.run.spec.parent_ref
    assert ref is not None
    message = f"parent WorkerRun {ref.name} {ended}: no attempt starts"
    admitted = read.parent is not None and ledger.live_entry(read.parent, o.run.metadata.uid) is not None
    if o.run.status.attempt == 0 and not admitted:
        _end(b, d, Phase.REJECTED, REASON_PARENT_GONE if read.parent is None else REASON_PARENT_ENDED, message)
    else:
        b.finish_after(Outcome.CANCELLED, message, None)
        d.actions.append(b.write())


def _end(b: StatusBuilder, d: Decision, phase: Phase, reason: str, message: str) -> None:
    b.set_phase(phase, message, reason=reason)
    b.events.append(Event("Warning", reason, message))
    d.actions.append(b.write())


RULES = ChildrenRules()
