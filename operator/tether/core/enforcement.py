"""Limits and the control channel: the run's deadline (endsAt), its caps and its budget, the
stop they cause, admission, and the signals the worker reads on every renewal.

Cap arithmetic is the protocol's (`tether.protocol.cap_remaining`), so the operator, the SDK
and the gateway agree on what is left of a cap.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from tether import protocol
from tether.api import constants as c
from tether.api.models import GateDecision, Outcome, Signals, Usage, WorkerRunSpec, WorkerRunStatus
from tether.core.accounting import earlier_usage, run_usage, sum_usage, tree_held
from tether.core.actions import UsageAlarm
from tether.core.clock import after
from tether.core.observe import Observed


def run_ends_at(spec: WorkerRunSpec, started_at: dt.datetime | None) -> dt.datetime | None:
    """status.endsAt as spec.deadlineSeconds says now: deadlineSeconds is a control field, so a
    changed deadline moves endsAt (counted from the first grant), and a removed one clears it."""
    deadline = spec.deadline_seconds
    return None if started_at is None or not deadline else after(started_at, deadline)


def over_limit(o: Observed, total: Usage) -> tuple[str, Usage] | None:
    """(why, overspend) when the run's cap or its budget is reached. `why` goes onto the Lease as
    the stop reason, so it names the limit, not the live total (which would rewrite the Lease
    on every heartbeat)."""
    budget = o.run.spec.budget
    if budget is not None:
        # A parent's cap is its tree's: what its children hold of it is not the parent's to spend.
        # Held, not spent: a parent whose children hold the rest waits for them, and is stopped
        # only once its own spending goes past what they leave it.
        tree, live = tree_held(o.run.status), o.run.status.children
        waits_cents = live is not None and live.reserved_cents > 0  # children hold some of it still
        waits_tokens = live is not None and live.reserved_tokens > 0
        left = protocol.cap_remaining(budget.cap_cents, tree.cents, total.cents)
        if left is not None and (left < 0 or (left == 0 and not waits_cents)):
            return f"cap of {budget.cap_cents} cents reached", Usage(cents=-left, tokens=0)
        left = protocol.cap_remaining(budget.max_tokens, tree.tokens, total.tokens)
        if left is not None and (left < 0 or (left == 0 and not waits_tokens)):
            return f"cap of {budget.max_tokens} tokens reached", Usage(cents=0, tokens=-left)
    b = o.budget
    if b is not None and not b.missing:
        # Only what the budget has not been charged yet draws on what it has left; a limit the
        # budget does not set is never reached.
        over_c = _over(total.cents - b.charged.cents, b.remaining.cents)
        over_t = _over(total.tokens - b.charged.tokens, b.remaining.tokens)
        if b.exhausted or over_c is not None or over_t is not None:
            return f"WorkerBudget {b.name} is exhausted", Usage(cents=over_c or 0, tokens=over_t or 0)
    return None


def _over(uncharged: int, left: int | None) -> int | None:
    """How far `uncharged` goes past what is `left` of a budget's limit (0 when it just reaches
    it), or None while it stays under it or the budget sets no such limit."""
    if left is None:
        return None
    over = max(0, uncharged) - left
    return over if over >= 0 else None


@dataclass(frozen=True)
class Stop:
    """Why the holder must stop: first told on its Lease, then revoked after stopGraceSeconds."""

    outcome: Outcome  # Cancelled (spec.stop), BudgetExceeded, or Preempted (a queue took the run's place back)
    reason: str
    overspend: Usage | None = None  # beyond the cap or budget, for BudgetExceeded
    eviction: str | None = None  # the queue's reason, for Preempted


def pauses(spec: WorkerRunSpec) -> bool:
    """Whether reaching a cap or the budget pauses the run rather than ending it."""
    return spec.budget is not None and spec.budget.on_exhausted == "Pause"


def stop_for(o: Observed, total: Usage) -> Stop | None:
    """spec.stop, else a cap or the budget crossed, unless that pauses the run (a capability's own
    stop comes after these)."""
    if o.run.spec.stop:
        return Stop(Outcome.CANCELLED, "spec.stop is set")
    over = over_limit(o, total)
    if over is not None and not pauses(o.run.spec):
        return Stop(Outcome.BUDGET_EXCEEDED, over[0], over[1])
    return None


def budget_pause(o: Observed, total: Usage) -> str | None:
    """Why a run whose budget says Pause is paused now (a cap or its WorkerBudget reached, with
    what to raise), else None."""
    if not pauses(o.run.spec):
        return None
    over = over_limit(o, total)
    if over is None:
        return None
    what = f"raise WorkerBudget {o.budget.name}'s limit or wait for its period to roll over" \
        if o.budget is not None and over[0].startswith("WorkerBudget") else \
        "raise spec.budget.capCents or maxTokens (for a child, its parent's tree must have room)"
    return f"{over[0]}: {what}"


def stop_due(o: Observed) -> dt.datetime:
    """When a stop told to the holder ends its attempt whatever it does (stopGraceSeconds)."""
    return after(o.run.status.stop_requested_at or o.now, o.run.spec.stop_grace_seconds)


def _least(*limits: int | None) -> int | None:
    """The tightest of the limits that exist, never below zero; None when none exists."""
    present = [x for x in limits if x is not None]
    return max(min(present), 0) if present else None


def usage_alarm(o: Observed) -> UsageAlarm | None:
    """The current attempt's own usage at which a cap or the budget is reached."""
    earlier = earlier_usage(o.run.status)
    tree = tree_held(o.run.status)
    budget = o.run.spec.budget
    pool = o.budget if o.budget is not None and not o.budget.missing else None
    # The run's total may reach what the budget has left plus its mark there; a limit the budget
    # does not set raises no alarm.
    pool_cents = pool.remaining.cents + pool.charged.cents if pool and pool.remaining.cents is not None else None
    pool_tokens = pool.remaining.tokens + pool.charged.tokens if pool and pool.remaining.tokens is not None else None
    cents = _least(protocol.cap_remaining(budget.cap_cents if budget else None, earlier.cents + tree.cents, 0),
                   protocol.cap_remaining(pool_cents, earlier.cents, 0))
    tokens = _least(protocol.cap_remaining(budget.max_tokens if budget else None, earlier.tokens + tree.tokens, 0),
                    protocol.cap_remaining(pool_tokens, earlier.tokens, 0))
    if cents is None and tokens is None:
        return None
    return UsageAlarm(cents=cents, tokens=tokens)


def signals_for(spec: WorkerRunSpec, status: WorkerRunStatus, stop_reason: str | None,
                yield_by: dt.datetime | None = None, budget_paused: bool = False) -> str:
    """The signals annotation for the holder of `status`: computed from the status being
    written, so a grant's Lease carries the signals of the attempt it starts."""
    budget = spec.budget
    # What the worker may still spend of its cap counts what its children hold of it (the tree's).
    earlier = sum_usage([earlier_usage(status), tree_held(status)])
    # Decisions on the holder's own requests only: never one made for another attempt.
    decisions = {r.gate: GateDecision(decision=r.decision, reason=r.reason, approver=r.approver)
                 for r in (status.review.requests if status.review is not None else [])
                 if r.attempt == status.attempt and r.decision in ("Approve", "Deny", "TimedOut")
                 and r.gate not in (c.GATE_START, c.GATE_RESULT)}
    return protocol.signals_annotation(Signals(
        stop=stop_reason is not None, reason=stop_reason, yield_=yield_by is not None, stop_by=yield_by,
        paused=spec.suspend or budget_paused, ends_at=status.ends_at,
        cap_cents=budget.cap_cents if budget else None, cap_tokens=budget.max_tokens if budget else None,
        base_cents=earlier.cents, base_tokens=earlier.tokens, decisions=decisions))


def desired_signals(o: Observed, stop_reason: str | None) -> str:
    return signals_for(o.run.spec, o.run.status, stop_reason,
                       budget_paused=budget_pause(o, run_usage(o)) is not None)


def yield_by(o: Observed, stop: Stop | None, stop_requested_at: dt.datetime | None) -> dt.datetime | None:
    """When a yield (a Kueue eviction) told at `stop_requested_at` ends the attempt regardless."""
    if stop is None or stop.outcome != Outcome.PREEMPTED:
        return None
    return after(stop_requested_at or o.now, o.run.spec.stop_grace_seconds)


def admission_refusal(o: Observed) -> tuple[str, str] | None:
    """(reason, message) when the run may not start an attempt: its budget is missing, or its
    cap or budget is already reached."""
    if o.budget is not None and o.budget.missing:
        return "BudgetNotFound", f"WorkerBudget {o.budget.name} does not exist"
    over = over_limit(o, run_usage(o))
    if over is not None:
        return "BudgetExceeded", f"not launched: {over[0]}"
    return None
