"""The WorkerClasses this operator knows (from their watch), and each run's body as its decisions
read it: with what it took from its class applied (core/classes.py decides which and what)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from pydantic import ValidationError

from tether.api import workerclass as wc
from tether.api.models import WorkerRun
from tether.core.classes import ClassResolution, KnownClass, resolve
from tether.kube.client import ApiError, NotFound

log = logging.getLogger("tether.controller")


class ClassBook:
    def __init__(self) -> None:
        self.classes: dict[str, KnownClass] = {}
        # Whether every class is known: the watch may deliver runs before classes (after a restart or
        # a failover), and a run decided meanwhile would be granted without its class for good.
        self.synced = False
        self.unlisted: str | None = None  # why the last list failed (None: none failed)
        self._watched: set[str] | None = None  # the names the watch told of while a sync's list ran
        self._lock = asyncio.Lock()  # one list at a time (runs are reconciled concurrently)
        self.generation = 0  # moves whenever what an unpinned run takes may have changed

    async def sync(self, list_classes: Callable[[], Awaitable[list[dict[str, Any]]]]) -> None:
        """Lists every class once; what the watch told of meanwhile is newer than the list. A list
        that fails leaves the book unsynced (unpinned runs wait: ClassesUnknown) and is tried again."""
        async with self._lock:
            if self.synced:
                return
            self._watched = set()
            try:
                items = await list_classes()
            except NotFound:
                items = []  # no WorkerClass CRD: no class can exist
            except ApiError as exc:
                self.unlisted = f"{exc.status} {exc.message}"[:200]
                return
            finally:
                watched, self._watched = self._watched, None
            for body in items:
                if str((body.get("metadata") or {}).get("name") or "") not in watched:
                    self.on_event("ADDED", body)
            self.synced, self.unlisted = True, None
            self.generation += 1

    def on_event(self, event_type: str | None, body: dict[str, Any]) -> str | None:
        """A WorkerClass's event; returns its name when what runs take from it may have changed."""
        name = str((body.get("metadata") or {}).get("name") or "")
        if not name:
            return None
        if self._watched is not None:
            self._watched.add(name)
        self.generation += 1
        if event_type == "DELETED":
            return name if self.classes.pop(name, None) is not None else None
        try:
            known = KnownClass.of(body)
        except ValidationError as exc:
            # The CRD's schema refuses what this cannot read; an older one may not have.
            log.error("WorkerClass unreadable; runs of it wait", extra={"event": "class_unreadable", "class": name,
                                                                       "error": str(exc)})
            self.classes.pop(name, None)
            return name
        before = self.classes.get(name)
        self.classes[name] = known
        return name if before is None or before != known else None

    def run_of(self, body: dict[str, Any]) -> tuple[WorkerRun, ClassResolution | None]:
        """The run as its decisions read it (parsed once, with its class applied), and what an
        unpinned run takes (None: pinned)."""
        if wc.pinned(body):
            return WorkerRun.model_validate(wc.effective_body(body)), None
        if not self.synced:
            return WorkerRun.model_validate(body), ClassResolution(None, unknown=self.unlisted or "not listed yet")
        resolution, run = resolve(body, self.classes)
        return run, resolution
