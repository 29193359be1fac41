"""Users of the test cluster as a person would be one: a ServiceAccount with the console's role."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.cluster.test_approvals import APPROVALS
from testkit.kube import Kube, eventually


def console_user(kube: Kube, ns: str, tmp_path: Path, name: str = "alice") -> tuple[str, str, Path]:
    """A ServiceAccount as a user of one namespace: reads runs, budgets and events, controls runs,
    records approvals. Returns its username, a token for the API server and a kubeconfig with it."""
    kube.ok(kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": name}}))
    kube.ok(kube.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", {
        "metadata": {"name": f"{name}-console"},
        "rules": [{"apiGroups": ["tether.dev"], "resources": ["workerruns"], "verbs": ["get", "list", "watch", "patch"]},
                  {"apiGroups": ["tether.dev"], "resources": ["workerbudgets", "workerrunschedules"],
                   "verbs": ["get", "list", "watch"]},
                  {"apiGroups": ["tether.dev"], "resources": ["workerrunapprovals"], "verbs": ["create", "get", "list"]},
                  {"apiGroups": [""], "resources": ["events", "pods"], "verbs": ["get", "list", "watch"]},
                  {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
                  {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "list", "watch"]}]}))
    username = f"system:serviceaccount:{ns}:{name}"
    kube.ok(kube.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", {
        "metadata": {"name": f"{name}-console"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{name}-console"},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}]}))
    token = kube.ok(kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts/{name}/token",
                              {"spec": {"expirationSeconds": 3600}}))["status"]["token"]
    admin = yaml.safe_load(Path(kube.kubeconfig_path).read_text())
    cluster = admin["clusters"][0]["cluster"]
    config = {"apiVersion": "v1", "kind": "Config",
              "clusters": [{"name": "c", "cluster": cluster}],
              "users": [{"name": name, "user": {"token": token}}],
              "contexts": [{"name": "c", "context": {"cluster": "c", "user": name, "namespace": ns}}],
              "current-context": "c"}
    path = tmp_path / f"{name}.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    # The API server's RBAC cache follows the binding a moment later.
    as_user = Kube(str(path))
    eventually(lambda: as_user.get(APPROVALS.format(ns=ns)).status_code == 200, timeout=10, interval=0.05,
               what=f"{name}'s role in effect")
    return username, token, path
