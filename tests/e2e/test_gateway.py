"""The HTTP gateway for external workers, against the real control plane (TokenReview, RBAC)."""

from __future__ import annotations

import base64
import os
import ssl
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import yaml

from tether.devcluster.processes import free_port
from tether.worker import ClaimRefused, LeaseLost, WorkerRun
from testkit import runs
from testkit.kube import Kube, eventually, worker_identity
from tests.support.netcut import CutProxy
from testkit.operator_process import OperatorProcess



def external_run(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name},
            "spec": {"executor": "External", "payload": {"invoice": "8f1b"}, "idempotencyKey": "invoice:8f1b",
                     "lease": {"durationSeconds": 8, "renewIntervalSeconds": 1, "startupGraceSeconds": 30},
                     "retry": {"maxAttempts": 3, "backoff": {"initialSeconds": 0}}, **spec}}


def ca_only() -> ssl.SSLContext:
    doc = yaml.safe_load(Path(os.environ["TETHER_TEST_KUBECONFIG"]).read_text())
    return ssl.create_default_context(cadata=base64.b64decode(doc["clusters"][0]["cluster"]["certificate-authority-data"]).decode())


@pytest.fixture
def gateway(namespace: str, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    op = OperatorProcess(namespace, os.environ["TETHER_TEST_KUBECONFIG"], tmp_path / "op.log",
                         extra_args=[f"--gateway-port={port}", "--gateway-host=127.0.0.1"],
                         extra_env={"TETHER_FOLD_INTERVAL_SECONDS": "1"}).start()
    url = f"http://127.0.0.1:{port}"
    eventually(lambda: _up(url), timeout=30, what="the gateway")
    yield url
    op.stop()
    print("\n".join(op.log_path.read_text(errors="replace").splitlines()[-40:]))


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def call(url: str, ns: str, name: str, op: str, token: str | None, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{url}/api/v1/namespaces/{ns}/workerruns/{name}/{op}", json=body, headers=headers, timeout=30)


def open_attempt(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    """An attempt a claim can take: granted in the status *and* on the Lease (the grant writes the
    status first; a claim between the two is answered NotClaimable, "retry shortly")."""
    run = runs.wait_phase(kube, ns, name, "Starting", timeout=30)
    holder, fence = run["status"]["holder"], run["status"]["fence"]

    def lease_granted() -> bool:
        resp = kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}")
        spec = resp.json().get("spec") or {} if resp.status_code == 200 else {}
        return spec.get("holderIdentity") == holder and spec.get("leaseTransitions") == fence

    eventually(lease_granted, timeout=30, what=f"{ns}/{name}'s Lease granted to {holder}")
    return run


@pytest.mark.local_cluster
def test_claim_heartbeat_checkpoint_complete(kube: Kube, namespace: str, gateway: str) -> None:
    token = worker_identity(kube, namespace, "ext")
    runs.create(kube, namespace, external_run("ext-job", budget={"capCents": 500}))
    open_attempt(kube, namespace, "ext-job")
    claim = call(gateway, namespace, "ext-job", "claim", token, {"workerId": "laptop-1"})
    assert claim.status_code == 200, claim.text
    c = claim.json()
    assert (c["holder"], c["fence"], c["attempt"]) == ("ext-job-a1", 1, 1)
    assert c["payload"] == {"invoice": "8f1b"} and c["idempotencyKey"] == "invoice:8f1b"
    assert c["leaseDurationSeconds"] == 8 and c["capRemainingCents"] == 500 and c["stop"] is False
    tool = c["toolClaim"]
    me = httpx.post(f"{kube.config.server}/apis/authentication.k8s.io/v1/selfsubjectreviews", verify=ca_only(),
                    headers={"Authorization": f"Bearer {tool['token']}"},
                    json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).json()
    assert me["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:ext-job-worker"
    # The same worker may claim again (idempotent); another one may not.
    assert call(gateway, namespace, "ext-job", "claim", token, {"workerId": "laptop-1"}).status_code == 200
    other = call(gateway, namespace, "ext-job", "claim", token, {"workerId": "laptop-2"})
    assert other.status_code == 409 and other.json()["error"]["code"] == "HeldByAnother"
    fenced = {"holder": c["holder"], "fence": c["fence"]}
    hb = call(gateway, namespace, "ext-job", "heartbeat", token, {**fenced, "usage": {"cents": 120, "tokens": 9}})
    assert hb.status_code == 200 and hb.json()["capRemainingCents"] == 380
    assert hb.json()["toolClaim"]["token"] and hb.json()["status"] in ("Starting", "Running")
    assert call(gateway, namespace, "ext-job", "checkpoint", token, {**fenced, "cursor": "row-7"}).status_code == 200
    eventually(lambda: (runs.get(kube, namespace, "ext-job")["status"].get("checkpoint") or {}).get("cursor") == "row-7",
               timeout=20, what="checkpoint folded")
    done = call(gateway, namespace, "ext-job", "complete", token, {**fenced, "result": {"captured": True}})
    assert done.status_code == 200, done.text
    run = runs.wait_phase(kube, namespace, "ext-job", "Succeeded", timeout=30)
    assert run["status"]["result"] == {"captured": True} and run["status"]["usage"]["cents"] == 120


@pytest.mark.local_cluster
def test_progress_reaches_the_status_within_a_fold_interval_not_a_lease_later(
        kube: Kube, namespace: str, gateway: str) -> None:
    """A heartbeat's usage and checkpoint were folded only when something else woke the run
    (at worst the lapse check a lease duration later): `test_claim_heartbeat_checkpoint_complete`
    stopped heartbeating while it waited for the fold and lost the run about half the time. With
    a 60 s lease, the fold (interval 1 s here) must not wait for the lease."""
    token = worker_identity(kube, namespace, "ext")
    runs.create(kube, namespace, external_run(
        "slow", lease={"durationSeconds": 60, "renewIntervalSeconds": 20, "startupGraceSeconds": 60}))
    open_attempt(kube, namespace, "slow")
    c = call(gateway, namespace, "slow", "claim", token, {}).json()
    eventually(lambda: runs.get(kube, namespace, "slow")["status"].get("phase") == "Running", timeout=20,
               what="first renewal recorded")
    fenced = {"holder": c["holder"], "fence": c["fence"]}
    for i in range(1, 4):
        began = time.monotonic()
        hb = call(gateway, namespace, "slow", "checkpoint", token,
                  {**fenced, "cursor": f"row-{i}", "usage": {"cents": 10 * i, "tokens": 0}})
        assert hb.status_code == 200, hb.text
        eventually(lambda: (s := runs.get(kube, namespace, "slow")["status"]).get("checkpoint", {}).get("cursor")
                   == f"row-{i}" and s["usage"]["cents"] == 10 * i, timeout=10, what=f"report {i} folded")
        assert time.monotonic() - began < 10


@pytest.mark.local_cluster
def test_auth_and_input_errors(kube: Kube, namespace: str, gateway: str) -> None:
    runs.create(kube, namespace, external_run("job"))
    open_attempt(kube, namespace, "job")
    none = call(gateway, namespace, "job", "claim", None, {})
    assert none.status_code == 401 and none.json()["error"]["code"] == "Unauthorized"
    wrong_audience = worker_identity(kube, namespace, "aud", audience=None)
    assert call(gateway, namespace, "job", "claim", wrong_audience, {}).status_code == 401
    stranger = worker_identity(kube, namespace, "stranger", allowed=False)
    forbidden = call(gateway, namespace, "job", "claim", stranger, {})
    assert forbidden.status_code == 403 and "claim" in forbidden.json()["error"]["message"]
    token = worker_identity(kube, namespace, "ext")
    assert call(gateway, namespace, "nope", "claim", token, {}).status_code in (403, 404)
    c = call(gateway, namespace, "job", "claim", token, {}).json()
    bad = call(gateway, namespace, "job", "heartbeat", token, {"holder": c["holder"], "fence": "x"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "fence"
    negative = call(gateway, namespace, "job", "heartbeat", token,
                    {"holder": c["holder"], "fence": c["fence"], "usage": {"cents": -1}})
    assert negative.status_code == 422 and negative.json()["error"]["field"] == "usage.cents"
    unknown = call(gateway, namespace, "job", "complete", token, {"holder": c["holder"], "fence": c["fence"],
                                                                 "result": {}, "extra": 1})
    assert unknown.status_code == 422 and unknown.json()["error"]["field"] == "extra"
    stale = call(gateway, namespace, "job", "heartbeat", token, {"holder": c["holder"], "fence": c["fence"] + 1})
    assert stale.status_code == 410 and stale.json()["error"]["code"] == "StaleFence", stale.text


@pytest.mark.local_cluster
def test_only_the_claimant_drives_an_attempt(kube: Kube, namespace: str, gateway: str) -> None:
    """`claim` RBAC lets a caller claim an open attempt, not drive one someone else claimed."""
    owner = worker_identity(kube, namespace, "ext")
    stranger = worker_identity(kube, namespace, "other")
    runs.create(kube, namespace, external_run("mine"))
    run = open_attempt(kube, namespace, "mine")
    fenced = {"holder": run["status"]["holder"], "fence": run["status"]["fence"]}
    # Nobody claimed yet: holder and fence read from the status are not enough.
    unclaimed = call(gateway, namespace, "mine", "heartbeat", stranger, fenced)
    assert unclaimed.status_code == 403 and unclaimed.json()["error"]["code"] == "NotClaimant", unclaimed.text
    assert call(gateway, namespace, "mine", "claim", owner, {"workerId": "w1"}).status_code == 200
    bodies = {"heartbeat": {**fenced, "checkpoint": "stolen", "usage": {"cents": 999}},
              "checkpoint": {**fenced, "cursor": "stolen"}, "complete": {**fenced, "result": {"by": "stranger"}},
              "fail": {**fenced, "error": {"code": "Stolen"}}, "cancel": {**fenced, "reason": "stolen"}}
    for op, body in bodies.items():
        refused = call(gateway, namespace, "mine", op, stranger, body)
        assert refused.status_code == 403, (op, refused.text)
        assert refused.json()["error"]["code"] == "NotClaimant" and "another identity" in refused.json()["error"]["message"]
    # The same identity naming another worker is a mix-up between its processes: 409.
    other_worker = call(gateway, namespace, "mine", "heartbeat", owner, {**fenced, "workerId": "w2"})
    assert other_worker.status_code == 409 and other_worker.json()["error"]["code"] == "HeldByAnother"
    lease = kube.ok(kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/mine"))
    annotations = lease["metadata"].get("annotations") or {}
    assert annotations.get("tether.dev/checkpoint") != "stolen" and "tether.dev/usage" not in annotations
    status = runs.get(kube, namespace, "mine")["status"]
    assert "result" not in status and "error" not in status
    # The claimant still drives it.
    assert call(gateway, namespace, "mine", "heartbeat", owner, {**fenced, "workerId": "w1"}).status_code == 200
    done = call(gateway, namespace, "mine", "complete", owner, {**fenced, "result": {"by": "owner"}})
    assert done.status_code == 200, done.text
    assert runs.wait_phase(kube, namespace, "mine", "Succeeded", timeout=30)["status"]["result"] == {"by": "owner"}


@pytest.mark.local_cluster
def test_budget_exceeded_is_402(kube: Kube, namespace: str, gateway: str) -> None:
    kube.ok(kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{namespace}/workerbudgets",
                      {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget", "metadata": {"name": "b"},
                       "spec": {"limitCents": 0}}))
    runs.create(kube, namespace, external_run("poor", budget={"budgetRef": {"name": "b"}}))
    eventually(lambda: (runs.condition(runs.get(kube, namespace, "poor"), "Admitted") or {}).get("status") == "False",
               timeout=30, what="not admitted")
    token = worker_identity(kube, namespace, "ext")
    resp = call(gateway, namespace, "poor", "claim", token, {})
    assert resp.status_code == 402 and resp.json()["error"]["code"] == "BudgetExceeded"


@pytest.mark.local_cluster
def test_reference_scenario_over_http(kube: Kube, namespace: str, gateway: str) -> None:
    token = worker_identity(kube, namespace, "ext")
    runs.create(kube, namespace, external_run("ref"))
    open_attempt(kube, namespace, "ref")
    port = int(gateway.rsplit(":", 1)[1])
    proxy = CutProxy(("127.0.0.1", port))
    try:
        # 1. W1 claims through its own network path (the proxy), and heartbeats.
        w1 = WorkerRun.claim(f"http://{proxy.url}", namespace, "ref", token, worker_id="w1")
        w1.start()
        assert w1.fence == 1 and w1.owned
        runs.wait_phase(kube, namespace, "ref", "Running", timeout=30)
        w1_tool = w1.tool_claim["token"]  # type: ignore[index]
        # 2. W1 is cut off.
        proxy.cut_all()
        # 3-4. The lease lapses; W2 claims the new attempt with a higher fence.
        eventually(lambda: runs.get(kube, namespace, "ref")["status"].get("attempt") == 2, timeout=30,
                   what="attempt 2 granted")
        w2 = eventually(lambda: _try_claim(gateway, namespace, token), timeout=30, what="W2's claim")
        assert w2.fence == 3 and w2.holder == "ref-a2"
        # W1's tool credential died with its attempt.
        gone = httpx.post(f"{kube.config.server}/apis/authentication.k8s.io/v1/selfsubjectreviews",
                          verify=ca_only(), headers={"Authorization": f"Bearer {w1_tool}"},
                          json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
        assert gone.status_code == 401
        # 5. W1 returns: 410 on heartbeat and on complete.
        proxy.heal_all()
        assert w1.ownership_unknown or w1.lost
        direct = {"holder": w1.holder, "fence": w1.fence}
        assert call(f"http://{proxy.url}", namespace, "ref", "heartbeat", token, direct).status_code == 410
        assert call(f"http://{proxy.url}", namespace, "ref", "complete", token,
                    {**direct, "result": {"by": "w1"}}).status_code == 410
        assert w1.renew() is False and w1.lost
        with pytest.raises(LeaseLost):
            w1.complete({"by": "w1"})
        w2.start()
        w2.complete({"by": "w2"})
        run = runs.wait_phase(kube, namespace, "ref", "Succeeded", timeout=30)
        assert run["status"]["result"] == {"by": "w2"}
        assert [a["outcome"] for a in run["status"]["attempts"]] == ["LeaseLost", "Succeeded"]
        w1.stop()
        w2.stop()
    finally:
        proxy.close()


def _try_claim(gateway: str, ns: str, token: str) -> WorkerRun | None:
    try:
        return WorkerRun.claim(gateway, ns, "ref", token, worker_id="w2")
    except ClaimRefused as exc:
        if exc.status == 409:
            return None
        raise


@pytest.mark.local_cluster
def test_schemathesis_against_the_gateway(kube: Kube, namespace: str, gateway: str) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    token = worker_identity(kube, namespace, "ext")
    runs.create(kube, namespace, external_run("fuzzed"))
    open_attempt(kube, namespace, "fuzzed")
    schema = schemathesis.openapi.from_url(f"{gateway}/openapi.json")
    failures = []
    started = time.monotonic()
    for op in schema.get_all_operations():
        operation = op.ok()

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case: Any) -> None:
            case.path_parameters = {"namespace": namespace, "name": "fuzzed"}
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}
            response = case.call(base_url=gateway)
            try:
                # Schema-valid bodies are often refused on purpose (a random fence is stale: 410),
                # so "positive data is accepted" does not apply; every other check does.
                case.validate_response(response, excluded_checks=[positive_data_acceptance])
            except AssertionError as exc:  # schemathesis raises subclasses of AssertionError
                failures.append((operation.label, response.status_code, str(exc)[:300]))

        check()
    assert time.monotonic() - started < 300
    assert not failures, failures[:5]


@pytest.mark.local_cluster
def test_gateway_serves_tls_when_configured(kube: Kube, namespace: str, tmp_path: Path) -> None:
    from tether.devcluster import pki

    ca = pki.CertificateAuthority(tmp_path)
    serving = ca.issue("gateway", "tether-gateway", server=True)
    port = free_port()
    op = OperatorProcess(namespace, os.environ["TETHER_TEST_KUBECONFIG"], tmp_path / "op.log",
                         extra_args=[f"--gateway-port={port}", "--gateway-host=127.0.0.1",
                                     f"--gateway-tls-cert={serving.cert}", f"--gateway-tls-key={serving.key}"]).start()
    try:
        verify = ssl.create_default_context(cafile=str(ca.pair.cert))
        url = f"https://127.0.0.1:{port}"
        eventually(lambda: _up_tls(url, verify), timeout=30, what="the TLS gateway")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).raise_for_status()  # no plain HTTP
        token = worker_identity(kube, namespace, "ext")
        runs.create(kube, namespace, external_run("tls-job"))
        open_attempt(kube, namespace, "tls-job")
        run = WorkerRun.claim(url, namespace, "tls-job", token, verify=verify)
        with run:
            run.complete({"over": "tls"})
        assert runs.wait_phase(kube, namespace, "tls-job", "Succeeded", timeout=30)["status"]["result"] == {"over": "tls"}
    finally:
        op.stop()


def _up_tls(url: str, verify: ssl.SSLContext) -> bool:
    try:
        return httpx.get(f"{url}/healthz", verify=verify, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
