"""What runs is what was approved, or what the first attempt ran.

A run's execution fields (executor, template, payload, idempotencyKey, lease, retry) are frozen by
the CRD once the run started, and from its creation under a start gate. This is the second line
of defence, which does not depend on that CEL rule (it once let a renamed payload key through: the
API server compared schemaless objects by the keys both had). Their digest is recorded with the
Start gate's entry when the gate opens (what a person is asked to approve) and in
status.executionDigest at the first grant; no attempt is granted while the spec's digest differs.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from tether.api import constants as c
from tether.api.conditions import Status, get_condition, set_condition
from tether.api.models import Phase, WorkerRunSpec, WorkerRunStatus
from tether.core.actions import Decision, Event
from tether.core.observe import Observed

if TYPE_CHECKING:
    from tether.core.lifecycle import StatusBuilder

# The fields the digest covers, by their names in WorkerRunSpec.
EXECUTION_FIELDS = frozenset({"executor", "template", "payload", "idempotency_key", "lease", "retry"})
_FIELD_NAMES = "spec.executor, template, payload, idempotencyKey, lease or retry"


def execution_digest(spec: WorkerRunSpec) -> str:
    """sha256 of the execution fields as canonical JSON. Defaults are left out: a default spelled
    out and one left to the API server are the same run, and a field given a default later does not
    change the digest of a run pinned before."""
    fields = spec.model_dump(mode="json", by_alias=True, include=set(EXECUTION_FIELDS), exclude_defaults=True)
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def pinned_digest(status: WorkerRunStatus) -> str | None:
    """The digest the next grant must match: the first grant's, else the one the Start gate asks to
    approve. None before either (a run granted before digests were recorded is pinned at its next grant)."""
    if status.execution_digest is not None:
        return status.execution_digest
    start = status.review.find(c.GATE_START, 0) if status.review is not None else None
    return start.execution_digest if start is not None else None


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
    message = (f"{_FIELD_NAMES} changed since {since} (executionDigest {pinned}, the spec's now {current}): "
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
