"""The start gate on the real control plane: a run waits for a person's WorkerRunApproval, starts
when approved, ends Rejected when denied or when nobody decides in time; what kstatus and Argo CD
say while it waits; and no pod exists before the approval (the audit log says so, not Tether)."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_approvals import APPROVALS, _approval, _as, _grant_approver
from testkit import runs
from testkit.audit import AuditLog
from testkit.kube import Kube, eventually, refused
from tests.unit.chart.test_argocd_health import health


def _gated(timeout: int | None = None) -> dict[str, Any]:
    body = runs.example("short-job.yaml", payload={"steps": 1, "stepSeconds": 0.1})
    body["spec"]["review"] = {"start": True, **({"startTimeoutSeconds": timeout} if timeout else {})}
    return body


def after_creation_second(kube: Kube, ns: str, run: str) -> None:
    """Waits until the API server's clock is past the second `run` was created in: a name-only
    approval made in that second does not count (it may be a deleted namesake's; README, Review)."""
    created = dt.datetime.fromisoformat(kube.ok(kube.get(Kube.wr_path(ns, run)))["metadata"]["creationTimestamp"]
                                        .replace("Z", "+00:00"))
    eventually(lambda: parsedate_to_datetime(kube.get(Kube.wr_path(ns, run)).headers["Date"]) > created,
               timeout=5, what=f"the API server's clock past {created}")


def _decide(kube: Kube, ns: str, decision: str, reason: str) -> dict[str, Any]:
    after_creation_second(kube, ns, "short-job")
    body = _approval("alice", decision=decision)
    body["spec"]["runRef"] = {"name": "short-job"}
    body["spec"]["reason"] = reason
    return kube.ok(kube.post(APPROVALS.format(ns=ns), body, headers=_as("alice")))


def _pod_creations(audit: AuditLog, ns: str) -> list[Any]:
    return [r for r in audit.read() if r.verb == "create" and r.object_ref is not None
            and r.object_ref.resource == "pods" and r.object_ref.namespace == ns and r.accepted]


def test_an_approved_start(kube: Kube, namespace: str, operator, tools_dir: Path,  # type: ignore[no-untyped-def]
                           tmp_path: Path) -> None:
    audit = AuditLog.from_env(from_end=True)
    _grant_approver(kube, namespace, "alice")
    runs.create(kube, namespace, _gated())
    waiting = runs.wait_phase(kube, namespace, "short-job", "AwaitingApproval", timeout=30)
    assert runs.condition(waiting, "Approved")["reason"] == "Pending"
    path = tmp_path / "waiting.json"
    path.write_text(json.dumps(waiting))
    out = subprocess.run([str(tools_dir / "kstatus-check"), str(path)], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)[0]["status"] == "InProgress"
    assert health(waiting)["status"] == "Suspended"
    eventually(lambda: "ApprovalPending" in runs.events(kube, namespace, "short-job"), timeout=15,
               what="the ApprovalPending event")  # posted after the status write it tells of

    approval = _decide(kube, namespace, "Approve", "estimate checked")
    done = runs.wait_phase(kube, namespace, "short-job", ("Succeeded", "Failed", "Rejected"), timeout=60)
    assert done["status"]["phase"] == "Succeeded"
    approved = runs.condition(done, "Approved")
    assert (approved["status"], approved["reason"]) == ("True", "Approved")
    assert "approved by alice: estimate checked" in approved["message"]
    eventually(lambda: "Approved" in runs.events(kube, namespace, "short-job"), timeout=15,
               what="the Approved event")  # posted after the status write it tells of
    # No pod before the approval: in the API server's audit log, the first pod creation in the
    # namespace comes after the approval's creation completed.
    created = eventually(lambda: _pod_creations(audit, namespace), timeout=10, what="the pod creation")
    decided = [r for r in audit.read() if r.verb == "create" and r.object_ref is not None
               and r.object_ref.resource == "workerrunapprovals" and r.object_ref.namespace == namespace]
    assert len([r for r in decided if r.accepted]) == 1 and approval["spec"]["decision"] == "Approve"
    assert min(r.received for r in created) > next(r for r in decided if r.accepted).completed


def test_a_denied_start_ends_rejected_without_a_pod(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    audit = AuditLog.from_env(from_end=True)
    _grant_approver(kube, namespace, "alice")
    runs.create(kube, namespace, _gated())
    runs.wait_phase(kube, namespace, "short-job", "AwaitingApproval", timeout=30)
    _decide(kube, namespace, "Deny", "too expensive")
    run = runs.wait_phase(kube, namespace, "short-job", ("Rejected", "Succeeded"), timeout=30)
    assert run["status"]["phase"] == "Rejected"
    denied = runs.condition(run, "Approved")
    assert (denied["status"], denied["reason"]) == ("False", "Denied") and "too expensive" in denied["message"]
    assert health(run)["status"] == "Degraded" and run["status"].get("attempt", 0) == 0
    assert _pod_creations(audit, namespace) == []


def test_kubectl_tether_approve_records_the_current_user(kube: Kube, namespace: str, operator,  # type: ignore[no-untyped-def]
                                                        bin_dir: Path) -> None:
    from tests.e2e.test_ship import kubectl

    runs.create(kube, namespace, _gated())
    runs.wait_phase(kube, namespace, "short-job", "AwaitingApproval", timeout=30)
    wrong = kubectl(bin_dir, "tether", "approve", "short-job", "-n", namespace, "--gate", "Ship It",
                    "--reason", "looks right")
    # Only a pending gate can be decided; the message says which are.
    assert wrong.returncode == 1 and "no pending Ship It gate; pending: Start (attempt 0)" in wrong.stderr, wrong
    done = kubectl(bin_dir, "tether", "approve", "short-job", "-n", namespace, "--gate", "start",
                   "--reason", "looks right")
    assert done.returncode == 0 and "Approve Start (attempt 0) of short-job" in done.stdout, done
    image = runs.get(kube, namespace, "short-job")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert f"by {kube.username()}" in done.stdout and image in done.stdout, done
    run = runs.wait_phase(kube, namespace, "short-job", ("Succeeded", "Failed", "Rejected"), timeout=60)
    assert run["status"]["phase"] == "Succeeded"
    approvals = kube.ok(kube.get(APPROVALS.format(ns=namespace)))["items"]
    assert [(a["spec"]["approver"], a["spec"]["runRef"].get("uid")) for a in approvals] == [
        (kube.username(), run["metadata"]["uid"])]
    again = kubectl(bin_dir, "tether", "deny", "short-job", "-n", namespace, "--reason", "late")
    assert again.returncode == 1 and "no pending Start gate" in again.stderr, again


@pytest.mark.local_cluster  # it starts an operator of its own to read its metrics
def test_metrics_count_the_waiting_and_time_the_decision(kube: Kube, namespace: str, tmp_path: Path) -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from tests.e2e.test_ship import _free_port, _kubeconfig
    from testkit.operator_process import OperatorProcess

    port = _free_port()
    op = OperatorProcess(namespace, _kubeconfig(), tmp_path / "op.log", extra_args=[f"--metrics-port={port}"]).start()
    try:
        _grant_approver(kube, namespace, "alice")

        def value(name: str, **labels: str) -> float:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                       if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

        runs.create(kube, namespace, _gated())
        runs.wait_phase(kube, namespace, "short-job", "AwaitingApproval", timeout=30)
        eventually(lambda: value("tether_approvals_pending", gate="Start") == 1, timeout=20, what="one pending")
        assert value("tether_approval_decision_seconds_count", gate="Start", decision="Approve") == 0
        _decide(kube, namespace, "Approve", "fine")
        runs.wait_phase(kube, namespace, "short-job", ("Starting", "Running", "Succeeded"), timeout=30)
        eventually(lambda: value("tether_approvals_pending", gate="Start") == 0, timeout=20, what="none pending")
        assert value("tether_approval_decision_seconds_count", gate="Start", decision="Approve") == 1
    finally:
        op.stop()


def test_no_decision_in_time_rejects(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    runs.create(kube, namespace, _gated(timeout=3))
    run = runs.wait_phase(kube, namespace, "short-job", ("Rejected", "Succeeded"), timeout=30)
    assert run["status"]["phase"] == "Rejected"
    assert runs.condition(run, "Approved")["reason"] == "TimedOut"


def test_what_waits_for_approval_cannot_be_changed(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    """The approval is for what the run will execute: its template and payload are fixed from
    creation, not only from its first attempt."""
    runs.create(kube, namespace, _gated())
    runs.wait_phase(kube, namespace, "short-job", "AwaitingApproval", timeout=30)
    for change in ({"payload": {"steps": 99}}, {"executor": "External"},
                   {"template": {"spec": {"containers": [{"name": "w", "image": "evil", "command": ["sh"]}]}}}):
        refused(kube.patch(Kube.wr_path(namespace, "short-job"), {"spec": change}), "what is approved is what runs")


def test_the_gate_cannot_be_removed_from_a_waiting_run(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    runs.create(kube, namespace, _gated())
    runs.wait_phase(kube, namespace, "short-job", "AwaitingApproval", timeout=30)
    refused(kube.patch(Kube.wr_path(namespace, "short-job"), {"spec": {"review": None}}), "spec.review is immutable")
    assert runs.get(kube, namespace, "short-job")["status"]["phase"] == "AwaitingApproval"


def test_an_approval_starts_only_the_fields_it_approved(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    """Issue 21, defect 2. The Start gate's entry records the digest of the execution fields it asks
    to approve, and no attempt starts with others. The API server refuses the edit itself, so the
    test puts the difference where CEL cannot look, as a bypass of the rule would: in the entry."""
    from tether.api.models import WorkerRun
    from tether.core.execution import execution_digest

    audit = AuditLog.from_env(from_end=True)
    _grant_approver(kube, namespace, "alice")
    runs.create(kube, namespace, _gated())
    path = Kube.wr_path(namespace, "short-job")
    waiting = runs.wait_phase(kube, namespace, "short-job", "AwaitingApproval", timeout=30)
    [entry] = waiting["status"]["review"]["requests"]
    assert entry["executionDigest"] == execution_digest(WorkerRun.model_validate(waiting).spec)
    refused(kube.patch(path, {"spec": {"payload": {"steps": None, "stepz": 1}}}), "immutable")

    def pin(digest: str) -> bool:
        run = runs.get(kube, namespace, "short-job")
        requests = [{**r, "executionDigest": digest} if r["gate"] == "Start" else r
                    for r in run["status"]["review"]["requests"]]
        patch = {"metadata": {"resourceVersion": run["metadata"]["resourceVersion"]},
                 "status": {"review": {**run["status"]["review"], "requests": requests}}}
        return kube.patch(path + "/status", patch).status_code == 200  # 409: the operator wrote first

    eventually(lambda: pin("sha256:" + "0" * 64), timeout=10, what="the Start entry rewritten")
    _decide(kube, namespace, "Approve", "estimate checked")

    def spec_changed() -> dict[str, Any] | None:
        run = runs.get(kube, namespace, "short-job")
        stalled = runs.condition(run, "Stalled") or {}
        return run if (stalled.get("status"), stalled.get("reason")) == ("True", "SpecChanged") else None

    run = eventually(spec_changed, timeout=30, what="Stalled=True SpecChanged")
    assert (run["status"]["phase"], run["status"].get("attempt", 0)) == ("Pending", 0)
    assert runs.condition(run, "Approved")["status"] == "True"  # decided, and still not started
    assert "create a new WorkerRun" in runs.condition(run, "Ready")["message"]
    eventually(lambda: "SpecChanged" in runs.events(kube, namespace, "short-job"), timeout=15,
               what="the SpecChanged event")
    assert _pod_creations(audit, namespace) == []
    # The approved fields back in place, the run starts.
    eventually(lambda: pin(entry["executionDigest"]), timeout=10, what="the Start entry restored")
    done = runs.wait_phase(kube, namespace, "short-job", ("Succeeded", "Failed", "Rejected"), timeout=60)
    assert done["status"]["phase"] == "Succeeded"
    assert done["status"]["executionDigest"] == entry["executionDigest"]
