"""The start-up herd: what an operator restart costs the API server, with the client-side limit.

    .venv/bin/python benchmarks/startup_herd.py [--runs 300] [--qps 50] [--burst 100]

N External runs (no pods) drawing on one WorkerBudget are granted; then the operator is
killed with SIGKILL and started again behind the fault proxy (used here only to count what
the operator sends). Reported: the grant phase's requests, and after the restart the
requests by verb and resource, the peak requests per second (1-second buckets) and the time
until the operator went quiet (no request for 5 s), for the given --qps/--burst. The API health
probe (`/readyz`, one per second) is not counted.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tether.devcluster.controlplane import LocalCluster, resolve_binaries  # noqa: E402
from tether.devcluster.crds import install_crds, install_policies  # noqa: E402
from tether.devcluster.processes import wait_for  # noqa: E402
from testkit.operator_process import OperatorProcess  # noqa: E402

NS = "herd"
WR = f"/apis/tether.dev/v1alpha1/namespaces/{NS}/workerruns"


def _resource(path: str) -> str:
    parts = [p for p in path.split("?")[0].split("/") if p]
    if "namespaces" in parts and parts.index("namespaces") + 2 < len(parts):
        return "/".join(parts[parts.index("namespaces") + 2:parts.index("namespaces") + 4:2])
    return parts[-1] if parts else "/"


def _profile(records: list, since: float) -> dict[str, object]:  # type: ignore[type-arg]
    mine = [r for r in records if r.started >= since and not r.watch and not r.path.startswith("/readyz")]
    by_kind = collections.Counter(f"{r.method} {_resource(r.path)}" for r in mine)
    buckets = collections.Counter(int(r.started - since) for r in mine)
    quiet_at = max((r.started for r in mine), default=since) - since
    return {"requests": len(mine), "byVerbAndResource": dict(by_kind.most_common()),
            "peakPerSecond": max(buckets.values(), default=0), "lastRequestAfterSeconds": round(quiet_at, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--qps", type=float, default=50)
    parser.add_argument("--burst", type=int, default=100)
    args = parser.parse_args()
    with LocalCluster(bin_dir=resolve_binaries(), with_kubelet=False) as cluster:
        os.environ["TETHER_TEST_STATE_DIR"] = str(cluster.state_dir)  # the proxy's certificate from the cluster CA
        from testkit.apiproxy import ApiProxy  # noqa: PLC0415 - needs the state dir above

        kube = cluster.client(timeout=30)
        install_crds(kube)
        install_policies(kube)
        kube.post("/api/v1/namespaces", json={"metadata": {"name": NS}}).raise_for_status()
        wait_for(lambda: kube.get(f"/api/v1/namespaces/{NS}/serviceaccounts/default").status_code == 200,
                 timeout=60, what="namespace")
        kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{NS}/workerbudgets", json={
            "apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget", "metadata": {"name": "team"},
            "spec": {"limitCents": 1_000_000}}).raise_for_status()
        body = lambda i: {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",  # noqa: E731
                          "metadata": {"name": f"r{i}"},
                          "spec": {"executor": "External", "budget": {"budgetRef": {"name": "team"}},
                                   "lease": {"durationSeconds": 600, "renewIntervalSeconds": 60}}}
        log_dir = Path(tempfile.mkdtemp(prefix="tether-herd-"))
        env = {"TETHER_KUBE_QPS": str(args.qps), "TETHER_KUBE_BURST": str(args.burst)}
        with ApiProxy(str(cluster.kubeconfig), seed=0) as proxy:
            op = OperatorProcess(NS, str(proxy.kubeconfig), log_dir / "operator.log", extra_env=env).start()
            started = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: kube.post(WR, json=body(i)).raise_for_status(), range(args.runs)))
            wait_for(lambda: sum(1 for r in kube.get(WR).json()["items"] if (r.get("status") or {}).get("holder"))
                     == args.runs, timeout=900, interval=0.5, what="every run granted")
            granted = time.monotonic() - started
            grant_profile = _profile(proxy.requests(), started)
            op.kill()
            restarted = time.monotonic()
            op.start()
            # Quiet: no request from the operator for 5 s (watches and the 1/s health probe excluded).
            wait_for(lambda: time.monotonic() - max([r.started for r in proxy.requests() if not r.watch
                                                     and not r.path.startswith("/readyz")
                                                     and r.started >= restarted] or [restarted]) > 5
                     and time.monotonic() - restarted > 10, timeout=600, interval=0.5, what="the operator quiet")
            restart_profile = _profile(proxy.requests(), restarted)
            op.stop()
        print(json.dumps({"runs": args.runs, "qps": args.qps, "burst": args.burst,
                          "grantSeconds": round(granted, 2), "grant": grant_profile,
                          "restart": restart_profile}, indent=2))


if __name__ == "__main__":
    main()
