"""What a WorkerRunSchedule does now: `decide(observed, now)`, pure, tested by tables.

Each pass handles, in order: a start held until the active runs ended (`status.waiting`), a manual
start asked for (`tether.dev/trigger`), and the latest slot due since the last one handled
(`status.lastScheduleTime`; slots before it that were missed are counted, recorded and never run:
at most one catch-up run, as CronJob does). Every slot handled is either started, held as the one
waiting start, or skipped with a reason in the status and an Event; `lastScheduleTime` then moves
to it, so no slot is handled twice. The runs a schedule keeps beyond its history limits are deleted
only once the status that handled their slots is written.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Mapping

from tether.api import constants as c
from tether.api.conditions import set_condition
from tether.schedules.api import (ANN_TRIGGER, TRIGGER_ID_LENGTH, RunRef, Skipped, TriggerStatus, Waiting,
                                  WorkerRunSchedule, WorkerRunScheduleStatus, slot_run_name, trigger_run_name)
from tether.schedules.timing import ScheduleError, Timing

COND_DEGRADED = "Degraded"
Why = tuple[str, str]  # (reason, message) of a skip or a refusal


@dataclass(frozen=True)
class ScheduleRun:
    """One run the schedule owns, as its decisions read it."""

    name: str
    uid: str
    scheduled_time: dt.datetime | None  # None: a manual start
    created: dt.datetime | None
    terminal: bool
    succeeded: bool
    finished_at: dt.datetime | None
    phase: str
    stopping: bool  # spec.stop is set
    deleting: bool = False  # its deletion was asked for already (its finalizers still hold it)


@dataclass(frozen=True)
class ScheduleObserved:
    schedule: WorkerRunSchedule
    runs: tuple[ScheduleRun, ...]
    taken: frozenset[str] = frozenset()  # run names held by runs the schedule does not own
    exhausted_budget: str | None = None  # the WorkerBudget its runs would draw on, when it is exhausted
    refused: Mapping[str, str] = field(default_factory=dict)  # starts the API server refused, by run name


@dataclass(frozen=True)
class CreateRun:
    name: str
    scheduled_time: dt.datetime | None
    trigger: str | None


@dataclass(frozen=True)
class ScheduleEvent:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class ScheduleDecision:
    create: list[CreateRun] = field(default_factory=list)
    stop: list[RunRef] = field(default_factory=list)
    delete: list[RunRef] = field(default_factory=list)  # beyond the history limits
    status: WorkerRunScheduleStatus | None = None  # None: unchanged
    events: list[ScheduleEvent] = field(default_factory=list)
    wake_at: dt.datetime | None = None


def valid_trigger(value: str | None) -> bool:
    return bool(value) and len(value or "") == TRIGGER_ID_LENGTH and (value or "").isalnum() and \
        (value or "").lower() == value


def decide(o: ScheduleObserved, now: dt.datetime) -> ScheduleDecision:
    s, spec = o.schedule, o.schedule.spec
    gen = s.metadata.generation
    old = s.status
    st = old.clone()
    st.observed_generation = gen
    d = ScheduleDecision()
    # A start whose run exists was made already (a pass whose status write did not land: a crash,
    # a conflict): it is recorded as made, never held against the policy, never stopped for itself.
    own = {r.name: r for r in o.runs}
    active = [r for r in o.runs if not r.terminal]
    busy = bool(active)  # a run of the schedule is active, or is started in this pass
    deleting = s.metadata.deletion_timestamp is not None  # being deleted: it starts and stops nothing
    try:
        timing: Timing | None = Timing.parse(spec.schedule, spec.time_zone)
        invalid = None
    except ScheduleError as exc:
        timing, invalid = None, str(exc)
    # The latest slot handled: the status's, or a later one whose run exists.
    slots_made = [r.scheduled_time for r in o.runs if r.scheduled_time is not None]
    since = max([t for t in (old.last_schedule_time or s.metadata.creation_timestamp or now, *slots_made)])
    due = timing.due(since, now) if timing is not None else None
    # Slots between the last one recorded and a later one whose run a pass made (its status write did
    # not land) that have no run: that pass counted them missed in the write that was lost, so they
    # are counted here (they would be in neither the status nor a run: unaccounted for).
    base = old.last_schedule_time or s.metadata.creation_timestamp
    if timing is not None and base is not None and slots_made and max(slots_made) > base:
        gap = timing.due(base, max(slots_made))
        unmade = gap.count - len({t for t in slots_made if base < t <= max(slots_made)})
        if unmade > 0:
            d.events.append(ScheduleEvent("Warning", "MissedSchedules",
                                          f"{'more than ' if gap.more else ''}{unmade} slot(s) before "
                                          f"{_iso(max(slots_made))} were missed; only the latest was handled"))
            st.skipped_count += unmade
    asked = s.metadata.annotations.get(ANN_TRIGGER)
    new_trigger = bool(asked) and (old.last_trigger is None or old.last_trigger.id != asked)

    def skip(reason: str, message: str, slot: dt.datetime | None = None, trigger: str | None = None) -> None:
        st.last_skipped = Skipped(scheduled_time=slot, trigger=trigger, reason=reason, message=message)
        st.skipped_count += 1
        d.events.append(ScheduleEvent("Warning", reason, message))

    def start(name: str, slot: dt.datetime | None, trigger: str | None) -> None:
        nonlocal busy
        if name not in own:
            d.create.append(CreateRun(name, slot, trigger))
        busy = True

    def stop_active() -> None:
        d.stop.extend(RunRef(name=r.name, uid=r.uid, scheduled_time=r.scheduled_time)
                      for r in active if not r.stopping and all(x.name != r.name for x in d.stop))

    def hold(name: str, slot: dt.datetime | None, trigger: str | None) -> None:
        """Replace stops what is active; BufferOne waits for it. One start waits at most."""
        if spec.concurrency_policy == "Replace":
            stop_active()
            if st.waiting is not None:  # the newer start replaces the waiting one too
                skip("Replaced", f"{st.waiting.name} was replaced by {name} before it started",
                     st.waiting.scheduled_time, st.waiting.trigger)
        st.waiting = Waiting(name=name, scheduled_time=slot, trigger=trigger)

    def refusal(name: str) -> Why | None:
        """Why a start is skipped whatever the active runs (None: it may start)."""
        if deleting:
            return "Deleting", "the schedule is being deleted"
        if name in o.refused:
            return "RunRefused", f"the API server refused {name}: {o.refused[name]}"
        if name in o.taken:
            return "NameTaken", f"a run named {name} exists and is not this schedule's"
        if o.exhausted_budget is not None:
            return "BudgetExhausted", f"WorkerBudget {o.exhausted_budget} has nothing left this period"
        return None

    def crowded() -> Why | None:
        """Why a start is skipped while a run of the schedule is active (None: it may start or wait)."""
        if busy and spec.concurrency_policy == "Forbid":
            return "ConcurrencyForbid", f"{', '.join(r.name for r in active) or 'a run'} is active"
        if busy and spec.concurrency_policy == "BufferOne" and st.waiting is not None:
            return "BufferFull", f"{st.waiting.name} already waits for the active run to end"
        return None

    def start_waiting(w: Waiting) -> None:
        why = refusal(w.name)
        if why is not None:
            skip(why[0], f"{w.name}: {why[1]}", w.scheduled_time, w.trigger)
        else:
            start(w.name, w.scheduled_time, w.trigger)

    why: Why | None
    # 1. A start that waited for the active runs to end (or was made already).
    deferred: Waiting | None = None  # under Replace, until it is known whether a newer start replaces it
    if st.waiting is not None and st.waiting.name in own:
        st.waiting = None
    elif st.waiting is not None and not active and not spec.suspend:
        w, st.waiting = st.waiting, None
        if spec.concurrency_policy == "Replace" and (new_trigger or (due is not None and due.latest is not None)):
            deferred = w
        else:
            start_waiting(w)
    elif st.waiting is not None and spec.concurrency_policy == "Replace" and not deleting:
        stop_active()

    # 2. A manual start asked for (kubectl tether trigger): under the concurrency policy too.
    if new_trigger and asked:
        name = trigger_run_name(s.metadata.name, asked) if valid_trigger(asked) else ""
        if name in own:
            st.last_trigger = TriggerStatus(id=asked, outcome="Started", run=name)
        else:
            why = ("Invalid", "a trigger id is nine lowercase letters or digits") if not name else \
                refusal(name) or crowded()
            if why is not None:
                st.last_trigger = TriggerStatus(id=asked, outcome="Refused", message=f"{why[0]}: {why[1]}")
                d.events.append(ScheduleEvent("Warning", "TriggerRefused", f"manual start {asked}: {why[0]}: {why[1]}"))
            elif busy and spec.concurrency_policy in ("Replace", "BufferOne"):
                hold(name, None, asked)
                st.last_trigger = TriggerStatus(id=asked, outcome="Waiting", run=name,
                                                message="starts when the active run has ended")
            else:
                start(name, None, asked)
                st.last_trigger = TriggerStatus(id=asked, outcome="Started", run=name)

    # 3. The latest slot due since the last one handled.
    if due is not None and due.latest is not None:
        slot = due.latest
        name = slot_run_name(s.metadata.name, slot)
        missed = due.count - 1
        if missed > 0:
            more = "more than " if due.more else ""
            what = "skipped while suspended" if spec.suspend else "missed (the operator was not running, or " \
                "could not reach the API server)"
            d.events.append(ScheduleEvent("Warning", "MissedSchedules",
                                          f"{more}{missed} slot(s) before {_iso(slot)} were {what}; only the "
                                          "latest is handled"))
            st.skipped_count += missed
        late = (now - slot).total_seconds()
        if spec.suspend:
            why = "Suspended", "the schedule is suspended"
        elif spec.starting_deadline_seconds is not None and late > spec.starting_deadline_seconds:
            why = "MissedStartingDeadline", f"{late:.0f}s late, past startingDeadlineSeconds " \
                                            f"({spec.starting_deadline_seconds})"
        elif missed > 0 and spec.catch_up_limit == 0:
            why = "CatchUpDisabled", "a slot missed is not run late (catchUpLimit 0)"
        else:
            why = refusal(name) or crowded()
        if why is not None:
            skip(why[0], f"slot {_iso(slot)}: {why[1]}", slot)
        elif busy and spec.concurrency_policy in ("Replace", "BufferOne"):
            hold(name, slot, None)
        else:
            start(name, slot, None)
        st.last_schedule_time = slot
    elif slots_made and (old.last_schedule_time is None or since > old.last_schedule_time):
        st.last_schedule_time = since  # a slot whose run a pass made before its status write landed
    if deferred is not None:
        if d.create or st.waiting is not None:  # never started only to be stopped
            skip("Replaced", f"{deferred.name} was replaced by a newer start before it started",
                 deferred.scheduled_time, deferred.trigger)
        else:
            start_waiting(deferred)

    # The status: what is active, the last success, the next slot, the conditions.
    st.active = [RunRef(name=r.name, uid=r.uid, scheduled_time=r.scheduled_time) for r in active]
    finished = sorted((r for r in o.runs if r.terminal), key=_order)
    successes = [r.finished_at for r in finished if r.succeeded and r.finished_at is not None]
    if successes:
        st.last_successful_time = max([*successes, *([old.last_successful_time] if old.last_successful_time else [])])
    last = finished[-1] if finished else None
    degraded = ("True", "LastRunFailed", f"{last.name} ended {last.phase}") if last is not None and not last.succeeded \
        else ("False", "LastRunSucceeded" if last is not None else "NoRunEnded", "")
    if timing is None:
        st.next_schedule_time = None
        st.conditions = _conditions(st, gen, now, ready=("False", "InvalidSchedule", invalid or ""), degraded=degraded,
                                    stalled=invalid)
    else:
        # A suspended schedule still passes at each slot: the slot is recorded as skipped then, not
        # run late when the schedule is resumed.
        d.wake_at = timing.after(max(since, st.last_schedule_time or since, now))
        st.next_schedule_time = None if spec.suspend else d.wake_at
        ready = ("False", "Suspended", "the schedule is suspended: no slot starts a run") if spec.suspend else \
            ("True", "Scheduled", f"next run at {_iso(st.next_schedule_time)}")
        st.conditions = _conditions(st, gen, now, ready=ready, degraded=degraded)
    # Only runs whose slots the status records as handled, and none being deleted already.
    handled = st.last_schedule_time
    d.delete = [] if deleting else _beyond_history(
        [r for r in finished if not r.deleting and (r.scheduled_time is None or
                                                   (handled is not None and r.scheduled_time <= handled))],
        spec.successful_runs_history_limit, spec.failed_runs_history_limit)
    d.status = st if st != old else None
    return d


def _order(r: ScheduleRun) -> tuple[dt.datetime, str]:
    return (r.scheduled_time or r.created or dt.datetime.min.replace(tzinfo=dt.timezone.utc), r.name)


def _beyond_history(finished: list[ScheduleRun], successful: int, failed: int) -> list[RunRef]:
    """The oldest finished runs past each limit (finished is oldest first)."""
    out: list[RunRef] = []
    for keep, runs in ((successful, [r for r in finished if r.succeeded]), (failed, [r for r in finished if not r.succeeded])):
        out.extend(RunRef(name=r.name, uid=r.uid, scheduled_time=r.scheduled_time)
                   for r in runs[:max(0, len(runs) - keep)])
    return out


def _conditions(st: WorkerRunScheduleStatus, gen: int, now: dt.datetime, ready: tuple[str, str, str],
                degraded: tuple[str, str, str] | None = None, stalled: str | None = None) -> list:
    conds = set_condition(st.conditions, c.COND_READY, ready[0], ready[1], ready[2], gen, now)  # type: ignore[arg-type]
    conds = set_condition(conds, c.COND_STALLED, "True" if stalled else "False", "InvalidSchedule" if stalled
                          else "Scheduling", stalled or "", gen, now)
    conds = set_condition(conds, c.COND_RECONCILING, "False", "Scheduled", "", gen, now)
    if degraded is not None:
        conds = set_condition(conds, COND_DEGRADED, degraded[0], degraded[1], degraded[2], gen, now)  # type: ignore[arg-type]
    return conds


def _iso(t: dt.datetime | None) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if t is not None else "-"
