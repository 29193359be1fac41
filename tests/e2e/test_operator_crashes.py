"""kill -9 the operator at random points of grant and revocation, again and again."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict

import pytest

from testkit import runs
from testkit.kube import Kube, eventually
from testkit.scenario import record_measurement

KILLS = 22
RUNS = 8


pytestmark = pytest.mark.local_cluster


def test_operator_killed_repeatedly(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(1234)
    pod_uids: dict[str, set[str]] = defaultdict(set)
    fences: dict[str, list[int]] = defaultdict(list)
    stop = threading.Event()

    def observe() -> None:
        while not stop.is_set():
            for pod in kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/pods"))["items"]:
                pod_uids[pod["metadata"]["name"]].add(pod["metadata"]["uid"])
            for run in kube.ok(kube.get(Kube.wr_path(namespace)))["items"]:
                fence = (run.get("status") or {}).get("fence")
                if fence is not None:
                    fences[run["metadata"]["name"]].append(fence)
            time.sleep(0.05)

    watcher = threading.Thread(target=observe, daemon=True)
    watcher.start()
    names = []
    try:
        for i in range(KILLS):
            if i < RUNS:
                name = f"job-{i}"
                body = runs.example("crashing-job.yaml", payload={
                    "steps": 4, "stepSeconds": 0.4, "crashAttempts": [1] if i % 2 == 0 else []},
                    lease={"durationSeconds": 8, "renewIntervalSeconds": 1},
                    retry={"maxAttempts": 4, "backoff": {"initialSeconds": 0}})
                runs.create(kube, namespace, body, name=name)
                names.append(name)
            time.sleep(rng.uniform(0.1, 1.5))
            operator.restart()  # kill -9, then start again
        finished = eventually(
            lambda: all((runs.get(kube, namespace, n).get("status") or {}).get("phase") in
                        ("Succeeded", "Failed", "Lost") for n in names),
            timeout=180, what="every run finished")
        assert finished
    finally:
        stop.set()
        watcher.join()
    assert operator.starts == KILLS + 1
    record_measurement("operator_crash_test", kills=KILLS, runs=RUNS)
    for name in names:
        s = runs.get(kube, namespace, name)["status"]
        assert s["phase"] == "Succeeded", (name, s)
        attempt_fences = [a["fence"] for a in s["attempts"]]
        assert attempt_fences == sorted(set(attempt_fences)), attempt_fences  # never reused
        assert all(later >= earlier for earlier, later in zip(fences[name], fences[name][1:])), fences[name]
        assert s["fence"] == 2 * len(s["attempts"])  # one grant and one release per attempt
    for pod, uids in pod_uids.items():
        assert len(uids) == 1, f"two pods for one attempt: {pod} had {uids}"
