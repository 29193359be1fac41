"""Invariant 15 on synthetic audit logs: a child admitted while another attempt held its parent and
then run, a child admitted twice, a child created twice and a ledger that does not add up are each
caught; a clean tree (two children admitted by the holder, one settled) passes."""

from __future__ import annotations

from collections import Counter
from typing import Any

from testkit.oracle_children import judge_children
from tests.unit.oracle.test_oracle import NS, OPERATOR, Log


def _child(name: str, holder: str = "planner-a1", fence: int = 1, ran: bool = True, cents: int = 0) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Succeeded", "attempt": 1,
                              "attempts": [{"attempt": 1, "fence": 1, "usage": {"cents": cents, "tokens": 0}}]} \
        if ran else {"phase": "Rejected", "attempt": 0}
    return {"metadata": {"name": name, "uid": f"u-{name}"},
            "spec": {"parentRef": {"name": "planner", "uid": "u-p", "holder": holder, "fence": fence, "depth": 1}},
            "status": status}


def _create(log: Log, child: dict[str, Any], code: int = 201) -> None:
    log._event("create", "workerruns", child["metadata"]["name"], OPERATOR, code, None, group="tether.dev",
               request={"metadata": {"name": child["metadata"]["name"]}, "spec": child["spec"]})


def _parent(log: Log, holder: str | None, fence: int, live: list[tuple[str, int]], admitted: int,
            spent: int = 0) -> dict[str, Any]:
    body = {"metadata": {"name": "planner", "namespace": NS, "uid": "u-p", "resourceVersion": log._next_rv()},
            "spec": {}, "status": {"holder": holder, "fence": fence, "children": {
                "admitted": admitted, "reservedCents": sum(c for _, c in live), "spentCents": spent,
                "live": [{"name": n, "uid": f"u-{n}", "reservedCents": c} for n, c in live]}}}
    log._event("patch", "workerruns", "planner", OPERATOR, 200, body, "status", "tether.dev")
    return body


def _judge(log: Log, runs: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    found: list[tuple[int, str, str]] = []
    judge_children(log.records, NS, runs, found, Counter())
    return found


def test_a_clean_tree_passes() -> None:
    log = Log()
    a, b = _child("planner-a", cents=7), _child("planner-b")
    _create(log, a)
    _create(log, a, code=409)  # a resumed attempt's re-attach: AlreadyExists
    _create(log, b)
    _parent(log, "planner-a1", 1, [("planner-a", 10)], 1)
    _parent(log, "planner-a1", 1, [("planner-a", 10), ("planner-b", 5)], 2)
    final = _parent(log, "planner-a1", 1, [("planner-b", 5)], 2, spent=7)  # a settled
    assert _judge(log, [final, a, b]) == []


def test_a_stale_attempts_child_that_ran_is_caught() -> None:
    log = Log()
    stale = _child("planner-s", holder="planner-a1", fence=1)
    _create(log, stale)
    final = _parent(log, "planner-a2", 3, [("planner-s", 0)], 1)  # admitted while attempt 2 held the parent
    (v,) = _judge(log, [final, stale])
    assert v[0] == 15 and "a stale attempt's child ran" in v[2]
    # Rejected before it ran: nothing to say.
    log = Log()
    rejected = _child("planner-s", ran=False)
    _create(log, rejected)
    assert _judge(log, [_parent(log, "planner-a2", 3, [], 0), rejected]) == []


def test_a_child_admitted_twice_created_twice_or_unadmitted_is_caught() -> None:
    log = Log()
    a = _child("planner-a")
    _create(log, a)
    _create(log, a)  # two accepted creations of one name
    _parent(log, "planner-a1", 1, [("planner-a", 0)], 1)
    _parent(log, "planner-a1", 1, [], 1)
    final = _parent(log, "planner-a1", 1, [("planner-a", 0)], 1)  # back in after it left
    found = {v[2].split(" (")[0] for v in _judge(log, [final, a])}
    assert "child created 2 times" in found and "child u-planner-a admitted again" in found
    log = Log()
    ghost = _child("planner-g")
    assert [v[2] for v in _judge(log, [_parent(log, "planner-a1", 1, [], 0), ghost])] == [
        "ran without being admitted into its parent's ledger"]


def test_a_ledger_that_does_not_add_up_is_caught() -> None:
    log = Log()
    a = _child("planner-a", cents=7)
    _create(log, a)
    _parent(log, "planner-a1", 1, [("planner-a", 10)], 1)
    final = _parent(log, "planner-a1", 1, [], 1, spent=3)  # settled, but 7 spent
    assert any("is not what its settled children spent (7, 0)" in v[2] for v in _judge(log, [final, a]))
    final["status"]["children"]["reservedCents"] = 4  # nothing live, 4 held
    assert any("reservedCents 4 is not the sum" in v[2] for v in _judge(log, [final, a]))
