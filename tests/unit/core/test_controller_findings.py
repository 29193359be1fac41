"""Issue 21's defects in the pure parts: each test failed on the code before its fix.

1: an interrupted grant charged the previous attempt's usage again;
3: progressDeadlineSeconds revoked a worker paused by spec.suspend or waiting for an approval;
8: a late answer to the operator's own Lease write was taken as newer than what the watch brought;
9: an old attempt's checkpoint rode on every later grant, and an attempt whose Lease was never
   written was never judged.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import pytest

from tether import protocol
from tether.api import constants as c
from tether.api.models import Outcome, Phase, Usage
from tether.controller.leases import LeaseTracker
from tether.core.decide import Revoke, WriteStatus, decide
from tether.kube import resources
from tests.unit.core.test_decide import T0, held, lease, observe, run

UID = "u-1"


def lease_body(holder: str | None, fence: int, rv: str, usage: Usage | None = None,
               checkpoint: str | None = None, signals: str | None = None) -> dict[str, Any]:
    ann = {c.ANN_FENCE: str(fence)}
    if usage is not None:
        ann[c.ANN_USAGE] = protocol.usage_annotation(usage)
    if checkpoint is not None:
        ann[c.ANN_CHECKPOINT] = checkpoint
    if signals is not None:
        ann[c.ANN_SIGNALS] = signals
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "job", "namespace": "ns", "resourceVersion": rv, "annotations": ann,
                         "labels": {c.LABEL_RUN: "job"},
                         "ownerReferences": [{"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
                                              "name": "job", "uid": UID, "controller": True}]},
            "spec": {"holderIdentity": holder, "leaseTransitions": fence, "leaseDurationSeconds": 20}}


def _interrupted_grant_status() -> dict[str, Any]:
    """Attempt 1 reported 100 cents and ended at fence 2; attempt 2's grant wrote fence 3 to the
    status, and the operator died before its Lease write."""
    status = held(attempt=2, fence=3, phase="Starting")
    status["attempts"][0]["usage"] = {"cents": 100, "tokens": 0}
    status["usage"] = {"cents": 100, "tokens": 0}
    return status


@pytest.mark.parametrize("why", ["deleted", "deadline"])
def test_an_interrupted_grant_never_charges_the_previous_attempts_report_again(why: str) -> None:
    """Defect 1: the revocation cleared the *old* cleared Lease at the new fence, still carrying
    attempt 1's 100 cents, and settle_usage booked it into attempt 2: status.usage 200."""
    tracker = LeaseTracker()
    tracker.observe(UID, lease_body(None, 2, "50", usage=Usage(cents=100)), 100.0)
    extra: dict[str, Any] = {"deletionTimestamp": T0.isoformat()} if why == "deleted" else {}
    spec = {"deadlineSeconds": 60} if why == "deadline" else {}
    r = run(spec=spec, status=_interrupted_grant_status(), **extra)
    later = T0 + dt.timedelta(seconds=120)
    d = decide(observe(r, tracker.get(UID), now=later, mono=220.0))
    revoke = next(a for a in d.actions if isinstance(a, Revoke))
    assert revoke.status_write.status.usage == Usage(cents=100)
    # The revocation's Lease step, as the executor writes it (the Lease still names nobody).
    cleared = resources.regrant_lease(lease_body(None, 2, "50", usage=Usage(cents=100)), None, revoke.fence, 20, later)
    cleared["metadata"]["resourceVersion"] = "51"
    tracker.observe(UID, cleared, 221.0)
    after = run(spec=spec, status=revoke.status_write.status.dump(), **extra)
    d2 = decide(observe(after, tracker.get(UID), now=later, mono=222.0))
    for action in d2.actions:
        if isinstance(action, WriteStatus):
            assert action.status.usage == Usage(cents=100), action.status.usage
            assert action.status.attempts[-1].usage in (None, Usage()), action.status.attempts[-1].usage


def test_a_cleared_lease_keeps_the_report_of_the_attempt_that_held_it() -> None:
    """The other side of defect 1's fix: clearing a held Lease keeps its holder's final report (it is
    settled into that attempt); rewriting a Lease that already names nobody drops it."""
    held_lease = lease_body("job-a1", 1, "10", usage=Usage(cents=7))
    cleared = resources.regrant_lease(held_lease, None, 2, 20, T0)
    assert protocol.lease_usage(cleared) == Usage(cents=7)
    again = resources.regrant_lease(cleared, None, 4, 20, T0)
    assert protocol.lease_usage(again) is None


def _paused_by(why: str) -> tuple[dict[str, Any], dict[str, Any]]:
    spec: dict[str, Any] = {"executor": "External", "progressDeadlineSeconds": 12}
    status = held(attempt=1)
    if why == "suspend":
        spec["suspend"] = True
    else:
        status["review"] = {"requests": [{"gate": "wire-money", "attempt": 1, "requestedAt": T0.isoformat()}]}
    return spec, status


@pytest.mark.parametrize("why", ["suspend", "request"])
def test_the_progress_clock_stops_while_the_worker_does_what_it_was_told(why: str) -> None:
    """Defect 3: a suspended worker (or one blocked in request_approval) renews but cannot make
    progress; it was ended Stalled after progressDeadlineSeconds."""
    spec, status = _paused_by(why)
    r = run(spec=spec, status=status)
    # Renewed a second ago; the last checkpoint is 60 s old, five times the progress deadline.
    o = observe(r, lease(last_change=159.0, checkpoint_changed=100.0), mono=160.0)
    d = decide(o)
    assert not any(isinstance(a, Revoke) for a in d.actions), d.actions


def test_the_progress_clock_restarts_when_the_pause_ends() -> None:
    """After a pause the worker gets a whole progressDeadlineSeconds again, from when the operator
    last saw the run paused, not from its last checkpoint before the pause."""
    r = run(spec={"executor": "External", "progressDeadlineSeconds": 12}, status=held(attempt=1))
    o = observe(r, lease(last_change=159.0, checkpoint_changed=100.0), mono=160.0)
    from dataclasses import replace
    resumed = replace(o, progress_held_at=155.0)
    assert not any(isinstance(a, Revoke) for a in decide(resumed).actions)
    stalled = replace(o, progress_held_at=155.0, mono=168.0, lease=replace(o.lease, last_change=167.0))  # type: ignore[arg-type]
    revoke = next(a for a in decide(stalled).actions if isinstance(a, Revoke))
    assert revoke.status_write.ended == Outcome.STALLED


def test_a_late_answer_to_the_operators_own_write_is_not_newer_than_the_watch(caplog: pytest.LogCaptureFixture) -> None:
    """Defect 8: the operator writes the signals (rv 11); the worker renews with more usage (rv 12);
    the watch brings both; then the answer to the operator's write (rv 11) arrives. Taken as
    newer, it moved the resourceVersion back, refused the worker's report as decreasing, and
    counted a renewal that did not happen."""
    tracker = LeaseTracker()
    tracker.observe(UID, lease_body("job-a1", 1, "10", usage=Usage(cents=1), signals="a"), 100.0)
    ours = lease_body("job-a1", 1, "11", usage=Usage(cents=1), signals="b")
    theirs = lease_body("job-a1", 1, "12", usage=Usage(cents=5), signals="b")
    tracker.observe(UID, ours, 101.0)  # by watch
    tracker.observe(UID, theirs, 102.0)  # by watch: a renewal
    with caplog.at_level(logging.WARNING, logger="tether.leases"):
        assert tracker.observe(UID, ours, 103.0, written_over="10") is False  # the late answer
    seen = tracker.get(UID)
    assert seen is not None
    assert (seen.resource_version, seen.usage, seen.last_change) == ("12", Usage(cents=5), 102.0)
    assert not [r for r in caplog.records if getattr(r, "event", "") == "usage_rejected"]


def test_a_lease_read_fresh_is_never_refused_as_old() -> None:
    """Seed 81019 of the fault trials, against the first fix of defect 8 (which refused any
    resourceVersion seen before): a held watch delivered renewal C after a GET had brought the
    newer D; D's own event was then refused as already seen, every confirming read of D said "the
    lease moved", and two runs churned with a dead holder, never revoked. Only the answers to our
    own writes are doubted; what a watch or a read brings is taken."""
    tracker = LeaseTracker()
    tracker.observe(UID, lease_body("job-a1", 1, "10", usage=Usage(cents=1)), 100.0)
    d = lease_body("job-a1", 1, "14", usage=Usage(cents=3))
    tracker.observe(UID, d, 101.0)  # the confirming GET
    tracker.observe(UID, lease_body("job-a1", 1, "12", usage=Usage(cents=2)), 102.0)  # the held watch, late
    tracker.observe(UID, d, 103.0)  # then D's own event, or the next confirming GET
    seen = tracker.get(UID)
    assert seen is not None and seen.resource_version == "14"


def test_a_grant_drops_an_old_attempts_checkpoint_from_the_lease() -> None:
    """Defect 9: the checkpoint annotation belongs to the attempt that wrote it; the run's status
    carries it to the next attempt (TETHER_CHECKPOINT, the claim's reply)."""
    cleared = lease_body(None, 2, "20", usage=Usage(cents=3), checkpoint="row-9")
    granted = resources.regrant_lease(cleared, "job-a2", 3, 20, T0)
    assert c.ANN_CHECKPOINT not in granted["metadata"]["annotations"]
    assert resources.regrant_lease(cleared, None, 2, 20, T0)["metadata"]["annotations"][c.ANN_CHECKPOINT] == "row-9"


def test_a_cleared_leases_last_checkpoint_is_settled_into_the_status() -> None:
    """What the worker checkpointed between the revocation's status write and the Lease clear is
    recorded before the next grant drops it from the Lease."""
    status = held(attempt=1, fence=2, phase="Backoff")
    status["holder"] = None
    status["attempts"][0].update(outcome="LeaseLost", endedAt=T0.isoformat())
    status["checkpoint"] = {"cursor": "row-8", "time": T0.isoformat()}
    tracker = LeaseTracker()
    tracker.observe(UID, lease_body(None, 2, "30", checkpoint="row-9"), 100.0)
    d = decide(observe(run(status=status), tracker.get(UID), mono=101.0))
    write = next(a for a in d.actions if isinstance(a, WriteStatus))
    assert write.status.checkpoint is not None and write.status.checkpoint.cursor == "row-9"
    assert not write.grants


def test_an_attempt_whose_lease_was_never_written_times_out() -> None:
    """Defect 9: a grant whose Lease write keeps failing (LeaseRefused) left the run Starting with a
    holder forever. Past the startup grace it ends like an attempt that never renewed."""
    status = held(attempt=1, phase="Starting")
    r = run(status=status)
    early = decide(observe(r, None, now=T0 + dt.timedelta(seconds=10)))
    assert not any(isinstance(a, Revoke) for a in early.actions)
    late = decide(observe(r, None, now=T0 + dt.timedelta(seconds=31)))
    revoke = next(a for a in late.actions if isinstance(a, Revoke))
    assert revoke.status_write.ended == Outcome.LEASE_LOST
    assert revoke.status_write.status.phase == Phase.BACKOFF
