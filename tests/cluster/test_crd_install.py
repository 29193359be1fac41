"""The WorkerRun CRD carries the pod template's schema (issue 34): generated from the API server's
own OpenAPI, and still installable as docs/install.md says (helm install, kubectl create, kubectl
apply --server-side; a client-side kubectl apply cannot hold it)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.kube import Kube, eventually

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "workerruns.tether.dev.yaml"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/workerruns.tether.dev"
# etcd's default request limit is 1.5 MiB: the stored CRD, managedFields and all, stays well below it.
STORED_LIMIT = 1024 * 1024


def test_the_template_schema_is_what_this_api_server_serves(kube: Kube) -> None:
    """hack/template_schema.py --check: the committed schema is the one generated from the pod
    template's OpenAPI of the Kubernetes version it names (after a version bump, regenerate)."""
    generated_from = re.search(r"from kube-apiserver (v\S+)", CRD.read_text())
    assert generated_from, "the generator's marker names the kube-apiserver version"
    server = kube.ok(kube.get("/version"))["gitVersion"]
    if server != generated_from.group(1):
        pytest.skip(f"generated from {generated_from.group(1)}, this API server is {server}")
    check = subprocess.run([sys.executable, str(ROOT / "hack" / "template_schema.py"), "--check",
                            "--kubeconfig", kube.kubeconfig_path], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.fixture
def bare_cluster(bin_dir: Path, tmp_path: Path) -> Iterator[Kube]:
    """A control plane without Tether's CRDs (the shared one has them), as a user's cluster is."""
    from tether.devcluster.controlplane import LocalCluster

    with LocalCluster(bin_dir=bin_dir, state_dir=tmp_path / "cluster", with_kubelet=False) as cluster:
        yield Kube(str(cluster.kubeconfig))


def test_the_crd_installs_by_helm_and_server_side_apply_not_client_side_apply(bare_cluster: Kube, bin_dir: Path,
                                                                             tools_dir: Path) -> None:
    kube, config = bare_cluster, ["--kubeconfig", bare_cluster.kubeconfig_path]
    # The README's install: helm creates the chart's CRDs (crds/, never templated nor upgraded).
    install = subprocess.run([str(tools_dir / "helm"), "install", "tether", str(ROOT / "charts" / "tether"),
                              "--namespace", "tether-system", "--create-namespace", *config],
                             capture_output=True, text=True)
    assert install.returncode == 0, install.stderr

    def established() -> bool:
        crd = kube.get(CRD_PATH)
        return crd.status_code == 200 and any(
            c["type"] == "Established" and c["status"] == "True" for c in crd.json()["status"].get("conditions", []))

    eventually(established, timeout=60, what="the WorkerRun CRD established")
    kubectl = [str(bin_dir / "kubectl"), *config]
    # How docs/install.md upgrades the CRDs (helm does not): server-side apply.
    applied = subprocess.run([*kubectl, "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds")],
                             capture_output=True, text=True)
    assert applied.returncode == 0 and "workerruns.tether.dev serverside-applied" in applied.stdout, applied.stderr
    stored = len(json.dumps(kube.ok(kube.get(CRD_PATH))))
    assert stored < STORED_LIMIT, f"the stored CRD is {stored} bytes"
    # A client-side apply copies the whole CRD into an annotation, which may hold 256 KiB: refused.
    client_side = subprocess.run([*kubectl, "apply", "-f", str(CRD)], capture_output=True, text=True)
    assert client_side.returncode == 1 and "Too long: may not be more than 262144 bytes" in client_side.stderr, \
        client_side.stderr
    # What the API server serves is the pod's schema: kubectl explain reaches a container's image.
    explained = subprocess.run([*kubectl, "explain", "workerruns.spec.template.spec.containers.image"],
                               capture_output=True, text=True)
    assert explained.returncode == 0 and "Container image name" in explained.stdout, explained.stderr
