"""The WorkerRunSchedule reconciler: observes the schedule and its runs, asks `decide`, and writes.

The writes of a pass, in this order, each conditional:

1. before it starts or stops anything or records a slot as handled, fresh reads: the schedule (the
   status the decision was made on), its runs (a list by label: a cache not yet listed after a restart or a failover, or one
   that has not seen this reconciler's last start, never makes Forbid or Replace start a second
   run) and the WorkerBudget its runs draw on; anything else than what was decided on, and the
   pass is decided again;
2. the runs to start: a run's name derives from its slot, so a retry, a restart or a second replica
   finds it created (AlreadyExists, ours) instead of creating another; then `spec.stop` on runs
   Replace stops (a JSON patch that tests their UID);
3. the status, against the resourceVersion read (a compare-and-swap): the slot handled;
4. only then the runs past the history limits, by UID: their slots are recorded as handled, so
   deleting them can never make a slot look due again.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any, Callable

from pydantic import ValidationError

from tether.api.constants import RUN_FINALIZER
from tether.api.models import API_VERSION, TERMINAL_PHASES, WorkerBudget
from tether.controller.errors import Again
from tether.controller.leader import Leadership
from tether.controller.loop import Result
from tether.controller.store import Store
from tether.core import budget as budget_rules
from tether.kube.client import Conflict, Forbidden, Invalid, KubeClient, NotFound
from tether.kube.paths import run_path
from tether.schedules.api import ANN_SCHEDULED_AT, LABEL_SCHEDULE, SCHEDULE_KIND, WorkerRunSchedule, schedule_of_run_name
from tether.schedules.decide import CreateRun, ScheduleDecision, ScheduleObserved, ScheduleRun, decide
from tether.schedules.paths import schedule_path

log = logging.getLogger("tether.schedules")

ScheduleKey = tuple[str, str]
# Runs by the schedule their name derives from (its own, and namesakes it does not own).
BY_SCHEDULE = "schedule"
# A replica that does not lead looks again this often (it takes over what is due once it leads).
FOLLOWER_RETRY_SECONDS = 5.0


def run_schedule(body: dict[str, Any]) -> ScheduleKey | None:
    meta = body.get("metadata") or {}
    name = schedule_of_run_name(str(meta.get("name") or ""))
    return (str(meta.get("namespace")), name) if name else None


class ScheduleReconciler:
    def __init__(self, kube: KubeClient, schedules: Store[ScheduleKey], runs: Store[Any],
                 budgets: Callable[[tuple[str, str]], dict[str, Any] | None],
                 budget_of: Callable[[str, dict[str, Any]], str | None], leadership: Leadership,
                 now: Callable[[], dt.datetime], feed: Callable[[str, str | None, dict[str, Any]], None]) -> None:
        self.kube, self.schedules, self.runs = kube, schedules, runs
        self.budgets, self.budget_of = budgets, budget_of
        self.leadership, self.now = leadership, now
        self.feed = feed  # what the operator reads itself enters the stores as a watch event would
        # Starts the API server refused for good (a policy, a class bound), by schedule UID: the
        # next pass records them as skipped instead of trying again at every pass.
        self.refused: dict[str, dict[str, str]] = {}

    def exists(self, key: ScheduleKey) -> bool:
        return key in self.schedules

    def observe(self, key: ScheduleKey, body: dict[str, Any], schedule: WorkerRunSchedule,
                now: dt.datetime) -> ScheduleObserved:
        runs: list[ScheduleRun] = []
        taken: set[str] = set()
        for run_key in self.runs.by(BY_SCHEDULE, key):
            run = self.runs.get(run_key)
            if run is None:
                continue
            if _owner_uid(run) != schedule.metadata.uid:
                taken.add(run["metadata"]["name"])
            else:
                runs.append(_schedule_run(run))
        return ScheduleObserved(schedule=schedule, runs=tuple(runs), taken=frozenset(taken),
                                exhausted_budget=self._exhausted(key[0], self._budget_body(key[0], body), now),
                                refused=dict(self.refused.get(schedule.metadata.uid, {})))

    def _budget_body(self, ns: str, schedule: dict[str, Any]) -> tuple[str, dict[str, Any] | None] | None:
        name = self.budget_of(ns, schedule["spec"]["runTemplate"]["spec"])
        return (name, self.budgets((ns, name))) if name else None

    @staticmethod
    def _exhausted(ns: str, budget: tuple[str, dict[str, Any] | None] | None, now: dt.datetime) -> str | None:
        if budget is None or budget[1] is None:
            return None  # none, or none of that name: the run's own pass says BudgetNotFound
        try:
            parsed = WorkerBudget.model_validate(budget[1])
        except ValidationError:
            return None
        return budget[0] if budget_rules.exhausted(parsed.spec, budget_rules.refresh(parsed, now).spent) else None

    async def reconcile(self, key: ScheduleKey) -> Result:
        if not self.leadership.may_act():
            return Result(requeue_after=FOLLOWER_RETRY_SECONDS)
        body = self.schedules.get(key)
        if body is None:
            return Result()
        try:
            schedule = WorkerRunSchedule.model_validate(body)
        except ValidationError as exc:
            log.warning("schedule does not parse", extra={"schedule": "/".join(key), "error": str(exc)[:500],
                                                          "event": "schedule_invalid"})
            return Result()
        now = self.now()
        observed = self.observe(key, body, schedule, now)
        d = decide(observed, now)
        rv = schedule.metadata.resource_version
        # Fresh reads before any start or stop, and before a slot is recorded as handled (a skip on a
        # cache that missed a late creation of that slot would be a false record).
        handles_a_slot = d.status is not None and d.status.last_schedule_time != schedule.status.last_schedule_time
        if d.create or d.stop or handles_a_slot:
            await self._fresh(key, body, observed, now)
        for create in d.create:
            await self._create(key, body, create)
        for ref in d.stop:
            await self._stop(key[0], ref.name, ref.uid or "")
        if d.status is not None:
            written = await self._write_status(key, body, d)
            self.refused.pop(schedule.metadata.uid, None)
            self.schedules.written(key, written, rv)
        for ref in d.delete:
            await self.kube.delete_object(run_path(key[0], ref.name), ref.uid or "")
        for event in d.events:
            await self.kube.post_event(body, event.type, event.reason, event.message)
        acted = bool(d.create or d.stop or d.status is not None or d.delete)
        if d.wake_at is None:
            return Result(acted=acted)
        # A moment past the slot: a timer that fires a hair early finds it not due yet.
        return Result(requeue_after=max(0.0, (d.wake_at - self.now()).total_seconds()) + 0.05, acted=acted)

    async def _fresh(self, key: ScheduleKey, body: dict[str, Any], observed: ScheduleObserved, now: dt.datetime) -> None:
        """What the decision rests on, read from the API server: the schedule as decided on, its runs
        as observed, its budget as judged; else the stores learn it and the pass is decided again."""
        ns, name = key
        mark = self.schedules.stamps.mark()
        fresh = await self.kube.get_object(schedule_path(ns, name))
        if fresh is None or str(fresh["metadata"].get("resourceVersion")) != observed.schedule.metadata.resource_version:
            self.schedules.read(key, fresh, mark)
            raise Again("the schedule changed since it was decided on")
        listed = await self.kube.list_objects(run_path(ns), label_selector=f"{LABEL_SCHEDULE}={name}")
        for run in listed:
            self.feed("run-read", None, run)
        mine = {_schedule_run(r) for r in listed if _owner_uid(r) == observed.schedule.metadata.uid}
        if mine != set(observed.runs):
            raise Again("the schedule's runs are not what the cache showed")
        budget = self._budget_body(ns, body)
        if budget is not None:
            got = await self.kube.get_budget(ns, budget[0])
            if got is not None:
                self.feed("budget", "MODIFIED", got)
            if self._exhausted(ns, (budget[0], got), now) != observed.exhausted_budget:
                raise Again("the budget is not what the cache showed")

    async def _create(self, key: ScheduleKey, schedule: dict[str, Any], create: CreateRun) -> None:
        ns, name = key
        template = schedule["spec"]["runTemplate"]
        meta = template.get("metadata") or {}
        # Only a slot's run says it is one (a template's copy would give a manual start a slot).
        annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != ANN_SCHEDULED_AT}
        if create.scheduled_time is not None:
            annotations[ANN_SCHEDULED_AT] = create.scheduled_time.strftime("%Y-%m-%dT%H:%M:%SZ")
        run = {
            "apiVersion": API_VERSION, "kind": "WorkerRun",
            "metadata": {
                "name": create.name, "namespace": ns,
                "labels": {**(meta.get("labels") or {}), LABEL_SCHEDULE: name},
                "annotations": annotations,
                # Its own finalizer from the start: no pass is needed to add it.
                "finalizers": [RUN_FINALIZER],
                "ownerReferences": [{"apiVersion": API_VERSION, "kind": SCHEDULE_KIND, "name": name,
                                     "uid": schedule["metadata"]["uid"], "controller": True}],
            },
            # The template's spec as written (not a parsed copy): what it leaves out, its class fills in.
            "spec": template["spec"],
        }
        uid = schedule["metadata"]["uid"]
        try:
            self.feed("run-read", None, await self.kube.create(run_path(ns), run))
        except Conflict:
            existing = await self.kube.get_object(run_path(ns, create.name))
            if existing is None:
                raise Again(f"{create.name} existed, and is gone since") from None
            self.feed("run-read", None, existing)
            if _owner_uid(existing) != uid:
                raise Again(f"{create.name} is taken") from None  # the next pass sees it: NameTaken
            # Ours already: created by an earlier pass, another replica, or before a restart.
        except (Invalid, Forbidden) as exc:
            if isinstance(exc, Forbidden) and not exc.refuses_the_object:
                raise
            self.refused.setdefault(uid, {})[create.name] = exc.message
            raise Again(f"{create.name} was refused: {exc.message}") from None
        log.info("schedule started a run", extra={"schedule": "/".join(key), "run": create.name,
                                                  "event": "schedule_run_created"})

    async def _stop(self, ns: str, name: str, uid: str) -> None:
        patch: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/uid", "value": uid},
                 {"op": "replace", "path": "/spec/stop", "value": True}]
        try:
            await self.kube.json_patch(run_path(ns, name), patch, f"stop workerrun {ns}/{name}")
        except (NotFound, Invalid):
            pass  # gone, or a namesake: nothing of ours to stop

    async def _write_status(self, key: ScheduleKey, body: dict[str, Any], d: ScheduleDecision) -> dict[str, Any]:
        assert d.status is not None
        new = {**body, "status": d.status.dump()}
        try:
            return await self.kube.replace_status(schedule_path(*key), new, f"schedule {'/'.join(key)}")
        except NotFound:
            self.schedules.read(key, None, self.schedules.stamps.mark())  # deleted; its DELETED may be lost
            raise Again("the schedule is gone") from None
        except Conflict as exc:
            raise Again(f"the schedule changed under its status write: {exc}") from None


def _owner_uid(run: dict[str, Any]) -> str | None:
    owners = [o for o in run["metadata"].get("ownerReferences") or [] if o.get("controller")]
    return str(owners[0].get("uid")) if owners else None


def _schedule_run(run: dict[str, Any]) -> ScheduleRun:
    meta, status = run["metadata"], run.get("status") or {}
    phase = str(status.get("phase") or "Pending")
    return ScheduleRun(
        name=meta["name"], uid=meta["uid"], scheduled_time=_time((meta.get("annotations") or {}).get(ANN_SCHEDULED_AT)),
        created=_time(meta.get("creationTimestamp")), terminal=phase in {p.value for p in TERMINAL_PHASES},
        succeeded=phase == "Succeeded", finished_at=_time(status.get("finishedAt")), phase=phase,
        stopping=bool((run.get("spec") or {}).get("stop")), deleting=bool(meta.get("deletionTimestamp")))


def _time(text: Any) -> dt.datetime | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None

