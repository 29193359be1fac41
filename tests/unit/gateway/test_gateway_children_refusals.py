"""What the gateway's spawn and child calls refuse, found by an adversarial review: a bad input is
a clear 422 (never a 500), the API server's 413 is a refusal (not a 502 to retry), `child` forwards
nothing but a run name into an API path, a spawn names the run it is for (runUid), spawn's found
run is handed back only when it is this run's child, spawning needs RBAC's `spawn` on the run, and
a pod run spawns nothing through the gateway."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tether.children.api import child_name
from tether.gateway.app import build_app
from testkit.fakeapi import FakeApi
from tests.unit.gateway.test_gateway_children import FENCED, RUNS, SPEC, _spawn, parent_api
from tests.unit.gateway.test_gateway_envelope import AUTH, OP, _call

pytestmark = pytest.mark.unit


def _raw(api: FakeApi, op: str, body: dict[str, Any]) -> httpx.Response:
    """A body as a non-Python client may send it (json.dumps: lone surrogates and NaN pass)."""
    return _call(build_app(api.client(), "tether-gateway"), "POST", f"{OP}/{op}", content=json.dumps(body).encode(),
                 headers={**AUTH, "content-type": "application/json"})


@pytest.mark.parametrize("spec", [
    {**SPEC, "payload": {"x": "\ud800"}},      # spawn_digest: UnicodeEncodeError
    {**SPEC, "payload": {"x": float("nan")}},  # kube client's JSON encoding: ValueError
    {**SPEC, "budget": 5},                     # with_parent: dict(5) TypeError
], ids=["lone-surrogate", "nan", "budget-not-an-object"])
def test_a_bad_spec_is_a_clear_refusal_not_a_500(spec: dict[str, Any]) -> None:
    resp = _raw(parent_api(), "spawn", {**FENCED, "key": "k1", "spec": spec})
    assert resp.status_code == 422, resp.text


def test_the_api_servers_413_is_a_spawn_refusal_not_a_502() -> None:
    """tether-workerrun-size refuses a child over 1 MiB (as CEL counts it, managedFields and
    <, >, & included) with 413: a refusal of this ask, which the SDK must not take as 'retry'."""
    api = parent_api()
    api.before(lambda req: (413, {"kind": "Status", "code": 413, "reason": "RequestEntityTooLarge", "message":
                                  "ValidatingAdmissionPolicy 'tether-workerrun-size' denied request"})
               if req.method == "POST" and req.path == RUNS else None)
    resp = _spawn(api)
    assert resp.status_code in (413, 422), resp.text


@pytest.mark.parametrize("name", ["../../../../../../api/v1/pods",
                                  "../../../../../../api/v1/namespaces/kube-system/secrets/x",
                                  "x?watch=true"])
def test_child_reads_nothing_outside_this_namespaces_workerruns(name: str) -> None:
    api = parent_api()
    resp = _call(build_app(api.client(), "tether-gateway"), "POST", f"{OP}/child",
                 json={**FENCED, "name": name}, headers=AUTH)
    asked = [a for a in api.asked() if "review" not in a]
    assert resp.status_code in (404, 422), resp.text
    assert all(a.split(" ", 1)[1].split("/", 1)[0] in ("workerruns", "leases") for a in asked), asked
    assert "GET workerruns/x" not in asked, asked  # x?watch=true went out as a watch


def test_a_spawn_must_name_the_run_it_is_for() -> None:
    """Without runUid nothing tells run-1 from a deleted namesake whose attempt job-a1 (fence 1) the
    same identity held: the child would name run-1's current attempt and the operator admits it."""
    api = parent_api()
    resp = _call(build_app(api.client(), "tether-gateway"), "POST", f"{OP}/spawn",
                 json={"holder": "job-a1", "fence": 1, "key": "k1", "spec": SPEC}, headers=AUTH)
    assert resp.status_code == 422, resp.text
    assert not api.asked("workerruns", writes=True)


def test_spawn_does_not_hand_back_a_run_that_is_not_this_runs_child() -> None:
    api = parent_api()
    name = child_name("job", "run-1", "search:1")
    api.put(f"{RUNS}/{name}", {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
                               "metadata": {"name": name, "namespace": "ns"},
                               "spec": {"payload": {"secret": "s3cr3t"}}, "status": {"result": {"private": 1}}})
    resp = _spawn(api)
    assert resp.status_code == 409 and "s3cr3t" not in resp.text, resp.text


def test_spawning_through_the_gateway_needs_the_spawn_verb_on_the_run() -> None:
    """`claim` lets an identity drive a run; a child's pod, made with the operator's rights, takes
    RBAC's `spawn` too (a SubjectAccessReview, as for claim)."""
    api = parent_api()
    api.hooks.insert(0, lambda req: (201, {"status": {"allowed": False}}) if req.method == "POST" and req.path.endswith(
        "/subjectaccessreviews") and req.body["spec"]["resourceAttributes"]["verb"] == "spawn" else None)
    resp = _spawn(api)
    assert resp.status_code == 403 and "may not spawn" in resp.json()["error"]["message"], resp.text
    assert not api.asked("workerruns", writes=True)


def test_a_pod_run_spawns_nothing_through_the_gateway() -> None:
    api = parent_api()
    api.objects[f"{RUNS}/job"]["spec"]["executor"] = "Pod"
    resp = _spawn(api)
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "NotExternal", resp.text
    assert not api.asked("workerruns", writes=True)


@pytest.mark.parametrize("path", ["/api/v1/namespaces/ns/workerruns/../spawn",
                                  "/api/v1/namespaces/ns/workerruns/%2E%2E/child",
                                  "/api/v1/namespaces/NS/workerruns/job/spawn"])
def test_a_path_that_names_no_possible_run_is_answered_404_and_goes_nowhere(path: str) -> None:
    api = parent_api()
    resp = _call(build_app(api.client(), "tether-gateway"), "POST", path, json={**FENCED, "key": "k", "spec": SPEC},
                 headers=AUTH)
    assert resp.status_code == 404, resp.text
    assert not [a for a in api.asked() if "review" not in a], api.asked()
