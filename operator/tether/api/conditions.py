"""Condition helpers: kstatus-compatible, lastTransitionTime kept when the status did not change."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal, Mapping

from tether.api import constants as c
from tether.api.models import Condition, Phase

Status = Literal["True", "False", "Unknown"]

FAILURE_PHASES = frozenset({Phase.FAILED, Phase.LOST, Phase.CANCELLED, Phase.BUDGET_EXCEEDED,
                            Phase.DEADLINE_EXCEEDED, Phase.REJECTED})


def set_condition(conditions: list[Condition], type_: str, status: Status, reason: str, message: str,
                  generation: int, now: dt.datetime) -> list[Condition]:
    """Returns a new list with `type_` set; its lastTransitionTime moves only when status changes."""
    out: list[Condition] = []
    found = False
    for cond in conditions:
        if cond.type != type_:
            out.append(cond)
            continue
        found = True
        changed = cond.status != status
        out.append(Condition(type=type_, status=status, reason=reason, message=message,
                             observed_generation=generation,
                             last_transition_time=now if changed else cond.last_transition_time))
    if not found:
        out.append(Condition(type=type_, status=status, reason=reason, message=message,
                             observed_generation=generation, last_transition_time=now))
    return out


def get_condition(conditions: list[Condition], type_: str) -> Condition | None:
    return next((cond for cond in conditions if cond.type == type_), None)


def phase_conditions(conditions: list[Condition], phase: Phase, holder: str | None, message: str,
                     generation: int, now: dt.datetime, lease_reason: str = "", reason: str = "") -> list[Condition]:
    """The standard conditions for a phase; their reason is the phase unless a more telling one
    is given (BudgetNotFound rather than Pending: it is what the REASON column shows).

    kstatus reads Reconciling/Stalled/Ready; Succeeded and Failed follow the Job
    controller (present once true); LeaseHeld tells whether anybody may execute.
    """
    conds = list(conditions)
    p = reason or phase.value
    if phase == Phase.SUCCEEDED:
        conds = set_condition(conds, c.COND_READY, "True", p, message, generation, now)
        conds = set_condition(conds, c.COND_RECONCILING, "False", p, message, generation, now)
        conds = set_condition(conds, c.COND_STALLED, "False", p, message, generation, now)
        conds = set_condition(conds, c.COND_SUCCEEDED, "True", p, message, generation, now)
    elif phase in FAILURE_PHASES:
        conds = set_condition(conds, c.COND_READY, "False", p, message, generation, now)
        conds = set_condition(conds, c.COND_RECONCILING, "False", p, message, generation, now)
        conds = set_condition(conds, c.COND_STALLED, "True", p, message, generation, now)
        conds = set_condition(conds, c.COND_FAILED, "True", p, message, generation, now)
    else:
        working = phase != Phase.SUSPENDED
        conds = set_condition(conds, c.COND_READY, "False", p, message, generation, now)
        conds = set_condition(conds, c.COND_RECONCILING, "True" if working else "False", p, message,
                              generation, now)
        conds = set_condition(conds, c.COND_STALLED, "False", p, message, generation, now)
    if holder:
        conds = set_condition(conds, c.COND_LEASE_HELD, "True", lease_reason or "AttemptStarted",
                              f"{holder} holds the lease", generation, now)
    else:
        conds = set_condition(conds, c.COND_LEASE_HELD, "False", lease_reason or "NoHolder",
                              "nobody may execute the run now", generation, now)
    return conds


def headline(status: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """What a run's phase alone does not say, as (reason, message), for the places users look
    first (kubectl tether status, the console's run page): Ready's reason when it is more telling
    than the phase (PodRefused, WorkerPaused, BudgetNotFound, SpecChanged), else the reason of a
    Stalled=True condition that is not the phase's (an object built from the spec was refused)."""
    status = status or {}
    phase = status.get("phase") or Phase.PENDING.value
    conditions = [cd for cd in status.get("conditions") or [] if isinstance(cd, Mapping)]
    for type_, wanted in ((c.COND_READY, None), (c.COND_STALLED, "True")):
        cd = next((x for x in conditions if x.get("type") == type_), None)
        if cd is not None and cd.get("reason") not in (None, "", phase) and wanted in (None, cd.get("status")):
            return str(cd["reason"]), str(cd.get("message") or "")
    return None
