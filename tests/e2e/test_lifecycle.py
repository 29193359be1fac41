"""WorkerRuns end to end: the operator as a subprocess, the real SDK inside process-kubelet pods."""

from __future__ import annotations

from tests.conftest import pod_log
from tests.support import runs
from tests.support.kube import Kube, eventually


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
    lease = kube.ok(kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/short-job"))
    assert lease["spec"].get("holderIdentity") is None and lease["spec"]["leaseTransitions"] == 2
    assert lease["metadata"]["ownerReferences"][0]["uid"] == run["metadata"]["uid"]
    eventually(lambda: {"AttemptStarted", "Succeeded"} <= set(runs.events(kube, namespace, "short-job")),
               timeout=10, what="events")
    assert '"event": "worker_started"' in pod_log(namespace, "short-job-a1")
    claimed = operator.events("job_claimed")
    assert claimed and {"run", "attempt", "fence", "holder", "leaseDeadline"} <= set(claimed[0])
