"""The budget's ledger is bounded by live runs: a run charged in full records that, and the amount
(status.charged), then leaves the ledger; whatever comes later (late usage settled, a pass on an
old snapshot, another replica) is charged from that amount, never from zero."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest

from tether.api.models import ObjectMeta, Usage, WorkerBudget, WorkerBudgetSpec, WorkerRun
from tether.controller.budgets import BudgetBook
from tether.core import budget as b
from tether.core.decide import BudgetObservation, ChargeBudget, Observed, ReleaseCharge, WriteStatus, decide
from tether.kube.paths import budget_path
from testkit.fakeapi import FakeApi, Request

T0 = dt.datetime(2026, 11, 30, 12, tzinfo=dt.timezone.utc)


def _run(status: dict[str, Any]) -> WorkerRun:
    return WorkerRun.model_validate({
        "metadata": {"name": "job", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": {"executor": "External", "budget": {"budgetRef": {"name": "team"}},
                 "lease": {"durationSeconds": 20, "renewIntervalSeconds": 5}},
        "status": {"phase": "Succeeded", "attempt": 1, "fence": 2, "usage": {"cents": 7, "tokens": 0},
                   "finishedAt": T0.isoformat(), "attempts": [], **status}})


def _decide(status: dict[str, Any], budget: BudgetObservation) -> list[Any]:
    return decide(Observed(run=_run(status), lease=None, pods=(), now=T0, mono=100.0, budget=budget)).actions


def test_a_finished_run_is_charged_records_the_amount_then_leaves_the_ledger() -> None:
    assert _decide({}, BudgetObservation(name="team", charged=Usage(cents=3), marked=True)) == \
        [ChargeBudget(budget="team", total=Usage(cents=7))]
    recorded = _decide({}, BudgetObservation(name="team", charged=Usage(cents=7), marked=True))
    assert len(recorded) == 1 and isinstance(recorded[0], WriteStatus)
    assert recorded[0].status.budget_charged and recorded[0].status.charged == Usage(cents=7)
    done = {"budgetCharged": True, "charged": {"cents": 7, "tokens": 0}}
    assert _decide(done, BudgetObservation(name="team", charged=Usage(cents=7), marked=True)) == \
        [ReleaseCharge(budget="team")]
    assert _decide(done, BudgetObservation(name="team")) == []  # released: nothing is owed
    # Late usage settled after the release (the settle resets budgetCharged): only the difference
    # is owed, counted from the recorded amount.
    late = {"usage": {"cents": 10, "tokens": 0}, "charged": {"cents": 7, "tokens": 0}}
    assert _decide(late, BudgetObservation(name="team")) == [ChargeBudget(budget="team", total=Usage(cents=10))]


def test_release_drops_the_mark_and_keeps_what_was_spent() -> None:
    budget = WorkerBudget(metadata=ObjectMeta(name="team", namespace="ns"), spec=WorkerBudgetSpec(limit_cents=100))
    for uid, cents in (("u-1", 7), ("u-2", 5)):
        budget = budget.model_copy(update={"status": b.apply_charge(budget, uid, uid, Usage(cents=cents), T0)})
    released = b.release(budget, "u-1", T0)
    assert set(released.charges) == {"u-2"} and released.spent == Usage(cents=12)
    assert released.remaining is not None and released.remaining.cents == 88


PATH = budget_path("ns", "team")
WRITE = f"PUT {PATH}/status"


class _Kube:
    """The budget as the unit tests' fake API holds it, and the operator's client to it (`client`).
    `before_put` runs before our next status write is served (another party's write in between
    makes ours conflict); `after_put` once it has landed, before its answer reaches us (the watch
    may deliver newer events, or a deletion, first)."""

    def __init__(self, charges: dict[str, Any], spent: int = 7) -> None:
        self.api = FakeApi(now=lambda: T0)
        self.api.put(PATH, {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget",
                            "metadata": {"name": "team", "namespace": "ns", "uid": "a", "generation": 1},
                            "spec": {"limitCents": 100},
                            "status": {"spent": {"cents": spent, "tokens": 0}, "charges": charges}})
        self.client = self.api.client()
        self.before_put: Any = None
        self.after_put: Any = None
        self.api.before(self._before)
        self.api.after(self._after)

    @property
    def body(self) -> dict[str, Any]:
        held = self.api.get(PATH)
        assert held is not None
        return held

    @body.setter
    def body(self, body: dict[str, Any]) -> None:
        """Another party's write (the API gives it its resourceVersion)."""
        self.api.put(PATH, body)

    @property
    def writes(self) -> int:
        return self.api.landed(WRITE)

    def _before(self, req: Request) -> None:
        if req.call == WRITE and self.before_put is not None:
            hook, self.before_put = self.before_put, None
            hook(self)
        return None

    def _after(self, req: Request, code: int) -> None:
        if req.call == WRITE and code < 300 and self.after_put is not None:
            hook, self.after_put = self.after_put, None
            hook(self)


def _charge(kube: _Kube, total: int, recorded: list[Usage | None]) -> Usage | None:
    """Charges the run `total`; each baseline read returns the next of `recorded`."""
    reads = iter(recorded)

    async def baseline() -> Usage | None:
        return next(reads)

    return asyncio.run(BudgetBook(kube.client, lambda: T0).charge(
        _run({}), "team", Usage(cents=total), baseline))


def test_an_unmarked_charge_counts_from_what_a_fresh_read_of_the_run_says_was_charged() -> None:
    """A pass acting on a snapshot older than the run's record (a lagging watch event), or after
    late usage was settled, would otherwise charge a released run's whole usage again."""
    released = _Kube(charges={})  # the run was charged 7 and left the ledger
    assert _charge(released, 7, [Usage(cents=7)]) == Usage()
    assert released.body["status"]["spent"]["cents"] == 7
    late = _Kube(charges={})
    assert _charge(late, 10, [Usage(cents=7)]) == Usage(cents=3)  # the late 3 cents, once
    assert late.body["status"]["spent"]["cents"] == 10
    new = _Kube(charges={}, spent=0)
    assert _charge(new, 7, [Usage()]) == Usage(cents=7)
    assert _charge(new, 7, []) == Usage()  # now marked: no read needed, nothing added
    assert _charge(_Kube(charges={}), 7, [None]) is None  # the run is gone: nothing to charge


def test_the_baseline_is_read_again_after_a_conflict() -> None:
    """Another replica charges the run in full and releases its mark between our reads and our
    write: our write conflicts, and the retry must not reuse the old baseline."""
    kube = _Kube(charges={}, spent=0)

    def other_replica(k: _Kube) -> None:
        k.body = {**k.body, "status": {**k.body["status"], "spent": {"cents": 7, "tokens": 0}, "charges": {}}}

    kube.before_put = other_replica
    assert _charge(kube, 7, [Usage(), Usage(cents=7)]) == Usage()
    assert kube.body["status"]["spent"]["cents"] == 7


def _runs(n: int) -> list[WorkerRun]:
    out = []
    for i in range(n):
        run = _run({})
        out.append(run.model_copy(update={"metadata": run.metadata.model_copy(update={"uid": f"u-{i}",
                                                                                   "name": f"r{i}"})}))
    return out


def test_runs_charging_one_budget_at_once_share_one_write() -> None:
    """A thousand runs on one budget: whatever they ask while a write is in flight rides on the
    next write, not on a write (and a conflict) each."""
    kube = _Kube(charges={}, spent=0)
    book = BudgetBook(kube.client, lambda: T0)

    async def base() -> Usage:
        return Usage()

    async def all_at_once() -> list[Usage | None]:
        return await asyncio.gather(*(book.charge(run, "team", Usage(cents=i + 1), base)
                                      for i, run in enumerate(_runs(50))))

    added = asyncio.run(all_at_once())
    assert added == [Usage(cents=i + 1) for i in range(50)]
    assert kube.writes == 1
    assert kube.body["status"]["spent"]["cents"] == sum(range(1, 51))
    assert len(kube.body["status"]["charges"]) == 50


def test_a_batch_that_conflicts_is_applied_again_from_a_fresh_read_and_charges_once() -> None:
    kube = _Kube(charges={"u-0": {"run": "r0", "cents": 5, "tokens": 0}}, spent=5)
    book = BudgetBook(kube.client, lambda: T0)

    def someone_else(k: _Kube) -> None:  # another replica charges r0 further in between
        k.body = {**k.body, "status": {**k.body["status"], "spent": {"cents": 8, "tokens": 0},
                             "charges": {"u-0": {"run": "r0", "cents": 8, "tokens": 0}}}}

    async def base() -> Usage:
        return Usage()

    async def charge() -> list[Usage | None]:
        r0, r1 = _runs(2)
        kube.before_put = someone_else
        return await asyncio.gather(book.charge(r0, "team", Usage(cents=10), base),
                                    book.charge(r1, "team", Usage(cents=4), base), book.release(r0, "team"))

    added = asyncio.run(charge())
    assert added == [Usage(cents=2), Usage(cents=4), True]
    assert kube.writes == 1
    assert kube.body["status"]["spent"]["cents"] == 8 + 2 + 4
    assert set(kube.body["status"]["charges"]) == {"u-1"}  # r0 charged in full, then released


# --- adversarial: the writer's awaits between a read and a write ------------------------------


async def _nothing_charged() -> Usage:
    return Usage()


def test_one_runs_failing_baseline_fails_that_run_alone() -> None:
    """A run whose fresh read fails (the API refuses it, its status does not validate) must not
    fail every other run that happens to share its write: each would retry with backoff and,
    while the broken run keeps coming back, keep failing with it."""
    kube = _Kube(charges={}, spent=0)
    book = BudgetBook(kube.client, lambda: T0)

    async def broken() -> Usage:
        raise RuntimeError("cannot read r0")

    async def charge() -> list[Any]:
        r0, r1 = _runs(2)
        return await asyncio.gather(book.charge(r0, "team", Usage(cents=5), broken),
                                    book.charge(r1, "team", Usage(cents=4), _nothing_charged),
                                    return_exceptions=True)

    failed, added = asyncio.run(charge())
    assert isinstance(failed, RuntimeError)
    assert added == Usage(cents=4)
    assert set(kube.body["status"]["charges"]) == {"u-1"} and kube.body["status"]["spent"]["cents"] == 4


def test_a_release_and_a_charge_of_one_run_in_one_write_count_from_its_record() -> None:
    """A reconcile cancelled while its release waits leaves the release queued; the run's next pass
    (late usage settled: 10 cents, 7 recorded as charged) rides on the same write. Its charge comes
    after the release, when the run has no mark, so it counts from the record, not from zero."""
    kube = _Kube(charges={"u-0": {"run": "r0", "cents": 7, "tokens": 0}}, spent=7)
    book = BudgetBook(kube.client, lambda: T0)

    async def recorded() -> Usage:
        return Usage(cents=7)

    async def passes() -> Usage | None:
        r0 = _runs(1)[0]
        release = asyncio.create_task(book.release(r0, "team"))
        charge = asyncio.create_task(book.charge(r0, "team", Usage(cents=10), recorded))
        await asyncio.sleep(0)  # both queued; the writer has not run yet
        release.cancel()
        return await charge

    assert asyncio.run(passes()) == Usage(cents=3)
    assert kube.body["status"]["spent"]["cents"] == 10  # not 17


_Racing = _Kube


def _consistent(body: dict[str, Any], **meta: Any) -> dict[str, Any]:
    """The body with a status as our own writes leave it (no refresh due), and `meta` changed."""
    out = {**body, "metadata": {**body["metadata"], **meta}}
    return {**out, "status": b.refresh(WorkerBudget.model_validate(out), T0).dump()}


def _charge_once(kube: _Racing, book: BudgetBook) -> Usage | None:
    async def charge() -> Usage | None:
        return await book.charge(_runs(1)[0], "team", Usage(cents=5), _nothing_charged)

    return asyncio.run(charge())


def test_a_write_answered_after_a_newer_event_does_not_roll_the_cache_back() -> None:
    """Another replica writes right after us and the watch brings that before our answer: caching
    our answer would hide the newer budget from every observation until its next change."""
    kube = _Racing(charges={}, spent=0)
    book = BudgetBook(kube.client, lambda: T0)
    book.cache.store(("ns", "team"), kube.body)

    def other_replica(k: _Racing) -> None:
        theirs = WorkerBudget.model_validate(k.body)
        status, _ = b.settle(theirs, [b.LedgerOp("u-9", "r9", Usage(cents=90))], T0)
        k.body = {**k.body, "status": status.dump()}
        theirs_at.append(k.body["metadata"]["resourceVersion"])
        book.on_event("MODIFIED", k.body)

    theirs_at: list[str] = []
    kube.after_put = other_replica
    assert _charge_once(kube, book) == Usage(cents=5)
    assert [book.cache[("ns", "team")]["metadata"]["resourceVersion"]] == theirs_at


def test_a_write_answered_after_the_budget_was_recreated_does_not_bring_the_old_one_back() -> None:
    kube = _Racing(charges={}, spent=0)
    book = BudgetBook(kube.client, lambda: T0)
    book.cache.store(("ns", "team"), kube.body)

    def recreated(k: _Racing) -> None:
        old = k.body
        del k.api.objects[PATH]
        k.body = _consistent({**old, "status": {}}, uid="b")
        book.on_event("DELETED", old)
        book.on_event("ADDED", k.body)

    kube.after_put = recreated
    assert _charge_once(kube, book) == Usage(cents=5)
    assert book.cache[("ns", "team")]["metadata"]["uid"] == "b"


@pytest.mark.parametrize("deleted", [True, False])
def test_a_refresh_answered_after_the_budget_was_deleted_or_changed_does_not_roll_the_cache_back(deleted: bool) -> None:
    kube = _Racing(charges={}, spent=0)  # never refreshed: remaining is missing
    book = BudgetBook(kube.client, lambda: T0)
    book.cache.store(("ns", "team"), kube.body)

    edited_at: list[str] = []

    def moved(k: _Racing) -> None:
        if deleted:
            book.on_event("DELETED", k.body)
            return
        k.body = _consistent(k.body, generation=2)  # the limit was edited
        edited_at.append(k.body["metadata"]["resourceVersion"])
        book.on_event("MODIFIED", k.body)

    kube.after_put = moved
    asyncio.run(book.refresh(("ns", "team")))
    assert kube.writes == 1
    if deleted:
        assert ("ns", "team") not in book.cache
    else:
        assert [book.cache[("ns", "team")]["metadata"]["resourceVersion"]] == edited_at


def test_stop_before_a_writer_ran_leaves_no_charge_waiting_forever() -> None:
    """A task cancelled before its first step never enters its `try`: its `finally` does not run."""
    kube = _Kube(charges={}, spent=0)
    book = BudgetBook(kube.client, lambda: T0)

    async def stop_early() -> Usage | None:
        run = _runs(1)[0]
        first = asyncio.create_task(book.charge(run, "team", Usage(cents=5), _nothing_charged))
        await asyncio.sleep(0)  # queued; its writer exists but has not run
        await book.stop()
        done, _ = await asyncio.wait({first}, timeout=1)
        assert first in done and first.cancelled()
        return await asyncio.wait_for(book.charge(run, "team", Usage(cents=5), _nothing_charged), 1)

    assert asyncio.run(stop_early()) == Usage(cents=5)


def test_a_time_zone_that_is_no_iana_zone_is_said_in_a_condition_and_a_warning_event() -> None:
    """`Mars/Olympus` was accepted and silently used UTC. The CRD cannot tell a zone name, so the
    operator says it: condition TimeZoneValid=False (UnknownTimeZone) and one Warning Event; a fixed
    zone drops the condition."""
    kube = _Kube(charges={}, spent=0)
    kube.body = {**kube.body, "spec": {**kube.body["spec"], "timeZone": "Mars/Olympus"}}

    def events() -> list[tuple[str, str, str]]:
        return [(e["type"], e["reason"], e["message"]) for req in kube.api.requests
                if req.method == "POST" and req.path.endswith("/events") for e in [req.body]]

    book = BudgetBook(kube.client, lambda: T0)

    async def refresh_twice() -> None:
        for _ in range(2):
            key, due = book.on_event("MODIFIED", kube.body)
            if due:  # as the refresh reconciler's watch has it
                await book.refresh(key)

    asyncio.run(refresh_twice())
    (zone,) = [c for c in kube.body["status"]["conditions"] if c["type"] == "TimeZoneValid"]
    assert (zone["status"], zone["reason"]) == ("False", "UnknownTimeZone") and "'Mars/Olympus'" in zone["message"]
    assert events() == [("Warning", "UnknownTimeZone", zone["message"])]  # once, not on every refresh
    kube.body = {**kube.body, "spec": {**kube.body["spec"], "timeZone": "Europe/Berlin"}}  # edited: a new version
    asyncio.run(refresh_twice())
    assert not any(c["type"] == "TimeZoneValid" for c in kube.body["status"]["conditions"])
    assert len(events()) == 1
