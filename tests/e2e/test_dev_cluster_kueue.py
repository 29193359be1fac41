"""`make cluster KUEUE=1` / `tether dev cluster --kueue`: the local cluster with Kueue's manager, as
docs/queues.md says, so the queue examples work there: the queues are admitted by Kueue's webhooks
and become active under its manager."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_quickstart import _stop_group
from testkit.kube import Kube, eventually

pytestmark = pytest.mark.local_cluster  # a control plane and a Kueue manager of its own
ROOT = Path(__file__).resolve().parents[2]


def _exports(out: Path) -> dict[str, str] | None:
    lines = out.read_text().splitlines() if out.exists() else []
    if not any(line.startswith("# Kueue's manager runs") for line in lines):
        return None
    return dict(line.removeprefix("export ").split("=", 1) for line in lines if line.startswith("export KUBECONFIG="))


def test_the_local_cluster_starts_kueue_when_asked(tmp_path: Path) -> None:
    out = tmp_path / "cluster.env"
    with out.open("wb") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "tether.cli", "dev", "cluster", "--kueue", "--state-dir",
                                 str(tmp_path / "state")], stdout=stdout, stderr=subprocess.STDOUT,
                                start_new_session=True, env=os.environ.copy())
    try:
        def up() -> dict[str, str] | None:
            if proc.poll() is not None:  # (not an assertion: eventually would keep waiting)
                raise RuntimeError(f"tether dev cluster --kueue exited:\n{out.read_text()}")
            return _exports(out)

        env = eventually(up, timeout=300, what="the local cluster with Kueue (its manager built once, cached)")
        kube = Kube(env["KUBECONFIG"])
        applied = subprocess.run([str(Path(os.environ["TETHER_TEST_BIN_DIR"]) / "kubectl"), "apply", "-f",
                                  str(ROOT / "examples" / "queues" / "tenancy.yaml")], env={**os.environ, **env},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        assert applied.returncode == 0, applied.stdout

        def active() -> bool:
            queue = kube.get("/apis/kueue.x-k8s.io/v1beta2/clusterqueues/team-a").json()
            return any(c["type"] == "Active" and c["status"] == "True" for c in queue.get("status", {}).get("conditions", []))

        eventually(active, timeout=60, what="ClusterQueue team-a active under the local Kueue manager")
    finally:
        _stop_group(proc)
        proc.wait(timeout=30)
