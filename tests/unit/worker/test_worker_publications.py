"""What the answer to a publication means to the Python SDK (docs/protocol.md §5.4, §6.3), from
sdk/vectors/publications.json, which the TypeScript and Go SDKs' tests run too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tether.worker import ResultInvalid
from tether.worker.transport import KubeTransport
from tests.unit.worker.test_worker import _MockKube, _gateway, _gateway_answer

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[3] / "sdk/vectors/publications.json").read_text())


def _outcome(publish: Any) -> str:
    """The vectors' name for what one publication did: published, lost, bad result or retry."""
    try:
        return "published" if publish() else "lost"
    except ResultInvalid:
        return "bad result"
    except httpx.HTTPStatusError:
        return "retry"  # what WorkerRun retries until its lease deadline


@pytest.mark.parametrize("vector", VECTORS["pod"], ids=lambda v: v["name"])
def test_a_pod_publication_answer_means_to_the_python_sdk_what_it_means_to_every_sdk(vector: dict[str, Any]) -> None:
    """A 500 with etcd's "request is too large" (or its client's ResourceExhausted) refuses the
    value every time: a bad result like the 413, never retried as a 5xx until the worker dies."""
    w = VECTORS["worker"]
    patches: list[httpx.Request] = []

    def api(request: httpx.Request) -> httpx.Response:
        patches.append(request)
        return _gateway_answer(vector)

    t = KubeTransport(w["namespace"], w["name"], w["holder"], w["fence"], _MockKube(api),  # type: ignore[arg-type]
                      timeout=1.0, run_uid=w["runUid"])
    assert _outcome(lambda: t.publish("result", VECTORS["result"])) == vector["outcome"]
    assert [p.method for p in patches] == ["PATCH"]


@pytest.mark.parametrize("vector", VECTORS["gateway"], ids=lambda v: v["name"])
def test_a_gateway_publication_answer_means_to_the_python_sdk_what_it_means_to_every_sdk(
        vector: dict[str, Any]) -> None:
    w = VECTORS["worker"]
    t = _gateway(lambda request: _gateway_answer(vector), worker_id=w["workerId"], run_uid=w["runUid"])
    assert _outcome(lambda: t.publish("result", VECTORS["result"])) == vector["outcome"]
