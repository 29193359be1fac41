"""How a payload reaches the worker: inline up to 32 KiB, else read from the WorkerRun (issue 9)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tether.api import constants as c
from tether.api.models import WorkerRun
from tether.kube import resources
from tether.worker.run import load_payload


def _run(payload: dict[str, Any], env: list[dict[str, str]] | None = None) -> WorkerRun:
    container: dict[str, Any] = {"name": "w", "command": ["w"], "env": env or []}
    return WorkerRun.model_validate({"metadata": {"name": "job", "namespace": "ns", "uid": "u"},
                                     "spec": {"payload": payload, "template": {"spec": {"containers": [container]}}}})


def _sized(total: int) -> dict[str, str]:
    """A payload whose compact JSON is exactly `total` bytes: {"k":"xxx…"} has 8 bytes of syntax."""
    return {"k": "x" * (total - 8)}


def _env(run: WorkerRun) -> dict[str, str]:
    pod = resources.build_pod(run, "job-a1", 1, 1, "job-a1")
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}


def test_payload_up_to_the_limit_is_inline() -> None:
    payload = _sized(resources.INLINE_PAYLOAD_BYTES)
    env = _env(_run(payload))
    assert len(env[c.ENV_PAYLOAD].encode()) == resources.INLINE_PAYLOAD_BYTES
    assert json.loads(env[c.ENV_PAYLOAD]) == payload and c.ENV_PAYLOAD_FROM not in env


def test_payload_over_the_limit_is_read_from_the_run() -> None:
    env = _env(_run(_sized(resources.INLINE_PAYLOAD_BYTES + 1)))
    assert c.ENV_PAYLOAD not in env and env[c.ENV_PAYLOAD_FROM] == "spec.payload"


def test_the_limit_counts_bytes_not_characters() -> None:
    # "é" is two bytes in UTF-8: what the kernel limits is bytes.
    env = _env(_run({"k": "é" * (resources.INLINE_PAYLOAD_BYTES // 2)}))
    assert env[c.ENV_PAYLOAD_FROM] == "spec.payload"


def test_a_template_cannot_shadow_the_payload() -> None:
    stale = [{"name": c.ENV_PAYLOAD, "value": '{"forged":true}'}, {"name": c.ENV_PAYLOAD_FROM, "value": "x"},
             {"name": "OWN", "value": "kept"}]
    large = _env(_run(_sized(40_000), env=stale))
    assert c.ENV_PAYLOAD not in large and large[c.ENV_PAYLOAD_FROM] == "spec.payload" and large["OWN"] == "kept"
    small = _env(_run({"n": 1}, env=stale))
    assert json.loads(small[c.ENV_PAYLOAD]) == {"n": 1} and c.ENV_PAYLOAD_FROM not in small


class _Kube:
    """A KubeConfig stand-in whose client answers from `handler` (no network)."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self.paths: list[str] = []

    def sync_client(self, timeout: float = 10.0) -> httpx.Client:
        def record(request: httpx.Request) -> httpx.Response:
            self.paths.append(request.url.path)
            return self.handler(request)
        return httpx.Client(transport=httpx.MockTransport(record), base_url="https://api")


ENV = {c.ENV_RUN: "job", c.ENV_NAMESPACE: "ns", c.ENV_PAYLOAD_FROM: "spec.payload"}


def test_sdk_reads_a_large_payload_from_its_run() -> None:
    kube = _Kube(lambda r: httpx.Response(200, json={"spec": {"payload": {"big": "y" * 50_000}}}))
    assert load_payload(ENV, kube) == {"big": "y" * 50_000}  # type: ignore[arg-type]
    assert kube.paths == ["/apis/tether.dev/v1alpha1/namespaces/ns/workerruns/job"]


def test_sdk_prefers_the_inline_payload_and_reads_nothing() -> None:
    kube = _Kube(lambda r: httpx.Response(500))
    assert load_payload({**ENV, c.ENV_PAYLOAD: '{"n":1}'}, kube) == {"n": 1}  # type: ignore[arg-type]
    assert load_payload({c.ENV_RUN: "job"}, kube) == {} and kube.paths == []  # type: ignore[arg-type]


def test_sdk_retries_a_server_error_but_not_a_refusal() -> None:
    answers = iter([httpx.Response(503), httpx.Response(200, json={"spec": {"payload": {"n": 2}}})])
    kube = _Kube(lambda r: next(answers))
    assert load_payload(ENV, kube, attempts=2, backoff=0) == {"n": 2}  # type: ignore[arg-type]
    forbidden = _Kube(lambda r: httpx.Response(403, json={"message": "forbidden"}))
    with pytest.raises(httpx.HTTPStatusError):
        load_payload(ENV, forbidden)  # type: ignore[arg-type]
    assert len(forbidden.paths) == 1


def test_sdk_refuses_a_source_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="TETHER_PAYLOAD_FROM"):
        load_payload({**ENV, c.ENV_PAYLOAD_FROM: "configmap/x"}, _Kube(lambda r: httpx.Response(500)))  # type: ignore[arg-type]


def test_sdk_never_takes_a_re_created_namesakes_payload_for_its_own() -> None:
    """The old run's pod starting late would otherwise run the new run's input."""
    from tether.worker.errors import LeaseLost

    kube = _Kube(lambda r: httpx.Response(200, json={"metadata": {"uid": "new"}, "spec": {"payload": {"n": 2}}}))
    with pytest.raises(LeaseLost):
        load_payload({**ENV, c.ENV_RUN_UID: "old"}, kube)  # type: ignore[arg-type]
    assert load_payload({**ENV, c.ENV_RUN_UID: "new"}, kube) == {"n": 2}  # type: ignore[arg-type]
