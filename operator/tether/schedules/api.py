"""WorkerRunSchedule: a recurring WorkerRun as an API object (as a CronJob is a recurring Job).
Mirrors crds/workerrunschedules.tether.dev.yaml (hack/schedule_crd.py writes it; its runTemplate's
spec is the WorkerRun CRD's spec schema).

A slot's run is named `<schedule>-<the slot's Unix seconds>`, so that it is created once whoever
creates it and however often; a manual start's is `<schedule>-m<its request id>`, which no slot's
can be. Runs carry the schedule's label and an owner reference to it.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import Field

from tether.api.constants import PREFIX
from tether.api.models import Condition, ObjectMeta, RunSpec, _Model

SCHEDULE_PLURAL = "workerrunschedules"
SCHEDULE_KIND = "WorkerRunSchedule"
# On each run a schedule creates: which schedule, and the slot it is for (absent: a manual start).
LABEL_SCHEDULE = f"{PREFIX}/schedule"
ANN_SCHEDULED_AT = f"{PREFIX}/scheduled-at"
# On the schedule: a manual start asked for (`kubectl tether trigger`), by its request id.
ANN_TRIGGER = f"{PREFIX}/trigger"
# A slot's run name: the schedule's name, a dash and ten digits (Unix seconds until the year 2286);
# a run name has at most 58 characters.
SLOT_SUFFIX_LENGTH = 11
MAX_SCHEDULE_NAME = 58 - SLOT_SUFFIX_LENGTH
TRIGGER_ID_LENGTH = 9  # lowercase letters and digits; the run's suffix is "-m" and the id

ConcurrencyPolicy = Literal["Allow", "Forbid", "Replace", "BufferOne"]


class RunTemplate(_Model):
    metadata: dict[str, Any] = Field(default_factory=dict)  # labels and annotations
    spec: RunSpec


class WorkerRunScheduleSpec(_Model):
    schedule: str
    time_zone: str | None = None
    run_template: RunTemplate
    concurrency_policy: ConcurrencyPolicy = "Allow"
    starting_deadline_seconds: int | None = None
    catch_up_limit: int = 1
    successful_runs_history_limit: int = 3
    failed_runs_history_limit: int = 1
    suspend: bool = False


class RunRef(_Model):
    name: str
    uid: str | None = None
    scheduled_time: dt.datetime | None = None  # None: a manual start


class Waiting(_Model):
    """A start held until the active runs end (BufferOne; Replace while the replaced run stops)."""

    name: str
    scheduled_time: dt.datetime | None = None
    trigger: str | None = None


class Skipped(_Model):
    scheduled_time: dt.datetime | None = None
    trigger: str | None = None
    reason: str
    message: str


class TriggerStatus(_Model):
    id: str
    outcome: Literal["Started", "Waiting", "Refused"]
    run: str | None = None
    message: str | None = None


class WorkerRunScheduleStatus(_Model):
    observed_generation: int | None = None
    last_schedule_time: dt.datetime | None = None
    last_successful_time: dt.datetime | None = None
    next_schedule_time: dt.datetime | None = None
    active: list[RunRef] = Field(default_factory=list)
    waiting: Waiting | None = None
    last_skipped: Skipped | None = None
    skipped_count: int = 0
    last_trigger: TriggerStatus | None = None
    conditions: list[Condition] = Field(default_factory=list)


class WorkerRunSchedule(_Model):
    api_version: str = "tether.dev/v1alpha1"
    kind: str = SCHEDULE_KIND
    metadata: ObjectMeta
    spec: WorkerRunScheduleSpec
    status: WorkerRunScheduleStatus = Field(default_factory=WorkerRunScheduleStatus)


def slot_run_name(schedule: str, slot: dt.datetime) -> str:
    return f"{schedule}-{int(slot.timestamp()):010d}"


def trigger_run_name(schedule: str, trigger: str) -> str:
    return f"{schedule}-m{trigger}"


def schedule_of_run_name(run_name: str) -> str | None:
    """The schedule a run's name derives from, if it has the form of one (a slot's or a manual start's)."""
    head, sep, tail = run_name.rpartition("-")
    if not sep or not head:
        return None
    if len(tail) == SLOT_SUFFIX_LENGTH - 1 and tail.isdigit():
        return head
    if len(tail) == TRIGGER_ID_LENGTH + 1 and tail.startswith("m") and tail[1:].isalnum():
        return head
    return None
