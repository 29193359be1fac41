"""Interleavings the gateway must survive, forced deterministically against the real API server.

The gateway runs in this process (its ASGI app over httpx), talking to the real kube-apiserver
through a KubeClient whose hooks hold a call at the exact point where a race bites. No operator
runs: the test grants the attempt itself, as the operator would (status, then Lease), so
nothing else moves the objects while the interleaving is forced.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from typing import Any, Awaitable, Callable, TypeVar

import httpx
import pytest

from tether.api.models import WorkerRun
from tether.gateway.app import build_app
from tether.kube import config as kubeconfig
from tether.kube import resources
from tether.kube.client import KubeClient
from tether.kube.paths import lease_path, run_path
from tests.e2e.test_gateway import ca_only, external_run
from testkit.kube import AUDIENCE, Kube, worker_identity
from testkit import runs

pytestmark = pytest.mark.local_cluster

T = TypeVar("T")


class HookedKube(KubeClient):
    """The real client; `before_replace_lease` / `before_apply` / `before_patch_run_status` run just
    before those calls go out, and every TokenRequest it sends is recorded in `token_requests`."""

    def __init__(self) -> None:
        super().__init__(kubeconfig.load(os.environ["TETHER_TEST_KUBECONFIG"]))
        self.before_replace_lease: Callable[[], Awaitable[None]] | None = None
        self.before_apply: Callable[[str], Awaitable[None]] | None = None
        self.before_patch_run_status: Callable[[], Awaitable[None]] | None = None
        self.token_requests: list[str] = []

    async def replace_lease(self, lease: dict[str, Any]) -> dict[str, Any]:
        if self.before_replace_lease is not None:
            await self.before_replace_lease()
        return await super().replace_lease(lease)

    async def apply(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.before_apply is not None:
            await self.before_apply(path)
        return await super().apply(path, body)

    async def patch_run_status(self, ns: str, name: str, patch: list[dict[str, Any]],
                               timeout: float | None = None) -> dict[str, Any]:
        if self.before_patch_run_status is not None:
            await self.before_patch_run_status()
        return await super().patch_run_status(ns, name, patch, timeout)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path.endswith("/token"):
            self.token_requests.append(path)
        return await super().create(path, body)


def grant(kube: Kube, ns: str, name: str) -> tuple[str, int]:
    """What the operator does to open attempt 1: fence and holder in status, then the Lease; and the
    run's ServiceAccount, which tool claims are minted for."""
    run = runs.create(kube, ns, external_run(name))
    holder = f"{name}-a1"
    kube.ok(kube.patch(run_path(ns, name) + "/status",
                       {"status": {"phase": "Starting", "attempt": 1, "fence": 1, "holder": holder}}))
    model = WorkerRun.model_validate(runs.get(kube, ns, name))
    kube.ok(kube.post(lease_path(ns), resources.build_lease(model, holder, 1, 30, dt.datetime.now(dt.timezone.utc))))
    kube.ok(kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts",
                      {"metadata": {"name": resources.worker_service_account(model),
                                    "ownerReferences": [resources.owner_ref(model)]}}))
    return holder, 1


async def move_fence(kube: Kube, ns: str, name: str, fence: int) -> None:
    """The revocation's first write, as the operator makes it: the fence moves past `fence` and the
    holder is cleared. Its Lease clear comes second (not made here)."""
    async with kube.config.async_client(timeout=30) as api:
        bumped = await api.patch(run_path(ns, name) + "/status", headers={
            "Content-Type": "application/json-patch+json"}, json=[
            {"op": "test", "path": "/status/fence", "value": fence},
            {"op": "replace", "path": "/status/fence", "value": fence + 1},
            {"op": "replace", "path": "/status/holder", "value": None}])
        assert bumped.status_code == 200, bumped.text


def once(action: Callable[[], Awaitable[None]]) -> tuple[Callable[[], Awaitable[None]], list[int]]:
    """A hook that runs `action` the first time it is called only, and the count of its calls."""
    calls = [0]

    async def hook() -> None:
        calls[0] += 1
        if calls[0] == 1:
            await action()

    return hook, calls


async def _post(app: Any, ns: str, name: str, op: str, token: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30) as client:
        return await client.post(f"/api/v1/namespaces/{ns}/workerruns/{name}/{op}", json=body,
                                 headers={"Authorization": f"Bearer {token}"})


def through_gateway(calls: Callable[[Any], Awaitable[T]], hook: Callable[[HookedKube], None] | None = None) -> T:
    """Runs `calls(app)` against a fresh in-process gateway whose client `hook` prepared."""
    async def go() -> T:
        client = HookedKube()
        try:
            if hook is not None:
                hook(client)
            return await calls(build_app(client, AUDIENCE))
        finally:
            await client.close()
    return asyncio.run(go())


def _both_write_after_both_read(kube: HookedKube) -> None:
    """The first two Lease writes wait for each other: both claims have read the Lease (and seen
    it unclaimed) before either writes, the interleaving that let both win."""
    barrier = asyncio.Barrier(2)
    held = [0]

    async def hold() -> None:
        held[0] += 1
        if held[0] <= 2:
            await asyncio.wait_for(barrier.wait(), timeout=20)

    kube.before_replace_lease = hold


def test_two_concurrent_claims_cannot_both_win(kube: Kube, namespace: str) -> None:
    token = worker_identity(kube, namespace, "ext", audience=AUDIENCE)
    holder, fence = grant(kube, namespace, "race")

    async def claims(app: Any) -> list[httpx.Response]:
        return list(await asyncio.gather(*(_post(app, namespace, "race", "claim", token, {"workerId": w})
                                           for w in ("w1", "w2"))))

    answers = through_gateway(claims, _both_write_after_both_read)
    codes = sorted(r.status_code for r in answers)
    assert codes == [200, 409], [r.text for r in answers]
    winner = next(r for r in answers if r.status_code == 200).json()
    loser = next(r for r in answers if r.status_code == 409).json()
    assert (winner["holder"], winner["fence"]) == (holder, fence)
    assert loser["error"]["code"] == "HeldByAnother"
    claimed = kube.ok(kube.get(lease_path(namespace, "race")))["metadata"]["annotations"]["tether.dev/claimed-by"]
    assert '"workerId":"w1"' in claimed or '"workerId":"w2"' in claimed


def test_a_claim_repeated_by_the_same_worker_during_the_race_still_succeeds(kube: Kube, namespace: str) -> None:
    """The retry rule: a conflict caused by the claimant itself is re-read and retried, not refused."""
    token = worker_identity(kube, namespace, "ext", audience=AUDIENCE)
    grant(kube, namespace, "same")

    async def claims(app: Any) -> list[httpx.Response]:
        return list(await asyncio.gather(*(_post(app, namespace, "same", "claim", token, {"workerId": "w1"})
                                           for _ in range(2))))

    assert [r.status_code for r in through_gateway(claims, _both_write_after_both_read)] == [200, 200]


def test_many_concurrent_claims_have_one_winner(kube: Kube, namespace: str) -> None:
    """No forced interleaving: eight workers race as they would in the wild."""
    token = worker_identity(kube, namespace, "ext", audience=AUDIENCE)
    grant(kube, namespace, "herd")

    async def claims(app: Any) -> list[httpx.Response]:
        return list(await asyncio.gather(*(_post(app, namespace, "herd", "claim", token, {"workerId": f"w{i}"})
                                           for i in range(8))))

    answers = through_gateway(claims)
    assert sorted(r.status_code for r in answers) == [200] + [409] * 7, [r.text for r in answers]
    # The winner is the only one that may heartbeat.
    winner = next(i for i, r in enumerate(answers) if r.status_code == 200)
    fenced = {"holder": "herd-a1", "fence": 1}

    async def heartbeats(app: Any) -> list[int]:
        return [(await _post(app, namespace, "herd", "heartbeat", token, {**fenced, "workerId": f"w{i}"})).status_code
                for i in range(8)]

    codes = through_gateway(heartbeats)
    assert codes[winner] == 200 and all(code == 409 for i, code in enumerate(codes) if i != winner), codes


def test_revocation_between_renewal_and_mint_leaves_no_credential(kube: Kube, namespace: str) -> None:
    """The operator revokes the attempt (status fence bump, Lease cleared, tool-claim Secret deleted)
    after the claim's renewal and before the gateway creates that Secret: the delete finds nothing.
    The gateway must not leave a live Secret, nor hand out a working token, for the revoked attempt."""
    token = worker_identity(kube, namespace, "ext", audience=AUDIENCE)
    holder, fence = grant(kube, namespace, "late")
    secret = f"/api/v1/namespaces/{namespace}/secrets/{holder}-toolclaim"

    async def revoke(path: str) -> None:
        if not path.endswith("/secrets"):
            return
        await move_fence(kube, namespace, "late", fence)
        async with kube.config.async_client(timeout=30) as api:
            lease = (await api.get(lease_path(namespace, "late"))).json()
            lease["spec"] = {"holderIdentity": None, "leaseTransitions": fence + 1, "leaseDurationSeconds": 30}
            cleared = await api.put(lease_path(namespace, "late"), json=lease)
            assert cleared.status_code == 200, cleared.text
            assert (await api.delete(secret)).status_code == 404  # nothing to delete yet: the race

    def revoke_on_secret_create(client: HookedKube) -> None:
        client.before_apply = revoke

    answer = through_gateway(lambda app: _post(app, namespace, "late", "claim", token, {"workerId": "w1"}),
                             revoke_on_secret_create)
    assert answer.status_code == 200, answer.text  # the claim itself landed before the revocation
    tool = answer.json()["toolClaim"]
    if tool is not None:  # had a token been handed out, it must not work
        who = httpx.post(f"{kube.config.server}/apis/authentication.k8s.io/v1/selfsubjectreviews", verify=ca_only(),
                         headers={"Authorization": f"Bearer {tool['token']}"},
                         json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
        assert who.status_code == 401, who.text
    assert tool is None
    assert kube.get(secret).status_code == 404, "the revoked attempt's tool-claim Secret survived"
    # And the worker learns of the revocation on its next call.
    heartbeat = through_gateway(lambda app: _post(app, namespace, "late", "heartbeat", token,
                                                  {"holder": holder, "fence": fence, "workerId": "w1"}))
    assert heartbeat.status_code == 410, heartbeat.text


def test_an_accepted_result_or_error_is_never_replaced_through_the_gateway(kube: Kube, namespace: str) -> None:
    """Found by review: the gateway writes as the operator, which the admission policy does not hold
    to "never replaced", and a JSON-patch `add` replaces. Between the first accepted `complete` and
    the operator's revocation (no operator runs here: the window stays open), a second `complete`
    with another value, or a `fail`, must be refused; the same value again is a retry (200)."""
    token = worker_identity(kube, namespace, "ext", audience=AUDIENCE)
    holder, fence = grant(kube, namespace, "once")

    async def calls(app: Any) -> list[httpx.Response]:
        claim = await _post(app, namespace, "once", "claim", token, {})
        fenced = {"holder": holder, "fence": fence, "runUid": claim.json()["runUid"]}
        return [claim] + [await _post(app, namespace, "once", op, token, {**fenced, **body}) for op, body in [
            ("complete", {"result": {"v": 1}}), ("complete", {"result": {"v": 2}}),
            ("fail", {"error": {"code": "Late", "message": "m"}}), ("complete", {"result": {"v": 1}})]]

    claim, first, other, fail, again = through_gateway(calls)
    assert claim.status_code == 200 and first.status_code == 200, (claim.text, first.text)
    assert (other.status_code, other.json()["error"]["code"]) == (409, "AlreadyPublished"), other.text
    assert (fail.status_code, fail.json()["error"]["code"]) == (409, "AlreadyPublished"), fail.text
    assert again.status_code == 200, again.text
    status = runs.get(kube, namespace, "once")["status"]
    assert status["result"] == {"v": 1} and "error" not in status


def test_two_concurrent_publications_cannot_both_land(kube: Kube, namespace: str) -> None:
    """Both read a status with no result, then both patch: the resourceVersion `test` lets one in;
    the other reads again, finds a different result, and is refused."""
    token = worker_identity(kube, namespace, "ext", audience=AUDIENCE)
    holder, fence = grant(kube, namespace, "pair")
    barrier = asyncio.Barrier(2)

    def both_read_first(client: HookedKube) -> None:
        original = client.patch_run_status

        async def patch(ns: str, name: str, body: list[dict[str, Any]], timeout: float | None = None) -> dict[str, Any]:
            if barrier.n_waiting < 2 and not barrier.broken:
                try:
                    await asyncio.wait_for(barrier.wait(), timeout=20)
                except asyncio.BrokenBarrierError:
                    pass
            return await original(ns, name, body, timeout)

        client.patch_run_status = patch  # type: ignore[method-assign]

    async def calls(app: Any) -> list[httpx.Response]:
        claim = await _post(app, namespace, "pair", "claim", token, {})
        fenced = {"holder": holder, "fence": fence, "runUid": claim.json()["runUid"]}
        return list(await asyncio.gather(*(_post(app, namespace, "pair", "complete", token, {**fenced, "result": {"v": v}})
                                           for v in (1, 2))))

    answers = through_gateway(calls, both_read_first)
    assert sorted(r.status_code for r in answers) == [200, 409], [r.text for r in answers]
    winner = next(i for i, r in enumerate(answers) if r.status_code == 200) + 1
    assert runs.get(kube, namespace, "pair")["status"]["result"] == {"v": winner}


RENEWALS = {"claim": {}, "heartbeat": {"usage": {"cents": 3, "tokens": 10}}, "checkpoint": {"cursor": "row-7"},
            "approval": {"name": "deploy", "details": "push to prod"}}


@pytest.mark.parametrize("op", sorted(RENEWALS))
def test_a_lease_write_that_lands_after_the_fence_moved_is_not_answered_as_current(
        kube: Kube, namespace: str, op: str) -> None:
    """Revocation moves the run's status first and clears the Lease second. A call that read the run
    before the fence moved still finds the Lease held, and its PUT lands (the resourceVersion is
    current). Its answer must not say the attempt is current (410; a claim 409), and no tool claim
    may be minted for the revoked attempt."""
    token = worker_identity(kube, namespace, "ext", audience=AUDIENCE)
    name = f"moved-{op}"
    holder, fence = grant(kube, namespace, name)
    secret = f"/api/v1/namespaces/{namespace}/secrets/{holder}-toolclaim"
    body: dict[str, Any] = {"workerId": "w1", **RENEWALS[op]}
    if op != "claim":
        claimed = through_gateway(lambda app: _post(app, namespace, name, "claim", token, {"workerId": "w1"}))
        assert claimed.status_code == 200, claimed.text
        body.update(holder=holder, fence=fence, runUid=claimed.json()["runUid"])
        # The claim minted its own tool claim: without its Secret, one found at the end was minted by `op`.
        kube.ok(kube.delete(secret))
    hook, calls = once(lambda: move_fence(kube, namespace, name, fence))
    clients: list[HookedKube] = []

    def between_run_read_and_lease_write(client: HookedKube) -> None:
        client.before_replace_lease = hook
        clients.append(client)

    answer = through_gateway(lambda app: _post(app, namespace, name, op, token, body), between_run_read_and_lease_write)
    assert calls[0] == 1, "the gateway never wrote the Lease: the interleaving was not forced"
    expected = (409, "NotClaimable") if op == "claim" else (410, "StaleFence")
    assert (answer.status_code, answer.json().get("error", {}).get("code")) == expected, answer.text
    assert clients[0].token_requests == [], "a tool claim was minted for the revoked attempt"
    assert kube.get(secret).status_code == 404, "a tool-claim Secret was created for the revoked attempt"
    # The window was real: the run's fence had moved, yet the gateway's Lease write still landed on the
    # not-yet-cleared Lease (the revocation's Lease clear wins over it, a compare-and-swap retried).
    status = runs.get(kube, namespace, name)["status"]
    assert (status["fence"], status.get("holder")) == (fence + 1, None)
    lease = kube.ok(kube.get(lease_path(namespace, name)))
    assert lease["spec"]["holderIdentity"] == holder
    assert "tether.dev/claimed-by" in lease["metadata"]["annotations"]


@pytest.mark.parametrize("op,body", [("complete", {"result": {"v": 1}}),
                                     ("fail", {"error": {"code": "Boom", "message": "m"}}),
                                     ("cancel", {"reason": "enough"})])
def test_a_publication_after_the_fence_moved_is_refused_as_stale(kube: Kube, namespace: str, op: str,
                                                                 body: dict[str, Any]) -> None:
    """The fence moves between the gateway's Lease read (still held: the Lease clear comes second)
    and its fenced status patch: the patch's `test` refuses it, and the answer is 410, not a 503
    that sends the worker to retry a publication that can never land."""
    token = worker_identity(kube, namespace, "ext", audience=AUDIENCE)
    name = f"late-{op}"
    holder, fence = grant(kube, namespace, name)
    claimed = through_gateway(lambda app: _post(app, namespace, name, "claim", token, {"workerId": "w1"}))
    assert claimed.status_code == 200, claimed.text
    fenced = {"holder": holder, "fence": fence, "workerId": "w1", "runUid": claimed.json()["runUid"]}
    hook, calls = once(lambda: move_fence(kube, namespace, name, fence))

    def between_lease_read_and_status_patch(client: HookedKube) -> None:
        client.before_patch_run_status = hook

    answer = through_gateway(lambda app: _post(app, namespace, name, op, token, {**fenced, **body}),
                             between_lease_read_and_status_patch)
    assert calls[0] >= 1, "the gateway never patched the status: the interleaving was not forced"
    assert (answer.status_code, answer.json().get("error", {}).get("code")) == (410, "StaleFence"), answer.text
    status = runs.get(kube, namespace, name)["status"]
    assert (status["fence"], status.get("result"), status.get("error")) == (fence + 1, None, None)
