"""The fault trials' invariant 14, judged from the API server's audit log and the final schedule: a
WorkerRunSchedule starts at most one run per slot, ever, and accounts for every slot.

- One run per slot: the accepted creations of runs labelled for the schedule (audited at level
  Request, so their names are known) name each slot's run at most once, whatever the faults: a
  creation sent before a kill and landing after the successor's (the fault operator-kill-mid-schedule)
  is refused as AlreadyExists, never a second run.
- Handled once: `status.lastScheduleTime` never goes back across the accepted status writes (in
  commit order), so no slot is handled twice.
- Every slot accounted for: from the first slot handled to the final `lastScheduleTime`, each slot
  has a run created for it, or is named as skipped (`lastSkipped`) by an accepted status write, or
  is one of the missed ones the status counts (`skippedCount` less the skips it names): none is
  passed over without a record; and none is both (a pass that did not see its own run).
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any, Iterable, Mapping

from testkit.audit import AuditRecord

LABEL = "tether.dev/schedule"
INVARIANT = 14


def _epoch(text: Any) -> int | None:
    if not text:
        return None
    return int(dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp())


def _slot_of(run_name: str, schedule: str) -> int | None:
    tail = run_name[len(schedule) + 1:] if run_name.startswith(schedule + "-") else ""
    return int(tail) if len(tail) == 10 and tail.isdigit() else None


def judge_schedules(records: Iterable[AuditRecord], namespace: str, schedules: Mapping[str, tuple[int, dict[str, Any]]],
                    violations: list[tuple[int, str, str]], stats: Counter[str]) -> None:
    """Invariant 14 for each schedule (name -> (its @every period in seconds, its final object))."""
    records = [r for r in records if r.object_ref is not None and r.object_ref.namespace == namespace]
    for name, (period, final) in schedules.items():
        created = Counter(
            str(r.request_object["metadata"]["name"]) for r in records
            if r.verb == "create" and r.accepted and not r.dry_run and r.about("workerruns", namespace)
            and r.request_object is not None
            and ((r.request_object.get("metadata") or {}).get("labels") or {}).get(LABEL) == name)
        for run, n in created.items():
            if n > 1:
                violations.append((INVARIANT, run, f"created {n} times"))
        slots = {s for run in created if (s := _slot_of(run, name)) is not None}
        writes = sorted((r for r in records if r.accepted and r.verb in ("update", "patch") and r.response_object
                         and r.about("workerrunschedules", namespace, name, "status")),
                        key=lambda r: int(r.response_object["metadata"]["resourceVersion"]))  # type: ignore[index]
        handled: int | None = None
        named: set[int] = set()
        for w in writes:
            status = w.response_object.get("status") or {}  # type: ignore[union-attr]
            last = _epoch(status.get("lastScheduleTime"))
            if handled is not None and last is not None and last < handled:
                violations.append((INVARIANT, name, f"lastScheduleTime went back from {handled} to {last} "
                                                    f"(resourceVersion {w.response_object['metadata']['resourceVersion']})"))  # type: ignore[index]
            handled = max(handled or 0, last or 0) or None
            skipped = status.get("lastSkipped") or {}
            if (at := _epoch(skipped.get("scheduledTime"))) is not None:
                named.add(at)
        both = sorted(slots & named)
        if both:
            violations.append((INVARIANT, name, f"slot(s) both started and recorded as skipped: {both[:5]}"))
        fs = final.get("status") or {}
        end = _epoch(fs.get("lastScheduleTime"))
        if end is None or not (slots | named):
            continue
        first = min(slots | named)
        window = range(first, end + 1, period)
        unaccounted = [s for s in window if s not in slots and s not in named]
        counted = int(fs.get("skippedCount") or 0) - len(named)
        if len(unaccounted) > max(0, counted):
            violations.append((INVARIANT, name, f"{len(unaccounted)} slot(s) neither started nor recorded as "
                                                f"skipped (skippedCount counts {max(0, counted)} unnamed): "
                                                f"{unaccounted[:5]}"))
        stray = sorted(s for s in slots if s % period or not first <= s <= end)
        if stray:
            violations.append((INVARIANT, name, f"runs for instants that are no slot it handled: {stray[:5]}"))
        stats["schedule slots started"] += len(slots)
        stats["schedule slots skipped (named)"] += len(named)
