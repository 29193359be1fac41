"""Creating a WorkerRun never grants the rights of an account its creator could not use otherwise.

The creator is a ServiceAccount holding only the documented roles (the chart's `-view` and `-edit`
rules, and the gateway's `claim` verb); `deployer` is an account of the same namespace that may read
Secrets. Judged by the API server's own answers to the tokens involved, not by Tether's view."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_gateway import call, ca_only, external_run, gateway, open_attempt  # noqa: F401 (fixture)
from testkit import runs
from testkit.kube import Kube, eventually, worker_identity

CHART = Path(__file__).resolve().parents[2] / "charts" / "tether"
RBAC = "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/{kind}"


def _documented_rules(tools_dir: Path) -> list[dict[str, Any]]:
    """The rules of the chart's roles for people who run work: view and edit."""
    from tests.cluster.test_chart import render

    roles = {d["metadata"]["name"]: d for d in render(tools_dir) if d["kind"] == "ClusterRole"}
    return [*roles["rel-tether-view"]["rules"], *roles["rel-tether-edit"]["rules"]]


def _bind(kube: Kube, ns: str, sa: str, rules: list[dict[str, Any]]) -> None:
    kube.ok(kube.post(RBAC.format(ns=ns, kind="roles"), {"metadata": {"name": f"{sa}-rules"}, "rules": rules}))
    kube.ok(kube.post(RBAC.format(ns=ns, kind="rolebindings"), {
        "metadata": {"name": f"{sa}-rules"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{sa}-rules"},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]}))


def _can_list_secrets(kube: Kube, ns: str, token: str) -> int:
    """The API server's answer to `token` listing the namespace's Secrets (200 or 403)."""
    return httpx.get(f"{kube.config.server}/api/v1/namespaces/{ns}/secrets", verify=ca_only(),
                     headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code


def _whoami(kube: Kube, token: str) -> str:
    review = httpx.post(f"{kube.config.server}/apis/authentication.k8s.io/v1/selfsubjectreviews", verify=ca_only(),
                        headers={"Authorization": f"Bearer {token}"}, timeout=30,
                        json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).json()
    return str(review["status"]["userInfo"]["username"])


def _pod_run(name: str, account: str) -> dict[str, Any]:
    run = runs.example("short-job.yaml")
    run["metadata"] = {"name": name}
    run["spec"]["template"]["spec"]["serviceAccountName"] = account
    return run


@pytest.mark.local_cluster
def test_a_run_never_yields_tokens_of_an_account_its_creator_cannot_use(
        kube: Kube, namespace: str, gateway: str, tools_dir: Path) -> None:  # noqa: F811
    ns = namespace
    kube.ok(kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "deployer"}}))
    _bind(kube, ns, "deployer", [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"]}])
    claim_token = worker_identity(kube, ns, "creator")  # the gateway's audience, and `claim`
    _bind(kube, ns, "creator", _documented_rules(tools_dir))
    creator = {"Impersonate-User": f"system:serviceaccount:{ns}:creator"}
    deployer_token = kube.ok(kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts/deployer/token",
                                       {"spec": {"expirationSeconds": 600}}))["status"]["token"]
    eventually(lambda: _can_list_secrets(kube, ns, deployer_token) == 200, timeout=10, what="deployer's rights")
    creator_token = kube.ok(kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts/creator/token",
                                      {"spec": {"expirationSeconds": 600}}))["status"]["token"]
    assert _can_list_secrets(kube, ns, creator_token) == 403

    # An External run naming the account: refused by the API server, saying why.
    named = external_run("ext-named")
    named["spec"]["template"] = {"spec": {"serviceAccountName": "deployer"}}
    refused = kube.post(Kube.wr_path(ns), named, headers=creator)
    assert refused.status_code == 422 and "cannot be set on an External run" in refused.text, refused.text

    # A pod run naming it: refused for the creator (who may not impersonate deployer), with what to do.
    refused = kube.post(Kube.wr_path(ns), _pod_run("pod-named", "deployer"), headers=creator)
    assert refused.status_code == 403, refused.text
    said = refused.json()["message"]
    assert 'may not act as ServiceAccount "deployer"' in said and f"system:serviceaccount:{ns}:creator" in said
    # ... and admitted for whoever may act as deployer anyway (the admin): no new right is gained.
    waiting = _pod_run("pod-admin", "deployer")
    waiting["spec"]["suspend"] = True  # never starts: its template stays editable
    kube.ok(kube.post(Kube.wr_path(ns), waiting))
    # The creator may not change what would run as deployer in the admin's run, only control it.
    edited = kube.request(
        "PATCH", Kube.wr_path(ns, "pod-admin"), headers={**creator, "Content-Type": "application/json-patch+json"},
        json=[{"op": "replace", "path": "/spec/template/spec/containers/0/command", "value": ["sh", "-c", "env"]}])
    assert edited.status_code == 403 and 'ServiceAccount "deployer"' in edited.json()["message"], edited.text
    stopped = kube.request("PATCH", Kube.wr_path(ns, "pod-admin"), json={"spec": {"stop": True}},
                           headers={**creator, "Content-Type": "application/merge-patch+json"})
    assert stopped.status_code == 200, stopped.text

    # Someone's own account under the name Tether would make for a run (`ci` -> `ci-worker`):
    # never adopted. The gateway makes an External run's account at its first claim, and refuses
    # the claim, saying so: no attempt of it is ever driven, no token of that account minted.
    kube.ok(kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "ci-worker"}}))
    kube.ok(kube.post(Kube.wr_path(ns), external_run("ci"), headers=creator))
    open_attempt(kube, ns, "ci")
    refused_claim = call(gateway, ns, "ci", "claim", claim_token, {"workerId": "w1"})
    assert refused_claim.status_code == 409, refused_claim.text
    assert refused_claim.json()["error"]["code"] == "WorkerIdentityTaken" and "ci-worker" in refused_claim.text
    account = kube.ok(kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/ci-worker"))
    assert not account["metadata"].get("ownerReferences")  # still the admin's, unchanged

    # An External run the creator makes and claims: its tool claim is the run's own account.
    kube.ok(kube.post(Kube.wr_path(ns), external_run("ext-own"), headers=creator))
    open_attempt(kube, ns, "ext-own")
    claim = call(gateway, ns, "ext-own", "claim", claim_token, {"workerId": "w1"})
    assert claim.status_code == 200, claim.text
    tool = claim.json()["toolClaim"]["token"]
    assert _whoami(kube, tool) == f"system:serviceaccount:{ns}:ext-own-worker"
    assert _can_list_secrets(kube, ns, tool) == 403
    heartbeat = call(gateway, ns, "ext-own", "heartbeat", claim_token,
                     {"holder": claim.json()["holder"], "fence": claim.json()["fence"]})
    assert heartbeat.status_code == 200 and _whoami(kube, heartbeat.json()["toolClaim"]["token"]) == \
        f"system:serviceaccount:{ns}:ext-own-worker"
    # The run's Role binds only the run's own account: deployer was granted nothing by any run.
    bindings = kube.ok(kube.get(RBAC.format(ns=ns, kind="rolebindings")))["items"]
    assert not [b for b in bindings if b["metadata"]["name"].startswith("tether-worker-ext")
                and any(s["name"] == "deployer" for s in b.get("subjects") or [])]
