"""The controller tells the core of a refused pod (issue 34): the API server's refusal of an
attempt's pod is recorded for the next decision, which ends that attempt PodRefused and revokes it;
a refusal of the moment (a used-up quota) is no refusal of the attempt. The Kubernetes side is the
in-memory fake of test_namesake_and_revocation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tether.controller.controller import RunController
from tether.controller.errors import Again, SpecError
from tether.kube.client import ApiError, Forbidden, Invalid
from tether.kube.paths import lease_path
from testkit.fakeapi import FakeApi, Request
from tests.unit.controller.test_namesake_and_revocation import _held, _new_run, controller, fake_api

KEY = ("ns", "job")
INVALID = 'Pod "job-a1" is invalid: spec.containers[0].name: Invalid value: "Worker_1": a lowercase RFC 1123 label'


def _status(code: int, message: str) -> str:
    return json.dumps({"kind": "Status", "code": code, "message": message})


def _passes(refusal: ApiError, count: int) -> tuple[RunController, FakeApi, list[type[Exception] | None]]:
    """`count` passes over a run whose attempts' pods the API server refuses with `refusal`."""
    api = fake_api(_new_run())

    def refuse(req: Request) -> tuple[int, dict[str, Any]] | None:
        return (refusal.status, json.loads(refusal.body)) if req.method == "POST" and req.path.endswith("/pods") else None

    api.before(refuse)

    async def go() -> tuple[RunController, FakeApi, list[type[Exception] | None]]:
        ctl = controller(api)
        ctl.on_run("ADDED", _held(api, _new_run()))
        ended: list[type[Exception] | None] = []
        for _ in range(count):
            try:
                await ctl.reconciler.reconcile(KEY)
                ended.append(None)
            except (Again, SpecError) as exc:
                ended.append(type(exc))
        return ctl, api, ended

    return asyncio.run(go())


@pytest.mark.parametrize("refusal", [
    Invalid(422, _status(422, INVALID), "create pod"),
    Forbidden(403, _status(403, 'pods "job-a1" is forbidden: violates PodSecurity "restricted:latest"'), "create pod"),
    Forbidden(403, _status(403, 'admission webhook "pods.example.com" denied the request: no latest tags'), "create pod"),
    Forbidden(403, _status(403, 'pods "job-a1" is forbidden: ValidatingAdmissionPolicy \'no-hostpath\' with binding '
                                '\'no-hostpath\' denied request: hostPath volumes are not allowed'), "create pod"),
], ids=["invalid", "pod-security", "webhook", "policy"])
def test_a_refused_pod_is_told_to_the_core_which_ends_its_attempt(refusal: ApiError) -> None:
    ctl, api, ended = _passes(refusal, 2)
    # The grant's pass: refused, recorded, decided again at once; the next pass ends the attempt.
    assert ended == [Again, None], ended
    assert ctl.cache.pod_refusals["run-NEW"].fence == 1
    status = ctl.cache.runs[KEY]["status"]
    assert (status["phase"], status["fence"], status.get("holder")) == ("Backoff", 2, None)
    assert status["attempts"][-1]["outcome"] == "PodRefused" and refusal.message in status["attempts"][-1]["message"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "PodRefused" and refusal.message in ready["message"]
    assert api.asked("pods", writes=True) == ["POST pods/job-a1"]  # not tried again: the attempt is over
    lease = api.get(lease_path("ns", "job"))
    assert lease is not None and (lease["spec"]["holderIdentity"], lease["spec"]["leaseTransitions"]) == (None, 2)


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
    ctl, api, ended = _passes(refusal, 2)
    assert ended == [SpecError, SpecError] and "run-NEW" not in ctl.cache.pod_refusals
    status = ctl.cache.runs[KEY]["status"]
    assert status["holder"] == "job-a1" and status["attempts"][-1].get("outcome") is None
    stalled = next(c for c in status["conditions"] if c["type"] == "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "PodRefused") and message in stalled["message"]
    assert api.asked("pods", writes=True) == ["POST pods/job-a1", "POST pods/job-a1"]
