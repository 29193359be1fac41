"""`kubectl tether release-finalizers`: lets go of runs whose operator is gone.

Tether's finalizer on a WorkerRun (and on its pods) waits for the operator to end the attempt,
charge the final usage and release the pods. After `helm uninstall` with runs left behind,
nobody will: `kubectl delete wr` hangs. This command removes only Tether's finalizers, after
checking that no operator is alive (its leader Lease is held and fresh, or its Deployment has
pods), each removal a JSON patch that tests the list it was decided on (a compare-and-swap).
What the finalizer would have done and is not done here: charging the run's final usage to its
budget. The run's Lease, pods, worker ServiceAccount and Role are owned by the run, so the
garbage collector deletes them once the run is gone.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from tether.api import constants as c
from tether.kube.client import ApiError, Conflict, KubeClient
from tether.kube.paths import all_runs_path, pod_path, run_path
from tether.protocol import JSON_PATCH

# `tether operator --leader-election-id`'s default: the chart leaves it so.
LEADER_LEASE = "tether-operator-leader"
# The chart's operator Deployment (charts/tether/templates/_helpers.tpl, tether.labels).
OPERATOR_SELECTOR = "app.kubernetes.io/part-of=tether,app.kubernetes.io/component=operator"
# A leader Lease renewed this long past its duration still counts as held: the operator's clock
# wrote renewTime, this machine's reads it.
CLOCK_SKEW_SECONDS = 5.0
# Attempts at one run's compare-and-swap before giving up on it (something else keeps changing it).
CAS_TRIES = 3


@dataclass
class Released:
    runs: list[str] = field(default_factory=list)
    pods: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def _scoped(group_version: str, plural: str, ns: str | None) -> str:
    return f"/{group_version}/namespaces/{ns}/{plural}" if ns else f"/{group_version}/{plural}"


def _parse_time(ts: str) -> dt.datetime:
    return dt.datetime.fromisoformat(ts.replace("Z", "+00:00"))


def lease_alive(lease: dict[str, Any], now: dt.datetime) -> bool:
    """Held, and renewed within its duration (plus skew), by this machine's clock."""
    spec = lease.get("spec") or {}
    if not spec.get("holderIdentity") or not spec.get("renewTime"):
        return False  # released (ReleaseOnCancel empties the holder) or never acquired
    age = (now - _parse_time(spec["renewTime"])).total_seconds()
    return age < float(spec.get("leaseDurationSeconds") or 15) + CLOCK_SKEW_SECONDS


async def live_operators(kube: KubeClient, operator_ns: str | None, now: dt.datetime) -> list[str]:
    """Why an operator may be alive, one line per sign: a fresh leader Lease, a Deployment with pods."""
    signs = []
    leases = await kube.list_objects(_scoped("apis/coordination.k8s.io/v1", "leases", operator_ns),
                                     field_selector=f"metadata.name={LEADER_LEASE}")
    for lease in leases:
        if lease_alive(lease, now):
            meta, spec = lease["metadata"], lease["spec"]
            age = (now - _parse_time(spec["renewTime"])).total_seconds()
            signs.append(f"leader Lease {meta['namespace']}/{meta['name']} is held by {spec['holderIdentity']} "
                         f"(renewed {age:.0f}s ago)")
    for deploy in await kube.list_objects(_scoped("apis/apps/v1", "deployments", operator_ns),
                                          label_selector=OPERATOR_SELECTOR):
        pods = max(int((deploy.get("spec") or {}).get("replicas", 1)),
                   int((deploy.get("status") or {}).get("replicas") or 0))
        if pods:
            meta = deploy["metadata"]
            signs.append(f"Deployment {meta['namespace']}/{meta['name']} wants {pods} operator pod(s)")
    return signs


def finalizer_patch(meta: dict[str, Any], finalizer: str) -> list[dict[str, Any]]:
    """Removes `finalizer` only if the object is still the one read, with the finalizers read."""
    finalizers = meta.get("finalizers") or []
    return [{"op": "test", "path": "/metadata/uid", "value": meta["uid"]},
            {"op": "test", "path": "/metadata/finalizers", "value": finalizers},
            {"op": "replace", "path": "/metadata/finalizers", "value": [f for f in finalizers if f != finalizer]}]


async def _release_run(kube: KubeClient, run: dict[str, Any]) -> bool:
    """Compare-and-swap on the finalizer list, re-read after a lost race. False: gone meanwhile."""
    meta = run["metadata"]
    path = run_path(meta["namespace"], meta["name"])
    for _ in range(CAS_TRIES):
        if c.RUN_FINALIZER not in (meta.get("finalizers") or []):
            return False
        resp = await kube.http.patch(path, json=finalizer_patch(meta, c.RUN_FINALIZER), headers=JSON_PATCH)
        if resp.status_code < 300:
            return True
        if resp.status_code == 404:
            return False
        if resp.status_code != 422:  # 422: a `test` failed, the run changed since it was read
            raise ApiError(resp.status_code, resp.text, f"release workerrun {meta['namespace']}/{meta['name']}")
        fresh = await kube.http.get(path)
        if fresh.status_code == 404:
            return False
        meta = fresh.json()["metadata"]
        if meta["uid"] != run["metadata"]["uid"]:
            return False  # re-created under the same name: not the run that was chosen
    raise Conflict(409, "", f"release workerrun {meta['namespace']}/{meta['name']}: it kept changing")


async def _release_pods(kube: KubeClient, run: dict[str, Any]) -> list[str]:
    """The run's pods still held by Tether's attempt-tracking finalizer (they would hang in
    Terminating once the garbage collector deletes them)."""
    meta = run["metadata"]
    ns, released = meta["namespace"], []
    for pod in await kube.list_objects(pod_path(ns), label_selector=f"{c.LABEL_RUN}={meta['name']}"):
        pmeta = pod["metadata"]
        owned = any(ref.get("uid") == meta["uid"] for ref in pmeta.get("ownerReferences") or [])
        if owned and c.POD_FINALIZER in (pmeta.get("finalizers") or []):
            if await kube.remove_finalizer(ns, pmeta["name"], c.POD_FINALIZER, uid=pmeta["uid"]) is not None:
                released.append(f"{ns}/{pmeta['name']}")
    return released


async def release_finalizers(kube: KubeClient, ns: str | None, name: str | None) -> Released:
    """Every run in scope (one namespace, or all with ns None; one run with `name`) that carries
    Tether's finalizer, and its pods."""
    if name:
        resp = await kube.http.get(run_path(ns or "default", name))
        runs = [resp.json()] if resp.status_code == 200 else []
    else:
        runs = await kube.list_objects(run_path(ns) if ns else all_runs_path())
    done = Released()
    for run in runs:
        meta = run["metadata"]
        if c.RUN_FINALIZER not in (meta.get("finalizers") or []):
            continue
        key = f"{meta['namespace']}/{meta['name']}"
        try:
            done.pods += await _release_pods(kube, run)
            if await _release_run(kube, run):
                done.runs.append(key)
        except ApiError as exc:
            done.failed.append(f"{key}: {exc}")
    return done


def report(done: Released) -> list[str]:
    lines = [f"released workerrun.tether.dev/{key}" for key in done.runs]
    lines += [f"released pod/{key}" for key in done.pods]
    lines += [f"error: {failure}" for failure in done.failed]
    if not done.runs and not done.failed:
        lines.append("no WorkerRun in scope carries Tether's finalizer")
    if done.runs:
        lines.append("Their final usage was not charged to any budget (the operator would have). Their Leases, "
                     "pods and worker RBAC are owned by the runs: the garbage collector deletes them.")
    return lines
