"""The chart on a kind cluster built here (hack/build-kind.sh, hack/e2e-kind.sh): what only a cluster
as users have one shows. kubeadm's control plane, CoreDNS, kube-proxy and Services, the image on the
node's containerd, two operator replicas behind leader election, a worker frozen on a real node.
`make e2e-kind` runs the whole e2e suite there; these are the part `make test` runs.

The chart comes from the release's artefacts, installed by docs/own-cluster.md's kind block as
written (hack/e2e-kind.sh runs it). TETHER_KIND_KUBECONFIG points them at a cluster that already has
it (as hack/e2e-kind.sh KIND_SETUP_ONLY=1 leaves one, with TETHER_KIND_RELEASE naming its dist/);
otherwise the module creates its own and deletes it afterwards."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.e2e.test_gateway import external_run, open_attempt
from tests.kueue.test_queues import _time, queued_run, tenancy
from testkit import runs
from testkit.kube import Kube, eventually, worker_identity

pytestmark = pytest.mark.xdist_group("kind")

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "tether-test"
SYSTEM = "tether-system"


@dataclass
class Kind:
    kube: Kube
    node: str  # the node's container, for `docker exec`
    image: str  # the release's example-worker image, loaded into the node
    release: Path  # the release's dist/ the chart was installed from

    def worker(self, body: dict[str, Any]) -> dict[str, Any]:
        return runs.use_test_image(body, self.image)


def _script(name: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(["bash", str(ROOT / "hack" / name)], cwd=ROOT, env={**os.environ, **(env or {})},
                         check=True, stdout=subprocess.PIPE, text=True)
    return out.stdout.strip().splitlines()[-1]


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


@pytest.fixture(scope="module")
def kind() -> Iterator[Kind]:
    image = _env_file(Path(_script("build-images.sh")) / "images.env")["EXAMPLE_IMAGE"]
    given = os.environ.get("TETHER_KIND_KUBECONFIG")
    if given:
        yield Kind(Kube(given), os.environ.get("TETHER_KIND_NODE", f"{CLUSTER}-control-plane"), image,
                   Path(os.environ["TETHER_KIND_RELEASE"]))
        return
    # A cluster of this process's own: two sessions on one machine must not delete each other's.
    name = f"{CLUSTER}-{os.getpid()}"
    kind_bin = Path(_script("build-kind.sh")) / "bin" / "kind"
    try:  # (the script deletes a cluster whose set-up failed; one killed meanwhile is deleted here)
        kubeconfig, _, release = _script("e2e-kind.sh", {"KIND_CLUSTER": name, "KIND_SETUP_ONLY": "1"}).split()
        yield Kind(Kube(kubeconfig), f"{name}-control-plane", image, Path(release))
    finally:
        subprocess.run([str(kind_bin), "delete", "cluster", "--name", name], check=False)
        # What the script keeps for this cluster in the cache (its release alone is 200 MB).
        kind_cache = kind_bin.parent.parent.parent
        for leftover in (f"{name}-release", f"{name}-audit"):
            shutil.rmtree(kind_cache / leftover, ignore_errors=True)
        (kind_cache / f"{name}.kubeconfig").unlink(missing_ok=True)


@pytest.fixture
def ns(kind: Kind) -> Iterator[str]:
    name = f"t-kind-{uuid.uuid4().hex[:6]}"
    kind.kube.ok(kind.kube.post("/api/v1/namespaces", {"metadata": {"name": name}}))
    eventually(lambda: kind.kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default").status_code == 200,
               timeout=60, what=f"default service account in {name}")
    yield name
    kind.kube.delete(f"/api/v1/namespaces/{name}")


def _leader(kube: Kube) -> tuple[str, int]:
    """The operator pod holding the leader Lease, and the Lease's transitions (once one holds it)."""
    def held() -> tuple[str, int] | None:
        resp = kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{SYSTEM}/leases/tether-operator-leader")
        spec = resp.json().get("spec") or {} if resp.status_code == 200 else {}
        holder = spec.get("holderIdentity") or ""
        pods = {p["metadata"]["name"] for p in _operator_pods(kube)}
        pod = next((p for p in pods if holder.startswith(p)), None)
        return (pod, int(spec.get("leaseTransitions") or 0)) if pod else None
    return eventually(held, timeout=120, what="an operator pod holding the leader Lease")


def _operator_pods(kube: Kube) -> list[dict[str, Any]]:
    pods = kube.ok(kube.get(f"/api/v1/namespaces/{SYSTEM}/pods",
                            params={"labelSelector": "app.kubernetes.io/name=tether"}))["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def _ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


def test_the_chart_runs_two_operator_replicas_one_of_them_leading(kind: Kind) -> None:
    pods = eventually(lambda: (p := _operator_pods(kind.kube)) and len(p) == 2 and all(map(_ready, p)) and p,
                      timeout=120, what="two ready operator pods")
    names = {p["metadata"]["name"] for p in pods}
    assert _leader(kind.kube)[0] in names
    crd = kind.kube.ok(kind.kube.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/workerruns.tether.dev"))
    assert any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"]["conditions"])


def _archive_digests(archive: Path) -> set[str]:
    """What a container runtime may report an image of this archive by: the archive's index (kind's
    import names it so), the manifest, or the config the manifest names."""
    with tarfile.open(archive) as tar:
        index = tar.extractfile("index.json").read()  # type: ignore[union-attr]
        manifest = json.loads(index)["manifests"][0]["digest"]
        config = json.load(tar.extractfile(f"blobs/sha256/{manifest[7:]}"))["config"]["digest"]  # type: ignore[arg-type]
    return {f"sha256:{hashlib.sha256(index).hexdigest()}", manifest, config}


def test_the_operator_runs_the_release_image_by_the_digest_the_packaged_chart_pins(kind: Kind) -> None:
    refs = dict(line.split("@") for line in (kind.release / "images.txt").read_text().split())
    (digest,) = [d for ref, d in refs.items() if ref.startswith("ghcr.io/tether-dev/tether:")]
    pods = eventually(lambda: (p := _operator_pods(kind.kube)) and all(map(_ready, p)) and p, timeout=120,
                      what="ready operator pods")
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["image"].endswith(f"@{digest}"), container["image"]
        (status,) = pod["status"]["containerStatuses"]
        # The image the kubelet found on the node (no registry is reachable here): one of the release's.
        loaded = set().union(*(_archive_digests(a) for a in (kind.release / "images").glob("*.oci.tar")))
        assert status["imageID"].rpartition("@")[2] in loaded, (status, loaded)


def test_a_run_succeeds_in_a_pod_on_the_kind_node(kind: Kind, ns: str) -> None:
    runs.create(kind.kube, ns, kind.worker(runs.example("short-job.yaml")))
    done = runs.wait_phase(kind.kube, ns, "short-job", ("Succeeded", "Failed"), timeout=180)
    assert done["status"]["phase"] == "Succeeded", done["status"]
    (attempt,) = done["status"]["attempts"]
    assert attempt["outcome"] == "Succeeded", attempt


def _container_pid(kind: Kind, ns: str, pod: str) -> int:
    """The worker's pid on the kind node, from the node's own CRI (crictl), not from Tether."""
    def find() -> int | None:
        try:
            return _running_pid(kind, ns, pod)
        except subprocess.CalledProcessError:
            return None  # (a crictl call that failed meanwhile is asked again)
    return int(eventually(find, timeout=60, what=f"{ns}/{pod}'s running container"))


def _running_pid(kind: Kind, ns: str, pod: str) -> int | None:
    ids = subprocess.run(["docker", "exec", kind.node, "crictl", "ps", "-q", "--namespace", ns, "--pod",
                          _pod_id(kind, ns, pod), "--state", "running"], check=True, stdout=subprocess.PIPE,
                         text=True).stdout.split()
    if not ids:
        return None
    info = subprocess.run(["docker", "exec", kind.node, "crictl", "inspect", "-o", "go-template",
                           "--template", "{{.info.pid}}", ids[0]], check=True, stdout=subprocess.PIPE, text=True)
    return int(info.stdout.strip())


def _pod_id(kind: Kind, ns: str, pod: str) -> str:
    out = subprocess.run(["docker", "exec", kind.node, "crictl", "pods", "-q", "--namespace", ns, "--name", pod],
                         check=True, stdout=subprocess.PIPE, text=True).stdout.split()
    return out[0] if out else "none"


def test_a_worker_frozen_on_the_node_is_lost_and_its_run_retried(kind: Kind, ns: str) -> None:
    """SIGSTOP to the worker's process on the node: its lease lapses, the attempt ends Lost, the
    next attempt runs to Succeeded, and the frozen one's pod is gone."""
    body = kind.worker(runs.example("short-job.yaml", payload={"steps": 20, "stepSeconds": 1},
                                    lease={"durationSeconds": 8, "renewIntervalSeconds": 1, "startupGraceSeconds": 60},
                                    retry={"maxAttempts": 3, "backoff": {"initialSeconds": 0}}))
    runs.create(kind.kube, ns, body, name="frozen")
    first = runs.wait_phase(kind.kube, ns, "frozen", "Running", timeout=120)["status"]
    pod = f"{first['holder']}"
    pid = _container_pid(kind, ns, pod)
    subprocess.run(["docker", "exec", kind.node, "kill", "-STOP", str(pid)], check=True)
    done = runs.wait_phase(kind.kube, ns, "frozen", ("Succeeded", "Failed"), timeout=180)["status"]
    assert done["phase"] == "Succeeded", done
    outcomes = [a["outcome"] for a in done["attempts"]]
    assert outcomes[0] == "LeaseLost" and outcomes[-1] == "Succeeded", outcomes
    eventually(lambda: kind.kube.get(f"/api/v1/namespaces/{ns}/pods/{pod}").status_code == 404, timeout=120,
               what=f"the frozen attempt's pod {pod} deleted")


_CLAIM_AND_COMPLETE = """
import json, os, sys, time, httpx
url = os.environ["GATEWAY"] + "/api/v1/namespaces/{ns}/workerruns/{run}/".format(ns=os.environ["NS"], run=os.environ["RUN"])
auth = {"Authorization": "Bearer " + os.environ["TOKEN"]}
for _ in range(60):
    claim = httpx.post(url + "claim", json={"workerId": "in-cluster"}, headers=auth, timeout=10)
    if claim.status_code == 200:
        break
    print("claim", claim.status_code, claim.text, flush=True)
    time.sleep(1)
claim.raise_for_status()
c = claim.json()
done = httpx.post(url + "complete", json={"holder": c["holder"], "fence": c["fence"], "result": {"via": "service"}},
                  headers=auth, timeout=10)
print("complete", done.status_code, done.text, flush=True)
sys.exit(0 if done.status_code == 200 else 1)
"""


def test_an_external_worker_in_the_cluster_reaches_the_gateway_through_its_service(kind: Kind, ns: str) -> None:
    """A pod calls the gateway by its Service's DNS name: CoreDNS answers, kube-proxy routes to a
    ready operator replica, and the claim and result go through the gateway's own checks."""
    token = worker_identity(kind.kube, ns, "ext")
    runs.create(kind.kube, ns, external_run("ext"))
    open_attempt(kind.kube, ns, "ext")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "external-worker"},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "worker", "image": kind.image, "imagePullPolicy": "Never",
               "command": ["python", "-c", _CLAIM_AND_COMPLETE],
               "env": [{"name": "GATEWAY", "value": f"http://tether-gateway.{SYSTEM}.svc.cluster.local:443"},
                       {"name": "NS", "value": ns}, {"name": "RUN", "value": "ext"},
                       {"name": "TOKEN", "value": token}]}]}}
    kind.kube.ok(kind.kube.post(f"/api/v1/namespaces/{ns}/pods", pod))
    done = runs.wait_phase(kind.kube, ns, "ext", ("Succeeded", "Failed"), timeout=180)["status"]
    assert done["phase"] == "Succeeded" and done["result"] == {"via": "service"}, done
    phase = eventually(lambda: (p := kind.kube.ok(kind.kube.get(f"/api/v1/namespaces/{ns}/pods/external-worker"))
                                ["status"].get("phase")) in ("Succeeded", "Failed") and p, timeout=60,
                       what="the external worker pod finished")
    assert phase == "Succeeded"


def test_when_the_leading_replica_dies_the_other_takes_over_and_runs_go_on(kind: Kind, ns: str) -> None:
    """The leader's pod deleted without grace: the other replica takes the leader Lease, and a run
    created meanwhile still runs to Succeeded."""
    eventually(lambda: len([p for p in _operator_pods(kind.kube) if _ready(p)]) == 2, timeout=120,
               what="two ready operator pods")
    pod, transitions = _leader(kind.kube)
    kind.kube.ok(kind.kube.delete(f"/api/v1/namespaces/{SYSTEM}/pods/{pod}", params={"gracePeriodSeconds": "0"}))
    runs.create(kind.kube, ns, kind.worker(runs.example("short-job.yaml")), name="after-failover")
    done = runs.wait_phase(kind.kube, ns, "after-failover", ("Succeeded", "Failed"), timeout=240)["status"]
    assert done["phase"] == "Succeeded", done
    now, later = _leader(kind.kube)
    assert now != pod and later > transitions, (pod, transitions, now, later)



def test_kueue_in_the_cluster_admits_queued_runs_one_at_a_time(kind: Kind, ns: str) -> None:
    """Kueue installed by its own chart (its webhooks behind its Service, its own certificates):
    with a quota of one run's CPU, a second run waits Queued until the first finishes. (A small
    request: the one node's 2 CPUs also hold the control plane's requests.)"""
    tenancy(kind.kube, ns, cpu="200m")
    runs.create(kind.kube, ns, kind.worker(queued_run(steps=60, cpu="200m")), name="first")  # 30 s
    runs.wait_phase(kind.kube, ns, "first", "Running", timeout=120)
    runs.create(kind.kube, ns, kind.worker(queued_run(steps=2, cpu="200m")), name="second")
    waiting = runs.wait_phase(kind.kube, ns, "second", "Queued", timeout=60)
    assert runs.condition(waiting, "Admitted") is not None and runs.condition(waiting, "Admitted")["reason"] == "Queued"
    done = {n: runs.wait_phase(kind.kube, ns, n, ("Succeeded", "Failed"), timeout=180)["status"] for n in ("first", "second")}
    assert all(d["phase"] == "Succeeded" for d in done.values()), done
    assert _time(done["first"]["attempts"][0]["endedAt"]) <= _time(done["second"]["attempts"][0]["startedAt"]), done


def test_a_claim_on_the_default_storage_class_is_provisioned_on_the_node(kind: Kind, ns: str) -> None:
    """kind's default storage (the local-path provisioner, its helper pod): a pod writes to a claim
    that names no class; the claim is bound to a volume the provisioner made on the node."""
    kind.kube.ok(kind.kube.post(f"/api/v1/namespaces/{ns}/persistentvolumeclaims", {
        "metadata": {"name": "scratch"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "16Mi"}}}}))
    kind.kube.ok(kind.kube.post(f"/api/v1/namespaces/{ns}/pods", {
        "metadata": {"name": "writer"},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "writer", "image": kind.image, "imagePullPolicy": "Never",
            "command": ["python", "-c", "open('/data/checkpoint', 'w').write('cycle 7')"],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
            "securityContext": {"runAsUser": 0},
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "scratch"}}]}}))
    phase = eventually(lambda: (p := kind.kube.ok(kind.kube.get(f"/api/v1/namespaces/{ns}/pods/writer"))
                                ["status"].get("phase")) in ("Succeeded", "Failed") and p, timeout=120,
                       what="the writer pod finished")
    assert phase == "Succeeded"
    claim = kind.kube.ok(kind.kube.get(f"/api/v1/namespaces/{ns}/persistentvolumeclaims/scratch"))
    assert claim["status"]["phase"] == "Bound" and claim["spec"]["storageClassName"] == "local-path", claim
    volume = kind.kube.ok(kind.kube.get(f"/api/v1/persistentvolumes/{claim['spec']['volumeName']}"))
    path = volume["spec"]["local"]["path"] if "local" in volume["spec"] else volume["spec"]["hostPath"]["path"]
    written = subprocess.run(["docker", "exec", kind.node, "cat", f"{path}/checkpoint"], check=True,
                             stdout=subprocess.PIPE, text=True).stdout
    assert written == "cycle 7"
