"""Child runs end to end on the local cluster: a planner of a planners class spawns its tool calls
as children of a tools class, crashes after the second result, resumes and re-attaches to all
three (none created twice, none run twice: the children's own records and the fenced receiver),
and completes with their results; its ledger settles each child once. A stale parent attempt (its
pod alive, its token valid) spawns a child the API server admits and the operator rejects: nothing
of it runs. A spawn past what the tree has left is refused before it starts."""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.cluster.test_admission_policy import _bound_token, _client
from tether.children.api import LABEL_PARENT
from tether.children.bodies import Parent, child_body
from testkit import runs
from testkit.audit import AuditLog
from testkit.kube import Kube, eventually
from testkit.oracle import TrialFacts, judge
from testkit.receiver import Receiver
from testkit.scenario import app_run, lines

CLASSES = "/apis/tether.dev/v1alpha1/workerclasses"


@pytest.fixture
def classes(kube: Kube) -> Iterator[dict[str, str]]:
    tag = uuid.uuid4().hex[:6]
    names = {"planners": f"planners-{tag}", "tools": f"tools-{tag}"}
    for key, bounds in (("planners", {"childClasses": [names["tools"]], "maxChildren": 5}), ("tools", {})):
        kube.ok(kube.post(CLASSES, {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerClass",
                                    "metadata": {"name": names[key]}, "spec": {"bounds": bounds}}))
    yield names
    for name in names.values():
        kube.delete(f"{CLASSES}/{name}")


def planner(classes: dict[str, str], calls: list[dict[str, Any]], out: Path, cap: int | None = None,
            crash_after: int | None = None) -> dict[str, Any]:
    tool = app_run("tool", {})["spec"]["template"]
    body = app_run("planner", {"calls": calls, "childTemplate": tool, "outFile": str(out),
                               **({"crashAfter": crash_after} if crash_after else {})}, duration=10, renew=2)
    body["spec"]["template"]["spec"]["containers"][0]["command"] = ["python", "tests/support/planner_app.py"]
    body["spec"]["className"] = classes["planners"]
    if cap is not None:
        body["spec"]["budget"] = {"capCents": cap}
    return body


def children(kube: Kube, ns: str) -> list[dict[str, Any]]:
    return kube.ok(kube.get(Kube.wr_path(ns), params={"labelSelector": f"{LABEL_PARENT}=planner"}))["items"]


def test_a_planner_that_crashes_re_attaches_to_its_children_and_completes_with_their_results(
        kube: Kube, namespace: str, operator, classes: dict[str, str], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    receiver = Receiver()
    try:
        calls = [{"key": f"search:{i}", "className": classes["tools"], "capCents": 10,
                  "payload": {"workSeconds": 1 + 2 * i, "effectUrl": receiver.url,
                              "outFile": str(tmp_path / f"tool-{i}.jsonl")}} for i in range(3)]
        out = tmp_path / "planner.jsonl"
        runs.create(kube, namespace, planner(classes, calls, out, cap=100, crash_after=2))
        done = runs.wait_phase(kube, namespace, "planner", ("Succeeded", "Failed", "Lost"), timeout=180)
        s = done["status"]
        assert s["phase"] == "Succeeded", s
        assert [a["attempt"] for a in s["attempts"]] == [1, 2]  # the crash, then the resumed attempt
        assert set(s["result"]["results"]) == {"search:0", "search:1", "search:2"}
        events = lines(out)
        spawned = {(e["attempt"], e["key"]): e["child"] for e in events if e["event"] == "spawned"}
        # Attempt 2 spawned the same three calls and found the same three children.
        assert {k: v for (a, k), v in spawned.items() if a == 1} == {k: v for (a, k), v in spawned.items() if a == 2}
        made = children(kube, namespace)
        assert sorted(c["metadata"]["name"] for c in made) == sorted({v for v in spawned.values()})
        for c in made:
            cs = c["status"]
            assert cs["phase"] == "Succeeded" and len(cs["attempts"]) == 1, cs  # none ran twice
            assert c["spec"]["parentRef"]["holder"] in ("planner-a1", "planner-a2")
        # The fenced receiver: one side effect per child, each accepted once.
        accepted = receiver.accepted()
        assert sorted(e.key for e in accepted) == sorted(f"{c['metadata']['uid']}:deliver" for c in made)
        # The ledger: three admitted, all settled, what they spent counted once. The last child's
        # settlement may land after its parent's end (its books close once its own attempt has
        # ended and its Lease is cleared, which the parent does not wait for).
        def settled() -> dict[str, Any] | None:
            ledger = runs.get(kube, namespace, "planner")["status"]["children"]
            return None if ledger.get("live") else ledger
        tree = eventually(settled, timeout=30, what="every child settled")
        assert (tree["admitted"], tree.get("live", []), tree.get("reservedCents", 0)) == (3, [], 0)
        # The oracle, from the audit log and the final objects (invariant 15 among the rest).
        final = kube.ok(kube.get(Kube.wr_path(namespace)))["items"]
        verdict = judge(AuditLog.from_env(namespace=namespace).read(), TrialFacts(namespace=namespace, runs=final))
        assert verdict.ok, verdict.violations
        assert verdict.stats["child runs that ran"] == 3 and verdict.stats["child runs settled"] == 3
        # Each child's end is said on the parent.
        said = eventually(lambda: e if len(e := kube.ok(kube.get(f"/api/v1/namespaces/{namespace}/events", params={
            "fieldSelector": "involvedObject.name=planner,reason=ChildEnded"}))["items"]) == 3 else None,
            timeout=30, what="three ChildEnded events on the parent")
        assert sorted(c["metadata"]["name"] for c in made) == sorted(e["message"].split()[2] for e in said)
        assert all("ended Succeeded" in e["message"] for e in said)
    finally:
        receiver.close()


def test_a_stale_parent_attempts_child_is_rejected_and_nothing_of_it_runs(
        kube: Kube, namespace: str, operator, classes: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    """Attempt 1's pod never starts (no scheduler takes it): its startup grace lapses and the run
    moves on. Its token, bound to a pod that still exists (a finalizer holds it), still works: the
    API server admits its spawn (it is that attempt), and the operator, reading the parent, rejects it."""
    body = app_run("planner", {}, duration=8, renew=1)
    spec = body["spec"]
    spec["className"] = classes["planners"]
    spec["lease"]["startupGraceSeconds"] = 5
    spec["template"]["spec"]["schedulerName"] = "tether-test-parked"
    spec["template"]["metadata"]["labels"] = {}
    parent = runs.create(kube, namespace, body)
    pod_path = f"/api/v1/namespaces/{namespace}/pods/planner-a1"
    pod = kube.wait_for(f"/api/v1/namespaces/{namespace}/pods", "planner-a1", lambda p: True, 30, "attempt 1's pod")
    kube.ok(kube.patch(pod_path, {"metadata": {"finalizers": ["tether.dev/test-hold"]}}))
    stale = _client(kube, _bound_token(kube, namespace, pod["spec"]["serviceAccountName"], pod))
    try:
        eventually(lambda: runs.get(kube, namespace, "planner")["status"].get("holder") != "planner-a1",
                   timeout=60, what="attempt 1 revoked")
        me = Parent.of({**parent, "status": {"class": {"name": classes["planners"]}}})
        child = child_body(me, namespace, "planner-a1", 1, "search:1", 0,
                           {"executor": "External", "className": classes["tools"]})
        made = stale.post(Kube.wr_path(namespace), json=child)
        assert made.status_code == 201, made.text  # the API server: this pod is attempt 1 of the parent
        rejected = runs.wait_phase(kube, namespace, child["metadata"]["name"], "Rejected", timeout=30)
        ready = next(c for c in rejected["status"]["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == "StaleParent" and "planner-a1 at fence 1" in ready["message"], ready
        assert rejected["status"].get("attempt", 0) == 0 and not rejected["status"].get("holder")
        parent_now = runs.get(kube, namespace, "planner")["status"]
        assert not (parent_now.get("children") or {}).get("admitted")
    finally:
        stale.close()
        kube.patch(pod_path, {"metadata": {"finalizers": None}})


def test_a_spawn_past_what_the_tree_has_left_is_refused_before_it_starts(
        kube: Kube, namespace: str, operator, classes: dict[str, str], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    calls = [{"key": "big", "className": classes["tools"], "capCents": 80, "payload": {"workSeconds": 1}},
             {"key": "bigger", "className": classes["tools"], "capCents": 30, "payload": {"workSeconds": 1}}]
    out = tmp_path / "planner.jsonl"
    runs.create(kube, namespace, planner(classes, calls, out, cap=100))
    done = runs.wait_phase(kube, namespace, "planner", ("Succeeded", "Failed"), timeout=120)
    results = done["status"]["result"]["results"]
    # Together they ask for 110 of 100: whichever the operator admits first runs, the other asks for
    # more than the tree has left and never starts (spawned at once, either may be first).
    assert sorted(str(r) for r in results.values()) == sorted(["{'attempt': 1}", "{'failed': 'TreeBudgetExhausted'}"])
    (refused,) = [c for c in children(kube, namespace) if (c.get("status") or {}).get("phase") == "Rejected"]
    assert refused["status"].get("attempt", 0) == 0 and not refused["status"].get("attempts")
    left = 100 - (80 if refused["metadata"]["annotations"]["tether.dev/child-key"] == "bigger" else 30)
    message = next(c["message"] for c in refused["status"]["conditions"] if c["type"] == "Ready")
    assert f"has {left} left" in message, message


def test_stopping_the_parent_stops_its_running_children(
        kube: Kube, namespace: str, operator, classes: dict[str, str], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    calls = [{"key": "slow", "className": classes["tools"], "capCents": 10,
              "payload": {"holdAttempts": [1], "holdSeconds": 300, "stopOnSignal": True,
                          "outFile": str(tmp_path / "slow.jsonl")}}]
    runs.create(kube, namespace, planner(classes, calls, tmp_path / "planner.jsonl", cap=50))
    (slow,) = eventually(lambda: [c for c in children(kube, namespace)
                                  if (c.get("status") or {}).get("phase") == "Running"] or None,
                         timeout=90, what="the child running")
    kube.ok(kube.patch(Kube.wr_path(namespace, "planner"), {"spec": {"stop": True}}))
    ended = runs.wait_phase(kube, namespace, slow["metadata"]["name"], ("Cancelled", "Failed", "Succeeded"), timeout=60)
    assert ended["status"]["phase"] == "Cancelled" and "parent planner" in ended["status"]["attempts"][-1]["message"]
    assert any(e["event"] == "stopped" for e in lines(tmp_path / "slow.jsonl"))  # told, and it left with its grace
    parent = runs.wait_phase(kube, namespace, "planner", "Cancelled", timeout=60)
    assert copy.deepcopy(parent["status"]["children"]["admitted"]) == 1


def test_suspending_the_parent_suspends_its_children_and_resuming_it_resumes_them(
        kube: Kube, namespace: str, operator, classes: dict[str, str], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    calls = [{"key": "slow", "className": classes["tools"], "capCents": 10,
              "payload": {"holdAttempts": [1], "holdSeconds": 300, "outFile": str(tmp_path / "slow.jsonl")}}]
    runs.create(kube, namespace, planner(classes, calls, tmp_path / "planner.jsonl", cap=50))
    (slow,) = eventually(lambda: [c for c in children(kube, namespace)
                                  if (c.get("status") or {}).get("phase") == "Running"] or None,
                         timeout=90, what="the child running")
    name = slow["metadata"]["name"]
    kube.ok(kube.patch(Kube.wr_path(namespace, "planner"), {"spec": {"suspend": True}}))
    paused = kube.wait_for(Kube.wr_path(namespace), name, lambda r: r["spec"].get("suspend") is True, 30,
                           "the child suspended with its parent")
    assert paused["metadata"]["annotations"]["tether.dev/suspended-by-parent"] == "true"
    # Its worker is told to pause (the signal on its heartbeat), and keeps its lease.
    eventually(lambda: any(e.get("event") == "signals" and e.get("paused") for e in lines(tmp_path / "slow.jsonl")),
               timeout=30, what="the child's worker told to pause")
    kube.ok(kube.patch(Kube.wr_path(namespace, "planner"), {"spec": {"suspend": False}}))
    resumed = kube.wait_for(Kube.wr_path(namespace), name, lambda r: r["spec"].get("suspend") is False, 30,
                            "the child resumed with its parent")
    assert "tether.dev/suspended-by-parent" not in (resumed["metadata"].get("annotations") or {})
    assert resumed["status"]["attempt"] == 1  # the same attempt went on


def _ready(run: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in (run.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), {})


def test_a_parent_whose_own_spending_reaches_what_its_tree_leaves_pauses_and_a_raised_cap_resumes_it(
        kube: Kube, namespace: str, operator, classes: dict[str, str], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The tree's cap with onExhausted: Pause. The child holds 20 of the parent's 30; the parent's own
    15 cents go past the 10 its tree leaves it: the parent (not the child, whose share is its own)
    pauses, keeping its lease, and says what to raise; raised, the same attempt goes on and completes."""
    calls = [{"key": "slow", "className": classes["tools"], "capCents": 20,
              "payload": {"holdAttempts": [1], "holdSeconds": 300, "gateFile": str(tmp_path / "gate"),
                          "outFile": str(tmp_path / "slow.jsonl")}}]
    body = planner(classes, calls, tmp_path / "planner.jsonl")
    body["spec"]["payload"]["spendCents"] = 15
    body["spec"]["budget"] = {"capCents": 30, "onExhausted": "Pause"}
    runs.create(kube, namespace, body)
    paused = kube.wait_for(Kube.wr_path(namespace), "planner", lambda r: _ready(r).get("reason") == "BudgetPaused",
                           90, "the parent paused for its tree's cap")
    assert paused["status"]["phase"] == "Running" and paused["status"]["holder"] == "planner-a1"
    suspended = next(c for c in paused["status"]["conditions"] if c["type"] == "Suspended")
    assert suspended["status"] == "True" and "30" in suspended["message"], suspended
    (child,) = children(kube, namespace)
    assert child["status"]["phase"] == "Running" and _ready(child).get("reason") != "BudgetPaused"  # its share is its own
    assert paused["status"]["children"]["reservedCents"] == 20
    kube.ok(kube.patch(Kube.wr_path(namespace, "planner"), {"spec": {"budget": {"capCents": 60}}}))
    kube.wait_for(Kube.wr_path(namespace), "planner", lambda r: _ready(r).get("reason") != "BudgetPaused", 30,
                  "the parent resumed")
    (tmp_path / "gate").touch()
    done = runs.wait_phase(kube, namespace, "planner", ("Succeeded", "Failed", "BudgetExceeded"), timeout=90)
    assert done["status"]["phase"] == "Succeeded" and len(done["status"]["attempts"]) == 1, done["status"]
    resumed = next(c for c in done["status"]["conditions"] if c["type"] == "Suspended")
    assert (resumed["status"], resumed["reason"]) == ("False", "Resumed")


def test_deleting_the_parent_deletes_its_children_and_charges_every_one_exactly_once(
        kube: Kube, namespace: str, operator, classes: dict[str, str], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two children spending while their parent is deleted: each is stopped and charged its final
    report once (as is the parent) to the tree's WorkerBudget, and only then gone. Judged by the
    oracle over the audit log: every run's charge equals its last accepted report."""
    kube.ok(kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{namespace}/workerbudgets", {
        "apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget", "metadata": {"name": "team"},
        "spec": {"limitCents": 10_000}}))
    calls = [{"key": f"spender:{i}", "className": classes["tools"], "capCents": 40,
              "payload": {"holdAttempts": [1], "holdSeconds": 300, "usagePerSecond": 1, "stopOnSignal": True}}
             for i in range(2)]
    body = planner(classes, calls, tmp_path / "planner.jsonl")
    body["spec"]["payload"]["spendCents"] = 3
    body["spec"]["budget"] = {"capCents": 100, "budgetRef": {"name": "team"}}
    runs.create(kube, namespace, body)
    eventually(lambda: len([c for c in children(kube, namespace) if ((c.get("status") or {}).get("usage") or {}).get("cents", 0) >= 2
                            ]) == 2, timeout=90, what="both children spending")
    kube.ok(kube.delete(Kube.wr_path(namespace, "planner")))
    eventually(lambda: not kube.ok(kube.get(Kube.wr_path(namespace)))["items"], timeout=120,
               what="the parent and its children gone")
    budget = kube.ok(kube.get(f"/apis/tether.dev/v1alpha1/namespaces/{namespace}/workerbudgets/team"))
    verdict = judge(AuditLog.from_env(namespace=namespace).read(),
                    TrialFacts(namespace=namespace, runs=[], budgets=[budget]))
    assert verdict.ok, verdict.violations
    # All three ended (stopped) before they went, and the budget holds exactly what they reported. The
    # ledger of a parent that is gone is not kept up: the children charge the budget themselves.
    assert verdict.stats["attempts ended Cancelled"] == 3, verdict.stats
    spent = budget["status"]["spent"]["cents"]
    assert spent >= 3 + 2 * 2 and verdict.stats["cents charged to budgets"] == spent, (spent, verdict.stats)
