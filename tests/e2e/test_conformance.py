"""A subset of the conformance kit (conformance/, `make conformance` runs all of it) for each
SDK's conformance worker: the happy path over both transports, the two partition scenarios, a
publication answered after T (waited for, not resent), and
the branches of conformance/branches.py (short cells: the payload read from the run, in-cluster
credentials, 401s and a rotated token, a refused claim, the receiver's InProgress and StaleFence,
a result too large (413; at 1.6 and 2.25 MiB the size policy's 413, etcd's 500 without it), malformed signals).
Each cell has its own namespace, operator, receiver and proxies on the shared cluster."""

from __future__ import annotations

import pytest

from conformance.harness import GATEWAY, POD, Cluster
from conformance.run import Cell, run_cell
from conformance.branches import ALL as SCENARIOS, BRANCHES
from conformance.sdks import WORKERS

SUBSET = [("happy", POD), ("happy", GATEWAY), ("partition", POD), ("revoked-while-reconnecting", POD),
          ("yield", POD), ("yield", GATEWAY), ("spawn", POD), ("spawn", GATEWAY), ("slow-publication", POD), *((s.name, t) for s in BRANCHES for t in s.transports)]
# Each cell's worker is a process of this machine (the process kubelet runs its pod as one), and
# each cell starts its own operator: the local control plane's, not a kind cluster's.
pytestmark = pytest.mark.local_cluster
# The yield queues through the session's Kueue: on the Kueue tests' worker (one of them stops it).
CELLS = [pytest.param(s, t, id=f"{s}-{t}", marks=[pytest.mark.xdist_group("kueue")] if s == "yield" else [])
         for s, t in SUBSET]


@pytest.mark.parametrize("sdk", sorted(WORKERS))
@pytest.mark.parametrize(("scenario", "transport"), CELLS)
def test_conformance(sdk: str, scenario: str, transport: str) -> None:
    worker = WORKERS[sdk]
    worker.build()
    cell = run_cell(Cluster.from_env(), Cell(worker, next(s for s in SCENARIOS if s.name == scenario), transport))
    assert cell.passed, f"{sdk} · {scenario} ({transport}): {cell.reason} (logs in {cell.workdir})"
