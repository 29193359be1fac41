"""The fault trials' queues (testkit/chaos.py): runs queued through the real Kueue, and the
fault that preempts them. A queued trial gets a ClusterQueue of its own with room for all its
queued runs (so only the fault contends for it) and a LocalQueue in its namespace; the preemption
fault submits a higher-priority run asking for the whole quota, so Kueue evicts every admitted
queued run at once: each is told to yield, revoked, requeued, and resumes once the preemptor ends.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from testkit.kube import Kube

KUEUE = "/apis/kueue.x-k8s.io/v1beta2"
LOCAL_QUEUE = "trial"
CPU_PER_RUN_MILLI = 100
# Cluster-scoped and shared by every trial (made once, kept).
PRIORITY_CLASSES = {"tether-chaos-low": 10, "tether-chaos-high": 1000}


@dataclass(frozen=True)
class TrialQueue:
    cluster_queue: str
    flavor: str
    quota_milli: int


def create_object(kube: Kube, path: str, body: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
    """A Kueue object created as `kubectl apply` in a retry loop would: sent again while Kueue's
    webhook does not answer the API server within its 10 s (CI saw it once under make test's
    load, for a ResourceFlavor: a set-up step, not what the tests are about), refused at once for anything else."""
    deadline = time.monotonic() + timeout
    while True:
        resp = kube.post(path, {"apiVersion": "kueue.x-k8s.io/v1beta2", **body})
        if resp.status_code != 500 or "failed calling webhook" not in resp.text or time.monotonic() > deadline:
            return kube.ok(resp)
        time.sleep(1)


def set_up(kube: Kube, ns: str, queued_runs: int, poll: Callable[[Callable[[], Any], float, str], Any]) -> TrialQueue:
    """The trial's flavor, ClusterQueue (preemption by priority within it) and LocalQueue. Each
    create is retried for a minute: a shared Kueue may be restarting (tests/kueue stops it)."""
    tag = uuid.uuid4().hex[:6]
    queue = TrialQueue(cluster_queue=f"chaos-{tag}", flavor=f"chaos-{tag}", quota_milli=queued_runs * CPU_PER_RUN_MILLI)

    def create(path: str, body: dict[str, Any]) -> None:
        poll(lambda: kube.post(path, {"apiVersion": "kueue.x-k8s.io/v1beta2", **body}).status_code in (201, 409),
             60, f"create {body['kind']} {body['metadata']['name']}")

    for name, value in PRIORITY_CLASSES.items():
        create(f"{KUEUE}/workloadpriorityclasses",
               {"kind": "WorkloadPriorityClass", "metadata": {"name": name}, "value": value})
    create(f"{KUEUE}/resourceflavors", {"kind": "ResourceFlavor", "metadata": {"name": queue.flavor}, "spec": {}})
    create(f"{KUEUE}/clusterqueues", {"kind": "ClusterQueue", "metadata": {"name": queue.cluster_queue}, "spec": {
        "namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
        "resourceGroups": [{"coveredResources": ["cpu"], "flavors": [{"name": queue.flavor, "resources": [
            {"name": "cpu", "nominalQuota": f"{queue.quota_milli}m"}]}]}]}})
    create(f"{KUEUE}/namespaces/{ns}/localqueues",
           {"kind": "LocalQueue", "metadata": {"name": LOCAL_QUEUE}, "spec": {"clusterQueue": queue.cluster_queue}})
    poll(lambda: _active(kube, f"{KUEUE}/clusterqueues/{queue.cluster_queue}"), 60, "the trial's ClusterQueue Active")
    return queue


def _active(kube: Kube, path: str) -> bool:
    resp = kube.get(path)
    conds = ((resp.json() if resp.status_code == 200 else {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Active" and c.get("status") == "True" for c in conds)


def queue(body: dict[str, Any], priority: str, milli: int) -> dict[str, Any]:
    """`body` (a WorkerRun) queued in the trial's LocalQueue at `priority`, asking `milli` cpu."""
    body["metadata"].setdefault("labels", {}).update({"kueue.x-k8s.io/queue-name": LOCAL_QUEUE,
                                                      "kueue.x-k8s.io/priority-class": priority})
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": f"{milli}m"}}
    return body


def tear_down(kube: Kube, queue: TrialQueue) -> None:
    """Best effort, once the namespace's Workloads are gone (Kueue keeps a ClusterQueue in use)."""
    kube.delete(f"{KUEUE}/clusterqueues/{queue.cluster_queue}")
    kube.delete(f"{KUEUE}/resourceflavors/{queue.flavor}")

