"""Shared setup for benchmarks: a local control plane, the CRDs, an operator subprocess."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import httpx

from tether.devcluster.controlplane import LocalCluster, resolve_binaries
from tether.devcluster.crds import install_crds, install_policies
from tether.devcluster.processes import free_port, spawn, terminate, wait_for


@contextlib.contextmanager
def cluster_with_operator(namespace: str, gateway: bool = False) -> Iterator[tuple[LocalCluster, httpx.Client, str]]:
    """Yields (cluster, admin client, gateway URL or "")."""
    with LocalCluster(bin_dir=resolve_binaries(), with_kubelet=False) as cluster:
        client = cluster.client(timeout=30)
        install_crds(client)
        install_policies(client)
        client.post("/api/v1/namespaces", json={"metadata": {"name": namespace}}).raise_for_status()
        wait_for(lambda: client.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default").status_code == 200,
                 timeout=60, what="namespace")
        port = free_port()
        args = [sys.executable, "-m", "tether.cli", "operator", "-n", namespace]
        if gateway:
            args += [f"--gateway-port={port}", "--gateway-host=127.0.0.1"]
        log = Path(tempfile.mkdtemp(prefix="tether-bench-")) / "operator.log"
        op = spawn(args, log_path=log, env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})
        url = f"http://127.0.0.1:{port}" if gateway else ""
        try:
            if gateway:
                wait_for(lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200, timeout=60,
                         what="gateway")
            yield cluster, client, url
        finally:
            terminate(op)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]
