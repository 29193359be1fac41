"""Pods of deleted runs, on their own queue (the Job controller's orphan queue): deleted, and
released from Tether's finalizer, so nothing hangs in Terminating. Keyed by run key, since a
namesake re-created under that key must never be mistaken for the pods' owner."""

from __future__ import annotations

import logging
from typing import Any, Callable

from tether.api import constants as c
from tether.controller.cache import RunCache
from tether.controller.errors import Again
from tether.controller.leader import Leadership
from tether.controller.loop import Result
from tether.controller.views import RunKey
from tether.kube.client import KubeClient, NotFound

log = logging.getLogger("tether.controller")


class StrayReconciler:
    def __init__(self, kube: KubeClient, cache: RunCache, leadership: Leadership,
                 saw_run: Callable[[dict[str, Any]], None]) -> None:
        self.kube, self.cache, self.leadership, self.saw_run = kube, cache, leadership, saw_run

    def exists(self, key: RunKey) -> bool:
        return bool(self.cache.strays(key))

    async def reconcile(self, key: RunKey) -> Result:
        strays = self.cache.strays(key)
        if not strays:
            return Result()
        self.leadership.check()
        if key not in self.cache.runs:
            # The cache may simply not have seen the run yet: ask before releasing anything.
            try:
                fresh = await self.kube.get_run(*key)
            except NotFound:
                fresh = None
            if fresh is not None:
                self.saw_run(fresh)  # as a watch event: the run's own pass follows
                raise Again("the run exists after all")
        for pod in strays:
            self.leadership.check()
            # By UID: the name is deterministic, and the namesake's own pod may carry it by now.
            if not pod.deleting:
                await self.kube.delete_pod(pod.namespace, pod.name, uid=pod.uid)
            self.leadership.check()
            self.cache.pod_written(key, pod.name, await self.kube.remove_finalizer(pod.namespace, pod.name,
                                                                                   c.POD_FINALIZER, uid=pod.uid))
            log.info("released a pod of a deleted run", extra={"run": "/".join(key), "pod": pod.name,
                                                              "event": "stray_pod_released"})
        return Result(acted=True)
