"""The operator as a subprocess (tests kill it), and helpers to read its JSON log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tether.devcluster.processes import spawn, terminate


class OperatorProcess:
    def __init__(self, namespace: str, kubeconfig: str, log_path: Path, extra_env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.extra_args = extra_args or []
        self.namespace = namespace
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.extra_env = extra_env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> "OperatorProcess":
        env = {**os.environ, "KUBECONFIG": self.kubeconfig, **self.extra_env}
        # TETHER_TEST_OPERATOR_SRC: run another build of the operator (e.g. an older commit's
        # operator/ folder) under the same tests, to show a test fails without a fix.
        if os.environ.get("TETHER_TEST_OPERATOR_SRC"):
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ["TETHER_TEST_OPERATOR_SRC"],
                                                               env.get("PYTHONPATH")]))
        self.proc = spawn([sys.executable, "-m", "tether.cli", "operator", "-n", self.namespace, *self.extra_args],
                          log_path=self.log_path, env=env)
        self.starts += 1
        return self

    def kill(self) -> None:
        """kill -9: no cleanup, no goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, grace=5)

    def restart(self) -> None:
        self.kill()
        self.start()

    def logs(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def events(self, name: str) -> list[dict[str, Any]]:
        return [entry for entry in self.logs() if entry.get("event") == name]
