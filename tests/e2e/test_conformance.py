"""A subset of the conformance kit (conformance/, `make conformance` runs all of it) for each
SDK's conformance worker: the happy path over both transports, and the two partition scenarios.
Each cell has its own namespace, operator, receiver and proxies on the shared cluster."""

from __future__ import annotations

import pytest

from conformance.harness import GATEWAY, POD, Cluster
from conformance.run import Cell, run_cell
from conformance.scenarios import SCENARIOS
from conformance.sdks import WORKERS

SUBSET = [("happy", POD), ("happy", GATEWAY), ("partition", POD), ("revoked-while-reconnecting", POD)]


@pytest.mark.parametrize("sdk", sorted(WORKERS))
@pytest.mark.parametrize(("scenario", "transport"), SUBSET, ids=[f"{s}-{t}" for s, t in SUBSET])
def test_conformance(sdk: str, scenario: str, transport: str) -> None:
    worker = WORKERS[sdk]
    worker.build()
    cell = run_cell(Cluster.from_env(), Cell(worker, next(s for s in SCENARIOS if s.name == scenario), transport))
    assert cell.passed, f"{sdk} · {scenario} ({transport}): {cell.reason} (logs in {cell.workdir})"
