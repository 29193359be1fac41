"""Namespaces being deleted: kopf stops watching a namespace once it is being deleted, yet its
runs still need their cleanup (Tether's finalizer holds them). Until the namespace is gone, what
is left there is listed every few seconds and fed to the controller as the watch would have."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from tether.api import constants as c
from tether.controller.budgets import BudgetBook
from tether.controller.cache import RunCache
from tether.controller.views import PodView, RunView
from tether.kube.client import Forbidden, KubeClient, NotFound, Unavailable
from tether.kube.paths import budget_path, lease_path, namespace_path, pod_path, run_path

log = logging.getLogger("tether.controller")

# How often a namespace being deleted (no longer watched by kopf) is listed.
SWEEP_SECONDS = 2.0
# How long a namespace that refused a create as "being terminated" gets no new attempts.
TERMINATING_NAMESPACE_SECONDS = 30.0

# (kind, event type, body): the controller's watch-event entry.
Feed = Callable[[str, str, dict[str, Any]], None]


class NamespaceSweeper:
    def __init__(self, kube: KubeClient, cache: RunCache, budgets: BudgetBook, feed: Feed,
                 on_terminating: Callable[[str], None]) -> None:
        self.kube, self.cache, self.budgets, self.feed = kube, cache, budgets, feed
        self.on_terminating = on_terminating
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def terminating(self, ns: str) -> bool:
        return self.cache.mono() - self.cache.terminating.get(ns, -1e18) < TERMINATING_NAMESPACE_SECONDS

    def mark(self, ns: str) -> None:
        """The namespace is being deleted: no attempts start there, and it is swept until it is gone."""
        self.cache.terminating[ns] = self.cache.mono()
        self.on_terminating(ns)
        if ns not in self._tasks:
            task = asyncio.create_task(self._sweep(ns), name=f"sweep {ns}")
            self._tasks[ns] = task
            task.add_done_callback(lambda _: self._tasks.pop(ns, None))

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _sweep(self, ns: str) -> None:
        try:
            await self._sweep_until_gone(ns)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - said, not silent: the namespace's runs wait for the watch then
            log.exception("namespace sweep failed", extra={"namespace": ns, "event": "sweep_failed"})
            self.cache.terminating.pop(ns, None)

    async def _sweep_until_gone(self, ns: str) -> None:
        """Until the namespace that was being deleted is gone: not there, another namespace of the
        same name (re-created between two sweeps), or not being deleted after all."""
        uid: str | None = None
        while True:
            marks = self._marks()
            try:
                body = await self.kube.get_object(namespace_path(ns))
                if body is None:
                    self._relist(ns, marks, [], [], [], [])  # gone, and all that was in it
                    break
                if not body["metadata"].get("deletionTimestamp") or uid not in (None, body["metadata"].get("uid")):
                    # Live (re-created, or never being deleted): say once what is really there; the
                    # watch goes on from it.
                    await self._relist_now(ns)
                    break
                uid = body["metadata"].get("uid")
                await self._relist_now(ns)
            except (Unavailable, Forbidden, NotFound) as exc:
                log.warning("cannot list a namespace being deleted", extra={"namespace": ns, "error": str(exc)})
            self.cache.terminating[ns] = self.cache.mono()
            await asyncio.sleep(SWEEP_SECONDS)
        self.cache.terminating.pop(ns, None)  # a namespace of that name created later starts afresh

    def _marks(self) -> tuple[int, int]:
        return self.cache.stamps.mark(), self.budgets.stamps.mark()

    async def _relist_now(self, ns: str) -> None:
        marks = self._marks()
        runs = await self.kube.list_objects(run_path(ns))
        pods = await self.kube.list_objects(pod_path(ns), c.LABEL_RUN)
        leases = await self.kube.list_objects(lease_path(ns), c.LABEL_RUN)
        budgets = await self.kube.list_objects(budget_path(ns))
        self._relist(ns, marks, runs, pods, leases, budgets)

    def _relist(self, ns: str, marks: tuple[int, int], runs: list[dict[str, Any]], pods: list[dict[str, Any]],
                leases: list[dict[str, Any]], budgets: list[dict[str, Any]]) -> None:
        """Like an informer's relist: what is listed is current, what is not listed is gone, unless
        the watch brought it after the lists began (`marks`: stamps.py)."""
        cached, budgeted = marks
        for body in runs:
            if self.cache.stamps.before(RunView(body).key, cached):  # else the watch has as new or newer
                self.feed("run", "MODIFIED", body)
        listed = {RunView(r).name for r in runs}
        for body in [b for (rns, name) in list(self.cache.runs) if rns == ns and name not in listed
                     if (b := self.cache.run_cached_before((rns, name), cached)) is not None]:
            self.feed("run", "DELETED", body)
        for body in leases:
            self.feed("lease", "MODIFIED", body)
        for body in pods:
            if self.cache.pod_read_current(body, cached):
                self.feed("pod", "MODIFIED", body)
        listed = {PodView(p).name for p in pods}
        for body in [b for key in {run_key for run_key, _ in self.cache.pods} if key[0] == ns
                     for b in self.cache.pods_cached_before(key, cached) if PodView(b).name not in listed]:
            self.feed("pod", "DELETED", body)
        listed = {b["metadata"]["name"] for b in budgets}
        for body in [b for (bns, name), b in self.budgets.cache.copy().items() if bns == ns and name not in listed
                     and self.budgets.stamps.before((bns, name), budgeted)]:
            self.feed("budget", "DELETED", body)
