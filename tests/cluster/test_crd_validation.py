"""The API server enforces the WorkerRun contract: CEL rules and schema, no operator needed."""

from __future__ import annotations

from tests.support.kube import Kube


def _run(name: str = "r", **spec: object) -> dict:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name},
            "spec": {"executor": "External", "payload": {"n": 1}, **spec}}


def _started(kube: Kube, ns: str) -> str:
    kube.ok(kube.post(Kube.wr_path(ns), _run()))
    path = Kube.wr_path(ns, "r")
    kube.ok(kube.patch(path + "/status", {"status": {"attempt": 1, "fence": 1, "holder": "r-a1", "phase": "Running"}}))
    return path


def test_defaults_are_applied(kube: Kube, namespace: str) -> None:
    run = kube.ok(kube.post(Kube.wr_path(namespace), _run()))
    assert run["spec"]["lease"] == {"durationSeconds": 90, "renewIntervalSeconds": 30, "startupGraceSeconds": 120}
    assert run["spec"]["retry"]["maxAttempts"] == 3 and run["spec"]["stop"] is False


def test_execution_fields_are_immutable_once_started(kube: Kube, namespace: str) -> None:
    path = _started(kube, namespace)
    resp = kube.patch(path, {"spec": {"payload": {"n": 2}}})
    assert resp.status_code == 422, resp.text
    assert "spec.payload" in resp.json()["message"] and "immutable once the run has started" in resp.json()["message"]
    resp = kube.patch(path, {"spec": {"lease": {"durationSeconds": 300}}})
    assert resp.status_code == 422
    # Control fields stay mutable.
    assert kube.ok(kube.patch(path, {"spec": {"stop": True, "suspend": True, "budget": {"capCents": 900}}}))["spec"]["stop"]


def test_execution_fields_are_mutable_before_start(kube: Kube, namespace: str) -> None:
    kube.ok(kube.post(Kube.wr_path(namespace), _run()))
    assert kube.ok(kube.patch(Kube.wr_path(namespace, "r"), {"spec": {"payload": {"n": 2}}}))["spec"]["payload"] == {"n": 2}


def test_fence_never_decreases(kube: Kube, namespace: str) -> None:
    path = _started(kube, namespace)
    resp = kube.patch(path + "/status", {"status": {"fence": 0}})
    assert resp.status_code == 422 and "status.fence never decreases" in resp.json()["message"], resp.text
    assert kube.ok(kube.get(path))["status"]["fence"] == 1


def test_retry_rule_needs_exactly_one_matcher(kube: Kube, namespace: str) -> None:
    resp = kube.post(Kube.wr_path(namespace), _run(retry={"rules": [{"action": "Retry"}]}))
    assert resp.status_code == 422 and "spec.retry.rules[0]" in resp.json()["message"], resp.text
