"""Every rule of every CRD, broken once on the real API server: its refusal names the field it is
about (issue 34). A CEL rule at a level that names no field answered `<nil>: Invalid value: ...`
(metadata.name's length), and on Kubernetes 1.34 a rule on an object said `Invalid value: "object"`;
rules that forbid a change or require a field now say so (reason Forbidden, Required)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

from tests.cluster.test_approvals import APPROVALS
from testkit.kube import Kube, refused
from tether.devcluster.crds import read_crd

CRDS = Path(__file__).resolve().parents[2] / "crds"
BUDGETS = "/apis/tether.dev/v1alpha1/namespaces/{ns}/workerbudgets"
CLASSES = "/apis/tether.dev/v1alpha1/workerclasses"
DIGEST = "sha256:" + "a" * 64
SCHEDULES = "/apis/tether.dev/v1alpha1/namespaces/{ns}/workerrunschedules"


def _schedule(name: str, template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunSchedule", "metadata": {"name": name},
            "spec": {"schedule": "@hourly", "runTemplate": {"spec": template}}}


def _rules(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from schema.get("x-kubernetes-validations") or []
    for sub in [*(schema.get("properties") or {}).values(), schema.get("items"), schema.get("additionalProperties")]:
        if isinstance(sub, dict):
            yield from _rules(sub)


def crd_rules() -> list[str]:
    """The message of every CEL rule in crds/, folded to one line: once each (the WorkerClass CRD's
    defaults carry the WorkerRun CRD's own lease and retry rules, judged there)."""
    return sorted({" ".join(rule["message"].split()) for path in sorted(CRDS.glob("*.yaml"))
                   for version in read_crd(path)["spec"]["versions"]
                   for rule in _rules(version["schema"]["openAPIV3Schema"])})


def _run(name: str = "r", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name},
            "spec": {"executor": "External", **spec}}


def _created(kube: Kube, ns: str, body: dict[str, Any], status: dict[str, Any] | None = None) -> str:
    path = Kube.wr_path(ns, kube.ok(kube.post(Kube.wr_path(ns), body))["metadata"]["name"])
    if status is not None:
        kube.ok(kube.patch(path + "/status", {"status": status}))
    return path


def _approval(kube: Kube, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunApproval", "metadata": {"generateName": "a-"},
            "spec": {"runRef": {"name": "r"}, "gate": "Start", "decision": "Approve", "reason": "checked",
                     "approver": kube.username(), **spec}}


def _started(kube: Kube, ns: str, name: str) -> str:
    return _created(kube, ns, _run(name, payload={"n": 1}),
                    {"attempt": 1, "fence": 3, "holder": f"{name}-a1", "executionDigest": DIGEST})


def _child(kube: Kube, ns: str, name: str, **spec: Any) -> str:
    """A child run made by hand (an administrator's: the policies judge only workers' holders)."""
    parent = kube.ok(kube.post(Kube.wr_path(ns), _run(f"{name}-parent")))["metadata"]
    body = _run(name, parentRef={"name": parent["name"], "uid": parent["uid"], "holder": f"{parent['name']}-a1",
                                 "fence": 1, "depth": 1}, **spec)
    body["metadata"]["labels"] = {"tether.dev/parent": parent["name"]}
    body["metadata"]["ownerReferences"] = [{"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
                                            "name": parent["name"], "uid": parent["uid"]}]
    return _created(kube, ns, body)


def _class(ns: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerClass", "metadata": {"name": f"{ns}-c"}, "spec": spec}


def _rebudgeted(kube: Kube, ns: str) -> httpx.Response:
    """A started run that took its class's WorkerBudget, given one of its own."""
    taken = {"name": "c", "defaults": {"budget": {"budgetRef": {"name": "pool"}}}}
    path = _created(kube, ns, _run("pooled", payload={"n": 1}),
                    {"attempt": 1, "fence": 1, "holder": "pooled-a1", "executionDigest": DIGEST, "class": taken})
    return kube.patch(path, {"spec": {"budget": {"budgetRef": {"name": "mine"}}}})


def _rewritten_approval(kube: Kube, ns: str) -> httpx.Response:
    made = kube.ok(kube.post(APPROVALS.format(ns=ns), _approval(kube)))
    return kube.patch(f"{APPROVALS.format(ns=ns)}/{made['metadata']['name']}", {"spec": {"reason": "other"}})


# (a fragment of the rule's message, the field its refusal names, the refused write)
CASES: list[tuple[str, str, Callable[[Kube, str], httpx.Response]]] = [
    ("a WorkerBudget needs limitCents", "spec", lambda kube, ns: kube.post(BUDGETS.format(ns=ns), {
        "apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget", "metadata": {"name": "b"},
        "spec": {"period": "Daily"}})),
    ("a run has one Start gate", "spec.attempt",
     lambda kube, ns: kube.post(APPROVALS.format(ns=ns), _approval(kube, attempt=1))),
    ("spec.attempt is required for gate Result", "spec.attempt",
     lambda kube, ns: kube.post(APPROVALS.format(ns=ns), _approval(kube, gate="Result"))),
    ("an approval is immutable once created", "spec", _rewritten_approval),
    ("are immutable once the run has started", "spec",
     lambda kube, ns: kube.patch(_started(kube, ns, "edited"), {"spec": {"payload": {"n": 2}}})),
    ("spec.review is immutable", "spec.review",
     lambda kube, ns: kube.patch(_created(kube, ns, _run("gated", review={"start": True})), {"spec": {"review": None}})),
    ("spec.template is required for executor Pod", "spec.template",
     lambda kube, ns: kube.post(Kube.wr_path(ns), _run("pod", executor="Pod"))),
    ("cannot be set on an External run", "spec.template", lambda kube, ns: kube.post(Kube.wr_path(ns), _run(
        "ext", template={"spec": {"serviceAccountName": "x", "containers": [{"name": "w", "image": "w"}]}}))),
    ("metadata.name must be at most 58 characters", "metadata.name",
     lambda kube, ns: kube.post(Kube.wr_path(ns), _run("n" * 59))),
    ("spec.budget.budgetRef cannot be changed", "spec.budget.budgetRef", lambda kube, ns: kube.patch(
        _created(kube, ns, _run("charged", budget={"budgetRef": {"name": "a"}})),
        {"spec": {"budget": {"budgetRef": {"name": "b"}}}})),
    ("lease.durationSeconds must exceed", "spec.lease.durationSeconds", lambda kube, ns: kube.post(
        Kube.wr_path(ns), _run("lease", lease={"durationSeconds": 6, "renewIntervalSeconds": 1}))),
    ("a retry rule needs exactly one of", "spec.retry.rules[0]",
     lambda kube, ns: kube.post(Kube.wr_path(ns), _run("retry", retry={"rules": [{"action": "Retry"}]}))),
    ("status.fence never decreases", "status.fence",
     lambda kube, ns: kube.patch(_started(kube, ns, "fenced") + "/status", {"status": {"fence": 2}})),
    ("spec.budget.budgetRef cannot be added once the run has started", "spec.budget", _rebudgeted),
    ("defaults.lease.durationSeconds (90 when defaults.lease is unset)", "spec.bounds.maxLeaseDurationSeconds",
     lambda kube, ns: kube.post(CLASSES, _class(ns, bounds={"maxLeaseDurationSeconds": 60}))),
    ("bounds.maxDeadlineSeconds needs defaults.deadlineSeconds", "spec.bounds.maxDeadlineSeconds",
     lambda kube, ns: kube.post(CLASSES, _class(ns, bounds={"maxDeadlineSeconds": 60}))),
    ("bounds.maxCapCents needs defaults.budget.capCents", "spec.bounds.maxCapCents",
     lambda kube, ns: kube.post(CLASSES, _class(ns, bounds={"maxCapCents": 60}))),
    ("bounds.maxTokens needs defaults.budget.maxTokens", "spec.bounds.maxTokens",
     lambda kube, ns: kube.post(CLASSES, _class(ns, bounds={"maxTokens": 60}))),
    ("defaults.retry.maxAttempts (3 when defaults.retry is unset)", "spec.bounds.maxAttempts",
     lambda kube, ns: kube.post(CLASSES, _class(ns, bounds={"maxAttempts": 2}))),
    ("labels keys must be Prometheus label names", "spec.labels",
     lambda kube, ns: kube.post(CLASSES, _class(ns, labels={"Bad-Key": "x"}))),
    ("each run is named <schedule>-<ten digits>", "metadata.name",
     lambda kube, ns: kube.post(SCHEDULES.format(ns=ns), _schedule("s" * 48, {"executor": "External"}))),
    ("each run of a schedule is an operation of its own", "spec.runTemplate.spec.idempotencyKey",
     lambda kube, ns: kube.post(SCHEDULES.format(ns=ns), _schedule("keyed", {"executor": "External",
                                                                              "idempotencyKey": "k"}))),
    ("spec.parentRef cannot be changed once set", "spec.parentRef",
     lambda kube, ns: kube.patch(_child(kube, ns, "moved"), {"spec": {"parentRef": {"fence": 2}}})),
    ("spec.parentRef cannot be added or removed", "spec.parentRef",
     lambda kube, ns: kube.patch(_created(kube, ns, _run("orphan")), {"spec": {"parentRef": {
         "name": "p", "uid": "u", "holder": "p-a1", "fence": 1, "depth": 1}}})),
    ("spec.budget.capCents and maxTokens may be lowered, never raised", "spec.budget",
     lambda kube, ns: kube.patch(_child(kube, ns, "greedy", budget={"capCents": 5}), {"spec": {"budget": {"capCents": 6}}})),
    ("status.executionDigest never changes once set", "status.executionDigest",
     lambda kube, ns: kube.patch(_started(kube, ns, "digested") + "/status",
                                 {"status": {"executionDigest": "sha256:" + "b" * 64}})),
]


def test_every_rule_names_its_field(kube: Kube, namespace: str) -> None:
    # One case per rule: a rule added to a CRD without a case here fails, so the sweep stays whole.
    rules = crd_rules()
    for rule in rules:
        assert len([fragment for fragment, _, _ in CASES if fragment in rule]) == 1, rule
    for fragment, _, _ in CASES:
        assert len([rule for rule in rules if fragment in rule]) == 1, fragment
    wrong = []
    for fragment, field, write in CASES:
        resp = write(kube, namespace)
        if resp.status_code != 422:
            wrong.append(f"{fragment}: {resp.status_code} {resp.text}")
            continue
        causes = [(c.get("field"), c.get("message", "")) for c in resp.json()["details"].get("causes", [])]
        if [f for f, m in causes if fragment in m] != [field] or "<nil>" in resp.json()["message"]:
            wrong.append(f"{fragment}: {causes}")
            continue
        refused(resp, fragment, f"{field}: ")
    assert not wrong, "\n".join(wrong)
