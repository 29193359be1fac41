"""The gateway's spawn and child calls (docs/protocol.md §6.2): an External parent's children, made
in the name of the attempt the caller drives and built by the gateway (not the worker), refused
for a stale attempt, a parent of no class, a capped parent's child without its share, or by the
API server; and the Python SDK's External spawn driven through it, end to end but the network."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tether.children.api import ANN_SPAWN_DIGEST, LABEL_PARENT, child_name, spawn_digest
from tether.gateway.app import build_app
from tether.worker import AsyncWorkerRun, ChildFailed, LeaseLost, SpawnConflict, SpawnRefused
from tether.worker.transport import AsyncGatewayTransport
from testkit.fakeapi import FakeApi
from tests.unit.gateway.test_gateway_envelope import AUTH, OP, _call, _envelope, held_api

pytestmark = pytest.mark.unit
RUNS = "/apis/tether.dev/v1alpha1/namespaces/ns/workerruns"
FENCED = {"holder": "job-a1", "fence": 1, "runUid": "run-1", "workerId": "w1"}
SPEC = {"executor": "Pod", "className": "tools", "payload": {"q": "tether"}, "budget": {"capCents": 20}}


def parent_api(class_name: str | None = "planners", budget: dict[str, Any] | None = None) -> FakeApi:
    """Attempt job-a1 of run job holds it, claimed by the caller; the run took `class_name`."""
    api = held_api()
    run = api.get(f"{RUNS}/job")
    assert run is not None
    run["spec"]["budget"] = budget or {"capCents": 100, "budgetRef": {"name": "team"}}
    if class_name is not None:
        run["status"]["class"] = {"name": class_name}
    api.objects[f"{RUNS}/job"] = run
    return api


def _spawn(api: FakeApi, **body: Any) -> httpx.Response:
    return _call(build_app(api.client(), "tether-gateway"), "POST", f"{OP}/spawn",
                 json={**FENCED, "key": "search:1", "spec": SPEC, **body}, headers=AUTH)


def test_the_gateway_builds_the_child_in_the_name_of_the_callers_attempt() -> None:
    api = parent_api()
    resp = _spawn(api)
    assert resp.status_code == 200, resp.text
    child = resp.json()["child"]
    name = child_name("job", "run-1", "search:1")
    assert child["metadata"]["name"] == name and api.get(f"{RUNS}/{name}") is not None
    assert child["spec"]["parentRef"] == {"name": "job", "uid": "run-1", "holder": "job-a1", "fence": 1,
                                          "depth": 1, "className": "planners"}
    assert child["spec"]["budget"] == {"capCents": 20, "budgetRef": {"name": "team"}}  # the parent's budget
    assert child["metadata"]["labels"] == {LABEL_PARENT: "job"}
    assert [r["uid"] for r in child["metadata"]["ownerReferences"]] == ["run-1"]
    # The digest is of what the worker sent, which it can compute without reading the parent.
    assert child["metadata"]["annotations"][ANN_SPAWN_DIGEST] == spawn_digest(SPEC)
    # Again: the same child, found, not made twice.
    again = _spawn(api)
    assert again.status_code == 200 and again.json()["child"]["metadata"]["uid"] == child["metadata"]["uid"]
    assert api.asked("workerruns", writes=True).count(f"POST workerruns/{name}") == 2
    assert api.landed(f"POST {RUNS}") == 1
    # A later generation of the key is another name.
    assert _spawn(api, generation=1).json()["child"]["metadata"]["name"] == child_name("job", "run-1", "search:1", 1)


def test_a_stale_attempt_spawns_nothing() -> None:
    api = parent_api()
    resp = _spawn(api, fence=2, holder="job-a2")
    _envelope(resp, 410, "StaleFence")
    assert not api.asked("workerruns", writes=True)


@pytest.mark.parametrize("api, body, status, code, words", [
    (lambda: parent_api(class_name=None), {}, 422, "SpawnRefused", "of no WorkerClass"),
    (parent_api, {"spec": {**SPEC, "parentRef": {"name": "other"}}}, 422, "MalformedBody", "parentRef"),
    (parent_api, {"spec": {"executor": "Pod", "payload": {}}}, 422, "SpawnRefused", "names its class"),
    (parent_api, {"spec": {"executor": "Pod", "className": "tools"}}, 422, "SpawnRefused", "names its share"),
    (parent_api, {"key": "not a key"}, 422, "MalformedBody", "key"),
    (parent_api, {"generation": 16}, 422, "MalformedBody", "generation"),
])
def test_what_the_gateway_refuses_before_it_creates_anything(api: Any, body: dict[str, Any], status: int,
                                                             code: str, words: str) -> None:
    fake = api()
    error = _envelope(_spawn(fake, **body), status, code)
    assert words in error["message"] or words == error.get("field"), error
    assert not fake.asked("workerruns", writes=True)


def test_the_api_servers_refusal_is_a_spawn_refused_with_its_words() -> None:
    api = parent_api()
    api.before(lambda req: (403, {"kind": "Status", "code": 403, "message": (
        "workerruns.tether.dev is forbidden: ValidatingAdmissionPolicy 'tether-child-classes' denied request: "
        "WorkerClass planners lets its runs spawn children of no class")}) if req.method == "POST"
        and req.path == RUNS else None)
    error = _envelope(_spawn(api), 422, "SpawnRefused")
    assert "tether-child-classes" in error["message"]


def test_the_child_call_reads_only_this_runs_children() -> None:
    api = parent_api()
    name = _spawn(api).json()["child"]["metadata"]["name"]
    api.put(f"{RUNS}/stranger", {"metadata": {"name": "stranger", "namespace": "ns"}, "spec": {}})
    app = build_app(api.client(), "tether-gateway")
    got = _call(app, "POST", f"{OP}/child", json={**FENCED, "name": name}, headers=AUTH)
    assert got.status_code == 200 and got.json()["child"]["metadata"]["name"] == name
    for other in ("stranger", "missing"):
        _envelope(_call(app, "POST", f"{OP}/child", json={**FENCED, "name": other}, headers=AUTH), 404, "ChildNotFound")
    _envelope(_call(app, "POST", f"{OP}/child", json={**FENCED, "fence": 2, "name": name}, headers=AUTH),
              410, "StaleFence")


def _sdk_run(api: FakeApi) -> tuple[AsyncWorkerRun, AsyncGatewayTransport]:
    """The Python SDK's External run on the gateway app (no network: httpx's ASGI transport)."""
    transport = AsyncGatewayTransport("http://gw", "ns", "job", "t0ken", "job-a1", 1, timeout=5, worker_id="w1",
                                      run_uid="run-1")
    transport._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(api.client(), "tether-gateway")),
                                        base_url="http://gw", headers=AUTH)
    run = AsyncWorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=20,
                         renew_interval=3600, transport=transport, run_uid="run-1")
    return run, transport


def test_an_external_worker_spawns_re_attaches_and_reads_its_childs_result_through_the_gateway() -> None:
    api = parent_api()

    async def main() -> tuple[str, Any, int]:
        run, _ = _sdk_run(api)
        async with run:
            child = await run.spawn("search:1", class_name="tools", payload={"q": "tether"}, cap_cents=20)
            again = await run.spawn("search:1", class_name="tools", payload={"q": "tether"}, cap_cents=20)
            assert again.name == child.name
            with pytest.raises(SpawnConflict, match="another spec"):
                await run.spawn("search:1", class_name="tools", payload={"q": "other"}, cap_cents=20)
            with pytest.raises(SpawnRefused, match="names its share"):
                await run.spawn("search:2", class_name="tools")
            stored = api.objects[f"{RUNS}/{child.name}"]
            stored["status"] = {"phase": "Succeeded", "attempt": 1, "result": {"hits": 3}}
            result = await child.result(timeout=5, poll=0.01)
            failed = await run.spawn("search:3", class_name="tools", cap_cents=5)
            api.objects[f"{RUNS}/{failed.name}"]["status"] = {"phase": "Failed", "conditions": [
                {"type": "Ready", "status": "False", "reason": "WorkerFailed", "message": "boom"}]}
            with pytest.raises(ChildFailed, match="WorkerFailed"):
                await failed.result(timeout=5, poll=0.01)
            return child.name, result, api.landed(f"POST {RUNS}")

    name, result, created = asyncio.run(main())
    assert result == {"hits": 3} and created == 2  # search:1 once, search:3 once
    assert api.objects[f"{RUNS}/{name}"]["spec"]["parentRef"]["holder"] == "job-a1"


def test_an_external_worker_that_lost_its_attempt_gets_no_childs_result() -> None:
    api = parent_api()

    async def main() -> None:
        run, _ = _sdk_run(api)
        async with run:
            child = await run.spawn("search:1", class_name="tools", cap_cents=20)
            api.objects[f"{RUNS}/{child.name}"]["status"] = {"phase": "Succeeded", "attempt": 1, "result": {}}
            parent = api.objects[f"{RUNS}/job"]
            parent["status"].update({"fence": 2, "holder": "job-a2", "attempt": 2})  # revoked, a new attempt
            with pytest.raises(LeaseLost):
                await child.result(timeout=5, poll=0.01)

    asyncio.run(main())
