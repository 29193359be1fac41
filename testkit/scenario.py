"""Building blocks of the fault scenarios: a WorkerRun running tests/support/worker_app.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tether import protocol
from testkit import runs
from testkit.kube import Kube, eventually

MEASUREMENTS = Path(__file__).resolve().parents[1] / ".tether" / "measurements.jsonl"


def app_run(name: str, payload: dict[str, Any], duration: int = 8, renew: int = 1,
            annotations: dict[str, str] | None = None, env: list[dict[str, str]] | None = None,
            max_attempts: int = 3) -> dict[str, Any]:
    return runs.use_test_image({
        "apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name},
        "spec": {
            "payload": payload,
            "lease": {"durationSeconds": duration, "renewIntervalSeconds": renew, "startupGraceSeconds": 30},
            "retry": {"maxAttempts": max_attempts, "backoff": {"initialSeconds": 0}},
            "template": {
                "metadata": {"annotations": annotations or {}},
                "spec": {
                    # Long enough that a worker cut off from the cluster outlives its deletion.
                    "terminationGracePeriodSeconds": 300,
                    "containers": [{"name": "worker", "image": "tether-test-worker",
                                    "command": ["python", "tests/support/worker_app.py"],
                                    "env": env or []}],
                },
            },
        },
    })


def lines(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def wait_line(out: Path, timeout: float = 60, **match: Any) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        return next((entry for entry in lines(out) if all(entry.get(k) == v for k, v in match.items())), None)

    return eventually(find, timeout=timeout, interval=0.05, what=f"worker line {match} in {out}")


def lease(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    return kube.ok(kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}"))


def watch_last_renewal(kube: Kube, ns: str, name: str, holder: str, timeout: float = 60) -> float:
    """Polls the Lease until `holder` no longer holds it; returns when (on this machine's
    monotonic clock) its last new resourceVersion was seen."""
    last_rv, last_seen = None, time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = lease(kube, ns, name)
        if current["spec"].get("holderIdentity") != holder:
            return last_seen
        rv = current["metadata"]["resourceVersion"]
        if rv != last_rv:
            last_rv, last_seen = rv, time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"{holder} still holds {ns}/{name} after {timeout}s")


def record_measurement(name: str, **values: Any) -> None:
    MEASUREMENTS.parent.mkdir(exist_ok=True)
    with MEASUREMENTS.open("a") as f:
        f.write(json.dumps({"name": name, "pid": os.getpid(), **values}) + "\n")


def held_by(kube: Kube, ns: str, name: str, timeout: float = 60) -> dict[str, Any]:
    """Waits until the run is granted and its Lease names the holder; returns the run."""
    run = eventually(lambda: (r := runs.get(kube, ns, name)).get("status", {}).get("holder") and r,
                     timeout=timeout, what=f"{name} granted")
    eventually(lambda: lease(kube, ns, name)["spec"].get("holderIdentity") == run["status"]["holder"],
               timeout=30, what=f"{name}'s lease written")
    return run


def fenced_result(kube: Kube, ns: str, name: str, fence: int, holder: str, result: dict[str, Any]) -> int:
    """The worker SDK's complete(): one JSON patch whose tests pin fence and holder."""
    patch = protocol.fenced_patch(holder, fence, "result", result)
    return kube.patch(Kube.wr_path(ns, name) + "/status", patch, kind="json").status_code
