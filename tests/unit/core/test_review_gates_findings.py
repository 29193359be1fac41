"""Adversarial review of the result gate and a worker's named requests (issue 13): each test pins
one defect.

Written against the promise (README "Review", docs/protocol.md §9, the CRDs), not the code: they
fail while the defect is there. Pure: no cluster, no network.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
from dataclasses import replace
from typing import Any

import pytest
from tether import protocol
from tether.api import constants as c
from tether.api.models import Phase
from tether.controller.leases import LeaseTracker
from tether.core.decide import decide
from tether.core.observe import ApprovalObservation
from tether.kube import resources

from tests.support.crd_schema import openapi_schema, schema_violations
from tests.unit.core.test_decide import T0, held, kinds, lease, observe, pod, run
from tests.unit.core.test_review_gates import RESULT, at, awaiting, dumped

pytestmark = pytest.mark.unit

STATUS_SCHEMA = openapi_schema("workerruns.tether.dev.yaml")["properties"]["status"]
CREATED = T0 - dt.timedelta(minutes=10)


def writes(d: Any) -> list[Any]:
    """Every status write of a decision (a revocation's included)."""
    return [a.status_write.status if type(a).__name__ == "Revoke" else a.status
            for a in d.actions if type(a).__name__ in ("WriteStatus", "Revoke")]


def status_after(d: Any) -> Any:
    [s] = writes(d)
    return s


def _lease_body(holder: str | None, fence: int, annotations: dict[str, str], rv: str = "10") -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "job", "namespace": "ns", "resourceVersion": rv,
                         "labels": {"tether.dev/run": "job"}, "annotations": dict(annotations),
                         "ownerReferences": [{"kind": "WorkerRun", "name": "job", "uid": "u-1", "controller": True}]},
            "spec": {"holderIdentity": holder, "leaseTransitions": fence, "leaseDurationSeconds": 20}}


# --- 1. a new attempt inherits the previous attempt's requests ---------------------------------


def test_a_regranted_lease_does_not_carry_the_previous_attempts_requests() -> None:
    """Attempt 1 (pod job-a1) asked for "wire-money" on its Lease (or wrote it in the revocation
    window, between the fence bump and the Lease clear, which the policy still admits). The
    revocation clears the Lease and the grant of attempt 2 rewrites it with regrant_lease, which
    drops the usage report and the claimant but keeps tether.dev/requests. The operator's
    LeaseTracker then reads attempt 1's requests as the new holder's, and track_requests records
    them as attempt 2's: status says "attempt 2 asks for approval of 'wire-money'" with attempt 1's
    details. A person approves it for attempt 2 (the plugin and the console bind the approval to
    attempt 2); when attempt 2's worker asks "wire-money" itself (same program, same name, other
    details), its request_approval returns Approve at once: a decision nobody made for it."""
    asked = protocol.requests_annotation({"wire-money": protocol.ApprovalRequest("wire-money", "30 EUR to acme")})
    revoked = _lease_body(None, 2, {c.ANN_FENCE: "2", c.ANN_REQUESTS: asked})
    regranted = resources.regrant_lease(revoked, "job-a2", 3, 20, T0, "")
    assert c.ANN_REQUESTS not in regranted["metadata"]["annotations"], regranted["metadata"]["annotations"]

    # What the operator does with it: no request of attempt 2 appears until attempt 2 makes one.
    tracker = LeaseTracker()
    tracker.observe("u-1", regranted, 200.0)
    seen = tracker.get("u-1")
    assert seen is not None
    first = held(1)
    first["review"] = {"requests": [{"gate": "wire-money", "attempt": 1, "requestedAt": T0.isoformat(),
                                     "details": "30 EUR to acme", "decision": "Withdrawn"}]}
    st = held(2)
    st["review"] = first["review"]
    o = observe(run(status=st), replace(seen, renewed=True), pods=(pod(2),), now=T0 + dt.timedelta(minutes=2),
                mono=201.0)
    for s in writes(decide(o)):
        assert s.review.find("wire-money", 2) is None, s.review


def test_an_external_attempt_may_ask_after_its_predecessor_used_twenty_requests() -> None:
    """The same leftover, through the gateway: `_with_requests` merges an External attempt's asks
    into the requests already on the Lease, which still are the previous attempt's. Attempt 2's
    first request is refused (422 "at most 20 approval requests") when attempt 1 made 20, and a
    name attempt 1 used keeps attempt 1's details ("a request already made keeps its first
    details"): the person reads what attempt 1 wanted to do, and decides attempt 2's step."""
    from tether.gateway import models as m
    from tether.gateway.app import _with_requests

    old = {f"r{i}": protocol.ApprovalRequest(f"r{i}", "attempt 1's step") for i in range(20)}
    revoked = _lease_body(None, 2, {c.ANN_FENCE: "2", c.ANN_REQUESTS: protocol.requests_annotation(old)})
    regranted = resources.regrant_lease(revoked, "job-a2", 3, 20, T0, "")
    merged = json.loads(_with_requests(regranted, [m.ApprovalAsk(name="r0", details="attempt 2's step")]))
    assert merged == {"r0": {"details": "attempt 2's step"}}


# --- 2. a worker can wedge every status write of its attempt -----------------------------------


def test_a_request_name_with_a_trailing_newline_is_refused() -> None:
    """REQUEST_NAME ends in `$`, which in Python matches before a trailing newline: "refund\\n"
    and a 63-character name plus "\\n" pass request_refusal and parse_requests. The CRDs (Go's
    regexp, maxLength 63) do not take them."""
    assert protocol.request_refusal("refund\n", "", None) is not None
    with pytest.raises(ValueError):
        protocol.parse_requests(json.dumps({"a" * 63 + "\n": {"details": "x"}}))


def test_a_hostile_request_name_does_not_block_the_stop() -> None:
    """A pod worker writes its own Lease (the policy admits any tether.dev/requests value from the
    holder) with a request named 63 letters plus a newline. The operator records it, and every
    status write of the held attempt now carries a gate of 64 characters, which the CRD refuses
    (status.review.requests[].gate maxLength 63): 422 on every pass. spec.stop is set: the write
    that records stopRequestedAt fails, so the worker is never told to stop, stopGraceSeconds never
    starts (attempt_end needs stopRequestedAt) and the run is never Cancelled; usage is never
    folded nor charged. The kill switch and the budget are off for as long as it renews."""
    raw = json.dumps({"a" * 63 + "\n": {"details": "x"}})
    try:
        reqs = protocol.parse_requests(raw)
    except ValueError:
        reqs = ()  # refused as a whole: the previous requests (none) stand
    o = observe(run(spec={"stop": True}, status=held(1)), lease(1, requests=reqs), pods=(pod(1),))
    s = status_after(decide(o))
    assert s.stop_requested_at is not None
    assert schema_violations(s.dump(), STATUS_SCHEMA, ".status") == []


def test_a_worker_cycling_request_names_does_not_overflow_the_record() -> None:
    """The annotation holds at most 20 requests, but nothing bounds the requests of an attempt:
    a worker that replaces its 20 names with 20 others (and again) leaves every earlier one
    pending in status.review.requests (open_request never drops a pending gate, and appends past
    50 anyway). The third batch makes 60 entries; the CRD allows 50, so every status write of the
    attempt is refused from then on — including the one that tells it to stop (spec.stop)."""
    st: dict[str, Any] = held(1)
    for batch, minutes in (("a", 0), ("b", 1)):
        reqs = tuple(protocol.ApprovalRequest(f"{batch}{i}", "x") for i in range(20))
        o = observe(run(status=st), lease(1, requests=reqs), pods=(pod(1),), now=T0 + dt.timedelta(minutes=minutes))
        # The second batch is past the attempt's 20 requests: ignored, nothing to write.
        st = dumped(status_after(decide(o))) if writes(decide(o)) else st
    assert len([r for r in run(status=st).status.review.requests if r.attempt == 1]) == 20
    reqs = tuple(protocol.ApprovalRequest(f"c{i}", "x") for i in range(20))
    o = observe(run(spec={"stop": True}, status=st), lease(1, requests=reqs), pods=(pod(1),),
                now=T0 + dt.timedelta(minutes=2))
    s = status_after(decide(o))
    assert s.stop_requested_at is not None
    assert schema_violations(s.dump(), STATUS_SCHEMA, ".status") == []


# --- 3. a Deny on the start gate is ignored when it names an attempt ---------------------------


def test_a_start_denial_that_names_an_attempt_still_rejects_the_run() -> None:
    """README: "a denial is final: any Deny on the gate rejects the run, whatever was decided
    before or after". The CRD admits `attempt` 0..100 on any gate, and decision_on compares it
    with the Start request's attempt (0): bob's Deny {gate: Start, attempt: 1} (he meant "the
    first attempt") is ignored, and alice's Approve a minute later starts the run."""
    deny = ApprovalObservation(name="bob", gate="Start", decision="Deny", approver="bob", reason="too expensive",
                               created=T0 - dt.timedelta(minutes=2), attempt=1)
    approve = ApprovalObservation(name="alice", gate="Start", decision="Approve", approver="alice", reason="ok",
                                  created=T0 - dt.timedelta(minutes=1))
    gated = run(spec={"review": {"start": True}}, creationTimestamp=CREATED.isoformat())
    d = decide(replace(observe(gated, None), approvals=(deny, approve)))
    assert "EnsureLease" not in kinds(d.actions) and "EnsurePod" not in kinds(d.actions)
    assert status_after(d).phase == Phase.REJECTED


# --- 4. an edit while the result waits is never observed ---------------------------------------


def test_a_spec_change_while_awaiting_review_is_observed() -> None:
    """The fix made for the start gate ("an edit while waiting is observed") is missing on the
    result gate: a run in AwaitingReview whose control fields change (suspend, a cap, the TTL)
    gets generation 2, and decide_result_review writes nothing while it waits. observedGeneration
    stays 1: Argo CD's health check says "Waiting for the operator to observe the latest spec"
    (Progressing) instead of Suspended/"Awaiting review", kstatus says InProgress for the wrong
    reason, for as long as nobody decides (up to a year)."""
    waiting = awaiting()
    edited = run(spec={"review": {"result": True}, "ttlSecondsAfterFinished": 60}, status=waiting, generation=2)
    d = decide(replace(observe(edited, None, now=T0 + dt.timedelta(minutes=2)), approvals=()))
    s = status_after(d)
    assert s.observed_generation == 2 and s.phase == Phase.AWAITING_REVIEW


# --- 5. an approval in the gate's first second does not count ----------------------------------


def test_an_approval_decides_its_attempt_whatever_second_it_was_made_in() -> None:
    """Finding 5 was: an approval without `attempt` made 0.3 s after the gate opened read as made
    "before" it (creationTimestamps have whole seconds) and was ignored. Rounding the gate's time
    down instead let an approval made for attempt 2 decide attempt 3 when attempt 3's result went
    to review in the same second (the fault trials' invariant 7 caught it). The class is matching
    by time at all: an approval of a Result or a request must name its attempt (CRD rule), one
    naming it counts whenever it was made, one naming none counts for nothing."""
    opened = T0 + dt.timedelta(milliseconds=600)
    st = held(1, result=RESULT)
    for _ in range(3):
        o = observe(run(spec={"review": {"result": True}}, status=st), lease(1), now=opened)
        st = dumped(status_after(decide(o)))
        if st["phase"] == "AwaitingReview":
            break
    for attempt, phase in ((1, Phase.SUCCEEDED), (None, None)):
        made = ApprovalObservation(name="a", gate="Result", decision="Approve", approver="alice", reason="ok",
                                   created=T0, attempt=attempt)  # made at T0 + 0.9 s; stored truncated
        d = decide(at(st, (made,), minutes=1))
        assert (status_after(d).phase if writes(d) else None) == phase, attempt


# --- 6. the chaos oracle calls the result gate a violation -------------------------------------


def test_the_oracle_accepts_a_denied_result_and_its_retry() -> None:
    """Invariant 2 of testkit/oracle.py ("no accepted result erased or replaced; a run with
    a result is never granted again; a published result never ends other than Succeeded") knows
    nothing of the result gate, whose documented behaviour is exactly that: a denied result is
    cleared and the attempt retried; an unreviewed one ends Rejected with its result kept. A fault
    trial with spec.review.result would report Tether's correct behaviour as a safety violation."""
    from testkit.oracle import judge
    from tests.unit.oracle.test_oracle import facts, invariants
    from tests.unit.oracle.test_oracle_reviews import approve, under_review

    log, r = under_review()
    approve(log, r, decision="Deny", attempt=1)  # the person's decision (invariant 7 wants one)
    denied = copy.deepcopy(r.status)  # the operator's write on a Deny: ResultRejected, result cleared
    denied.pop("result")
    denied["attempts"][-1].update(outcome="ResultRejected", message="result denied by alice: cite sources")
    denied.update(phase="Backoff", review={"feedback": "cite sources", "requests": [
        {"gate": "Result", "attempt": 1, "requestedAt": "2026-11-29T12:00:00Z", "decision": "Deny",
         "approver": "alice", "reason": "cite sources"}]})
    log.run_status(r, denied)
    a2 = r.grant()
    r.renew(a2, usage=2)
    r.publish(a2)
    r.end("Succeeded", "AwaitingReview", usage=2)
    approve(log, r, attempt=2)
    r.write(phase="Succeeded")
    verdict = judge(log.records, facts(r))
    assert invariants(verdict) == [], verdict.violations
