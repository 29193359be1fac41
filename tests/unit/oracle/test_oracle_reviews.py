"""Invariant 7 of the fault trials' oracle (a result under review is accepted or denied only as a
person decided), on synthetic audit logs: it must catch each way of getting it wrong."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

import pytest

from testkit.oracle import judge
from tests.unit.oracle.test_oracle import NS, Log, Run, facts

pytestmark = pytest.mark.unit


def approve(log: Log, run: Run, decision: str = "Approve", attempt: int | None = 1, user: str = "alice",
            approver: str | None = None, uid: str | None = "run", name: str | None = None) -> None:
    spec: dict[str, Any] = {"runRef": {"name": name or run.name, **({"uid": run.uid} if uid == "run" else
                                                                    {"uid": uid} if uid else {})},
                            "gate": "Result", "decision": decision, "approver": approver or user}
    if attempt is not None:
        spec["attempt"] = attempt
    body = {"metadata": {"name": f"a{log.rv}", "namespace": NS, "resourceVersion": str(log.rv + 1),
                         "creationTimestamp": (log.clock + dt.timedelta(seconds=1)).isoformat().replace("+00:00", "Z")},
            "spec": spec}
    log.rv += 1
    log._event("create", "workerrunapprovals", body["metadata"]["name"], {"username": user}, 201, body,
               group="tether.dev")


def under_review() -> tuple[Log, Run]:
    log = Log()
    r = Run(log)
    r.spec["review"] = {"result": True}
    a1 = r.grant()
    r.renew(a1, usage=1)
    r.publish(a1)
    r.end("Succeeded", "AwaitingReview", usage=1)
    return log, r


def sevens(log: Log, r: Run) -> list[str]:
    return [v.evidence for v in judge(log.records, facts(r)).violations if v.invariant == 7]


def test_an_approved_result_is_accepted() -> None:
    log, r = under_review()
    approve(log, r)
    r.write(phase="Succeeded")
    assert sevens(log, r) == []


@pytest.mark.parametrize("how", ["none", "another attempt", "denied too", "made for a namesake"])
def test_a_result_accepted_without_its_approval_is_caught(how: str) -> None:
    log, r = under_review()
    if how == "another attempt":
        approve(log, r, attempt=2)
    elif how == "denied too":
        approve(log, r, decision="Deny")
        approve(log, r)
    elif how == "made for a namesake":
        approve(log, r, uid="someone-else")
    r.write(phase="Succeeded")
    assert sevens(log, r), how


def test_an_unbound_approval_counts_only_after_the_gate_opened() -> None:
    log = Log()
    r = Run(log)
    r.spec["review"] = {"result": True}
    a1 = r.grant()
    approve(log, r, attempt=None)  # before the result went to review
    r.publish(a1)
    r.end("Succeeded", "AwaitingReview", usage=0)
    r.write(phase="Succeeded")
    assert sevens(log, r)
    approve(log, r, attempt=None)
    r.write(phase="Succeeded", message="again")  # not a new acceptance: no second check
    assert len(sevens(log, r)) == 1


def test_a_rejection_needs_a_denial_and_a_forged_approver_is_caught() -> None:
    log, r = under_review()
    denied = copy.deepcopy(r.status)
    denied["attempts"][-1]["outcome"] = "ResultRejected"
    denied.pop("result")
    log.run_status(r, {**denied, "phase": "Backoff"})
    assert any("rejected" in e for e in sevens(log, r))
    log2, r2 = under_review()
    approve(log2, r2, decision="Deny", approver="bob")  # accepted from alice naming bob: forged
    log2.run_status(r2, {**denied, "phase": "Backoff"})
    assert any("approver 'bob' accepted from user 'alice'" in e for e in sevens(log2, r2))


def test_runs_without_the_gate_are_not_judged_by_it() -> None:
    log = Log()
    r = Run(log)
    a1 = r.grant()
    r.publish(a1)
    r.end("Succeeded", "Succeeded")
    assert sevens(log, r) == []
