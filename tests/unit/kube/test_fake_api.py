"""The unit tests' one fake API (testkit/fakeapi.py) answers the operator's real client as the
API server does where safety rests on it: compare-and-swap, preconditions, the status subresource,
finalizers holding a deletion, a JSON patch's test, selectors."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tether.kube.client import Conflict, Invalid, NotFound
from tether.kube.paths import lease_path, pod_path, run_path
from testkit.fakeapi import FakeApi


def _run() -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
            "metadata": {"name": "job", "namespace": "ns", "labels": {"team": "a"}}, "spec": {"x": 1}, "status": {}}


def test_a_status_write_is_a_compare_and_swap_on_the_resource_version() -> None:
    async def go() -> None:
        api = FakeApi()
        kube = api.client()
        created = await kube.create(run_path("ns"), _run())
        written = await kube.replace_run_status({**created, "status": {"phase": "Pending"}, "spec": {"x": 2}})
        assert written["status"] == {"phase": "Pending"} and written["spec"] == {"x": 1}  # status only
        with pytest.raises(Conflict):
            await kube.replace_run_status({**created, "status": {"phase": "Running"}})  # stale
        with pytest.raises(Conflict):
            await kube.set_run_finalizers("ns", "job", created["metadata"]["resourceVersion"], ["f"])
        await kube.set_run_finalizers("ns", "job", written["metadata"]["resourceVersion"], ["f"])
        with pytest.raises(Conflict):
            await kube.delete_run("ns", "job", "another-uid", written["metadata"]["resourceVersion"])
        held = await kube.get_run("ns", "job")
        await kube.delete_run("ns", "job", held["metadata"]["uid"], held["metadata"]["resourceVersion"])
        deleting = await kube.get_run("ns", "job")  # held by its finalizer
        assert deleting["metadata"]["deletionTimestamp"]
        await kube.set_run_finalizers("ns", "job", deleting["metadata"]["resourceVersion"], [])
        with pytest.raises(NotFound):
            await kube.get_run("ns", "job")
        await kube.close()

    asyncio.run(go())


def test_pods_release_by_a_tested_json_patch_and_lists_filter_by_labels() -> None:
    async def go() -> None:
        api = FakeApi()
        kube = api.client()
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns", "labels": {"run": "job"},
                                                               "finalizers": ["a", "b"]}}
        created = await kube.create_pod(pod)
        assert await kube.list_objects(pod_path("ns"), label_selector="run=job") != []
        assert await kube.list_objects(pod_path("ns"), label_selector="run=other") == []
        assert (await kube.delete_pod("ns", "p", uid="someone-else")) is None  # the precondition held it
        released = await kube.remove_finalizer("ns", "p", "b", uid=created["metadata"]["uid"])
        assert released is not None and released["metadata"]["finalizers"] == ["a"]
        api.before(lambda req: (422, {"kind": "Status", "message": "test failed", "code": 422})
                   if req.method == "PATCH" else None)
        with pytest.raises(Conflict):  # the finalizers moved between the read and the patch
            await kube.remove_finalizer("ns", "p", "a")
        api.hooks.clear()
        await kube.create(run_path("ns"), _run())
        with pytest.raises(Invalid):
            await kube.patch_run_status("ns", "job", [{"op": "test", "path": "/spec/x", "value": 2}])
        await kube.patch_run_status("ns", "job", [{"op": "test", "path": "/spec/x", "value": 1},
                                                 {"op": "add", "path": "/status/phase", "value": "Running"}])
        assert (await kube.get_run("ns", "job"))["status"] == {"phase": "Running"}
        assert api.calls[0] == f"POST {pod_path('ns')}"
        assert await kube.get_lease("ns", "job") is None and f"GET {lease_path('ns', 'job')}" in api.calls
        await kube.close()

    asyncio.run(go())
