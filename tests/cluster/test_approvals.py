"""WorkerRunApproval on the real API server: who may decide is RBAC, the record of who did cannot be
forged (policies/approval-approver.yaml), and a decision is never rewritten (the CRD's rule)."""

from __future__ import annotations

from typing import Any

import httpx

from testkit.kube import Kube, eventually, refused

APPROVALS = "/apis/tether.dev/v1alpha1/namespaces/{ns}/workerrunapprovals"


def _as(user: str) -> dict[str, str]:
    """The admin client acting as `user` (impersonation): RBAC and admission see that user."""
    return {"Impersonate-User": user}


def _approval(approver: str, gate: str = "Start", decision: str = "Approve", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunApproval",
            "metadata": {"generateName": "approve-"},
            "spec": {"runRef": {"name": "invoice"}, "gate": gate, "decision": decision,
                     "reason": "checked the estimate", "approver": approver, **spec}}


def _grant_approver(kube: Kube, ns: str, user: str) -> None:
    kube.ok(kube.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", {
        "metadata": {"name": "approver"},
        "rules": [{"apiGroups": ["tether.dev"], "resources": ["workerrunapprovals"],
                   "verbs": ["create", "get", "list", "update", "patch"]}]}))
    kube.ok(kube.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", {
        "metadata": {"name": "approver"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "approver"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}))
    # The API server's RBAC cache follows the binding a moment later.
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
              "spec": {"resourceAttributes": {"namespace": ns, "verb": "create", "group": "tether.dev",
                                              "resource": "workerrunapprovals"}}}
    eventually(lambda: kube.ok(kube.post("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", review,
                                         headers=_as(user)))["status"].get("allowed"),
               timeout=10, interval=0.05, what=f"{user} allowed to create approvals")


def _create(kube: Kube, ns: str, body: dict[str, Any], user: str) -> httpx.Response:
    return kube.post(APPROVALS.format(ns=ns), body, headers=_as(user))


def test_an_approver_records_their_own_decision(kube: Kube, namespace: str) -> None:
    _grant_approver(kube, namespace, "alice")
    created = kube.ok(_create(kube, namespace, _approval("alice"), "alice"))
    assert created["spec"]["approver"] == "alice" and created["spec"]["decision"] == "Approve"
    listed = kube.ok(kube.get(APPROVALS.format(ns=namespace)))["items"]
    assert [a["metadata"]["name"] for a in listed] == [created["metadata"]["name"]]


def test_a_forged_approver_is_refused_with_the_name_to_use(kube: Kube, namespace: str) -> None:
    _grant_approver(kube, namespace, "alice")
    resp = _create(kube, namespace, _approval("bob"), "alice")
    assert resp.status_code == 403, resp.text
    message = resp.json()["message"]
    assert "approval-approver" in message and 'set it to "alice"' in message, message
    # Even cluster admins record only themselves.
    resp = kube.post(APPROVALS.format(ns=namespace), _approval("alice"))
    assert resp.status_code == 403 and 'set it to "tether-admin"' in resp.json()["message"], resp.text
    assert kube.ok(kube.get(APPROVALS.format(ns=namespace)))["items"] == []


def test_who_may_decide_is_rbac(kube: Kube, namespace: str) -> None:
    resp = _create(kube, namespace, _approval("mallory"), "mallory")
    assert resp.status_code == 403 and "workerrunapprovals" in resp.json()["message"], resp.text


def test_a_decision_is_never_rewritten(kube: Kube, namespace: str) -> None:
    _grant_approver(kube, namespace, "alice")
    created = kube.ok(_create(kube, namespace, _approval("alice", decision="Deny"), "alice"))
    path = f"{APPROVALS.format(ns=namespace)}/{created['metadata']['name']}"
    resp = kube.request("PATCH", path, json={"spec": {"decision": "Approve"}},
                        headers={**_as("alice"), "Content-Type": "application/merge-patch+json"})
    refused(resp, "immutable")
    # Labels may change (tools sort approvals); the decision and its approver may not.
    resp = kube.request("PATCH", path, json={"metadata": {"labels": {"team": "billing"}}},
                        headers={**_as("alice"), "Content-Type": "application/merge-patch+json"})
    assert resp.status_code == 200, resp.text
    assert kube.ok(kube.get(path))["spec"]["decision"] == "Deny"


def test_malformed_approvals_say_what_to_fix(kube: Kube, namespace: str) -> None:
    _grant_approver(kube, namespace, "alice")
    cases = [
        (_approval("alice", decision="Maybe"), "spec.decision"),
        (_approval("alice", gate="Ship It!"), "spec.gate"),
        ({**_approval("alice"), "spec": {k: v for k, v in _approval("alice")["spec"].items() if k != "runRef"}},
         "spec.runRef"),
        # Every gate but Start names its attempt: never matched by time.
        (_approval("alice", gate="Result"), "spec.attempt is required for gate Result"),
        (_approval("alice", gate="refund"), "spec.attempt is required"),
        (_approval("alice", attempt=2), "spec.attempt for gate Start is 0 or unset"),
    ]
    for body, field in cases:
        refused(_create(kube, namespace, body, "alice"), field)
