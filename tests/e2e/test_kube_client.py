"""The operator's API client against the real API server, at the races its compare-and-swap
writes exist for."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from tether.api import constants as c
from tether.kube import config as kubeconfig
from tether.kube.client import Conflict, KubeClient
from testkit.kube import Kube

pytestmark = pytest.mark.local_cluster

OTHER = "example.com/other-controller"


class FinalizerMovesAfterRead(KubeClient):
    """Another controller drops its finalizer right after our read: the index we read is stale."""

    def __init__(self, kube: Kube) -> None:
        super().__init__(kubeconfig.load(os.environ["TETHER_TEST_KUBECONFIG"]))
        self.test_kube = kube
        self.reads = 0

    async def get_pod(self, ns: str, name: str) -> dict[str, Any] | None:
        pod = await super().get_pod(ns, name)
        self.reads += 1
        if self.reads == 1:
            self.test_kube.ok(self.test_kube.patch(
                f"/api/v1/namespaces/{ns}/pods/{name}",
                [{"op": "remove", "path": "/metadata/finalizers/0"}], kind="json"))
        return pod


def test_finalizer_release_after_a_concurrent_change_is_a_conflict_not_a_bug(kube: Kube, namespace: str) -> None:
    pods = f"/api/v1/namespaces/{namespace}/pods"
    kube.ok(kube.post(pods, {
        "metadata": {"name": "p", "finalizers": [OTHER, c.POD_FINALIZER]},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]}}))

    async def go() -> dict[str, Any] | None:
        client = FinalizerMovesAfterRead(kube)
        try:
            with pytest.raises(Conflict):
                await client.remove_finalizer(namespace, "p", c.POD_FINALIZER)
            # The patch's `test` refused the stale index: nothing else was removed, ours is still there.
            assert kube.ok(kube.get(f"{pods}/p"))["metadata"]["finalizers"] == [c.POD_FINALIZER]
            return await client.remove_finalizer(namespace, "p", c.POD_FINALIZER)  # a fresh read: it goes
        finally:
            await client.close()

    released = asyncio.run(go())
    assert released is not None and not released["metadata"].get("finalizers")
    assert not kube.ok(kube.get(f"{pods}/p"))["metadata"].get("finalizers")
