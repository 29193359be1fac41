"""Child runs in the pure decision, by tables: what a child's first pass does with its parent read
fresh (admitted into the ledger, refused with the reason that says what to fix, or let through
once admitted), the parent's end reaching its children, the settlement of an ended child, and the
parent's caps counting what its children hold."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from tether.api.models import Phase, Usage, WorkerRun
from tether.api.workerclass import ClassBounds
from tether.children import ledger
from tether.children.actions import AdmitChild, SettleChild, SuspendChild
from tether.children.decide import RULES, ParentRead
from tether.core.actions import WriteStatus
from tether.core.decide import decide
from tether.core.enforcement import signals_for
from tests.unit.core.test_decide import T0, held, kinds, lease, observe, pod, run, status_of

PARENT_UID = "u-parent"


def parent(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None, **meta: Any) -> WorkerRun:
    body = {"metadata": {"name": "planner", "namespace": "ns", "uid": PARENT_UID, "resourceVersion": "41", **meta},
            "spec": {"executor": "External", **(spec or {})},
            "status": {**held(2, fence=3), "holder": "planner-a2", "class": {"name": "planners"}, **(status or {})}}
    return WorkerRun.model_validate(body)


def child(ref: dict[str, Any] | None = None, spec: dict[str, Any] | None = None,
          status: dict[str, Any] | None = None) -> WorkerRun:
    return run({"parentRef": {"name": "planner", "uid": PARENT_UID, "holder": "planner-a2", "fence": 3, "depth": 1,
                              "className": "planners", **(ref or {})}, "className": "search", **(spec or {})}, status,
               name="planner-0a1b2c3d4e", uid="u-child",
               labels={"tether.dev/parent": "planner"})


SEARCH = ClassBounds(child_classes=["search"])


def first_pass(c: WorkerRun, p: WorkerRun | None, bounds: ClassBounds | None = SEARCH, fresh: bool = True) -> Any:
    o = dataclasses.replace(observe(c), parts={ParentRead: ParentRead(parent=p, body={} if p else None, fresh=fresh,
                                                                      bounds=bounds)})
    return decide(o, (RULES,))


def test_a_child_spawned_by_the_parents_holder_is_admitted_into_its_ledger_then_granted() -> None:
    d = first_pass(child(spec={"budget": {"capCents": 40}}), parent({"budget": {"capCents": 100}}))
    (admit,) = d.actions
    assert isinstance(admit, AdmitChild) and admit.resource_version == "41" and d.again_now
    assert (admit.children.admitted, admit.children.reserved_cents) == (1, 40)
    assert [(e.uid, e.reserved_cents) for e in admit.children.live] == [("u-child", 40)]
    # Admitted: the next pass grants it, whatever the parent does meanwhile (a new attempt of it).
    p = parent({"budget": {"capCents": 100}}, {"children": admit.children.dump(), "holder": "planner-a3", "fence": 5})
    d = first_pass(child(spec={"budget": {"capCents": 40}}), p)
    assert kinds(d.actions) == ["WriteStatus", "EnsureLease", "EnsurePod"]


@pytest.mark.parametrize("ref, spec, parent_spec, parent_status, bounds, reason", [
    # The attempt that spawned it no longer holds the parent: revoked (a new holder), or between attempts.
    ({}, {}, {}, {"holder": "planner-a3", "fence": 5}, None, "StaleParent"),
    ({}, {}, {}, {"holder": None, "fence": 4, "phase": "Backoff"}, None, "StaleParent"),
    ({"fence": 1}, {}, {}, {}, None, "StaleParent"),
    # What it says of its parent is not so: another class (the admission policy judged the one it names), depth.
    ({"className": "tools"}, {}, {}, {}, SEARCH, "ParentMismatch"),
    ({"depth": 2}, {}, {}, {}, SEARCH, "ParentMismatch"),
    ({}, {"className": "shell"}, {}, {}, SEARCH, "ChildClassNotAllowed"),
    # Only a run whose class lists what it may spawn spawns: none listed, a class the operator does not
    # know (deleted meanwhile), no class at all.
    ({}, {}, {}, {}, ClassBounds(), "ChildClassNotAllowed"),
    ({}, {}, {}, {}, None, "ChildClassNotAllowed"),
    ({"className": None}, {}, {}, {"class": None}, SEARCH, "ChildClassNotAllowed"),
    ({}, {}, {}, {"children": {"admitted": 3}}, ClassBounds(child_classes=["search"], max_children=3), "TooManyChildren"),
    ({}, {}, {}, {"children": {"admitted": 100}}, SEARCH, "TooManyChildren"),
    # The tree's money: a capped parent's child names its share; the share must fit what is left.
    ({}, {}, {"budget": {"capCents": 100}}, {}, SEARCH, "ShareRequired"),
    ({}, {"budget": {"capCents": 62}}, {"budget": {"capCents": 100}},
     {"attempts": [{"attempt": 2, "fence": 3, "usage": {"cents": 30}}],
      "children": {"admitted": 1, "reservedCents": 5, "spentCents": 4}}, SEARCH, "TreeBudgetExhausted"),
    ({}, {"budget": {"capCents": 10}}, {"budget": {"budgetRef": {"name": "team"}}}, {}, SEARCH, "BudgetMismatch"),
])
def test_a_child_the_parent_may_not_have_ends_rejected_before_anything_of_it_runs(
        ref: dict[str, Any], spec: dict[str, Any], parent_spec: dict[str, Any], parent_status: dict[str, Any],
        bounds: ClassBounds | None, reason: str) -> None:
    d = first_pass(child(ref, spec), parent(parent_spec, parent_status), bounds)
    s = status_of(d.actions)
    assert kinds(d.actions) == ["WriteStatus"] and s.phase == Phase.REJECTED and s.attempt == 0
    assert next(c for c in s.conditions if c.type == "Ready").reason == reason  # what the SDK reads
    assert [e.reason for e in d.actions[0].events] == [reason]


def test_a_share_that_fits_exactly_is_admitted() -> None:
    p = parent({"budget": {"capCents": 100}}, {"attempts": [{"attempt": 2, "fence": 3, "usage": {"cents": 30}}],
                                              "children": {"admitted": 1, "reservedCents": 5, "spentCents": 4}})
    (admit,) = first_pass(child(spec={"budget": {"capCents": 61}}), p).actions[:1]
    assert isinstance(admit, AdmitChild) and admit.children.reserved_cents == 66


def test_a_child_whose_parent_is_gone_or_ended_never_starts() -> None:
    for p, reason in ((None, "ParentGone"), (parent(status={"phase": "Succeeded", "holder": None}), "ParentEnded"),
                      (parent({"stop": True}), "ParentEnded")):
        d = first_pass(child(), p)
        assert status_of(d.actions).phase == Phase.REJECTED and d.actions[0].events[0].reason == reason


def test_without_a_fresh_read_an_unadmitted_child_waits() -> None:
    d = first_pass(child(), parent(), fresh=False)
    assert d.actions == [] and d.requeue_after is not None


def test_a_running_child_is_stopped_with_its_grace_when_the_parent_ends_and_not_when_it_loses_an_attempt() -> None:
    running = child(status=held(1))
    for p, stopped in ((parent(status={"phase": "Failed", "holder": None}), True), (parent({"stop": True}), True),
                       (None, True), (parent(status={"holder": None, "phase": "Backoff"}), False)):
        o = dataclasses.replace(observe(running, lease()),
                                parts={ParentRead: ParentRead(parent=p, body=None, fresh=False)})
        d = decide(o, (RULES,))
        told = [json.loads(a.signals) for a in d.actions if isinstance(getattr(a, "signals", None), str)]
        assert any(t["stop"] for t in told) == stopped, (p and p.status.phase, d.actions)


def test_an_ended_child_is_settled_once_into_its_parents_ledger() -> None:
    admitted = ledger.admitted(parent(), child(spec={"budget": {"capCents": 40}}))
    p = parent({"budget": {"capCents": 100}}, {"children": admitted.dump()})
    done = child(spec={"budget": {"capCents": 40}}, status={
        "phase": "Succeeded", "attempt": 1, "fence": 2, "finishedAt": "2026-11-29T12:00:00Z",
        "attempts": [{"attempt": 1, "fence": 1, "outcome": "Succeeded", "usage": {"cents": 17, "tokens": 9}}]})
    o = dataclasses.replace(observe(done), parts={ParentRead: ParentRead(parent=p, body={}, fresh=True)})
    d = decide(o, (RULES,))
    (settle,) = [a for a in d.actions if isinstance(a, SettleChild)]
    t = settle.children
    assert (t.live, t.reserved_cents, t.spent_cents, t.spent_tokens, t.admitted) == ([], 0, 17, 9, 1)
    # Settled: nothing more to do, however often it is decided again.
    p = parent({"budget": {"capCents": 100}}, {"children": t.dump()})
    o = dataclasses.replace(o, parts={ParentRead: ParentRead(parent=p, body={}, fresh=True)})
    assert not [a for a in decide(o, (RULES,)).actions if isinstance(a, SettleChild)]


def test_a_parents_cap_counts_what_its_children_hold_and_spent() -> None:
    tree = {"admitted": 2, "reservedCents": 50, "spentCents": 30}
    # Own 20 + held 80 = the cap: a parent that only waits for its children is not stopped...
    p = run({"budget": {"capCents": 100}}, held(1, children=tree))
    o = observe(p, lease(usage=Usage(cents=20)))
    assert not any("cap of 100 cents" in str(a) for a in decide(o).actions)
    # ...its worker is told what the tree leaves it (the cap less what was spent and is held)...
    told = json.loads(signals_for(p.spec, p.status, None))
    assert (told["capCents"], told["baseCents"]) == (100, 80)
    # ...and spending past that stops it.
    o = observe(p, lease(usage=Usage(cents=21)))
    assert any("cap of 100 cents" in str(a) for a in decide(o).actions)


def test_a_deleted_child_leaves_its_parents_ledger_before_its_finalizer_goes() -> None:
    admitted = ledger.admitted(parent(), child(spec={"budget": {"capCents": 40}}))
    p = parent({"budget": {"capCents": 100}}, {"children": admitted.dump()})
    gone = child(spec={"budget": {"capCents": 40}}, status={
        "phase": "Cancelled", "attempt": 1, "fence": 2, "finishedAt": "2026-11-29T12:00:00Z", "budgetCharged": True,
        "attempts": [{"attempt": 1, "fence": 1, "outcome": "Cancelled", "usage": {"cents": 3}}]})
    gone = gone.model_copy(update={"metadata": gone.metadata.model_copy(update={
        "deletion_timestamp": T0, "finalizers": ["tether.dev/finalizer"]})})
    o = dataclasses.replace(observe(gone), parts={ParentRead: ParentRead(parent=p, body={}, fresh=True)})
    actions = decide(o, (RULES,)).actions
    (settle,) = [a for a in actions if isinstance(a, SettleChild)]
    assert (settle.children.live, settle.children.reserved_cents, settle.children.spent_cents) == ([], 0, 3)
    assert not [a for a in actions if type(a).__name__ == "RemoveFinalizer"]  # not before it is settled
    # Settled (or never admitted): its finalizer may go.
    o = dataclasses.replace(o, parts={ParentRead: ParentRead(parent=parent(status={"children": settle.children.dump()}),
                                                             body={}, fresh=True)})
    assert [type(a).__name__ for a in decide(o, (RULES,)).actions if type(a).__name__ == "RemoveFinalizer"]


def test_a_child_is_suspended_with_its_parent_and_resumed_with_it_unless_a_person_suspended_it() -> None:
    def after(c: WorkerRun, p: WorkerRun) -> list[Any]:
        """What the child's quiet pass asks (its own status writes applied first, as the next passes see them)."""
        for _ in range(3):
            o = dataclasses.replace(observe(c, lease(), pods=(pod(),)),
                                    parts={ParentRead: ParentRead(parent=p, body=None, fresh=False)})
            actions = decide(o, (RULES,)).actions
            writes = [a for a in actions if isinstance(a, WriteStatus)]
            if not writes:
                return [a for a in actions if isinstance(a, SuspendChild)]
            c = c.model_copy(update={"status": writes[0].status})
        raise AssertionError(f"no quiet pass: {actions}")

    running = child(status=held(1))
    assert after(running, parent({"suspend": True})) == [SuspendChild(suspend=True, resource_version="")]
    assert after(running, parent()) == []
    ours = child(spec={"suspend": True}, status=held(1))
    ours.metadata.annotations["tether.dev/suspended-by-parent"] = "true"
    assert after(ours, parent()) == [SuspendChild(suspend=False, resource_version="")]
    assert after(ours, parent({"suspend": True})) == []
    theirs = child(spec={"suspend": True}, status=held(1))  # a person's suspension stays
    assert after(theirs, parent()) == []


def test_an_ended_child_is_settled_only_once_its_last_report_is_in_its_books() -> None:
    """Review finding: a revocation interrupted after its status write (the Lease still names the
    attempt, with a later report) was settled in the same pass as the ClearLease, at the old usage."""
    admitted = ledger.admitted(parent(), child(spec={"budget": {"capCents": 40}}))
    p = parent({"budget": {"capCents": 100}}, {"children": admitted.dump()})
    done = child(spec={"budget": {"capCents": 40}}, status={
        "phase": "Succeeded", "attempt": 1, "fence": 2, "finishedAt": "2026-11-29T12:00:00Z",
        "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "outcome": "Succeeded",
                      "usage": {"cents": 17}}]})
    o = dataclasses.replace(observe(done, lease(fence=1, usage=Usage(cents=35))),
                            parts={ParentRead: ParentRead(parent=p, body={}, fresh=True)})
    actions = decide(o, (RULES,)).actions
    assert actions and not [a for a in actions if isinstance(a, SettleChild)], actions


def test_a_suspended_child_that_never_started_ends_with_its_parent() -> None:
    """Review finding: spec.suspend returns before the gates, so a suspended, unstarted child of an
    ended parent stayed Suspended, holding its reservation, for good."""
    admitted = ledger.admitted(parent(), child())
    ended = parent(status={"phase": "Failed", "holder": None, "children": admitted.dump()})
    for c, phase in ((child(spec={"suspend": True}), Phase.CANCELLED),  # admitted: cancelled
                     (child(spec={"suspend": True}, status={"phase": "Suspended"}), Phase.CANCELLED)):
        o = dataclasses.replace(observe(c), parts={ParentRead: ParentRead(parent=ended, body={}, fresh=True)})
        d = decide(o, (RULES,))
        if not any(isinstance(a, WriteStatus) and a.status.phase == phase for a in d.actions):
            # The first pass records the suspension; the next, with nothing else to do, ends it.
            c = c.model_copy(update={"status": status_of(d.actions)})
            o = dataclasses.replace(o, run=c)
            d = decide(o, (RULES,))
        assert status_of(d.actions).phase == phase, d.actions
    never = parent(status={"phase": "Failed", "holder": None})  # not in the tree: refused
    c = child(spec={"suspend": True}, status={"phase": "Suspended", "conditions": []})
    o = dataclasses.replace(observe(c), parts={ParentRead: ParentRead(parent=never, body={}, fresh=True)})
    d = decide(o, (RULES,))
    if not d.actions or status_of(d.actions).phase != Phase.REJECTED:
        o = dataclasses.replace(o, run=c.model_copy(update={"status": status_of(d.actions)}))
        d = decide(o, (RULES,))
    assert status_of(d.actions).phase == Phase.REJECTED


def test_an_admitted_child_read_from_the_cache_still_ends_with_its_parent() -> None:
    """Once admitted it is read from the cache until its first attempt: a cached parent that ended
    must end it there too, not let its grant through."""
    admitted = ledger.admitted(parent(), child())
    ended = parent(status={"phase": "Failed", "holder": None, "children": admitted.dump()})
    d = first_pass(child(), ended, fresh=False)
    assert kinds(d.actions) == ["WriteStatus"] and status_of(d.actions).phase == Phase.CANCELLED
    live = parent(status={"children": admitted.dump()})
    assert kinds(first_pass(child(), live, fresh=False).actions) == ["WriteStatus", "EnsureLease", "EnsurePod"]


def test_admission_counts_what_the_parents_worker_reported_since_its_last_fold() -> None:
    """Review finding: the parent's folded status said 30 spent while its Lease said 60; a child
    asking for 50 of the 70 the status left was admitted, and the tree went past its cap."""
    p = parent({"budget": {"capCents": 100}}, {"attempts": [{"attempt": 2, "fence": 3, "holder": "planner-a2",
                                                            "usage": {"cents": 30}}]})
    c = child(spec={"budget": {"capCents": 50}})
    read = ParentRead(parent=p, body={}, fresh=True, bounds=SEARCH, reported=Usage(cents=60))
    d = decide(dataclasses.replace(observe(c), parts={ParentRead: read}), (RULES,))
    assert status_of(d.actions).phase == Phase.REJECTED and d.actions[0].events[0].reason == "TreeBudgetExhausted"
    assert "has 40 left" in d.actions[0].events[0].message
    # What the status has already: nothing counted twice.
    read = dataclasses.replace(read, reported=Usage(cents=30))
    (admit,) = decide(dataclasses.replace(observe(c), parts={ParentRead: read}), (RULES,)).actions
    assert isinstance(admit, AdmitChild)
