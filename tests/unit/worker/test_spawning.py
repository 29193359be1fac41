"""The SDK's spawn (tether.worker.spawning), both flavours, against an in-memory API that stores
what is created as the API server does (201, or 409 and the stored object): the child's body, its
re-attachment by key, a conflicting key, a stale attempt's rejected child, and its result."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from tether.api.models import Signals
from tether.children.api import ANN_SPAWN_DIGEST, LABEL_PARENT, child_name
from tether.children.bodies import Parent
from tether.worker import AsyncWorkerRun, ChildFailed, LeaseLost, SpawnConflict, SpawnRefused, WorkerRun
from tether.worker.transport import Renewal

pytestmark = pytest.mark.unit
PARENT = {"metadata": {"name": "planner", "namespace": "ns", "uid": "u-p"},
          "spec": {"executor": "Pod", "budget": {"capCents": 100, "budgetRef": {"name": "team"}}},
          "status": {"class": {"name": "planners"}, "holder": "planner-a2", "fence": 3}}


class Api:
    """Stores runs by name; spawn answers as POST then GET on 409 do."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, Any]] = {"planner": copy.deepcopy(PARENT)}
        self.posts = 0
        self.lost = False
        self.refuse: str | None = None

    def renew(self, checkpoint: Any, usage: Any, requests: Any = None) -> Renewal:
        return Renewal(ok=False, lost=True, why="gone") if self.lost else Renewal(ok=True, signals=Signals())

    def publish(self, field: str, value: Any) -> bool:
        return True

    def recorded(self, field: str, value: Any) -> bool:
        return False

    def parent(self) -> Parent:
        return Parent.of(self.runs["planner"])

    def spawn(self, key: str, generation: int, spec: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        self.posts += 1
        if self.refuse:
            raise SpawnRefused(self.refuse)
        name = body["metadata"]["name"]
        return copy.deepcopy(self.runs.setdefault(name, copy.deepcopy(body)))

    def read_run(self, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.runs.get(name))

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def end(self, name: str, phase: str, reason: str | None = None, **status: Any) -> None:
        self.runs[name]["status"] = {"phase": phase, **status, "conditions": [
            {"type": "Ready", "status": "False", "reason": reason or phase, "message": f"it ended {phase}"}]}


class AsyncApi(Api):
    async def renew(self, *a: Any) -> Renewal:  # type: ignore[override]
        return Api.renew(self, *a)

    async def parent(self) -> Parent:  # type: ignore[override]
        return Api.parent(self)

    async def spawn(self, *a: Any) -> dict[str, Any]:  # type: ignore[override]
        return Api.spawn(self, *a)

    async def read_run(self, name: str) -> dict[str, Any] | None:  # type: ignore[override]
        return Api.read_run(self, name)


def _run(api: Api, fence: int = 3, attempt: int = 2) -> WorkerRun:
    return WorkerRun(name="planner", namespace="ns", holder=f"planner-a{attempt}", fence=fence, attempt=attempt,
                     lease_duration=30, renew_interval=3600, transport=api)  # type: ignore[arg-type]


def test_a_child_names_its_parent_the_attempt_that_spawned_it_and_its_key() -> None:
    api = Api()
    with _run(api) as run:
        child = run.spawn("search:1", class_name="search", payload={"q": "tether"}, cap_cents=20)
    body = api.runs[child.name]
    assert child.name == child_name("planner", "u-p", "search:1")
    assert body["spec"]["parentRef"] == {"name": "planner", "uid": "u-p", "holder": "planner-a2", "fence": 3,
                                         "depth": 1, "className": "planners"}
    assert body["spec"]["budget"] == {"capCents": 20, "budgetRef": {"name": "team"}}  # the parent's budget
    assert body["metadata"]["labels"] == {LABEL_PARENT: "planner"}
    assert body["metadata"]["ownerReferences"][0]["uid"] == "u-p"


def test_a_resumed_attempt_finds_its_children_by_key_and_a_key_is_one_call() -> None:
    api = Api()
    with _run(api) as run:
        first = run.spawn("search:1", class_name="search", payload={"q": "tether"}, cap_cents=20)
    api.runs[first.name]["status"] = {"phase": "Running", "attempt": 1}  # admitted, and running
    # The parent's next attempt, resumed from its checkpoint, spawns the same call again.
    with _run(api, fence=5, attempt=3) as run:
        again = run.spawn("search:1", class_name="search", payload={"q": "tether"}, cap_cents=20)
        assert again.name == first.name and len(api.runs) == 2
        assert api.runs[first.name]["spec"]["parentRef"]["holder"] == "planner-a2"  # the one made first
        with pytest.raises(SpawnConflict, match="another spec"):
            run.spawn("search:1", class_name="search", payload={"q": "other"}, cap_cents=20)


def test_a_stale_attempts_rejected_child_never_ran_so_the_key_moves_on() -> None:
    api = Api()
    with _run(api) as run:
        stale = run.spawn("shell:1", class_name="shell", cap_cents=5)
    api.end(stale.name, "Rejected", "StaleParent")
    with _run(api, fence=5, attempt=3) as run:
        child = run.spawn("shell:1", class_name="shell", cap_cents=5)
        assert child.name == child_name("planner", "u-p", "shell:1", generation=1) != stale.name
        assert api.runs[child.name]["spec"]["parentRef"]["holder"] == "planner-a3"
        # Again from the same attempt: the same generation, not a third.
        assert run.spawn("shell:1", class_name="shell", cap_cents=5).name == child.name
    # A child that was rejected for another reason, or that ran, keeps its key: its end is the answer.
    api.end(child.name, "Rejected", "TreeBudgetExhausted")
    with _run(api, fence=7, attempt=4) as run:
        with pytest.raises(ChildFailed, match="TreeBudgetExhausted") as failed:
            run.spawn("shell:1", class_name="shell", cap_cents=5).result()
    assert failed.value.reason == "TreeBudgetExhausted"


def test_the_result_reaches_only_an_attempt_that_holds_the_parent() -> None:
    api = Api()
    with _run(api) as run:
        child = run.spawn("search:1", class_name="search", cap_cents=20)
        api.end(child.name, "Succeeded", result={"hits": 3})
        assert child.result(timeout=5, poll=0.01) == {"hits": 3}
        api.lost = True
        run.renew()
        with pytest.raises(LeaseLost):
            child.result(timeout=5, poll=0.01)
        with pytest.raises(LeaseLost):
            run.spawn("search:2", class_name="search", cap_cents=20)  # a stale attempt spawns nothing
    assert api.posts == 1


def test_a_spawn_the_sdk_or_the_api_server_refuses_creates_nothing() -> None:
    api = Api()
    with _run(api) as run:
        with pytest.raises(ValueError, match="cap_cents"):
            run.spawn("search:1", class_name="search")  # the parent is capped: the child names its share
        with pytest.raises(ValueError, match="child key"):
            run.spawn("no spaces", class_name="search", cap_cents=1)
        api.refuse = "WorkerClass planners lets its runs spawn children of the classes search only"
        with pytest.raises(SpawnRefused, match="search only"):
            run.spawn("shell:1", class_name="shell", cap_cents=1)
    assert list(api.runs) == ["planner"]


def test_an_asyncio_parent_spawns_and_awaits_its_child() -> None:
    api = AsyncApi()

    async def main() -> dict[str, Any]:
        run = AsyncWorkerRun(name="planner", namespace="ns", holder="planner-a2", fence=3, attempt=2,
                             lease_duration=30, renew_interval=3600, transport=api)  # type: ignore[arg-type]
        async with run:
            child = await run.spawn("search:1", class_name="search", cap_cents=20)
            api.end(child.name, "Succeeded", result={"hits": 1})
            return await child.result(timeout=5, poll=0.01)

    assert asyncio.run(main()) == {"hits": 1}
    (name,) = [n for n in api.runs if n != "planner"]
    assert api.runs[name]["metadata"]["annotations"][ANN_SPAWN_DIGEST]


def test_a_resumed_attempt_waits_for_the_operators_word_on_an_earlier_attempts_child() -> None:
    """Review finding: the child an earlier attempt spawned, found before the operator judged it, was
    returned, and then failed StaleParent; the call is this attempt's, under the next generation."""
    api = Api()
    with _run(api) as run:
        stale = run.spawn("shell:1", class_name="shell", cap_cents=5)
    reads = {"n": 0}
    read_run = api.read_run

    def judged_on_the_third_read(name: str) -> dict[str, Any] | None:
        reads["n"] += 1
        if name == stale.name and reads["n"] == 3:
            api.end(stale.name, "Rejected", "StaleParent")
        return read_run(name)

    api.read_run = judged_on_the_third_read  # type: ignore[method-assign]
    with _run(api, fence=5, attempt=3) as run:
        child = run.spawn("shell:1", class_name="shell", cap_cents=5)
    assert child.name == child_name("planner", "u-p", "shell:1", generation=1) and reads["n"] >= 3
