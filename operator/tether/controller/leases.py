"""What the operator has observed of each run's Lease, timed on its own monotonic clock.

Like client-go's leader election, a lease counts as renewed when a new
resourceVersion is observed for the same holder and fence; when that was
observed is the operator's business, never the worker's timestamps.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

from tether.api import constants as c
from tether.api.models import Usage
from tether.core.decide import LeaseObservation

log = logging.getLogger("tether.leases")


def parse_usage(raw: str | None) -> Usage | None:
    """The worker's cumulative usage report for its attempt; malformed reports are ignored."""
    if not raw:
        return None
    try:
        doc = json.loads(raw)
        usage = Usage(cents=int(doc.get("cents", 0)), tokens=int(doc.get("tokens", 0)))
    except (ValueError, TypeError, AttributeError):
        log.warning("malformed usage report refused", extra={"event": "usage_rejected"})
        return None
    if usage.cents < 0 or usage.tokens < 0:
        log.warning("negative usage report refused", extra={"event": "usage_rejected"})
        return None
    return usage


class LeaseTracker:
    def __init__(self) -> None:
        self._items: dict[str, LeaseObservation] = {}

    def get(self, key: str) -> LeaseObservation | None:
        return self._items.get(key)

    def forget(self, key: str) -> None:
        self._items.pop(key, None)

    def observe(self, key: str, lease: dict[str, Any], mono: float) -> bool:
        """Records a Lease seen by watch, GET or our own write. Returns True when it matters
        to the run's decision (new holder or fence, or the first renewal)."""
        spec = lease.get("spec", {}) or {}
        meta = lease.get("metadata", {}) or {}
        ann = meta.get("annotations", {}) or {}
        holder, fence = spec.get("holderIdentity"), spec.get("leaseTransitions")
        rv = meta.get("resourceVersion", "")
        prev = self._items.get(key)
        extras = {"checkpoint": ann.get(c.ANN_CHECKPOINT), "usage": parse_usage(ann.get(c.ANN_USAGE))}
        if prev is not None and fence is not None and prev.fence is not None and fence < prev.fence:
            return False  # an event older than what we already know
        if prev is None or (holder, fence) != (prev.holder, prev.fence):
            self._items[key] = LeaseObservation(holder=holder, fence=fence, resource_version=rv,
                                                last_change=mono, renewed=False, **extras)
            return True
        if rv == prev.resource_version:
            return False
        self._items[key] = replace(prev, resource_version=rv, last_change=mono, renewed=True, **extras)
        return not prev.renewed
