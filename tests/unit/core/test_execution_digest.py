"""What runs is what was approved or first granted: the execution fields' digest, pinned in the
status at the Start gate and the first grant, checked before every grant (issue 21, defect 2).

The CRD refuses changes to those fields; these tables show the grant refusing them where that rule
was bypassed (or wrong, as it was: CEL compared schemaless objects by their common keys only)."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from typing import Any

import pytest

from tether.api.models import Phase, WorkerRunSpec
from tether.core.decide import decide
from tether.core.execution import execution_digest
from tether.core.observe import ApprovalObservation
from tests.unit.core.test_decide import T0, cond, kinds, observe, run, status_of

pytestmark = pytest.mark.unit

PAYLOAD = {"n": 1, "dryRun": True, "opts": {"a": 1}}
TEMPLATE = {"spec": {"containers": [{"name": "w", "command": ["w"]}]}}


def spec(**changes: Any) -> dict[str, Any]:
    return {"payload": PAYLOAD, "template": TEMPLATE, **changes}


PINNED = execution_digest(run(spec()).spec)


def ended(**extra: Any) -> dict[str, Any]:
    """Attempt 1 ended and its backoff is over: the next pass grants attempt 2."""
    return {"phase": "Backoff", "attempt": 1, "fence": 2, "observedGeneration": 1, "startedAt": T0.isoformat(),
            "nextAttemptAt": T0.isoformat(), "executionDigest": PINNED,
            "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "pod": "job-a1", "outcome": "PodFailed",
                          "startedAt": T0.isoformat(), "endedAt": T0.isoformat()}], **extra}


CHANGED = [
    # the edit the API server let through (CEL compared only the keys both objects have)
    pytest.param(spec(payload={"n": 1, "dryRunX": True, "opts": {"a": 1}}), id="payload key renamed"),
    pytest.param(spec(payload={**PAYLOAD, "m": 2}), id="payload key added"),
    pytest.param(spec(payload={"n": 1, "dryRun": True}), id="payload key removed"),
    pytest.param(spec(payload={**PAYLOAD, "opts": {"a": 2}}), id="payload nested change"),
    pytest.param(spec(payload=None), id="payload removed"),
    pytest.param(spec(template={"spec": {"containers": [{"name": "w", "command": ["rm", "-rf", "/"]}]}}),
                 id="template changed"),
    pytest.param(spec(template={"metadata": {"labels": {"x": "y"}}, **TEMPLATE}), id="template key added"),
    pytest.param(spec(executor="External", template=None), id="executor"),
    pytest.param(spec(idempotencyKey="other"), id="idempotencyKey"),
    pytest.param(spec(lease={"durationSeconds": 60, "renewIntervalSeconds": 5, "startupGraceSeconds": 30}),
                 id="lease"),
    pytest.param(spec(retry={"maxAttempts": 9, "backoff": {"initialSeconds": 10, "maxSeconds": 60, "factor": 2}}),
                 id="retry"),
]

CONTROL = [
    pytest.param(spec(), id="unchanged"),
    pytest.param(spec(budget={"capCents": 900}), id="cap raised"),
    pytest.param(spec(progressDeadlineSeconds=600, stopGraceSeconds=5, ttlSecondsAfterFinished=60),
                 id="other control fields"),
    pytest.param(spec(payload={"opts": {"a": 1}, "dryRun": True, "n": 1}), id="same payload, keys reordered"),
]


@pytest.mark.parametrize("changed", CONTROL)
def test_the_next_attempt_is_granted_while_the_execution_fields_are_the_pinned_ones(changed: dict[str, Any]) -> None:
    d = decide(observe(run(changed, ended())))
    assert kinds(d.actions) == ["WriteStatus", "EnsureLease", "EnsurePod"]
    s = status_of(d.actions)
    assert (s.attempt, s.holder, s.execution_digest) == (2, "job-a2", PINNED)
    assert cond(s, "Stalled") == ("False", "Starting")


@pytest.mark.parametrize("changed", CHANGED)
def test_no_attempt_starts_once_an_execution_field_changed_after_the_first_grant(changed: dict[str, Any]) -> None:
    # (tool_claims_cleared: an External attempt's revocation is over, as it is for a Pod's)
    d = decide(replace(observe(run(changed, ended(), generation=2)), tool_claims_cleared=True))
    assert kinds(d.actions) == ["WriteStatus"]  # no Lease, no pod
    write = d.actions[0]
    s = write.status
    assert (s.attempt, s.holder, s.fence, s.phase) == (1, None, 2, Phase.BACKOFF)
    assert s.execution_digest == PINNED  # the pin is never moved to what was edited in
    # Said the way kstatus and Argo CD read a refused spec: Stalled, not Ready, for this generation.
    assert cond(s, "Stalled") == ("True", "SpecChanged") and cond(s, "Ready") == ("False", "SpecChanged")
    assert cond(s, "Reconciling") == ("False", "SpecChanged") and s.observed_generation == 2
    message = next(c.message for c in s.conditions if c.type == "Stalled")
    assert "changed since attempt 1 started" in message and "create a new WorkerRun" in message
    [event] = write.events
    assert (event.type, event.reason, event.message) == ("Warning", "SpecChanged", message)


def test_a_refused_run_waits_quietly_and_starts_when_its_fields_are_restored() -> None:
    changed = run(spec(payload={"n": 1, "dryRunX": True}), ended(), generation=2)
    refused = status_of(decide(observe(changed)).actions).dump()
    again = decide(observe(run(spec(payload={"n": 1, "dryRunX": True}), refused, generation=2)))
    assert again.actions == []  # said once; no write per pass
    restored = decide(observe(run(spec(), refused, generation=3)))
    assert kinds(restored.actions) == ["WriteStatus", "EnsureLease", "EnsurePod"]
    s = status_of(restored.actions)
    assert s.attempt == 2 and cond(s, "Stalled") == ("False", "Starting") and cond(s, "Ready")[1] == "Starting"


def test_the_first_grant_pins_the_digest() -> None:
    s = status_of(decide(observe(run(spec()))).actions)
    assert (s.attempt, s.execution_digest) == (1, PINNED)


def test_a_run_granted_before_digests_were_recorded_is_pinned_at_its_next_grant() -> None:
    legacy = ended()
    del legacy["executionDigest"]
    edited = spec(payload={"n": 2})
    s = status_of(decide(observe(run(edited, legacy))).actions)
    assert s.attempt == 2 and s.execution_digest == execution_digest(run(edited).spec)


# --- bound to the Start approval ---------------------------------------------------------

CREATED = T0 - dt.timedelta(minutes=10)


def gated(changes: dict[str, Any] | None = None, status: dict[str, Any] | None = None, generation: int = 1) -> Any:
    return run({**spec(review={"start": True}), **(changes or {})}, status, creationTimestamp=CREATED.isoformat(),
               generation=generation)


APPROVE = ApprovalObservation(name="a", gate="Start", decision="Approve", approver="alice", reason="fine",
                              created=T0 - dt.timedelta(minutes=1), run_uid="u-1")


def waiting() -> dict[str, Any]:
    """The run as it waits for its Start approval: the gate's entry records what is to be approved."""
    return status_of(decide(observe(gated())).actions).dump()


def test_the_start_gate_records_the_digest_of_what_is_to_be_approved() -> None:
    [req] = run(spec(), waiting()).status.review.requests  # type: ignore[union-attr]
    assert (req.gate, req.decision, req.execution_digest) == ("Start", None, execution_digest(gated().spec))


def test_an_approved_start_pins_what_was_approved() -> None:
    d = decide(replace(observe(gated(status=waiting())), approvals=(APPROVE,)))
    assert "EnsureLease" in kinds(d.actions)
    s = status_of(d.actions)
    assert s.execution_digest == execution_digest(gated().spec) == s.review.find("Start", 0).execution_digest


@pytest.mark.parametrize("changed", CHANGED[:4])
def test_an_approval_does_not_start_a_run_edited_since_its_gate_opened(changed: dict[str, Any]) -> None:
    edited = gated({"payload": changed["payload"]}, waiting(), generation=2)
    d = decide(replace(observe(edited), approvals=(APPROVE,)))
    assert kinds(d.actions) == ["WriteStatus"]
    s = status_of(d.actions)
    assert (s.attempt, s.execution_digest, s.phase) == (0, None, Phase.PENDING)  # approved, not waiting for it
    # The decision is on record (it approved the fields as they were) ...
    assert s.review.find("Start", 0).decision == "Approve" and cond(s, "Approved") == ("True", "Approved")
    # ... and the run says why it does not start.
    assert cond(s, "Stalled") == ("True", "SpecChanged")
    assert "changed since the run asked for its start approval" in next(c.message for c in s.conditions if c.type == "Stalled")


# --- the digest itself --------------------------------------------------------------------


@pytest.mark.parametrize("a, b, same", [
    ({"payload": {"a": 1, "b": 2}}, {"payload": {"b": 2, "a": 1}}, True),
    # defaults spelled out or left to the API server: the same run
    ({}, {"lease": {"durationSeconds": 90, "renewIntervalSeconds": 30, "startupGraceSeconds": 120},
          "retry": {"maxAttempts": 3}, "executor": "Pod"}, True),
    ({"payload": {"dryRun": True}}, {"payload": {"dryRunX": True}}, False),
    ({"payload": {"a": [1, 2]}}, {"payload": {"a": [2, 1]}}, False),
    ({"payload": {"a": 1}}, {"payload": {"a": "1"}}, False),
    ({"payload": {}}, {}, False),
    ({"template": {"spec": {}}}, {"payload": {"spec": {}}}, False),
    ({"suspend": True, "stop": True, "budget": {"capCents": 1}}, {}, True),
])
def test_the_digest_covers_the_execution_fields_and_only_them(a: dict[str, Any], b: dict[str, Any], same: bool) -> None:
    digest = execution_digest(WorkerRunSpec.model_validate(a))
    assert digest.startswith("sha256:") and len(digest) == len("sha256:") + 64
    assert (digest == execution_digest(WorkerRunSpec.model_validate(b))) == same
