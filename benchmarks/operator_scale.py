"""Many runs at once: how fast the operator grants N External runs, and what it costs.

    .venv/bin/python benchmarks/operator_scale.py [--runs 300]

External runs need no pods, so this measures the operator and the API server
alone: the time from creating N runs to all N holding a lease (each grant is a
status CAS, a Lease create and the worker's RBAC), then the operator's CPU
time and memory while N leases are renewed once by a fake fleet of workers,
and, side by side on the same API server, how long the Kubernetes Job
controller takes to create one pod for each of N Jobs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cluster_with_operator  # noqa: E402

NS = "scale"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    with cluster_with_operator(NS) as (_cluster, kube, _):
        operator = next(p for p in psutil.process_iter(["cmdline"])
                        if p.info["cmdline"] and "operator" in p.info["cmdline"] and "tether.cli" in " ".join(p.info["cmdline"]))
        cpu0 = sum(operator.cpu_times()[:2])
        body = lambda i: {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",  # noqa: E731
                          "metadata": {"name": f"r{i}"},
                          "spec": {"executor": "External", "lease": {"durationSeconds": 600, "renewIntervalSeconds": 60}}}
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{NS}/workerruns",
                                              json=body(i)).raise_for_status(), range(args.runs)))
        created = time.monotonic() - started
        while True:
            items = kube.get(f"/apis/tether.dev/v1alpha1/namespaces/{NS}/workerruns").json()["items"]
            granted = sum(1 for r in items if (r.get("status") or {}).get("holder"))
            if granted == args.runs:
                break
            if time.monotonic() - started > 600:
                raise SystemExit(f"only {granted} of {args.runs} granted after 600 s")
            time.sleep(0.5)
        while len([lease for lease in kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases").json()["items"]
                   if lease["spec"].get("holderIdentity")]) < args.runs:
            time.sleep(0.5)  # the grant's second step (the Lease) follows the status write
        all_granted = time.monotonic() - started
        cpu_grant = sum(operator.cpu_times()[:2]) - cpu0
        # One heartbeat per lease, as a fleet of workers would send (conditional PUTs).
        leases = kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases").json()["items"]
        cpu1 = sum(operator.cpu_times()[:2])
        beat_started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda lease: kube.put(
                f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{lease['metadata']['name']}",
                json=lease).raise_for_status(), leases))
        beats = time.monotonic() - beat_started
        time.sleep(2)  # let the operator drain the watch events before reading its CPU time
        # Side by side: the Kubernetes Job controller creating one pod per Job on the same API server.
        job = lambda i: {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"j{i}"},  # noqa: E731
                         "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [
                             {"name": "c", "image": "none", "command": ["true"]}]}}}}
        jobs_started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: kube.post(f"/apis/batch/v1/namespaces/{NS}/jobs", json=job(i)).raise_for_status(),
                          range(args.runs)))
        while len(kube.get(f"/api/v1/namespaces/{NS}/pods", params={"labelSelector": "batch.kubernetes.io/job-name"})
                  .json()["items"]) < args.runs:
            if time.monotonic() - jobs_started > 600:
                raise SystemExit("the Job controller did not create all pods in 600 s")
            time.sleep(0.5)
        jobs_seconds = time.monotonic() - jobs_started
        print(json.dumps({
            "runs": args.runs, "createSeconds": round(created, 2), "allGrantedSeconds": round(all_granted, 2),
            "grantsPerSecond": round(args.runs / all_granted, 1), "operatorCpuSecondsForGrants": round(cpu_grant, 2),
            "heartbeats": len(leases), "heartbeatSeconds": round(beats, 2),
            "operatorCpuSecondsForHeartbeats": round(sum(operator.cpu_times()[:2]) - cpu1, 3),
            "operatorRssMiB": round(operator.memory_info().rss / 2**20, 1),
            "jobControllerPodsCreatedSeconds": round(jobs_seconds, 2),
            "jobControllerPerSecond": round(args.runs / jobs_seconds, 1),
        }, indent=2))


if __name__ == "__main__":
    main()
