"""Gateway heartbeat latency and throughput on the local control plane.

    .venv/bin/python benchmarks/gateway_heartbeat.py [--runs 8] [--beats 200]

Each external run is claimed once; then heartbeats (each one TokenReview-cached
auth, one Lease GET and one conditional Lease PUT) are sent sequentially
(latency) and from one thread per run (throughput). Loopback only, bounded.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cluster_with_operator, percentile  # noqa: E402
from tether.devcluster.processes import wait_for  # noqa: E402

NS = "bench"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--beats", type=int, default=200)
    args = parser.parse_args()
    with cluster_with_operator(NS, gateway=True) as (_cluster, kube, url):
        kube.post(f"/api/v1/namespaces/{NS}/serviceaccounts", json={"metadata": {"name": "ext"}})
        kube.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles", json={
            "metadata": {"name": "claims"},
            "rules": [{"apiGroups": ["tether.dev"], "resources": ["workerruns"], "verbs": ["claim"]}]})
        kube.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings", json={
            "metadata": {"name": "claims"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                       "name": "claims"},
            "subjects": [{"kind": "ServiceAccount", "name": "ext", "namespace": NS}]})
        token = kube.post(f"/api/v1/namespaces/{NS}/serviceaccounts/ext/token",
                          json={"spec": {"audiences": ["tether-gateway"], "expirationSeconds": 3600}}).json()["status"]["token"]
        headers = {"Authorization": f"Bearer {token}"}
        claims = []
        for i in range(args.runs):
            name = f"ext-{i}"
            kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{NS}/workerruns", json={
                "apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name},
                "spec": {"executor": "External", "lease": {"durationSeconds": 120, "renewIntervalSeconds": 30}}}
            ).raise_for_status()
            wait_for(lambda n=name: (kube.get(f"/apis/tether.dev/v1alpha1/namespaces/{NS}/workerruns/{n}").json()
                                     .get("status") or {}).get("holder"), timeout=60, what=f"{name} granted")
            claim = wait_for(lambda n=name: (r := httpx.post(f"{url}/api/v1/namespaces/{NS}/workerruns/{n}/claim",
                                                             json={}, headers=headers, timeout=30)).status_code == 200
                             and r.json(), timeout=60, what=f"claim {name}")
            claims.append((name, claim["holder"], claim["fence"]))

        def beat(http: httpx.Client, name: str, holder: str, fence: int, n: int, offset: int = 0) -> list[float]:
            out = []
            for i in range(offset, offset + n):
                t = time.perf_counter()
                r = http.post(f"/api/v1/namespaces/{NS}/workerruns/{name}/heartbeat",
                              json={"holder": holder, "fence": fence, "usage": {"cents": i, "tokens": i}})
                out.append(time.perf_counter() - t)
                assert r.status_code == 200, r.text
            return out

        with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
            latencies = beat(http, *claims[0], args.beats)
        results: list[list[float]] = [[] for _ in claims]

        def worker(i: int) -> None:
            with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
                results[i] = beat(http, *claims[i], args.beats, offset=args.beats)  # usage only grows

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(claims))]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
        total = sum(len(r) for r in results)
        ms = lambda v: round(v * 1000, 2)  # noqa: E731
        print(json.dumps({
            "sequential": {"n": len(latencies), "p50_ms": ms(percentile(latencies, 50)),
                           "p95_ms": ms(percentile(latencies, 95)), "p99_ms": ms(percentile(latencies, 99))},
            "concurrent": {"clients": len(claims), "heartbeats": total, "seconds": round(elapsed, 2),
                           "per_second": round(total / elapsed, 1),
                           "p50_ms": ms(percentile([x for r in results for x in r], 50)),
                           "p95_ms": ms(percentile([x for r in results for x in r], 95))},
        }, indent=2))


if __name__ == "__main__":
    main()
