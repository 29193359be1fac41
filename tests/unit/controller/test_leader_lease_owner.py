"""The leader Lease is owned by the chart's ServiceAccount, so `helm uninstall` takes it along
(tests/cluster/test_chart.py sees it collected); a Lease from before, or from an earlier install
whose account was recreated, gets the current owner on the next write."""

from __future__ import annotations

import pytest

from tether.controller.leader import LeaderElector

pytestmark = pytest.mark.unit
OWNER = {"apiVersion": "v1", "kind": "ServiceAccount", "name": "tether", "uid": "u-2"}


def _elector(owner: dict | None) -> LeaderElector:
    return LeaderElector(None, "tether-system", "tether-operator-leader", "pod-a_1", owner=owner)  # type: ignore[arg-type]


def _lease(owners: list[dict] | None) -> dict:
    meta: dict = {"name": "tether-operator-leader", "namespace": "tether-system", "resourceVersion": "7"}
    if owners is not None:
        meta["ownerReferences"] = owners
    return {"metadata": meta, "spec": {"holderIdentity": "pod-b_2", "leaseTransitions": 3}}


@pytest.mark.parametrize(("owners", "expected"), [
    (None, [OWNER]),
    ([OWNER], [OWNER]),
    ([{**OWNER, "uid": "u-1"}], [OWNER]),  # the account of an earlier install
    ([{"apiVersion": "apps/v1", "kind": "Deployment", "name": "x", "uid": "d"}],
     [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "x", "uid": "d"}, OWNER]),
])
def test_an_existing_lease_gets_the_current_owner(owners: list[dict] | None, expected: list[dict]) -> None:
    body = _elector(OWNER)._body(_lease(owners), 4)
    assert body["metadata"]["ownerReferences"] == expected
    assert body["metadata"]["resourceVersion"] == "7" and body["spec"]["holderIdentity"] == "pod-a_1"


def test_a_new_lease_is_created_owned() -> None:
    assert _elector(OWNER)._body(None, 0)["metadata"]["ownerReferences"] == [OWNER]


def test_outside_a_cluster_the_lease_has_no_owner() -> None:
    assert "ownerReferences" not in _elector(None)._body(None, 0)["metadata"]
    assert "ownerReferences" not in _elector(None)._body(_lease(None), 1)["metadata"]


class _Leases:
    """Enough of the client for one Lease that can be deleted under the elector (its owner deleted)."""

    def __init__(self) -> None:
        self.lease: dict | None = None
        self.created = 0

    async def get_lease(self, ns: str, name: str) -> dict | None:
        return self.lease

    async def create_lease(self, body: dict) -> dict:
        self.created += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.created)}}
        return self.lease

    async def replace_lease(self, body: dict) -> dict:
        self.lease = body
        return body


def test_a_lease_deleted_while_held_ends_the_leadership_instead_of_being_made_again() -> None:
    import asyncio

    leases = _Leases()
    elector = LeaderElector(leases, "tether-system", "tether-operator-leader", "pod-a_1", owner=OWNER)  # type: ignore[arg-type]
    assert asyncio.run(elector.try_acquire_or_renew()) and elector.is_leader and leases.created == 1
    leases.lease = None  # garbage-collected with the ServiceAccount: a new install's replica may lead now
    assert not asyncio.run(elector.try_acquire_or_renew())
    assert not elector.is_leader and leases.created == 1
