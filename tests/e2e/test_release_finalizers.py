"""`kubectl tether release-finalizers`: runs left behind by an uninstalled operator can be deleted,
and nothing is released while an operator is alive (issue 22)."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from typing import Any

import pytest

from testkit import runs
from testkit.kube import Kube, eventually
from testkit.operator_process import OperatorProcess
from tether.api import constants as c
from tether.release_finalizers import LEADER_LEASE

pytestmark = pytest.mark.local_cluster  # stops its own operator process


def _plugin(kube: Kube, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tether.plugin", "release-finalizers", *args,
                           "--kubeconfig", kube.kubeconfig_path], capture_output=True, text=True, timeout=60)


def _leader_lease(ns: str, renewed: dt.datetime, holder: str = "tether-7d9f_0a1b2c3d") -> dict[str, Any]:
    stamp = renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": LEADER_LEASE, "namespace": ns},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "renewTime": stamp,
                     "acquireTime": stamp, "leaseTransitions": 0}}


def _finalizers(kube: Kube, ns: str, name: str) -> list[str] | None:
    resp = kube.get(Kube.wr_path(ns, name))
    return None if resp.status_code == 404 else resp.json()["metadata"].get("finalizers", [])


def _strip(kube: Kube, ns: str, name: str) -> None:
    """So that a failed test does not leave its namespace stuck in Terminating."""
    kube.patch(Kube.wr_path(ns, name), {"metadata": {"finalizers": None}})


def test_a_run_whose_operator_is_gone_becomes_deletable(kube: Kube, namespace: str,
                                                         operator: OperatorProcess) -> None:
    runs.create(kube, namespace, runs.example("long-job.yaml", payload={"steps": 300, "stepSeconds": 1}),
                name="left-behind")
    run = runs.wait_phase(kube, namespace, "left-behind", "Running")
    pod = f"left-behind-a{run['status']['attempt']}"
    assert c.POD_FINALIZER in kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/pods/{pod}"))["metadata"]["finalizers"]
    operator.stop()  # as `helm uninstall` would
    # A stale leader Lease (an uninstalled operator's) is no sign of life.
    kube.ok(kube.post(f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
                      _leader_lease(namespace, dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=2))))
    try:
        kube.ok(kube.delete(Kube.wr_path(namespace, "left-behind")))
        # The forgotten order: deleted, and held by the finalizer nobody will remove.
        assert _finalizers(kube, namespace, "left-behind") == [c.RUN_FINALIZER]

        done = _plugin(kube, "-n", namespace, "--operator-namespace", namespace)
        assert done.returncode == 0, done.stderr
        assert f"released workerrun.tether.dev/{namespace}/left-behind" in done.stdout
        assert f"released pod/{namespace}/{pod}" in done.stdout
        assert "not charged" in done.stdout
        eventually(lambda: _finalizers(kube, namespace, "left-behind") is None, timeout=30, what="the run gone")
        # Its pod, owned by the run, goes with it (its finalizer released too).
        eventually(lambda: kube.get(f"/api/v1/namespaces/{namespace}/pods/{pod}").status_code == 404,
                   timeout=60, what="the run's pod collected")
    finally:
        _strip(kube, namespace, "left-behind")


def test_refused_while_an_operator_holds_its_leader_lease(kube: Kube, namespace: str) -> None:
    body = runs.example("short-job.yaml")
    body["metadata"]["finalizers"] = ["example.com/keep", c.RUN_FINALIZER]
    runs.create(kube, namespace, body, name="guarded")
    kube.ok(kube.post(f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
                      _leader_lease(namespace, dt.datetime.now(dt.timezone.utc))))
    try:
        refused = _plugin(kube, "guarded", "-n", namespace, "--operator-namespace", namespace)
        assert refused.returncode == 1
        assert f"leader Lease {namespace}/{LEADER_LEASE} is held by tether-7d9f_0a1b2c3d" in refused.stderr
        assert _finalizers(kube, namespace, "guarded") == ["example.com/keep", c.RUN_FINALIZER]

        forced = _plugin(kube, "guarded", "-n", namespace, "--operator-namespace", namespace, "--force")
        assert forced.returncode == 0, forced.stderr
        # Only Tether's finalizer goes; another controller's stays.
        assert _finalizers(kube, namespace, "guarded") == ["example.com/keep"]
    finally:
        _strip(kube, namespace, "guarded")
