"""The WorkerClasses this operator knows (from their watch), and each run's body as its decisions
read it: with what it took from its class applied (core/classes.py decides which and what)."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from tether.api import workerclass as wc
from tether.core.classes import ClassResolution, KnownClass, resolve

log = logging.getLogger("tether.controller")


class ClassBook:
    def __init__(self) -> None:
        self.classes: dict[str, KnownClass] = {}

    def on_event(self, event_type: str | None, body: dict[str, Any]) -> str | None:
        """A WorkerClass's event; returns its name when what runs take from it may have changed."""
        name = str((body.get("metadata") or {}).get("name") or "")
        if not name:
            return None
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

    def effective(self, body: dict[str, Any]) -> tuple[dict[str, Any], ClassResolution | None]:
        """The run's body with its class applied, and what an unpinned run takes (None: pinned)."""
        if wc.pinned(body):
            return wc.effective_body(body), None
        resolution = resolve(body, self.classes)
        return wc.with_applied(body, dict(resolution.applied)), resolution
