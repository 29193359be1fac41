"""The gate of a run's WorkerClass: before its first attempt, the run records what it takes from
its class (status.class, carried by every write of the pass, so the grant pins it), and no
attempt starts while the class it names does not exist or a bound of it is broken."""

from __future__ import annotations

from tether.api import constants as c
from tether.api.conditions import get_condition, set_condition
from tether.api.models import Phase, RunClassStatus
from tether.core.actions import Decision, Event
from tether.core.lifecycle import StatusBuilder
from tether.core.observe import Observed


def class_allows(o: Observed, b: StatusBuilder, d: Decision) -> bool:
    """True when the run may start as far as its class goes (or it is pinned: o.run_class None)."""
    r = o.run_class
    if r is None:
        return True
    if r.unknown is None:
        # What it takes, from a class that exists (a run of no class, or naming a missing one, records
        # none: a class made default or created later still applies until it starts).
        taken = RunClassStatus(name=r.name, defaults=dict(r.defaults)) if r.name is not None and not r.missing \
            else None
        if b.status.class_ != taken:
            b.status.class_ = taken
    if r.unknown is not None:
        reason = c.REASON_CLASSES_UNKNOWN
        message = (f"the operator could not list the WorkerClasses ({r.unknown}): no attempt starts until it "
                   "can (its RBAC needs list and watch on workerclasses)")
        d.wake(10.0)  # the list is tried again on the next pass
    elif r.missing:
        reason = c.REASON_CLASS_NOT_FOUND
        message = (f"WorkerClass {r.name} does not exist: no attempt starts until it does "
                   "(kubectl get workerclasses), or name another class in spec.className")
    elif r.violations:
        reason = c.REASON_CLASS_BOUNDS_EXCEEDED
        message = "; ".join(r.violations) + ": change the run (it has not started) or its class"
    else:
        return True
    s, gen = o.run.status, o.run.metadata.generation
    stalled = get_condition(s.conditions, c.COND_STALLED)
    said = stalled is not None and (stalled.status, stalled.reason, stalled.message) == ("True", reason, message)
    if not said or s.observed_generation != gen or s.phase != Phase.PENDING:
        b.set_phase(Phase.PENDING, message, reason=reason)
        b.status.conditions = set_condition(b.status.conditions, c.COND_STALLED, "True", reason, message, gen, o.now)
        if not said:
            b.events.append(Event("Warning", reason, message))
    if b.changed():
        d.actions.append(b.write())
    return False
