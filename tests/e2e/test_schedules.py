"""WorkerRunSchedule end to end on the local cluster, on `@every 5s` slots: one run per slot named for
it, each concurrency policy with a run that outlasts its slot, suspend and resume, a budget-skipped
slot, history limits, and a manual start under the policy. External runs with no worker stay active
(their startup grace is long) until the test stops them, which is what a run that outlasts its slot
needs."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path
from typing import Any

from testkit.kube import Kube, eventually

SCHEDULES = "/apis/tether.dev/v1alpha1/namespaces/{ns}/workerrunschedules"
EVERY = 5


def _schedule(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunSchedule", "metadata": {"name": name},
            "spec": {"schedule": f"@every {EVERY}s",
                     "runTemplate": {"metadata": {"labels": {"team": "reports"}},
                                     "spec": {"executor": "External",
                                              "lease": {"durationSeconds": 60, "renewIntervalSeconds": 20,
                                                        "startupGraceSeconds": 300}}},
                     **spec}}


def _create(kube: Kube, ns: str, body: dict[str, Any]) -> dict[str, Any]:
    return kube.ok(kube.post(SCHEDULES.format(ns=ns), body))


def _get(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    return kube.ok(kube.get(f"{SCHEDULES.format(ns=ns)}/{name}"))


def _runs(kube: Kube, ns: str, schedule: str) -> list[dict[str, Any]]:
    items = kube.ok(kube.get(Kube.wr_path(ns), params={"labelSelector": f"tether.dev/schedule={schedule}"}))["items"]
    return sorted(items, key=lambda r: r["metadata"]["name"])


def _slot(run: dict[str, Any]) -> int:
    return int(run["metadata"]["name"].rsplit("-", 1)[1])


def _stop(kube: Kube, ns: str, name: str) -> None:
    kube.ok(kube.patch(Kube.wr_path(ns, name), {"spec": {"stop": True}}))


def _ended(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    return kube.wait_for(Kube.wr_path(ns), name, lambda r: (r.get("status") or {}).get("phase") in
                         ("Cancelled", "Succeeded", "Failed", "Lost"), 60, f"{name} ended")


def test_each_slot_starts_one_run_named_for_it(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    created = _create(kube, namespace, _schedule("sync", failedRunsHistoryLimit=10))
    runs = eventually(lambda: r if len(r := _runs(kube, namespace, "sync")) >= 3 else None, timeout=40,
                      what="three slots' runs")
    slots = [_slot(r) for r in runs]
    assert all(s % EVERY == 0 for s in slots)  # at the multiples of the period
    assert slots == list(range(slots[0], slots[0] + EVERY * len(slots), EVERY))  # every slot, none twice
    first = runs[0]
    assert first["metadata"]["labels"] == {"team": "reports", "tether.dev/schedule": "sync"}
    scheduled = dt.datetime.fromisoformat(first["metadata"]["annotations"]["tether.dev/scheduled-at"].replace("Z", "+00:00"))
    assert int(scheduled.timestamp()) == slots[0]
    owner = first["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("WorkerRunSchedule", created["metadata"]["uid"], True)
    status = _get(kube, namespace, "sync")["status"]
    assert status["nextScheduleTime"] > status["lastScheduleTime"]
    assert {a["name"] for a in status["active"]} >= {r["metadata"]["name"] for r in runs[:2]}
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"


def test_forbid_skips_slots_while_a_run_is_active_and_says_why(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    _create(kube, namespace, _schedule("audit", concurrencyPolicy="Forbid"))
    first = eventually(lambda: _runs(kube, namespace, "audit"), timeout=20, what="the first run")[0]
    skipped = kube.wait_for(SCHEDULES.format(ns=namespace), "audit",
                            lambda s: (s.get("status") or {}).get("skippedCount", 0) >= 2, 30, "two skipped slots")
    assert skipped["status"]["lastSkipped"]["reason"] == "ConcurrencyForbid"
    assert [r["metadata"]["name"] for r in _runs(kube, namespace, "audit")] == [first["metadata"]["name"]]
    _stop(kube, namespace, first["metadata"]["name"])
    _ended(kube, namespace, first["metadata"]["name"])
    eventually(lambda: len(_runs(kube, namespace, "audit")) == 2, timeout=20, what="the next slot's run")


def test_replace_stops_the_active_run_through_spec_stop_and_starts_the_new_one_after_it_ended(
        kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    _create(kube, namespace, _schedule("refresh", concurrencyPolicy="Replace", failedRunsHistoryLimit=10))
    first = eventually(lambda: _runs(kube, namespace, "refresh"), timeout=20, what="the first run")[0]
    name = first["metadata"]["name"]
    stopped = kube.wait_for(Kube.wr_path(namespace), name, lambda r: r["spec"].get("stop") is True, 20,
                            "the operator asking the first run to stop")
    assert stopped["metadata"]["uid"] == first["metadata"]["uid"]
    ended = _ended(kube, namespace, name)
    second = eventually(lambda: [r for r in _runs(kube, namespace, "refresh") if r["metadata"]["name"] != name],
                        timeout=20, what="the replacing run")[0]
    # The new run was created only once the old one had ended.
    assert second["metadata"]["creationTimestamp"] >= ended["status"]["finishedAt"]


def test_buffer_one_keeps_one_start_waiting_and_runs_it_when_the_active_run_ends(
        kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    _create(kube, namespace, _schedule("digest", concurrencyPolicy="BufferOne", failedRunsHistoryLimit=10))
    first = eventually(lambda: _runs(kube, namespace, "digest"), timeout=20, what="the first run")[0]
    held = kube.wait_for(SCHEDULES.format(ns=namespace), "digest",
                         lambda s: (s.get("status") or {}).get("lastSkipped", {}).get("reason") == "BufferFull",
                         30, "a slot skipped because one already waits")
    waiting = held["status"]["waiting"]
    assert waiting["name"] != first["metadata"]["name"]
    _stop(kube, namespace, first["metadata"]["name"])
    _ended(kube, namespace, first["metadata"]["name"])
    started = eventually(lambda: [r for r in _runs(kube, namespace, "digest") if r["metadata"]["name"] == waiting["name"]],
                         timeout=20, what="the waiting start")[0]
    assert started["metadata"]["annotations"]["tether.dev/scheduled-at"] == waiting["scheduledTime"]


def test_a_suspended_schedule_starts_nothing_and_runs_no_slot_late_on_resume(
        kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    _create(kube, namespace, _schedule("weekly", suspend=True))
    status = kube.wait_for(SCHEDULES.format(ns=namespace), "weekly",
                           lambda s: (s.get("status") or {}).get("skippedCount", 0) >= 2, 30, "two slots skipped")["status"]
    assert status["lastSkipped"]["reason"] == "Suspended" and "nextScheduleTime" not in status
    assert _runs(kube, namespace, "weekly") == []
    kube.ok(kube.patch(f"{SCHEDULES.format(ns=namespace)}/weekly", {"spec": {"suspend": False}}))
    resumed_at = dt.datetime.now(dt.timezone.utc).timestamp()
    run = eventually(lambda: _runs(kube, namespace, "weekly"), timeout=20, what="a run after resume")[0]
    assert _slot(run) > resumed_at - 1  # a slot after the resume, not one skipped while suspended


def test_a_slot_whose_budget_is_exhausted_is_skipped_with_its_reason(
        kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    kube.ok(kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{namespace}/workerbudgets",
                      {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget", "metadata": {"name": "team"},
                       "spec": {"limitCents": 0}}))
    body = _schedule("costly")
    body["spec"]["runTemplate"]["spec"]["budget"] = {"budgetRef": {"name": "team"}}
    _create(kube, namespace, body)
    status = kube.wait_for(SCHEDULES.format(ns=namespace), "costly",
                           lambda s: (s.get("status") or {}).get("skippedCount", 0) >= 1, 30, "a slot skipped")["status"]
    assert status["lastSkipped"]["reason"] == "BudgetExhausted" and "team" in status["lastSkipped"]["message"]
    assert _runs(kube, namespace, "costly") == []
    events = kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/events",
                              params={"fieldSelector": "involvedObject.name=costly"}))["items"]
    assert any(e["reason"] == "BudgetExhausted" for e in events)


def test_history_limits_keep_the_newest_finished_runs(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    _create(kube, namespace, _schedule("hourly", failedRunsHistoryLimit=1))
    for _ in range(3):  # each stopped run ends Cancelled: the failed history keeps one
        run = eventually(lambda: [r for r in _runs(kube, namespace, "hourly") if not r["spec"].get("stop")],
                         timeout=20, what="an active run")[0]
        _stop(kube, namespace, run["metadata"]["name"])
        _ended(kube, namespace, run["metadata"]["name"])

    def kept() -> list[str] | None:
        finished = [r["metadata"]["name"] for r in _runs(kube, namespace, "hourly")
                    if (r.get("status") or {}).get("phase") == "Cancelled"]
        return finished if len(finished) == 1 else None

    assert eventually(kept, timeout=20, what="one finished run kept")[0] == run["metadata"]["name"]  # the newest


def test_kubectl_tether_trigger_starts_a_run_now_and_says_so(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    _create(kube, namespace, _schedule("audit", schedule="@yearly", concurrencyPolicy="Forbid"))

    def trigger() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tether.plugin", "trigger", "audit", "-n", namespace,
                               "--kubeconfig", kube.kubeconfig_path],
                              capture_output=True, text=True, timeout=60)

    started = trigger()
    assert started.returncode == 0, started.stderr
    run = started.stdout.split("workerrun.tether.dev/")[1].split()[0]
    assert run.startswith("audit-m") and [r["metadata"]["name"] for r in _runs(kube, namespace, "audit")] == [run]
    refused = trigger()  # Forbid, with the first still active
    assert refused.returncode == 1 and "trigger refused: ConcurrencyForbid" in refused.stderr, refused.stderr
    assert len(_runs(kube, namespace, "audit")) == 1


def test_a_manual_start_runs_now_and_obeys_forbid(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    _create(kube, namespace, _schedule("report", schedule="@yearly", concurrencyPolicy="Forbid"))
    path = f"{SCHEDULES.format(ns=namespace)}/report"
    kube.ok(kube.patch(path, {"metadata": {"annotations": {"tether.dev/trigger": "m1abcdefg"}}}))
    started = kube.wait_for(SCHEDULES.format(ns=namespace), "report",
                            lambda s: (s.get("status") or {}).get("lastTrigger", {}).get("id") == "m1abcdefg",
                            20, "the manual start handled")["status"]["lastTrigger"]
    assert started == {"id": "m1abcdefg", "outcome": "Started", "run": "report-mm1abcdefg"}
    assert [r["metadata"]["name"] for r in _runs(kube, namespace, "report")] == ["report-mm1abcdefg"]
    kube.ok(kube.patch(path, {"metadata": {"annotations": {"tether.dev/trigger": "m2abcdefg"}}}))
    refused = kube.wait_for(SCHEDULES.format(ns=namespace), "report",
                            lambda s: (s.get("status") or {}).get("lastTrigger", {}).get("id") == "m2abcdefg",
                            20, "the second manual start handled")["status"]["lastTrigger"]
    assert refused["outcome"] == "Refused" and "report-mm1abcdefg is active" in refused["message"]
    assert len(_runs(kube, namespace, "report")) == 1


def test_the_same_schedule_gives_the_same_slots_as_a_cronjob(kube: Kube, namespace: str, operator) -> None:  # type: ignore[no-untyped-def]
    """Side by side with the controller-manager's CronJob controller for a few minutes: the same
    scheduled times (its Jobs are named <cronjob>-<the slot's Unix minutes>)."""
    schedule = "*/1 * * * *"
    cronjob = {"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "twin"},
               "spec": {"schedule": schedule, "timeZone": "Etc/UTC", "concurrencyPolicy": "Allow",
                        "jobTemplate": {"spec": {"suspend": True, "template": {"spec": {
                            "restartPolicy": "Never", "containers": [{"name": "c", "image": "none"}]}}}}}}
    made = kube.ok(kube.post(f"/apis/batch/v1/namespaces/{namespace}/cronjobs", cronjob))
    ours = _create(kube, namespace, _schedule("twin", schedule=schedule, failedRunsHistoryLimit=10))
    since = max(dt.datetime.fromisoformat(o["metadata"]["creationTimestamp"].replace("Z", "+00:00")).timestamp()
                for o in (made, ours))

    def jobs() -> set[int]:
        items = kube.ok(kube.get(f"/apis/batch/v1/namespaces/{namespace}/jobs"))["items"]
        return {int(j["metadata"]["name"].rsplit("-", 1)[1]) * 60 for j in items}

    def both() -> tuple[set[int], set[int]] | None:
        theirs = {s for s in jobs() if s > since}
        mine = {_slot(r) for r in _runs(kube, namespace, "twin") if _slot(r) > since}
        return (theirs, mine) if len(theirs) >= 3 and len(mine) >= 3 else None

    theirs, mine = eventually(both, timeout=240, interval=2, what="three slots of each")
    first3 = sorted(theirs)[:3]
    assert sorted(mine)[:3] == first3, (sorted(theirs), sorted(mine))
    cj_last = kube.ok(kube.get(f"/apis/batch/v1/namespaces/{namespace}/cronjobs/twin"))["status"]["lastScheduleTime"]
    assert dt.datetime.fromisoformat(cj_last.replace("Z", "+00:00")).timestamp() in mine


def test_kubectl_get_wrs_shows_schedule_suspend_active_last_and_next(kube: Kube, namespace: str, operator,  # type: ignore[no-untyped-def]
                                                                     bin_dir: Path) -> None:
    _create(kube, namespace, _schedule("board", concurrencyPolicy="Forbid"))
    status = kube.wait_for(SCHEDULES.format(ns=namespace), "board", lambda s: bool((s.get("status") or {}).get("active")),
                           30, "an active run")["status"]
    table = subprocess.run([str(bin_dir / "kubectl"), "get", "wrs", "-n", namespace,
                            "--kubeconfig", kube.kubeconfig_path], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "SCHEDULE", "SUSPEND", "ACTIVE", "LAST", "NEXT", "AGE"]
    assert row.split()[:5] == ["board", "@every", "5s", "false", status["active"][0]["name"]]
    # kstatus (Flux's and kubectl wait's reading) and explain teach the kind.
    explain = subprocess.run([str(bin_dir / "kubectl"), "explain", "wrs.spec.concurrencyPolicy",
                              "--kubeconfig", kube.kubeconfig_path], capture_output=True, text=True, timeout=60)
    assert explain.returncode == 0 and "BufferOne" in explain.stdout, explain.stderr
