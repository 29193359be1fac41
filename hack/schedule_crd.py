"""Writes crds/workerrunschedules.tether.dev.yaml (and the chart's copy): spec.runTemplate.spec is the
WorkerRun CRD's spec schema (without the rules that guard a run's own updates), so a schedule whose
runs would be refused is refused itself at apply. `--check`: exit 1 if the files are not what this
writes (tests/unit/crds/test_generated_crds.py runs it)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from crdgen import run_spec, without_transition_rules, write  # noqa: E402

FIELD = "^[0-9A-Za-z*?,/#-]+$"
# Five fields, a macro, or @every with a duration; a TZ= prefix belongs in timeZone.
SCHEDULE = ("^(@(yearly|annually|monthly|weekly|daily|midnight|hourly)|@every ([0-9]{1,4}h)?([0-9]{1,6}m)?([0-9]{1,8}s)?"
            "|[0-9A-Za-z*?,/#-]+( +[0-9A-Za-z*?,/#-]+){4})$")


def integer(desc: str, minimum: int, maximum: int, default: int | None = None, fmt: str = "int32") -> dict:
    out = {"type": "integer", "format": fmt, "minimum": minimum, "maximum": maximum,
           "description": f"{desc} ({minimum} to {maximum})." + (f" Defaults to {default}." if default is not None else "")}
    if default is not None:
        out["default"] = default
    return out


def counter(desc: str) -> dict:
    return integer(f"{desc}; at most 9007199254740991, the largest integer JSON carries exactly", 0,
                   9007199254740991, fmt="int64")


def time(desc: str) -> dict:
    return {"type": "string", "format": "date-time", "description": desc}


def ref(desc: str) -> dict:
    return {"type": "object", "required": ["name"], "description": desc, "properties": {
        "name": {"type": "string", "description": "The run's name."},
        "uid": {"type": "string", "description": "The run's UID."},
        "scheduledTime": time("The slot it is for; absent for a manual start."),
    }}


template_spec = without_transition_rules(run_spec())
# A schedule's runs are its own, never children of a run (only a parent's attempt spawns those).
del template_spec["properties"]["parentRef"]
template_spec["description"] = ("The WorkerRun spec each run gets (className included); the same schema as a "
                                 "WorkerRun's, but for idempotencyKey and parentRef.")
# One key for every run would make a receiver take each slot's effects for the first slot's again.
template_spec.setdefault("x-kubernetes-validations", []).append({
    "rule": "!has(self.idempotencyKey)",
    "message": "idempotencyKey: each run of a schedule is an operation of its own (its name is its slot's); "
               "leave it out, or use the run's name (TETHER_RUN) as the key",
    "fieldPath": ".idempotencyKey"})
spec = {
    "type": "object",
    "required": ["schedule", "runTemplate"],
    "description": "When runs start, what they are, and what happens when a slot comes while a run is still active.",
    "properties": {
        "schedule": {
            "type": "string", "minLength": 1, "maxLength": 128, "pattern": SCHEDULE,
            "description": ("When runs start: five cron fields (minute hour day-of-month month day-of-week, as CronJob's), "
                            "a macro (@yearly, @monthly, @weekly, @daily, @hourly) or @every with a duration "
                            "(@every 30s, @every 1h30m; at least 5s; slots at whole multiples of it since the Unix epoch)."),
        },
        "timeZone": {
            "type": "string", "maxLength": 64, "pattern": "^[A-Za-z0-9_+-]+(/[A-Za-z0-9_+-]+)*$",
            "description": ("The IANA time zone the cron fields are read in (Europe/Berlin); unset: UTC. Across "
                            "daylight-saving changes it follows Debian cron: a slot in the skipped hour runs at the "
                            "jump, a slot in the repeated hour runs once."),
        },
        "runTemplate": {
            "type": "object", "required": ["spec"],
            "description": "The WorkerRun each slot creates, named <schedule>-<the slot's Unix seconds>.",
            "properties": {
                "metadata": {"type": "object", "description": "Labels and annotations each run gets.", "properties": {
                    "labels": {"type": "object", "additionalProperties": {"type": "string", "description": "A label value."},
                               "description": "Labels of each run (tether.dev/schedule is added)."},
                    "annotations": {"type": "object", "additionalProperties": {"type": "string", "description": "An annotation value."},
                                    "description": "Annotations of each run (tether.dev/scheduled-at is added)."},
                }},
                "spec": template_spec,
            },
        },
        "concurrencyPolicy": {
            "type": "string", "enum": ["Allow", "Forbid", "Replace", "BufferOne"], "default": "Allow",
            "description": ("What a slot (or a manual start) does while a run of the schedule is active: Allow starts it "
                            "beside; Forbid skips it; Replace stops the active run through spec.stop (with its stop "
                            "grace, never by killing its pods) and starts the new one once it has ended; BufferOne "
                            "keeps one start waiting until the active run ends (a later one is skipped). Defaults to Allow."),
        },
        "startingDeadlineSeconds": integer(
            "A slot not started this long after its time is skipped (MissedStartingDeadline); unset: no limit",
            1, 31536000, fmt="int64"),
        "catchUpLimit": integer(
            "How many slots missed while the operator could not start them run late: 1, the latest of them (as "
            "CronJob does; the others are counted and recorded), or 0, none", 0, 1, default=1),
        "successfulRunsHistoryLimit": integer("How many succeeded runs are kept; older ones are deleted", 0, 100, default=3),
        "failedRunsHistoryLimit": integer("How many runs that ended otherwise are kept; older ones are deleted", 0, 100,
                                          default=1),
        "suspend": {"type": "boolean", "default": False,
                    "description": "No slot starts a run while true; each slot is recorded as skipped (Suspended), and none runs late on resume. Defaults to false."},
    },
}
status = {
    "type": "object",
    "description": "What the schedule did last and does next (written by the operator).",
    "properties": {
        "observedGeneration": counter("The generation this status is for"),
        "lastScheduleTime": time("The latest slot handled: started, waiting, or skipped with a reason."),
        "lastSuccessfulTime": time("When a run of the schedule last succeeded."),
        "nextScheduleTime": time("The next slot (absent while suspended)."),
        "active": {"type": "array", "items": ref("An active run."), "description": "The schedule's runs that have not ended."},
        "waiting": {"type": "object", "required": ["name"], "description": "A start held until the active runs end (BufferOne, Replace).",
                    "properties": {"name": {"type": "string", "description": "The run it will create."},
                                   "scheduledTime": time("Its slot; absent for a manual start."),
                                   "trigger": {"type": "string", "description": "The manual start's request id."}}},
        "lastSkipped": {"type": "object", "required": ["reason", "message"], "description": "The last slot or start skipped, and why.",
                        "properties": {"scheduledTime": time("Its slot."),
                                       "trigger": {"type": "string", "description": "The manual start's request id."},
                                       "reason": {"type": "string", "description": "Suspended, MissedStartingDeadline, CatchUpDisabled, ConcurrencyForbid, BufferFull, Replaced, BudgetExhausted, NameTaken."},
                                       "message": {"type": "string", "description": "What happened, in words."}}},
        "skippedCount": counter("Slots and starts skipped so far (missed ones included)"),
        "lastTrigger": {"type": "object", "required": ["id", "outcome"], "description": "The last manual start asked for (kubectl tether trigger) and what became of it.",
                        "properties": {"id": {"type": "string", "description": "Its request id (annotation tether.dev/trigger)."},
                                       "outcome": {"type": "string", "enum": ["Started", "Waiting", "Refused"], "description": "Started, Waiting (BufferOne, Replace) or Refused."},
                                       "run": {"type": "string", "description": "The run it started or will start."},
                                       "message": {"type": "string", "description": "Why it was refused."}}},
        "conditions": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"],
                       "description": "Ready (False while suspended), Degraded (the last run that ended failed), Stalled (the schedule does not parse), Reconciling.",
                       "items": {"type": "object", "required": ["type", "status", "reason", "lastTransitionTime"],
                                 "description": "A condition, as kstatus and Argo CD read them.", "properties": {
                           "type": {"type": "string", "description": "Condition type."},
                           "status": {"type": "string", "enum": ["True", "False", "Unknown"], "description": "True, False or Unknown."},
                           "reason": {"type": "string", "description": "Why, in one word."},
                           "message": {"type": "string", "description": "Why, in words."},
                           "observedGeneration": counter("The generation it was set for"),
                           "lastTransitionTime": time("When its status last changed."),
                       }}},
    },
}
crd = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "workerrunschedules.tether.dev",
                 "labels": {"app.kubernetes.io/name": "tether", "app.kubernetes.io/part-of": "tether"}},
    "spec": {
        "group": "tether.dev",
        "scope": "Namespaced",
        "names": {"kind": "WorkerRunSchedule", "listKind": "WorkerRunScheduleList", "plural": "workerrunschedules",
                  "singular": "workerrunschedule", "shortNames": ["wrs"], "categories": ["tether"]},
        "versions": [{
            "name": "v1alpha1", "served": True, "storage": True,
            "subresources": {"status": {}},
            "additionalPrinterColumns": [
                {"name": "Schedule", "type": "string", "jsonPath": ".spec.schedule", "description": "When runs start."},
                {"name": "Timezone", "type": "string", "jsonPath": ".spec.timeZone", "priority": 1, "description": "The time zone of the schedule."},
                {"name": "Suspend", "type": "boolean", "jsonPath": ".spec.suspend", "description": "No slot starts a run."},
                {"name": "Active", "type": "string", "jsonPath": ".status.active[*].name", "description": "Its runs that have not ended."},
                {"name": "Last", "type": "date", "jsonPath": ".status.lastScheduleTime", "description": "The latest slot handled."},
                {"name": "Next", "type": "string", "jsonPath": ".status.nextScheduleTime", "description": "The next slot (UTC)."},
                {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
            ],
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "description": ("WorkerRunSchedule starts a WorkerRun at each slot of a schedule, as a CronJob starts Jobs: at most "
                                "one run per slot, named for it, whoever creates it and however often."),
                "x-kubernetes-validations": [{
                    "rule": "size(self.metadata.name) <= 47",
                    "message": "metadata.name must be at most 47 characters: each run is named <schedule>-<ten digits> and a run name has at most 58",
                    "fieldPath": ".metadata.name"}],
                "properties": {
                    "apiVersion": {"type": "string", "description": "APIVersion defines the versioned schema of this representation of an object."},
                    "kind": {"type": "string", "description": "Kind is a string value representing the REST resource this object represents."},
                    "metadata": {"type": "object", "properties": {"name": {
                        "type": "string", "description": "The schedule's name, at most 47 characters (its runs are named <name>-<ten digits>)."}}},
                    "spec": spec,
                    "status": status,
                },
            }},
        }],
    },
}
write(crd, "hack/schedule_crd.py", "spec.runTemplate.spec is the run's spec schema")
