"""The controller layer around a re-created namesake, interrupted revocations and report folds
(review of the seed-378 fix). The Kubernetes side is a small in-memory fake: these pin what the
controller asks before it writes, not the API server's behaviour (the e2e and chaos tests do)."""

from __future__ import annotations

import types

import asyncio
import datetime as dt
from typing import Any

import pytest

from tether.api import constants as c
from tether.api.models import WorkerRun
from tether.controller.controller import Clock, RunController
from tether.controller.errors import Again
from tether.controller.snapshot import foreign_pod
from tether.core.cleanup import revocation_unfinished
from tether.core.decide import EnsureLease, LeaseObservation, Observed, decide
from tether.kube.paths import budget_path, lease_path, pod_path, run_path
from testkit.fakeapi import FakeApi, Request

T0 = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.timezone.utc)


def fake_api(*objects: dict[str, Any], now: dt.datetime = T0) -> FakeApi:
    """The unit tests' fake API holding `objects` (runs, pods, Leases, budgets) as created."""
    api = FakeApi(now=lambda: now)
    for obj in objects:
        api.put(object_path(obj), obj)
    return api


def object_path(obj: dict[str, Any]) -> str:
    meta, kind = obj["metadata"], obj.get("kind", "WorkerRun")
    return {"WorkerRun": run_path, "Pod": pod_path, "Lease": lease_path, "WorkerBudget": budget_path}[kind](
        meta["namespace"], meta["name"])


def controller(api: FakeApi, **kw: Any) -> RunController:
    """The controller on the fake API, through the operator's own client."""
    return RunController(api.client(), clock=Clock(now=lambda: T0, mono=lambda: 100.0), **kw)


def _held(api: FakeApi, obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the API holds it (its resourceVersion and UID), as a watch would bring it."""
    held = api.get(object_path(obj))
    assert held is not None
    return held


async def reconcile(ctl: RunController, key: tuple[str, str]) -> tuple[float | None, bool]:
    """One pass of the run reconciler: (seconds to the next timed pass, whether it acted)."""
    result = await ctl.reconciler.reconcile(key)
    return result.requeue_after, result.acted


def _old_pod(deleting: dt.datetime | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "job-a1", "namespace": "ns", "uid": "pod-old", "resourceVersion": "5",
                            "labels": {c.LABEL_RUN: "job", c.LABEL_ATTEMPT: "1"},
                            "ownerReferences": [{"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
                                                 "name": "job", "uid": "run-OLD", "controller": True}]}
    if deleting is not None:
        meta["deletionTimestamp"] = deleting.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": {"phase": "Running"}}


def _new_run() -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
            "metadata": {"name": "job", "namespace": "ns", "uid": "run-NEW", "generation": 1,
                         "resourceVersion": "9", "finalizers": [c.RUN_FINALIZER]},
            "spec": {"template": {"spec": {"containers": [{"name": "w", "command": ["w"]}]}},
                     "lease": {"durationSeconds": 20, "renewIntervalSeconds": 5, "startupGraceSeconds": 30}},
            "status": {}}


def test_a_namesakes_pod_the_watch_has_not_delivered_holds_the_grant() -> None:
    """After a restart the run watch may list the re-created run before the pod watch lists the
    old run's pod job-a1: the grant must look for that pod itself before it writes anything."""
    api = fake_api(_new_run(), _old_pod())

    async def go() -> RunController:
        ctl = controller(api)
        ctl.on_run("ADDED", _held(api, _new_run()))
        with pytest.raises(Again):
            await reconcile(ctl, ("ns", "job"))
        assert api.asked("workerruns", "pods", "leases", writes=True) == []  # the pod read came first, and nothing was written
        # Now it knows the pod: it waits until the pod's token is dead; the stray queue deletes it.
        requeue, _ = await reconcile(ctl, ("ns", "job"))
        assert requeue == 1.0  # not being deleted yet
        assert len(ctl.stray_queue) == 1  # the pod of a deleted run waits on the stray queue
        await ctl.stray_loop.reconciler.reconcile(("ns", "job"))
        requeue, _ = await reconcile(ctl, ("ns", "job"))
        # Deleted with the default 30 s grace period: its token is accepted until 85 s past that.
        assert requeue == pytest.approx(30.0 + 85.0)
        return ctl

    ctl = asyncio.run(go())
    # No Lease, no pod: only the status that says why the run waits (pod not deleted, then terminating).
    assert api.asked("workerruns", "pods", "leases", writes=True) == ["PUT workerruns/job/status", "DELETE pods/job-a1",
                                      "PUT workerruns/job/status"], api.calls
    assert "GET pods/job-a1" in api.asked("pods")
    assert "job-a1" in ctl.cache.pods_of(("ns", "job"))


def test_a_deleted_namesakes_pod_holds_the_grant_for_the_token_cache_after_it_is_gone() -> None:
    """The pod's DELETED event: its token may still authenticate from the API server's 10 s
    cache and lister lag, so the name stays taken for 20 s; after that the run is granted."""
    now = [T0]
    api = fake_api(_new_run())

    async def go() -> None:
        ctl = RunController(api.client(), clock=Clock(now=lambda: now[0], mono=lambda: 100.0))
        ctl.on_pod("ADDED", _old_pod())
        ctl.on_pod("DELETED", _old_pod(deleting=T0))
        ctl.on_run("ADDED", _held(api, _new_run()))
        requeue, acted = await reconcile(ctl, ("ns", "job"))
        assert acted and requeue == pytest.approx(20.0)  # acted: it said why it waits
        status = ctl.cache.runs[("ns", "job")]["status"]
        assert status["phase"] == "Pending" and "job-a1" in status["conditions"][-1]["message"]
        now[0] = T0 + dt.timedelta(seconds=21)
        await reconcile(ctl, ("ns", "job"))

    asyncio.run(go())
    writes = api.asked("workerruns", "pods", "leases", writes=True)
    assert writes[:3] == ["PUT workerruns/job/status", "PUT workerruns/job/status", "POST leases/job"], api.calls
    assert "GET pods/job-a1" in api.asked("pods")  # the grant looked for the name itself


def test_the_grant_waits_past_the_token_leeway_and_the_auth_cache() -> None:
    """A bound token is accepted while deletionTimestamp >= now - 60 s, and a success is cached
    10 s: a renewal validated at D+59.9 s still works at D+69.9 s."""
    run = WorkerRun.model_validate(_new_run())
    for ago, blocked in ((69.0, True), (80.0, True), (86.0, False)):
        pod = foreign_pod(_old_pod(deleting=T0 - dt.timedelta(seconds=ago)))
        d = decide(Observed(run=run, lease=None, pods=(), now=T0, mono=100.0, foreign_pods=(pod,)))
        assert any(isinstance(a, EnsureLease) for a in d.actions) is not blocked, ago


def test_the_tool_claim_horizon_covers_the_token_lifetime_and_leeway() -> None:
    """A tool-claim token minted as the attempt ended (600 s) is accepted until about +670 s."""
    cleared = LeaseObservation(holder=None, fence=2, resource_version="9", last_change=100.0, renewed=False)
    for ago, pending in ((610.0, True), (700.0, True), (725.0, False)):
        ended = (T0 - dt.timedelta(seconds=ago)).isoformat()
        run = WorkerRun.model_validate({**_new_run(), "spec": {"executor": "External", "lease": {
            "durationSeconds": 20, "renewIntervalSeconds": 5}}, "status": {
            "phase": "Backoff", "attempt": 1, "fence": 2, "holder": None, "startedAt": ended,
            "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "startedAt": ended, "endedAt": ended,
                          "outcome": "LeaseLost"}]}})
        assert revocation_unfinished(Observed(run=run, lease=cleared, pods=(), now=T0, mono=200.0)) is pending, ago


def _lease(usage: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"name": "job", "namespace": "ns", "resourceVersion": rv, "labels": {c.LABEL_RUN: "job"},
                         "annotations": {c.ANN_USAGE: usage},
                         "ownerReferences": [{"kind": "WorkerRun", "uid": "run-NEW", "controller": True}]},
            "spec": {"holderIdentity": "job-a1", "leaseTransitions": 1}}


def test_a_report_is_folded_within_a_fold_interval_but_never_cuts_an_error_backoff_short() -> None:
    async def go() -> tuple[float, float, float]:
        ctl = RunController(types.SimpleNamespace(), clock=Clock(now=lambda: T0), fold_interval=10.0)  # type: ignore[arg-type]
        key = ("ns", "job")
        ctl.cache.runs.store(key, _new_run())
        ctl.on_lease("MODIFIED", _lease('{"cents":1,"tokens":1}', "1"))
        ctl.on_lease("MODIFIED", _lease('{"cents":1,"tokens":1}', "2"))  # the first renewal
        ctl.queue._timers.clear()
        ctl.on_lease("MODIFIED", _lease('{"cents":2,"tokens":1}', "3"))  # new usage
        fold = ctl.queue._timers[key][0] - ctl.queue.mono()
        ctl.queue._timers.pop(key)[1].cancel()
        for _ in range(13):
            ctl.queue.backoff.when(key)
        delay = ctl.queue.add_rate_limited(key)  # failing reconciles, backed off to the cap
        ctl.on_lease("MODIFIED", _lease('{"cents":3,"tokens":1}', "4"))
        due = ctl.queue._timers[key][0] - ctl.queue.mono()
        for _, handle in ctl.queue._timers.values():
            handle.cancel()
        return fold, delay, due

    fold, delay, due = asyncio.run(go())
    assert 9.0 < fold <= 10.0
    assert due > delay - 1, f"a backoff of {delay}s replaced by a pass in {due:.1f}s"


def _budget(spent: int, exhausted: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"name": "team", "namespace": "ns", "generation": 1, "resourceVersion": rv},
            "spec": {"limitCents": 100},
            "status": {"spent": {"cents": spent, "tokens": 0}, "periodStart": None,
                       "conditions": [{"type": "Exhausted", "status": exhausted}]}}


def test_a_charge_wakes_only_the_runs_waiting_for_admission_and_running_out_wakes_all() -> None:
    """Every fold of every run charges the budget: waking every run on it per charge made the
    work per heartbeat grow with the number of runs sharing the budget."""
    def run(name: str, budget: str, holder: str | None) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "resourceVersion": "1"},
                "spec": {"budget": {"budgetRef": {"name": budget}}}, "status": {"holder": holder}}

    async def go() -> list[list[Any]]:
        ctl = RunController(types.SimpleNamespace(), clock=Clock(now=lambda: T0))  # type: ignore[arg-type]
        for body in (run("held", "team", "held-a1"), run("waiting", "team", None), run("other", "else", None)):
            ctl.on_run("ADDED", body)
        seen = []
        for budget in (_budget(10, "False", "1"), _budget(20, "False", "2"), _budget(100, "True", "3")):
            ctl.queue._queue.clear()
            ctl.queue._dirty.clear()
            ctl.on_budget("MODIFIED", budget)
            seen.append(sorted(k[1] for k in ctl.queue._queue))
        return seen

    first, charge, exhausted = asyncio.run(go())
    assert first == ["held", "waiting"]  # first sight: everyone on it
    assert charge == ["waiting"]
    assert exhausted == ["held", "waiting"]


def test_a_grant_never_overwrites_a_lease_that_still_names_an_ended_attempt() -> None:
    """Seed 7: a leader revoked attempt 1 (status: fence 2, holder none) and lost leadership
    before clearing the Lease; the frozen worker thawed and reported 2 cents on the uncleared
    Lease. The new leader's cache had no Lease yet: it granted attempt 2 over it, and the 2 cents
    were never charged. The grant reads the Lease first: clear it (keeping the report), settle."""
    ended = (T0 - dt.timedelta(seconds=5)).isoformat()
    run = {**_new_run(), "status": {
        "phase": "Backoff", "attempt": 1, "fence": 2, "holder": None, "startedAt": ended,
        "nextAttemptAt": ended, "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "pod": "job-a1",
                                              "startedAt": ended, "endedAt": ended, "outcome": "LeaseLost"}]}}
    uncleared = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": "job", "namespace": "ns", "resourceVersion": "7", "labels": {c.LABEL_RUN: "job"},
                              "annotations": {c.ANN_USAGE: '{"cents":2,"tokens":0}'},
                              "ownerReferences": [{"kind": "WorkerRun", "name": "job", "uid": "run-NEW",
                                                   "controller": True}]},
                 "spec": {"holderIdentity": "job-a1", "leaseTransitions": 1, "leaseDurationSeconds": 20}}

    api = fake_api(run, uncleared)

    async def go() -> None:
        ctl = controller(api)
        ctl.on_run("ADDED", _held(api, run))  # the Lease is not in this operator's cache
        with pytest.raises(Again):
            await reconcile(ctl, ("ns", "job"))
        assert api.asked("workerruns", "pods", "leases", writes=True) == []  # nothing granted
        await reconcile(ctl, ("ns", "job"))  # now it sees the Lease: clear it first

    asyncio.run(go())
    assert api.asked("workerruns", "pods", "leases", writes=True)[0] == "PUT leases/job", api.calls
    lease = _held(api, uncleared)
    assert (lease["spec"]["holderIdentity"], lease["spec"]["leaseTransitions"]) == (None, 2)  # cleared, fence 2
    assert lease["metadata"]["annotations"][c.ANN_USAGE] == '{"cents":2,"tokens":0}'  # the report kept


def test_the_books_close_only_against_a_fresh_lease_and_budget() -> None:
    """Review of the bounded ledger: after a restart the run watch may come before the Lease
    watch. The run is finished; its cleared Lease still holds the worker's last report (10 cents,
    the status says 7). Recording budgetCharged (and releasing the mark, and the TTL deletion)
    from that view would close the books on 7 cents. Before any of them the Lease is read: the
    report is settled first. Likewise a cached budget older than our own charge must not let the
    run go while its mark is still in the ledger."""
    finished = {**_new_run(), "spec": {**_new_run()["spec"], "budget": {"budgetRef": {"name": "team"}},
                                       "ttlSecondsAfterFinished": 0},
                "status": {"phase": "Succeeded", "attempt": 1, "fence": 2, "holder": None,
                           "finishedAt": T0.isoformat(), "usage": {"cents": 7, "tokens": 0},
                           "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "pod": "job-a1",
                                         "endedAt": T0.isoformat(), "outcome": "Succeeded",
                                         "usage": {"cents": 7, "tokens": 0}}]}}
    cleared = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
               "metadata": {"name": "job", "namespace": "ns", "resourceVersion": "8", "labels": {c.LABEL_RUN: "job"},
                            "annotations": {c.ANN_USAGE: '{"cents":10,"tokens":0}', c.ANN_FENCE: "2"},
                            "ownerReferences": [{"kind": "WorkerRun", "name": "job", "uid": "run-NEW",
                                                 "controller": True}]},
               "spec": {"holderIdentity": None, "leaseTransitions": 2, "leaseDurationSeconds": 20}}
    budget = {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget",
              "metadata": {"name": "team", "namespace": "ns", "resourceVersion": "3"},
              "spec": {"limitCents": 100},
              "status": {"spent": {"cents": 7, "tokens": 0}, "charges": {"run-NEW": {"run": "job", "cents": 7}}}}

    api = fake_api(finished, cleared, budget)

    async def go() -> None:
        ctl = controller(api)
        ctl.on_budget("ADDED", _held(api, budget))
        ctl.on_run("ADDED", _held(api, finished))  # no Lease in the cache yet
        with pytest.raises(Again):
            await reconcile(ctl, ("ns", "job"))  # about to record budgetCharged on 7 cents: read first
        assert api.asked("workerruns", "leases", "workerbudgets", writes=True) == []
        await reconcile(ctl, ("ns", "job"))  # the 10 cents are settled into the status
        settled = ctl.cache.runs[("ns", "job")]["status"]
        assert settled["usage"]["cents"] == 10 and not settled.get("budgetCharged")
        # The run is charged in full and released; then a stale budget event brings the mark back.
        charged = _held(api, finished)
        charged["status"] = {**settled, "budgetCharged": True, "charged": {"cents": 10, "tokens": 0}}
        ctl.on_run("MODIFIED", _held(api, api.put(run_path("ns", "job"), charged)))
        now_held = _held(api, budget)
        now_held["status"] = {"spent": {"cents": 10, "tokens": 0}, "charges": {"run-NEW": {"run": "job", "cents": 10}}}
        api.put(budget_path("ns", "team"), now_held)  # the API's budget still holds the mark
        ctl.on_budget("MODIFIED", {**now_held, "metadata": {**now_held["metadata"], "resourceVersion": "1"},
                                   "status": {"spent": {"cents": 10, "tokens": 0}, "charges": {}}})
        with pytest.raises(Again):
            await reconcile(ctl, ("ns", "job"))  # TTL due, but the fresh budget still holds its mark

    asyncio.run(go())
    # The settle; no deletion while the mark is in the ledger.
    assert api.asked("workerruns", "leases", "workerbudgets", writes=True) == ["PUT workerruns/job/status"], api.calls


def test_a_deposed_leader_stops_writing_in_the_middle_of_a_pass() -> None:
    """Issue 21, defect 6: leadership was checked once per reconcile, so a pass already under way
    when the Lease of leadership was lost went on writing (Lease, pod) without preconditions.
    Now every action checks it: the grant's status write lands (a compare-and-swap), then
    leadership is gone, and nothing after it is written."""
    leader = [True]

    api = fake_api(_new_run())

    def depose(req: Request) -> None:
        if req.method == "PUT" and req.path.endswith("/status"):
            leader[0] = False  # deposed while the status write was in flight (it lands)
        return None

    api.before(depose)

    async def go() -> Any:
        ctl = controller(api, may_act=lambda: leader[0])
        ctl.on_run("ADDED", _held(api, _new_run()))
        key = ("ns", "job")
        await ctl.loop.process(key)
        return ctl.queue

    queue = asyncio.run(go())
    writes = api.asked("workerruns", "pods", "leases", writes=True)
    assert writes == ["PUT workerruns/job/status"], api.calls  # no Lease, no pod by a replica no longer leading
    assert queue.pending_timers() == 1  # the key comes back once this replica may act again (or it exits)
