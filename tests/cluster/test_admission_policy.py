"""Fencing enforced by the API server: the ValidatingAdmissionPolicies in policies/.

The run's state is set up with admin writes (no operator): attempt 1 (pod job-a1) was
revoked and attempt 2 (pod job-a2) holds the run. Each worker talks to the API server
with a raw HTTP client and a real pod-bound token of its own pod, and its ServiceAccount's
RBAC allows every write tried here, so whatever is refused is refused by the policies, not
by RBAC or by a cooperative SDK.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime as dt
import json
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import yaml

from testkit import runs
from testkit.audit import AuditLog, AuditRecord
from testkit.kube import Kube, eventually
from testkit.scenario import app_run

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
BUDGETS = "/apis/tether.dev/v1alpha1/namespaces/{ns}/workerbudgets"
POLICIES = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
JSON_PATCH = {"Content-Type": "application/json-patch+json"}
MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}
# A Helm release of the chart (tests/e2e/test_ship.py installs one) names its copies
# <release>-tether-worker-...; whichever copy answers first, the message names it.
STATUS_POLICY = re.compile(r"ValidatingAdmissionPolicy '(\S+-)?tether-worker-status-fencing'")
LEASE_POLICY = re.compile(r"ValidatingAdmissionPolicy '(\S+-)?tether-worker-lease-fencing'")

WORKER_RULES = [
    # Wider than Tether's own per-run Role: a careless or hostile worker identity that RBAC
    # lets write anything it could want to, so that only the policies stand in the way.
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
     "verbs": ["get", "create", "update", "patch", "delete"]},
    {"apiGroups": ["tether.dev"], "resources": ["workerruns", "workerbudgets"], "verbs": ["get"]},
    {"apiGroups": ["tether.dev"], "resources": ["workerruns/status", "workerbudgets/status"],
     "verbs": ["get", "update", "patch"]},
]


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ca_only(kube: Kube) -> ssl.SSLContext:
    # Only the CA: the admin kubeconfig's context also carries a client certificate, which
    # the API server would prefer to the bearer token.
    doc = yaml.safe_load(Path(kube.kubeconfig_path).read_text())
    return ssl.create_default_context(
        cadata=base64.b64decode(doc["clusters"][0]["cluster"]["certificate-authority-data"]).decode())


def _client(kube: Kube, token: str) -> httpx.Client:
    return httpx.Client(base_url=kube.config.server, verify=_ca_only(kube),
                        headers={"Authorization": f"Bearer {token}"}, timeout=10)


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("message", ""))
    except ValueError:
        return resp.text


def refused(resp: httpx.Response, policy: re.Pattern[str], *fragments: str) -> str:
    """Asserts the API server refused the write through `policy`; returns its message."""
    message = _message(resp)
    assert resp.status_code == 403, f"{resp.request.method} {resp.request.url.path}: {resp.status_code} {message}"
    assert policy.search(message), message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _ok(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, f"{resp.request.method} {resp.request.url.path}: {resp.status_code} {resp.text}"
    return resp.json()


def _created(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 201, f"{resp.request.url.path}: {resp.status_code} {resp.text}"
    return resp.json()


def _bound_token(kube: Kube, ns: str, sa: str, pod: dict[str, Any] | None) -> str:
    spec: dict[str, Any] = {"expirationSeconds": 600}
    if pod is not None:
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                  "uid": pod["metadata"]["uid"]}
    return kube.ok(kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
                             {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                              "spec": spec}))["status"]["token"]


def _grant(kube: Kube, ns: str, sa: str, rules: list[dict[str, Any]]) -> None:
    kube.ok(kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": sa}}))
    kube.ok(kube.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
                      {"metadata": {"name": sa}, "rules": rules}))
    kube.ok(kube.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", {
        "metadata": {"name": sa},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]}))


def _parked_pod(kube: Kube, ns: str, name: str, sa: str) -> dict[str, Any]:
    """A pod no scheduler picks up (so nothing runs it): its only use is to have tokens bound to it."""
    return kube.ok(kube.post(f"/api/v1/namespaces/{ns}/pods", {
        "metadata": {"name": name},
        "spec": {"serviceAccountName": sa, "schedulerName": "tether-test-parked",
                 "containers": [{"name": "worker", "image": "tether-test-worker", "command": ["true"]}]}}))


@dataclass
class Scene:
    ns: str
    run: str
    lease_path: str
    status_path: str
    stale: httpx.Client    # pod job-a1: attempt 1, revoked
    current: httpx.Client  # pod job-a2: attempt 2, status.holder and holderIdentity

    def lease(self) -> dict[str, Any]:
        return _ok(self.current.get(self.lease_path))


@pytest.fixture
def scene(kube: Kube, namespace: str) -> Iterator[Scene]:
    ns, name = namespace, "job"
    _grant(kube, ns, "worker", WORKER_RULES)
    runs.create(kube, ns, runs.example("short-job.yaml"), name=name)
    status_path = Kube.wr_path(ns, name) + "/status"
    # Attempt 1 was granted with fence 1 and revoked (fence 2); attempt 2 holds fence 3.
    kube.ok(kube.patch(status_path, {"status": {
        "phase": "Running", "attempt": 2, "fence": 3, "holder": f"{name}-a2",
        "usage": {"cents": 5, "tokens": 10}, "budgetCharged": False}}))
    kube.ok(kube.post(LEASES.format(ns=ns), {
        "metadata": {"name": name, "labels": {"tether.dev/run": name, "app.kubernetes.io/managed-by": "tether"},
                     "annotations": {"tether.dev/fence": "3"}},
        "spec": {"holderIdentity": f"{name}-a2", "leaseTransitions": 3, "leaseDurationSeconds": 10,
                 "acquireTime": _now(), "renewTime": _now()}}))
    a1 = _parked_pod(kube, ns, f"{name}-a1", "worker")
    a2 = _parked_pod(kube, ns, f"{name}-a2", "worker")
    stale = _client(kube, _bound_token(kube, ns, "worker", a1))
    current = _client(kube, _bound_token(kube, ns, "worker", a2))
    s = Scene(ns=ns, run=name, lease_path=f"{LEASES.format(ns=ns)}/{name}", status_path=status_path,
              stale=stale, current=current)
    # The policies were installed at session start; wait until the API server enforces them
    # (its policy informers sync asynchronously). A dry run is admitted but never stored.
    eventually(lambda: stale.patch(status_path, params={"dryRun": "All"}, headers=MERGE_PATCH,
                                   json={"status": {"result": {"probe": True}}}).status_code == 403,
               timeout=30, what="the admission policies in force")
    yield s
    stale.close()
    current.close()


def test_tokens_name_their_pod(scene: Scene) -> None:
    for client, pod in ((scene.stale, "job-a1"), (scene.current, "job-a2")):
        review = _created(client.post("/apis/authentication.k8s.io/v1/selfsubjectreviews",
                                      json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}))
        user = review["status"]["userInfo"]
        assert user["username"] == f"system:serviceaccount:{scene.ns}:worker"
        assert user["extra"]["authentication.kubernetes.io/pod-name"] == [pod]


def test_stale_worker_cannot_write_a_result_or_an_error(kube: Kube, scene: Scene) -> None:
    attempts = [
        # No test operations at all.
        ("json", [{"op": "add", "path": "/status/result", "value": {"by": "a1"}}]),
        ("merge", {"status": {"error": {"code": "Late", "message": "a1"}}}),
        # Tests forged with the current fence and holder (read from the run): they pass, the policy does not.
        ("json", [{"op": "test", "path": "/status/fence", "value": 3},
                  {"op": "test", "path": "/status/holder", "value": "job-a2"},
                  {"op": "add", "path": "/status/result", "value": {"by": "a1"}}]),
    ]
    for kind, body in attempts:
        resp = scene.stale.patch(scene.status_path, json=body, headers=JSON_PATCH if kind == "json" else MERGE_PATCH)
        refused(resp, STATUS_POLICY, "pod job-a1 does not hold WorkerRun job", "status.holder is job-a2")
    # A full-object update is refused the same way.
    run = _ok(scene.stale.get(scene.status_path))
    run["status"]["result"] = {"by": "a1"}
    refused(scene.stale.put(scene.status_path, json=run), STATUS_POLICY, "pod job-a1 does not hold")
    status = runs.get(kube, scene.ns, scene.run)["status"]
    assert "result" not in status and "error" not in status


def test_no_worker_may_touch_ownership_or_accounting(kube: Kube, scene: Scene) -> None:
    changes: dict[str, Any] = {
        "holder": "job-a1", "fence": 4, "usage": {"cents": 1, "tokens": 1}, "budgetCharged": True,
        "phase": "Succeeded", "attempt": 3,
    }
    for field, value in changes.items():
        patch = {"status": {field: value}}
        refused(scene.stale.patch(scene.status_path, json=patch, headers=MERGE_PATCH), STATUS_POLICY,
                "pod job-a1 does not hold")
        refused(scene.current.patch(scene.status_path, json=patch, headers=MERGE_PATCH), STATUS_POLICY,
                f"refused change to status.{field}")
    # Smuggled in with a legitimate result, the change is still refused (and so is the result).
    both = [{"op": "test", "path": "/status/holder", "value": "job-a2"},
            {"op": "add", "path": "/status/result", "value": {"ok": True}},
            {"op": "replace", "path": "/status/fence", "value": 9},
            {"op": "remove", "path": "/status/usage"}]
    message = refused(scene.current.patch(scene.status_path, json=both, headers=JSON_PATCH), STATUS_POLICY)
    # The fields come in the API server's map order.
    assert set(message.split("refused change to ")[1].split(", ")) == {"status.fence", "status.usage"}, message
    status = runs.get(kube, scene.ns, scene.run)["status"]
    assert (status["holder"], status["fence"], status["usage"], status["budgetCharged"]) == \
        ("job-a2", 3, {"cents": 5, "tokens": 10}, False)
    assert "result" not in status


def test_stale_worker_cannot_renew(kube: Kube, scene: Scene) -> None:
    # It re-reads the Lease (so its resourceVersion is current) and renews anyway.
    lease = _ok(scene.stale.get(scene.lease_path))
    lease["spec"]["renewTime"] = _now()
    refused(scene.stale.put(scene.lease_path, json=lease), LEASE_POLICY,
            "pod job-a1 does not hold Lease job", "holderIdentity is job-a2")
    # Patches, which need no resourceVersion, fare no better.
    refused(scene.stale.patch(scene.lease_path, json={"spec": {"renewTime": _now()}}, headers=MERGE_PATCH),
            LEASE_POLICY, "pod job-a1 does not hold")
    refused(scene.stale.patch(scene.lease_path, json=[{"op": "replace", "path": "/spec/renewTime", "value": _now()}],
                              headers=JSON_PATCH), LEASE_POLICY, "pod job-a1 does not hold")
    # Nor can it take the Lease back.
    takeover = {"spec": {"holderIdentity": "job-a1", "leaseTransitions": 4}}
    refused(scene.stale.patch(scene.lease_path, json=takeover, headers=MERGE_PATCH), LEASE_POLICY)
    spec = scene.lease()["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("job-a2", 3)


def test_holder_cannot_change_holder_fence_or_the_operators_fields(scene: Scene) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"spec": {"holderIdentity": "job-a1"}}, "may not change holderIdentity of Lease job (from job-a2 to job-a1)"),
        ({"spec": {"holderIdentity": None}}, "may not change holderIdentity of Lease job (from job-a2 to empty)"),
        ({"spec": {"leaseTransitions": 4}}, "may not change leaseTransitions (the fence) of Lease job (from 3 to 4)"),
        ({"spec": {"leaseDurationSeconds": 3600}}, "refused change to spec.leaseDurationSeconds"),
        ({"metadata": {"annotations": {"tether.dev/fence": "9"}}}, "refused change to annotation tether.dev/fence"),
        ({"metadata": {"annotations": {"tether.dev/signals": "{}"}}}, "refused change to annotation tether.dev/signals"),
        ({"metadata": {"annotations": {"tether.dev/claimed-by": "{}"}}},
         "refused change to annotation tether.dev/claimed-by"),
        ({"metadata": {"labels": {"tether.dev/run": None}}}, "refused change to metadata.labels"),
    ]
    for patch, fragment in cases:
        refused(scene.current.patch(scene.lease_path, json=patch, headers=MERGE_PATCH), LEASE_POLICY, fragment)
    refused(scene.current.delete(scene.lease_path), LEASE_POLICY, "may not delete Lease job")
    other = {"metadata": {"name": "job-2", "labels": {"tether.dev/run": "job-2"}},
             "spec": {"holderIdentity": "job-a2", "leaseTransitions": 1}}
    refused(scene.current.post(LEASES.format(ns=scene.ns), json=other), LEASE_POLICY, "may not create Lease job-2")
    spec = scene.lease()["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"], spec["leaseDurationSeconds"]) == ("job-a2", 3, 10)


def test_current_holder_renews_and_publishes(kube: Kube, scene: Scene) -> None:
    # A heartbeat: the Lease as last seen (its resourceVersion makes the update a CAS),
    # renewTime, and the worker's checkpoint and usage report.
    lease = scene.lease()
    body = copy.deepcopy(lease)
    body["spec"]["renewTime"] = _now()
    body["metadata"]["annotations"].update({"tether.dev/checkpoint": "row-7", "tether.dev/usage": '{"cents":3,"tokens":4}'})
    renewed = _ok(scene.current.put(scene.lease_path, json=body))
    assert renewed["metadata"]["resourceVersion"] != lease["metadata"]["resourceVersion"]
    assert renewed["metadata"]["annotations"]["tether.dev/checkpoint"] == "row-7"
    # The same write again, now with a stale resourceVersion: a conflict, not a policy refusal.
    assert scene.current.put(scene.lease_path, json=body).status_code == 409
    # The result, with the fenced JSON patch the SDK sends.
    fenced = [{"op": "test", "path": "/status/fence", "value": 3},
              {"op": "test", "path": "/status/holder", "value": "job-a2"},
              {"op": "add", "path": "/status/result", "value": {"rows": 7}}]
    assert _ok(scene.current.patch(scene.status_path, json=fenced, headers=JSON_PATCH))["status"]["result"] == {"rows": 7}
    # A retry of the same write (its first answer was lost) changes nothing and is accepted...
    _ok(scene.current.patch(scene.status_path, json=fenced, headers=JSON_PATCH))
    # ...but an accepted result is never replaced, nor joined by an error.
    fenced[2]["value"] = {"rows": 8}
    refused(scene.current.patch(scene.status_path, json=fenced, headers=JSON_PATCH), STATUS_POLICY,
            "already has a result, which is never replaced or erased", "status.result")
    refused(scene.current.patch(scene.status_path, json={"status": {"error": {"code": "X", "message": ""}}},
                                headers=MERGE_PATCH), STATUS_POLICY, "already has a result", "status.error")
    assert runs.get(kube, scene.ns, scene.run)["status"]["result"] == {"rows": 7}


def test_only_the_holder_may_ask_for_an_approval(scene: Scene) -> None:
    """A request (tether.dev/requests) rides on a renewal: the current holder's is admitted, a
    revoked attempt's is refused however it is written, so a stale worker can ask nothing."""
    ask = {"metadata": {"annotations": {"tether.dev/requests": '{"wire-money":{"details":"1000 EUR"}}'}}}
    refused(scene.stale.patch(scene.lease_path, json=ask, headers=MERGE_PATCH), LEASE_POLICY,
            "pod job-a1 does not hold Lease job")
    lease = _ok(scene.stale.get(scene.lease_path))
    lease["metadata"]["annotations"].update(ask["metadata"]["annotations"])
    refused(scene.stale.put(scene.lease_path, json=lease), LEASE_POLICY, "pod job-a1 does not hold")
    assert "tether.dev/requests" not in scene.lease()["metadata"].get("annotations", {})
    asked = _ok(scene.current.patch(scene.lease_path, json=ask, headers=MERGE_PATCH))
    assert asked["metadata"]["annotations"]["tether.dev/requests"] == '{"wire-money":{"details":"1000 EUR"}}'
    # Bounded, so the operator's signals always fit beside them: 65536 bytes, counted as bytes.
    huge = {"metadata": {"annotations": {"tether.dev/requests": json.dumps({"a": {"details": "€" * 22000}})}}}
    refused(scene.current.patch(scene.lease_path, json=huge, headers=MERGE_PATCH), LEASE_POLICY,
            "may be at most 65536 bytes")


def test_a_workers_checkpoint_is_bounded(scene: Scene) -> None:
    """Issue 21, defect 9: an unbounded tether.dev/checkpoint could fill the Lease's 256 KiB of
    annotations, after which every operator write of that Lease fails (signals, the next grant).
    The holder's checkpoint is admitted up to 4096 bytes, counted as bytes, and refused beyond."""
    fits = {"metadata": {"annotations": {"tether.dev/checkpoint": "€" * 1365}}}  # 4095 bytes
    assert _ok(scene.current.patch(scene.lease_path, json=fits, headers=MERGE_PATCH))
    huge = {"metadata": {"annotations": {"tether.dev/checkpoint": "€" * 1366}}}  # 4098 bytes
    refused(scene.current.patch(scene.lease_path, json=huge, headers=MERGE_PATCH), LEASE_POLICY,
            "tether.dev/checkpoint of Lease job may be at most 4096 bytes (4098 sent)")
    assert scene.lease()["metadata"]["annotations"]["tether.dev/checkpoint"] == "€" * 1365


def _holders_transport(kube: Kube, scene: Scene) -> Any:
    """The worker SDK's transport, with the current holder's pod-bound token."""
    from tether.kube.config import KubeConfig
    from tether.worker.transport import KubeTransport

    token = scene.current.headers["Authorization"].removeprefix("Bearer ")
    cfg = KubeConfig(server=kube.config.server, ssl_context=_ca_only(kube), token=token, namespace=scene.ns)
    return KubeTransport(scene.ns, scene.run, "job-a2", 3, cfg, timeout=10)


def test_sdk_transport_passes_the_policy(kube: Kube, scene: Scene) -> None:
    """The worker SDK's own writes (heartbeat with reports, fenced result) are what the policy admits."""
    from tether.api.models import Usage

    transport = _holders_transport(kube, scene)
    try:
        renewal = transport.renew("row-9", Usage(cents=7, tokens=8))
        assert renewal.ok, renewal.why
        assert scene.lease()["metadata"]["annotations"]["tether.dev/checkpoint"] == "row-9"
        assert transport.publish("error", {"code": "Boom", "message": "gave up"}) is True
    finally:
        transport.close()
    assert runs.get(kube, scene.ns, scene.run)["status"]["error"]["code"] == "Boom"


# --- size (policies/workerrun-size.yaml; issue 34) -----------------------------------------------
# A run too large for etcd came back as a 500 in etcd's or gRPC's words: `etcdserver: request is too
# large` past 1.5 MiB, `rpc error: code = ResourceExhausted desc = trying to send message larger than
# max` past 2 MiB. It is refused first, 413, saying what to do.

SIZE_POLICY = re.compile(r"ValidatingAdmissionPolicy '(\S+-)?tether-workerrun-size'")
MIB = 1 << 20


def _too_large(resp: httpx.Response, *fragments: str) -> str:
    message = _message(resp)
    assert resp.status_code == 413 and resp.json()["reason"] == "RequestEntityTooLarge", f"{resp.status_code} {message}"
    assert SIZE_POLICY.search(message) and "ResourceExhausted" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _payload_run(name: str, size: int, char: str = "x") -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name},
            "spec": {"executor": "External", "payload": {"text": char * size, "n": size}}}


def test_a_run_too_large_to_store_is_refused_at_apply_saying_what_to_do(kube: Kube, namespace: str, bin_dir: Path,
                                                                         tmp_path: Path) -> None:
    import subprocess

    runs_path = Kube.wr_path(namespace)
    eventually(lambda: kube.post(runs_path, _payload_run("probe", 2 * MIB), params={"dryRun": "All"}).status_code == 413,
               timeout=30, what="the size policy in force")
    for name, size in (("two-mib", 2 * MIB), ("over-one", MIB + 50_000)):
        message = _too_large(kube.post(runs_path, _payload_run(name, size)), f"WorkerRun {name} would be",
                             "over the 1048576 (1 MiB) a run may hold",
                             "put large inputs in object storage and name them in spec.payload")
        said = re.search(r"would be (\d+) bytes \(spec.payload (\d+)\)", message)
        assert said is not None and size < int(said[2]) < int(said[1]) < size + 2000, message
    # What the user sees (kubectl create, or apply --server-side: a client-side apply's annotation
    # refuses anything this large first).
    manifest = tmp_path / "run.json"
    manifest.write_text(json.dumps(_payload_run("kubectl", 2 * MIB)))
    shown = subprocess.run([str(bin_dir / "kubectl"), "--kubeconfig", kube.kubeconfig_path, "create", "-n", namespace,
                            "-f", str(manifest)], capture_output=True, text=True)
    assert shown.returncode == 1 and shown.stderr.startswith("Error from server (RequestEntityTooLarge)"), shown.stderr
    assert "put large inputs in object storage" in shown.stderr and "rpc error" not in shown.stderr, shown.stderr
    # Counted as stored: 900 KB (tests/e2e/test_payload.py) fit; a < takes six bytes (\u003c).
    fits = kube.ok(kube.post(runs_path, _payload_run("fits", 900_000)))
    _too_large(kube.post(runs_path, _payload_run("markup", 200_000, "<")), "WorkerRun markup would be")
    # A payload grown before the start is judged again; an edit of control fields is not measured.
    path = Kube.wr_path(namespace, "fits")
    _too_large(kube.patch(path, {"spec": {"payload": {"more": "x" * 200_000}}}), "WorkerRun fits would be")
    assert kube.ok(kube.patch(path, {"spec": {"suspend": True}}))["spec"]["payload"] == fits["spec"]["payload"]


def test_a_result_too_large_for_its_run_is_refused_saying_what_to_do(kube: Kube, scene: Scene) -> None:
    from tether.worker.errors import ResultInvalid

    fenced = [{"op": "test", "path": "/status/fence", "value": 3},
              {"op": "test", "path": "/status/holder", "value": "job-a2"},
              {"op": "add", "path": "/status/result", "value": {"rows": "x" * (MIB + 50_000)}}]
    eventually(lambda: scene.current.patch(scene.status_path, json=fenced, headers=JSON_PATCH,
                                           params={"dryRun": "All"}).status_code == 413,
               timeout=30, what="the size policy in force")
    _too_large(scene.current.patch(scene.status_path, json=fenced, headers=JSON_PATCH),
               "the result would make WorkerRun job", "over the 1048576 (1 MiB) a run may hold",
               "publish a reference to large output")
    # The SDK takes it as a bad result (not lost, not to retry), and says why in those words.
    transport = _holders_transport(kube, scene)
    try:
        with pytest.raises(ResultInvalid, match="result is too large: .*publish a reference to large output"):
            transport.publish("result", {"rows": "x" * 2 * MIB})
        with pytest.raises(ResultInvalid, match="the error would make WorkerRun job"):
            transport.publish("error", {"code": "Boom", "message": "x" * (MIB + 50_000)})
    finally:
        transport.close()
    assert "result" not in runs.get(kube, scene.ns, scene.run)["status"]
    # The control plane is not measured (its writes only follow the run): an admin's is stored.
    kube.ok(kube.patch(scene.status_path, {"status": {"error": {"code": "Big", "message": "x" * (MIB + 50_000)}}}))


def test_tokens_that_name_no_pod_budgets_and_external_runs_are_refused(kube: Kube, scene: Scene) -> None:
    # A token of the worker's ServiceAccount bound to no pod (like a tool claim): never a holder.
    with _client(kube, _bound_token(kube, scene.ns, "worker", None)) as unbound:
        lease = _ok(unbound.get(scene.lease_path))
        lease["spec"]["renewTime"] = _now()
        refused(unbound.put(scene.lease_path, json=lease), LEASE_POLICY, "name no pod")
        refused(unbound.patch(scene.status_path, json={"status": {"result": {}}}, headers=MERGE_PATCH),
                STATUS_POLICY, "name no pod")
    # Budgets are charged by the operator alone.
    kube.ok(kube.post(BUDGETS.format(ns=scene.ns), {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget",
                                                    "metadata": {"name": "team"}, "spec": {"limitCents": 1000}}))
    budget_status = f"{BUDGETS.format(ns=scene.ns)}/team/status"
    refused(scene.current.patch(budget_status, json={"status": {"periodStart": _now()}}, headers=MERGE_PATCH),
            STATUS_POLICY, "may not write the status of WorkerBudget team")
    # An External run is written by the gateway only, even if its holder had a pod's name.
    ext = runs.create(kube, scene.ns, {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
                                       "metadata": {"name": "ext"}, "spec": {"executor": "External"}})
    ext_status = Kube.wr_path(scene.ns, "ext") + "/status"
    kube.ok(kube.patch(ext_status, {"status": {"attempt": 1, "fence": 1, "holder": "job-a2"}}))
    assert ext["spec"]["executor"] == "External"
    refused(scene.current.patch(ext_status, json={"status": {"result": {}}}, headers=MERGE_PATCH),
            STATUS_POLICY, "WorkerRun ext is executed externally: only the Tether gateway writes its status")


def test_the_operator_and_admins_are_not_workers(kube: Kube, scene: Scene) -> None:
    # Admins (users, not ServiceAccounts) write anything.
    kube.ok(kube.patch(scene.status_path, {"status": {"fence": 4, "holder": None}}))
    # A ServiceAccount of the run's namespace is a worker unless RBAC lets it `fence` runs,
    # as the chart's ClusterRole does for the operator (and its gateway).
    _grant(kube, scene.ns, "tether-operator", WORKER_RULES + [
        {"apiGroups": ["tether.dev"], "resources": ["workerruns"], "verbs": ["fence"]}])
    with _client(kube, _bound_token(kube, scene.ns, "tether-operator", None)) as operator:
        lease = _ok(operator.get(scene.lease_path))
        lease["spec"].update(holderIdentity="job-a3", leaseTransitions=5, renewTime=_now())
        _ok(operator.put(scene.lease_path, json=lease))
        _ok(operator.patch(scene.status_path, json={"status": {"fence": 5, "holder": "job-a3", "budgetCharged": True}},
                           headers=MERGE_PATCH))
    # The policies are well-typed against the objects they inspect.
    for name in ("tether-worker-status-fencing", "tether-worker-lease-fencing"):
        checking = kube.ok(kube.get(f"{POLICIES}/{name}")).get("status", {}).get("typeChecking") or {}
        assert not checking.get("expressionWarnings"), checking


@pytest.mark.local_cluster
def test_audit_log_records_refused_and_accepted_writes(scene: Scene) -> None:
    log = AuditLog.from_env(from_end=True)
    stale_patch = scene.stale.patch(scene.status_path, json={"status": {"result": {"late": True}}}, headers=MERGE_PATCH)
    refused(stale_patch, STATUS_POLICY)
    lease = scene.lease()
    lease["spec"]["renewTime"] = _now()
    renewed = _ok(scene.current.put(scene.lease_path, json=lease))

    def by(pod: str, resource: str, subresource: str = "") -> Any:
        # Dry runs (the fixture's probe of the policies) are admitted or refused, never stored.
        return lambda r: (r.user.pod == pod and r.is_write and not r.dry_run
                          and r.about(resource, scene.ns, scene.run, subresource=subresource))

    refusal: AuditRecord = log.wait_for(by("job-a1", "workerruns", "status"), what="the stale status write")
    assert (refusal.verb, refusal.code, refusal.accepted) == ("patch", 403, False)
    assert refusal.user.username == f"system:serviceaccount:{scene.ns}:worker"
    assert any(p.endswith("tether-worker-status-fencing") for p in refusal.denied_by), refusal.annotations
    assert refusal.request_object == {"status": {"result": {"late": True}}}
    renewal = log.wait_for(by("job-a2", "leases"), what="the holder's renewal")
    assert (renewal.verb, renewal.code) == ("update", 200) and not renewal.denied_by
    assert renewal.request_object is not None and renewal.response_object is not None
    assert renewal.response_object["metadata"]["resourceVersion"] == renewed["metadata"]["resourceVersion"]
    assert renewal.completed >= renewal.received
    # follow() hands out each record once.
    first = log.follow()
    assert any(r.audit_id == renewal.audit_id for r in first)
    assert not any(r.audit_id == renewal.audit_id for r in log.follow())


@pytest.mark.local_cluster
def test_kubelet_workers_run_under_the_policy(kube: Kube, namespace: str, operator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A real worker pod (process kubelet, its pod-bound token) renews and completes; the audit
    log shows each of its writes made as its pod and accepted."""
    log = AuditLog.from_env(from_end=True)
    runs.create(kube, namespace, app_run("real", {"workSeconds": 2, "checkpoint": "c1", "usageCents": 3},
                                                duration=8, renew=1))
    run = runs.wait_phase(kube, namespace, "real", ("Succeeded", "Failed", "Lost"), timeout=90)
    assert run["status"]["phase"] == "Succeeded", run["status"]
    mine = lambda r: r.user.pod == "real-a1" and r.is_write  # noqa: E731
    result = log.wait_for(lambda r: mine(r) and r.about("workerruns", namespace, "real", "status"),
                          what="the worker's result write")
    assert result.accepted and result.verb == "patch"
    renewals = [r for r in log.read() if mine(r) and r.about("leases", namespace, "real")]
    # Conflicts (409) are part of the protocol (the operator updates the signals); refusals are not.
    assert any(r.accepted for r in renewals)
    assert not [(r.code, r.message) for r in renewals if r.denied_by or r.code == 403]


def test_process_kubelet_rotates_pod_tokens(tmp_path: Path) -> None:
    """Like the real kubelet, the process kubelet replaces a pod's token file before the token
    expires (at 80% of its lifetime); clients re-read the file when it changes."""
    from tether.devcluster import kubelet as pk

    minted = iter(["second", "third"])

    class Minting(pk.ProcessKubelet):
        def __init__(self) -> None:  # no API server: only the refresh loop is under test
            pass

        async def _mint_token(self, pod: dict[str, Any]) -> tuple[str, float]:
            return next(minted), 1.0

    token = tmp_path / "token"
    token.write_text("first")

    async def rotations() -> list[str]:
        seen = [token.read_text()]
        refresher = asyncio.create_task(Minting()._refresh_token({"metadata": {}}, token, lifetime=1.0))
        try:
            while seen[-1] != "third":
                await asyncio.sleep(0.05)
                if token.read_text() != seen[-1]:
                    seen.append(token.read_text())
        finally:
            refresher.cancel()
        return seen

    assert asyncio.run(asyncio.wait_for(rotations(), timeout=10)) == ["first", "second", "third"]


@pytest.mark.local_cluster
def test_the_namespace_worker_identity_writes_run_leases_only(kube: Kube, namespace: str) -> None:
    """Review finding: the shared tether-worker Role may update every Lease in the namespace (RBAC
    cannot select by label). An application's leader-election Lease there must stay out of reach;
    a run's Lease stays writable (the lease-fencing policy then decides which and how)."""
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    _grant(kube, namespace, "tether-worker", [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "update", "patch", "create",
                                                                                   "delete"]}])
    app = _created(kube.post(leases, {"metadata": {"name": "app-leader"},
                                      "spec": {"holderIdentity": "app-0", "leaseDurationSeconds": 15}}))
    with _client(kube, _bound_token(kube, namespace, "tether-worker", None)) as worker:
        app["spec"]["holderIdentity"] = "hijacked"
        refused = worker.put(f"{leases}/app-leader", json=app)
        assert refused.status_code == 403 and "tether-namespace-worker-scope" in refused.text, refused.text
        assert worker.delete(f"{leases}/app-leader").status_code == 403
        created = worker.post(leases, json={"metadata": {"name": "mine"}, "spec": {"holderIdentity": "x"}})
        assert created.status_code == 403 and "tether-namespace-worker-scope" in created.text, created.text
        # Relabelling an application's Lease as a run's is a write to an unlabelled Lease: refused.
        app["metadata"].setdefault("labels", {})["tether.dev/run"] = "app-leader"
        assert worker.put(f"{leases}/app-leader", json=app).status_code == 403
    assert kube.ok(kube.get(f"{leases}/app-leader"))["spec"]["holderIdentity"] == "app-0"
    checking = kube.ok(kube.get(f"{POLICIES}/tether-namespace-worker-scope")).get("status", {}).get("typeChecking") or {}
    assert not checking.get("expressionWarnings"), checking
