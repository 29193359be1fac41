"""Adversarial review of the restructured run controller: each test pins one defect found on
paper, at the place it breaks the promise (nothing hangs, an accepted result is never lost,
Tether never destroys what it does not own, memory is freed).

Judged from the API server's objects and, through the fault proxy, from the requests the
operator really sent; never from the operator's own view.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tether.api import constants as c
from testkit import runs
from testkit.apiproxy import ApiProxy
from testkit.kube import Kube, eventually
from testkit.operator_process import OperatorProcess
from testkit.scenario import lease, fenced_result, held_by

pytestmark = pytest.mark.local_cluster

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
PODS = "/api/v1/namespaces/{ns}/pods"
BUDGETS = "/apis/tether.dev/v1alpha1/namespaces/{ns}/workerbudgets"
HOLD = "example.com/hold"  # a finalizer of someone else (a CSI driver, a node that is gone, ...)


def external_run(name: str, duration: int = 8, renew: int = 1, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name},
            "spec": {"executor": "External", "payload": {},
                     "lease": {"durationSeconds": duration, "renewIntervalSeconds": renew,
                               "startupGraceSeconds": duration},
                     "retry": {"maxAttempts": 3, "backoff": {"initialSeconds": 0}}, **spec}}


def report_usage(kube: Kube, ns: str, name: str, cents: int) -> None:
    """A heartbeat carrying usage, as the holder (or the gateway for it) writes it."""
    for _ in range(10):
        current = lease(kube, ns, name)
        current["metadata"].setdefault("annotations", {})["tether.dev/usage"] = json.dumps(
            {"cents": cents, "tokens": 0}, separators=(",", ":"))
        current["spec"]["renewTime"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        resp = kube.put(LEASES.format(ns=ns) + f"/{name}", current)
        if resp.status_code == 200:
            return
        assert resp.status_code == 409, resp.text
    raise AssertionError("could not renew the lease")


def unschedulable_pod(name: str, labels: dict[str, str], owner: dict[str, Any] | None = None,
                      finalizers: list[str] | None = None) -> dict[str, Any]:
    """A pod no kubelet ever runs (a scheduling gate holds it), so only controllers touch it."""
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    if finalizers:
        meta["finalizers"] = finalizers
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"schedulingGates": [{"name": "example.com/never"}],
                     "containers": [{"name": "w", "image": "busybox", "command": ["sleep", "3600"]}]}}


def drop_finalizers(kube: Kube, path: str) -> None:
    kube.patch(path, {"metadata": {"finalizers": None}})


# --- 1. a terminating pod of a deleted namesake blocks the new run forever --------------------


def test_a_namesakes_pod_stuck_terminating_does_not_block_the_new_run(kube: Kube, namespace: str,
                                                                      operator: OperatorProcess) -> None:
    """Run A ("x") is deleted while its attempt's pod cannot finish terminating (its node is
    unreachable, or another party's finalizer holds it: here `example.com/hold`). Tether ends A,
    deletes the pod (it is then Terminating), has nothing to release, and lets A go — as it should.

    The user re-creates "x" (B). Every reconcile of B starts with _release_strays (runs.py): the
    old pod is a "stray" (owner uid is A's), it is already deleting and has no Tether finalizer, so
    nothing is done — yet _release_strays returns True and _reconcile returns before deciding.
    B is never granted (not even given its finalizer) for as long as the old pod exists: forever on
    a dead node. Nothing may hang on another object's termination.

    Nor may B be granted while the old pod's worker can still act (seed 378 of the fault trials):
    B's first holder is `x-a1` again, and the API server accepts the old pod's bound token until a
    minute past its deletionTimestamp. So B waits exactly that long, not forever."""
    pods = PODS.format(ns=namespace)
    runs.create(kube, namespace, external_run("x"))
    a = held_by(kube, namespace, "x")
    owner = {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "name": "x",
             "uid": a["metadata"]["uid"], "controller": True}
    # A's attempt pod (External runs have none; this stands for one on a node that went away).
    kube.ok(kube.post(pods, unschedulable_pod("x-a1", {"tether.dev/run": "x", "tether.dev/attempt": "1"},
                                              owner=owner, finalizers=[HOLD])))
    try:
        kube.delete(Kube.wr_path(namespace, "x"))
        eventually(lambda: kube.get(Kube.wr_path(namespace, "x")).status_code == 404, timeout=60,
                   what="A finalized and gone")
        pod = kube.ok(kube.get(f"{pods}/x-a1"))
        assert pod["metadata"].get("deletionTimestamp"), "Tether deleted A's pod while ending A"

        deleting = dt.datetime.fromisoformat(pod["metadata"]["deletionTimestamp"].replace("Z", "+00:00"))
        token_dead_at = deleting + dt.timedelta(seconds=60)  # kube-apiserver's leeway for bound tokens
        runs.create(kube, namespace, external_run("x"))  # B, same name
        eventually(lambda: c.RUN_FINALIZER in (runs.get(kube, namespace, "x")["metadata"].get("finalizers") or []),
                   timeout=30, what="B reconciled")
        if dt.datetime.now(dt.timezone.utc) < token_dead_at - dt.timedelta(seconds=5):
            assert not runs.get(kube, namespace, "x").get("status", {}).get("holder"), \
                "B granted holder x-a1 while A's pod x-a1 could still act"
            # The wait is visible: on B's conditions, and in an Event naming the pod.
            waiting = eventually(lambda: next((cond for cond in runs.get(kube, namespace, "x").get("status", {})
                                              .get("conditions") or [] if cond["type"] == "LeaseHeld"
                                              and cond["reason"] == "NamesakePodTerminating"), None),
                                 timeout=20, what="B says why it waits")
            assert "x-a1" in waiting["message"] and "terminating" in waiting["message"]
            assert runs.get(kube, namespace, "x")["status"]["phase"] == "Pending"
            # The Event follows the status write that set the condition (the executor posts it after).
            eventually(lambda: any(e["reason"] == "NamesakePodTerminating" and "x-a1" in e["message"] for e in
                                   kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/events"))["items"]),
                       timeout=10, what="an Event naming the namesake's pod")
        wait = (token_dead_at - dt.datetime.now(dt.timezone.utc)).total_seconds()
        b = eventually(lambda: (r := runs.get(kube, namespace, "x")).get("status", {}).get("holder") and r,
                       timeout=max(wait, 0) + 40, what="B granted while A's pod is still terminating")
        assert b["metadata"]["uid"] != a["metadata"]["uid"]
        started = dt.datetime.fromisoformat(b["status"]["startedAt"].replace("Z", "+00:00"))
        assert started >= token_dead_at, f"B granted at {started}, before A's pod token died at {token_dead_at}"
        assert kube.ok(kube.get(f"{pods}/x-a1"))["metadata"]["uid"] == pod["metadata"]["uid"]  # still there
    finally:
        drop_finalizers(kube, f"{pods}/x-a1")


# --- 2. Tether deletes pods it does not control ---------------------------------------------


def test_a_pod_tether_does_not_control_is_not_deleted(kube: Kube, namespace: str,
                                                      operator: OperatorProcess) -> None:
    """A pod that carries the run's labels but is not controlled by the run — a debug copy of the
    worker pod (`kubectl debug --copy-to ... --keep-labels`), a helper Job's pod that copied its
    parent's labels — is a "stray" to _release_strays (owner_uid() != the run's uid, and None
    counts as different), which deletes it and would strip finalizers from it. A controller only
    deletes what it controls (ownerReference with controller: true naming it)."""
    pods = PODS.format(ns=namespace)
    runs.create(kube, namespace, external_run("y"))
    held_by(kube, namespace, "y")
    created = kube.ok(kube.post(pods, unschedulable_pod(
        "y-debug", {"tether.dev/run": "y", "tether.dev/attempt": "1", "purpose": "debug"})))
    time.sleep(8)  # the pod event queues the run: several reconciles happen meanwhile
    resp = kube.get(f"{pods}/y-debug")
    assert resp.status_code == 200, "Tether deleted a pod it does not control"
    pod = resp.json()
    assert pod["metadata"]["uid"] == created["metadata"]["uid"]
    assert not pod["metadata"].get("deletionTimestamp"), "Tether deleted a pod it does not control"


# --- 3. Tether deletes a Lease it does not own -----------------------------------------------


def test_a_lease_of_someone_else_with_the_runs_name_is_not_deleted(kube: Kube, namespace: str,
                                                                   operator: OperatorProcess) -> None:
    """An application in the namespace elects its leader with a Lease named "z" (no owner, not
    Tether's label). A WorkerRun named "z" is created. _set_lease (runs.py) treats any Lease of that
    name whose controller owner is not the run as a deleted namesake's and deletes it (owner_uid()
    is None != the run's uid): the application's leader election is broken (two leaders for a
    while). A Lease Tether does not own must be left alone; the run should report the conflict."""
    leases = LEASES.format(ns=namespace)
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    theirs = kube.ok(kube.post(leases, {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "z"},
        "spec": {"holderIdentity": "some-app-0", "leaseDurationSeconds": 15, "acquireTime": now,
                 "renewTime": now, "leaseTransitions": 3}}))
    runs.create(kube, namespace, external_run("z"))
    eventually(lambda: runs.get(kube, namespace, "z").get("status", {}).get("phase"), timeout=30,
               what="the run reconciled")
    time.sleep(3)
    resp = kube.get(f"{leases}/z")
    assert resp.status_code == 200, "Tether deleted a Lease it does not own"
    now_there = resp.json()
    assert now_there["metadata"]["uid"] == theirs["metadata"]["uid"], (
        f"Tether deleted the application's Lease and replaced it: {now_there['spec']}")


# --- 4. a result accepted in time is reported as DeadlineExceeded -----------------------------


def test_a_result_accepted_before_the_deadline_is_not_reported_as_deadline_exceeded(
        kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    """The holder publishes its result well before endsAt and the API server accepts it (200),
    while the operator is down (a restart, a rollout). The operator comes back after endsAt: its
    decision checks the deadline before the held attempt's result (_decide_unfinished), so the
    run ends DeadlineExceeded, with an error and its attempt recorded as DeadlineExceeded, although
    its result was accepted in time. Whoever waits on the run sees a failure and runs it again."""
    runs.create(kube, namespace, external_run("d", deadlineSeconds=12))
    run = held_by(kube, namespace, "d")
    operator.kill()
    assert fenced_result(kube, namespace, "d", run["status"]["fence"], run["status"]["holder"],
                         {"invoice": "paid"}) == 200
    ends_at = dt.datetime.fromisoformat(runs.get(kube, namespace, "d")["status"]["endsAt"].replace("Z", "+00:00"))
    time.sleep(max(0.0, (ends_at - dt.datetime.now(dt.timezone.utc)).total_seconds()) + 2)
    operator.start()
    final = runs.wait_phase(kube, namespace, "d", ("Succeeded", "DeadlineExceeded", "Failed"), timeout=60)
    s = final["status"]
    assert s.get("result") == {"invoice": "paid"}
    assert s["phase"] == "Succeeded", (s["phase"], s.get("error"), s["attempts"])
    assert s["attempts"][-1]["outcome"] == "Succeeded"


# --- 5. a deleted run comes back into the cache, forever -------------------------------------


def test_a_deleted_run_is_not_brought_back_into_the_cache(kube: Kube, namespace: str, tmp_path: Path) -> None:
    """The finalizer-removal PATCH deletes the run; its answer reaches the operator after the
    watch's DELETED event (a slow network, a busy event loop). _remove_finalizer then calls
    _store_written, which stores the written body because the cache entry is gone ('cached is
    None'): the deleted run is back in self.runs, and no DELETED event will ever remove it again.
    Every pass then decides RemoveFinalizer, gets 404, refreshes (404, the cache is kept), raises
    Again: PATCH+GET forever (backoff capped at 300 s), a ghost in the phase gauge, memory never
    freed."""
    name = "ghost"
    with ApiProxy(os.environ["TETHER_TEST_KUBECONFIG"], seed=11) as proxy:
        op = OperatorProcess(namespace, str(proxy.kubeconfig), tmp_path / "operator.log",
                             extra_env={"TETHER_FOLD_INTERVAL_SECONDS": "1"}).start()
        try:
            runs.create(kube, namespace, external_run(name))
            held_by(kube, namespace, name)
            gate = proxy.gate(method="PATCH", path=rf"/namespaces/{namespace}/workerruns/{name}$", phase="response")
            kube.delete(Kube.wr_path(namespace, name))
            gate.wait_arrived(timeout=60)  # the finalizer is removed: the run is gone, the answer held
            eventually(lambda: kube.get(Kube.wr_path(namespace, name)).status_code == 404, timeout=10,
                       what="run gone")
            time.sleep(2)  # the operator's watch delivers DELETED meanwhile
            gate.release()
            time.sleep(3)

            def touching() -> list[Any]:
                return proxy.requests(lambda r: not r.watch and f"/workerruns/{name}" in r.path)

            before = len(touching())
            time.sleep(15)
            late = touching()[before:]
            assert not late, f"the operator still reconciles a deleted run: {[(r.method, r.path, r.status) for r in late]}"
        finally:
            op.stop()


# --- 6. a budget the cache keeps after it was deleted blocks deletion forever -----------------


def test_a_deleted_budget_does_not_keep_a_deleted_run_from_going(kube: Kube, namespace: str, tmp_path: Path) -> None:
    """The budget's charge (a status PUT) succeeds, then the budget is deleted and the watch's
    DELETED event is handled before the PUT's answer; BudgetBook.charge then stores the written
    budget back into its cache (the same happens when kopf stops watching a namespace being
    deleted: the sweeper relists runs, pods and leases, never budgets). Nothing ever removes it:
    budgets.observe() keeps reporting a budget that does not exist, charge() finds it gone and
    returns None without forgetting it, and _charge raises Again — on every pass, forever. A run
    with usage still to charge can then never finish its deletion (decide_deleting charges before
    RemoveFinalizer): kubectl delete hangs, and so would its namespace."""
    budgets = BUDGETS.format(ns=namespace)
    kube.ok(kube.post(budgets, {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget",
                                "metadata": {"name": "b"}, "spec": {"limitCents": 100_000, "period": "None"}}))
    with ApiProxy(os.environ["TETHER_TEST_KUBECONFIG"], seed=12) as proxy:
        op = OperatorProcess(namespace, str(proxy.kubeconfig), tmp_path / "operator.log",
                             extra_env={"TETHER_FOLD_INTERVAL_SECONDS": "1"}).start()
        try:
            eventually(lambda: kube.ok(kube.get(f"{budgets}/b")).get("status", {}).get("remaining"), timeout=30,
                       what="budget status refreshed")
            runs.create(kube, namespace, external_run("spend", duration=30, renew=5,
                                                      budget={"budgetRef": {"name": "b"}}))
            held_by(kube, namespace, "spend")
            time.sleep(1)
            gate = proxy.gate(method="PUT", path=rf"/namespaces/{namespace}/workerbudgets/b/status$",
                              phase="response")
            report_usage(kube, namespace, "spend", 5)
            gate.wait_arrived(timeout=30)  # the charge is written; its answer is held
            kube.delete(f"{budgets}/b")
            eventually(lambda: kube.get(f"{budgets}/b").status_code == 404, timeout=10, what="budget gone")
            time.sleep(2)  # the operator's watch delivers DELETED meanwhile
            gate.release()
            time.sleep(2)
            report_usage(kube, namespace, "spend", 9)  # more usage, to be charged at the end
            time.sleep(1)
            kube.delete(Kube.wr_path(namespace, "spend"))
            eventually(lambda: kube.get(Kube.wr_path(namespace, "spend")).status_code == 404, timeout=45,
                       what="the deleted run finalized (its budget no longer exists)")
        finally:
            op.stop()
            if kube.get(Kube.wr_path(namespace, "spend")).status_code == 200:
                drop_finalizers(kube, Kube.wr_path(namespace, "spend"))
