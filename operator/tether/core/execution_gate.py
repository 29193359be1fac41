"""The gate no attempt passes while the run's execution fields differ from the pinned ones
(execution.py says which fields, and when they are pinned)."""

from __future__ import annotations

from tether.api import constants as c
from tether.api.conditions import Status, get_condition, set_condition
from tether.api.models import Phase
from tether.core.actions import Decision, Event
from tether.core.execution import FIELD_NAMES, execution_digest, pinned_digest
from tether.core.lifecycle import StatusBuilder
from tether.core.observe import Observed


def execution_allowed(o: Observed, b: StatusBuilder, d: Decision) -> bool:
    """True when an attempt may start as far as its execution fields go: none are pinned yet, or
    the spec still has the pinned ones. Otherwise no attempt starts, and the run says why once
    (Stalled=True, Ready=False and Reconciling=False with reason SpecChanged, a Warning Event), as
    long as the fields stay changed; restored, the next pass grants."""
    s, gen = o.run.status, o.run.metadata.generation
    pinned, current = pinned_digest(s), execution_digest(o.run.spec)
    if pinned is None or pinned == current:
        return True
    since = "the run asked for its start approval" if s.attempt == 0 else f"attempt {s.attempt} started"
    message = (f"{FIELD_NAMES} changed since {since} (executionDigest {pinned}, the spec's now {current}): "
               "no attempt starts with fields nobody approved or ran; restore them or create a new WorkerRun")
    stalled = get_condition(s.conditions, c.COND_STALLED)
    said = stalled is not None and (stalled.status, stalled.reason, stalled.message) == \
        ("True", c.REASON_SPEC_CHANGED, message)
    if said and s.observed_generation == gen:
        return False
    b.status.observed_generation = gen
    if b.status.phase == Phase.AWAITING_APPROVAL:
        b.set_phase(Phase.PENDING, message, lease_reason=c.REASON_SPEC_CHANGED)  # approved, and still not started
    refused: tuple[tuple[str, Status], ...] = ((c.COND_STALLED, "True"), (c.COND_READY, "False"),
                                               (c.COND_RECONCILING, "False"))
    for type_, value in refused:
        b.status.conditions = set_condition(b.status.conditions, type_, value, c.REASON_SPEC_CHANGED, message,
                                            gen, o.now)
    b.events.append(Event("Warning", c.REASON_SPEC_CHANGED, message))
    d.actions.append(b.write())
    return False
