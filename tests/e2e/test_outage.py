"""Control-plane outages must not revoke healthy workers (issue 9: 20/20 falsely LeaseLost).

These pause the API server or etcd, so they run on a private control plane of their own,
never on the shared one. Healthy workers renew every 2 s with a 10 s lease; the outage lasts
25 s, far past the lease. Afterwards every worker is still the holder of its first attempt.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest

from testkit import runs
from testkit.kube import Kube, eventually
from testkit.operator_process import OperatorProcess
from testkit.scenario import app_run

pytestmark = pytest.mark.local_cluster

RUNS = 8
NS = "outage"


@pytest.fixture
def private(bin_dir: Path, tmp_path: Path) -> Iterator[tuple[object, Kube, OperatorProcess]]:
    from tether.devcluster.controlplane import LocalCluster
    from tether.devcluster.crds import install_crds

    with LocalCluster(bin_dir=bin_dir, state_dir=tmp_path / "cluster") as cluster:
        with cluster.client() as client:
            install_crds(client)
        kube = Kube(str(cluster.kubeconfig))
        kube.ok(kube.post("/api/v1/namespaces", {"metadata": {"name": NS}}))
        eventually(lambda: kube.get(f"/api/v1/namespaces/{NS}/serviceaccounts/default").status_code == 200,
                   timeout=60, what="default service account")
        op = OperatorProcess(NS, str(cluster.kubeconfig), tmp_path / "operator.log").start()
        try:
            yield cluster, kube, op
        finally:
            op.stop()
            print("\n".join(op.log_path.read_text(errors="replace").splitlines()[-40:]))


def _start_healthy_runs(kube: Kube) -> None:
    for i in range(RUNS):
        body = app_run(f"healthy-{i}", {"holdAttempts": [1], "holdSeconds": 600, "holdWhileUnknown": True}, duration=10, renew=2)
        body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 2
        runs.create(kube, NS, body)
    for i in range(RUNS):
        runs.wait_phase(kube, NS, f"healthy-{i}", "Running", timeout=120)


def _pause(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        until = time.monotonic() + seconds
        eventually(lambda: time.monotonic() >= until, timeout=seconds + 5, interval=0.5, what="the outage")
    finally:
        os.kill(pid, signal.SIGCONT)


def _assert_nobody_lost(kube: Kube, op: OperatorProcess) -> None:
    # Two lease durations after the outage: any false lapse would have been written by now.
    eventually(lambda: kube.get("/readyz").status_code == 200, timeout=60, what="the API back")
    after = time.monotonic() + 25
    eventually(lambda: time.monotonic() >= after, timeout=40, interval=0.5, what="two lease durations")
    for i in range(RUNS):
        s = runs.get(kube, NS, f"healthy-{i}")["status"]
        assert s["phase"] == "Running" and s["attempt"] == 1 and s["holder"] == f"healthy-{i}-a1", s
    assert not op.events("heartbeat_lost")


def _pid(cluster: object, name: str) -> int:
    return next(proc.pid for n, proc in cluster._procs if n == name)  # type: ignore[attr-defined]


def test_a_paused_apiserver_revokes_no_healthy_worker(private: tuple[object, Kube, OperatorProcess]) -> None:
    cluster, kube, op = private
    _start_healthy_runs(kube)
    _pause(_pid(cluster, "kube-apiserver"), 25)
    _assert_nobody_lost(kube, op)
    assert op.events("api_unreachable")  # the operator knew it could not see


def test_a_paused_etcd_revokes_no_healthy_worker(private: tuple[object, Kube, OperatorProcess]) -> None:
    cluster, kube, op = private
    _start_healthy_runs(kube)
    _pause(_pid(cluster, "etcd"), 25)
    _assert_nobody_lost(kube, op)
