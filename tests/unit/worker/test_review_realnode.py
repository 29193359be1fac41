"""Adversarial review of c75f60b (real node, signals, late exit codes): each test pins one defect.

They are written against the promise (docstrings, docs/protocol.md §4.2, realnode's module
docstring), not the code: they fail while the defect is there. None of them starts a cluster,
runs `ip`/`iptables`, or sends a signal to anything but this process (with a handler installed)
or a child it started itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from tether.api.models import Signals, Usage
from tether.devcluster import realnode
from tether.devcluster.realnode import NodeNetwork, RealNode
from tether.worker import WorkerRun
from tether.worker.transport import Renewal

# --- operator signals (cli.py) -------------------------------------------------


def test_until_stopped_a_stop_that_came_first_wins() -> None:
    """`_until_stopped`: "Runs `work` unless `stopping` is set first". SIGTERM that lands while the
    leadership request completes (both done when asyncio.wait returns) must not be dropped: today
    task.done() is checked first, the stop is ignored, and the replica goes on to lead."""
    from tether.cli import _until_stopped

    async def main() -> bool:
        stopping = asyncio.Event()

        async def acquire() -> None:
            stopping.set()  # the signal arrives before the Lease write's answer is read

        return await _until_stopped(acquire(), stopping)

    assert asyncio.run(main()) is False


def test_sigterm_right_after_leadership_stops_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM between `elector.acquire()` returning and kopf installing its own handlers sets the
    `stopping` event, which nothing reads after that: kopf runs until SIGKILL, and the Lease is
    never handed over. kopf must be told (stop_flag=stopping) or not started at all."""
    import kopf

    from tether import cli, gcpause
    from tether.controller import leader
    from tether.kube import client as kube_client
    from tether.kube import config as kubeconfig

    seen: dict[str, Any] = {}

    class Elector:
        def __init__(self, *_: Any, **__: Any) -> None:
            self.is_leader = False

        async def acquire(self) -> None:
            # The operator's own loop.add_signal_handler(SIGTERM, ...) is installed by now.
            os.kill(os.getpid(), signal.SIGTERM)
            self.is_leader = True

        async def hold(self) -> None:
            await asyncio.Event().wait()

        async def release(self) -> None:
            seen["released"] = True

    async def operator(**kw: Any) -> None:
        seen["kopf"] = kw
        flag = kw.get("stop_flag")
        waiter: Any = asyncio.Event().wait() if flag is None else (
            flag.wait() if isinstance(flag, asyncio.Event) else asyncio.shield(flag))
        try:
            await asyncio.wait_for(waiter, 2.0)  # the real kopf would stop on the flag at once
            seen["stopped"] = True
        except asyncio.TimeoutError:
            seen["stopped"] = False  # it would run until the pod's grace period ends: SIGKILL

    monkeypatch.setattr(kopf, "operator", operator)
    monkeypatch.setattr(leader, "LeaderElector", Elector)
    monkeypatch.setattr(kube_client, "KubeClient", lambda *a, **kw: object())
    monkeypatch.setattr(kubeconfig, "load", lambda: types.SimpleNamespace(namespace="tether-system"))
    monkeypatch.setattr(gcpause, "install", lambda: None)
    args = argparse.Namespace(metrics_port=0, gateway_port=0, leader_elect=True, leader_election_namespace="ns",
                              leader_election_id="tether-operator-leader", leader_lease_seconds=15.0,
                              kube_qps=1.0, kube_burst=1, max_concurrent_reconciles=1, event_qps=1.0,
                              worker_identity="namespace", attempt_history=100, namespace=[], liveness=None)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert asyncio.run(cli._run_operator(args)) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "kopf" not in seen or seen["stopped"], "SIGTERM was lost: kopf ran on without any stop"


# --- the Python SDK's __exit__ (worker/run.py) ---------------------------------


class _Recording:
    def __init__(self) -> None:
        self.publications: list[tuple[str, dict[str, Any]]] = []

    def renew(self, checkpoint: str | None, usage: Usage | None, requests: Any = None) -> Renewal:
        return Renewal(ok=True, signals=Signals())

    def publish(self, field: str, value: dict[str, Any]) -> bool:
        self.publications.append((field, value))
        return True

    def recorded(self, field: str, value: dict[str, Any]) -> bool:
        return False

    def close(self) -> None:
        pass


def test_a_program_that_calls_sys_exit_with_an_error_inside_the_run_still_fails_it() -> None:
    """Only SIGTERM's SystemExit is "not the job failing" (docs/protocol.md §4.2). A program's own
    `sys.exit(2)` inside `with WorkerRun(...)` published WorkerFailed before c75f60b; now nothing is
    published, and an External run (no pod exit code to look at) waits a lease duration and ends
    LeaseLost. `_raise_terminated` could raise a SystemExit subclass that `__exit__` alone excuses."""
    t = _Recording()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            with WorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=60,
                           renew_interval=3600, transport=t, monotonic=lambda: 0.0):
                sys.exit(2)
    finally:
        signal.signal(signal.SIGTERM, previous)  # start() installed the SDK's handler in this process
    assert [field for field, _ in t.publications] == ["error"]


# --- the real node (devcluster/realnode.py) --------------------------------------


def test_teardown_kills_only_its_own_nodes_shims(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`_kill_node_processes` matches the bytes of run_dir in every /proc/*/cmdline, with no
    separator: tearing down node 1 SIGKILLs the shims of nodes 10-19 and 100-199 (their
    `-address /run/tether-node-1X/containerd.sock`) of another cluster running at the same time."""
    index = 7919  # run_dir /run/tether-node-7919: nothing on this machine is under it
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                              f"/run/tether-node-{index}0/containerd.sock"])  # node 79190's "shim"
    killed: list[int] = []

    def kill(pid: int, sig: int) -> None:
        killed.append(pid)
        if pid == other.pid:  # only ever our own child; reaped, so /proc/<pid> goes
            other.kill()
            other.wait()

    monkeypatch.setattr(realnode, "os", types.SimpleNamespace(kill=kill, getpid=os.getpid))
    node = RealNode(state_dir=tmp_path, bin_dir=tmp_path, images={}, network=NodeNetwork(index), log_dir=tmp_path)
    try:
        node._kill_node_processes()  # noqa: SLF001
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    assert other.pid not in killed, "a process of node 79190 was killed by node 7919's teardown"


def test_pick_does_not_take_a_subnet_another_cluster_is_setting_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A starting cluster adds 198.18.N.1 seconds after it picked N (etcd and the API server come
    first); its netns tether-node-N exists from the start. A second cluster must not pick N too
    (create() once deleted that netns and veth first)."""
    index = 7

    def run(*argv: str) -> str:
        if argv == ("ip", "netns", "add", f"tether-node-{index}"):
            # What `ip netns add` does when the namespace exists: the other cluster claimed it.
            raise subprocess.CalledProcessError(1, argv, "", f'Cannot create namespace file "/run/netns/tether-node-{index}"')
        return ""  # the other cluster has not added its address or routes yet

    monkeypatch.setattr(realnode, "_run", run)
    monkeypatch.setattr(realnode, "os", types.SimpleNamespace(getpid=lambda: index, environ=os.environ))
    assert NodeNetwork.pick().index != index
