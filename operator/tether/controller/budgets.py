"""The operator's view of WorkerBudgets: a cache fed by the watch, the observation a run's
decision needs, and charging with a compare-and-swap on the budget's status."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any, Awaitable, Callable

from tether import metrics
from tether.api.models import Usage, WorkerBudget, WorkerRun
from tether.core import budget as budgets
from tether.core.decide import BudgetObservation
from tether.kube.client import Conflict, KubeClient, NotFound

log = logging.getLogger("tether.budgets")

BudgetKey = tuple[str, str]  # (namespace, name)


class BudgetBook:
    def __init__(self, kube: KubeClient, now: Callable[[], dt.datetime]) -> None:
        self.kube = kube
        self.now = now
        self.cache: dict[BudgetKey, dict[str, Any]] = {}
        # The validated model of each cached body, by resourceVersion: a budget shared by
        # thousands of runs is parsed once per change, not once per reconcile.
        self._models: dict[BudgetKey, tuple[str, WorkerBudget]] = {}
        self._refreshing: set[BudgetKey] = set()
        self._background: set[asyncio.Task[None]] = set()

    def on_event(self, event_type: str | None, body: dict[str, Any]) -> BudgetKey:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if event_type == "DELETED":
            self.cache.pop(key, None)
            self._models.pop(key, None)
        else:
            self.cache[key] = body
            self._refresh_soon(key)
        return key

    def _refresh_soon(self, key: BudgetKey) -> None:
        if key in self._refreshing:
            return
        self._refreshing.add(key)
        task = asyncio.create_task(self._refresh(key))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def _refresh(self, key: BudgetKey) -> None:
        """Keeps a budget's status current (remaining, period, Exhausted) when nothing is charged."""
        ns, name = key
        try:
            body = await self.kube.get_budget(ns, name)
            if body is None:
                return
            budget = WorkerBudget.model_validate(body)
            status = budgets.refresh(budget, self.now())
            if status.dump() == budget.status.dump():
                return
            written = await self.kube.replace_budget_status({**body, "status": status.dump()})
            if key in self.cache:  # never bring back a budget whose deletion was seen meanwhile
                self.cache[key] = written
        except (Conflict, NotFound):
            pass  # a newer version arrives by watch and triggers another refresh
        except Exception as exc:  # noqa: BLE001 - best effort; charges refresh it too
            log.warning("budget refresh failed", extra={"budget": f"{ns}/{name}", "error": str(exc)})
        finally:
            self._refreshing.discard(key)

    async def observe(self, run: WorkerRun, now: dt.datetime) -> BudgetObservation | None:
        ref = run.spec.budget.budget_ref if run.spec.budget else None
        if ref is None:
            return None
        key = (run.metadata.namespace, ref.name)
        body = self.cache.get(key)
        if body is None:
            # Not seen by the watch (yet): ask, so a starting operator does not think it missing.
            body = await self.kube.get_budget(*key)
            if body is None:
                return BudgetObservation(name=ref.name, missing=True)
            self.cache[key] = body
        budget = self._model(key, body)
        status = budgets.refresh(budget, now)
        if status.period_start != budget.status.period_start:
            self._refresh_soon(key)
        reset = budgets.next_period_start(now, budget.spec)
        next_reset = None if reset is None else (reset - now).total_seconds()
        return BudgetObservation(
            name=ref.name, exhausted=budgets.exhausted(budget.spec, status.spent),
            remaining=status.remaining or Usage(), charged=budgets.charged(budget, run.metadata.uid),
            marked=run.metadata.uid in budget.status.charges, next_reset_seconds=next_reset)

    def _model(self, key: BudgetKey, body: dict[str, Any]) -> WorkerBudget:
        rv = body["metadata"].get("resourceVersion", "")
        known = self._models.get(key)
        if known is not None and known[0] == rv:
            return known[1]
        model = WorkerBudget.model_validate(body)
        self._models[key] = (rv, model)
        return model

    async def release(self, run: WorkerRun, budget_name: str) -> bool:
        """Drops the run's mark (CAS). False: the budget kept changing; try again later."""
        ns = run.metadata.namespace
        for _ in range(10):
            body = await self.kube.get_budget(ns, budget_name)
            if body is None:
                return True  # nothing left to release
            self.cache[(ns, budget_name)] = body  # the newest view, even when there is nothing to do
            budget = WorkerBudget.model_validate(body)
            if run.metadata.uid not in budget.status.charges:
                return True
            status = budgets.release(budget, run.metadata.uid, self.now())
            try:
                written = await self.kube.replace_budget_status({**body, "status": status.dump()})
            except Conflict:
                metrics.BUDGET_CONFLICTS.inc()
                continue
            if (ns, budget_name) in self.cache:
                self.cache[(ns, budget_name)] = written
            return True
        return False

    async def charge(self, run: WorkerRun, budget_name: str, total: Usage,
                     baseline: Callable[[], Awaitable[Usage | None]]) -> Usage | None:
        """CAS on the budget's status; the per-run mark makes a repeated charge add nothing.
        A run without a mark is new to the budget, or was charged and left the ledger: then
        `baseline` (a fresh read of the run's status.charged; None: the run is gone) says what
        it was charged, on every attempt of the loop — another replica may have charged and
        released it in between. Returns what was newly charged, or None when the budget could
        not be charged now."""
        ns = run.metadata.namespace
        for _ in range(10):
            body = await self.kube.get_budget(ns, budget_name)
            if body is None:
                self.cache.pop((ns, budget_name), None)  # gone: the next observation says so
                return None
            self.cache[(ns, budget_name)] = body
            budget = WorkerBudget.model_validate(body)
            base = None
            if run.metadata.uid not in budget.status.charges:
                base = await baseline()
                if base is None:
                    return None
            status = budgets.apply_charge(budget, run.metadata.uid, run.metadata.name, total, self.now(), base)
            before = budgets.charged(budget, run.metadata.uid) if base is None else base
            try:
                written = await self.kube.replace_budget_status({**body, "status": status.dump()})
            except Conflict:
                metrics.BUDGET_CONFLICTS.inc()
                continue  # another run charged first: re-read and apply our difference again
            if (ns, budget_name) in self.cache:
                self.cache[(ns, budget_name)] = written
            added = Usage(cents=max(0, total.cents - before.cents), tokens=max(0, total.tokens - before.tokens))
            metrics.BUDGET_CHARGED_CENTS.labels(ns, budget_name).inc(added.cents)
            metrics.BUDGET_CHARGED_TOKENS.labels(ns, budget_name).inc(added.tokens)
            return added
        return None
