"""What runs is what was approved, or what the first attempt ran.

A run's execution fields (executor, template, payload, idempotencyKey, lease, retry, className) are frozen by
the CRD once the run started, and from its creation under a start gate. This is the second line
of defence, which does not depend on that CEL rule (it once let a renamed payload key through: the
API server compared schemaless objects by the keys both had). Their digest is recorded with the
Start gate's entry when the gate opens (what a person is asked to approve) and in
status.executionDigest at the first grant; no attempt is granted while the spec's digest differs
(execution_gate.py).
"""

from __future__ import annotations

import hashlib
import json

from tether.api import constants as c
from tether.api.models import WorkerRunSpec, WorkerRunStatus

# The fields the digest covers, by their names in WorkerRunSpec.
# className: a run approved (or started) as one class runs as that class (its defaults fill the rest).
EXECUTION_FIELDS = frozenset({"executor", "template", "payload", "idempotency_key", "lease", "retry", "class_name"})
FIELD_NAMES = "spec.executor, template, payload, idempotencyKey, lease, retry or className"


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
