"""The operator's Lease observations: a refused usage report is logged once, not per heartbeat."""

from __future__ import annotations

import logging

import pytest

from tether.controller.leases import LeaseTracker


def lease(rv: str, usage: str) -> dict:  # type: ignore[type-arg]
    return {"metadata": {"resourceVersion": rv, "annotations": {"tether.dev/usage": usage}},
            "spec": {"holderIdentity": "job-a1", "leaseTransitions": 1}}


def test_a_refused_usage_report_is_logged_once_until_it_changes(caplog: pytest.LogCaptureFixture) -> None:
    tracker = LeaseTracker()
    caplog.set_level(logging.WARNING, logger="tether.leases")
    tracker.observe("u", lease("1", '{"cents": 5, "tokens": 0}'), 1.0)
    for i in range(2, 12):  # ten heartbeats carrying the same decreasing (refused) report
        tracker.observe("u", lease(str(i), '{"cents": 3, "tokens": 0}'), float(i))
    refused = [r for r in caplog.records if getattr(r, "event", "") == "usage_rejected"]
    assert len(refused) == 1
    assert tracker.get("u").usage.cents == 5  # type: ignore[union-attr]
    tracker.observe("u", lease("12", '{"cents": 9, "tokens": 0}'), 12.0)
    assert tracker.get("u").usage.cents == 9  # type: ignore[union-attr]
