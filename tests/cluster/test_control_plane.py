"""Smoke tests of the local control plane: each checks something a fake API server would get wrong."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import pod_log
from testkit.kube import Kube, eventually

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


def test_version_reports_the_pinned_release(kube: Kube) -> None:
    pinned = re.search(r"^KUBERNETES_VERSION=(\S+)", (Path(__file__).parents[2] / "hack/versions.env").read_text(), re.M)
    version = kube.ok(kube.get("/version"))
    assert re.fullmatch(r"v1\.36\.\d+", version["gitVersion"]), version
    if not os.environ.get("TETHER_CONTROL_PLANE_BIN"):
        assert pinned and version["gitVersion"] == pinned.group(1)


def test_stale_resource_version_update_conflicts(kube: Kube, namespace: str) -> None:
    path = LEASES.format(ns=namespace)
    lease = kube.ok(kube.post(path, {"metadata": {"name": "l"}, "spec": {"holderIdentity": "a"}}))
    stale = dict(lease)
    lease["spec"]["holderIdentity"] = "b"
    kube.ok(kube.put(f"{path}/l", lease))
    stale["spec"] = {"holderIdentity": "c"}
    resp = kube.put(f"{path}/l", stale)
    assert resp.status_code == 409, resp.text
    assert kube.ok(kube.get(f"{path}/l"))["spec"]["holderIdentity"] == "b"


def test_json_patch_with_failing_test_changes_nothing(kube: Kube, namespace: str) -> None:
    path = LEASES.format(ns=namespace)
    lease = kube.ok(kube.post(path, {"metadata": {"name": "l"}, "spec": {"holderIdentity": "w1", "leaseTransitions": 3}}))
    resp = kube.patch(f"{path}/l", [
        {"op": "test", "path": "/spec/leaseTransitions", "value": 2},
        {"op": "replace", "path": "/spec/holderIdentity", "value": "intruder"},
    ], kind="json")
    assert resp.status_code == 422, resp.text
    after = kube.ok(kube.get(f"{path}/l"))
    assert after["spec"]["holderIdentity"] == "w1"
    assert after["metadata"]["resourceVersion"] == lease["metadata"]["resourceVersion"]
    # The same patch with the right value goes through: the precondition is what failed.
    resp = kube.patch(f"{path}/l", [
        {"op": "test", "path": "/spec/leaseTransitions", "value": 3},
        {"op": "replace", "path": "/spec/holderIdentity", "value": "w2"},
    ], kind="json")
    assert kube.ok(resp)["spec"]["holderIdentity"] == "w2"


def _sleep_pod(name: str, owner: dict | None = None) -> dict:
    meta: dict = {"name": name}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"],
                                    "uid": owner["metadata"]["uid"]}]
    return {"metadata": meta, "spec": {
        "restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
        "containers": [{"name": "main", "image": "process", "command": ["sleep", "3600"]}]}}


def _pid(pod: dict) -> int:
    return int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited even though its pid still answers.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.split(")")[-1].split()[0] != "Z"


def test_pod_is_scheduled_and_runs_as_a_process(kube: Kube, namespace: str) -> None:
    pods = f"/api/v1/namespaces/{namespace}/pods"
    kube.ok(kube.post(pods, _sleep_pod("sleeper")))
    pod = eventually(lambda: (p := kube.ok(kube.get(f"{pods}/sleeper"))).get("status", {}).get("phase") == "Running" and p,
                     timeout=60, what="pod Running")
    assert pod["spec"]["nodeName"] == "tether-node-0"  # bound by the real scheduler
    pid = _pid(pod)
    assert _alive(pid)
    assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"3600"]
    kube.ok(kube.delete(f"{pods}/sleeper"))
    eventually(lambda: kube.get(f"{pods}/sleeper").status_code == 404, timeout=30, what="pod deleted")
    assert not _alive(pid)


def test_pod_exit_code_is_reported(kube: Kube, namespace: str) -> None:
    pods = f"/api/v1/namespaces/{namespace}/pods"
    body = _sleep_pod("crasher")
    body["spec"]["containers"][0]["command"] = ["sh", "-c", "exit 7"]
    kube.ok(kube.post(pods, body))
    pod = eventually(lambda: (p := kube.ok(kube.get(f"{pods}/crasher"))).get("status", {}).get("phase") == "Failed" and p,
                     timeout=60, what="pod Failed")
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 7


def test_deleting_owner_cascades_to_pods(kube: Kube, namespace: str) -> None:
    cms = f"/api/v1/namespaces/{namespace}/configmaps"
    pods = f"/api/v1/namespaces/{namespace}/pods"
    owner = kube.ok(kube.post(cms, {"metadata": {"name": "owner"}}))
    kube.ok(kube.post(pods, _sleep_pod("owned", owner)))
    eventually(lambda: kube.ok(kube.get(f"{pods}/owned")).get("status", {}).get("phase") == "Running",
               timeout=60, what="owned pod Running")
    kube.ok(kube.delete(f"{cms}/owner", json={"propagationPolicy": "Background"}))
    # Only the garbage collector in kube-controller-manager deletes the pod.
    eventually(lambda: kube.get(f"{pods}/owned").status_code == 404, timeout=60, what="owned pod collected")


@pytest.mark.local_cluster
def test_a_pod_reaches_a_service_through_its_environment_variables(kube: Kube, namespace: str) -> None:
    """As a real kubelet does, the process kubelet gives a pod its namespace's Service variables and
    expands `$(VAR)` in args; the proxy behind them finds the Service's pod on its published port.
    The client starts first: its connection waits for the server to listen."""
    pods = f"/api/v1/namespaces/{namespace}/pods"
    kube.ok(kube.post(f"/api/v1/namespaces/{namespace}/services", {"metadata": {"name": "web-app"}, "spec": {
        "selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}))
    client = _sleep_pod("client")
    client["spec"]["containers"][0]["command"] = [
        "python", "-c", "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=30).status, "
                        "sys.argv[2])",
        "http://$(WEB_APP_SERVICE_HOST):$(WEB_APP_SERVICE_PORT_HTTP)/", "$$(WEB_APP_SERVICE_HOST)"]
    kube.ok(kube.post(pods, client))
    server = _sleep_pod("server")
    server["metadata"]["labels"] = {"app": "web"}
    server["spec"]["containers"][0].update(command=["python", "-m", "http.server", "8000", "--bind", "127.0.0.1"],
                                           ports=[{"name": "http", "containerPort": 8000}])
    kube.ok(kube.post(pods, server))
    done = eventually(lambda: (p := kube.ok(kube.get(f"{pods}/client"))).get("status", {}).get("phase")
                      in ("Succeeded", "Failed") and p, timeout=60, what="the client finished")
    assert done["status"]["phase"] == "Succeeded", done["status"]
    assert pod_log(namespace, "client").splitlines()[-1] == "200 $(WEB_APP_SERVICE_HOST)"  # `$$` escapes
    argv = Path(f"/proc/{_pid(kube.ok(kube.get(f'{pods}/server')))}/cmdline").read_bytes().split(b"\0")
    assert argv[3] != b"8000"  # the server listens on a published host port, not on 8000


def _worker_run(**spec: object) -> dict:
    base = {"executor": "External", "payload": {"x": 1}}
    base.update(spec)
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": "bad"}, "spec": base}


@pytest.mark.parametrize(
    ("spec", "field", "hint"),
    [
        ({"lease": {"durationSeconds": 60, "renewIntervalSeconds": 30}}, "spec.lease.durationSeconds", "2 × lease.renewIntervalSeconds"),
        ({"retry": {"maxAttempts": -1}}, "spec.retry.maxAttempts", "should be greater than or equal to 1"),
        ({"budget": {"capCents": -5}}, "spec.budget.capCents", "should be greater than or equal to 0"),
        ({"executor": "Lambda"}, "spec.executor", "supported values"),
    ],
)
def test_invalid_worker_run_is_rejected_naming_the_field(kube: Kube, namespace: str, spec: dict, field: str, hint: str) -> None:
    resp = kube.post(Kube.wr_path(namespace), _worker_run(**spec))
    assert resp.status_code == 422, resp.text
    message = resp.json()["message"]
    assert field in message and hint in message, message
    assert kube.get(Kube.wr_path(namespace, "bad")).status_code == 404


def test_kubectl_talks_to_the_cluster(bin_dir: Path, namespace: str) -> None:
    out = subprocess.run(
        [str(bin_dir / "kubectl"), "--kubeconfig", os.environ["TETHER_TEST_KUBECONFIG"], "get", "serviceaccounts",
         "-n", namespace, "-o", "name"], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "serviceaccount/default"


@pytest.mark.local_cluster
def test_a_second_cluster_runs_side_by_side_and_leaves_nothing(kube: Kube, bin_dir: Path) -> None:
    import psutil

    from tether.devcluster.controlplane import LocalCluster

    with LocalCluster(bin_dir=bin_dir, with_kubelet=False) as second:
        assert second.server != kube.config.server
        with second.client() as client:
            assert client.get("/version").json()["gitVersion"].startswith("v1.36.")
            assert client.get("/api/v1/namespaces/default").status_code == 200
        pids = second.pids
        assert len(pids) == 4  # etcd, apiserver, controller manager, scheduler
        assert kube.get("/version").status_code == 200  # the shared one is undisturbed
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
