"""A result the Kubernetes API cannot store, through the gateway (docs/protocol.md §6.3): under
the gateway's 1 MiB body limit, yet making the run larger than etcd stores (a run with a large
payload). The API server answers 500 with etcd's message; the gateway answered 503 Unavailable,
which every SDK retries until the worker dies. It is a bad result, as the gateway's own 413."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tether.gateway.app import build_app
from tether.kube.client import Unavailable
from tests.unit.gateway.test_gateway_envelope import AUTH, OP, HeldKube, _call, _envelope


def _status(message: str) -> str:
    return json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": message, "code": 500})


class RefusingKube(HeldKube):
    """The attempt is the caller's; the status patch is answered 500 with `body`."""

    def __init__(self, body: str) -> None:
        super().__init__()
        self.body, self.patches = body, 0

    async def patch_run_status(self, ns: str, name: str, patch: list[dict[str, Any]],
                               timeout: float | None = None) -> dict[str, Any]:
        self.patches += 1
        raise Unavailable(500, self.body, f"patch status of {ns}/{name}")


def _complete(kube: RefusingKube) -> Any:
    fenced = {"holder": "job-a1", "fence": 1, "runUid": "run-1", "workerId": "w1"}
    return _call(build_app(kube, "tether-gateway"), "POST", f"{OP}/complete",  # type: ignore[arg-type]
                 json={**fenced, "result": {"pad": "x" * 1000}}, headers=AUTH)


@pytest.mark.parametrize("message", [
    "etcdserver: request is too large",
    "rpc error: code = ResourceExhausted desc = trying to send message larger than max (2097843 vs. 2097152)"])
def test_a_result_the_api_server_cannot_store_is_a_413_bad_result_not_a_503(message: str) -> None:
    kube = RefusingKube(_status(message))
    resp = _complete(kube)
    error = _envelope(resp, 413, "ResultTooLarge")
    assert message in error["message"] and error["field"] == "status.result"
    assert "retry-after" not in resp.headers
    assert kube.patches == 1  # refused once; trying again changes nothing


def test_another_500_from_the_api_server_is_still_a_503_to_retry() -> None:
    resp = _complete(RefusingKube(_status("Internal error occurred: resource quota evaluation timed out")))
    _envelope(resp, 503, "Unavailable")
    assert resp.headers["retry-after"]
