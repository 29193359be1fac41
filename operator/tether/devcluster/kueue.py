"""Kueue on the local control plane: its manager (built from Go modules by hack/build-kueue.sh),
its own CRDs, and its webhooks served on loopback with a certificate of the cluster's CA.

Kueue's configuration registers WorkerRun as an external framework, so Kueue knows the pods a
WorkerRun owns are queued through their run and never queues them a second time. Of the built-in
integrations only batch/job is on (the benchmark queues Jobs beside runs); the webhooks installed
are the ones the enabled parts serve, each pointing at the manager's loopback address.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import yaml

from tether.devcluster import pki
from tether.devcluster.crds import create_or_replace, install_crds
from tether.devcluster.processes import free_port, spawn, terminate, wait_for

NAMESPACE = "kueue-system"
# Without its internal certificate management, Kueue's manager loads a metrics certificate from this
# fixed path (cmd/kueue/main.go) even with its metrics server off, and exits if there is none.
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
EXTERNAL_FRAMEWORK = "WorkerRun.v1alpha1.tether.dev"
# The webhooks of the parts this configuration enables (others would answer 404: refused writes).
_SERVED_GROUPS = {"kueue.x-k8s.io", "batch"}
_WEBHOOK_COLLECTIONS = {
    "MutatingWebhookConfiguration": "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
    "ValidatingWebhookConfiguration": "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations",
}


def configuration(webhook_port: int, cert_dir: Path, health_port: int) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for the local cluster."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        # Certificates come from the cluster's CA (below); Kueue's own rotation wants a Service.
        "internalCertManagement": {"enable": False},
        "leaderElection": {"leaderElect": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [EXTERNAL_FRAMEWORK]},
        # The visibility API server wants a fixed port and an APIService; PriorityBoost is how Tether
        # ranks victims by unsaved work.
        "featureGates": {"VisibilityOnDemand": False, "PriorityBoost": True},
        # Fair sharing between the ClusterQueues of a cohort (tests/kueue shares a pool by it).
        "fairSharing": {"preemptionStrategies": ["LessThanOrEqualToFinalShare", "LessThanInitialShare"]},
    }


def webhook_configurations(manifests: str, url: str, ca_bundle: bytes) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, kept to the served groups and pointed at `url` (loopback).
    Jobs reach Kueue's webhooks only when labelled for a queue: a Job of another test (or of the
    benchmark's unqueued half) is never refused because Kueue is down or restarting."""
    out = []
    for doc in yaml.safe_load_all(manifests):
        if not doc:
            continue
        hooks = []
        for hook in doc.get("webhooks") or []:
            groups = {g for rule in hook.get("rules") or [] for g in rule.get("apiGroups") or []}
            if not groups or not groups <= _SERVED_GROUPS:
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook = {**hook, "clientConfig": {"url": f"{url}{path}", "caBundle": base64.b64encode(ca_bundle).decode()}}
            if groups == {"batch"}:
                hook["objectSelector"] = {"matchExpressions": [{"key": "kueue.x-k8s.io/queue-name",
                                                                "operator": "Exists"}]}
            hooks.append(hook)
        name = f"kueue-{doc['metadata']['name']}"
        out.append({"apiVersion": doc["apiVersion"], "kind": doc["kind"], "metadata": {"name": name},
                    "webhooks": hooks})
    return out


def resolve_kueue(build: Callable[[str, str], Path]) -> Path:
    """The directory with the kueue binary, its CRDs and webhooks (TETHER_KUEUE overrides)."""
    explicit = os.environ.get("TETHER_KUEUE")
    return Path(explicit) if explicit else build("build-kueue.sh", "kueue")


@dataclass
class LocalKueue:
    """Kueue's manager as a child process of the test cluster; `restart()` for outage tests."""

    home: Path
    state_dir: Path
    log_dir: Path
    kubeconfig: Path
    ca: pki.CertPair
    client: Callable[[], httpx.Client]
    webhook_port: int = field(default_factory=free_port)
    health_port: int = field(default_factory=free_port)
    _proc: subprocess.Popen[bytes] | None = None

    def install(self) -> None:
        """CRDs, namespace, certificates, configuration and webhooks: everything but the process."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        certs = self.state_dir / "certs"
        certs.mkdir(exist_ok=True)
        # Named tls.crt / tls.key: what controller-runtime's webhook server reads from certDir.
        pki.CertificateAuthority.load(self.ca, certs).issue("tls", "kueue-webhook", server=True)
        if not (METRICS_CERT_DIR / "tls.crt").exists():
            # Any certificate will do: the metrics server is off (bindAddress "0").
            try:
                METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
                pki.CertificateAuthority.load(self.ca, METRICS_CERT_DIR).issue("tls", "kueue-metrics", server=True)
            except PermissionError as exc:
                raise RuntimeError(f"Kueue's manager needs a certificate at {METRICS_CERT_DIR} (run as root, "
                                   "or create it)") from exc
        self.config = self.state_dir / "config.yaml"
        self.config.write_text(yaml.safe_dump(configuration(self.webhook_port, certs, self.health_port)))
        with self.client() as c:
            install_crds(c, self.home / "crds", timeout=120)
            resp = c.post("/api/v1/namespaces", json={"metadata": {"name": NAMESPACE}})
            if resp.status_code not in (201, 409):
                raise RuntimeError(f"creating {NAMESPACE}: {resp.status_code} {resp.text}")
            for obj in webhook_configurations((self.home / "webhooks.yaml").read_text(),
                                              f"https://127.0.0.1:{self.webhook_port}", self.ca.cert_pem()):
                create_or_replace(c, _WEBHOOK_COLLECTIONS[obj["kind"]], obj)

    def argv(self) -> list[str]:
        return [str(self.home / "kueue"), f"--config={self.config}", "--zap-log-level=info"]

    def start(self, timeout: float = 120) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        self._proc = spawn(self.argv(), log_path=self.log_dir / "kueue.log", env=env)
        wait_for(self.ready, timeout=timeout, what=f"kueue ready (see {self.log_dir / 'kueue.log'})")

    def stop(self) -> None:
        if self._proc is not None:
            terminate(self._proc)
            self._proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def ready(self) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError(f"kueue exited; see {self.log_dir / 'kueue.log'}")
        if httpx.get(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2).status_code != 200:
            return False
        # Ready once its webhooks answer the API server: a dry-run create goes through both.
        with self.client() as c:
            resp = c.post("/apis/kueue.x-k8s.io/v1beta2/resourceflavors?dryRun=All",
                          json={"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                                "metadata": {"name": "readiness-probe"}})
            return resp.status_code == 201

    def describe(self) -> dict[str, str]:
        """What a test needs to stop the manager and start it again (tests/kueue)."""
        return {"home": str(self.home), "log": str(self.log_dir / "kueue.log"),
                "pid": str(self._proc.pid if self._proc else ""), "argv": json.dumps(self.argv()),
                "kubeconfig": str(self.kubeconfig), "health": f"http://127.0.0.1:{self.health_port}/readyz"}
