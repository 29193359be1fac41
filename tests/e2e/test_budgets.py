"""Budgets, caps, control signals and progress, on the real control plane."""

from __future__ import annotations

import pytest

import datetime as dt
import json
import random
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.conftest import pod_log
from testkit import runs
from testkit.kube import Kube, eventually
from testkit.scenario import app_run, lines, record_measurement, wait_line

BUDGETS = "/apis/tether.dev/v1alpha1/namespaces/{ns}/workerbudgets"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


def budget(kube: Kube, ns: str, name: str = "team", **spec: Any) -> dict[str, Any]:
    body = {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget", "metadata": {"name": name},
            "spec": {"limitCents": 10_000, **spec}}
    return kube.ok(kube.post(BUDGETS.format(ns=ns), body))


def get_budget(kube: Kube, ns: str, name: str = "team") -> dict[str, Any]:
    return kube.ok(kube.get(BUDGETS.format(ns=ns) + f"/{name}"))


def _wall(ts: str) -> float:
    return dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


@pytest.mark.local_cluster
def test_cap_crossed_stops_the_worker_then_its_pod(kube: Kube, namespace: str, operator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # A cooperative worker (the example) and a deaf one (ignores the stop) share the scenario.
    coop = runs.example("long-job.yaml", payload={"steps": 200, "stepSeconds": 0.1, "centsPerStep": 2},
                        lease={"durationSeconds": 8, "renewIntervalSeconds": 1}, budget={"capCents": 50},
                        stopGraceSeconds=3)
    runs.create(kube, namespace, coop, name="coop")
    deaf = app_run("deaf", {"holdAttempts": [1], "usagePerSecond": 20, "outFile": str(tmp_path / "deaf.jsonl")})
    deaf["spec"]["budget"] = {"capCents": 50}
    deaf["spec"]["stopGraceSeconds"] = 3
    deaf["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 1
    runs.create(kube, namespace, deaf)
    crossed: dict[str, float] = {}
    gone: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(gone) < 2:
        for name in ("coop", "deaf"):
            if name not in crossed:
                lease = kube.get(LEASES.format(ns=namespace) + f"/{name}")
                ann = (lease.json().get("metadata", {}).get("annotations") or {}) if lease.status_code == 200 else {}
                if json.loads(ann.get("tether.dev/usage", '{"cents":0}'))["cents"] >= 50:
                    crossed[name] = time.time()
            elif name not in gone:
                pod = kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}-a1")
                if pod.status_code == 404 or pod.json()["status"].get("phase") in ("Succeeded", "Failed"):
                    gone[name] = time.time()
        time.sleep(0.05)
    assert set(gone) == {"coop", "deaf"}, (crossed, gone)
    for name in ("coop", "deaf"):
        run = runs.wait_phase(kube, namespace, name, "BudgetExceeded", timeout=30)
        s = run["status"]
        assert s["attempts"][0]["outcome"] == "BudgetExceeded"
        assert s["overspend"]["cents"] == s["usage"]["cents"] - 50 >= 0
        assert runs.condition(run, "Stalled")["status"] == "True"
    stopped = next(json.loads(line) for line in pod_log(namespace, "coop-a1").splitlines()
                   if '"worker_stopped"' in line)
    coop_stop = _wall(stopped["ts"]) - crossed["coop"]
    record_measurement("cap_enforcement", workerStoppedAfter=round(coop_stop, 3),
                       cooperativePodEndedAfter=round(gone["coop"] - crossed["coop"], 3),
                       deafPodGoneAfter=round(gone["deaf"] - crossed["deaf"], 3), graceSeconds=3, renewSeconds=1)
    assert coop_stop < 3, coop_stop  # told on its next heartbeat, it stopped by itself
    # The deaf one was deleted after the grace period. The operator may see the crossing a
    # poll earlier than this test does, hence the half-second tolerance.
    assert 3 - 0.5 <= gone["deaf"] - crossed["deaf"] < 10


def test_exhausted_budget_blocks_admission_until_raised(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    budget(kube, namespace, limitCents=0)
    body = runs.example("short-job.yaml", payload={"steps": 2, "stepSeconds": 0.1, "centsPerStep": 3},
                        budget={"budgetRef": {"name": "team"}})
    runs.create(kube, namespace, body)
    run = eventually(lambda: (r := runs.get(kube, namespace, "short-job")).get("status", {}).get("phase") == "Pending"
                     and r, timeout=30, what="run held back")
    admitted = runs.condition(run, "Admitted")
    assert admitted["status"] == "False" and admitted["reason"] == "BudgetExceeded"
    assert run["status"].get("attempt", 0) == 0
    assert kube.get(f"/api/v1/namespaces/{namespace}/pods/short-job-a1").status_code == 404
    wb = eventually(lambda: (b := get_budget(kube, namespace)).get("status", {}).get("conditions") and b,
                    timeout=30, what="budget status")
    assert [c["status"] for c in wb["status"]["conditions"] if c["type"] == "Exhausted"] == ["True"]
    kube.ok(kube.patch(BUDGETS.format(ns=namespace) + "/team", {"spec": {"limitCents": 1000}}))
    run = runs.wait_phase(kube, namespace, "short-job", "Succeeded", timeout=60)
    assert runs.condition(run, "Admitted")["status"] == "True"
    wb = eventually(lambda: (b := get_budget(kube, namespace))["status"]["spent"]["cents"] == 6 and b,
                    timeout=30, what="charged")
    assert wb["status"]["remaining"]["cents"] == 994


@pytest.mark.local_cluster
def test_every_cent_charged_once_across_crashes_retries_and_ttl(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    budget(kube, namespace, limitCents=1_000_000)
    reported: dict[tuple[str, str], int] = defaultdict(int)  # (run, holder) -> last cents on the lease
    last_holder: dict[str, str] = {}
    stop = threading.Event()

    def watch_leases() -> None:
        while not stop.is_set():
            for lease in kube.ok(kube.get(LEASES.format(ns=namespace)))["items"]:
                ann = lease["metadata"].get("annotations") or {}
                # A cleared lease keeps its last holder's final report: attribute it to that holder.
                holder = lease["spec"].get("holderIdentity") or last_holder.get(lease["metadata"]["name"])
                if lease["spec"].get("holderIdentity"):
                    last_holder[lease["metadata"]["name"]] = holder
                if "tether.dev/usage" in ann and holder:
                    cents = json.loads(ann["tether.dev/usage"])["cents"]
                    key = (lease["metadata"]["name"], holder)
                    reported[key] = max(reported[key], cents)
            time.sleep(0.03)

    watcher = threading.Thread(target=watch_leases, daemon=True)
    watcher.start()
    rng = random.Random(7)
    names = [f"r{i}" for i in range(5)]
    try:
        for i, name in enumerate(names):
            body = runs.example("crashing-job.yaml", payload={"steps": 8, "stepSeconds": 0.25, "centsPerStep": 7,
                                                              "crashAttempts": [1] if i % 2 else []},
                                lease={"durationSeconds": 8, "renewIntervalSeconds": 1},
                                retry={"maxAttempts": 3, "backoff": {"initialSeconds": 1}},
                                budget={"budgetRef": {"name": "team"}}, ttlSecondsAfterFinished=1)
            runs.create(kube, namespace, body, name=name)
        for _ in range(12):
            time.sleep(rng.uniform(0.2, 1.2))
            operator.restart()  # kill -9 while usage is reported and charged
        eventually(lambda: all(kube.get(Kube.wr_path(namespace, n)).status_code == 404 for n in names),
                   timeout=120, what="every run finished, charged and deleted by its TTL")
    finally:
        stop.set()
        watcher.join()
    expected = sum(reported.values())
    assert expected > 0
    status = get_budget(kube, namespace)["status"]
    assert status["spent"]["cents"] == expected, (status["spent"], dict(reported))
    assert operator.events("budget_charged")
    # The ledger holds live runs only: every finished run left it once charged in full.
    assert not status.get("charges"), status["charges"]


@pytest.mark.local_cluster
def test_malformed_usage_reports_are_refused(kube: Kube, namespace: str, operator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    budget(kube, namespace)
    body = app_run("m", {"holdAttempts": [1], "outFile": str(tmp_path / "o.jsonl")})
    body["spec"]["budget"] = {"budgetRef": {"name": "team"}}
    runs.create(kube, namespace, body)
    runs.wait_phase(kube, namespace, "m", "Running", timeout=30)
    lease_path = LEASES.format(ns=namespace) + "/m"

    def report(raw: str) -> None:
        kube.ok(kube.patch(lease_path, {"metadata": {"annotations": {"tether.dev/usage": raw}}}))

    report('{"cents": 40, "tokens": 10}')
    eventually(lambda: (runs.get(kube, namespace, "m")["status"].get("usage") or {}).get("cents") == 40,
               timeout=20, what="valid report folded")
    for i, bad in enumerate(('{"cents": -5}', '{"cents": NaN}', '{"cents": "many"}', '{"cents": 20, "tokens": 10}',
                             '{"cents": 100000000000000}', "not json")):
        report(bad)
        # One at a time: kopf coalesces events that arrive close together.
        eventually(lambda n=i + 1: len(operator.events("usage_rejected")) >= n, timeout=20,
                   what=f"refusal {i + 1} logged")
    report('{"cents": 45, "tokens": 10}')
    eventually(lambda: (runs.get(kube, namespace, "m")["status"].get("usage") or {}).get("cents") == 45,
               timeout=20, what="the next valid report")
    eventually(lambda: get_budget(kube, namespace)["status"]["spent"]["cents"] == 45, timeout=20,
               what="only valid usage charged")


@pytest.mark.local_cluster
def test_signals_arrive_within_one_heartbeat(kube: Kube, namespace: str, operator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "o.jsonl"
    body = app_run("sig", {"holdAttempts": [1], "outFile": str(out)}, renew=1)
    body["spec"]["budget"] = {"capCents": 900}
    body["spec"]["deadlineSeconds"] = 600
    runs.create(kube, namespace, body)
    run = runs.wait_phase(kube, namespace, "sig", "Running", timeout=30)
    first = wait_line(out, event="signals")
    assert first["capRemainingCents"] == 900 and first["stop"] is False
    assert _wall(first["endsAt"]) == _wall(run["status"]["endsAt"])
    delays = {}
    for field, patch in (("paused", {"suspend": True}), ("resumed", {"suspend": False}), ("stop", {"stop": True})):
        before = len(lines(out))
        sent = time.time()
        kube.ok(kube.patch(Kube.wr_path(namespace, "sig"), {"spec": patch}))
        want = {"paused": {"paused": True}, "resumed": {"paused": False}, "stop": {"stop": True}}[field]
        seen = eventually(lambda: next((e for e in lines(out)[before:] if e["event"] == "signals"
                                        and all(e[k] == v for k, v in want.items())), None),
                          timeout=10, interval=0.05, what=f"{field} seen by the worker")
        delays[field] = round(seen["at"] - sent, 3)
    record_measurement("signal_delivery", renewSeconds=1, **delays)
    assert all(d <= 1.5 for d in delays.values()), delays  # within one heartbeat interval (+ API latency)


@pytest.mark.local_cluster
def test_progress_deadline_stalls_and_next_attempt_gets_the_checkpoint(kube: Kube, namespace: str, operator,  # type: ignore[no-untyped-def]
                                                                       tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    body = app_run("slow", {"holdAttempts": [1, 2], "checkpoint": "cp-7", "outFile": str(out)}, max_attempts=2)
    body["spec"]["progressDeadlineSeconds"] = 3
    runs.create(kube, namespace, body)
    run = runs.wait_phase(kube, namespace, "slow", ("Failed", "Succeeded", "Lost"), timeout=60)
    s = run["status"]
    assert s["phase"] == "Failed"
    assert [a["outcome"] for a in s["attempts"]] == ["Stalled", "Stalled"]
    second = wait_line(out, event="started", attempt=2)
    assert second["resumeFrom"] == "cp-7"  # the next attempt received the last checkpoint
    assert s["checkpoint"]["cursor"] == "cp-7"


@pytest.mark.local_cluster
def test_suspend_pauses_the_worker_and_resume_continues(kube: Kube, namespace: str, operator,  # type: ignore[no-untyped-def]
                                                         bin_dir: Path) -> None:
    body = runs.example("long-job.yaml", payload={"steps": 30, "stepSeconds": 0.2},
                        lease={"durationSeconds": 8, "renewIntervalSeconds": 1})
    runs.create(kube, namespace, body)
    runs.wait_phase(kube, namespace, "long-job", "Running", timeout=30)
    kube.ok(kube.patch(Kube.wr_path(namespace, "long-job"), {"spec": {"suspend": True}}))
    lease = LEASES.format(ns=namespace) + "/long-job"
    cursor = lambda: (kube.ok(kube.get(lease))["metadata"].get("annotations") or {}).get("tether.dev/checkpoint")  # noqa: E731
    eventually(lambda: '"worker_paused"' in pod_log(namespace, "long-job-a1"), timeout=10, what="worker paused")
    # The worker paused before step N, with steps up to N checkpointed; the last of them reaches the
    # Lease on the next heartbeat, which may come after the log line. From then on, no progress.
    paused = next(json.loads(line) for line in pod_log(namespace, "long-job-a1").splitlines()
                  if '"worker_paused"' in line)
    paused_at = eventually(lambda: (c := cursor()) == str(paused["step"]) and c, timeout=10,
                           what=f"checkpoint {paused['step']} on the Lease")
    samples = []
    for _ in range(10):
        samples.append(cursor())
        time.sleep(0.2)
    assert set(samples) == {paused_at}, samples  # no progress while suspended (2 s, 10 steps' worth)
    # What the user sees: still Running (the worker keeps its lease), but paused, and said so.
    table = _table(bin_dir, kube, namespace, "long-job")
    assert (table["PHASE"], table["REASON"]) == ("Running", "WorkerPaused"), table
    run = kube.ok(kube.get(Kube.wr_path(namespace, "long-job")))
    suspended = runs.condition(run, "Suspended")
    assert suspended is not None and (suspended["status"], suspended["reason"]) == ("True", "WorkerPaused"), suspended
    eventually(lambda: "Suspended" in runs.events(kube, namespace, "long-job"), timeout=10, what="a Suspended Event")
    kube.ok(kube.patch(Kube.wr_path(namespace, "long-job"), {"spec": {"suspend": False}}))
    run = runs.wait_phase(kube, namespace, "long-job", "Succeeded", timeout=60)
    assert len(run["status"]["attempts"]) == 1 and run["status"]["result"]["steps"] == 30
    assert "Resumed" in runs.events(kube, namespace, "long-job")
    assert runs.condition(run, "Suspended")["status"] == "False"


def _table(bin_dir: Path, kube: Kube, namespace: str, name: str) -> dict[str, str]:
    """`kubectl get wr NAME` as the user reads it: column header -> value."""
    out = subprocess.run([str(bin_dir / "kubectl"), "--kubeconfig", kube.kubeconfig_path, "get", "wr", name, "-n",
                          namespace], check=True, capture_output=True, text=True).stdout.splitlines()
    return dict(zip(out[0].split(), out[1].split()))


def test_a_cap_that_pauses_tells_the_worker_to_pause_and_raising_it_resumes_the_same_attempt(
        kube: Kube, namespace: str, operator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """spec.budget.onExhausted: Pause — the cap reached, the worker is told to pause and keeps its lease
    (Ready's reason BudgetPaused says what to raise); a raised cap lets the same attempt go on."""
    out, gate = tmp_path / "out.jsonl", tmp_path / "gate"
    body = app_run("pausing", {"holdAttempts": [1], "holdSeconds": 120, "usagePerSecond": 2,
                               "gateFile": str(gate), "outFile": str(out)}, duration=10, renew=1)
    body["spec"]["budget"] = {"capCents": 6, "onExhausted": "Pause"}
    runs.create(kube, namespace, body)
    paused = kube.wait_for(Kube.wr_path(namespace), "pausing", lambda r: any(
        c["type"] == "Ready" and c["reason"] == "BudgetPaused" for c in (r.get("status") or {}).get("conditions", [])),
        60, "the run paused for its cap")
    s = paused["status"]
    assert s["phase"] == "Running" and s["holder"] == "pausing-a1"  # it keeps its lease
    suspended = next(c for c in s["conditions"] if c["type"] == "Suspended")
    assert suspended["status"] == "True" and "cap of 6 cents reached" in suspended["message"]
    eventually(lambda: any(e.get("event") == "signals" and e.get("paused") for e in lines(out)), timeout=30,
               what="the worker told to pause")
    kube.ok(kube.patch(Kube.wr_path(namespace, "pausing"), {"spec": {"budget": {"capCents": 100000}}}))
    eventually(lambda: any(e.get("event") == "signals" and e.get("paused") is False and e["at"] > _wall(
        suspended["lastTransitionTime"]) for e in lines(out)), timeout=30, what="the worker told to go on")
    gate.touch()
    done = runs.wait_phase(kube, namespace, "pausing", ("Succeeded", "Failed", "BudgetExceeded"), timeout=60)
    assert done["status"]["phase"] == "Succeeded" and len(done["status"]["attempts"]) == 1
    resumed = next(c for c in done["status"]["conditions"] if c["type"] == "Suspended")
    assert (resumed["status"], resumed["reason"]) == ("False", "Resumed")
