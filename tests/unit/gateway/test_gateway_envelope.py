"""The gateway answers every request with JSON in its error envelope, bounds what it reads, and
says 503 + Retry-After when the Kubernetes API cannot be reached. No cluster needed: the
Kubernetes side is either unreachable for real (a closed port) or the unit tests' fake API, which
records what the gateway forwarded."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from typing import Any, AsyncIterator

import httpx
import pytest

from tether.gateway.app import MAX_DEPTH, build_app
from tether.kube.client import KubeClient
from tether.kube.config import KubeConfig
from tether.kube.paths import lease_path, run_path, service_account_path
from testkit.fakeapi import FakeApi, Request

OP = "/api/v1/namespaces/ns/workerruns/job"
AUTH = {"Authorization": "Bearer t0ken"}


REVIEWS = ("tokenreviews", "subjectaccessreviews")


def gateway_api(*objects: dict[str, Any]) -> FakeApi:
    """The unit tests' fake API as the gateway meets it: it authenticates the caller (TokenReview:
    system:serviceaccount:ns:ext; SubjectAccessReview: allowed), mints tokens (TokenRequest), and
    holds `objects` (the run, its Lease, the run's ServiceAccount)."""
    api = FakeApi()

    def reviews(req: Request) -> tuple[int, dict[str, Any]] | None:
        if req.method != "POST":
            return None
        if req.path.endswith("/tokenreviews"):
            return 201, {"status": {"authenticated": True, "audiences": ["tether-gateway"],
                                    "user": {"username": "system:serviceaccount:ns:ext", "uid": "u1"}}}
        if req.path.endswith("/subjectaccessreviews"):
            return 201, {"status": {"allowed": True}}
        if req.path.endswith("/token"):
            return 201, {"status": {"token": "tool-1", "expirationTimestamp": "2026-11-30T16:10:00Z"}}
        return None

    api.before(reviews)
    for obj in objects:
        meta = obj["metadata"]
        path = {"WorkerRun": run_path, "Lease": lease_path, "ServiceAccount": service_account_path}[obj["kind"]]
        api.put(path(meta["namespace"], meta["name"]), obj)
    return api


def forwarded(api: FakeApi) -> list[str]:
    """What the gateway asked of the API server beyond authenticating the caller."""
    return [call for call in api.asked() if call.split(" ", 1)[1].split("/", 1)[0] not in REVIEWS]


def _call(app: Any, method: str, path: str, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            return await client.request(method, path, **kw)
    return asyncio.run(go())


def _envelope(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    error = resp.json()["error"]
    assert error["code"] == code and error["message"], error
    return error


def test_unknown_routes_and_methods_answer_in_the_envelope() -> None:
    app = build_app(gateway_api().client(), "tether-gateway")
    _envelope(_call(app, "POST", f"{OP}/explode", json={}), 404, "NotFound")
    _envelope(_call(app, "GET", "/nothing-here"), 404, "NotFound")
    wrong = _call(app, "GET", f"{OP}/claim")
    _envelope(wrong, 405, "MethodNotAllowed")
    assert wrong.headers["allow"] == "POST"


def test_a_10_mb_body_is_refused_before_it_is_read_or_forwarded() -> None:
    api = gateway_api()
    app = build_app(api.client(), "tether-gateway")
    big = json.dumps({"holder": "job-a1", "fence": 1, "result": {"blob": "x" * 10_000_000}})
    error = _envelope(_call(app, "POST", f"{OP}/complete", content=big, headers=AUTH), 413, "BodyTooLarge")
    assert "1048576" in error["message"]
    assert forwarded(api) == []


def test_a_streamed_body_without_length_is_cut_off_at_the_limit() -> None:
    api = gateway_api()
    app = build_app(api.client(), "tether-gateway", max_body_bytes=64 * 1024)
    sent = [0]

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(1000):  # 16 MiB if read whole
            sent[0] += 1
            yield b" " * 16384

    _envelope(_call(app, "POST", f"{OP}/heartbeat", content=chunks(), headers=AUTH), 413, "BodyTooLarge")
    assert sent[0] < 10 and forwarded(api) == []


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 100_000], ids=["just-too-deep", "recursion-bomb"])
def test_deeply_nested_json_is_a_422(depth: int) -> None:
    api = gateway_api()
    app = build_app(api.client(), "tether-gateway")
    nested = '{"holder":"job-a1","fence":1,"result":' + '{"a":' * (depth - 1) + "1" + "}" * (depth - 1) + "}"
    error = _envelope(_call(app, "POST", f"{OP}/complete", content=nested, headers=AUTH), 422, "MalformedBody")
    assert "nested deeper" in error["message"] and forwarded(api) == []


def test_reasonable_nesting_is_accepted_by_the_body_parser() -> None:
    """The limit leaves room for real results: depth MAX_DEPTH passes the parser and reaches the
    next step: the run's Lease is read (the API holds none here: the attempt is not current)."""
    api = gateway_api()
    app = build_app(api.client(), "tether-gateway")
    nested = '{"holder":"job-a1","fence":1,"result":' + '{"a":' * (MAX_DEPTH - 2) + "1" + "}" * (MAX_DEPTH - 2) + "}"
    resp = _call(app, "POST", f"{OP}/complete", content=nested, headers=AUTH)
    assert resp.status_code != 422, resp.text  # the body got through the parser
    assert forwarded(api)[0] == "GET leases/job"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_an_unreachable_api_server_is_a_503_with_retry_after() -> None:
    kube = KubeClient(KubeConfig(server=f"https://127.0.0.1:{_closed_port()}", ssl_context=ssl.create_default_context()),
                      timeout=5)
    app = build_app(kube, "tether-gateway")
    resp = _call(app, "POST", f"{OP}/claim", json={}, headers=AUTH)
    _envelope(resp, 503, "Unavailable")
    assert int(resp.headers["retry-after"]) >= 1


@pytest.mark.parametrize("status", [500, 503, 429])
def test_an_api_server_that_answers_errors_is_a_503(status: int) -> None:
    kube = KubeClient(KubeConfig(server="https://api", ssl_context=ssl.create_default_context()))
    kube.http = httpx.AsyncClient(base_url="https://api", transport=httpx.MockTransport(
        lambda request: httpx.Response(status, text="etcdserver: request timed out")))
    resp = _call(build_app(kube, "tether-gateway"), "POST", f"{OP}/heartbeat", json={}, headers=AUTH)
    _envelope(resp, 503, "Unavailable")
    assert resp.headers["retry-after"]


def test_a_bug_is_a_500_in_the_envelope(caplog: pytest.LogCaptureFixture) -> None:
    kube = gateway_api().client()

    async def broken(ns: str, name: str) -> dict[str, Any]:
        raise KeyError("metadata")

    kube.get_run = broken  # type: ignore[method-assign]  # a bug in the gateway's own code
    resp = _call(build_app(kube, "tether-gateway"), "POST", f"{OP}/claim", json={}, headers=AUTH)
    _envelope(resp, 500, "InternalError")
    assert any(getattr(r, "event", None) == "gateway_bug" and r.exc_info for r in caplog.records)


def test_claimant_record_round_trip_and_claims_written_before_it_was_json() -> None:
    from tether.gateway.app import Claimant
    from tether.gateway.auth import Caller

    ext = Caller("system:serviceaccount:ns:ext", "u1", (), {})
    other = Caller("system:serviceaccount:ns:other", "u2", (), {})
    mine = Claimant.parse(Claimant.of(ext, "w1").encode())
    assert mine == Claimant("system:serviceaccount:ns:ext", "u1", "w1")
    assert mine.is_claim_of(ext, "w1") and not mine.is_claim_of(ext, "w2") and not mine.is_claim_of(other, "w1")
    assert mine.same_identity(ext) and not mine.same_identity(other)
    # A recreated ServiceAccount of the same name is another identity (its uid differs).
    assert not mine.same_identity(Caller(ext.username, "u9", (), {}))
    assert mine.same_worker(None) and mine.same_worker("w1") and not mine.same_worker("w2")
    legacy = Claimant.parse("system:serviceaccount:ns:ext/w1")
    assert legacy is not None and legacy.is_claim_of(ext, "w1") and legacy.same_identity(ext)
    assert not legacy.is_claim_of(ext, "w2") and not legacy.same_identity(other)
    assert Claimant.parse(None) is None and Claimant.parse("") is None


def _run(status: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
            "metadata": {"name": "job", "namespace": "ns", "uid": "run-1"},
            "spec": {"executor": "External", "lease": {"durationSeconds": 20, "renewIntervalSeconds": 5}},
            "status": status}


def _lease(holder: str | None, transitions: int, **annotations: str) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "job", "namespace": "ns", "annotations": annotations,
                         "ownerReferences": [{"kind": "WorkerRun", "uid": "run-1", "controller": True}]},
            "spec": {"holderIdentity": holder, "leaseTransitions": transitions, "leaseDurationSeconds": 20}}


def revoked_api() -> FakeApi:
    """The revocation window: the run's status already names the next fence, the Lease still names
    the old holder (its clear is the next step)."""
    return gateway_api(_run({"phase": "Backoff", "attempt": 1, "fence": 2, "holder": None}), _lease("job-a1", 1))


@pytest.mark.parametrize("op, extra", [("heartbeat", {}), ("checkpoint", {"cursor": "row-1"})])
def test_a_revoked_attempt_renews_nothing_and_gets_no_tool_credential_before_its_lease_is_cleared(
        op: str, extra: dict[str, Any]) -> None:
    """Revocation moves the run's fence first and clears the Lease second. In between, the
    gateway used to renew the old attempt's Lease (it still named it) and mint it a fresh tool
    credential. It checks the run's status first now."""
    api = revoked_api()
    app = build_app(api.client(), "tether-gateway")
    error = _envelope(_call(app, "POST", f"{OP}/{op}", json={"holder": "job-a1", "fence": 1, **extra},
                            headers=AUTH), 410, "StaleFence")
    assert "no longer current" in error["message"]
    assert [call for call in forwarded(api) if not call.startswith("GET ")] == []  # no renewal, no token


def concluded_api() -> FakeApi:
    """The attempt's result was accepted and the run concluded (fence moved, Lease cleared)."""
    return gateway_api(_run({"phase": "Succeeded", "attempt": 1, "fence": 2, "holder": None, "result": {"ok": 1},
                             "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "outcome": "Succeeded"}]}),
                       _lease(None, 2))


def test_a_repeated_complete_whose_first_answer_was_lost_is_answered_200_only_for_the_same_result() -> None:
    app = build_app(concluded_api().client(), "tether-gateway")
    fenced = {"holder": "job-a1", "fence": 1, "runUid": "run-1"}
    same = _call(app, "POST", f"{OP}/complete", json={**fenced, "result": {"ok": 1}}, headers=AUTH)
    assert same.status_code == 200, same.text
    _envelope(_call(app, "POST", f"{OP}/complete", json={**fenced, "result": {"ok": 2}}, headers=AUTH),
              410, "StaleFence")
    _envelope(_call(app, "POST", f"{OP}/complete", json={**fenced, "runUid": "other", "result": {"ok": 1}},
                    headers=AUTH), 410, "StaleFence")


def test_a_repeated_complete_whose_first_answer_was_lost_says_the_runs_phase() -> None:
    """docs/protocol.md §6.2: a publication's reply carries `status`, the run's phase as the gateway
    last read or wrote it. A retry after a lost answer, once the operator has concluded the run,
    used to answer `"status": ""`, which names no phase."""
    app = build_app(concluded_api().client(), "tether-gateway")
    fenced = {"holder": "job-a1", "fence": 1, "runUid": "run-1"}
    same = _call(app, "POST", f"{OP}/complete", json={**fenced, "result": {"ok": 1}}, headers=AUTH)
    assert same.status_code == 200, same.text
    assert same.json() == {"status": "Succeeded", "fence": 1}


def held_api(account_owners: list[dict[str, Any]] | None = None) -> FakeApi:
    """Attempt job-a1 (fence 1) of run run-1, claimed by the caller as worker w1: every renewal lands
    (resourceVersion compare-and-swap) and mints a tool credential for the run's own account."""
    from tether.gateway.app import Claimant
    from tether.gateway.auth import Caller

    claimant = Claimant.of(Caller("system:serviceaccount:ns:ext", "u1", (), {}), "w1").encode()
    owners = [{"kind": "WorkerRun", "uid": "run-1"}] if account_owners is None else account_owners
    return gateway_api(_run({"phase": "Running", "attempt": 1, "fence": 1, "holder": "job-a1"}),
                       _lease("job-a1", 1, **{"tether.dev/claimed-by": claimant}),
                       {"apiVersion": "v1", "kind": "ServiceAccount",
                        "metadata": {"name": "job-worker", "namespace": "ns", "ownerReferences": owners}})


@pytest.mark.parametrize("op, extra, schema", [
    ("heartbeat", {}, "Signals"), ("checkpoint", {"cursor": "row-2"}, "Signals"),
    ("approval", {"name": "refund", "details": "42 EUR"}, "ApprovalResponse"), ("claim", None, "ClaimResponse")])
def test_every_renewal_reply_names_its_attempt_as_the_sdks_and_the_openapi_document_require(
        op: str, extra: dict[str, Any] | None, schema: str) -> None:
    """docs/protocol.md §6.4: a 200 is the gateway's reply only when it names the attempt it renewed
    (holder, fence, runUid) and carries the signals with their types. The SDKs recognise replies by
    that rule (a proxy's `{}` confirms nothing), so every reply must follow it, and the OpenAPI
    document the gateway serves must say so."""
    from tether import protocol
    from tether.gateway.openapi import openapi_document

    body = {"workerId": "w1"} if extra is None else {"holder": "job-a1", "fence": 1, "runUid": "run-1",
                                                      "workerId": "w1", **extra}
    resp = _call(build_app(held_api().client(), "tether-gateway"), "POST", f"{OP}/{op}", json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    if op == "claim":
        assert protocol.claim_reply(resp.content) is not None, resp.text
    assert protocol.gateway_reply(resp.content, "job-a1", 1, "run-1") is not None, resp.text
    assert protocol.gateway_reply(resp.content, "job-a1", 2, "run-1") is None  # another attempt's reply
    required = set(openapi_document()["components"]["schemas"][schema]["required"])
    assert {"holder", "fence", "runUid", "stop", "paused", "leaseExpiresAt", "status"} <= required
    assert required <= set(resp.json()), required - set(resp.json())


def test_no_tool_claim_for_an_account_the_run_does_not_own() -> None:
    """Review finding: `job-worker` exists but no run made it (an admin's account of that name): the
    claim is refused (WorkerIdentityTaken, saying what to do, also as an Event on the run), and
    nothing is made or minted for it."""
    api = held_api(account_owners=[])
    resp = _call(build_app(api.client(), "tether-gateway"), "POST", f"{OP}/claim", json={"workerId": "w1"},
                 headers=AUTH)
    error = _envelope(resp, 409, "WorkerIdentityTaken")
    assert "ServiceAccount job-worker exists and was not made for this run" in error["message"], error
    # Its create was answered 409 and the account read: nothing else was made or minted (the claim's
    # renewal came first: the identity is made for the run as read after it, never a namesake).
    assert not [call for call in api.asked(writes=True) if call.startswith(("POST secrets", "POST roles",
                                                                            "POST rolebindings", "POST tokens"))]
    account = api.get("/api/v1/namespaces/ns/serviceaccounts/job-worker")
    assert account is not None and not account["metadata"].get("ownerReferences")


def test_the_first_claim_makes_the_runs_own_account_and_a_grant_made_none() -> None:
    """An External run's identity (ServiceAccount, Role, RoleBinding, owned by the run) is made at its
    first claim, for its tool claims; a later claim or heartbeat makes none again."""
    api = held_api()
    api.objects.pop("/api/v1/namespaces/ns/serviceaccounts/job-worker")
    app = build_app(api.client(), "tether-gateway")
    resp = _call(app, "POST", f"{OP}/claim", json={"workerId": "w1"}, headers=AUTH)
    assert resp.status_code == 200 and resp.json()["toolClaim"]["serviceAccount"] == "job-worker", resp.text
    made = [call for call in api.asked(writes=True) if call.startswith(("POST serviceaccounts", "POST roles",
                                                                        "POST rolebindings"))]
    assert made == ["POST serviceaccounts/job-worker", "POST roles/tether-worker-job",
                    "POST rolebindings/tether-worker-job"], made
    account = api.get("/api/v1/namespaces/ns/serviceaccounts/job-worker")
    assert account is not None and account["metadata"]["ownerReferences"][0]["uid"] == "run-1"
    again = _call(app, "POST", f"{OP}/claim", json={"workerId": "w1"}, headers=AUTH)
    assert again.status_code == 200 and len([c for c in api.asked(writes=True) if c.startswith(
        ("POST serviceaccounts", "POST roles", "POST rolebindings"))]) == 3
    # Deleted by someone since (the gateway remembered it made it): the heartbeat's tool claim is
    # withheld, and the next claim makes the account again.
    api.objects.pop("/api/v1/namespaces/ns/serviceaccounts/job-worker")
    app.state.gateway._secrets.clear()
    beat = _call(app, "POST", f"{OP}/heartbeat", json={"holder": "job-a1", "fence": 1, "runUid": "run-1",
                                                       "workerId": "w1"}, headers=AUTH)
    assert beat.status_code == 200 and beat.json()["toolClaim"] is None, beat.text
    third = _call(app, "POST", f"{OP}/claim", json={"workerId": "w1"}, headers=AUTH)
    assert third.status_code == 200 and third.json()["toolClaim"]["serviceAccount"] == "job-worker", third.text


