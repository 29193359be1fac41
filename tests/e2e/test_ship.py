"""Shipping: the Helm chart on the real control plane (its RBAC, its HA), metrics, kubectl, GitOps."""

from __future__ import annotations

import pytest

import base64
import json
import os
import ssl
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from testkit import runs
from testkit.kube import Kube, eventually
from testkit.operator_process import OperatorProcess
from testkit.scenario import app_run, record_measurement
from tests.unit.chart.test_argocd_health import health

ROOT = Path(__file__).resolve().parents[2]
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


def _kubeconfig() -> str:
    return os.environ["TETHER_TEST_KUBECONFIG"]


def _pid(kube: Kube, ns: str, pod: str) -> int:
    body = kube.ok(kube.get(f"/api/v1/namespaces/{ns}/pods/{pod}"))
    return int(body["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))


@pytest.mark.local_cluster
def test_helm_install_runs_under_its_rbac_and_fails_over(kube: Kube, namespace: str, tools_dir: Path) -> None:
    release = f"t{uuid.uuid4().hex[:6]}"
    lease_seconds = 6
    install = subprocess.run(
        [str(tools_dir / "helm"), "install", release, str(ROOT / "charts" / "tether"), "--namespace", namespace,
         "--kubeconfig", _kubeconfig(), "--set", f"watchNamespaces={{{namespace}}}",
         # One namespace per test holds the release and its runs: placement is asked for, as a user would.
         "--set", "admissionPolicy.allowRunsInOperatorNamespace=true",
         "--set", f"leaderElection.leaseSeconds={lease_seconds}", "--set", "foldIntervalSeconds=1",
         "--wait", "--timeout", "180s"], capture_output=True, text=True)
    try:
        assert install.returncode == 0, install.stderr
        assert "is installed in namespace" in install.stdout  # NOTES.txt
        selector = {"labelSelector": f"app.kubernetes.io/instance={release}"}
        pods = kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/pods", params=selector))["items"]
        assert len(pods) == 2 and all(p["spec"]["serviceAccountName"] == f"{release}-tether" for p in pods)
        leader_lease = LEASES.format(ns=namespace) + "/tether-operator-leader"
        leader = eventually(lambda: kube.get(leader_lease).status_code == 200 and
                            kube.ok(kube.get(leader_lease))["spec"].get("holderIdentity"), timeout=60,
                            what="a leader")
        # The lifecycle, driven by the chart's operator with the chart's ServiceAccount.
        runs.create(kube, namespace, runs.example("short-job.yaml", payload={"steps": 2, "stepSeconds": 0.2}))
        runs.create(kube, namespace, runs.example("crashing-job.yaml", payload={"steps": 4, "stepSeconds": 0.2,
                                                                                "crashAttempts": [1]}))
        assert runs.wait_phase(kube, namespace, "short-job", ("Succeeded", "Failed"), timeout=90)["status"]["phase"] == "Succeeded"
        crashed = runs.wait_phase(kube, namespace, "crashing-job", ("Succeeded", "Failed"), timeout=90)
        assert crashed["status"]["phase"] == "Succeeded" and len(crashed["status"]["attempts"]) == 2
        # A schedule's run, made by the chart's operator under the chart's RBAC (it watches schedules,
        # creates their runs and writes their status).
        schedules = f"/apis/tether.dev/v1alpha1/namespaces/{namespace}/workerrunschedules"
        kube.ok(kube.post(schedules, {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunSchedule",
                                      "metadata": {"name": "tick"},
                                      "spec": {"schedule": "@every 5s", "runTemplate": {"spec": {
                                          "executor": "External", "suspend": True}}}}))
        ticked = kube.wait_for(schedules, "tick", lambda s: bool((s.get("status") or {}).get("active")), 60,
                               "a slot's run made by the chart's operator")
        made = kube.ok(kube.get(Kube.wr_path(namespace, ticked["status"]["active"][0]["name"])))
        assert made["metadata"]["labels"]["tether.dev/schedule"] == "tick"
        kube.ok(kube.patch(f"{schedules}/tick", {"spec": {"suspend": True}}))
        # HA: kill the leader mid-run; the standby takes over; the run is neither lost nor launched twice.
        runs.create(kube, namespace, runs.example("long-job.yaml", payload={"steps": 40, "stepSeconds": 0.25},
                                                  lease={"durationSeconds": 8, "renewIntervalSeconds": 1}))
        runs.wait_phase(kube, namespace, "long-job", "Running", timeout=60)
        leader_pod = next(p["metadata"]["name"] for p in pods if leader.startswith(p["metadata"]["name"]))
        os.kill(_pid(kube, namespace, leader_pod), signal.SIGKILL)
        killed = time.monotonic()
        new_leader = eventually(lambda: (h := kube.ok(kube.get(leader_lease))["spec"].get("holderIdentity")) != leader and h,
                                timeout=lease_seconds * 4, interval=0.1, what="a new leader")
        takeover = time.monotonic() - killed
        record_measurement("ha_takeover", leaseSeconds=lease_seconds, takeoverSeconds=round(takeover, 3))
        assert takeover <= lease_seconds + 3, takeover
        assert not new_leader.startswith(leader_pod + "_" + leader.split("_")[-1])
        run = runs.wait_phase(kube, namespace, "long-job", ("Succeeded", "Failed", "Lost"), timeout=90)
        assert run["status"]["phase"] == "Succeeded"
        assert [a["attempt"] for a in run["status"]["attempts"]] == [1]
    finally:
        subprocess.run([str(tools_dir / "helm"), "uninstall", release, "--namespace", namespace,
                        "--kubeconfig", _kubeconfig(), "--wait", "--timeout", "60s"], capture_output=True)


@pytest.mark.local_cluster
def test_worker_cannot_renew_another_runs_lease(kube: Kube, namespace: str, operator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    for name in ("a", "b"):
        runs.create(kube, namespace, app_run(name, {"holdAttempts": [1], "outFile": str(tmp_path / f"{name}.jsonl")}))
    for name in ("a", "b"):
        runs.wait_phase(kube, namespace, name, "Running", timeout=30)
    # Bound to a's pod, as the kubelet binds it: the admission policy lets only the holder's pod renew.
    pod_a = kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/pods/a-a1"))["metadata"]
    # The namespace's worker identity, shared by every pod-backed run: the admission policy, not a
    # per-run Role, keeps each pod to its own run.
    token = kube.ok(kube.post(f"/api/v1/namespaces/{namespace}/serviceaccounts/tether-worker/token", {"spec": {
        "expirationSeconds": 600,
        "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": "a-a1", "uid": pod_a["uid"]}}}))["status"]["token"]
    # Only the CA: the admin kubeconfig's context also carries a client certificate, which would win.
    ca = ssl.create_default_context(cadata=base64.b64decode(
        yaml.safe_load(Path(_kubeconfig()).read_text())["clusters"][0]["cluster"]["certificate-authority-data"]).decode())
    as_a = httpx.Client(base_url=kube.config.server, verify=ca, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    me = as_a.post("/apis/authentication.k8s.io/v1/selfsubjectreviews",
                   json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).json()
    assert me["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:tether-worker"
    own = as_a.get(LEASES.format(ns=namespace) + "/a")
    assert own.status_code == 200
    # Reading is the shared Role's; writing is the policy's to refuse. b's own worker renews its Lease
    # every second: a PUT of what was read a moment ago may meet a newer resourceVersion (409, decided
    # before the policy is asked; make test met it once), so it is read and sent again until the API
    # server answers about the write itself.
    def put_b() -> httpx.Response | None:
        other = as_a.get(LEASES.format(ns=namespace) + "/b")
        assert other.status_code == 200
        resp = as_a.put(LEASES.format(ns=namespace) + "/b", json=other.json())
        return None if resp.status_code == 409 else resp
    refused = eventually(put_b, timeout=30, what="a PUT of b's Lease answered about the write itself")
    assert refused.status_code == 403 and "tether-worker-lease-fencing" in refused.text, refused.text
    patch = [{"op": "add", "path": "/status/result", "value": {"forged": True}}]
    resp = as_a.patch(Kube.wr_path(namespace, "b") + "/status", json=patch,
                      headers={"Content-Type": "application/json-patch+json"})
    assert resp.status_code == 403 and "tether-worker-status-fencing" in resp.text, resp.text
    assert as_a.put(LEASES.format(ns=namespace) + "/a", json=own.json()).status_code == 200


def _free_port() -> int:
    from tether.devcluster.processes import free_port

    return free_port()


@pytest.mark.local_cluster
def test_metrics_are_scraped(kube: Kube, namespace: str, tmp_path: Path) -> None:
    port = _free_port()
    op = OperatorProcess(namespace, _kubeconfig(), tmp_path / "op.log", extra_args=[f"--metrics-port={port}"],
                         extra_env={"TETHER_FOLD_INTERVAL_SECONDS": "1"}).start()
    try:
        runs.create(kube, namespace, runs.example("crashing-job.yaml", payload={"steps": 2, "stepSeconds": 0.1,
                                                                                "crashAttempts": [1]}))
        runs.wait_phase(kube, namespace, "crashing-job", "Succeeded", timeout=60)

        def scrape() -> dict[str, list]:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            return {f.name: f.samples for f in text_string_to_metric_families(text)}

        families = eventually(lambda: (f := scrape()) and "tether_workerruns" in f and f, timeout=20, what="metrics")
        value = lambda name, **labels: sum(s.value for s in families[name]  # noqa: E731
                                           if all(s.labels.get(k) == v for k, v in labels.items()))
        assert value("tether_workerruns", phase="Succeeded") == 1
        assert value("tether_attempts_started") == 2 and value("tether_lease_regrants") == 1
        assert value("tether_attempts_ended", outcome="PodFailed") == 1
        assert value("tether_attempts_ended", outcome="Succeeded") == 1
        assert value("controller_runtime_reconcile", controller="workerrun") > 0
        assert "controller_runtime_reconcile_time_seconds" in families
        assert "tether_lease_lapse_detection_seconds" in families and "tether_heartbeat_age_seconds" in families
        assert value("tether_leader") == 1
    finally:
        op.stop()


def kubectl(bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": _kubeconfig(),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    return subprocess.run([str(bin_dir / "kubectl"), *args], capture_output=True, text=True, env=env, timeout=120)


def test_kubectl_wait_explain_columns_and_plugin(kube: Kube, namespace: str, operator, bin_dir: Path) -> None:  # type: ignore[no-untyped-def]
    runs.create(kube, namespace, runs.example("short-job.yaml", payload={"steps": 2, "stepSeconds": 0.2}))
    waited = kubectl(bin_dir, "wait", "--for=condition=Succeeded", "wr/short-job", "-n", namespace, "--timeout=60s")
    assert waited.returncode == 0 and "condition met" in waited.stdout, waited.stderr
    table = kubectl(bin_dir, "get", "wr", "-n", namespace)
    header = table.stdout.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "REASON", "ATTEMPT", "FENCE", "HOLDER", "PARENT", "QUEUE", "AGE"]
    # A finished run has no holder, and this one no queue: those columns are blank.
    row = table.stdout.splitlines()[1].split()
    assert row[1:5] == ["Succeeded", "Succeeded", "1", "2"] and len(row) == len(header) - 3, row  # no holder, parent, queue
    wide = kubectl(bin_dir, "get", "wr", "-n", namespace, "-o", "wide").stdout.splitlines()[0]
    assert "SPENT" in wide and "CHECKPOINT" in wide
    explained = kubectl(bin_dir, "explain", "workerrun.spec.lease")
    assert explained.returncode == 0 and "renewIntervalSeconds" in explained.stdout
    assert "Liveness contract" in explained.stdout
    assert "tether" in kubectl(bin_dir, "plugin", "list").stdout
    status = kubectl(bin_dir, "tether", "status", "short-job", "-n", namespace)
    assert status.returncode == 0, status.stderr
    assert "Succeeded" in status.stdout and "FENCE" in status.stdout and "not held" in status.stdout
    runs.create(kube, namespace, runs.example("long-job.yaml"), name="ctl")
    runs.wait_phase(kube, namespace, "ctl", "Running", timeout=30)
    assert kubectl(bin_dir, "tether", "suspend", "ctl", "-n", namespace).returncode == 0
    assert runs.get(kube, namespace, "ctl")["spec"]["suspend"] is True
    assert kubectl(bin_dir, "tether", "resume", "ctl", "-n", namespace).returncode == 0
    assert runs.get(kube, namespace, "ctl")["spec"]["suspend"] is False
    assert kubectl(bin_dir, "tether", "stop", "ctl", "-n", namespace).returncode == 0
    runs.wait_phase(kube, namespace, "ctl", "Cancelled", timeout=30)


@pytest.mark.local_cluster
def test_kstatus_and_argo_health_of_live_runs(kube: Kube, namespace: str, operator, tools_dir: Path,  # type: ignore[no-untyped-def]
                                              tmp_path: Path) -> None:
    kube.ok(kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{namespace}/workerbudgets",
                      {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget", "metadata": {"name": "empty"},
                       "spec": {"limitCents": 0}}))
    runs.create(kube, namespace, app_run("running", {"holdAttempts": [1], "outFile": str(tmp_path / "o.jsonl")}))
    runs.create(kube, namespace, runs.example("short-job.yaml", payload={"steps": 1, "stepSeconds": 0.1}), name="done")
    failing = runs.example("crashing-job.yaml", payload={"steps": 2, "stepSeconds": 0.1, "crashAttempts": [1]})
    failing["spec"]["retry"]["rules"] = [{"action": "FailRun", "onExitCodes": {"operator": "In", "values": [3]}}]
    runs.create(kube, namespace, failing, name="failed")
    blocked = runs.example("short-job.yaml", budget={"budgetRef": {"name": "empty"}})
    runs.create(kube, namespace, blocked, name="blocked")
    states = {"running": "Running", "done": "Succeeded", "failed": "Failed", "blocked": "Pending"}
    objects = {name: runs.wait_phase(kube, namespace, name, phase, timeout=60) for name, phase in states.items()}
    paths = []
    for name, obj in objects.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(obj))
        paths.append(str(path))
    out = subprocess.run([str(tools_dir / "kstatus-check"), *paths], capture_output=True, text=True, check=True)
    results = dict(zip(objects, json.loads(out.stdout)))
    assert {name: r["status"] for name, r in results.items()} == {
        "running": "InProgress", "done": "Current", "failed": "Failed", "blocked": "InProgress"}
    argo = {name: health(obj)["status"] for name, obj in objects.items()}
    assert argo == {"running": "Progressing", "done": "Healthy", "failed": "Degraded", "blocked": "Progressing"}
