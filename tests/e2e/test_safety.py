"""Defects of the safety review (issue 9), each put exactly where it used to break.

Judged from the API server's objects (and, through the fault proxy, the requests the
operator really sent), never from the operator's own view.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from testkit import runs
from testkit.apiproxy import ApiProxy
from testkit.kube import Kube, eventually
from testkit.operator_process import OperatorProcess
from testkit.scenario import app_run, lease, lines, wait_line, fenced_result, held_by

pytestmark = pytest.mark.local_cluster

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


def external_run(name: str, duration: int = 8, renew: int = 1, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name},
            "spec": {"executor": "External", "payload": {},
                     "lease": {"durationSeconds": duration, "renewIntervalSeconds": renew,
                               "startupGraceSeconds": duration},
                     "retry": {"maxAttempts": 3, "backoff": {"initialSeconds": 0}}, **spec}}


def proxied_operator(proxy: ApiProxy, namespace: str, tmp_path: Path) -> OperatorProcess:
    return OperatorProcess(namespace, str(proxy.kubeconfig), tmp_path / "operator.log",
                           extra_env={"TETHER_FOLD_INTERVAL_SECONDS": "1"}).start()


def test_a_result_landing_while_a_lapse_is_being_confirmed_is_kept(kube: Kube, namespace: str,
                                                                   tmp_path: Path) -> None:
    """The review's critical defect: the operator decides 'lapsed' and awaits its confirming Lease
    GET; the worker's fenced result lands right then (and is answered 200). The revocation must not
    erase it: its status write is conditional on the run it decided from."""
    name = "late-result"
    with ApiProxy(os.environ["TETHER_TEST_KUBECONFIG"], seed=1) as proxy:
        op = proxied_operator(proxy, namespace, tmp_path)
        try:
            runs.create(kube, namespace, external_run(name))
            run = held_by(kube, namespace, name)
            gate = proxy.gate(method="GET", path=rf"/namespaces/{namespace}/leases/{name}$")
            # Nobody renews: after the startup grace the operator confirms the lapse with a GET.
            gate.wait_arrived(timeout=60)
            status = fenced_result(kube, namespace, name, run["status"]["fence"], run["status"]["holder"],
                                   {"answer": 42})
            assert status == 200  # the worker was told its result is accepted
            gate.release()
            final = runs.wait_phase(kube, namespace, name, ("Succeeded", "Failed", "Lost", "Backoff"), timeout=60)
        finally:
            op.stop()
    s = final["status"]
    assert s["phase"] == "Succeeded", s
    assert s["result"] == {"answer": 42}
    assert [a["outcome"] for a in s["attempts"]] == ["Succeeded"]


def test_an_invalid_pod_is_backed_off_and_recorded_not_retried_hot(kube: Kube, namespace: str,
                                                                    tmp_path: Path) -> None:
    """A pod the API server refuses ends its attempt PodRefused (the run's REASON, with the API
    server's message, and an Event), and the next try waits for the retry backoff: never a hot loop."""
    body = app_run("bad-template", {}, duration=60, renew=5)
    body["spec"]["template"]["spec"]["containers"][0]["name"] = "Not_A_DNS_Label"
    with ApiProxy(os.environ["TETHER_TEST_KUBECONFIG"], seed=2) as proxy:
        op = proxied_operator(proxy, namespace, tmp_path)
        try:
            runs.create(kube, namespace, body)
            run = eventually(lambda: (r := runs.get(kube, namespace, "bad-template")) and
                             (c := runs.condition(r, "Ready")) and c["reason"] == "PodRefused" and r,
                             timeout=60, what="the refusal recorded")
            ready = runs.condition(run, "Ready")
            assert "Not_A_DNS_Label" in ready["message"], ready
            assert run["status"]["attempts"][0]["outcome"] == "PodRefused", run["status"]["attempts"]
            eventually(lambda: "PodRefused" in runs.events(kube, namespace, "bad-template"), timeout=20,
                       what="a PodRefused event")
            first = proxy.wait_for_request(lambda r: r.method == "POST" and r.path.endswith("/pods"), timeout=10)
            # Measure the retry rate over a fixed window after the first refusal (a rate, not a condition).
            window_end = first.started + 15.0
            eventually(lambda: time.monotonic() >= window_end, timeout=30, interval=0.5, what="the window")
            creates = proxy.requests(lambda r: r.method == "POST" and r.path.endswith("/pods")
                                     and first.started <= r.started <= window_end)
        finally:
            op.stop()
    # One create per attempt, attempts apart by the retry backoff (10 s first): a hot loop makes thousands.
    assert 1 <= len(creates) <= 3, len(creates)
    assert 1 <= len(op.events("pod_refused")) <= 3  # logged once per refused attempt, not per pass
    assert op.events("reconcile_refused") == []  # an ended attempt, not a reconcile error


def test_deleting_a_running_run_ends_it_charges_once_and_leaves_nothing(kube: Kube, namespace: str, operator,
                                                                         tmp_path: Path) -> None:
    kube.ok(kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{namespace}/workerbudgets",
                      {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget", "metadata": {"name": "team"},
                       "spec": {"limitCents": 10_000}}))
    out = tmp_path / "out.jsonl"
    body = app_run("doomed", {"holdAttempts": [1], "outFile": str(out), "usageCents": 37}, duration=10, renew=1)
    body["spec"]["budget"] = {"budgetRef": {"name": "team"}}
    body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 2
    runs.create(kube, namespace, body)
    runs.wait_phase(kube, namespace, "doomed", "Running", timeout=60)
    wait_line(out, event="usage_reported", timeout=30)
    eventually(lambda: "tether.dev/run-cleanup" in runs.get(kube, namespace, "doomed")["metadata"]["finalizers"],
               timeout=10, what="the cleanup finalizer")
    kube.ok(kube.delete(Kube.wr_path(namespace, "doomed")))
    eventually(lambda: kube.get(Kube.wr_path(namespace, "doomed")).status_code == 404, timeout=60,
               what="the run gone")
    eventually(lambda: kube.get(f"/api/v1/namespaces/{namespace}/pods/doomed-a1").status_code == 404, timeout=60,
               what="its pod gone, not stuck Terminating")
    budget = kube.ok(kube.get(f"/apis/tether.dev/v1alpha1/namespaces/{namespace}/workerbudgets/team"))
    assert budget["status"]["spent"]["cents"] == 37  # the final usage, charged once
    assert operator.events("run_finalized")
    # The worker learned it no longer owns the run (the fence moved before the pod went).
    eventually(lambda: any(e.get("event") == "gate" and not e.get("owned") for e in lines(out)) or
               any(e.get("event") == "sigterm" for e in lines(out)), timeout=30, what="the worker told")


def test_deleting_a_namespace_ends_promptly_and_grants_nothing_new(kube: Kube, tmp_path: Path) -> None:
    ns = f"t-nsdel-{uuid.uuid4().hex[:5]}"
    kube.ok(kube.post("/api/v1/namespaces", {"metadata": {"name": ns, "labels": {"tether.dev/test": "true"}}}))
    eventually(lambda: kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default").status_code == 200,
               timeout=60, what="default service account")
    op = OperatorProcess(ns, os.environ["TETHER_TEST_KUBECONFIG"], tmp_path / "operator.log").start()
    try:
        for i in range(3):
            body = app_run(f"r{i}", {"holdAttempts": [1, 2, 3]}, duration=10, renew=1)
            body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 2
            runs.create(kube, ns, body)
        for i in range(3):
            runs.wait_phase(kube, ns, f"r{i}", "Running", timeout=60)
        granted_before = len(op.events("job_claimed"))
        kube.ok(kube.delete(f"/api/v1/namespaces/{ns}"))
        try:
            eventually(lambda: kube.get(f"/api/v1/namespaces/{ns}").status_code == 404, timeout=120,
                       what="the namespace gone")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; left: {_remaining(kube, ns)}") from None
    finally:
        op.stop()
    assert len(op.events("job_claimed")) == granted_before == 3
    assert not op.events("reconcile_bug")


def _remaining(kube: Kube, ns: str) -> str:
    """What still holds a namespace in Terminating (for the failure message)."""
    out = [json.dumps(kube.get(f"/api/v1/namespaces/{ns}").json().get("status"))]
    for path in (f"/api/v1/namespaces/{ns}/pods", Kube.wr_path(ns), LEASES.format(ns=ns)):
        for item in kube.get(path).json().get("items", []):
            meta = item["metadata"]
            out.append(f"{path.rsplit('/', 1)[-1]}/{meta['name']} finalizers={meta.get('finalizers')} "
                       f"deleting={bool(meta.get('deletionTimestamp'))}")
    return "; ".join(out)


def test_a_tampered_lease_fence_is_revoked_past_and_the_run_goes_on(kube: Kube, namespace: str, operator,
                                                                     tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    body = app_run("tampered", {"holdAttempts": [1], "outFile": str(out), "workSeconds": 0.5},
                   duration=10, renew=1)
    body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 2
    runs.create(kube, namespace, body)
    runs.wait_phase(kube, namespace, "tampered", "Running", timeout=60)
    kube.ok(kube.patch(LEASES.format(ns=namespace) + "/tampered", {"spec": {"leaseTransitions": 99}}))
    final = runs.wait_phase(kube, namespace, "tampered", ("Succeeded", "Failed", "Lost"), timeout=90)
    s = final["status"]
    assert s["phase"] == "Succeeded", s
    first, second = s["attempts"][0], s["attempts"][-1]
    assert first["outcome"] == "LeaseLost" and "someone other than Tether" in first["message"]
    assert second["fence"] > 99 and second["outcome"] == "Succeeded"
    assert "LeaseTampered" in runs.events(kube, namespace, "tampered")
    assert 1 <= len(operator.events("lease_tampered")) <= 2  # converged, no loop


def test_a_recreated_run_adopts_nothing_of_its_namesake(kube: Kube, namespace: str, operator,
                                                        tmp_path: Path) -> None:
    body = app_run("again", {"holdAttempts": [1]}, duration=10, renew=1)
    body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30
    old = runs.create(kube, namespace, body)
    runs.wait_phase(kube, namespace, "again", "Running", timeout=60)
    kube.ok(kube.delete(Kube.wr_path(namespace, "again")))
    eventually(lambda: kube.get(Kube.wr_path(namespace, "again")).status_code == 404, timeout=60,
               what="the first run gone")
    new = runs.create(kube, namespace, body)
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    runs.wait_phase(kube, namespace, "again", "Running", timeout=90)
    uid = new["metadata"]["uid"]

    def owner(path: str) -> str:
        return kube.ok(kube.get(path))["metadata"]["ownerReferences"][0]["uid"]

    assert owner(f"/api/v1/namespaces/{namespace}/pods/again-a1") == uid
    assert owner(LEASES.format(ns=namespace) + "/again") == uid
    # Its worker identity is the namespace's, which no run owns (deleting one leaves it to the rest).
    pod = kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/pods/again-a1"))
    assert pod["spec"]["serviceAccountName"] == "tether-worker"
    role = kube.ok(kube.get(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles/tether-worker"))
    assert not role["metadata"].get("ownerReferences")


def test_a_run_ended_by_its_last_pod_leaves_no_finalizer(kube: Kube, namespace: str, operator) -> None:
    runs.create(kube, namespace, runs.example("crashing-job.yaml", payload={"steps": 2, "stepSeconds": 0.1,
                                                                            "crashAttempts": [1, 2, 3, 4, 5]},
                                              retry={"maxAttempts": 1}))
    run = runs.wait_phase(kube, namespace, "crashing-job", ("Failed", "Succeeded", "Lost"), timeout=60)
    assert run["status"]["phase"] == "Failed"
    eventually(lambda: "tether.dev/attempt-tracking" not in
               (kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/pods/crashing-job-a1"))["metadata"]
                .get("finalizers") or []), timeout=30, what="the pod released")
    kube.ok(kube.delete(Kube.wr_path(namespace, "crashing-job")))
    eventually(lambda: kube.get(f"/api/v1/namespaces/{namespace}/pods/crashing-job-a1").status_code == 404,
               timeout=60, what="the pod collected with its run")
