"""Payloads of any size the API server stores reach the worker (issue 9).

A payload over ~128 KiB used to be passed as one environment variable, which the kernel refuses
to exec: the pod exited 127 on every attempt and the run failed. Up to 32 KiB the payload is
still inline (TETHER_PAYLOAD); above, the pod gets TETHER_PAYLOAD_FROM=spec.payload and the SDK
reads the payload from its WorkerRun.
"""

from __future__ import annotations

from typing import Any

import pytest

from testkit import runs
from testkit.kube import Kube
from tests.support.payload_worker import digest


def _body(name: str, payload: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name},
            "spec": {"payload": payload,
                     "lease": {"durationSeconds": 10, "renewIntervalSeconds": 2, "startupGraceSeconds": 30},
                     "retry": {"maxAttempts": 1},
                     "template": {"spec": {"containers": [{"name": "worker", "image": "tether-worker",
                                                           "command": ["python", "tests/support/payload_worker.py"]}]}}}}


@pytest.mark.local_cluster
@pytest.mark.parametrize(("name", "size"), [("small", 1_000), ("near-inline-limit", 30_000),
                                            ("over-argv-limit", 200_000), ("large", 900_000)])
def test_the_worker_receives_its_payload_whatever_its_size(kube: Kube, namespace: str, operator: Any,
                                                           name: str, size: int) -> None:
    payload = {"text": "x" * size, "nested": {"n": size, "list": list(range(10))}}
    runs.create(kube, namespace, _body(name, payload))
    run = runs.wait_phase(kube, namespace, name, ("Succeeded", "Failed", "Lost"), timeout=90)
    assert run["status"]["phase"] == "Succeeded", run["status"]
    assert run["status"]["result"] == digest(payload)
    pod = kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}-a1"))
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    if size > 32 * 1024:
        # The pod spec does not carry a copy: every pod watcher would receive it otherwise.
        assert "TETHER_PAYLOAD" not in env and env["TETHER_PAYLOAD_FROM"] == "spec.payload"
    else:
        assert "TETHER_PAYLOAD_FROM" not in env and len(env["TETHER_PAYLOAD"]) > size
