"""The operator's view of WorkerBudgets: a cache fed by the watch, the observation a run's
decision needs, and charging with a compare-and-swap on the budget's status."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable

from pydantic import ValidationError

from tether import metrics
from tether.api.models import Usage, WorkerBudget, WorkerRun
from tether.core import budget as budgets
from tether.core.decide import BudgetObservation
from tether.controller.errors import NotLeader
from tether.controller.leader import Leadership
from tether.controller.store import Store
from tether.kube.client import Conflict, KubeClient, NotFound

BudgetKey = tuple[str, str]  # (namespace, name)


@dataclass
class _Queued:
    """A ledger change waiting for its budget's next write."""

    op: budgets.LedgerOp
    baseline: Callable[[], Awaitable[Usage | None]] | None
    done: asyncio.Future[Usage | None]


class BudgetBook:
    def __init__(self, kube: KubeClient, now: Callable[[], dt.datetime], leadership: Leadership | None = None) -> None:
        self.kube = kube
        self.now = now
        self.leadership = leadership or Leadership()
        self.cache: Store[BudgetKey] = Store(time.monotonic)
        self.stamps = self.cache.stamps  # when each cached budget changed: stamps.py
        # The validated model of each cached body, by resourceVersion: a budget shared by
        # thousands of runs is parsed once per change, not once per reconcile.
        self._models: dict[BudgetKey, tuple[str, WorkerBudget]] = {}
        # Wakes the budget's refresh (budget_refresh.py, a reconciler of its own); set by its registration.
        self.wake_refresh: Callable[[BudgetKey], None] = lambda key: None
        self._queued: dict[BudgetKey, list[_Queued]] = {}
        self._writers: dict[BudgetKey, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()

    def on_event(self, event_type: str | None, body: dict[str, Any]) -> tuple[BudgetKey, bool]:
        """Stores a budget's event; returns its key and whether its status is due a refresh."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if event_type == "DELETED":
            self.cache.remove(key)
            self._models.pop(key, None)
            return key, False
        self.cache.store(key, body)
        return key, self._due(key, body)

    def _due(self, key: BudgetKey, body: dict[str, Any]) -> bool:
        try:
            return budgets.needs_refresh(self._model(key, body), self.now())
        except ValidationError:
            return True  # the refresh reads it again and says what is wrong

    def read(self, key: BudgetKey, body: dict[str, Any] | None, mark: int) -> dict[str, Any] | None:
        """Our own GET's answer (`mark` taken before it was sent), kept unless the watch stored or
        removed the budget since: then what the watch says stands. Returns what is cached now."""
        if self.cache.read(key, body, mark):
            if body is None:
                self._models.pop(key, None)
            elif self._due(key, body):
                self.wake_refresh(key)
        return self.cache.get(key)

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def refresh(self, key: BudgetKey) -> None:
        """Brings a budget's status up to date (remaining, period, Exhausted) when nothing is charged,
        from a fresh read; a conflict or a failure is raised to its reconcile loop, which retries."""
        body = await self.kube.get_budget(*key)
        if body is None:
            return
        budget = WorkerBudget.model_validate(body)
        status = budgets.refresh(budget, self.now())
        if status.dump() == budget.status.dump():
            return
        written = await self.kube.replace_budget_status({**body, "status": status.dump()})
        self._store_written(key, {body["metadata"].get("resourceVersion")}, written)
        problem = budgets.time_zone_problem(budget.spec)
        if problem is not None and not any(c.type == budgets.COND_TIME_ZONE for c in budget.status.conditions):
            await self.kube.post_event(written, "Warning", budgets.REASON_UNKNOWN_TIME_ZONE, problem)

    async def observe(self, run: WorkerRun, now: dt.datetime) -> BudgetObservation | None:
        ref = run.spec.budget.budget_ref if run.spec.budget else None
        if ref is None:
            return None
        key = (run.metadata.namespace, ref.name)
        body = self.cache.get(key)
        if body is None:
            # Not seen by the watch (yet): ask, so a starting operator does not think it missing.
            mark = self.stamps.mark()
            body = self.read(key, await self.kube.get_budget(*key), mark)
            if body is None:
                return BudgetObservation(name=ref.name, missing=True)
        budget = self._model(key, body)
        status = budgets.refresh(budget, now)
        if status.period_start != budget.status.period_start:
            self.wake_refresh(key)
        reset = budgets.next_period_start(now, budget.spec)
        next_reset = None if reset is None else (reset - now).total_seconds()
        return BudgetObservation(
            name=ref.name, exhausted=budgets.exhausted(budget.spec, status.spent),
            remaining=budgets.remaining(budget.spec, status.spent), charged=budgets.charged(budget, run.metadata.uid),
            marked=run.metadata.uid in budget.status.charges, next_reset_seconds=next_reset)

    def _store_written(self, key: BudgetKey, over: set[str | None], written: dict[str, Any]) -> None:
        """Caches our write's answer only while the cache still holds a version it replaced (in
        `over`): an event that arrived during the write (a newer write, the deletion, a namesake
        re-created) stays, and the watch brings our write in its turn."""
        self.cache.written(key, written, *over)

    def _model(self, key: BudgetKey, body: dict[str, Any]) -> WorkerBudget:
        rv = body["metadata"].get("resourceVersion", "")
        known = self._models.get(key)
        if known is not None and known[0] == rv:
            return known[1]
        model = WorkerBudget.model_validate(body)
        self._models[key] = (rv, model)
        return model

    async def release(self, run: WorkerRun, budget_name: str) -> bool:
        """Drops the run's mark. False: the budget kept changing; try again later."""
        op = budgets.LedgerOp(run.metadata.uid, run.metadata.name, None)
        return await self._enqueue((run.metadata.namespace, budget_name), op, None) is not None

    async def charge(self, run: WorkerRun, budget_name: str, total: Usage,
                     baseline: Callable[[], Awaitable[Usage | None]]) -> Usage | None:
        """Charges the run's total; the per-run mark makes a repeated charge add nothing. A run
        without a mark is new to the budget, or was charged and left the ledger: then `baseline`
        (a fresh read of the run's status.charged; None: the run is gone) says what it was
        charged, on every attempt of the write — another replica may have charged and released
        it in between. Returns what was newly charged, or None when the budget could not be
        charged now."""
        op = budgets.LedgerOp(run.metadata.uid, run.metadata.name, total)
        return await self._enqueue((run.metadata.namespace, budget_name), op, baseline)

    async def _enqueue(self, key: BudgetKey, op: budgets.LedgerOp,
                       baseline: Callable[[], Awaitable[Usage | None]] | None) -> Usage | None:
        """One writer per budget: whatever the runs ask while a write is in flight goes into the
        next one, so a thousand runs charging one budget cost a few writes per second, not a
        thousand conflicting ones."""
        done: asyncio.Future[Usage | None] = asyncio.get_running_loop().create_future()
        self._queued.setdefault(key, []).append(_Queued(op, baseline, done))
        if key not in self._writers:
            task = asyncio.create_task(self._write_all(key))
            self._writers[key] = task
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            task.add_done_callback(lambda t: self._writer_gone(key, t))
        return await done

    def _writer_gone(self, key: BudgetKey, task: asyncio.Task[None]) -> None:
        """A writer cancelled before its first step never ran its `finally`: without this, its
        runs and every later charge of the budget would wait for it forever."""
        if self._writers.get(key) is task:
            del self._writers[key]
            for q in self._queued.pop(key, []):
                if not q.done.done():
                    q.done.cancel()

    async def _write_all(self, key: BudgetKey) -> None:
        batch: list[_Queued] = []
        try:
            while batch := self._queued.pop(key, []):
                try:
                    results = await self._settle(key, batch)
                except Exception as exc:  # noqa: BLE001 - each waiting reconcile handles it as its own
                    for q in batch:
                        if not q.done.done():
                            q.done.set_exception(exc)
                    continue
                for q, result in zip(batch, results):
                    if q.done.done():
                        continue
                    if isinstance(result, Exception):
                        q.done.set_exception(result)  # that run's own failure (its baseline read)
                    else:
                        q.done.set_result(result)
        finally:
            del self._writers[key]  # no await since the queue was found empty: nothing is left behind
            for q in batch + self._queued.pop(key, []):  # cancelled (the operator stops)
                if not q.done.done():
                    q.done.cancel()

    async def _settle(self, key: BudgetKey, batch: list[_Queued]) -> list[Usage | Exception | None]:
        """One CAS on the budget's status for the whole batch, from the newest body known (the
        last write's answer); a conflict reads it fresh and applies the batch again. A run whose
        baseline read fails is left out of the write and gets its own exception."""
        ns, name = key
        body = self.cache.get(key)
        over: set[str | None] = set()  # the versions our write replaces, directly or by a retry
        for _ in range(10):
            if body is None:
                body = await self.kube.get_budget(ns, name)
                if body is None:
                    self._drop(key)  # gone: the next observation says so
                    return [None] * len(batch)
            over.add(body["metadata"].get("resourceVersion"))
            budget = self._model(key, body)
            # A run without a mark: what it recorded as charged, read fresh on every attempt. A
            # charge after the same run's release in this batch has no mark either when applied.
            need, released = [], set()
            for i, q in enumerate(batch):
                if q.op.total is None:
                    released.add(q.op.run_uid)
                elif q.baseline is not None and (q.op.run_uid not in budget.status.charges or q.op.run_uid in released):
                    need.append(i)
            read = await asyncio.gather(*(batch[i].baseline() for i in need), return_exceptions=True)  # type: ignore[misc]
            bases: dict[int, Usage | BaseException | None] = dict(zip(need, read))
            # Left out: the run is gone (None), or its read failed (that run's error alone).
            live = [i for i in range(len(batch)) if i not in bases or isinstance(bases[i], Usage)]
            ops = [replace(batch[i].op, base=bases.get(i)) for i in live]  # type: ignore[arg-type]
            status, added = budgets.settle(budget, ops, self.now())
            try:
                self.leadership.check()  # a deposed leader's batch is not written
                written = await self.kube.replace_budget_status({**body, "status": status.dump()})
            except NotLeader as exc:
                return [exc] * len(batch)
            except Conflict:
                metrics.BUDGET_CONFLICTS.inc()
                body = None  # another writer (a refresh, another replica) came first: read again
                continue
            except NotFound:
                self._drop(key)
                return [None] * len(batch)
            self._store_written(key, over, written)
            results: list[Usage | Exception | None] = [None] * len(batch)
            for i, failed in bases.items():
                if isinstance(failed, Exception):
                    results[i] = failed
            for i, usage in zip(live, added):
                results[i] = usage
            metrics.BUDGET_CHARGED_CENTS.labels(ns, name).inc(sum(u.cents for u in added))
            metrics.BUDGET_CHARGED_TOKENS.labels(ns, name).inc(sum(u.tokens for u in added))
            return results
        return [None] * len(batch)
