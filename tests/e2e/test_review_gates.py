"""The result gate and a worker's mid-run requests on the real control plane: approved, denied and
timed out; a denied result's reason reaching the next attempt; a stale worker's request refused by
the API server (its audit log says so, not Tether)."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from tether.worker import WorkerRun
from tests.cluster.test_approvals import APPROVALS, _approval, _as, _grant_approver
from tests.e2e.test_budgets import _table
from tests.e2e.test_gateway import call, external_run, gateway, open_attempt  # noqa: F401 (gateway: a fixture)
from tests.e2e.test_review import after_creation_second
from testkit import runs
from testkit.audit import AuditLog
from testkit.kube import Kube, eventually, worker_identity
from testkit.scenario import app_run, wait_line, watch_last_renewal
from tests.unit.chart.test_argocd_health import health


def _reviewed(timeout: int | None = None, **payload: Any) -> dict[str, Any]:
    body = runs.example("short-job.yaml", payload={"steps": 1, "stepSeconds": 0.1, **payload})
    body["spec"]["review"] = {"result": True, **({"resultTimeoutSeconds": timeout} if timeout else {})}
    body["spec"]["retry"] = {"maxAttempts": 3, "backoff": {"initialSeconds": 0}}
    return body


def _decide(kube: Kube, ns: str, run: str, gate: str, decision: str, reason: str,
            attempt: int | None = None) -> dict[str, Any]:
    after_creation_second(kube, ns, run)
    body = _approval("alice", gate=gate, decision=decision)
    body["spec"]["runRef"] = {"name": run}
    body["spec"]["reason"] = reason
    if attempt is not None:
        body["spec"]["attempt"] = attempt
    return kube.ok(kube.post(APPROVALS.format(ns=ns), body, headers=_as("alice")))


def _kstatus(tools_dir: Path, tmp_path: Path, run: dict[str, Any]) -> str:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    out = subprocess.run([str(tools_dir / "kstatus-check"), str(path)], capture_output=True, text=True, check=True)
    return str(json.loads(out.stdout)[0]["status"])


def _pending(run: dict[str, Any]) -> list[tuple[str, int]]:
    return [(r["gate"], r["attempt"]) for r in ((run.get("status") or {}).get("review") or {}).get("requests", [])
            if "decision" not in r]


# --- the result gate ------------------------------------------------------------------


def test_a_result_waits_for_review_then_a_denial_retries_with_the_reason(  # type: ignore[no-untyped-def]
        kube: Kube, namespace: str, operator, tools_dir: Path, tmp_path: Path) -> None:
    _grant_approver(kube, namespace, "alice")
    runs.create(kube, namespace, _reviewed())
    waiting = runs.wait_phase(kube, namespace, "short-job", "AwaitingReview", timeout=60)
    assert waiting["status"]["result"]["steps"] == 1 and waiting["status"].get("holder") is None
    assert runs.condition(waiting, "Approved")["reason"] == "Pending"
    assert _pending(waiting) == [("Result", 1)]
    assert _kstatus(tools_dir, tmp_path, waiting) == "InProgress"
    assert health(waiting)["status"] == "Suspended"

    _decide(kube, namespace, "short-job", "Result", "Deny", "cite your sources", attempt=1)
    again = eventually(lambda: (r := runs.get(kube, namespace, "short-job"))["status"].get("attempt") == 2
                       and r["status"]["phase"] == "AwaitingReview" and r, timeout=60, what="attempt 2 under review")
    a1 = again["status"]["attempts"][0]
    assert (a1["outcome"], "cite your sources" in a1["message"]) == ("ResultRejected", True)
    assert again["status"]["review"]["feedback"] == "cite your sources"
    # The next attempt got the reason: in its pod's environment (the API's copy of the pod) and,
    # through the SDK, in its own result.
    pod = kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/pods/short-job-a2"))
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["TETHER_REVIEW_FEEDBACK"] == "cite your sources"
    assert again["status"]["result"]["feedback"] == "cite your sources"
    eventually(lambda: "ResultDenied" in runs.events(kube, namespace, "short-job"), timeout=15,
               what="the ResultDenied event")  # posted after the status write it tells of

    # An approval bound to attempt 1 decides nothing for attempt 2; one for attempt 2 does.
    _decide(kube, namespace, "short-job", "Result", "Approve", "too late for attempt 1", attempt=1)
    _decide(kube, namespace, "short-job", "Result", "Approve", "sources cited", attempt=2)
    done = runs.wait_phase(kube, namespace, "short-job", ("Succeeded", "Failed", "Rejected"), timeout=30)
    assert done["status"]["phase"] == "Succeeded"
    assert "sources cited" in runs.condition(done, "Approved")["message"]
    assert _kstatus(tools_dir, tmp_path, done) == "Current" and health(done)["status"] == "Healthy"


def test_an_unreviewed_result_ends_rejected_with_its_result_kept(kube: Kube, namespace: str,  # type: ignore[no-untyped-def]
                                                                operator) -> None:
    runs.create(kube, namespace, _reviewed(timeout=3))
    run = runs.wait_phase(kube, namespace, "short-job", ("Rejected", "Succeeded", "Failed"), timeout=60)
    assert run["status"]["phase"] == "Rejected" and runs.condition(run, "Approved")["reason"] == "TimedOut"
    assert run["status"]["result"]["steps"] == 1 and run["status"]["attempt"] == 1
    assert health(run)["status"] == "Degraded"


# --- mid-run requests ------------------------------------------------------------------


def _asking(timeout: int | None = None) -> dict[str, Any]:
    approval = {"name": "send-report", "details": "POST the report to finance",
                **({"timeoutSeconds": timeout} if timeout else {})}
    return runs.example("short-job.yaml", payload={"steps": 1, "stepSeconds": 0.1, "approval": approval})


def _waiting_request(kube: Kube, ns: str) -> dict[str, Any]:
    return eventually(lambda: (r := runs.get(kube, ns, "short-job")) and ("send-report", 1) in _pending(r) and r,
                      timeout=60, what="the worker's pending request")


def test_a_request_approved_with_kubectl_tether_reaches_the_worker(  # type: ignore[no-untyped-def]
        kube: Kube, namespace: str, operator, bin_dir: Path) -> None:
    from tests.e2e.test_ship import kubectl

    runs.create(kube, namespace, _asking())
    waiting = _waiting_request(kube, namespace)
    [req] = [r for r in waiting["status"]["review"]["requests"] if r["gate"] == "send-report"]
    assert req["details"] == "POST the report to finance"
    assert waiting["status"]["phase"] == "Running" and waiting["status"]["holder"] == "short-job-a1"
    # What `kubectl get wr` shows while it waits: the REASON column says a person is awaited.
    table = _table(bin_dir, kube, namespace, "short-job")
    assert (table["PHASE"], table["REASON"]) == ("Running", "AwaitingApproval"), table
    assert health(waiting) == {"status": "Suspended",
                               "message": "Awaiting approval: short-job-a1 waits for a WorkerRunApproval with gate "
                                          "send-report"}
    eventually(lambda: "ApprovalPending" in runs.events(kube, namespace, "short-job"), timeout=15,
               what="the ApprovalPending event")  # posted after the status write it tells of
    wrong = kubectl(bin_dir, "tether", "approve", "short-job", "-n", namespace, "--gate", "send-report",
                    "--attempt", "2", "--reason", "numbers checked")
    assert wrong.returncode == 1 and "no pending send-report gate of attempt 2" in wrong.stderr, wrong
    done = kubectl(bin_dir, "tether", "approve", "short-job", "-n", namespace, "--gate", "send-report",
                   "--attempt", "1", "--reason", "numbers checked")
    assert done.returncode == 0, done
    assert "send-report (attempt 1)" in done.stdout and "details: POST the report to finance" in done.stdout, done
    run = runs.wait_phase(kube, namespace, "short-job", ("Succeeded", "Failed"), timeout=60)
    assert run["status"]["result"]["approval"] == {"decision": "Approve", "reason": "numbers checked",
                                                   "approver": kube.username()}
    [approval] = kube.ok(kube.get(APPROVALS.format(ns=namespace)))["items"]
    assert (approval["spec"]["gate"], approval["spec"]["attempt"]) == ("send-report", 1)
    # The approval lives as long as its run: owned by it, collected by Kubernetes' garbage collector.
    assert [o["uid"] for o in approval["metadata"]["ownerReferences"]] == [run["metadata"]["uid"]]
    kube.ok(kube.delete(Kube.wr_path(namespace, "short-job")))
    eventually(lambda: kube.ok(kube.get(APPROVALS.format(ns=namespace)))["items"] == [], timeout=60,
               what="the approval collected with its run")


def test_a_request_denied_or_timed_out_is_told_to_the_worker(kube: Kube, namespace: str,  # type: ignore[no-untyped-def]
                                                             operator) -> None:
    _grant_approver(kube, namespace, "alice")
    runs.create(kube, namespace, _asking())
    _waiting_request(kube, namespace)
    _decide(kube, namespace, "short-job", "send-report", "Deny", "not this month", attempt=1)
    run = runs.wait_phase(kube, namespace, "short-job", ("Succeeded", "Failed"), timeout=60)
    assert run["status"]["result"]["approval"]["decision"] == "Deny"
    assert run["status"]["result"]["approval"]["reason"] == "not this month"

    runs.create(kube, namespace, _asking(timeout=2), name="short-job-2")
    late = runs.wait_phase(kube, namespace, "short-job-2", ("Succeeded", "Failed"), timeout=60)
    assert late["status"]["result"]["approval"]["decision"] == "TimedOut"
    eventually(lambda: "ApprovalTimedOut" in runs.events(kube, namespace, "short-job-2"), timeout=15,
               what="the ApprovalTimedOut event")  # posted after the status write it tells of


@pytest.mark.local_cluster  # it freezes the worker's process through files on this machine
def test_a_stale_workers_request_is_refused_and_a_decision_reaches_only_its_attempt(  # type: ignore[no-untyped-def]
        kube: Kube, namespace: str, operator, tmp_path: Path) -> None:
    """Attempt 1 is frozen on its way to ask for an approval until its lease lapses and attempt 2
    holds the run (and asks too); then it wakes up and asks. Whatever it sends is refused by the API
    server (the audit log says so), the SDK raises LeaseLost, and no request of attempt 1 reaches
    the run's status; the approval of attempt 2's request reaches attempt 2 alone."""
    audit = AuditLog.from_env(from_end=True)
    _grant_approver(kube, namespace, "alice")
    out, gate = tmp_path / "out.jsonl", tmp_path / "gate"
    runs.create(kube, namespace, app_run("stale", {"holdAttempts": [1], "gateFile": str(gate), "outFile": str(out),
                                                   "approval": "wire-money"}, duration=8))
    pid = wait_line(out, event="started", attempt=1)["pid"]
    try:
        runs.wait_phase(kube, namespace, "stale", "Running", timeout=30)
        os.kill(pid, signal.SIGSTOP)
        watch_last_renewal(kube, namespace, "stale", "stale-a1", timeout=40)
        eventually(lambda: ("wire-money", 2) in _pending(runs.get(kube, namespace, "stale")), timeout=60,
                   what="attempt 2's request")
        gate.touch()  # attempt 1 leaves its hold at once and asks
        os.kill(pid, signal.SIGCONT)
        assert wait_line(out, timeout=60, event="approval_refused", attempt=1)["error"] == "LeaseLost"
    finally:
        os.kill(pid, signal.SIGKILL)
    _decide(kube, namespace, "stale", "wire-money", "Approve", "for attempt 2", attempt=2)
    assert wait_line(out, timeout=60, event="approval", attempt=2)["decision"] == "Approve"
    run = runs.wait_phase(kube, namespace, "stale", ("Succeeded", "Failed"), timeout=60)
    assert run["status"]["phase"] == "Succeeded"
    asked = [(r["gate"], r["attempt"]) for r in run["status"]["review"]["requests"]]
    assert asked == [("wire-money", 2)]
    # The oracle: every Lease write attempt 1's pod made after attempt 2's grant was refused.
    granted = dt.datetime.fromisoformat(run["status"]["attempts"][1]["startedAt"].replace("Z", "+00:00"))
    writes = [r for r in audit.read() if r.object_ref is not None and r.object_ref.resource == "leases"
              and r.object_ref.name == "stale" and r.verb in ("update", "patch") and r.user.pod == "stale-a1"
              and r.received > granted]
    assert writes and not any(r.accepted for r in writes), writes


# --- over the gateway ---------------------------------------------------------------------


@pytest.mark.local_cluster
def test_external_worker_asks_through_the_gateway_and_gets_the_reviewers_feedback(
        kube: Kube, namespace: str, gateway: str) -> None:
    _grant_approver(kube, namespace, "alice")
    token = worker_identity(kube, namespace, "ext")
    runs.create(kube, namespace, external_run("ext-job", review={"result": True}))
    open_attempt(kube, namespace, "ext-job")
    c = call(gateway, namespace, "ext-job", "claim", token, {}).json()
    fenced = {"holder": c["holder"], "fence": c["fence"], "runUid": c["runUid"]}
    # The approval call records the request; nothing is decided yet.
    asked = call(gateway, namespace, "ext-job", "approval", token,
                 {**fenced, "name": "refund", "details": "refund 30 EUR", "timeoutSeconds": 600})
    assert asked.status_code == 200 and asked.json()["decision"] is None, asked.text
    eventually(lambda: ("refund", 1) in _pending(runs.get(kube, namespace, "ext-job")), timeout=30,
               what="the request in the status")
    bad = call(gateway, namespace, "ext-job", "approval", token, {**fenced, "name": "Refund!"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "name", bad.text
    stale = call(gateway, namespace, "ext-job", "approval", token, {**fenced, "fence": c["fence"] + 1, "name": "x"})
    assert stale.status_code == 410, stale.text
    _decide(kube, namespace, "ext-job", "refund", "Approve", "within policy", attempt=1)

    def decided() -> dict[str, Any] | None:
        beat = call(gateway, namespace, "ext-job", "heartbeat", token, fenced).json()
        return beat["decisions"].get("refund")
    assert eventually(decided, timeout=30, what="the decision in the heartbeat reply") == {
        "decision": "Approve", "reason": "within policy", "approver": "alice"}
    done = call(gateway, namespace, "ext-job", "complete", token, {**fenced, "result": {"refunded": 30}})
    assert done.status_code == 200, done.text
    runs.wait_phase(kube, namespace, "ext-job", "AwaitingReview", timeout=30)
    _decide(kube, namespace, "ext-job", "Result", "Deny", "attach the receipt", attempt=1)
    open_attempt(kube, namespace, "ext-job")
    # The SDK over the gateway: request_approval blocks until a person decides.
    sdk = WorkerRun.claim(gateway, namespace, "ext-job", token)
    with sdk:
        assert sdk.attempt == 2 and sdk.review_feedback == "attach the receipt"
        threading.Thread(target=lambda: (
            eventually(lambda: ("deploy", 2) in _pending(runs.get(kube, namespace, "ext-job")), timeout=30,
                       what="attempt 2's request"),
            _decide(kube, namespace, "ext-job", "deploy", "Deny", "not today", attempt=2)), daemon=True).start()
        decision = sdk.request_approval("deploy", "deploy v2", timeout=600)
        assert (decision.decision, decision.reason, decision.approved) == ("Deny", "not today", False)
        sdk.complete({"refunded": 30, "receipt": "r-1"})
    _decide(kube, namespace, "ext-job", "Result", "Approve", "receipt attached", attempt=2)
    final = runs.wait_phase(kube, namespace, "ext-job", ("Succeeded", "Failed", "Rejected"), timeout=30)
    assert final["status"]["phase"] == "Succeeded" and final["status"]["result"]["receipt"] == "r-1"
