"""The controller tells the core of a refused pod (issue 34): the API server's refusal of an
attempt's pod is recorded for the next decision, which ends that attempt PodRefused and revokes it;
a refusal of the moment (a used-up quota) is no refusal of the attempt. The Kubernetes side is the
in-memory fake of test_namesake_and_revocation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tether.controller.controller import Clock, RunController
from tether.controller.errors import Again, SpecError
from tether.kube.client import ApiError, Forbidden, Invalid
from tests.unit.controller.test_namesake_and_revocation import T0, FakeKube, _new_run

KEY = ("ns", "job")
INVALID = 'Pod "job-a1" is invalid: spec.containers[0].name: Invalid value: "Worker_1": a lowercase RFC 1123 label'


def _status(code: int, message: str) -> str:
    return json.dumps({"kind": "Status", "code": code, "message": message})


class RefusingKube(FakeKube):
    def __init__(self, refusal: ApiError) -> None:
        super().__init__({})
        self.refusal = refusal
        self.run = _new_run()

    async def replace_run_status(self, run: dict[str, Any]) -> dict[str, Any]:
        self.run = await super().replace_run_status(run)
        return self.run

    async def get_run(self, ns: str, name: str) -> dict[str, Any]:
        return self.run

    async def timed_get(self, path: str, what: str) -> tuple[dict[str, Any] | None, float]:
        return self.lease, 0.01  # the Lease, read back as written

    async def create_lease(self, lease: dict[str, Any]) -> dict[str, Any]:
        self.lease = await super().create_lease(lease)
        return self.lease

    async def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(f"create_pod {pod['metadata']['name']}")
        raise self.refusal


def _passes(refusal: ApiError, count: int) -> tuple[RunController, RefusingKube, list[type[Exception] | None]]:
    async def go() -> tuple[RunController, RefusingKube, list[type[Exception] | None]]:
        kube = RefusingKube(refusal)
        ctl = RunController(kube, clock=Clock(now=lambda: T0, mono=lambda: 100.0))  # type: ignore[arg-type]
        ctl.on_run("ADDED", _new_run())
        ended: list[type[Exception] | None] = []
        for _ in range(count):
            try:
                await ctl.reconciler.reconcile(KEY)
                ended.append(None)
            except (Again, SpecError) as exc:
                ended.append(type(exc))
        return ctl, kube, ended

    return asyncio.run(go())


@pytest.mark.parametrize("refusal", [
    Invalid(422, _status(422, INVALID), "create pod"),
    Forbidden(403, _status(403, 'pods "job-a1" is forbidden: violates PodSecurity "restricted:latest"'), "create pod"),
    Forbidden(403, _status(403, 'admission webhook "pods.example.com" denied the request: no latest tags'), "create pod"),
    Forbidden(403, _status(403, 'pods "job-a1" is forbidden: ValidatingAdmissionPolicy \'no-hostpath\' with binding '
                                '\'no-hostpath\' denied request: hostPath volumes are not allowed'), "create pod"),
], ids=["invalid", "pod-security", "webhook", "policy"])
def test_a_refused_pod_is_told_to_the_core_which_ends_its_attempt(refusal: ApiError) -> None:
    ctl, kube, ended = _passes(refusal, 2)
    # The grant's pass: refused, recorded, decided again at once; the next pass ends the attempt.
    assert ended == [Again, None], ended
    assert ctl.cache.pod_refusals["run-NEW"].fence == 1
    status = ctl.cache.runs[KEY]["status"]
    assert (status["phase"], status["fence"], status.get("holder")) == ("Backoff", 2, None)
    assert status["attempts"][-1]["outcome"] == "PodRefused" and refusal.message in status["attempts"][-1]["message"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "PodRefused" and refusal.message in ready["message"]
    assert kube.calls.count("create_pod job-a1") == 1  # not tried again: the attempt is over
    assert "replace_lease None 2" in kube.calls  # revoked: the Lease cleared at the new fence


@pytest.mark.parametrize("message", [
    'pods "job-a1" is forbidden: exceeded quota: q, requested: pods=1, used: pods=4, limited: pods=4',
    'pods "job-a1" is forbidden: status unknown for quota: q, resources: pods',  # a quota not yet counted
    'pods "job-a1" is forbidden: quota usage is negative for resource(s): [pods]',
    'pods "job-a1" is forbidden: error looking up service account ns/tether-worker: serviceaccount "tether-worker" not found',
    'pods is forbidden: User "system:serviceaccount:tether-system:tether" cannot create resource "pods"',
], ids=["quota-used-up", "quota-unknown", "quota-negative", "account-missing", "operator-rbac"])
def test_a_refusal_that_passes_on_its_own_is_no_refusal_of_the_attempt(message: str) -> None:
    """Recorded (Stalled) and the pod tried again, as before: the quota frees as other pods end, the
    worker account is made again, the operator's RBAC comes back. Only the pod itself refused ends it."""
    refusal = Forbidden(403, _status(403, message), "create pod")
    ctl, kube, ended = _passes(refusal, 2)
    assert ended == [SpecError, SpecError] and "run-NEW" not in ctl.cache.pod_refusals
    status = ctl.cache.runs[KEY]["status"]
    assert status["holder"] == "job-a1" and status["attempts"][-1].get("outcome") is None
    stalled = next(c for c in status["conditions"] if c["type"] == "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "PodRefused") and message in stalled["message"]
    assert kube.calls.count("create_pod job-a1") == 2
