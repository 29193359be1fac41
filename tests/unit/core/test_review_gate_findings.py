"""Adversarial review of the start gate (core/review.py): each test pins one defect.

Written against the promise ("a denial or timeout ends it Rejected"), not the code: they fail
while the defect is there.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import pytest

from tether.api.models import Phase
from tether.core.decide import decide
from tests.unit.core.test_decide import T0, cond, kinds, observe, run, status_of
from tests.unit.core.test_review import CREATED, approval, gated

pytestmark = pytest.mark.unit


def test_an_approval_made_after_the_start_timeout_does_not_start_the_run() -> None:
    # Created 10 min ago with startTimeoutSeconds=300: the deadline passed 5 min ago. The operator
    # was down (or its wake-up late) and the approval was made 1 min ago, after the deadline. Both
    # times are the API server's (creationTimestamps), so "within startTimeoutSeconds" is decidable.
    late = approval("Approve", minutes=-1)
    assert late.created > CREATED + dt.timedelta(seconds=300)
    o = replace(observe(gated(timeout=300), None), approvals=(late,))
    d = decide(o)
    assert "EnsureLease" not in kinds(d.actions) and "EnsurePod" not in kinds(d.actions)
    s = status_of(d.actions)
    assert s.phase == Phase.REJECTED and cond(s, "Approved") == ("False", "TimedOut")


def test_a_deny_and_an_approve_in_the_same_second_do_not_start_the_run() -> None:
    # creationTimestamp has one-second resolution: these two are simultaneous as far as anyone can
    # tell. Today the tie is broken by the approvals' names (generateName suffixes, or a name the
    # approver picks, e.g. "zzz"), so the Approve wins by lexical accident. Fail safe: Deny.
    deny = approval("Deny", minutes=-1, name="bob-start-abcde")
    approve = approval("Approve", minutes=-1, name="zzz")
    o = replace(observe(gated(), None), approvals=(deny, approve))
    d = decide(o)
    assert "EnsureLease" not in kinds(d.actions)
    assert status_of(d.actions).phase == Phase.REJECTED


def test_a_spec_change_while_awaiting_approval_is_observed() -> None:
    # The owner edits the run while it waits (template, payload and budget are all mutable until
    # attempt 1). The waiting run never writes status again, so observedGeneration stays 1 < 2:
    # Argo's health check says "Waiting for the operator to observe the latest spec" (Progressing)
    # forever instead of Suspended/AwaitingApproval, and the approver cannot tell which generation
    # the Approved=False condition describes.
    waiting = status_of(decide(observe(gated(), None)).actions)
    st = waiting.model_dump(by_alias=True, mode="json", exclude_none=True)
    edited = run(spec={"review": {"start": True}}, status=st, creationTimestamp=CREATED.isoformat(), generation=2)
    d = decide(observe(edited, None, now=T0))
    s = status_of(d.actions)
    assert s.observed_generation == 2 and s.phase == Phase.AWAITING_APPROVAL
