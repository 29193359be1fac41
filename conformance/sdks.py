"""The workers the kit knows how to build: one conformance worker per SDK (conformance/WORKER.md).
Any other worker is given as a command line (`--worker name=command...`)."""

from __future__ import annotations

import fcntl
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / ".tether" / "conformance"


@dataclass(frozen=True)
class Worker:
    name: str
    argv: list[str]
    build_steps: list[tuple[list[str], Path]] = field(default_factory=list)  # (command, cwd)

    def build(self) -> None:
        """Builds the worker once per process; concurrent callers (pytest workers) wait."""
        if not self.build_steps or self.name in _BUILT:
            return
        BUILD.mkdir(parents=True, exist_ok=True)
        with open(BUILD / f"{self.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for argv, cwd in self.build_steps:
                env = {**os.environ, "GOTOOLCHAIN": "local"}
                done = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"building the {self.name} worker: {shlex.join(argv)} failed:\n{done.stdout[-3000:]}")
        _BUILT.add(self.name)


_BUILT: set[str] = set()
TS = ROOT / "sdk" / "typescript"
GO = ROOT / "sdk" / "go"

WORKERS: dict[str, Worker] = {
    "python": Worker("python", [sys.executable, "-m", "tether.worker.conformance"]),
    # The same SDK's asyncio flavour (tether.worker.aio): its own worker, judged on its own.
    "python-async": Worker("python-async", [sys.executable, "-m", "tether.worker.aio_conformance"]),
    # The same install stamp as the Makefile's: npm ci only when the lock file changed.
    "typescript": Worker("typescript", ["node", str(TS / "dist" / "conformance-worker.js")],
                         [(["sh", "-c", "test node_modules/.installed -nt package-lock.json || "
                                        "{ npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.installed; }"], TS),
                          (["npm", "run", "build"], TS)]),
    "go": Worker("go", [str(BUILD / "go-conformance-worker")],
                 [(["go", "build", "-o", str(BUILD / "go-conformance-worker"), "./cmd/conformance-worker"], GO)]),
}


def parse_worker(spec: str) -> Worker:
    """`name` of a known SDK, or `name=command line` for any other worker."""
    if "=" in spec:
        name, command = spec.split("=", 1)
        return Worker(name, shlex.split(command))
    if spec not in WORKERS:
        raise SystemExit(f"unknown worker {spec!r}: one of {', '.join(WORKERS)}, or name=command")
    return WORKERS[spec]
