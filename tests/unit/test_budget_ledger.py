"""The budget's ledger is bounded by live runs: a run charged in full, and saying so in its own
status, leaves the ledger; nothing it did is charged again, whatever snapshot a pass acts on."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from tether.api.models import ObjectMeta, Usage, WorkerBudget, WorkerBudgetSpec, WorkerRun
from tether.controller.budgets import BudgetBook
from tether.core import budget as b
from tether.core.decide import BudgetObservation, ChargeBudget, Observed, ReleaseCharge, WriteStatus, decide

T0 = dt.datetime(2026, 11, 30, 12, tzinfo=dt.timezone.utc)


def _run(status: dict[str, Any]) -> WorkerRun:
    return WorkerRun.model_validate({
        "metadata": {"name": "job", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": {"executor": "External", "budget": {"budgetRef": {"name": "team"}},
                 "lease": {"durationSeconds": 20, "renewIntervalSeconds": 5}},
        "status": {"phase": "Succeeded", "attempt": 1, "fence": 2, "usage": {"cents": 7, "tokens": 0},
                   "finishedAt": T0.isoformat(), "attempts": [], **status}})


def _decide(status: dict[str, Any], budget: BudgetObservation) -> list[Any]:
    return decide(Observed(run=_run(status), lease=None, pods=(), now=T0, mono=100.0, budget=budget)).actions


def test_a_finished_run_is_charged_then_says_so_then_leaves_the_ledger() -> None:
    assert _decide({}, BudgetObservation(name="team", charged=Usage(cents=3), marked=True)) == \
        [ChargeBudget(budget="team", total=Usage(cents=7))]
    recorded = _decide({}, BudgetObservation(name="team", charged=Usage(cents=7), marked=True))
    assert len(recorded) == 1 and isinstance(recorded[0], WriteStatus) and recorded[0].status.budget_charged
    assert _decide({"budgetCharged": True}, BudgetObservation(name="team", charged=Usage(cents=7), marked=True)) == \
        [ReleaseCharge(budget="team")]
    # Released: no mark, and the run's own record says it is charged in full: nothing is owed.
    assert _decide({"budgetCharged": True}, BudgetObservation(name="team")) == []


def test_release_drops_the_mark_and_keeps_what_was_spent() -> None:
    budget = WorkerBudget(metadata=ObjectMeta(name="team", namespace="ns"), spec=WorkerBudgetSpec(limit_cents=100))
    for uid, cents in (("u-1", 7), ("u-2", 5)):
        budget = budget.model_copy(update={"status": b.apply_charge(budget, uid, uid, Usage(cents=cents), T0)})
    released = b.release(budget, "u-1", T0)
    assert set(released.charges) == {"u-2"} and released.spent == Usage(cents=12)
    assert released.remaining is not None and released.remaining.cents == 88


class _Kube:
    """The budget as the API server holds it; counts status writes."""

    def __init__(self, charges: dict[str, Any]) -> None:
        self.body = {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget",
                     "metadata": {"name": "team", "namespace": "ns", "resourceVersion": "1"},
                     "spec": {"limitCents": 100},
                     "status": {"spent": {"cents": 7, "tokens": 0}, "charges": charges}}
        self.writes = 0

    async def get_budget(self, ns: str, name: str) -> dict[str, Any]:
        return self.body

    async def replace_budget_status(self, body: dict[str, Any]) -> dict[str, Any]:
        self.writes += 1
        self.body = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.writes + 1)}}
        return self.body


def test_an_unmarked_charge_goes_ahead_only_when_a_fresh_read_says_the_run_is_not_charged_yet() -> None:
    """A pass acting on a snapshot from before budgetCharged (a watch event older than the
    operator's own write) would charge a released run's whole usage again."""
    run = _run({})

    async def charge(kube: _Kube, fresh_says_charged: bool) -> Usage | None:
        async def not_yet_charged() -> bool:
            return not fresh_says_charged
        book = BudgetBook(kube, lambda: T0)  # type: ignore[arg-type]
        return await book.charge(run, "team", Usage(cents=7), not_yet_charged)

    released = _Kube(charges={})
    assert asyncio.run(charge(released, fresh_says_charged=True)) is None
    assert released.writes == 0 and released.body["status"]["spent"]["cents"] == 7  # not charged twice
    new = _Kube(charges={})
    assert asyncio.run(charge(new, fresh_says_charged=False)) == Usage(cents=7)
    assert new.body["status"]["spent"]["cents"] == 14 and "u-1" in new.body["status"]["charges"]
    marked = _Kube(charges={"u-1": {"run": "job", "cents": 3, "tokens": 0}})
    # A run with a mark needs no read: the mark makes the charge idempotent.
    assert asyncio.run(charge(marked, fresh_says_charged=True)) == Usage(cents=4)
