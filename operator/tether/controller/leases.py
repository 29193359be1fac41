"""What the operator has observed of each run's Lease, timed on its own monotonic clock.

Like client-go's leader election, a lease counts as renewed when a new
resourceVersion is observed for the same holder and fence; when that was
observed is the operator's business, never the worker's timestamps.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from tether import metrics, protocol
from tether.api import constants as c
from tether.api.models import Usage
from tether.controller.views import LeaseView
from tether.core.decide import LeaseObservation

log = logging.getLogger("tether.leases")


def parse_usage(raw: str | None, previous: Usage | None, key: str) -> Usage | None:
    """The worker's cumulative usage report for its attempt. Malformed reports (not
    integers, NaN, negative, decreasing, implausibly large) are refused and logged,
    and the previous report stands."""
    try:
        usage = protocol.parse_usage(raw)
    except ValueError as exc:
        metrics.USAGE_REJECTED.inc()
        log.warning("malformed usage report refused", extra={"event": "usage_rejected", "run": key,
                                                             "reason": str(exc)[:200]})
        return previous
    if usage is None:
        return previous
    why = protocol.valid_report(usage, previous)
    if why is not None:
        metrics.USAGE_REJECTED.inc()
        log.warning("usage report refused", extra={"event": "usage_rejected", "run": key, "reason": why,
                                                   "reported": usage.dump(),
                                                   "previous": previous.dump() if previous else None})
        return previous
    return usage


def parse_requests(raw: str | None, previous: tuple[protocol.ApprovalRequest, ...],
                   key: str) -> tuple[protocol.ApprovalRequest, ...]:
    """The approvals the holder asks for. A malformed annotation is refused as a whole and logged,
    and the previous requests stand (the worker's SDK refuses such requests before sending)."""
    try:
        return protocol.parse_requests(raw)
    except ValueError as exc:
        metrics.REQUESTS_REJECTED.inc()
        log.warning("malformed approval requests refused", extra={"event": "requests_rejected", "run": key,
                                                                  "reason": str(exc)[:200]})
        return previous


class LeaseTracker:
    def __init__(self) -> None:
        self._items: dict[str, LeaseObservation] = {}
        # The usage annotation as last parsed: an unchanged report is not parsed (nor refused
        # and logged) again on every heartbeat.
        self._raw_usage: dict[str, str | None] = {}
        self._raw_requests: dict[str, str | None] = {}

    def get(self, key: str) -> LeaseObservation | None:
        return self._items.get(key)

    def forget(self, key: str) -> None:
        self._items.pop(key, None)
        self._raw_usage.pop(key, None)
        self._raw_requests.pop(key, None)

    def observe(self, key: str, lease: dict[str, Any], mono: float, written_over: str | None = None) -> bool:
        """Records a Lease seen by watch, GET or our own write. Returns True when it matters
        to the run's decision (new holder or fence, or the first renewal).

        `written_over`: this is the answer to our own write of the version with that
        resourceVersion. resourceVersions are compared only for equality, so whether an answer is
        newer than what the watch brought meanwhile cannot be told from it; it is taken only while
        nothing else was observed since that version (else the watch brings our write anyway)."""
        ann = protocol.annotations(lease)
        holder, fence = protocol.lease_holder(lease)
        rv = LeaseView(lease).resource_version
        prev = self._items.get(key)
        if prev is not None and fence is not None and prev.fence is not None and fence < prev.fence:
            return False  # an event older than what we already know
        if written_over is not None and prev is not None and prev.resource_version not in (written_over, rv):
            return False  # a late answer: the watch (or a read) has moved on since the write was sent
        checkpoint, signals = ann.get(c.ANN_CHECKPOINT), ann.get(c.ANN_SIGNALS)
        raw_usage, raw_requests = ann.get(c.ANN_USAGE), ann.get(c.ANN_REQUESTS)
        if prev is None or (holder, fence) != (prev.holder, prev.fence):
            self._raw_usage[key] = raw_usage
            self._raw_requests[key] = raw_requests
            self._items[key] = LeaseObservation(
                holder=holder, fence=fence, resource_version=rv, last_change=mono, renewed=False,
                checkpoint=checkpoint, checkpoint_changed=mono, signals=signals,
                usage=parse_usage(ann.get(c.ANN_USAGE), None, key),
                requests=parse_requests(raw_requests, (), key))
            return True
        if rv == prev.resource_version:
            return False
        requests = prev.requests
        if raw_requests != self._raw_requests.get(key):
            self._raw_requests[key] = raw_requests
            requests = parse_requests(raw_requests, prev.requests, key)
        # Only the holder's own writes count as renewals; a signal update by the operator does not.
        by_holder = signals == prev.signals
        usage = prev.usage if raw_usage == self._raw_usage.get(key) else parse_usage(raw_usage, prev.usage, key)
        self._raw_usage[key] = raw_usage
        self._items[key] = replace(
            prev, resource_version=rv, signals=signals,
            last_change=mono if by_holder else prev.last_change,
            renewed=prev.renewed or by_holder, checkpoint=checkpoint,
            checkpoint_changed=mono if checkpoint != prev.checkpoint else prev.checkpoint_changed,
            usage=usage, requests=requests)
        # A new request matters at once (a person is waiting to see it); other renewals do not.
        return (not prev.renewed and by_holder) or requests != prev.requests
