"""One cell of the matrix: a scenario, a worker, a transport — passed, or failed with a reason."""

from __future__ import annotations

import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.harness import Case, Cluster, Fail
from conformance.scenarios import Scenario
from conformance.sdks import BUILD, Worker


@dataclass
class Cell:
    worker: Worker
    scenario: Scenario
    transport: str
    passed: bool = False
    reason: str = ""
    seconds: float = 0.0
    workdir: Path = field(default_factory=lambda: BUILD / "cases" / uuid.uuid4().hex[:8])

    def record(self) -> dict[str, Any]:
        return {"worker": self.worker.name, "scenario": self.scenario.name, "transport": self.transport,
                "passed": self.passed, "reason": self.reason, "seconds": round(self.seconds, 1),
                "workdir": str(self.workdir)}


def run_cell(cluster: Cluster, cell: Cell) -> Cell:
    started = time.monotonic()
    try:
        with Case(cluster, cell.worker.argv, cell.transport, cell.workdir, sdk=cell.worker.name,
                  operator_behind_proxy=cell.scenario.operator_behind_proxy) as case:
            cell.reason = cell.scenario.fn(case)
            cell.passed = True
    except Fail as exc:
        cell.reason = str(exc)
    except Exception as exc:  # noqa: BLE001 - a broken case fails its cell, with the traceback kept
        cell.reason = f"harness error: {exc!r}"
        (cell.workdir / "traceback.txt").write_text(traceback.format_exc())
    cell.seconds = time.monotonic() - started
    if not cell.passed:
        cell.reason += _log_tails(cell.workdir)
    print(f"{'pass' if cell.passed else 'FAIL'} {cell.worker.name:<10} {cell.scenario.name} ({cell.transport}) "
          f"{cell.seconds:.0f}s: {cell.reason}", flush=True)
    return cell


def _log_tails(workdir: Path, lines: int = 8) -> str:
    """The end of each worker's log: a CI run keeps the failure message, not the case's folder."""
    tails = []
    for log in sorted(workdir.glob("worker-*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"\n--- {log.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "".join(tails)
