"""Budget arithmetic, property-based: charges are exactly-once whatever order and repetition."""

from __future__ import annotations

import datetime as dt

from hypothesis import given, settings
from hypothesis import strategies as st

from tether.api.models import MAX_STATUS_NUMBER, ObjectMeta, Usage, WorkerBudget, WorkerBudgetSpec
from tether.core import budget as b

T0 = dt.datetime(2026, 11, 29, 12, tzinfo=dt.timezone.utc)


def _budget(limit: int | None = None, period: str = "None") -> WorkerBudget:
    return WorkerBudget(metadata=ObjectMeta(name="team", namespace="ns"),
                        spec=WorkerBudgetSpec(limit_cents=limit, limit_tokens=None, period=period))


# A run reports cumulative totals that only grow; the operator may charge any of them,
# in any order, any number of times (crashes, conflicts, retries).
reports = st.lists(st.tuples(st.sampled_from(["r1", "r2", "r3"]), st.integers(0, 500), st.integers(0, 5000)),
                   max_size=30)


@settings(max_examples=200, deadline=None)
@given(reports, st.randoms())
def test_spent_equals_sum_of_final_totals(charges: list[tuple[str, int, int]], rnd) -> None:  # type: ignore[no-untyped-def]
    budget = _budget(limit=10**9)
    final: dict[str, Usage] = {}
    totals: dict[str, Usage] = {}
    for run, cents, tokens in charges:
        prev = totals.get(run, Usage())
        totals[run] = Usage(cents=prev.cents + cents, tokens=prev.tokens + tokens)
    # Each run's totals as a rising sequence, charged with repetitions and stale replays.
    for run, cents, tokens in charges:
        final[run] = totals[run]
    sequence = []
    for run, total in final.items():
        steps = [Usage(cents=total.cents * k // 3, tokens=total.tokens * k // 3) for k in range(4)]
        sequence += [(run, s) for s in steps]
    rnd.shuffle(sequence)
    sequence += [(run, total) for run, total in final.items()]  # the last charge of every run
    sequence += sequence[: len(sequence) // 2]  # repeated after "crashes"
    for run, total in sequence:
        budget = budget.model_copy(update={"status": b.apply_charge(budget, f"uid-{run}", run, total, T0)})
    assert budget.status.spent.cents == sum(t.cents for t in final.values())
    assert budget.status.spent.tokens == sum(t.tokens for t in final.values())
    for run, total in final.items():
        assert b.charged(budget, f"uid-{run}") == total


@given(st.integers(0, 1000), st.integers(0, 1000))
def test_exhaustion_and_remaining(limit: int, spent: int) -> None:
    spec = WorkerBudgetSpec(limit_cents=limit)
    used = Usage(cents=spent, tokens=0)
    assert b.exhausted(spec, used) == (spent >= limit)
    assert b.remaining(spec, used).cents == max(0, limit - spent)


# An instant, a period and a zone (one with DST each side of the Atlantic).
PERIODIC = (st.datetimes(min_value=dt.datetime(2020, 1, 1), max_value=dt.datetime(2035, 1, 1),
                         timezones=st.just(dt.timezone.utc)),
            st.sampled_from(["Daily", "Weekly", "Monthly"]),
            st.sampled_from(["UTC", "Europe/Berlin", "America/New_York"]))


@given(*PERIODIC)
def test_period_start_contains_now(now: dt.datetime, period: str, zone: str) -> None:
    spec = WorkerBudgetSpec(period=period, time_zone=zone)  # type: ignore[arg-type]
    start = b.period_start(now, spec)
    assert start is not None and start <= now
    assert now - start < dt.timedelta(days=32)
    local = start.astimezone(b._zone(zone))
    assert (local.hour, local.minute) == (0, 0)
    if period == "Weekly":
        assert local.weekday() == 0
    if period == "Monthly":
        assert local.day == 1
    assert b.period_start(start, spec) == start  # idempotent


@given(*PERIODIC)
def test_next_period_start_is_the_first_instant_of_the_next_period(now: dt.datetime, period: str, zone: str) -> None:
    """It replaced an hour-by-hour search (up to ~744 zone conversions per reconcile)."""
    spec = WorkerBudgetSpec(period=period, time_zone=zone)  # type: ignore[arg-type]
    nxt = b.next_period_start(now, spec)
    assert nxt is not None and nxt > now
    assert b.period_start(nxt, spec) == nxt  # a period starts there
    assert b.period_start(nxt - dt.timedelta(microseconds=1), spec) == b.period_start(now, spec)  # none before
    assert b.next_period_start(now, WorkerBudgetSpec()) is None


def test_rollover_resets_spent_but_not_marks() -> None:
    budget = _budget(limit=100, period="Daily")
    status = b.apply_charge(budget, "u1", "r1", Usage(cents=80, tokens=0), T0)
    budget = budget.model_copy(update={"status": status})
    assert b.exhausted(budget.spec, budget.status.spent) is False
    status = b.apply_charge(budget, "u1", "r1", Usage(cents=120, tokens=0), T0)
    budget = budget.model_copy(update={"status": status})
    assert budget.status.spent.cents == 120 and b.exhausted(budget.spec, budget.status.spent)
    assert [c.status for c in budget.status.conditions if c.type == "Exhausted"] == ["True"]
    tomorrow = T0 + dt.timedelta(days=1)
    rolled = b.refresh(budget, tomorrow)
    assert rolled.spent.cents == 0 and rolled.charges["u1"].cents == 120
    budget = budget.model_copy(update={"status": b.apply_charge(budget, "u1", "r1", Usage(cents=130, tokens=0), tomorrow)})
    assert budget.status.spent.cents == 10  # only what is new is charged to the new period


def test_malformed_reports() -> None:
    assert b.valid_report(Usage(cents=-1, tokens=0), None) == "negative usage"
    assert b.valid_report(Usage(cents=5, tokens=0), Usage(cents=6, tokens=0)) is not None
    assert b.valid_report(Usage(cents=b.MAX_CENTS + 1, tokens=0), None) is not None
    assert b.valid_report(Usage(cents=6, tokens=1), Usage(cents=6, tokens=0)) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["r1", "r2", "r3"]), st.integers(0, 300), st.booleans()), max_size=30),
       st.lists(st.integers(1, 6), min_size=1, max_size=30))
def test_a_batch_settles_like_its_ops_one_by_one(ops: list[tuple[str, int, bool]], cuts: list[int]) -> None:
    """One write for many runs' charges (and releases) must leave the ledger exactly as the same
    ops written one at a time would, and say what each op added."""
    ledger = [b.LedgerOp(f"uid-{run}", run, None if release else Usage(cents=cents, tokens=cents))
              for run, cents, release in ops]
    one_by_one = batched = _budget(limit=10**9)
    added_one = []
    for op in ledger:
        before = one_by_one.status.spent
        status = b.release(one_by_one, op.run_uid, T0) if op.total is None else \
            b.apply_charge(one_by_one, op.run_uid, op.run_name, op.total, T0)
        one_by_one = one_by_one.model_copy(update={"status": status})
        added_one.append(Usage(cents=status.spent.cents - before.cents, tokens=status.spent.tokens - before.tokens))
    added_batched: list[Usage] = []
    i = 0
    for cut in cuts * 30:
        if i >= len(ledger):
            break
        status, added = b.settle(batched, ledger[i:i + cut], T0)
        batched, i = batched.model_copy(update={"status": status}), i + cut
        added_batched += added
    assert batched.status.dump() == one_by_one.status.dump()
    assert added_batched == added_one


def test_needs_refresh_is_what_refresh_would_change() -> None:
    budget = _budget(limit=100, period="Daily")
    assert b.needs_refresh(budget, T0)  # never refreshed
    fresh = budget.model_copy(update={"status": b.refresh(budget, T0)})
    assert not b.needs_refresh(fresh, T0)
    assert b.needs_refresh(fresh, T0 + dt.timedelta(days=1))  # a new period
    spent = fresh.model_copy(update={"status": b.apply_charge(fresh, "u", "r", Usage(cents=100), T0)})
    assert not b.needs_refresh(spent, T0)  # a charge writes remaining and Exhausted itself
    assert b.needs_refresh(spent.model_copy(update={"spec": WorkerBudgetSpec(limit_cents=500, period="Daily")}), T0)


# --- issue 34 (18): a limit the budget does not set is said by no number -----------------------


def test_remaining_names_only_the_limits_the_budget_sets() -> None:
    # Was remaining.tokens: 9007199254740991 for a budget without limitTokens (and cents alike).
    cents_only = _budget(limit=100)
    status = b.refresh(cents_only, T0)
    assert status.dump()["remaining"] == {"cents": 100}
    tokens_only = WorkerBudget(metadata=ObjectMeta(name="team", namespace="ns"),
                               spec=WorkerBudgetSpec(limit_tokens=5000))
    assert b.refresh(tokens_only, T0).dump()["remaining"] == {"tokens": 5000}
    spent = cents_only.model_copy(update={"status": b.apply_charge(cents_only, "u", "r", Usage(cents=30, tokens=10**9),
                                                                   T0)})
    assert spent.status.dump()["remaining"] == {"cents": 70}


def test_a_status_that_names_an_unset_limit_is_refreshed_without_it() -> None:
    """A budget written by an operator before this fix says the old number until refreshed."""
    budget = _budget(limit=100)
    old = {**b.refresh(budget, T0).dump(), "remaining": {"cents": 100, "tokens": MAX_STATUS_NUMBER}}
    stale = WorkerBudget.model_validate({**budget.dump(), "status": old})
    assert b.needs_refresh(stale, T0)
    assert b.refresh(stale, T0).dump()["remaining"] == {"cents": 100}
