"""`tether dev demo` (what `make demo` runs): the main job on a local cluster.

Starts the control plane, installs the CRDs, runs the operator, applies the
examples, freezes one worker mid-run so that its lease lapses, and prints the
timeline: attempt 1 lost -> attempt 2 with a higher fence -> succeeded.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tether.devcluster.controlplane import LocalCluster, repo_root, resolve_binaries
from tether.devcluster.crds import install_crds, install_policies
from tether.devcluster.processes import spawn, terminate, wait_for

NS = "demo"
RUNS = "/apis/tether.dev/v1alpha1/namespaces/demo/workerruns"


def _say(msg: str) -> None:
    print(msg, flush=True)


def _status(client: httpx.Client, name: str) -> dict[str, Any]:
    resp = client.get(f"{RUNS}/{name}")
    resp.raise_for_status()
    return resp.json().get("status") or {}


def _hms(ts: str | None) -> str:
    return ts[11:19] if ts else "--:--:--"


def timeline(client: httpx.Client, name: str) -> list[str]:
    s = _status(client, name)
    lines = [f"{name}: {s.get('phase')} (fence {s.get('fence')})"]
    for a in s.get("attempts", []):
        lines.append(f"  {_hms(a.get('startedAt'))}  attempt {a['attempt']} granted to {a.get('holder')} "
                     f"with fence {a['fence']}")
        if a.get("endedAt"):
            extra = f", exit code {a['exitCode']}" if a.get("exitCode") is not None else ""
            lines.append(f"  {_hms(a.get('endedAt'))}  attempt {a['attempt']} ended: {a.get('outcome')}{extra}"
                         f" - {a.get('message', '')}")
    if s.get("checkpoint"):
        lines.append(f"  last checkpoint: {s['checkpoint']['cursor']}")
    if s.get("result") is not None:
        lines.append(f"  result: {s['result']}")
    return lines


# What the demo changes in an example so that it tells its story in seconds, and says it did.
SHORTENED = {"long-job.yaml": {"steps": 12, "stepSeconds": 1}}


def examples(root: Path) -> list[tuple[dict[str, Any], str]]:
    """The examples the demo applies, each with what it says of it (a shortened one says so)."""
    out = []
    for example in ("short-job.yaml", "long-job.yaml", "crashing-job.yaml"):
        body = yaml.safe_load((root / "examples" / example).read_text())
        said = f"==> applied examples/{example}"
        if example in SHORTENED:
            was, body["spec"]["payload"] = body["spec"].get("payload"), SHORTENED[example]
            said += f", shortened for the demo: payload {json.dumps(SHORTENED[example])} (the file says {json.dumps(was)})"
        out.append((body, said))
    return out


def ending(kubeconfig: Path, bin_dir: Path, keep: bool) -> list[str]:
    """The demo's last words: how to explore its cluster, only when the cluster stays (a
    non-interactive demo removes it, and its kubeconfig with it, as it returns)."""
    if not keep:
        return ["", "The cluster is stopped and its state removed. For one that stays, run `make demo` in a terminal,",
                "or `make cluster` (docs/development.md)."]
    return ["", "==> explore with kubectl:",
            f"    export KUBECONFIG={kubeconfig}",
            f"    export PATH={bin_dir}:$PATH",
            f"    kubectl get workerruns -n {NS} -o wide",
            f"    kubectl describe wr long-job -n {NS}",
            f"    kubectl get leases,pods -n {NS}",
            "    kubectl explain workerrun.spec.lease",
            f"    kubectl apply -n {NS} -f examples/long-job.yaml   # (delete it first to run it again)",
            "", "The cluster keeps running; Ctrl-C stops it and removes its state."]


def run_demo(keep: bool) -> int:
    root = repo_root()
    if root is None:
        _say("the demo runs from a source checkout (it uses examples/)")
        return 1
    bin_dir = resolve_binaries()
    state = root / ".tether" / "demo"
    if state.exists():
        import shutil

        shutil.rmtree(state)
    state.mkdir(parents=True, exist_ok=True)
    _say("==> starting a local control plane (etcd, kube-apiserver, controller-manager, scheduler, process kubelet)")
    with LocalCluster(bin_dir=bin_dir, state_dir=state) as cluster:
        client = cluster.client(timeout=30)
        install_crds(client)
        install_policies(client)
        _say(f"    up in {cluster.startup_seconds:.1f}s; CRDs installed")
        op_log = root / ".tether" / "demo-operator.log"
        op_log.unlink(missing_ok=True)
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        operator = spawn([sys.executable, "-m", "tether.cli", "operator"], log_path=op_log, env=env)
        _say(f"==> operator running (log: {op_log})")
        client.post("/api/v1/namespaces", json={"metadata": {"name": NS}})
        wait_for(lambda: client.get(f"/api/v1/namespaces/{NS}/serviceaccounts/default").status_code == 200,
                 timeout=60, what="namespace demo")
        for body, said in examples(root):
            client.post(RUNS, json=body).raise_for_status()
            _say(said)

        lease = "/apis/coordination.k8s.io/v1/namespaces/demo/leases/long-job"
        wait_for(lambda: int(((client.get(lease).json().get("metadata") or {}).get("annotations") or {})
                             .get("tether.dev/checkpoint", "0")) >= 3,
                 timeout=90, what="long-job checkpoint 3")
        pod = client.get(f"/api/v1/namespaces/{NS}/pods/long-job-a1").json()
        pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))
        os.kill(pid, signal.SIGSTOP)
        _say(f"==> froze long-job's worker (pid {pid}, SIGSTOP) mid-run: it stops renewing its lease")
        began = time.monotonic()
        wait_for(lambda: _status(client, "long-job").get("attempt", 0) >= 2, timeout=60, what="attempt 2")
        _say(f"    the operator declared the lease lost and granted attempt 2 after {time.monotonic() - began:.1f}s")
        for name in ("short-job", "crashing-job", "long-job"):
            wait_for(lambda n=name: _status(client, n).get("phase") in ("Succeeded", "Failed", "Lost"),
                     timeout=120, what=f"{name} finished")
        try:
            os.kill(pid, signal.SIGCONT)  # if it is still there, it wakes up too late to do harm
        except ProcessLookupError:
            pass  # the kubelet already killed it when the operator deleted its pod
        _say("\n==> timelines")
        for name in ("short-job", "crashing-job", "long-job"):
            _say("\n".join(timeline(client, name)))
        _say("\n".join(ending(cluster.kubeconfig, bin_dir, keep)))
        if keep:
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass
        terminate(operator)
    return 0


def main(argv: list[str] | None = None) -> int:
    keep = sys.stdin.isatty() and os.environ.get("TETHER_DEMO_KEEP", "1") != "0"
    return run_demo(keep)


if __name__ == "__main__":
    sys.exit(main())


