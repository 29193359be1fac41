"""The operator's leader election against the real API server: hand-over on release, and a
release that never touches a successor's Lease."""

from __future__ import annotations

import asyncio
import os

from tether.controller.leader import LeaderElector
from tether.kube import config as kubeconfig
from tether.kube.client import KubeClient
from testkit.kube import Kube

LEASE = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/leader"


def _elector(ns: str, identity: str) -> LeaderElector:
    kube = KubeClient(kubeconfig.load(os.environ["TETHER_TEST_KUBECONFIG"]))
    return LeaderElector(kube, ns, "leader", identity, lease_seconds=60, renew_deadline=40, retry_period=1)


def test_a_released_lease_is_taken_at_once(kube: Kube, namespace: str) -> None:
    async def scenario() -> None:
        a, b = _elector(namespace, "a"), _elector(namespace, "b")
        assert await a.try_acquire_or_renew() and a.is_leader
        assert not await b.try_acquire_or_renew()  # held for 60 s
        await a.release()
        assert not a.is_leader
        spec = kube.ok(kube.get(LEASE.format(ns=namespace)))["spec"]
        assert spec["holderIdentity"] == "" and spec["leaseDurationSeconds"] == 1
        assert await b.try_acquire_or_renew() and b.is_leader  # no wait for the 60 s
        spec = kube.ok(kube.get(LEASE.format(ns=namespace)))["spec"]
        assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
        await a.kube.close()
        await b.kube.close()

    asyncio.run(scenario())


def test_release_leaves_a_successors_lease_alone(kube: Kube, namespace: str) -> None:
    async def scenario() -> None:
        a = _elector(namespace, "a")
        assert await a.try_acquire_or_renew()
        # A successor took over (a lapsed while a stalled): the Lease names it now.
        body = kube.ok(kube.get(LEASE.format(ns=namespace)))
        body["spec"]["holderIdentity"] = "b"
        kube.ok(kube.put(LEASE.format(ns=namespace), body))
        await a.release()
        spec = kube.ok(kube.get(LEASE.format(ns=namespace)))["spec"]
        assert spec["holderIdentity"] == "b" and spec["leaseDurationSeconds"] == 60
        await a.kube.close()

    asyncio.run(scenario())
