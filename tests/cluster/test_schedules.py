"""WorkerRunSchedule at the API server (no operator): what its CRD refuses, each refusal naming the
field and what to fix; the shipped examples are admitted; and the identity rule, so that a schedule
is no way around it: a runTemplate naming a ServiceAccount needs impersonate on it, judged against
whoever applies the schedule, while the runs the operator then creates for it are not judged again
(and only those)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.kube import Kube, eventually, refused

SCHEDULES = "/apis/tether.dev/v1alpha1/namespaces/{ns}/workerrunschedules"
RBAC = "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/{kind}"
POD = {"spec": {"containers": [{"name": "w", "image": "registry.example.com/tools/w:1"}]}}


def _schedule(name: str = "s", template: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunSchedule", "metadata": {"name": name},
            "spec": {"schedule": "*/5 * * * *", "runTemplate": {"spec": template or {"executor": "Pod", "template": POD}},
                     **spec}}


@pytest.mark.parametrize("change, fragments", [
    ({"schedule": "every night"}, ["spec.schedule", "should match"]),
    ({"schedule": "TZ=Europe/Berlin 0 2 * * *"}, ["spec.schedule"]),
    ({"schedule": "@every 1d"}, ["spec.schedule"]),
    ({"timeZone": "../../etc/passwd"}, ["spec.timeZone"]),
    ({"concurrencyPolicy": "Sometimes"}, ["spec.concurrencyPolicy", "Allow", "BufferOne"]),
    ({"catchUpLimit": 2}, ["spec.catchUpLimit", "less than or equal to 1"]),
    ({"successfulRunsHistoryLimit": 101}, ["spec.successfulRunsHistoryLimit"]),
    ({"startingDeadlineSeconds": 0}, ["spec.startingDeadlineSeconds"]),
    ({"schedule": "@every 99999h"}, ["spec.schedule"]),
])
def test_what_the_crd_refuses_says_the_field(kube: Kube, namespace: str, change: dict[str, Any],
                                            fragments: list[str]) -> None:
    refused(kube.post(SCHEDULES.format(ns=namespace), _schedule(**change)), *fragments)


def test_a_template_a_run_would_be_refused_for_is_refused_with_the_runs_rule(kube: Kube, namespace: str) -> None:
    bad_lease = {"executor": "External", "lease": {"durationSeconds": 20, "renewIntervalSeconds": 10}}
    refused(kube.post(SCHEDULES.format(ns=namespace), _schedule(template=bad_lease)),
            "spec.runTemplate.spec.lease", "durationSeconds")


def test_one_idempotency_key_for_every_run_is_refused(kube: Kube, namespace: str) -> None:
    keyed = {"executor": "External", "idempotencyKey": "nightly-report"}
    refused(kube.post(SCHEDULES.format(ns=namespace), _schedule(template=keyed)),
            "spec.runTemplate.spec.idempotencyKey", "operation of its own")


def test_a_name_too_long_for_its_runs_is_refused(kube: Kube, namespace: str) -> None:
    refused(kube.post(SCHEDULES.format(ns=namespace), _schedule("s" * 48)), "metadata.name", "at most 47")
    kube.ok(kube.post(SCHEDULES.format(ns=namespace), _schedule("s" * 47)))


def test_the_example_schedules_are_admitted(kube: Kube, namespace: str) -> None:
    folder = Path(__file__).resolve().parents[2] / "examples" / "schedules"
    docs = [d for p in sorted(folder.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    assert [d["kind"] for d in docs] == ["WorkerRunSchedule", "WorkerRunSchedule"]
    for doc in docs:
        kube.ok(kube.post(SCHEDULES.format(ns=namespace) + "?dryRun=All", doc))


def _bind(kube: Kube, ns: str, sa: str, rules: list[dict[str, Any]]) -> dict[str, str]:
    kube.ok(kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": sa}}))
    kube.ok(kube.post(RBAC.format(ns=ns, kind="roles"), {"metadata": {"name": sa}, "rules": rules}))
    kube.ok(kube.post(RBAC.format(ns=ns, kind="rolebindings"), {
        "metadata": {"name": sa}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]}))
    # The API server's RBAC sees a new binding through its informers, a moment later (make test: a
    # create as the account right after the binding was refused as unauthorized, once).
    user = f"system:serviceaccount:{ns}:{sa}"
    last = rules[-1]
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": {
        "user": user, "resourceAttributes": {"namespace": ns, "group": last["apiGroups"][0],
                                             "resource": last["resources"][0], "verb": last["verbs"][-1]}}}
    eventually(lambda: kube.ok(kube.post("/apis/authorization.k8s.io/v1/subjectaccessreviews", review))
               ["status"].get("allowed"), timeout=30, what=f"RBAC granting {sa} its role")
    return {"Impersonate-User": user}


def _named_run(name: str, owner_uid: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
            "metadata": {"name": name, "labels": labels,
                         "ownerReferences": [{"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunSchedule",
                                              "name": "s", "uid": owner_uid, "controller": True}]},
            "spec": {"executor": "Pod", "template": {"spec": {**POD["spec"], "serviceAccountName": "deployer"}}}}


def test_a_schedule_is_no_way_around_the_service_account_rule(kube: Kube, namespace: str) -> None:
    ns = namespace
    kube.ok(kube.post(f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "deployer"}}))
    people = [{"apiGroups": ["tether.dev"], "resources": ["workerruns", "workerrunschedules"],
               "verbs": ["get", "list", "create", "update", "patch"]}]
    creator = _bind(kube, ns, "creator", people)
    as_deployer = {"executor": "Pod", "template": {"spec": {**POD["spec"], "serviceAccountName": "deployer"}}}
    # A schedule whose runs would run as an account its creator may not act as: refused, saying why.
    resp = kube.post(SCHEDULES.format(ns=ns), _schedule("s", template=as_deployer), headers=creator)
    assert resp.status_code == 403, resp.text
    assert 'may not act as ServiceAccount "deployer"' in resp.json()["message"]
    assert "spec.runTemplate.spec.template.spec.serviceAccountName" in resp.json()["message"]
    # Admitted for whoever may act as it (the admin), and its creator may not edit what runs as it.
    owner = kube.ok(kube.post(SCHEDULES.format(ns=ns), _schedule("s", template=as_deployer)))
    edit = kube.request("PATCH", f"{SCHEDULES.format(ns=ns)}/s", headers={**creator, "Content-Type": "application/merge-patch+json"},
                        json={"spec": {"runTemplate": {"spec": {"template": {"spec": {"containers": [
                            {"name": "w", "image": "registry.example.com/tools/w:2"}]}}}}}})
    assert edit.status_code == 403, edit.text
    # Nor what its runs are told to do as the account (a schedule is a standing order to run as it)...
    told = kube.request("PATCH", f"{SCHEDULES.format(ns=ns)}/s", headers={**creator, "Content-Type": "application/merge-patch+json"},
                        json={"spec": {"runTemplate": {"spec": {"payload": {"task": "something else"}}}}})
    assert told.status_code == 403, told.text
    # ...while when it runs is theirs to change.
    timed = kube.request("PATCH", f"{SCHEDULES.format(ns=ns)}/s", headers={**creator, "Content-Type": "application/merge-patch+json"},
                         json={"spec": {"schedule": "@hourly", "suspend": True}})
    assert timed.status_code == 200, timed.text
    # The operator's run of a schedule (it may fence runs) is not judged again...
    operator = _bind(kube, ns, "operator", [*people, {"apiGroups": ["tether.dev"], "resources": ["workerruns"],
                                                      "verbs": ["fence"]}])
    labelled = {"tether.dev/schedule": "s"}
    kube.ok(kube.post(Kube.wr_path(ns), _named_run("s-1796671200", owner["metadata"]["uid"], labelled), headers=operator))
    # ...but the same run from someone who may not fence runs is, however it is labelled.
    resp = kube.post(Kube.wr_path(ns), _named_run("s-1796671500", owner["metadata"]["uid"], labelled), headers=creator)
    assert resp.status_code == 403 and 'ServiceAccount "deployer"' in resp.json()["message"], resp.text
    # And the exemption is for runs of a schedule only.
    resp = kube.post(Kube.wr_path(ns), {**_named_run("plain", "x", {}), "metadata": {"name": "plain"}}, headers=operator)
    assert resp.status_code == 403, resp.text


def test_a_late_creation_of_a_slot_already_handled_is_refused(kube: Kube, namespace: str) -> None:
    """policies/schedule-slot-fence.yaml: a dead replica's creation that lands after its successor
    recorded the slot is refused; the waiting start (made after its slot was recorded) is not."""
    ns = namespace
    owner = kube.ok(kube.post(SCHEDULES.format(ns=ns), _schedule("s", template={"executor": "External"})))
    path = f"{SCHEDULES.format(ns=ns)}/s/status"
    kube.ok(kube.patch(path, {"status": {"lastScheduleTime": "2026-12-07T12:05:00Z",
                                         "waiting": {"name": "s-1796645100", "scheduledTime": "2026-12-07T12:05:00Z"}}}))

    def slot_run(name: str, at: str) -> dict[str, Any]:
        return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
                "metadata": {"name": name, "labels": {"tether.dev/schedule": "s"},
                             "annotations": {"tether.dev/scheduled-at": at},
                             "ownerReferences": [{"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunSchedule",
                                                  "name": "s", "uid": owner["metadata"]["uid"], "controller": True}]},
                "spec": {"executor": "External"}}

    late = slot_run("s-1796644800", "2026-12-07T12:00:00Z")
    resp = eventually(lambda: r if (r := kube.post(Kube.wr_path(ns) + "?dryRun=All", late)).status_code == 403 else None,
                      timeout=30, what="the fence in force")
    assert "handled slot 2026-12-07T12:00:00Z already" in resp.json()["message"], resp.text
    kube.ok(kube.post(Kube.wr_path(ns), slot_run("s-1796645100", "2026-12-07T12:05:00Z")))  # the waiting start
    kube.ok(kube.post(Kube.wr_path(ns), slot_run("s-1796645400", "2026-12-07T12:10:00Z")))  # a slot to come
