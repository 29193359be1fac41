"""The sync Python worker SDK's waits are bounded as the asyncio flavour's are (defect 10): an exec
credential plugin that hangs is killed after EXEC_TIMEOUT (with whatever it started) and the request
fails, and a renewal waits at most T for the renewal lock, so complete() and fail() raise or return
in bounded time instead of hanging for ever."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tether.api.models import Signals, Usage
from tether.kube import config as kubeconfig
from tether.worker import OwnershipUnknown, WorkerRun
from tether.worker.ops import request_timeout
from tether.worker.transport import Renewal

BOUND = 1.0  # EXEC_TIMEOUT for these tests (120 s otherwise)

# Its first run gives a token that has already expired, so every request runs it again; every later
# run starts a child of its own (as a shell-script plugin's commands are), records both pids, and
# hangs (an SSO prompt nobody answers).
PLUGIN = """
import json, pathlib, subprocess, sys, time
runs = pathlib.Path(sys.argv[1])
if not runs.exists():
    runs.write_text("")
    print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                      "status": {"token": "first", "expirationTimestamp": "2000-01-01T00:00:00Z"}}))
    sys.exit(0)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
with runs.open("a") as f:
    f.write(f"{__import__('os').getpid()} {child.pid}\\n")
time.sleep(3600)
"""


def _hanging_plugin_kubeconfig(tmp_path: Path) -> tuple[Path, Path]:
    script, runs = tmp_path / "plugin.py", tmp_path / "plugin-runs"
    script.write_text(PLUGIN)
    user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
                     "args": [str(script), str(runs)], "interactiveMode": "Never"}}
    path = tmp_path / "kubeconfig"
    # Never reached: every request stops at its credentials.
    path.write_text(yaml.safe_dump({
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}], "current-context": "x"}))
    return path, runs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie no one reaped yet (an orphan's, in a container without init) has ended
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _pids(runs: Path) -> list[int]:
    return [int(pid) for pid in runs.read_text().split()]


def _end_plugins(runs: Path, thread: threading.Thread) -> None:
    """Where nothing bounds them: kills the plugins this test started, each run the SDK starts
    after the last one was killed too, until it gives up."""
    ended: set[int] = set()
    for _ in range(100):
        for pid in set(_pids(runs)) - ended:
            os.kill(pid, signal.SIGKILL)
            ended.add(pid)
        thread.join(0.2)
        if not thread.is_alive():
            return


@pytest.mark.parametrize("publish", ["complete", "fail"])
def test_a_hung_exec_plugin_is_killed_and_complete_or_fail_raise_in_bounded_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, publish: str) -> None:
    monkeypatch.setattr(kubeconfig, "EXEC_TIMEOUT", BOUND)
    path, runs = _hanging_plugin_kubeconfig(tmp_path)
    run = WorkerRun(kube=kubeconfig.load(path), name="job", namespace="ns", holder="job-a1", fence=1, attempt=1,
                    lease_duration=60, renew_interval=1)
    raised: list[BaseException] = []

    def publishing() -> None:
        try:
            run.complete({"ok": True}) if publish == "complete" else run.fail("Boom", "it broke")
        except BaseException as exc:  # noqa: BLE001 - what it raised is the point
            raised.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=publishing, daemon=True)
    thread.start()
    # Two credential waits: the renewal before publishing, then the publication's one try (never
    # confirmed, ownership is unknown at its first failure).
    thread.join(2 * BOUND + 8)
    elapsed = time.monotonic() - started
    hung = thread.is_alive()
    if hung:
        _end_plugins(runs, thread)
    assert not hung, f"{publish}() still blocked after {elapsed:.1f}s on a hung exec plugin"
    assert elapsed < 2 * BOUND + 4
    assert len(raised) == 1 and isinstance(raised[0], OwnershipUnknown), raised
    assert f"the exec plugin did not answer within {BOUND:g}s" in str(raised[0])
    pids = _pids(runs)
    assert len(pids) == 4  # two runs of the plugin, each with its child
    deadline = time.monotonic() + 5  # a killed process takes a moment to go
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids if _alive(pid)] == [], "the hung plugin (or its child) was left running"
    run.stop()


class StuckRenewal:
    """A transport whose first renewal does not answer until `release` (a hung exec plugin, say)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.published: list[tuple[str, Any]] = []

    def renew(self, checkpoint: str | None, usage: Usage | None, requests: Any = None) -> Renewal:
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(30)
        return Renewal(ok=True, signals=Signals())

    def publish(self, field: str, value: dict[str, Any]) -> bool:
        self.published.append((field, value))
        return True

    def recorded(self, field: str, value: dict[str, Any]) -> bool:
        return False

    def close(self) -> None:
        pass


def test_complete_waits_at_most_t_for_a_renewal_stuck_holding_the_lock() -> None:
    """The heartbeat's renewal hangs holding the renewal lock: complete()'s renewal before publishing
    gives up after T (as the asyncio flavour's does) and the result is published."""
    t = StuckRenewal()
    run = WorkerRun(transport=t, name="job", namespace="ns", holder="job-a1", fence=1, attempt=1,
                    lease_duration=60, renew_interval=1)
    heartbeat = threading.Thread(target=run.renew, daemon=True)
    heartbeat.start()
    assert t.entered.wait(10)
    done = threading.Event()
    started = time.monotonic()
    publishing = threading.Thread(target=lambda: (run.complete({"ok": True}), done.set()), daemon=True)
    publishing.start()
    try:
        assert done.wait(request_timeout(run.renew_interval) + 3), "complete() waited on the stuck renewal's lock"
        assert time.monotonic() - started >= request_timeout(run.renew_interval)  # it did wait for it, T
        assert t.published == [("result", {"ok": True})]
    finally:
        t.release.set()
        heartbeat.join(10)
        publishing.join(10)
