"""WorkerRuns end to end: the operator as a subprocess, the real SDK inside process-kubelet pods."""

from __future__ import annotations

import pytest

from tests.conftest import pod_log
from testkit import runs
from testkit.kube import Kube, eventually


@pytest.mark.local_cluster
def test_happy_path(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    runs.create(kube, namespace, runs.example("short-job.yaml", payload={"steps": 3, "stepSeconds": 0.3}))
    run = runs.wait_phase(kube, namespace, "short-job", ("Succeeded", "Failed", "Lost"), timeout=60)
    s = run["status"]
    assert s["phase"] == "Succeeded", s
    assert s["result"] == {"steps": 3, "resumedFrom": 0}
    assert s["checkpoint"]["cursor"] == "3"
    assert [a["outcome"] for a in s["attempts"]] == ["Succeeded"]
    assert s["attempts"][0]["fence"] == 1 and s["fence"] == 2  # grant, then release
    assert "holder" not in s
    assert runs.condition(run, "Ready")["status"] == "True"
    assert runs.condition(run, "Succeeded")["status"] == "True"
    assert runs.condition(run, "Reconciling")["status"] == "False"
    assert s["observedGeneration"] == run["metadata"]["generation"]
    # The lease is cleared right after the status write that ended the attempt (revocation order).
    lease = eventually(lambda: (l := kube.ok(kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/short-job")))
                       ["spec"].get("holderIdentity") is None and l, timeout=10, what="lease cleared")
    assert lease["spec"]["leaseTransitions"] == 2
    assert lease["metadata"]["ownerReferences"][0]["uid"] == run["metadata"]["uid"]
    eventually(lambda: {"AttemptStarted", "Succeeded"} <= set(runs.events(kube, namespace, "short-job")),
               timeout=10, what="events")
    assert '"event": "worker_started"' in pod_log(namespace, "short-job-a1")
    claimed = operator.events("job_claimed")
    assert claimed and {"run", "attempt", "fence", "holder", "leaseDeadline"} <= set(claimed[0])


def test_status_writes_keep_what_the_user_and_other_managers_wrote(kube: Kube, namespace: str,  # type: ignore[no-untyped-def]
                                                                   operator) -> None:
    """The operator caches runs without managedFields and kubectl's last-applied annotation (half
    of each object at scale) and writes status from that: the stored object keeps both."""
    body = runs.example("short-job.yaml", payload={"steps": 2, "stepSeconds": 0.2})
    applied = '{"kind":"WorkerRun","metadata":{"name":"short-job"}}'
    body["metadata"]["annotations"] = {"kubectl.kubernetes.io/last-applied-configuration": applied, "team": "a"}
    runs.create(kube, namespace, body)
    run = runs.wait_phase(kube, namespace, "short-job", ("Succeeded", "Failed", "Lost"), timeout=60)
    assert run["status"]["phase"] == "Succeeded"
    stored = kube.ok(kube.get(Kube.wr_path(namespace, "short-job")))["metadata"]
    assert stored["annotations"] == {"kubectl.kubernetes.io/last-applied-configuration": applied, "team": "a"}
    # Kept: the creator's entry and the operator's status entry (its writes omitted managedFields).
    entries = {(m["operation"], m.get("subresource", "")) for m in stored.get("managedFields") or []}
    assert {("Update", ""), ("Update", "status")} <= entries, stored.get("managedFields")


def test_crash_is_retried_from_the_checkpoint(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    runs.create(kube, namespace, runs.example("crashing-job.yaml", payload={"steps": 6, "stepSeconds": 0.3,
                                                                            "crashAttempts": [1]}))
    run = runs.wait_phase(kube, namespace, "crashing-job", ("Succeeded", "Failed", "Lost"), timeout=60)
    s = run["status"]
    assert s["phase"] == "Succeeded", s
    first, second = s["attempts"]
    assert first["outcome"] == "PodFailed" and first["exitCode"] == 3
    assert second["outcome"] == "Succeeded" and second["fence"] == 3
    assert s["result"]["resumedFrom"] >= 1  # the second attempt started from the checkpoint
    assert "BackoffStarted" in runs.events(kube, namespace, "crashing-job")


def test_exit_code_rule_fails_the_run(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    body = runs.example("crashing-job.yaml", payload={"steps": 2, "stepSeconds": 0.2, "crashAttempts": [1]})
    body["spec"]["retry"]["rules"] = [{"action": "FailRun", "onExitCodes": {"operator": "In", "values": [3]}}]
    runs.create(kube, namespace, body)
    run = runs.wait_phase(kube, namespace, "crashing-job", ("Succeeded", "Failed", "Lost"), timeout=60)
    assert run["status"]["phase"] == "Failed" and len(run["status"]["attempts"]) == 1
    assert runs.condition(run, "Stalled")["status"] == "True"
    assert runs.condition(run, "Failed")["status"] == "True"


@pytest.mark.local_cluster
def test_a_refused_pod_backs_off_then_fails_the_run_pod_refused(kube: Kube, namespace: str,  # type: ignore[no-untyped-def]
                                                                 operator) -> None:
    """Issue 34: a template the CRD admits and the API server refuses at pod create (a container name
    that is no DNS label: the pod's schema has no pattern for it, its validation does) used to leave
    the run Starting, its lease held, until the startup grace passed. Each attempt now ends
    PodRefused at once (fenced like any ended attempt), backs off, and the run fails PodRefused when
    its attempts are used up, with no attempt ever shown as running or renewed."""
    body = runs.example("short-job.yaml", lease={"startupGraceSeconds": 300},
                        retry={"maxAttempts": 2, "backoff": {"initialSeconds": 3, "maxSeconds": 3, "factor": 1}})
    body["spec"]["template"]["spec"]["containers"][0]["name"] = "Worker_1"
    runs.create(kube, namespace, body)
    seen: list[tuple[str, str]] = []

    def finished() -> dict | None:
        run = runs.get(kube, namespace, "short-job")
        ready = runs.condition(run, "Ready") or {}
        seen.append(((run.get("status") or {}).get("phase", ""), ready.get("reason", "")))
        return run if seen[-1][0] == "Failed" else None

    # Well within the startup grace (300 s): no lapse is what ended these attempts.
    run = eventually(finished, timeout=60, interval=0.1, what="the run Failed")
    s = run["status"]
    assert ("Backoff", "PodRefused") in seen, seen  # the REASON column said why while it waited
    assert "Running" not in {phase for phase, _ in seen}, seen
    ready = runs.condition(run, "Ready")
    refusal = 'spec.containers[0].name: Invalid value: "Worker_1"'
    assert ready["reason"] == "PodRefused" and refusal in ready["message"], ready
    assert runs.condition(run, "Failed")["reason"] == "PodRefused"
    assert s["error"]["code"] == "PodRefused"
    assert [a["outcome"] for a in s["attempts"]] == ["PodRefused", "PodRefused"]
    assert all(refusal in a["message"] for a in s["attempts"]), s["attempts"]
    assert (s["fence"], s.get("holder"), s.get("lastRenewTime")) == (4, None, None)  # granted and fenced twice
    # The Lease is cleared right after the status write that ended the attempt (revocation order).
    lease = eventually(lambda: (l := kube.ok(kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/"
                                                      "short-job"))["spec"]).get("holderIdentity") is None and l,
                       timeout=10, what="the lease cleared")
    assert lease["leaseTransitions"] == 4
    for pod in ("short-job-a1", "short-job-a2"):
        assert kube.get(f"/api/v1/namespaces/{namespace}/pods/{pod}").status_code == 404
    eventually(lambda: {"PodRefused", "BackoffStarted", "Failed"} <= set(runs.events(kube, namespace, "short-job")),
               timeout=10, what="events")
    assert sorted({e["pod"] for e in operator.events("pod_refused")}) == ["short-job-a1", "short-job-a2"]


@pytest.mark.local_cluster
def test_stop_is_signalled_and_cancels(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    runs.create(kube, namespace, runs.example("long-job.yaml"))
    runs.wait_phase(kube, namespace, "long-job", "Running", timeout=30)
    kube.ok(kube.patch(Kube.wr_path(namespace, "long-job"), {"spec": {"stop": True}}))
    run = runs.wait_phase(kube, namespace, "long-job", "Cancelled", timeout=30)
    assert run["status"]["attempts"][0]["outcome"] == "Cancelled" and "holder" not in run["status"]
    # The worker heard the stop signal on a heartbeat and stopped by itself, within the grace period.
    assert '"event": "worker_stopped"' in pod_log(namespace, "long-job-a1")
    pod = kube.get(f"/api/v1/namespaces/{namespace}/pods/long-job-a1")
    assert pod.status_code == 404 or pod.json()["status"]["phase"] in ("Succeeded", "Failed")


@pytest.mark.local_cluster
def test_stop_without_cooperation_deletes_the_pod_after_grace(kube: Kube, namespace: str, operator,  # type: ignore[no-untyped-def]
                                                              tmp_path) -> None:
    from testkit.scenario import app_run

    body = app_run("deaf", {"holdAttempts": [1], "outFile": str(tmp_path / "out.jsonl")})
    body["spec"]["stopGraceSeconds"] = 2
    body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 1
    runs.create(kube, namespace, body)
    runs.wait_phase(kube, namespace, "deaf", "Running", timeout=30)
    kube.ok(kube.patch(Kube.wr_path(namespace, "deaf"), {"spec": {"stop": True}}))
    run = runs.wait_phase(kube, namespace, "deaf", "Cancelled", timeout=30)
    assert run["status"]["attempts"][0]["outcome"] == "Cancelled"
    eventually(lambda: kube.get(f"/api/v1/namespaces/{namespace}/pods/deaf-a1").status_code == 404,
               timeout=30, what="the pod of a worker that ignored the stop is deleted")


def test_suspend_holds_new_attempts_until_resumed(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    body = runs.example("short-job.yaml", payload={"steps": 1, "stepSeconds": 0.1}, suspend=True)
    runs.create(kube, namespace, body)
    run = runs.wait_phase(kube, namespace, "short-job", "Suspended", timeout=30)
    assert run["status"].get("attempt", 0) == 0
    assert kube.get(f"/api/v1/namespaces/{namespace}/pods/short-job-a1").status_code == 404
    kube.ok(kube.patch(Kube.wr_path(namespace, "short-job"), {"spec": {"suspend": False}}))
    runs.wait_phase(kube, namespace, "short-job", "Succeeded", timeout=60)


def test_deadline_exceeded_then_ttl_deletes(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    body = runs.example("long-job.yaml", deadlineSeconds=3, ttlSecondsAfterFinished=2)
    runs.create(kube, namespace, body)
    run = runs.wait_phase(kube, namespace, "long-job", "DeadlineExceeded", timeout=30)
    assert run["status"]["attempts"][0]["outcome"] == "DeadlineExceeded"
    assert runs.condition(run, "Stalled")["status"] == "True"
    eventually(lambda: kube.get(Kube.wr_path(namespace, "long-job")).status_code == 404, timeout=30,
               what="the finished run deleted after its TTL")
