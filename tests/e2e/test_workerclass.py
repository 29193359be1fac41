"""WorkerClass end to end: a class's defaults reach the run's pod and its Lease, are recorded in
status.class and fixed from the first attempt on (a class edited later changes nothing of a started
run), and a run naming a class that does not exist waits Pending until it does."""

from __future__ import annotations

from typing import Any

import pytest

from testkit import runs
from testkit.kube import Kube, eventually

CLASSES = "/apis/tether.dev/v1alpha1/workerclasses"
CLASS_LEASE = {"durationSeconds": 13, "renewIntervalSeconds": 2, "startupGraceSeconds": 40}


def _env(kube: Kube, ns: str, pod: str) -> dict[str, str]:
    body = kube.ok(kube.get(f"/api/v1/namespaces/{ns}/pods/{pod}"))
    return {e["name"]: e.get("value", "") for e in body["spec"]["containers"][0].get("env") or []}


def _lease_seconds(kube: Kube, ns: str, name: str) -> int:
    return int(kube.ok(kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}"))["spec"]
               ["leaseDurationSeconds"])


def _classless_job(name: str, class_name: str, steps: int) -> dict[str, Any]:
    body = runs.example("short-job.yaml", payload={"steps": steps, "stepSeconds": 0.5})
    del body["spec"]["lease"]  # the class's
    body["metadata"]["name"] = name
    body["spec"]["className"] = class_name
    return body


@pytest.mark.local_cluster
def test_a_class_default_reaches_the_pod_and_a_class_edit_leaves_a_started_run_as_it_was(
        kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    name = f"{namespace}-tools"
    kube.ok(kube.post(CLASSES, {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerClass", "metadata": {"name": name},
                                "spec": {"defaults": {"lease": CLASS_LEASE, "stopGraceSeconds": 3}}}))
    try:
        runs.create(kube, namespace, _classless_job("job", name, steps=16))
        run = runs.wait_phase(kube, namespace, "job", "Running", timeout=60)
        assert run["status"]["class"] == {"name": name, "defaults": {"lease": CLASS_LEASE, "stopGraceSeconds": 3}}
        assert "lease" not in run["spec"]  # the spec stays the user's
        env = _env(kube, namespace, "job-a1")
        assert (env["TETHER_LEASE_DURATION_SECONDS"], env["TETHER_RENEW_INTERVAL_SECONDS"]) == ("13", "2")
        assert _lease_seconds(kube, namespace, "job") == 13

        edited = kube.ok(kube.get(f"{CLASSES}/{name}"))
        edited["spec"]["defaults"]["lease"] = {"durationSeconds": 60, "renewIntervalSeconds": 20}
        edited["spec"]["defaults"]["stopGraceSeconds"] = 30
        kube.ok(kube.put(f"{CLASSES}/{name}", edited))
        # The edit wakes the class's unpinned runs only; this one keeps what it started with to the end.
        done = runs.wait_phase(kube, namespace, "job", ("Succeeded", "Failed", "Lost"), timeout=60)
        assert done["status"]["phase"] == "Succeeded", done["status"]
        assert done["status"]["class"]["defaults"]["lease"] == CLASS_LEASE
        assert _lease_seconds(kube, namespace, "job") == 13

        # A run created after the edit takes the class as it is now.
        runs.create(kube, namespace, _classless_job("later", name, steps=1))
        later = runs.wait_phase(kube, namespace, "later", ("Succeeded", "Failed", "Lost"), timeout=60)
        assert later["status"]["class"]["defaults"]["lease"]["durationSeconds"] == 60
    finally:
        kube.delete(f"{CLASSES}/{name}")


@pytest.mark.local_cluster
def test_a_run_of_a_missing_class_waits_pending_until_the_class_exists(
        kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    name = f"{namespace}-later"
    runs.create(kube, namespace, _classless_job("job", name, steps=1))
    waiting = eventually(lambda: (r := runs.get(kube, namespace, "job")) and
                         (runs.condition(r, "Stalled") or {}).get("reason") == "ClassNotFound" and r,
                         timeout=30, what="the run held for its class")
    assert waiting["status"]["phase"] == "Pending" and waiting["status"].get("attempt", 0) == 0
    assert f"WorkerClass {name} does not exist" in runs.condition(waiting, "Ready")["message"]
    eventually(lambda: "ClassNotFound" in runs.events(kube, namespace, "job"), timeout=10, what="the Warning Event")
    kube.ok(kube.post(CLASSES, {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerClass", "metadata": {"name": name},
                                "spec": {"defaults": {"lease": CLASS_LEASE}}}))
    try:
        # The class's creation wakes the run (no timer: it waited without one).
        done = runs.wait_phase(kube, namespace, "job", ("Succeeded", "Failed", "Lost"), timeout=60)
        assert done["status"]["phase"] == "Succeeded", done["status"]
        assert done["status"]["class"] == {"name": name, "defaults": {"lease": CLASS_LEASE}}
        assert runs.condition(done, "Stalled")["status"] == "False"
    finally:
        kube.delete(f"{CLASSES}/{name}")
