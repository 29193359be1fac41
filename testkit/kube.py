"""A small synchronous Kubernetes client for tests (admin credentials)."""

from __future__ import annotations

import json
import time
from typing import Any, Callable, TypeVar

import httpx

from tether.kube import config as kubeconfig

T = TypeVar("T")

GROUP = "/apis/tether.dev/v1alpha1"


class Kube:
    def __init__(self, kubeconfig_path: str) -> None:
        self.kubeconfig_path = kubeconfig_path
        self.config = kubeconfig.load(kubeconfig_path)
        self.http = self.config.sync_client(timeout=30)

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return self.http.request(method, path, **kw)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.http.get(path, **kw)

    def post(self, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return self.http.post(path, json=body, **kw)

    def put(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.put(path, json=body)

    def delete(self, path: str, **kw: Any) -> httpx.Response:
        return self.http.request("DELETE", path, **kw)

    def patch(self, path: str, body: Any, kind: str = "merge") -> httpx.Response:
        content_type = {
            "merge": "application/merge-patch+json",
            "json": "application/json-patch+json",
            "strategic": "application/strategic-merge-patch+json",
        }[kind]
        return self.http.patch(path, json=body, headers={"Content-Type": content_type})

    def wait_for(self, collection: str, name: str, ready: Callable[[dict[str, Any]], bool], timeout: float,
                 what: str) -> dict[str, Any]:
        """The object `name` of `collection` once `ready(object)`: a GET, then a watch from its
        resourceVersion, as `kubectl wait` does. Polling a run every 0.1 s from every waiting test was
        a tenth of the machine under `make test` (the API server's reads, etcd's and the tests' own)."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while True:
            resp = self.get(f"{collection}/{name}")
            rv = None
            if resp.status_code == 200:
                last = resp.json()
                if ready(last):
                    return last
                rv = last["metadata"]["resourceVersion"]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
            if rv is None:  # not there (yet, or any more): looked for again shortly
                time.sleep(min(0.2, remaining))
                continue
            params = {"watch": "1", "fieldSelector": f"metadata.name={name}", "resourceVersion": rv,
                      "allowWatchBookmarks": "false", "timeoutSeconds": str(max(1, min(int(remaining) + 1, 60)))}
            try:
                with self.http.stream("GET", collection, params=params,
                                      timeout=httpx.Timeout(remaining + 10, connect=10)) as stream:
                    for line in stream.iter_lines():
                        event = json.loads(line) if line.strip() else {}
                        if event.get("type") in ("ADDED", "MODIFIED"):
                            last = event["object"]
                            if ready(last):
                                return last
                        elif event.get("type") in ("DELETED", "ERROR"):
                            break  # gone, or the watch expired (410): read again
                        if time.monotonic() > deadline:
                            break
            except httpx.TransportError:
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def ok(self, resp: httpx.Response) -> dict[str, Any]:
        assert resp.status_code < 300, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
        return resp.json()

    def username(self) -> str:
        """Who these credentials are, as the API server says (the local cluster's admin is
        tether-admin, kind's kubernetes-admin)."""
        review = self.ok(self.post("/apis/authentication.k8s.io/v1/selfsubjectreviews",
                                   {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}))
        return str(review["status"]["userInfo"]["username"])

    @staticmethod
    def wr_path(ns: str, name: str = "") -> str:
        return f"{GROUP}/namespaces/{ns}/workerruns" + (f"/{name}" if name else "")


# What the API server adds, naming no field, when a wrong type or a value outside an enum keeps a
# CRD's CEL rules from running (apiextensions-apiserver, hasBlockingErr): no CRD can change it.
RULES_NOT_CHECKED = "<nil>: Invalid value: null: some validation rules were not checked because the object was invalid"


def refused(resp: httpx.Response, *fragments: str) -> str:
    """The message of a write the API server refused as invalid (422): it says each of `fragments`,
    and every cause names its field, never `<nil>` (a rule that names none: issue 34). Returns it."""
    assert resp.status_code == 422, f"{resp.status_code} {resp.text}"
    status = resp.json()
    message = str(status["message"])
    for fragment in fragments:
        assert fragment in message, message
    causes = [c for c in (status.get("details") or {}).get("causes") or []
              if not f"{c.get('field')}: {c.get('message')}".startswith(RULES_NOT_CHECKED)]
    assert "<nil>" not in message.replace(RULES_NOT_CHECKED, "") and causes, status
    assert all(c.get("field") not in (None, "", "<nil>") for c in causes), status
    return message


def eventually(fn: Callable[[], T], timeout: float = 30, interval: float = 0.2, what: str = "condition") -> T:
    """Polls `fn` until it returns a truthy value; fails the test with the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = fn()
        except AssertionError as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
        time.sleep(interval)


AUDIENCE = "tether-gateway"  # the gateway's default TokenReview audience


def worker_identity(kube: Kube, ns: str, sa: str, allowed: bool = True, audience: str | None = AUDIENCE) -> str:
    """A ServiceAccount for an external worker, allowed (or not) the gateway's verbs; returns a token."""
    kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": sa}})
    if allowed:
        kube.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", {
            "metadata": {"name": f"{sa}-claims"},
            "rules": [{"apiGroups": ["tether.dev"], "resources": ["workerruns"], "verbs": ["claim", "spawn"]}]})
        kube.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", {
            "metadata": {"name": f"{sa}-claims"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{sa}-claims"},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]})
    spec: dict[str, Any] = {"expirationSeconds": 3600}
    if audience:
        spec["audiences"] = [audience]
    resp = eventually(lambda: (r := kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
                                              {"spec": spec})).status_code == 201 and r, timeout=30,
                      what="a token")
    return resp.json()["status"]["token"]
