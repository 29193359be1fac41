"""An External run's account (ServiceAccount, Role, RoleBinding) is made by the gateway at the run's
first claim (docs/sdks.md), found by an adversarial review's cases: a claim that read a deleted
namesake never touches the live run's identity; what the API server refuses for good refuses the
claim (409, not a 502 to retry) and says so on the run; an account deleted since is made again by
the next tool claim."""

from __future__ import annotations

import copy
from typing import Any

from tether.gateway.app import Claimant, build_app
from tether.gateway.auth import Caller
from tether.kube.paths import role_binding_path, role_path, run_path, service_account_path
from tests.unit.gateway.test_gateway_envelope import AUTH, OP, _call, _envelope, _lease, _run, gateway_api, held_api

SA = service_account_path("ns", "job-worker")
ROLE = role_path("ns", "tether-worker-job")
RB = role_binding_path("ns", "tether-worker-job")


def _owner(api: Any, path: str) -> str | None:
    obj = api.get(path)
    return obj["metadata"]["ownerReferences"][0]["uid"] if obj is not None else None


def test_a_claim_that_read_a_deleted_namesake_never_touches_the_live_runs_identity() -> None:
    claimant = Claimant.of(Caller("system:serviceaccount:ns:ext", "u1", (), {}), "w1").encode()
    live = _run({"phase": "Running", "attempt": 1, "fence": 1, "holder": "job-a1"})
    live["metadata"]["uid"] = "run-2"  # the namesake, created after run-1 was deleted
    lease = _lease("job-a1", 1, **{"tether.dev/claimed-by": claimant})
    lease["metadata"]["ownerReferences"][0]["uid"] = "run-2"
    api = gateway_api(live, lease)
    app = build_app(api.client(), "tether-gateway")
    first = _call(app, "POST", f"{OP}/claim", json={"workerId": "w1"}, headers=AUTH)
    assert first.status_code == 200 and first.json()["toolClaim"] is not None, first.text
    assert {_owner(api, p) for p in (SA, ROLE, RB)} == {"run-2"}
    # A claim whose read of the run is from before the deletion (run-1: same name, holder, fence).
    stale = copy.deepcopy(live)
    stale["metadata"]["uid"] = "run-1"
    served = [False]

    def old_read(req: Any) -> tuple[int, dict[str, Any]] | None:
        if req.method == "GET" and req.path == run_path("ns", "job") and not served[0]:
            served[0] = True
            return 200, stale
        return None

    api.hooks.insert(0, old_read)
    before = len(api.asked(writes=True))
    late = _call(app, "POST", f"{OP}/claim", json={"workerId": "w9"}, headers=AUTH)
    assert late.status_code in (409, 410), late.text
    assert not [c for c in api.asked(writes=True)[before:] if c.split(" ")[1].split("/")[0]
                in ("serviceaccounts", "roles", "rolebindings")]
    assert {_owner(api, p) for p in (SA, ROLE, RB)} == {"run-2"}


def test_an_account_the_api_server_refuses_refuses_the_claim_for_good_and_says_so_on_the_run() -> None:
    api = held_api()
    api.objects.pop(SA)
    api.hooks.insert(0, lambda req: (403, {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
                                           "message": "exceeded quota: count/serviceaccounts"})
                     if req.method == "POST" and req.path.endswith("/serviceaccounts") else None)
    resp = _call(build_app(api.client(), "tether-gateway"), "POST", f"{OP}/claim", json={"workerId": "w1"},
                 headers=AUTH)
    error = _envelope(resp, 409, "WorkerIdentityRefused")
    assert "exceeded quota" in error["message"] and "job-worker" in error["message"], error
    events = [o for o in api.objects.values() if o.get("kind") == "Event" or "involvedObject" in o]
    assert [(e["reason"], e["involvedObject"]["name"]) for e in events] == [("WorkerIdentityRefused", "job")], events


def test_an_account_deleted_since_is_made_again_by_the_next_tool_claim() -> None:
    api = held_api()
    api.objects.pop(SA)
    app = build_app(api.client(), "tether-gateway")
    assert _call(app, "POST", f"{OP}/claim", json={"workerId": "w1"}, headers=AUTH).status_code == 200
    api.objects.pop(SA)  # deleted by someone
    app.state.gateway._secrets.clear()
    fenced = {"holder": "job-a1", "fence": 1, "runUid": "run-1", "workerId": "w1"}
    _call(app, "POST", f"{OP}/heartbeat", json=fenced, headers=AUTH)  # finds it gone, makes it again
    assert _owner(api, SA) == "run-1"
    beat = _call(app, "POST", f"{OP}/heartbeat", json=fenced, headers=AUTH)
    assert beat.status_code == 200 and beat.json()["toolClaim"]["serviceAccount"] == "job-worker", beat.text


def test_a_deleted_namesakes_leftover_account_is_a_busy_claim_to_retry_not_a_refusal() -> None:
    """Under the chart the operator may not delete ServiceAccounts: a leftover of a deleted run of the
    same name is garbage collection's to remove, shortly; meanwhile the claim is 503 Busy (retried)."""
    api = held_api(account_owners=[{"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "name": "job",
                                    "uid": "run-0"}])
    api.hooks.insert(0, lambda req: (403, {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
                                           "message": "serviceaccounts is forbidden: cannot delete"})
                     if req.method == "DELETE" else None)
    resp = _call(build_app(api.client(), "tether-gateway"), "POST", f"{OP}/claim", json={"workerId": "w1"},
                 headers=AUTH)
    error = _envelope(resp, 503, "Busy")
    assert "left by a deleted run" in error["message"] and resp.headers["retry-after"] == "1", error
