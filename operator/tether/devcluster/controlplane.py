"""A real Kubernetes control plane on loopback: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and the process kubelet.

Binaries come from `hack/build-control-plane.sh` (built from Go modules and
cached) or from a directory named by TETHER_CONTROL_PLANE_BIN.

With `audit=True` the API server writes an audit log (JSON lines, one event per
completed request) to `audit_log`: full request and response bodies for every
write to Leases, WorkerRun status and WorkerBudget status, metadata for the rest
of Tether's resources and for pod creation and deletion. It is the independent
record the fault-trial oracle checks (testkit/audit.py reads it).
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from tether.devcluster import pki
from tether.kube import config as kubeconfig
from tether.devcluster.processes import free_port, spawn, terminate, wait_for
from tether.devcluster.kueue import LocalKueue, resolve_kueue
from tether.devcluster.realnode import (
    KUBERNETES_SERVICE_IP, REAL_NODE_NAME, SERVICE_CIDR, NodeNetwork, RealNode, resolve_images, resolve_node_binaries,
)

NODE_NAME = "tether-node-0"
KWOK_NODE_PREFIX = "kwok-node-"
KWOK_LABEL = "tether.dev/kwok"
KWOK_TAINT = "tether.dev/kwok"
# Room for a scale run's pods: kwok reports whatever the node object says.
KWOK_NODE_CAPACITY = {"cpu": "1000", "memory": "4Ti", "pods": "5000"}


def kwok_placement() -> dict[str, object]:
    """Pod spec fields that put a pod on a kwok node (and only there)."""
    return {"nodeSelector": {KWOK_LABEL: "true"},
            "tolerations": [{"key": KWOK_TAINT, "operator": "Exists", "effect": "NoSchedule"}]}

# What the audit log records. Writes that decide ownership carry their bodies; reads and
# everything that is not Tether's stay out, so logging costs little beyond the heartbeats.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    # One event per request, when it completed (and on a panic).
    "omitStages": ["RequestReceived", "ResponseStarted"],
    "omitManagedFields": True,
    "rules": [
        {"level": "None", "nonResourceURLs": ["*"]},
        # Node heartbeats.
        {"level": "None", "resources": [{"group": "coordination.k8s.io", "resources": ["leases"]}],
         "namespaces": ["kube-node-lease"]},
        {"level": "RequestResponse", "verbs": ["create", "update", "patch", "delete"],
         "resources": [{"group": "coordination.k8s.io", "resources": ["leases"]}]},
        {"level": "RequestResponse", "verbs": ["update", "patch"],
         "resources": [{"group": "tether.dev", "resources": ["workerruns/status", "workerbudgets/status"]}]},
        # A schedule's handled slots (lastScheduleTime, skips) and the runs it created, by name (the
        # fault trials' invariant 14: one run per slot, every slot accounted for).
        {"level": "RequestResponse", "verbs": ["update", "patch"],
         "resources": [{"group": "tether.dev", "resources": ["workerrunschedules/status"]}]},
        {"level": "Request", "verbs": ["create"], "resources": [{"group": "tether.dev", "resources": ["workerruns"]}]},
        # Who decided which gate (the fault trials' invariant 7 reads the approval as stored).
        {"level": "RequestResponse", "verbs": ["create"],
         "resources": [{"group": "tether.dev", "resources": ["workerrunapprovals"]}]},
        {"level": "Metadata", "resources": [{"group": "tether.dev"}]},
        {"level": "Metadata", "resources": [{"group": "coordination.k8s.io", "resources": ["leases"]}]},
        # A pod's creation with its UID and owner: which run a pod-bound token's worker belongs to.
        {"level": "RequestResponse", "verbs": ["create"], "resources": [{"group": "", "resources": ["pods"]}]},
        {"level": "Metadata", "verbs": ["delete"], "resources": [{"group": "", "resources": ["pods"]}]},
        # When a pod's kubelet says it ended (its phase): how long a queued run's quota was in use.
        {"level": "Request", "verbs": ["update", "patch"], "resources": [{"group": "", "resources": ["pods/status"]}]},
        {"level": "None"},
    ],
}


# kube-controller-manager for the test suite: all on-by-default controllers but those of workloads,
# volumes, quotas, Services' endpoints and certificates, which no test uses and which watch (the
# quota controller and the endpoint controllers) or resync on their own. Kept: the garbage collector,
# namespaces, ServiceAccounts and their tokens, the root CA ConfigMap, node lifecycle and taint
# eviction, pod GC, cluster role aggregation, ServiceCIDRs, the admission policies' status, the Job
# controller (the scale smoke test launches Jobs beside runs, as the benchmark's anchor), and
# Deployments and ReplicaSets (the chart's operator, which `helm install --wait` waits for), and
# CronJobs (a WorkerRunSchedule's slots are compared with a CronJob's side by side).
TEST_CONTROLLERS = ",".join(["*"] + [f"-{name}-controller" for name in (
    "statefulset", "daemonset", "ttl-after-finished",
    "horizontal-pod-autoscaler", "disruption", "replicationcontroller", "resourcequota", "endpoints",
    "endpointslice", "endpointslice-mirroring", "persistentvolume-binder", "persistentvolume-attach-detach",
    "persistentvolume-expander", "persistentvolume-protection", "persistentvolumeclaim-protection",
    "ephemeral-volume", "ttl", "certificatesigningrequest-signing", "certificatesigningrequest-approving",
    "certificatesigningrequest-cleaner", "legacy-serviceaccount-token-cleaner", "storageversion-garbage-collector",
    "resourceclaim")])


def repo_root() -> Path | None:
    """The source checkout, when running from one (the build script lives there)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "hack" / "build-control-plane.sh").exists():
            return parent
    return None


def _build(script: str, what: str, *args: str) -> Path:
    root = repo_root()
    if root is None:
        raise RuntimeError(f"no {what}: run from a source checkout (hack/{script} builds it)")
    out = subprocess.run(["bash", str(root / "hack" / script), *args], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def resolve_kwok() -> Path:
    """The kwok binary (fake nodes for scale runs), built from Go modules and cached if needed."""
    explicit = os.environ.get("TETHER_KWOK")
    return Path(explicit) if explicit else _build("build-kwok.sh", "kwok binary") / "kwok"


def resolve_binaries(oldest: bool = False) -> Path:
    """Returns the binary directory, building the control plane if needed; `oldest`: the oldest
    supported Kubernetes (hack/versions.env KUBERNETES_OLDEST_VERSION)."""
    if oldest:
        explicit = os.environ.get("TETHER_OLDEST_CONTROL_PLANE_BIN")
        return Path(explicit) if explicit else _build("build-control-plane.sh", "oldest control plane", "--oldest")
    explicit = os.environ.get("TETHER_CONTROL_PLANE_BIN") or os.environ.get("KUBEBUILDER_ASSETS")
    if explicit:
        return Path(explicit)
    if repo_root() is None:
        raise RuntimeError(
            "no control-plane binaries: set TETHER_CONTROL_PLANE_BIN to a directory with "
            "etcd, kube-apiserver, kube-controller-manager and kube-scheduler"
        )
    return _build("build-control-plane.sh", "control-plane binaries")


@dataclass
class LocalCluster:
    """Starts and stops one control plane. Use as a context manager."""

    bin_dir: Path
    state_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="tether-cluster-")))
    with_kubelet: bool = True
    # Fake nodes played by kwok (pods on them reach Running without processes): scale runs.
    kwok_nodes: int = 0
    keep_state: bool = False
    # A real kubelet + containerd node (realnode.py) beside the process kubelet; pods go there
    # only when they ask (realnode.real_node_placement).
    real_node: bool = False
    node: RealNode | None = None
    # Kueue's manager (kueue.py) with its CRDs and loopback webhooks, for queued runs.
    with_kueue: bool = False
    kueue: LocalKueue | None = None
    # Write the API server's audit log (see AUDIT_POLICY) to `audit_log`.
    audit: bool = False
    # Only the controllers Tether's tests rely on (TEST_CONTROLLERS); else all of them, as a user's
    # cluster has (the demo, the benchmarks' Job controller anchor).
    lean: bool = False
    audit_log: Path | None = None
    server: str = ""
    kubeconfig: Path = Path()
    startup_seconds: float = 0.0
    _procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    # --- lifecycle -------------------------------------------------------

    def __enter__(self) -> "LocalCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        began = time.monotonic()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = self.state_dir / "logs"
        self.log_dir.mkdir(exist_ok=True)
        pki_dir = self.state_dir / "pki"
        pki_dir.mkdir(exist_ok=True)
        ca = pki.CertificateAuthority(pki_dir)
        self.ca = ca.pair
        if self.real_node:
            # Built (or found in the cache) first; the node's subnet is claimed now, as the API
            # server's certificate must name the address the node reaches it at.
            self.node = RealNode(state_dir=self.state_dir / "node", bin_dir=resolve_node_binaries(_build),
                                 images=resolve_images(_build), network=NodeNetwork.pick(), log_dir=self.log_dir)
        serving = ca.issue("apiserver", "kube-apiserver", server=True,
                           ips=(KUBERNETES_SERVICE_IP, *([self.node.network.host_ip] if self.node else [])))
        self.admin = ca.issue("admin", "tether-admin", ("system:masters",))
        # How the API server authenticates to kubelets (logs, exec).
        kubelet_client = ca.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", ("system:masters",))
        sa_key = pki.write_service_account_key(pki_dir / "sa.key")

        etcd_url = self._start_etcd()
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        audit_flags: list[str] = []
        if self.audit:
            policy = self.state_dir / "audit-policy.yaml"
            policy.write_text(yaml.safe_dump(AUDIT_POLICY))
            self.audit_log = self.state_dir / "audit" / "audit.log"
            audit_flags = [
                f"--audit-policy-file={policy}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                # One growing file: 0 turns rotation off, so readers never lose events to a rename.
                "--audit-log-maxsize=0",
                # Each event is written as its request completes, with no batching delay: a
                # reader that saw a response finds its event after a short poll.
                "--audit-log-mode=blocking",
            ]
        self._spawn("kube-apiserver", [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={pki_dir}",
            f"--tls-cert-file={serving.cert}",
            f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={self.ca.cert}",
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={sa_key}",
            f"--service-account-signing-key-file={sa_key}",
            "--api-audiences=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--kubelet-client-certificate={kubelet_client.cert}",
            f"--kubelet-client-key={kubelet_client.key}",
            "--kubelet-preferred-address-types=InternalIP",
            # The "kubernetes" Service endpoints would point at loopback, which
            # the endpoint reconciler refuses; nothing here needs them.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true",
            # TETHER_APISERVER_PROFILING=1: /debug/pprof for the admin (where a test run's CPU goes).
            f"--profiling={'true' if os.environ.get('TETHER_APISERVER_PROFILING') == '1' else 'false'}",
            "--v=1",
            *audit_flags,
        ])
        self.kubeconfig = self.write_kubeconfig(self.state_dir / "kubeconfig", self.admin, "tether-admin")
        wait_for(self._ready, timeout=120, what="kube-apiserver /readyz")

        kcm = ca.issue("kube-controller-manager", "system:kube-controller-manager")
        kcm_cfg = self.write_kubeconfig(self.state_dir / "kcm.kubeconfig", kcm, "kcm")
        self._spawn("kube-controller-manager", [
            str(self.bin_dir / "kube-controller-manager"),
            f"--kubeconfig={kcm_cfg}",
            f"--authentication-kubeconfig={kcm_cfg}",
            f"--authorization-kubeconfig={kcm_cfg}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            f"--cert-dir={pki_dir / 'kcm'}",
            f"--controllers={TEST_CONTROLLERS if self.lean else '*'}",
            "--use-service-account-credentials=true",
            f"--root-ca-file={self.ca.cert}",
            f"--service-account-private-key-file={sa_key}",
            "--cluster-cidr=10.1.0.0/16",
            "--v=1",
        ])
        sched = ca.issue("kube-scheduler", "system:kube-scheduler")
        sched_cfg = self.write_kubeconfig(self.state_dir / "scheduler.kubeconfig", sched, "scheduler")
        self._spawn("kube-scheduler", [
            str(self.bin_dir / "kube-scheduler"),
            f"--kubeconfig={sched_cfg}",
            f"--authentication-kubeconfig={sched_cfg}",
            f"--authorization-kubeconfig={sched_cfg}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            f"--cert-dir={pki_dir / 'scheduler'}",
            "--v=1",
        ])
        if self.with_kubelet:
            # Its containerLogs endpoint, for `kubectl logs`: the API server calls it with kubelet_client.
            kubelet_serving = ca.issue("process-kubelet", f"system:node:{NODE_NAME}", server=True)
            self._spawn("process-kubelet", [
                sys.executable, "-m", "tether.devcluster.kubelet",
                f"--kubeconfig={self.kubeconfig}",
                f"--node-name={NODE_NAME}",
                f"--work-dir={self.state_dir / 'pods'}",
                f"--serving-cert={kubelet_serving.cert}", f"--serving-key={kubelet_serving.key}",
                f"--client-ca={self.ca.cert}",
            ])
        if self.kwok_nodes:
            self._start_kwok()
        if self.node is not None:
            self.node.start(self.ca, ca, self.write_kubeconfig, self.server)
        # The cluster is usable once the controller manager mints service
        # accounts (pods need them) and, with a kubelet, the node is Ready.
        wait_for(lambda: self._get("/api/v1/namespaces/default/serviceaccounts/default").status_code == 200,
                 timeout=120, what="the default service account (kube-controller-manager)")
        if self.with_kubelet:
            wait_for(lambda: self._node_ready(NODE_NAME), timeout=60, what=f"node {NODE_NAME} Ready")
        if self.node is not None:
            wait_for(lambda: self.node.check_alive() is None and self._node_ready(REAL_NODE_NAME),  # type: ignore[union-attr]
                     timeout=120, what=f"real node {REAL_NODE_NAME} Ready")
        for name in (f"{KWOK_NODE_PREFIX}{i}" for i in range(self.kwok_nodes)):
            wait_for(lambda n=name: self._node_ready(n), timeout=60, what=f"kwok node {name} Ready")
        if self.with_kueue:
            self.kueue = LocalKueue(home=resolve_kueue(_build), state_dir=self.state_dir / "kueue", log_dir=self.log_dir,
                                    kubeconfig=self.kubeconfig, ca=self.ca, client=self.client)
            self.kueue.install()
            self.kueue.start()
        self.startup_seconds = time.monotonic() - began

    def stop(self) -> None:
        if self.kueue is not None:
            self.kueue.stop()
            self.kueue = None
        if self.node is not None:
            self.node.stop()
            self.node = None
        for _, proc in reversed(self._procs):
            terminate(proc)
        self._procs.clear()
        if not self.keep_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        """Process ids of the running components."""
        return [proc.pid for _, proc in self._procs]

    def check_alive(self) -> None:
        for name, proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.log_dir / name}.log")

    # --- helpers ---------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        self._procs.append((name, spawn(argv, log_path=self.log_dir / f"{name}.log")))

    def _start_etcd(self) -> str:
        client, peer = free_port(), free_port()
        client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        self._spawn("etcd", [
            str(self.bin_dir / "etcd"),
            "--name=tether",
            f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=tether={peer_url}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ])
        wait_for(lambda: httpx.get(f"{client_url}/health", timeout=2).status_code == 200,
                 timeout=60, what="etcd /health")
        return client_url

    def client(self, timeout: float = 10.0) -> httpx.Client:
        """An admin (system:masters) client."""
        return kubeconfig.from_kubeconfig(self.kubeconfig).sync_client(timeout=timeout)

    def _get(self, path: str) -> httpx.Response:
        self.check_alive()
        with self.client(timeout=5) as c:
            return c.get(path)

    def _ready(self) -> bool:
        return self._get("/readyz").status_code == 200

    def _start_kwok(self) -> None:
        """kwok plays the nodes labelled KWOK_LABEL and every pod bound to them (its default fast
        stages: Running at once, gone once deleted). The nodes are tainted, so only pods that
        tolerate KWOK_TAINT (see kwok_placement) land there, never the process kubelet's."""
        kwok = resolve_kwok()
        self._spawn("kwok", [
            str(kwok), f"--kubeconfig={self.kubeconfig}", f"--config={kwok.parent / 'stages.yaml'}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-label-selector={KWOK_LABEL}=true", "--cidr=10.2.0.0/16",
            "--node-lease-duration-seconds=40",
        ])
        with self.client() as c:
            for i in range(self.kwok_nodes):
                name = f"{KWOK_NODE_PREFIX}{i}"
                c.post("/api/v1/nodes", json={
                    "apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "labels": {KWOK_LABEL: "true", "kubernetes.io/hostname": name,
                                                          "kubernetes.io/os": "linux", "type": "kwok"},
                                 "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
                    "spec": {"taints": [{"key": KWOK_TAINT, "value": "true", "effect": "NoSchedule"}]},
                    "status": {"allocatable": KWOK_NODE_CAPACITY, "capacity": KWOK_NODE_CAPACITY},
                }).raise_for_status()

    def _node_ready(self, name: str) -> bool:
        resp = self._get(f"/api/v1/nodes/{name}")
        if resp.status_code != 200:
            return False
        conds = resp.json().get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def write_kubeconfig(self, path: Path, creds: pki.CertPair, user: str, server: str | None = None) -> Path:
        b64 = lambda data: base64.b64encode(data).decode()  # noqa: E731
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "tether-dev", "cluster": {
                "server": server or self.server,
                "certificate-authority-data": b64(self.ca.cert_pem()),
            }}],
            "users": [{"name": user, "user": {
                "client-certificate-data": b64(creds.cert_pem()),
                "client-key-data": b64(creds.key_pem()),
            }}],
            "contexts": [{"name": "tether-dev", "context": {"cluster": "tether-dev", "user": user}}],
            "current-context": "tether-dev",
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path
