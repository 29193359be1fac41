"""Who may create a child run, judged by the API server (policies/child-runs.yaml): a worker's pod
only as a child of the run it holds, in its own name; every child carries its parent's label and
owner reference; the parent's class says which classes its children may be of and how deep; a
child's parentRef is fixed at creation. No operator runs here: what is refused is refused by the
API server, with a message that says what to fix."""

from __future__ import annotations

import re
import uuid
from typing import Any, Iterator

import httpx
import pytest

from tests.cluster.test_admission_policy import (_bound_token, _client, _created, _grant, _message,
                                                 _parked_pod)
from testkit import runs
from testkit.kube import Kube, eventually

CLASSES = "/apis/tether.dev/v1alpha1/workerclasses"
CHILD_POLICY = re.compile(r"ValidatingAdmissionPolicy '(\S+-)?tether-child-runs'")
CLASS_POLICY = re.compile(r"ValidatingAdmissionPolicy '(\S+-)?tether-child-classes'")
# The namespace worker identity's own rules (kube/resources.py), and nothing more.
WORKER_RULES = [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "update", "patch"]},
                {"apiGroups": ["tether.dev"], "resources": ["workerruns"], "verbs": ["get", "create"]},
                {"apiGroups": ["tether.dev"], "resources": ["workerruns/status"], "verbs": ["get", "patch"]}]


def child(parent: dict[str, Any], name: str = "planner-c1", holder: str = "planner-a2", class_name: str | None = "search",
          parent_class: str | None = "planners", depth: int = 1, label: str | None = "default",
          owner: bool = True) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": parent["metadata"]["name"], "uid": parent["metadata"]["uid"], "holder": holder,
                           "fence": 3, "depth": depth}
    if parent_class is not None:
        ref["className"] = parent_class
    meta: dict[str, Any] = {"name": name}
    if label is not None:
        meta["labels"] = {"tether.dev/parent": parent["metadata"]["name"] if label == "default" else label}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
                                    "name": parent["metadata"]["name"], "uid": parent["metadata"]["uid"]}]
    spec: dict[str, Any] = {"executor": "External", "parentRef": ref}
    if class_name is not None:
        spec["className"] = class_name
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "metadata": meta, "spec": spec}


def refused(resp: httpx.Response, policy: re.Pattern[str], *fragments: str, status: int = 403) -> str:
    message = _message(resp)
    assert resp.status_code == status, f"{resp.status_code} {message}"
    assert policy.search(message), message
    for fragment in fragments:
        assert fragment in message, message
    return message


WORKER = "tether-worker"  # the namespace's worker identity (no operator runs here to make it)


class Pods:
    def __init__(self, kube: Kube, ns: str) -> None:
        _grant(kube, ns, WORKER, WORKER_RULES)
        self.parent = runs.create(kube, ns, runs.example("short-job.yaml"), name="planner")
        self.current = _client(kube, _bound_token(kube, ns, WORKER, _parked_pod(kube, ns, "planner-a2", WORKER)))
        self.other = _client(kube, _bound_token(kube, ns, WORKER, _parked_pod(kube, ns, "other-a1", WORKER)))
        self.unbound = _client(kube, _bound_token(kube, ns, WORKER, None))
        # Another account of the namespace (a CI job's) that its own Role lets create runs.
        _grant(kube, ns, "ci", [{"apiGroups": ["tether.dev"], "resources": ["workerruns"], "verbs": ["create"]}])
        self.ci = _client(kube, _bound_token(kube, ns, "ci", None))
        self.path = Kube.wr_path(ns)


@pytest.fixture
def pods(kube: Kube, namespace: str) -> Iterator[Pods]:
    p = Pods(kube, namespace)
    probe = child(p.parent, holder="planner-a1")  # refused once the policy is in force
    eventually(lambda: p.current.post(p.path, params={"dryRun": "All"}, json=probe).status_code == 403,
               timeout=30, what="the child policies in force")
    yield p
    for client in (p.current, p.other, p.unbound, p.ci):
        client.close()


def test_the_pod_holding_a_run_creates_a_child_of_it_in_its_own_name(pods: Pods) -> None:
    made = _created(pods.current.post(pods.path, json=child(pods.parent)))
    assert made["spec"]["parentRef"]["holder"] == "planner-a2"


def test_a_worker_may_create_no_run_but_a_child_of_the_run_it_holds(pods: Pods) -> None:
    plain = child(pods.parent)
    del plain["spec"]["parentRef"]
    refused(pods.current.post(pods.path, json=plain), CHILD_POLICY, "may create a WorkerRun only as a child")
    # In another attempt's name (a stale pod naming the current holder, or the other way round).
    refused(pods.current.post(pods.path, json=child(pods.parent, holder="planner-a1")), CHILD_POLICY,
            "pod planner-a2 may not spawn a child in the name of planner-a1")
    # A pod of another run, claiming to be an attempt of this one.
    refused(pods.other.post(pods.path, json=child(pods.parent, holder="other-a1")), CHILD_POLICY,
            "pod other-a1 is not an attempt of WorkerRun planner")
    # A token bound to no pod.
    refused(pods.unbound.post(pods.path, json=child(pods.parent)), CHILD_POLICY, "name no pod")
    # Without the classes part 2 judges: a worker's child names its class and its parent's.
    refused(pods.current.post(pods.path, json=child(pods.parent, parent_class=None)), CHILD_POLICY,
            "spec.parentRef.className")
    refused(pods.current.post(pods.path, json=child(pods.parent, class_name=None)), CHILD_POLICY, "(spec.className)")
    # And no finalizer of its own, which would hold the child (and its parent's deletion) up.
    held = child(pods.parent)
    held["metadata"]["finalizers"] = ["example.com/hold"]
    refused(pods.current.post(pods.path, json=held), CHILD_POLICY, "carries no finalizers")


def test_other_accounts_of_the_namespace_create_runs_as_before(pods: Pods) -> None:
    """Review finding: every ServiceAccount of the namespace was taken for a worker and refused a plain run."""
    plain = child(pods.parent, name="ci-run")
    del plain["spec"]["parentRef"]
    del plain["metadata"]["labels"], plain["metadata"]["ownerReferences"]
    _created(pods.ci.post(pods.path, json=plain))


def test_a_child_carries_its_parents_label_and_owner_reference(kube: Kube, pods: Pods) -> None:
    refused(pods.current.post(pods.path, json=child(pods.parent, label=None)), CHILD_POLICY,
            "label tether.dev/parent (planner)", status=422)
    refused(pods.current.post(pods.path, json=child(pods.parent, label="someone")), CHILD_POLICY,
            "label tether.dev/parent", status=422)
    refused(pods.current.post(pods.path, json=child(pods.parent, owner=False)), CHILD_POLICY,
            f"metadata.ownerReferences must name WorkerRun planner with uid {pods.parent['metadata']['uid']}",
            status=422)
    # Anyone's child, not only a worker's: an administrator's too.
    refused(kube.post(pods.path, child(pods.parent, label=None)), CHILD_POLICY, "label tether.dev/parent", status=422)


def test_a_childs_parent_is_fixed_at_creation(kube: Kube, namespace: str, pods: Pods) -> None:
    made = _created(pods.current.post(pods.path, json=child(pods.parent)))
    path = Kube.wr_path(namespace, made["metadata"]["name"])
    resp = kube.patch(path, {"spec": {"parentRef": {"fence": 9}}})
    assert resp.status_code == 422 and "spec.parentRef cannot be changed" in resp.text, resp.text
    plain = runs.create(kube, namespace, runs.example("short-job.yaml"), name="plain")
    resp = kube.patch(Kube.wr_path(namespace, plain["metadata"]["name"]), {"spec": {"parentRef": {
        "name": "planner", "uid": pods.parent["metadata"]["uid"], "holder": "planner-a2", "fence": 3, "depth": 1}}},
        )
    assert resp.status_code == 422 and "cannot be added or removed" in resp.text, resp.text


@pytest.fixture
def classes(kube: Kube) -> Iterator[dict[str, str]]:
    tag = uuid.uuid4().hex[:6]
    names = {"planners": f"planners-{tag}", "search": f"search-{tag}", "shell": f"shell-{tag}",
             "shallow": f"shallow-{tag}"}
    bounds = {"planners": {"childClasses": [names["search"]]}, "search": {}, "shell": {},
              "shallow": {"maxDepth": 1, "childClasses": [names["search"]]}}
    for key, name in names.items():
        kube.ok(kube.post(CLASSES, {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerClass",
                                    "metadata": {"name": name}, "spec": {"bounds": bounds[key]}}))
    yield names
    for name in names.values():
        kube.delete(f"{CLASSES}/{name}")


def test_the_parents_class_says_which_classes_its_children_may_be_of_and_how_deep(
        pods: Pods, classes: dict[str, str]) -> None:
    shell = child(pods.parent, name="planner-c2", class_name=classes["shell"], parent_class=classes["planners"])
    message = eventually(lambda: (r := pods.current.post(pods.path, params={"dryRun": "All"}, json=shell)).status_code
                         == 403 and _message(r), timeout=30, what="the class policy seeing the new classes")
    assert CLASS_POLICY.search(message) and f"lets its runs spawn children of the classes {classes['search']} only" \
        in message and f"is of class {classes['shell']}" in message, message
    none = child(pods.parent, name="planner-c3", class_name=classes["search"], parent_class=classes["search"])
    refused(pods.current.post(pods.path, json=none), CLASS_POLICY, "lets its runs spawn children of no class")
    _created(pods.current.post(pods.path, json=child(pods.parent, name="planner-c4", class_name=classes["search"],
                                                      parent_class=classes["planners"])))
    deep = child(pods.parent, name="planner-c5", class_name=classes["search"], parent_class=classes["shallow"],
                 depth=2)
    refused(pods.current.post(pods.path, json=deep), CLASS_POLICY, "at most 1 deep", "at depth 2")
