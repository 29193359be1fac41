"""Child processes that cannot outlive their parent.

Each child gets its own process group (so teardown can signal everything it
spawned) and PR_SET_PDEATHSIG=SIGKILL, so even a `kill -9` of the parent
leaves nothing running.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO, Mapping, Sequence

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn(
    argv: Sequence[str],
    log_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdout: int | IO[bytes] | None = None,
) -> subprocess.Popen[bytes]:
    out: int | IO[bytes] | None = stdout
    if log_path is not None:
        out = open(log_path, "ab")
    try:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    finally:
        if log_path is not None and hasattr(out, "close"):
            out.close()  # type: ignore[union-attr]


def terminate(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """SIGTERM the child's process group, then SIGKILL it after `grace`."""
    if proc.poll() is not None:
        _kill_group(proc.pid, signal.SIGKILL)
        return
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):  # type: ignore[no-untyped-def]
    """Polls `predicate` until it returns a truthy value or `timeout` passes."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - reported on timeout
            last_error = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}" + (f": {last_error}" if last_error else ""))
