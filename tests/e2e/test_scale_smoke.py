"""The scale harness at smoke size, on the shared cluster's kwok nodes: `make bench` must not rot.

A few dozen pod-backed runs launched beside Jobs (kwok marks the pods Running), then played by
the simulated fleet (the SDK's own transport) with a couple of workers frozen mid-window. What
is asserted is what the full benchmark reports, judged from the API server's objects and its
own request counters — at this size as exact facts, not speeds."""

from __future__ import annotations

import datetime as dt
import os
import uuid
from pathlib import Path

import pytest

from benchmarks import scale
from testkit.audit import AuditLog

pytestmark = pytest.mark.local_cluster

LEASE, RENEW = 12, 3


def test_launch_and_steady_state_on_kwok_with_the_simulated_fleet() -> None:
    env = scale.existing(Path(os.environ["TETHER_TEST_KUBECONFIG"]), qps=50, burst=100,
                         prefix=f"smoke-{uuid.uuid4().hex[:5]}-")
    launched = scale.launch(env, 10, None, "tether")
    for kind in ("tether", "jobs"):
        assert launched[kind]["createToPod"]["n"] == 10 and launched[kind]["createToRunning"]["n"] == 10
        assert launched[kind]["createToPod"]["p50"] <= launched[kind]["createToRunning"]["p50"]

    audit = AuditLog.from_env(from_end=True)
    pop = scale.Population(env, "steady", LEASE, RENEW)
    try:
        pop.grow(20)
        result = pop.measure(window=2 * LEASE + 2 * RENEW + 6, lapses=2, seed=7)
    finally:
        pop.close()
    start, end = (dt.datetime.fromtimestamp(t, dt.timezone.utc) for t in result["window"])
    writes = [r for r in audit.read() if r.object_ref is not None and r.object_ref.namespace == pop.ns
              and r.accepted and r.is_write and not r.dry_run and start <= r.received <= end]
    # Every frozen worker's attempt was ended LeaseLost, about one lease after its last renewal,
    # and nobody else was.
    lapses = result["lapseDetectionSeconds"]
    assert result["lapsesSampled"] == 2 and lapses["n"] == 2, result
    assert LEASE - 1 <= lapses["max"] <= LEASE + 2 * RENEW, lapses
    assert result["falseLost"] == 0, result["falseLostRuns"]
    # A heartbeat is one Lease write and no WorkerRun write: the audit log's writes in the namespace
    # over the window against the fleet's renewals, apart from what the two lapses cost (a revocation
    # and a re-grant each: Lease clear and grant; status revoke, grant, Running).
    lease_writes = sum(1 for r in writes if r.object_ref.resource == "leases")
    run_writes = sum(1 for r in writes if r.object_ref.resource == "workerruns")
    renewals = result["renewals"]
    assert renewals >= 20 * (result["windowSeconds"] // RENEW - 4), result  # the fleet kept renewing
    assert 0.95 * renewals <= lease_writes <= 1.05 * renewals + 2 * 2 + 2, (lease_writes, renewals)
    assert run_writes <= 2 * 4, [(r.verb, r.object_ref.name, r.object_ref.subresource) for r in writes
                                 if r.object_ref.resource == "workerruns"]
    assert result["operatorRssMiBPeak"] > 0 and result["watchLagSeconds"]["p50"] is not None


def test_a_burst_of_external_runs_is_granted_and_what_each_grant_writes_is_counted() -> None:
    """The burst scenario at smoke size: External runs created at once, every one granted, and the
    writes each grant cost in its namespace, from the audit log (on the shared cluster the API
    server's own counters include other tests): the status and the Lease, the run's finalizer, the
    grant's Event — and nothing per run beside them (no account: it is made at the first claim)."""
    env = scale.existing(Path(os.environ["TETHER_TEST_KUBECONFIG"]), qps=50, burst=100,
                         prefix=f"smoke-{uuid.uuid4().hex[:5]}-")
    audit = AuditLog.from_env(from_end=True)
    n = 20
    result = scale.burst(env, n, timeout=120)
    assert result["createToGranted"]["n"] == n and result["allGrantedSeconds"] > 0, result
    start, end = (dt.datetime.fromtimestamp(t, dt.timezone.utc) for t in result["window"])
    # The window closes once every grant's Lease is written too (the status comes first).
    writes = [r for r in audit.read() if r.object_ref is not None and r.object_ref.namespace == result["namespace"]
              and r.accepted and r.is_write and not r.dry_run and start <= r.received <= end]
    per: dict[str, int] = {}
    for r in writes:
        key = f"{r.verb} {r.object_ref.resource}{'/' + r.object_ref.subresource if r.object_ref.subresource else ''}"
        per[key] = per.get(key, 0) + 1
    per.pop("create workerruns", None)  # the benchmark's own
    assert per.get("create leases") == n, per  # one Lease per grant
    assert n <= per.get("update workerruns/status", 0) + per.get("patch workerruns/status", 0) <= 2 * n, per
    # Beside the status, the Lease, the finalizer and the grant's Event: what else each grant writes.
    usual = {"create leases", "update workerruns/status", "patch workerruns/status", "update workerruns",
             "patch workerruns", "create events", "patch events"}
    assert sum(v for k, v in per.items() if k not in usual) <= IDENTITY_WRITES_PER_GRANT * n, per
    assert sum(per.values()) / n <= WRITES_PER_GRANT, per


# Writes per External grant (docs/benchmarks.md, the burst): its status, its Lease, the run's
# finalizer and the grant's Event (4; 7 before the run's account moved to its first claim).
IDENTITY_WRITES_PER_GRANT = 0  # an External run's account is made at its first claim (none here)
WRITES_PER_GRANT = 4.5
