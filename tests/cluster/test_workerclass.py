"""WorkerClass at the API server: a run that breaks its class's bounds is refused at apply with a
message naming the class and the bound (policies/workerclass-bounds.yaml); a class whose bound has
no default within it is refused (its CRD's rules). No operator needed.

Classes are cluster-scoped and the suite's tests share one API server: each test names its classes
after its namespace, and the one default class a test makes bounds only what no other run asks for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from testkit.kube import Kube, eventually, refused

CLASSES = "/apis/tether.dev/v1alpha1/workerclasses"
IMAGE = "registry.example.com/tools/w:1"


def _run(name: str = "r", class_name: str | None = None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"executor": "Pod", "template": {"spec": {"containers": [{"name": "w", "image": IMAGE}]}},
                            **spec}
    if class_name is not None:
        body["className"] = class_name
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": {"name": name}, "spec": body}


def _class(name: str, defaults: dict[str, Any] | None = None, bounds: dict[str, Any] | None = None,
           default: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if default:
        meta["annotations"] = {"tether.dev/is-default-class": "true"}
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerClass", "metadata": meta,
            "spec": {"defaults": defaults or {}, "bounds": bounds or {}}}


def _probe(namespace: str) -> str:
    """Where a run is posted to learn whether the policy judges it yet: a dry run, so that a run the
    policy's informer admitted before it saw the class is not stored (every later post would be 409)."""
    return Kube.wr_path(namespace) + "?dryRun=All"


def _denied(resp: httpx.Response, *fragments: str) -> str:
    """A write the bounds policy refused: 422 Invalid, its message saying each fragment."""
    assert resp.status_code == 422, f"{resp.status_code} {resp.text}"
    message = str(resp.json()["message"])
    assert "tether-workerclass-bounds" in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture
def classes(kube: Kube) -> Iterator[list[str]]:
    """Classes a test makes (by name), deleted after it."""
    made: list[str] = []
    yield made
    for name in made:
        kube.delete(f"{CLASSES}/{name}")


def _make(kube: Kube, classes: list[str], body: dict[str, Any]) -> str:
    name = body["metadata"]["name"]
    kube.ok(kube.post(CLASSES, body))
    classes.append(name)
    return name


BOUNDS = {"maxLeaseDurationSeconds": 60, "maxDeadlineSeconds": 3600, "maxCapCents": 100, "maxTokens": 1000,
          "maxAttempts": 5, "executors": ["Pod"], "imagePrefixes": ["registry.example.com/tools/"],
          "serviceAccountNames": ["tools"]}
DEFAULTS = {"lease": {"durationSeconds": 30, "renewIntervalSeconds": 5}, "deadlineSeconds": 600,
            "budget": {"capCents": 50, "maxTokens": 500}}


@pytest.mark.parametrize(("spec", "fragments"), [
    ({"lease": {"durationSeconds": 90, "renewIntervalSeconds": 30}},
     ("bounds spec.lease.durationSeconds at 60s (maxLeaseDurationSeconds); this run asks for 90s",)),
    ({"deadlineSeconds": 7200}, ("bounds spec.deadlineSeconds at 3600s (maxDeadlineSeconds); this run asks for 7200s",)),
    ({"budget": {"capCents": 101}}, ("bounds spec.budget.capCents at 100 (maxCapCents); this run asks for 101",)),
    ({"budget": {"maxTokens": 1001}}, ("bounds spec.budget.maxTokens at 1000 (maxTokens); this run asks for 1001",)),
    ({"retry": {"maxAttempts": 6}}, ("bounds spec.retry.maxAttempts at 5 (maxAttempts); this run asks for 6",)),
    ({"executor": "External", "template": None}, ("allows executors Pod; this run's is External",)),
    ({"template": {"spec": {"containers": [{"name": "w", "image": "docker.io/evil:1"}]}}},
     ("allows images under registry.example.com/tools/; this run's containers run docker.io/evil:1",)),
    ({"template": {"spec": {"initContainers": [{"name": "i", "image": "evil:1"}],
                            "containers": [{"name": "w", "image": IMAGE}]}}},
     ("allows images under registry.example.com/tools/; this run's containers run " + IMAGE + ", evil:1",)),
    ({"template": {"spec": {"serviceAccountName": "deployer", "containers": [{"name": "w", "image": IMAGE}]}}},
     ("allows ServiceAccounts tools; this run names deployer",)),
])
def test_a_run_that_breaks_a_bound_of_its_class_is_refused_naming_both(
        kube: Kube, namespace: str, classes: list[str], spec: dict[str, Any], fragments: tuple[str, ...]) -> None:
    name = _make(kube, classes, _class(f"{namespace}-c", DEFAULTS, BOUNDS))
    body = _run(class_name=name, **spec)
    body["spec"] = {k: v for k, v in body["spec"].items() if v is not None}
    # The policy sees a new class once its informer has: until then nothing of it is judged.
    message = eventually(lambda: (r := kube.post(_probe(namespace), body)).status_code == 422 and _denied(
        r, f"WorkerClass {name} ", *fragments), timeout=30, what="the class's bounds enforced")
    assert "another class" in message
    assert kube.get(Kube.wr_path(namespace, "r")).status_code == 404


def test_a_run_within_its_bounds_or_leaving_them_to_the_class_is_admitted(
        kube: Kube, namespace: str, classes: list[str]) -> None:
    name = _make(kube, classes, _class(f"{namespace}-c", DEFAULTS, BOUNDS))
    eventually(lambda: kube.post(_probe(namespace), _run("probe", name, deadlineSeconds=7200)).status_code == 422,
               timeout=30, what="the class's bounds enforced")
    kube.ok(kube.post(Kube.wr_path(namespace), _run("plain", name)))
    kube.ok(kube.post(Kube.wr_path(namespace), _run("within", name, deadlineSeconds=3600, budget={"capCents": 100},
                                                    lease={"durationSeconds": 60, "renewIntervalSeconds": 10})))
    # A run of another class (or of none) is not judged by this one.
    kube.ok(kube.post(Kube.wr_path(namespace), _run("other", None, deadlineSeconds=7200)))


def test_an_update_is_judged_only_for_what_it_changes(kube: Kube, namespace: str, classes: list[str]) -> None:
    """A run admitted before its class was tightened can still be stopped; raising its cap past the
    new bound is refused."""
    name = _make(kube, classes, _class(f"{namespace}-c", {"budget": {"capCents": 50}}, {"maxCapCents": 500}))
    kube.ok(kube.post(Kube.wr_path(namespace), _run("r", name, budget={"capCents": 400})))
    path = f"{CLASSES}/{name}"
    current = kube.ok(kube.get(path))
    current["spec"]["bounds"]["maxCapCents"] = 100
    kube.ok(kube.put(path, current))
    run_path = Kube.wr_path(namespace, "r")
    eventually(lambda: kube.patch(run_path + "?dryRun=All", {"spec": {"budget": {"capCents": 450}}}).status_code == 422,
               timeout=30, what="the tightened bound enforced")
    _denied(kube.patch(run_path, {"spec": {"budget": {"capCents": 450}}}), "at 100 (maxCapCents)")
    assert kube.ok(kube.patch(run_path, {"spec": {"stop": True}}))["spec"]["budget"]["capCents"] == 400


@pytest.mark.parametrize(("defaults", "bounds", "fragment"), [
    ({}, {"maxDeadlineSeconds": 60}, "bounds.maxDeadlineSeconds needs defaults.deadlineSeconds within it"),
    ({"deadlineSeconds": 120}, {"maxDeadlineSeconds": 60}, "bounds.maxDeadlineSeconds needs defaults.deadlineSeconds"),
    ({}, {"maxCapCents": 60}, "bounds.maxCapCents needs defaults.budget.capCents within it"),
    ({}, {"maxTokens": 60}, "bounds.maxTokens needs defaults.budget.maxTokens within it"),
    ({}, {"maxLeaseDurationSeconds": 60}, "defaults.lease.durationSeconds (90 when defaults.lease is unset)"),
    ({}, {"maxAttempts": 2}, "defaults.retry.maxAttempts (3 when defaults.retry is unset)"),
    ({"lease": {"durationSeconds": 10, "renewIntervalSeconds": 5}}, {},
     "lease.durationSeconds must exceed 2 × lease.renewIntervalSeconds + 5s"),
])
def test_a_class_whose_bound_has_no_default_within_it_is_refused(
        kube: Kube, namespace: str, defaults: dict[str, Any], bounds: dict[str, Any], fragment: str) -> None:
    refused(kube.post(CLASSES, _class(f"{namespace}-bad", defaults, bounds)), fragment)


def test_class_name_is_immutable_once_the_run_started(kube: Kube, namespace: str) -> None:
    kube.ok(kube.post(Kube.wr_path(namespace), _run("r", f"{namespace}-a")))
    path = Kube.wr_path(namespace, "r")
    # Before its first attempt it may move to another class.
    kube.ok(kube.patch(path, {"spec": {"className": f"{namespace}-b"}}))
    kube.ok(kube.patch(path + "/status", {"status": {"attempt": 1, "fence": 1, "holder": "r-a1", "phase": "Running"}}))
    refused(kube.patch(path, {"spec": {"className": f"{namespace}-a"}}), "spec.className are immutable once the run has started")


def test_once_a_start_approval_is_asked_for_the_class_and_what_runs_are_frozen(kube: Kube, namespace: str) -> None:
    """A start gate may come from the run's class (its spec says nothing of it): from the request on,
    what a person approves is what runs, class included."""
    kube.ok(kube.post(Kube.wr_path(namespace), _run("r", f"{namespace}-a")))
    path = Kube.wr_path(namespace, "r")
    kube.ok(kube.patch(path + "/status", {"status": {"phase": "AwaitingApproval", "review": {"requests": [
        {"gate": "Start", "attempt": 0, "requestedAt": "2026-12-07T00:00:00Z", "executionDigest": "sha256:" + "0" * 64}]}}}))
    refused(kube.patch(path, {"spec": {"className": f"{namespace}-b"}}), "immutable once the run has started")
    refused(kube.patch(path, {"spec": {"lease": {"durationSeconds": 70}}}), "immutable once the run has started")
    assert kube.ok(kube.patch(path, {"spec": {"suspend": True}}))["spec"]["suspend"]


def test_a_run_that_took_its_classes_budget_cannot_name_another_once_started(kube: Kube, namespace: str) -> None:
    """It has charged its class's WorkerBudget: a budgetRef of its own, added later, would move its books."""
    kube.ok(kube.post(Kube.wr_path(namespace), _run("s", f"{namespace}-c", budget={"capCents": 50})))
    started = Kube.wr_path(namespace, "s")
    taken = {"name": f"{namespace}-c", "defaults": {"budget": {"budgetRef": {"name": "pool"}}}}
    stored = kube.ok(kube.patch(started + "/status", {"status": {"attempt": 1, "fence": 1, "holder": "s-a1",
                                                                 "phase": "Running", "class": taken}}))
    assert stored["status"]["class"] == taken, stored["status"]
    refused(kube.patch(started, {"spec": {"budget": {"budgetRef": {"name": "team"}}}}),
            "spec.budget.budgetRef cannot be added once the run has started")
    # One that took none from its class may (the operator charges the budget everything it spent).
    kube.ok(kube.post(Kube.wr_path(namespace), _run("r", None, budget={"capCents": 50})))
    path = Kube.wr_path(namespace, "r")
    kube.ok(kube.patch(path + "/status", {"status": {"attempt": 1, "fence": 1, "holder": "r-a1", "phase": "Running"}}))
    kube.ok(kube.patch(path, {"spec": {"budget": {"budgetRef": {"name": "team"}}}}))
    assert kube.ok(kube.patch(started, {"spec": {"budget": {"capCents": 70}}}))["spec"]["budget"] == {"capCents": 70}


def test_the_default_class_bounds_runs_that_name_none(kube: Kube, namespace: str, classes: list[str]) -> None:
    # Its one bound is one no other test's run comes near (a lease of a day), and it has no defaults,
    # so the other tests running meanwhile are not changed by it.
    name = _make(kube, classes, _class(f"{namespace}-default", bounds={"maxLeaseDurationSeconds": 86399},
                                       default=True))
    long_lease = {"durationSeconds": 86400, "renewIntervalSeconds": 30}
    eventually(lambda: kube.post(_probe(namespace), _run("r", None, lease=long_lease)).status_code == 422,
               timeout=30, what="the default class's bounds enforced")
    _denied(kube.post(Kube.wr_path(namespace), _run("r", None, lease=long_lease)),
            f"WorkerClass {name} bounds spec.lease.durationSeconds at 86399s")
    # A run that names a class is judged by that class alone.
    kube.ok(kube.post(Kube.wr_path(namespace), _run("named", f"{namespace}-absent", lease=long_lease)))


def test_the_example_classes_and_their_runs_are_admitted(kube: Kube, namespace: str, classes: list[str]) -> None:
    import yaml

    folder = Path(__file__).resolve().parents[2] / "examples" / "classes"
    examples = [d for p in sorted(folder.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    kinds = sorted(d["kind"] for d in examples)
    assert kinds == ["WorkerClass", "WorkerClass", "WorkerRun", "WorkerRun"], kinds
    renamed: dict[str, str] = {}
    for doc in (d for d in examples if d["kind"] == "WorkerClass"):
        # As shipped (a default class among them), judged by the CRD without being stored...
        kube.ok(kube.post(CLASSES + "?dryRun=All", doc))
        # ...and stored under this test's name, not the default (other tests' runs name no class).
        renamed[doc["metadata"]["name"]] = _make(kube, classes, {**doc, "metadata": {"name": f"{namespace}-{doc['metadata']['name']}"}})
    for doc in (d for d in examples if d["kind"] == "WorkerRun"):
        doc["spec"]["className"] = renamed[doc["spec"]["className"]]
        kube.ok(kube.post(Kube.wr_path(namespace), doc))
    # The classes are enforced: the shipped tool-call class refuses a run that asks for a long lease.
    greedy = _run("greedy", renamed["tool-call"], lease={"durationSeconds": 600, "renewIntervalSeconds": 30})
    eventually(lambda: kube.post(_probe(namespace), greedy).status_code == 422, timeout=30,
               what="the example class enforced")
