"""Queueing through Kueue at scale (`make bench-queues`), on a local control plane with kwok nodes
and the real Kueue manager built from Go modules.

    .venv/bin/python benchmarks/queues.py            # 1000 runs + 1000 Jobs, preemption of 10 + 10
    .venv/bin/python benchmarks/queues.py --smoke    # 40 + 40, preemption of 3 + 3

Scenarios:
  shared   N pod-backed WorkerRuns (their workers played by the simulated fleet, each completing
           1 s after its first renewal) and N Kueue-managed batch Jobs (kwok completes their pods
           at once), created together into one ClusterQueue with room for 100 at a time (100m cpu
           each, 10 cpu): created -> admitted (the Workload Admitted), admitted -> pod created,
           created -> finished (the run Succeeded, the Job Complete), for each kind side by side.
  preempt  K low-priority pod runs fill a ClusterQueue's cpu and K low-priority External runs its
           tether.dev/runs; one high-priority run of each kind arrives. Per evicted run: eviction ->
           its attempt revoked (the fleet's worker stops when told: yield), eviction -> its quota
           released (once its pod has ended: a kwok pod never reports an exit, so Tether waits
           its 60 s for one past the deletion; a kubelet reports it when the worker exits), the preemptor's end ->
           the victim admitted again, admitted -> its next attempt granted, eviction -> resumed
           (the next attempt's first renewal).

Writes benchmarks/results/queues-<date>.json; `benchmarks/report.py` puts it in the README's table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.fleet import FleetProcess, Plan  # noqa: E402
from benchmarks.scale import (JOBS, WR, Env, Operator, PodTimes, Times, batch_job, create_paced,  # noqa: E402
                              environment, summary, worker_run)
from tether.devcluster.processes import wait_for  # noqa: E402

KUEUE = "/apis/kueue.x-k8s.io/v1beta2"
CPU_MILLI = 100
SLOTS = 100


def _kueue(env: Env, path: str, body: dict[str, Any]) -> None:
    resp = env.api.post(f"{KUEUE}/{path}", json={"apiVersion": "kueue.x-k8s.io/v1beta2", **body})
    if resp.status_code not in (201, 409):
        resp.raise_for_status()


def cluster_queue(env: Env, name: str, cpu_milli: int, runs: int = 0, preemption: bool = False) -> None:
    _kueue(env, "resourceflavors", {"kind": "ResourceFlavor", "metadata": {"name": name}, "spec": {}})
    resources = [("cpu", f"{cpu_milli}m")] + ([("tether.dev/runs", str(runs))] if runs else [])
    _kueue(env, "clusterqueues", {"kind": "ClusterQueue", "metadata": {"name": name}, "spec": {
        "namespaceSelector": {}, **({"preemption": {"withinClusterQueue": "LowerPriority"}} if preemption else {}),
        "resourceGroups": [{"coveredResources": [r for r, _ in resources], "flavors": [
            {"name": name, "resources": [{"name": r, "nominalQuota": q} for r, q in resources]}]}]}})


def local_queue(env: Env, ns: str, cq: str) -> None:
    _kueue(env, f"namespaces/{ns}/localqueues",
           {"kind": "LocalQueue", "metadata": {"name": "bench"}, "spec": {"clusterQueue": cq}})


def queued(body: dict[str, Any], priority: str | None = None, milli: int = CPU_MILLI) -> dict[str, Any]:
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "bench",
                                  **({"kueue.x-k8s.io/priority-class": priority} if priority else {})}
    pod = body["spec"]["template"]["spec"] if "template" in body["spec"] else None
    if pod is not None:
        pod["containers"][0]["resources"] = {"requests": {"cpu": f"{milli}m"}}
    return body


def _owner(obj: dict[str, Any]) -> str | None:
    refs = obj["metadata"].get("ownerReferences") or []
    return refs[0]["name"] if refs else None


def _conds(obj: dict[str, Any]) -> dict[str, str]:
    return {c.get("type", ""): c.get("status", "") for c in (obj.get("status") or {}).get("conditions") or []}


def workload_marks(wl: dict[str, Any]) -> list[tuple[str, str]]:
    """admitted (first), evicted, released (evicted, its quota no longer reserved) and readmitted
    (admitted again after an eviction), by owner."""
    owner, conds = _owner(wl), _conds(wl)
    if owner is None:
        return []
    evictions = sum(e.get("count", 0) for e in ((wl.get("status") or {}).get("schedulingStats") or {}).get(
        "evictions") or [])
    out = []
    if conds.get("Admitted") == "True" and conds.get("Evicted") != "True":
        out.append(("admitted", owner))
        if evictions:
            out.append(("readmitted", owner))
    if conds.get("Evicted") == "True":
        out.append(("evicted", owner))
        if conds.get("QuotaReserved") == "False":
            out.append(("released", owner))  # the evicted attempt over: its quota free for the preemptor
    return out


TERMINAL = ("Succeeded", "Failed", "Cancelled", "Lost", "BudgetExceeded", "DeadlineExceeded", "Rejected")


def finished_marks(obj: dict[str, Any]) -> list[tuple[str, str]]:
    """finished: a run Succeeded, a Job Complete; ended: a run in any terminal phase."""
    name, status = obj["metadata"]["name"], obj.get("status") or {}
    done = status.get("phase") == "Succeeded" or _conds(obj).get("Complete") == "True"
    return ([("finished", name)] if done else []) + ([("ended", name)] if status.get("phase") in TERMINAL else [])


def _deltas(later: dict[str, float], earlier: dict[str, float]) -> dict[str, float | int]:
    return summary([later[k] - earlier[k] for k in earlier if k in later])


def shared(env: Env, n: int) -> dict[str, Any]:
    """N runs and N Jobs through one ClusterQueue with room for SLOTS at a time."""
    cluster_queue(env, "bench-shared", SLOTS * CPU_MILLI)
    ns = {"tether": env.namespace("queue-runs"), "jobs": env.namespace("queue-jobs")}
    for namespace in ns.values():
        local_queue(env, namespace, "bench-shared")
    op = Operator(env, ns["tether"])
    fleet = FleetProcess(env.kubeconfig, ns["tether"], Plan(complete_after=1.0))
    watches = {kind: {"workloads": Times(env, f"{KUEUE}/namespaces/{namespace}/workloads", workload_marks),
                      "finished": Times(env, (WR if kind == "tether" else JOBS).format(ns=namespace), finished_marks),
                      "pods": PodTimes(env, namespace, "tether.dev/run" if kind == "tether"
                                       else "batch.kubernetes.io/job-name")}
               for kind, namespace in ns.items()}
    sent: dict[str, dict[str, float]] = {}
    began = time.time()
    try:
        # Side by side, so neither kind is queued ahead of the other: 50 creates a second of each.
        with ThreadPoolExecutor(2) as pool:
            runs = pool.submit(create_paced, env, WR.format(ns=ns["tether"]),
                               [queued(worker_run(f"r{i}", 30, 5)) for i in range(n)], 50)
            jobs = pool.submit(create_paced, env, JOBS.format(ns=ns["jobs"]),
                               [queued(batch_job(f"r{i}")) for i in range(n)], 50)
            sent = {"tether": runs.result(), "jobs": jobs.result()}
        wait_for(lambda: all(len(w["finished"].of("finished")) >= n for w in watches.values()),
                 timeout=max(900, 2 * n), interval=1.0, what=f"{n} runs and {n} Jobs finished")
    finally:
        cpu = op.cpu_seconds()
        fleet.stop()
        op.stop()
        for w in watches.values():
            for t in w.values():
                t.stop()
    out: dict[str, Any] = {"objects": n, "slots": SLOTS, "seconds": round(time.time() - began, 1),
                           "operatorCpuSeconds": round(cpu, 1)}
    for kind, w in watches.items():
        admitted = w["workloads"].of("admitted")
        out[kind] = {"createdToAdmitted": _deltas(admitted, sent[kind]),
                     "admittedToPod": _deltas(w["pods"].created, admitted),
                     "createdToFinished": _deltas(w["finished"].of("finished"), sent[kind]),
                     "finishedPerSecond": round(n / max(max(w["finished"].of("finished").values()) - began, 1e-3), 2)}
        print(f"  shared {kind}: {out[kind]}", flush=True)
    return out


def _attempt_times(env: Env, ns: str, name: str) -> tuple[float | None, float | None]:
    """The first attempt's end and the second's start (wall clock)."""
    attempts = (env.api.get(f"{WR.format(ns=ns)}/{name}").json().get("status") or {}).get("attempts") or []

    def at(value: str | None) -> float | None:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else None

    ended = at(attempts[0].get("endedAt")) if attempts else None
    started = at(attempts[1].get("startedAt")) if len(attempts) > 1 else None
    return ended, started


def _where(env: Env, ns: str) -> str:
    """Each run's phase, status message and last attempt's outcome, counted, with the runs' names:
    what a timed-out wait reports."""
    seen: dict[str, list[str]] = {}
    for r in env.api.get(WR.format(ns=ns)).json()["items"]:
        s = r.get("status") or {}
        last = (s.get("attempts") or [{}])[-1]
        what = (f"{s.get('phase')}: {s.get('message', '')[:120]} (attempt {s.get('attempt')}: "
                f"{last.get('outcome')}: {last.get('message', '')[:160]})")
        seen.setdefault(what, []).append(r["metadata"]["name"])
    return "; ".join(f"{len(names)} x {what} [{', '.join(sorted(names))}]"
                     for what, names in sorted(seen.items(), key=lambda kv: -len(kv[1])))


def preempt(env: Env, k: int) -> dict[str, Any]:
    """K pod runs and K External runs evicted by one higher-priority run of each kind."""
    for name, value in (("bench-low", 10), ("bench-high", 1000)):
        _kueue(env, "workloadpriorityclasses", {"kind": "WorkloadPriorityClass", "metadata": {"name": name},
                                                "value": value})
    cluster_queue(env, "bench-preempt", k * CPU_MILLI, runs=k, preemption=True)
    ns = env.namespace("queue-preempt")
    local_queue(env, ns, "bench-preempt")
    op = Operator(env, ns)
    fleet = FleetProcess(env.kubeconfig, ns, Plan())  # renew until told to stop
    workloads = Times(env, f"{KUEUE}/namespaces/{ns}/workloads", workload_marks)
    finished = Times(env, WR.format(ns=ns), finished_marks)

    def pod_run(name: str) -> dict[str, Any]:
        body = worker_run(name, 30, 5)
        body["spec"]["stopGraceSeconds"] = 2  # a kwok pod never exits: its attempt ends at the grace
        return body

    def external(name: str) -> dict[str, Any]:
        body = worker_run(name, 30, 5)
        body["spec"] = {"executor": "External", "payload": {}, "lease": body["spec"]["lease"], "stopGraceSeconds": 2}
        return body

    victims = {"pod": [f"pod{i}" for i in range(k)], "external": [f"ext{i}" for i in range(k)]}
    try:
        for name in victims["pod"]:
            env.api.post(WR.format(ns=ns), json=queued(pod_run(name), "bench-low")).raise_for_status()
        for name in victims["external"]:
            env.api.post(WR.format(ns=ns), json=queued(external(name), "bench-low")).raise_for_status()
        everyone = victims["pod"] + victims["external"]
        try:
            wait_for(lambda: fleet.renewing() >= 2 * k, timeout=300, interval=0.5, what=f"{2 * k} victims renewing")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc} (renewing: {fleet.renewing()}; runs: {_where(env, ns)})") from None
        for body in (queued(pod_run("high-pod"), "bench-high", k * CPU_MILLI), queued(external("high-ext"), "bench-high")):
            env.api.post(WR.format(ns=ns), json=body).raise_for_status()
        wait_for(lambda: len(workloads.of("evicted")) >= k + 1, timeout=120, interval=0.5,
                 what="the victims evicted")
        # The preemptors finish at once (stopped), and the victims come back.
        for name in ("high-pod", "high-ext"):
            env.api.patch(f"{WR.format(ns=ns)}/{name}", json={"spec": {"stop": True}},
                          headers={"Content-Type": "application/merge-patch+json"}).raise_for_status()
        evicted = [n for n in everyone if n in workloads.of("evicted")]
        wait_for(lambda: all(n in workloads.of("readmitted") and _attempt_times(env, ns, n)[1] for n in evicted),
                 timeout=300, interval=0.5, what="the evicted victims readmitted and granted again")

        def resumed_all() -> Any:
            stats = fleet.stats()
            again = {p.run for key, p in stats.played.items() if key[1] > 1 and p.answered}
            return stats if set(evicted) <= again else None

        resumed = wait_for(resumed_all, timeout=120, interval=0.5, what="the victims' next attempts renewing")
    finally:
        fleet.stop()
        op.stop()
        workloads.stop()
        finished.stop()
    first_renewal = {p.run: p.answered[0] for key, p in resumed.played.items() if p.answered and key[1] > 1}
    out: dict[str, Any] = {"victimsPerKind": k}
    for kind, names in victims.items():
        hit = [n for n in names if n in workloads.of("evicted")]
        times = {n: _attempt_times(env, ns, n) for n in hit}
        stopped = finished.of("ended").get("high-pod" if kind == "pod" else "high-ext")
        out[kind] = {
            "evicted": len(hit),
            "evictedToRevoked": summary([times[n][0] - workloads.of("evicted")[n] for n in hit if times[n][0]]),
            "evictedToReleased": summary([workloads.of("released")[n] - workloads.of("evicted")[n] for n in hit
                                          if n in workloads.of("released")]),
            "preemptorEndToReadmitted": summary([workloads.of("readmitted")[n] - stopped for n in hit
                                                 if n in workloads.of("readmitted") and stopped]),
            "readmittedToGranted": summary([times[n][1] - workloads.of("readmitted")[n] for n in hit
                                            if times[n][1] and n in workloads.of("readmitted")]),
            "evictedToResumed": summary([first_renewal[n] - workloads.of("evicted")[n] for n in hit
                                         if n in first_renewal]),
        }
        print(f"  preempt {kind}: {out[kind]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="shared,preempt")
    parser.add_argument("--objects", type=int, default=1000, help="runs, and as many Jobs, in shared")
    parser.add_argument("--victims", type=int, default=10, help="pod runs, and as many External runs, in preempt")
    parser.add_argument("--kwok-nodes", type=int, default=4)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.smoke:
        args.objects, args.victims = 40, 3
    report: dict[str, Any] = {"date": dt.date.today().isoformat(), "smoke": args.smoke}
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"queues-{report['date']}{'-smoke' if args.smoke else ''}.json")
    with environment(args.kwok_nodes, 100, 200, kueue=True) as env:
        if "shared" in args.scenarios:
            report["shared"] = shared(env, args.objects)
        if "preempt" in args.scenarios:
            report["preempt"] = preempt(env, args.victims)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
