"""Budget arithmetic: periods, charges, exhaustion. Pure; tested with hypothesis.

Charging is idempotent by construction: a budget remembers, per run, the total
it has charged for that run, and a charge adds only the difference between
the run's reported total and that mark. Repeating a charge (after a crash,
a conflict, a retry) adds nothing; a total lower than the mark is refused.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Sequence
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from tether.api.conditions import set_condition
from tether.api.models import (
    MAX_STATUS_NUMBER,
    Charge,
    Remaining,
    Usage,
    WorkerBudget,
    WorkerBudgetSpec,
    WorkerBudgetStatus,
)
from tether.protocol import MAX_CENTS, MAX_TOKENS, valid_report  # noqa: F401  (re-exported: one definition)


# Condition of a budget whose spec.timeZone is no IANA zone (the CRD cannot tell): said, never silent.
COND_TIME_ZONE = "TimeZoneValid"
REASON_UNKNOWN_TIME_ZONE = "UnknownTimeZone"


def _zone(name: str) -> dt.tzinfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return dt.timezone.utc


def time_zone_problem(spec: WorkerBudgetSpec) -> str | None:
    """Why spec.timeZone cannot be used (periods then start at midnight UTC), or None."""
    try:
        ZoneInfo(spec.time_zone)
        return None
    except (ZoneInfoNotFoundError, ValueError):
        return (f"timeZone {spec.time_zone!r} is not an IANA time zone (e.g. Europe/Berlin): periods start at "
                "midnight UTC until it is fixed")


def period_start(now: dt.datetime, spec: WorkerBudgetSpec) -> dt.datetime | None:
    """Start of the period containing `now` (midnight in the budget's zone), or None."""
    if spec.period == "None":
        return None
    local = now.astimezone(_zone(spec.time_zone))
    day = local.replace(hour=0, minute=0, second=0, microsecond=0)
    if spec.period == "Weekly":
        day = day - dt.timedelta(days=day.weekday())
    elif spec.period == "Monthly":
        day = day.replace(day=1)
    # Rebuild through the zone so a DST change between day start and now is honoured.
    start = dt.datetime(day.year, day.month, day.day, tzinfo=_zone(spec.time_zone))
    return start.astimezone(dt.timezone.utc)


def next_period_start(now: dt.datetime, spec: WorkerBudgetSpec) -> dt.datetime | None:
    """Start of the period after the one containing `now` (local midnight), or None."""
    start = period_start(now, spec)
    if start is None:
        return None
    zone = _zone(spec.time_zone)
    day = start.astimezone(zone).date()
    if spec.period == "Monthly":
        day = (day.replace(day=28) + dt.timedelta(days=4)).replace(day=1)
    else:
        day = day + dt.timedelta(days=7 if spec.period == "Weekly" else 1)
    return dt.datetime(day.year, day.month, day.day, tzinfo=zone).astimezone(dt.timezone.utc)


def remaining(spec: WorkerBudgetSpec, spent: Usage) -> Remaining:
    """What is left of each limit the budget sets; None for a limit it does not set (unlimited)."""
    return Remaining(cents=None if spec.limit_cents is None else max(0, spec.limit_cents - spent.cents),
                     tokens=None if spec.limit_tokens is None else max(0, spec.limit_tokens - spent.tokens))


def exhausted(spec: WorkerBudgetSpec, spent: Usage) -> bool:
    return (spec.limit_cents is not None and spent.cents >= spec.limit_cents) or \
        (spec.limit_tokens is not None and spent.tokens >= spec.limit_tokens)


def refresh(budget: WorkerBudget, now: dt.datetime) -> WorkerBudgetStatus:
    """Status with the period rolled over if due, remaining and the Exhausted condition recomputed."""
    spec = budget.spec
    status = budget.status.clone()
    start = period_start(now, spec)
    if start is not None and (status.period_start is None or status.period_start < start):
        # A new period: spending starts over. Per-run marks stay, so usage charged
        # before the rollover is never charged again.
        status.spent = Usage()
        status.period_start = start
    status.remaining = remaining(spec, status.spent)
    gen = budget.metadata.generation
    status.observed_generation = gen
    if exhausted(spec, status.spent):
        status.conditions = set_condition(status.conditions, "Exhausted", "True", "LimitReached",
                                          "the limit for this period is reached", gen, now)
    else:
        status.conditions = set_condition(status.conditions, "Exhausted", "False", "WithinLimit",
                                          "spending is within the limit", gen, now)
    problem = time_zone_problem(spec)
    if problem is not None:
        status.conditions = set_condition(status.conditions, COND_TIME_ZONE, "False", REASON_UNKNOWN_TIME_ZONE,
                                          problem, gen, now)
    else:  # only a wrong zone is worth a condition
        status.conditions = [c for c in status.conditions if c.type != COND_TIME_ZONE]
    return status


@dataclass(frozen=True)
class LedgerOp:
    """One change to a budget's ledger: charge a run's whole usage so far (`total`), or drop its
    mark (`total` None). `base` is what the run recorded as charged when its mark left the ledger."""

    run_uid: str
    run_name: str
    total: Usage | None
    base: Usage | None = None


def settle(budget: WorkerBudget, ops: Sequence[LedgerOp], now: dt.datetime) -> tuple[WorkerBudgetStatus, list[Usage]]:
    """Applies ops in order to one copy of the status: a batch of charges is one write. Each
    charge adds what its total adds beyond the run's mark (without a mark, beyond `base`).
    Returns the status and what each op newly charged."""
    status = refresh(budget, now)
    added: list[Usage] = []
    for op in ops:
        if op.total is None:
            status.charges.pop(op.run_uid, None)  # what it was charged stays in `spent`
            added.append(Usage())
            continue
        start = op.base or Usage()
        mark = status.charges.get(op.run_uid, Charge(run=op.run_name, cents=start.cents, tokens=start.tokens))
        delta = Usage(cents=max(0, op.total.cents - mark.cents), tokens=max(0, op.total.tokens - mark.tokens))
        status.charges[op.run_uid] = Charge(run=op.run_name, cents=max(mark.cents, op.total.cents),
                                            tokens=max(mark.tokens, op.total.tokens))
        # Saturates at the CRD's maximum (far past any limit, so exhaustion is unchanged).
        status.spent = Usage(cents=min(status.spent.cents + delta.cents, MAX_STATUS_NUMBER),
                             tokens=min(status.spent.tokens + delta.tokens, MAX_STATUS_NUMBER))
        added.append(delta)
    return refresh(budget.model_copy(update={"status": status}), now), added


def apply_charge(budget: WorkerBudget, run_uid: str, run_name: str, total: Usage,
                 now: dt.datetime, base: Usage | None = None) -> WorkerBudgetStatus:
    """Charges what `total` (the run's whole usage so far) adds beyond the run's mark; without a
    mark, beyond `base` (what the run recorded as charged when its mark left the ledger)."""
    return settle(budget, [LedgerOp(run_uid, run_name, total, base)], now)[0]


def release(budget: WorkerBudget, run_uid: str, now: dt.datetime) -> WorkerBudgetStatus:
    """The ledger without the run's mark (the run is charged in full and says so itself);
    what it was charged stays in `spent`."""
    return settle(budget, [LedgerOp(run_uid, "", None)], now)[0]


def needs_refresh(budget: WorkerBudget, now: dt.datetime) -> bool:
    """Whether refresh() would change the status: a charge's own write needs no second one."""
    status, spec = budget.status, budget.spec
    start = period_start(now, spec)
    if start is not None and (status.period_start is None or status.period_start < start):
        return True
    want = "True" if exhausted(spec, status.spent) else "False"
    have = next((c.status for c in status.conditions if c.type == "Exhausted"), None)
    zone_said = any(c.type == COND_TIME_ZONE for c in status.conditions)
    return status.remaining != remaining(spec, status.spent) or \
        status.observed_generation != budget.metadata.generation or have != want or \
        zone_said != (time_zone_problem(spec) is not None)


def charged(budget: WorkerBudget, run_uid: str) -> Usage:
    mark = budget.status.charges.get(run_uid)
    return Usage(cents=mark.cents, tokens=mark.tokens) if mark else Usage()
