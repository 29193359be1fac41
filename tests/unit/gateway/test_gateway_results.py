"""A result the Kubernetes API cannot store, through the gateway (docs/protocol.md §6.3): under
the gateway's 1 MiB body limit, yet making the run larger than etcd stores (a run with a large
payload). The API server answers 500 with etcd's message; the gateway answered 503 Unavailable,
which every SDK retries until the worker dies. It is a bad result, as the gateway's own 413."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tether.gateway.app import build_app
from testkit.fakeapi import FakeApi
from tests.unit.gateway.test_gateway_envelope import AUTH, OP, _call, _envelope, held_api


def _status(message: str) -> str:
    return json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": message, "code": 500})


def refusing_api(body: str) -> FakeApi:
    """The attempt is the caller's; the run's status patch is answered 500 with `body`."""
    api = held_api()
    api.before(lambda req: (500, json.loads(body)) if req.method == "PATCH" and req.path.endswith("/status")
               and "/workerruns/" in req.path else None)
    return api


def _complete(api: FakeApi) -> Any:
    fenced = {"holder": "job-a1", "fence": 1, "runUid": "run-1", "workerId": "w1"}
    return _call(build_app(api.client(), "tether-gateway"), "POST", f"{OP}/complete",
                 json={**fenced, "result": {"pad": "x" * 1000}}, headers=AUTH)


@pytest.mark.parametrize("message", [
    "etcdserver: request is too large",
    "rpc error: code = ResourceExhausted desc = trying to send message larger than max (2097843 vs. 2097152)"])
def test_a_result_the_api_server_cannot_store_is_a_413_bad_result_not_a_503(message: str) -> None:
    api = refusing_api(_status(message))
    resp = _complete(api)
    error = _envelope(resp, 413, "ResultTooLarge")
    assert message in error["message"] and error["field"] == "status.result"
    assert "retry-after" not in resp.headers
    assert sum(1 for r in api.requests if r.method == "PATCH" and "/workerruns/" in r.path) == 1  # refused once


def test_another_500_from_the_api_server_is_still_a_503_to_retry() -> None:
    resp = _complete(refusing_api(_status("Internal error occurred: resource quota evaluation timed out")))
    _envelope(resp, 503, "Unavailable")
    assert resp.headers["retry-after"]
