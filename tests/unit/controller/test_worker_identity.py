"""Worker identity: one per namespace for pod-backed runs (three writes fewer per launch), one per
run where the namespace's cannot be used."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tether.api.models import WorkerRun
from tether.controller.rbac import WorkerRbac
from tether.kube import resources
from testkit.fakeapi import FakeApi


def _run(name: str, executor: str = "Pod", sa: str | None = None, ns: str = "ns") -> WorkerRun:
    spec: dict[str, Any] = {"containers": [{"name": "w", "command": ["w"]}]}
    if sa:
        spec["serviceAccountName"] = sa
    return WorkerRun.model_validate({
        "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}"},
        "spec": {"executor": executor, "template": {"spec": spec} if executor == "Pod" else None}})


def _created(api: FakeApi) -> list[str]:
    """What the API was asked to create, as "plural/name"."""
    return [call.split(" ", 1)[1] for call in api.asked(writes=True) if call.startswith("POST ")]


def test_pod_runs_of_a_namespace_share_one_identity_created_once() -> None:
    api = FakeApi()
    rbac = WorkerRbac(api.client(), shared=True)

    async def go() -> None:
        for run in (_run("a"), _run("b"), _run("c", ns="other")):
            await rbac.ensure(run)
    asyncio.run(go())
    assert _created(api) == ["serviceaccounts/tether-worker", "roles/tether-worker", "rolebindings/tether-worker"] * 2
    pod = resources.build_pod(_run("a"), "a-a1", 1, 1, "a-a1", shared=True)
    assert pod["spec"]["serviceAccountName"] == "tether-worker"
    role = dict(resources.build_namespace_worker_rbac("ns"))["/apis/rbac.authorization.k8s.io/v1/namespaces/ns/roles"]
    assert "ownerReferences" not in role["metadata"]  # no run's deletion may take it from the others


def test_external_runs_own_accounts_and_per_run_mode_keep_one_identity_per_run() -> None:
    for shared, run, expected_sa in ((True, _run("x", executor="External"), "x-worker"),
                                     (True, _run("y", sa="mine"), "mine"),
                                     (False, _run("z"), "z-worker")):
        api = FakeApi()
        asyncio.run(WorkerRbac(api.client(), shared=shared).ensure(run))
        name, created = run.metadata.name, _created(api)
        assert f"roles/tether-worker-{name}" in created and f"rolebindings/tether-worker-{name}" in created
        assert resources.worker_service_account(run, shared) == expected_sa


def test_the_namespace_identity_is_made_again_once_forgotten() -> None:
    """Review finding: deleted by someone, or the namespace re-created, the objects are missing;
    a pod refusal (or the namespace going away) makes the next ensure create them again."""
    api = FakeApi()
    rbac = WorkerRbac(api.client(), shared=True)
    asyncio.run(rbac.ensure(_run("a")))
    asyncio.run(rbac.ensure(_run("b")))
    assert len(_created(api)) == 3
    for path in list(api.objects):
        del api.objects[path]  # deleted by someone
    rbac.forget_namespace("ns")
    asyncio.run(rbac.ensure(_run("c")))
    assert _created(api)[3:] == ["serviceaccounts/tether-worker", "roles/tether-worker", "rolebindings/tether-worker"]


def test_an_external_run_is_never_given_an_account_it_names() -> None:
    """Tool claims are minted for the run's account; one the run names would hand out its tokens
    (the CRD refuses such a run; this holds for one made before that rule, too)."""
    run = WorkerRun.model_validate({
        "metadata": {"name": "ext", "namespace": "ns", "uid": "uid-ext"},
        "spec": {"executor": "External", "template": {"spec": {"serviceAccountName": "deployer"}}}})
    assert resources.tool_claim_service_account(run) == "ext-worker"
    assert resources.worker_service_account(run) == resources.worker_service_account(run, shared=True) == "ext-worker"
    subjects = [obj["subjects"] for _, obj in resources.build_worker_rbac(run) if obj["kind"] == "RoleBinding"]
    assert subjects == [[{"kind": "ServiceAccount", "name": "ext-worker", "namespace": "ns"}]]
    assert [obj["metadata"]["name"] for _, obj in resources.build_worker_rbac(run) if obj["kind"] == "ServiceAccount"] \
        == ["ext-worker"]


def _existing(owners: list[dict[str, Any]]) -> FakeApi:
    """The API server already holds ServiceAccount `ci-worker`, made by someone (owner references as given)."""
    api = FakeApi()
    api.put("/api/v1/namespaces/ns/serviceaccounts/ci-worker", {
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "ci-worker", "namespace": "ns", "ownerReferences": owners}})
    return api


@pytest.mark.parametrize("shared, executor", [(True, "External"), (False, "Pod")])
def test_someone_elses_account_of_the_runs_name_is_never_adopted(shared: bool, executor: str) -> None:
    """Review finding: an admin's ServiceAccount `ci-worker` and a run named `ci` (External, or a
    pod run in per-run mode): the run must not act as that account, nor get its tokens."""
    from tether.controller.errors import SpecError
    api = _existing(owners=[])
    with pytest.raises(SpecError) as refused:
        asyncio.run(WorkerRbac(api.client(), shared=shared).ensure(_run("ci", executor=executor)))
    assert refused.value.reason == "WorkerIdentityTaken" and "was not made for this run" in refused.value.api_error.message
    assert not [c for c in api.asked(writes=True) if c.startswith(("DELETE", "POST rolebindings"))], api.calls
    # One a deleted run of that name left (garbage collection's to take) is replaced.
    left = _existing(owners=[{"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "name": "ci", "uid": "old"}])
    asyncio.run(WorkerRbac(left.client(), shared=shared).ensure(_run("ci", executor=executor)))
    assert "DELETE serviceaccounts/ci-worker" in left.asked(writes=True)
    account = left.get("/api/v1/namespaces/ns/serviceaccounts/ci-worker")
    assert account is not None and account["metadata"]["ownerReferences"][0]["uid"] == "uid-ci"  # made again, for this run
