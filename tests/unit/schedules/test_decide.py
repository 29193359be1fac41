"""A schedule's decisions by tables on an injected clock: one run per slot, each concurrency policy
with a run that outlasts its slot, missed slots after downtime, the starting deadline, suspend,
budget-skipped slots, manual starts under the policy, history limits, and conditions."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from tether.schedules.api import ANN_TRIGGER, Waiting, WorkerRunSchedule, slot_run_name, trigger_run_name
from tether.schedules.decide import CreateRun, ScheduleObserved, ScheduleRun, decide

U = dt.timezone.utc
T0 = dt.datetime(2026, 12, 7, 12, 0, tzinfo=U)  # a slot of "*/5 * * * *"


def at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def schedule(status: dict[str, Any] | None = None, annotations: dict[str, str] | None = None,
             **spec: Any) -> WorkerRunSchedule:
    return WorkerRunSchedule.model_validate({
        "metadata": {"name": "nightly", "namespace": "ns", "uid": "s-uid", "generation": 2,
                     "creationTimestamp": "2026-12-07T11:50:00Z", "annotations": annotations or {}},
        "spec": {"schedule": "*/5 * * * *", "runTemplate": {"spec": {"executor": "External"}}, **spec},
        "status": status or {}})


def run(slot: dt.datetime | None, phase: str = "Running", name: str | None = None, stopping: bool = False,
        finished: dt.datetime | None = None) -> ScheduleRun:
    terminal = phase in ("Succeeded", "Failed", "Lost", "Cancelled")
    return ScheduleRun(name=name or slot_run_name("nightly", slot),  # type: ignore[arg-type]
                       uid=f"uid-{name or int(slot.timestamp())}",  # type: ignore[union-attr]
                       scheduled_time=slot, created=slot, terminal=terminal, succeeded=phase == "Succeeded",
                       finished_at=finished or (slot + dt.timedelta(minutes=1) if terminal and slot else None),
                       phase=phase, stopping=stopping)


def observe(s: WorkerRunSchedule, *runs: ScheduleRun, **kw: Any) -> ScheduleObserved:
    return ScheduleObserved(schedule=s, runs=tuple(runs), **kw)


def test_the_first_slot_after_creation_starts_one_run_named_for_it() -> None:
    d = decide(observe(schedule()), at(0.1))
    assert d.create == [CreateRun("nightly-" + str(int(T0.timestamp())), T0, None)]
    assert d.status is not None and d.status.last_schedule_time == T0 and d.status.next_schedule_time == at(5)
    assert d.wake_at == at(5)


def test_a_slot_handled_is_never_handled_again() -> None:
    handled = {"lastScheduleTime": "2026-12-07T12:00:00Z"}
    for now in (at(0.1), at(4.9)):  # the same pass again, and later before the next slot
        d = decide(observe(schedule(handled)), now)
        assert d.create == [] and d.wake_at == at(5)


def test_before_the_first_slot_nothing_starts() -> None:
    d = decide(observe(schedule()), dt.datetime(2026, 12, 7, 11, 54, tzinfo=U))
    assert d.create == [] and d.wake_at == dt.datetime(2026, 12, 7, 11, 55, tzinfo=U)


def test_after_downtime_only_the_latest_missed_slot_runs_and_the_others_are_recorded() -> None:
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T11:00:00Z"})), at(1))
    assert [c.scheduled_time for c in d.create] == [T0]  # never a burst
    assert d.status is not None and d.status.skipped_count == 11
    assert [e.reason for e in d.events] == ["MissedSchedules"] and "11 slot(s)" in d.events[0].message


@pytest.mark.parametrize("late_minutes, deadline, starts", [(1, 120, True), (3, 120, False), (3, None, True)])
def test_a_slot_later_than_its_starting_deadline_is_skipped(late_minutes: float, deadline: int | None,
                                                            starts: bool) -> None:
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T11:55:00Z"}, startingDeadlineSeconds=deadline)),
               at(late_minutes))
    assert bool(d.create) is starts
    assert d.status is not None and d.status.last_schedule_time == T0  # handled either way
    if not starts:
        assert d.status.last_skipped is not None and d.status.last_skipped.reason == "MissedStartingDeadline"


def test_catch_up_limit_zero_runs_no_slot_late_but_runs_the_slot_on_time() -> None:
    late = decide(observe(schedule({"lastScheduleTime": "2026-12-07T11:00:00Z"}, catchUpLimit=0)), at(1))
    assert late.create == [] and late.status.last_skipped.reason == "CatchUpDisabled"  # type: ignore[union-attr]
    on_time = decide(observe(schedule({"lastScheduleTime": "2026-12-07T11:55:00Z"}, catchUpLimit=0)), at(0.1))
    assert len(on_time.create) == 1


PREVIOUS = at(-5)


@pytest.mark.parametrize("policy, creates, stops, waiting, skipped", [
    ("Allow", [T0], [], None, None),
    ("Forbid", [], [], None, "ConcurrencyForbid"),
    ("Replace", [], [slot_run_name("nightly", PREVIOUS)], slot_run_name("nightly", T0), None),
    ("BufferOne", [], [], slot_run_name("nightly", T0), None),
])
def test_each_concurrency_policy_with_a_run_that_outlasts_its_slot(policy: str, creates: list[dt.datetime],
                                                                   stops: list[str], waiting: str | None,
                                                                   skipped: str | None) -> None:
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T11:55:00Z"}, concurrencyPolicy=policy),
                       run(PREVIOUS)), at(0.1))
    assert [c.scheduled_time for c in d.create] == creates
    assert [r.name for r in d.stop] == stops
    assert d.status is not None
    assert (d.status.waiting.name if d.status.waiting else None) == waiting
    assert (d.status.last_skipped.reason if d.status.last_skipped else None) == skipped
    assert d.status.last_schedule_time == T0  # the slot is handled: started, waiting or skipped


def test_the_waiting_start_runs_once_the_active_run_ended() -> None:
    waiting = {"lastScheduleTime": "2026-12-07T12:00:00Z",
               "waiting": Waiting(name=slot_run_name("nightly", T0), scheduledTime=T0).dump()}
    still = decide(observe(schedule(waiting, concurrencyPolicy="BufferOne"), run(PREVIOUS)), at(1))
    assert still.create == [] and still.status is not None and still.status.waiting is not None
    again = decide(observe(schedule(still.status.dump(), concurrencyPolicy="BufferOne"), run(PREVIOUS)), at(2))
    assert again.create == [] and again.status is None  # a pass on its own status writes nothing
    ended = decide(observe(schedule(waiting, concurrencyPolicy="BufferOne"), run(PREVIOUS, "Succeeded")), at(1))
    assert ended.create == [CreateRun(slot_run_name("nightly", T0), T0, None)]
    assert ended.status is not None and ended.status.waiting is None


def test_replace_stops_the_active_run_once_and_waits_for_it_to_end() -> None:
    waiting = {"lastScheduleTime": "2026-12-07T12:00:00Z",
               "waiting": Waiting(name=slot_run_name("nightly", T0), scheduledTime=T0).dump()}
    stopping = decide(observe(schedule(waiting, concurrencyPolicy="Replace"), run(PREVIOUS, stopping=True)), at(1))
    assert stopping.stop == [] and stopping.create == []  # asked to stop already; never killed
    not_yet = decide(observe(schedule(waiting, concurrencyPolicy="Replace"), run(PREVIOUS)), at(1))
    assert [r.name for r in not_yet.stop] == [slot_run_name("nightly", PREVIOUS)]


def test_buffer_one_keeps_one_waiting_start_and_skips_the_next_slot() -> None:
    waiting = {"lastScheduleTime": "2026-12-07T12:00:00Z",
               "waiting": Waiting(name=slot_run_name("nightly", T0), scheduledTime=T0).dump()}
    d = decide(observe(schedule(waiting, concurrencyPolicy="BufferOne"), run(PREVIOUS)), at(5.1))
    assert d.create == [] and d.status is not None
    assert d.status.waiting.name == slot_run_name("nightly", T0)  # type: ignore[union-attr]
    assert d.status.last_skipped.reason == "BufferFull"  # type: ignore[union-attr]


def test_a_newer_slot_replaces_the_start_waiting_under_replace_and_says_so() -> None:
    waiting = {"lastScheduleTime": "2026-12-07T12:00:00Z",
               "waiting": Waiting(name=slot_run_name("nightly", T0), scheduledTime=T0).dump()}
    d = decide(observe(schedule(waiting, concurrencyPolicy="Replace"), run(PREVIOUS, stopping=True)), at(5.1))
    assert d.status is not None and d.status.waiting.name == slot_run_name("nightly", at(5))  # type: ignore[union-attr]
    assert d.status.last_skipped.reason == "Replaced"  # type: ignore[union-attr]


def test_a_suspended_schedule_records_each_slot_skipped_and_runs_none_late_on_resume() -> None:
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T11:55:00Z"}, suspend=True)), at(0.1))
    assert d.create == [] and d.status is not None and d.status.last_skipped.reason == "Suspended"  # type: ignore[union-attr]
    assert d.status.next_schedule_time is None and d.wake_at == at(5)  # it passes at the next slot still
    ready = next(x for x in d.status.conditions if x.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "Suspended")
    resumed = decide(observe(schedule(d.status.dump())), at(1))
    assert resumed.create == []  # the slot skipped while suspended is not run late


def test_a_slot_whose_budget_is_exhausted_is_skipped_not_queued_up() -> None:
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T11:55:00Z"}), exhausted_budget="team"), at(0.1))
    assert d.create == [] and d.status.last_skipped.reason == "BudgetExhausted"  # type: ignore[union-attr]
    assert "team" in d.events[0].message
    later = decide(observe(schedule(d.status.dump())), at(5.1))  # the period rolled over
    assert [c.scheduled_time for c in later.create] == [at(5)]  # the next slot, not a burst of the skipped


def test_a_slots_name_held_by_a_run_the_schedule_does_not_own_is_skipped() -> None:
    name = slot_run_name("nightly", T0)
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T11:55:00Z"}), taken=frozenset({name})), at(0.1))
    assert d.create == [] and d.status.last_skipped.reason == "NameTaken"  # type: ignore[union-attr]


@pytest.mark.parametrize("policy, active, outcome, creates", [
    ("Allow", True, "Started", True),
    ("Forbid", False, "Started", True),
    ("Forbid", True, "Refused", False),  # a manual start does not get around Forbid
    ("Replace", True, "Waiting", False),
    ("BufferOne", True, "Waiting", False),
])
def test_a_manual_start_is_under_the_concurrency_policy(policy: str, active: bool, outcome: str,
                                                        creates: bool) -> None:
    s = schedule({"lastScheduleTime": "2026-12-07T12:00:00Z"}, {ANN_TRIGGER: "abc123xyz"}, concurrencyPolicy=policy)
    d = decide(observe(s, *([run(T0)] if active else [])), at(1))
    assert d.status is not None and d.status.last_trigger is not None
    assert d.status.last_trigger.outcome == outcome
    assert [c.name for c in d.create] == ([trigger_run_name("nightly", "abc123xyz")] if creates else [])
    # The same request seen again (the pass after): no second start.
    again = decide(observe(schedule(d.status.dump(), {ANN_TRIGGER: "abc123xyz"}, concurrencyPolicy=policy),
                           *([run(T0)] if active else [])), at(1))
    assert again.create == []


def test_a_manual_starts_name_cannot_be_a_slots() -> None:
    assert not trigger_run_name("nightly", "123456789")[len("nightly-"):].isdigit()
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T12:00:00Z"}, {ANN_TRIGGER: "BAD"})), at(1))
    assert d.create == [] and d.status.last_trigger.outcome == "Refused"  # type: ignore[union-attr]


def test_history_limits_delete_the_oldest_finished_runs_of_each_kind() -> None:
    runs = [run(at(-5 * i), "Succeeded" if i % 2 else "Failed") for i in range(1, 9)]
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T12:00:00Z"}, successfulRunsHistoryLimit=2,
                                failedRunsHistoryLimit=1), *runs), at(1))
    kept_s = {slot_run_name("nightly", at(-5)), slot_run_name("nightly", at(-15))}
    kept_f = {slot_run_name("nightly", at(-10))}
    assert {r.name for r in d.delete} == {r.name for r in runs} - kept_s - kept_f


def test_a_failed_last_run_makes_the_schedule_degraded_and_a_success_clears_it() -> None:
    failed = decide(observe(schedule({"lastScheduleTime": "2026-12-07T12:00:00Z"}), run(T0, "Failed")), at(2))
    cond = next(x for x in failed.status.conditions if x.type == "Degraded")  # type: ignore[union-attr]
    assert (cond.status, cond.reason) == ("True", "LastRunFailed")
    ok = decide(observe(schedule(failed.status.dump()), run(T0, "Failed"), run(at(5), "Succeeded")), at(7))  # type: ignore[union-attr]
    cond = next(x for x in ok.status.conditions if x.type == "Degraded")  # type: ignore[union-attr]
    assert cond.status == "False" and ok.status.last_successful_time == at(6)  # type: ignore[union-attr]


def test_a_schedule_that_does_not_parse_is_stalled_and_starts_nothing() -> None:
    d = decide(observe(schedule(schedule="61 * * * *")), at(1))
    assert d.create == [] and d.wake_at is None
    stalled = next(x for x in d.status.conditions if x.type == "Stalled")  # type: ignore[union-attr]
    assert stalled.status == "True" and "five fields" in (stalled.message or "")


def test_a_clock_that_went_back_starts_nothing_again() -> None:
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T12:00:00Z"})), at(-30))
    assert d.create == [] and d.wake_at == at(5)


# --- what an interrupted pass left, and what the review found ------------------------------------


@pytest.mark.parametrize("policy", ["Allow", "Forbid", "Replace", "BufferOne"])
def test_a_slots_run_made_before_its_status_write_landed_counts_as_the_slots_start(policy: str) -> None:
    """The pass that created the slot's run crashed (or its status write conflicted): the next pass
    sees the run and the old lastScheduleTime. It neither stops it, nor skips the slot for it."""
    made = run(T0)
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T11:55:00Z"}, concurrencyPolicy=policy), made), at(0.5))
    assert d.create == [] and d.stop == []
    assert d.status is not None and d.status.last_schedule_time == T0 and d.status.last_skipped is None
    assert d.status.waiting is None and d.status.skipped_count == 0


@pytest.mark.parametrize("suspended", [False, True])
def test_the_slots_missed_before_a_run_made_whose_status_write_was_lost_are_counted(suspended: bool) -> None:
    """Fault trials, seeds 98400 and 98503 (invariant 14): slots 11:55 and 12:00 were missed while the
    operator was cut off; its pass made 12:00's run and counted 11:55 missed, but that status write
    conflicted (the schedule was suspended meanwhile). The next pass, seeing 12:00's run, recorded
    12:00 handled and counted nothing: 11:55 was in neither a run nor the status."""
    made = run(T0)
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T11:50:00Z"}, suspend=suspended), made), at(1))
    assert d.create == [] and d.status is not None
    assert d.status.last_schedule_time == T0 and d.status.skipped_count == 1
    assert [e.reason for e in d.events] == ["MissedSchedules"] and "1 slot(s) before" in d.events[0].message
    # Two made, with one missed between them: only that one.
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T11:45:00Z"}), made, run(at(-10))), at(1))
    assert d.status is not None and d.status.skipped_count == 1


def test_a_waiting_or_manual_start_whose_run_exists_is_recorded_as_made() -> None:
    waiting = {"lastScheduleTime": "2026-12-07T12:00:00Z",
               "waiting": Waiting(name=slot_run_name("nightly", T0), scheduledTime=T0).dump()}
    d = decide(observe(schedule(waiting, concurrencyPolicy="Replace"), run(PREVIOUS, "Cancelled"), run(T0)), at(1))
    assert d.create == [] and d.stop == [] and d.status is not None and d.status.waiting is None
    manual = run(None, name=trigger_run_name("nightly", "abc123xyz"))
    s = schedule({"lastScheduleTime": "2026-12-07T12:00:00Z"}, {ANN_TRIGGER: "abc123xyz"}, concurrencyPolicy="Forbid")
    d = decide(observe(s, manual), at(1))
    assert d.create == [] and d.status.last_trigger.outcome == "Started"  # type: ignore[union-attr]


def test_a_schedule_being_deleted_starts_and_stops_nothing() -> None:
    s = schedule({"lastScheduleTime": "2026-12-07T11:55:00Z",
                  "waiting": Waiting(name=slot_run_name("nightly", PREVIOUS), scheduledTime=PREVIOUS).dump()},
                 {ANN_TRIGGER: "abc123xyz"}, concurrencyPolicy="Replace")
    s.metadata.deletion_timestamp = at(0)
    d = decide(observe(s, run(at(-10))), at(0.1))
    assert d.create == [] and d.stop == [] and d.delete == []


def test_history_never_deletes_a_run_whose_slot_the_status_does_not_record_or_one_being_deleted() -> None:
    unrecorded = run(at(5), "Succeeded")  # made by a pass whose status write did not land, then ended
    going = ScheduleRun(**{**run(at(-10), "Succeeded").__dict__, "deleting": True})
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T12:00:00Z"}, successfulRunsHistoryLimit=0),
                       unrecorded, going, run(at(-5), "Succeeded")), at(5.5))
    assert [r.name for r in d.delete] == [slot_run_name("nightly", at(-5)), slot_run_name("nightly", at(5))]
    assert d.status is not None and d.status.last_schedule_time == at(5)  # recorded in this very pass
    early = decide(observe(schedule({"lastScheduleTime": "2026-12-07T12:00:00Z"}, successfulRunsHistoryLimit=0),
                           run(at(-5), "Succeeded")), at(1))
    assert [r.name for r in early.delete] == [slot_run_name("nightly", at(-5))]


def test_a_suspended_schedule_does_not_start_its_waiting_run() -> None:
    waiting = {"lastScheduleTime": "2026-12-07T12:00:00Z",
               "waiting": Waiting(name=slot_run_name("nightly", T0), scheduledTime=T0).dump()}
    d = decide(observe(schedule(waiting, concurrencyPolicy="BufferOne", suspend=True), run(PREVIOUS, "Succeeded")), at(1))
    assert d.create == [] and d.status is not None and d.status.waiting is not None


def test_under_replace_a_waiting_start_a_newer_one_replaces_in_the_same_pass_is_never_made() -> None:
    waiting = {"lastScheduleTime": "2026-12-07T12:00:00Z",
               "waiting": Waiting(name=slot_run_name("nightly", T0), scheduledTime=T0).dump()}
    d = decide(observe(schedule(waiting, concurrencyPolicy="Replace"), run(PREVIOUS, "Cancelled")), at(5.1))
    assert [c.name for c in d.create] == [slot_run_name("nightly", at(5))]
    assert d.status is not None and d.status.waiting is None and d.status.last_skipped.reason == "Replaced"  # type: ignore[union-attr]
    alone = decide(observe(schedule(waiting, concurrencyPolicy="Replace"), run(PREVIOUS, "Cancelled")), at(1))
    assert [c.name for c in alone.create] == [slot_run_name("nightly", T0)]


def test_a_manual_start_is_answered_while_the_schedule_does_not_parse() -> None:
    s = schedule({"lastScheduleTime": "2026-12-07T12:00:00Z"}, {ANN_TRIGGER: "abc123xyz"}, schedule="61 * * * *")
    d = decide(observe(s), at(1))
    assert [c.name for c in d.create] == [trigger_run_name("nightly", "abc123xyz")] and d.wake_at is None


def test_a_long_downtime_on_an_every_schedule_counts_every_missed_slot() -> None:
    d = decide(observe(schedule({"lastScheduleTime": "2026-12-07T11:00:00Z"}, schedule="@every 5s")), at(0.01))
    assert d.status is not None and d.status.skipped_count == 719 and len(d.create) == 1
