"""Table tests of core.decide: one row per lifecycle transition."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import replace
from typing import Any

import pytest

from tether.api.models import MAX_STATUS_NUMBER, Outcome, Phase, Remaining, Usage, WorkerRun
from tether.core.decide import (
    BudgetObservation,
    Change,
    ChargeBudget,
    ClearLease,
    EnsureSignals,
    DeletePod,
    DeleteRun,
    EnsureLease,
    EnsurePod,
    LeaseObservation,
    Observed,
    PodObservation,
    PodRefusal,
    ReleasePod,
    Revoke,
    WriteStatus,
    backoff_seconds,
    decide,
    desired_signals,
    MAX_REQUEUE_SECONDS,
)

T0 = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.timezone.utc)


def run(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None, **meta: Any) -> WorkerRun:
    body = {
        "metadata": {"name": "job", "namespace": "ns", "uid": "u-1", "generation": 1, **meta},
        "spec": {"template": {"spec": {"containers": [{"name": "w", "command": ["w"]}]}},
                 "lease": {"durationSeconds": 20, "renewIntervalSeconds": 5, "startupGraceSeconds": 30},
                 "retry": {"maxAttempts": 3, "backoff": {"initialSeconds": 10, "maxSeconds": 60, "factor": 2}},
                 **(spec or {})},
        "status": status or {},
    }
    return WorkerRun.model_validate(body)


def held(attempt: int = 1, fence: int | None = None, phase: str = "Running", **extra: Any) -> dict[str, Any]:
    fence = fence if fence is not None else 2 * attempt - 1
    attempts = [{"attempt": i, "fence": 2 * i - 1, "holder": f"job-a{i}", "pod": f"job-a{i}",
                 "startedAt": T0.isoformat(), "outcome": "LeaseLost", "endedAt": T0.isoformat()}
                for i in range(1, attempt)]
    attempts.append({"attempt": attempt, "fence": fence, "holder": f"job-a{attempt}", "pod": f"job-a{attempt}",
                     "startedAt": T0.isoformat()})
    return {"phase": phase, "attempt": attempt, "fence": fence, "holder": f"job-a{attempt}",
            "attempts": attempts, "startedAt": T0.isoformat(), "observedGeneration": 1, **extra}


def lease(attempt: int = 1, fence: int | None = None, last_change: float = 100.0, renewed: bool = True,
          holder: str | None = "default", **kw: Any) -> LeaseObservation:
    return LeaseObservation(holder=f"job-a{attempt}" if holder == "default" else holder,
                            fence=fence if fence is not None else 2 * attempt - 1,
                            resource_version="7", last_change=last_change, renewed=renewed, **kw)


def pod(attempt: int = 1, phase: str = "Running", **kw: Any) -> PodObservation:
    return PodObservation(name=f"job-a{attempt}", attempt=attempt, phase=phase, **kw)


def observe(r: WorkerRun, lease_obs: LeaseObservation | None = None, pods: tuple[PodObservation, ...] = (),
            now: dt.datetime = T0, mono: float = 105.0, budget: BudgetObservation | None = None) -> Observed:
    o = Observed(run=r, lease=lease_obs, pods=pods, now=now, mono=mono, budget=budget)
    if lease_obs is not None and lease_obs.signals is None:
        # The lease already carries what the operator wants the worker to know.
        o = replace(o, lease=replace(lease_obs, signals=desired_signals(o, None)))
    return o


def kinds(actions: list[Any]) -> list[str]:
    return [type(a).__name__ for a in actions]


def status_of(actions: list[Any]):  # type: ignore[no-untyped-def]
    writes = [a.status_write if isinstance(a, Revoke) else a for a in actions if isinstance(a, (WriteStatus, Revoke))]
    assert len(writes) == 1, actions
    return writes[0].status


def cond(status: Any, type_: str) -> tuple[str, str]:
    c = next(c for c in status.conditions if c.type == type_)
    return c.status, c.reason


# --- grant --------------------------------------------------------------------


def test_new_run_is_admitted_and_granted_in_order() -> None:
    d = decide(observe(run(), None))
    assert kinds(d.actions) == ["WriteStatus", "EnsureLease", "EnsurePod"]  # status CAS first
    s = status_of(d.actions)
    assert (s.phase, s.attempt, s.fence, s.holder) == (Phase.STARTING, 1, 1, "job-a1")
    assert d.actions[1].holder == "job-a1" and d.actions[1].fence == 1 and d.actions[1].duration_seconds == 20
    assert json.loads(d.actions[1].signals)["stop"] is False
    assert d.actions[2] == EnsurePod(name="job-a1", attempt=1, fence=1, holder="job-a1")
    assert cond(s, "Admitted") == ("True", "Admitted")
    assert cond(s, "Reconciling") == ("True", "Starting")
    assert cond(s, "LeaseHeld")[0] == "True"
    assert s.observed_generation == 1
    assert d.actions[0].change == Change.GRANTED and d.actions[0].grants
    assert d.requeue_after == 30


def test_external_run_gets_no_pod() -> None:
    d = decide(observe(run({"executor": "External", "template": None}), None))
    assert kinds(d.actions) == ["WriteStatus", "EnsureLease"]


def test_deadline_sets_ends_at_on_first_grant() -> None:
    s = status_of(decide(observe(run({"deadlineSeconds": 600}))).actions)
    assert s.ends_at == T0 + dt.timedelta(seconds=600)


# --- holding -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "renewed", "mono", "expect_actions", "wake"),
    [
        # Granted, no renewal yet: startup grace (30s) from when the grant was observed.
        ("Starting", False, 120.0, [], 10.0),
        ("Starting", False, 131.0, ["Revoke"], None),
        # First renewal observed: Starting -> Running.
        ("Starting", True, 105.0, ["WriteStatus"], 15.0),
        # Running: lapse after lease duration (20s) without a new resourceVersion.
        ("Running", True, 119.0, [], 1.0),
        ("Running", True, 120.0, ["Revoke"], None),
    ],
)
def test_lease_lapse_timing(phase: str, renewed: bool, mono: float, expect_actions: list[str], wake: float | None) -> None:
    d = decide(observe(run(status=held(phase=phase)), lease(renewed=renewed), (pod(),), mono=mono))
    assert kinds(d.actions) == expect_actions
    if wake is not None:
        assert d.requeue_after == pytest.approx(wake)


def test_first_renewal_moves_to_running() -> None:
    d = decide(observe(run(status=held(phase="Starting")), lease(renewed=True), (pod(),)))
    s = status_of(d.actions)
    assert s.phase == Phase.RUNNING and s.fence == 1
    assert cond(s, "LeaseHeld") == ("True", "LeaseRenewed")
    assert d.actions[0].change == Change.RENEWED


def test_steady_heartbeats_write_nothing() -> None:
    d = decide(observe(run(status=held()), lease(), (pod(),)))
    assert d.actions == []


def test_lapse_revokes_then_backs_off() -> None:
    d = decide(observe(run(status=held()), lease(checkpoint="row-9"), (pod(),), mono=200))
    s = status_of(d.actions)
    assert (s.fence, s.holder, s.phase) == (2, None, Phase.BACKOFF)
    assert s.attempts[-1].outcome == Outcome.LEASE_LOST and s.attempts[-1].ended_at == T0
    assert s.checkpoint is not None and s.checkpoint.cursor == "row-9"
    assert s.next_attempt_at == T0 + dt.timedelta(seconds=10)
    # One composite action: status (fence 2) -> Lease cleared at fence 2 -> pod -> (no tool claims: a pod run).
    assert kinds(d.actions) == ["Revoke"]
    revoke = d.actions[0]
    assert revoke.fence == 2 and revoke.pods_to_delete == ("job-a1",) and revoke.tool_claim_holders == ()
    write = revoke.status_write
    assert write.change == Change.ATTEMPT_ENDED and write.ended == Outcome.LEASE_LOST and write.lapse
    assert cond(s, "LeaseHeld") == ("False", "LeaseLost")
    assert d.requeue_after == 10


def test_lapse_on_last_attempt_is_lost() -> None:
    d = decide(observe(run(status=held(attempt=3)), lease(attempt=3), (pod(3),), mono=200))
    s = status_of(d.actions)
    assert s.phase == Phase.LOST and s.fence == 6
    assert cond(s, "Stalled") == ("True", "Lost") and cond(s, "Failed") == ("True", "Lost")
    assert cond(s, "Ready") == ("False", "Lost")
    assert s.finished_at == T0


def test_result_succeeds_run_and_keeps_pod_to_exit() -> None:
    d = decide(observe(run(status=held(result={"ok": True})), lease(), (pod(),)))
    s = status_of(d.actions)
    assert (s.phase, s.fence, s.holder) == (Phase.SUCCEEDED, 2, None)
    assert s.attempts[-1].outcome == Outcome.SUCCEEDED
    assert kinds(d.actions) == ["Revoke"] and d.actions[0].pods_to_delete == ()  # the pod exits on its own
    assert cond(s, "Ready") == ("True", "Succeeded") and cond(s, "Succeeded") == ("True", "Succeeded")
    assert cond(s, "Reconciling")[0] == "False"


@pytest.mark.parametrize(
    ("rules", "pod_obs", "error", "phase", "outcome"),
    [
        ([], pod(phase="Failed", exit_code=3), None, Phase.BACKOFF, Outcome.POD_FAILED),
        ([{"action": "FailRun", "onExitCodes": {"operator": "In", "values": [3]}}],
         pod(phase="Failed", exit_code=3), None, Phase.FAILED, Outcome.POD_FAILED),
        ([{"action": "FailRun", "onExitCodes": {"operator": "NotIn", "values": [3]}}],
         pod(phase="Failed", exit_code=3), None, Phase.BACKOFF, Outcome.POD_FAILED),
        ([], pod(phase="Succeeded", exit_code=0), None, Phase.BACKOFF, Outcome.POD_FAILED),
        ([], pod(deleting=True), None, Phase.BACKOFF, Outcome.POD_VANISHED),
        ([], pod(), {"code": "Boom", "message": "bad input"}, Phase.BACKOFF, Outcome.WORKER_FAILED),
        ([{"action": "FailRun", "onReasons": ["WorkerFailed"]}], pod(), {"code": "Boom", "message": "no"},
         Phase.FAILED, Outcome.WORKER_FAILED),
        ([{"action": "FailRun", "onReasons": ["PodVanished"]}, {"action": "Retry", "onReasons": ["WorkerFailed"]}],
         pod(), {"code": "Boom"}, Phase.BACKOFF, Outcome.WORKER_FAILED),
    ],
)
def test_failed_attempts_follow_retry_rules(rules: list[dict[str, Any]], pod_obs: PodObservation,
                                             error: dict[str, Any] | None, phase: Phase, outcome: Outcome) -> None:
    extra = {"error": error} if error else {}
    d = decide(observe(run({"retry": {"maxAttempts": 3, "rules": rules}}, status=held(**extra)), lease(), (pod_obs,)))
    s = status_of(d.actions)
    assert s.phase == phase and s.attempts[-1].outcome == outcome and s.fence == 2
    if phase == Phase.FAILED and error:
        assert s.error is not None and s.error.code == "Boom"
    if phase == Phase.BACKOFF:
        assert s.error is None


# --- a refused pod (issue 34): an attempt that did not start ------------------------------

REFUSED = 'Pod "job-a{n}" is invalid: spec.containers: Required value'


def refusal(attempt: int = 1, fence: int | None = None) -> PodRefusal:
    return PodRefusal(fence=fence if fence is not None else 2 * attempt - 1, pod=f"job-a{attempt}",
                      message=REFUSED.format(n=attempt))


@pytest.mark.parametrize(
    ("attempt", "rules", "phase", "reason", "wake"),
    [
        (1, [], Phase.BACKOFF, "PodRefused", 10.0),  # backoff as after any ended attempt
        (2, [], Phase.BACKOFF, "PodRefused", 20.0),
        (3, [], Phase.FAILED, "PodRefused", None),  # maxAttempts 3 used up
        (1, [{"action": "FailRun", "onReasons": ["PodRefused"]}], Phase.FAILED, "PodRefused", None),
        (1, [{"action": "FailRun", "onReasons": ["PodFailed"]}], Phase.BACKOFF, "PodRefused", 10.0),
    ],
)
def test_a_refused_pod_ends_its_attempt_at_once(attempt: int, rules: list[dict[str, Any]], phase: Phase,
                                                reason: str, wake: float | None) -> None:
    """Not after the startup grace, and not as LeaseLost: the holder never renewed, no pod exists."""
    r = run({"retry": {"maxAttempts": 3, "backoff": {"initialSeconds": 10, "maxSeconds": 60, "factor": 2},
                       "rules": rules}}, status=held(attempt=attempt, phase="Starting"))
    d = decide(replace(observe(r, lease(attempt=attempt, renewed=False), ()), pod_refusal=refusal(attempt)))
    assert kinds(d.actions) == ["Revoke"] and d.actions[0].pods_to_delete == ()
    s = status_of(d.actions)
    assert (s.phase, s.holder, s.fence) == (phase, None, 2 * attempt)  # fenced as any ended attempt
    record = s.attempts[-1]
    assert record.outcome == Outcome.POD_REFUSED and record.ended_at == T0
    assert REFUSED.format(n=attempt) in (record.message or "")
    assert s.last_renew_time is None and s.lease_expires_at is None  # no liveness claimed
    ready = next(c for c in s.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", reason) and REFUSED.format(n=attempt) in ready.message
    assert cond(s, "LeaseHeld") == ("False", "PodRefused")
    write = d.actions[0].status_write
    assert write.ended == Outcome.POD_REFUSED
    assert ("Warning", "PodRefused") in [(e.type, e.reason) for e in write.events]
    if phase == Phase.FAILED:
        assert cond(s, "Stalled") == ("True", "PodRefused") and cond(s, "Failed") == ("True", "PodRefused")
        assert s.error is not None and s.error.code == "PodRefused" and s.next_attempt_at is None
    else:
        assert cond(s, "Stalled") == ("False", "PodRefused") and s.error is None
        assert s.next_attempt_at == T0 + dt.timedelta(seconds=wake or 0) and d.requeue_after == wake


@pytest.mark.parametrize(
    ("status", "pods", "heard"),
    [
        # A refusal of an earlier grant says nothing of this one: its pod is created.
        (held(attempt=2, phase="Starting"), (), refusal(attempt=1)),
        # The pod exists after all (created by a later try): it speaks for the attempt.
        (held(phase="Starting"), (pod(phase="Pending"),), refusal()),
    ],
    ids=["earlier-grant", "pod-exists"],
)
def test_a_refusal_ends_only_the_attempt_it_was_for(status: dict[str, Any], pods: tuple[PodObservation, ...],
                                                   heard: PodRefusal) -> None:
    attempt = int(status["attempt"])
    d = decide(replace(observe(run(status=status), lease(attempt=attempt, renewed=False), pods), pod_refusal=heard))
    assert "Revoke" not in kinds(d.actions)
    assert kinds(d.actions) == ([] if pods else ["EnsurePod"])


def test_a_stop_told_to_an_attempt_whose_pod_was_refused_ends_it_at_once() -> None:
    """Nobody is there to stop: no stopGraceSeconds to wait out."""
    asked = held(phase="Starting", stopRequestedAt=T0.isoformat())
    d = decide(replace(observe(run({"stop": True, "stopGraceSeconds": 60}, status=asked), lease(renewed=False), (),
                               now=T0 + dt.timedelta(seconds=1)), pod_refusal=refusal()))
    s = status_of(d.actions)
    assert s.phase == Phase.CANCELLED and s.attempts[-1].outcome == Outcome.CANCELLED


def test_pod_exit_code_is_recorded() -> None:
    d = decide(observe(run(status=held()), lease(), (pod(phase="Failed", exit_code=42),)))
    assert status_of(d.actions).attempts[-1].exit_code == 42
    assert "DeletePod" not in kinds(d.actions)  # already terminated


# --- backoff, retries ----------------------------------------------------------


def test_backoff_waits_then_grants_next_attempt_with_higher_fence() -> None:
    st = {"phase": "Backoff", "attempt": 1, "fence": 2, "startedAt": T0.isoformat(),
          "nextAttemptAt": (T0 + dt.timedelta(seconds=10)).isoformat(),
          "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "outcome": "LeaseLost",
                        "endedAt": T0.isoformat()}]}
    early = decide(observe(run(status=st), lease(holder=None, fence=2), (pod(phase="Failed", has_finalizer=False),)))
    assert early.actions == [] and early.requeue_after == 10
    d = decide(observe(run(status=st), lease(holder=None, fence=2), (),
                       now=T0 + dt.timedelta(seconds=10)))
    s = status_of(d.actions)
    assert (s.attempt, s.fence, s.holder, s.phase) == (2, 3, "job-a2", Phase.STARTING)
    assert d.actions[2] == EnsurePod(name="job-a2", attempt=2, fence=3, holder="job-a2")


@pytest.mark.parametrize(("ended", "seconds"), [(1, 10), (2, 20), (3, 40), (4, 60), (9, 60)])
def test_backoff_grows_and_is_capped(ended: int, seconds: float) -> None:
    assert backoff_seconds(run(), ended) == seconds


# --- control fields --------------------------------------------------------------


def test_stop_is_signalled_first_then_revoked_after_grace() -> None:
    r = run({"stop": True, "stopGraceSeconds": 10}, status=held())
    first = decide(observe(r, lease(), (pod(),)))
    assert kinds(first.actions) == ["WriteStatus", "EnsureSignals"]
    s = status_of(first.actions)
    assert s.stop_requested_at == T0 and s.fence == 1 and s.holder == "job-a1"
    assert json.loads(first.actions[1].signals)["stop"] is True and first.actions[1].fence == 1
    assert first.requeue_after == 10
    asked = held(stopRequestedAt=T0.isoformat())
    waiting = decide(observe(run({"stop": True, "stopGraceSeconds": 10}, status=asked), lease(), (pod(),),
                             now=T0 + dt.timedelta(seconds=4)))
    assert kinds(waiting.actions) == ["EnsureSignals"] and waiting.requeue_after == 6
    late = decide(observe(run({"stop": True, "stopGraceSeconds": 10}, status=asked), lease(), (pod(),),
                          now=T0 + dt.timedelta(seconds=10)))
    s = status_of(late.actions)
    assert (s.phase, s.fence, s.holder) == (Phase.CANCELLED, 2, None)
    assert kinds(late.actions) == ["Revoke"] and late.actions[0].pods_to_delete == ("job-a1",)
    assert cond(s, "Stalled") == ("True", "Cancelled")


def test_stopped_worker_exiting_ends_the_attempt_cancelled() -> None:
    asked = held(stopRequestedAt=T0.isoformat())
    d = decide(observe(run({"stop": True}, status=asked), lease(), (pod(phase="Failed", exit_code=1),),
                       now=T0 + dt.timedelta(seconds=1)))
    s = status_of(d.actions)
    assert s.phase == Phase.CANCELLED and s.attempts[-1].outcome == Outcome.CANCELLED


def test_stop_before_start_cancels_without_attempt() -> None:
    d = decide(observe(run({"stop": True})))
    s = status_of(d.actions)
    assert s.phase == Phase.CANCELLED and s.attempt == 0 and s.fence == 0
    assert kinds(d.actions) == ["WriteStatus"]


def _cond(status: Any, type_: str) -> tuple[str, str] | None:
    cond = next((x for x in status.conditions if x.type == type_), None)
    return None if cond is None else (cond.status, cond.reason)


def test_suspend_blocks_new_attempts_only() -> None:
    d = decide(observe(run({"suspend": True})))
    write = d.actions[0]
    assert status_of(d.actions).phase == Phase.SUSPENDED and kinds(d.actions) == ["WriteStatus"]
    assert _cond(write.status, "Suspended") == ("True", "Suspended") and [e.reason for e in write.events] == ["Suspended"]
    again = decide(observe(run({"suspend": True}, status=write.status.dump())))
    assert again.actions == []


def test_a_paused_worker_is_shown_paused_while_it_keeps_its_lease() -> None:
    """kubectl get wr showed Running, REASON Running and no Event while the worker really paused."""
    running = {"type": "Ready", "status": "False", "reason": "Running", "message": "job-a1 renewed its lease",
               "lastTransitionTime": T0.isoformat()}
    o = observe(run({"suspend": True}, status=held(conditions=[running])), lease(), (pod(),))
    write = next(a for a in decide(o).actions if kinds([a]) == ["WriteStatus"])
    assert write.status.phase == Phase.RUNNING and write.status.holder == "job-a1"  # it still holds the run
    assert _cond(write.status, "Suspended") == ("True", "WorkerPaused")
    assert _cond(write.status, "Ready") == ("False", "WorkerPaused")
    assert [(e.type, e.reason) for e in write.events] == [("Normal", "Suspended")]
    steady = decide(observe(run({"suspend": True}, status=write.status.dump()), lease(), (pod(),)))
    assert not [a for a in steady.actions if kinds([a]) == ["WriteStatus"]]
    resumed = decide(observe(run(status=write.status.dump()), lease(), (pod(),)))
    back = next(a for a in resumed.actions if kinds([a]) == ["WriteStatus"])
    assert _cond(back.status, "Suspended") == ("False", "Resumed") and _cond(back.status, "Ready") == ("False", "Running")
    assert [e.reason for e in back.events] == ["Resumed"]


def test_a_resumed_run_says_so_then_starts_its_attempt() -> None:
    suspended = status_of(decide(observe(run({"suspend": True}))).actions)
    d = decide(observe(run(status=suspended.dump())))
    assert kinds(d.actions) == ["WriteStatus"] and d.again_now
    assert _cond(d.actions[0].status, "Suspended") == ("False", "Resumed")
    started = decide(observe(run(status=d.actions[0].status.dump())))
    assert "EnsureLease" in kinds(started.actions)


def test_a_resume_into_a_refusal_that_already_stands_leaves_suspended() -> None:
    """Found by review: waiting for a missing budget, suspended, resumed: the resume wrote Resumed but
    kept phase Suspended, and admit() said nothing new (its condition had not changed), forever."""
    missing = BudgetObservation(name="b", missing=True)
    spec = {"budget": {"budgetRef": {"name": "b"}}}
    pending = status_of(decide(observe(run(spec), budget=missing)).actions)
    suspended = status_of(decide(observe(run({**spec, "suspend": True}, status=pending.dump(), generation=2),
                                         budget=missing)).actions)
    assert suspended.phase == Phase.SUSPENDED
    resumed = status_of(decide(observe(run(spec, status=suspended.dump(), generation=3), budget=missing)).actions)
    assert resumed.phase == Phase.PENDING and resumed.observed_generation == 3
    after = decide(observe(run(spec, status=resumed.dump(), generation=3), budget=missing))
    final = status_of(after.actions) if after.actions else resumed
    assert final.phase == Phase.PENDING and _cond(final, "Ready")[1] == "BudgetNotFound"


def test_a_spec_changed_while_suspended_is_observed() -> None:
    suspended = status_of(decide(observe(run({"suspend": True}))).actions)
    d = decide(observe(run({"suspend": True, "deadlineSeconds": 5000}, status=suspended.dump(), generation=2)))
    assert status_of(d.actions).observed_generation == 2


def test_a_paused_run_that_loses_its_holder_is_not_said_suspended_twice() -> None:
    running = {"type": "Ready", "status": "False", "reason": "Running", "message": "m", "lastTransitionTime": T0.isoformat()}
    o = observe(run({"suspend": True}, status=held(conditions=[running]), generation=1), lease(), (pod(),))
    paused = next(a for a in decide(o).actions if kinds([a]) == ["WriteStatus"]).status
    lapsed = decide(observe(run({"suspend": True}, status=paused.dump()), lease(last_change=0.0), (pod(),), mono=1000.0))
    events = [e.reason for a in lapsed.actions for w in ([a] if kinds([a]) == ["WriteStatus"] else
                                                          [a.status_write] if kinds([a]) == ["Revoke"] else [])
              for e in w.events]
    assert "LeaseLost" in events and "Suspended" not in events, events


def test_a_run_that_ends_while_suspended_is_no_longer_suspended() -> None:
    suspended = status_of(decide(observe(run({"suspend": True}))).actions)
    cancelled = status_of(decide(observe(run({"suspend": True, "stop": True}, status=suspended.dump()))).actions)
    assert cancelled.phase == Phase.CANCELLED and _cond(cancelled, "Suspended") == ("False", "Cancelled")


def test_deadline_exceeded_ends_run() -> None:
    st = held(endsAt=(T0 + dt.timedelta(seconds=60)).isoformat())
    before = decide(observe(run({"deadlineSeconds": 60}, status=st), lease(), (pod(),), now=T0 + dt.timedelta(seconds=30)))
    assert before.actions == [] and before.requeue_after == pytest.approx(15)  # lapse check comes first
    d = decide(observe(run({"deadlineSeconds": 60}, status=st), lease(), (pod(),), now=T0 + dt.timedelta(seconds=60)))
    s = status_of(d.actions)
    assert s.phase == Phase.DEADLINE_EXCEEDED and s.attempts[-1].outcome == Outcome.DEADLINE_EXCEEDED


def test_ttl_deletes_finished_run() -> None:
    st = {"phase": "Succeeded", "fence": 2, "attempt": 1, "finishedAt": T0.isoformat()}
    early = decide(observe(run({"ttlSecondsAfterFinished": 60}, status=st), now=T0 + dt.timedelta(seconds=20)))
    assert early.actions == [] and early.requeue_after == 40
    due = decide(observe(run({"ttlSecondsAfterFinished": 60}, status=st), now=T0 + dt.timedelta(seconds=60)))
    assert due.actions == [DeleteRun()]


# --- crash recovery ------------------------------------------------------------------


def test_status_written_but_lease_and_pod_missing_are_repaired() -> None:
    d = decide(observe(run(status=held(phase="Starting")), None, ()))
    assert kinds(d.actions) == ["EnsureLease", "EnsurePod"]
    assert (d.actions[0].holder, d.actions[0].fence) == ("job-a1", 1)


def test_lease_from_previous_attempt_is_rewritten() -> None:
    d = decide(observe(run(status=held(attempt=2)), lease(attempt=1), (pod(2),)))
    assert kinds(d.actions) == ["EnsureLease"]


def test_pod_missing_after_crash_is_created_with_same_name() -> None:
    d = decide(observe(run(status=held(phase="Starting")), lease(renewed=False), ()))
    assert kinds(d.actions) == ["EnsurePod"] and d.actions[0].name == "job-a1"


def test_terminal_run_with_held_lease_clears_it() -> None:
    d = decide(observe(run(status={"phase": "Succeeded", "fence": 2, "finishedAt": T0.isoformat()}), lease()))
    assert d.actions == [ClearLease(fence=2)]


def test_old_attempt_pods_are_deleted_and_released() -> None:
    st = held(attempt=2)
    d = decide(observe(run(status=st), lease(attempt=2),
                       (pod(1), pod(2), PodObservation("job-a0", 0, "Failed"))))
    assert DeletePod("job-a1") in d.actions
    assert ReleasePod("job-a0") in d.actions
    assert DeletePod("job-a2") not in d.actions


DUE = T0 + dt.timedelta(seconds=4)  # a deleted pod's deletionTimestamp: its grace period ends


@pytest.mark.parametrize("pod_obs, now, expected, exit_code", [
    # deleted, still in its grace period: keep Tether's finalizer, look again when it may be over
    (pod(1, deleting=True, deletion_due=DUE), T0, [], None),
    # killed when the grace period ran out: its exit status goes on the ended attempt first...
    (pod(1, "Failed", deleting=True, deletion_due=DUE, exit_code=137), DUE, ["WriteStatus"], 137),
    # ... as does one that exited on SIGTERM, or by itself after its attempt ended
    (pod(1, "Failed", deleting=True, deletion_due=DUE, exit_code=143), T0, ["WriteStatus"], 143),
    (pod(1, "Succeeded", exit_code=0), T0, ["WriteStatus"], 0),
    # a node that never reports: given up on a minute past the grace period, released without one
    (pod(1, deleting=True, deletion_due=DUE), DUE + dt.timedelta(seconds=61), ["ReleasePod"], None),
    # terminated without an exit code (never started): released
    (pod(1, "Failed", deleting=True, deletion_due=DUE), T0, ["ReleasePod"], None),
])
def test_an_ended_attempt_gets_its_pods_exit_status(pod_obs: PodObservation, now: dt.datetime,
                                                    expected: list[str], exit_code: int | None) -> None:
    st = held(attempt=2)
    d = decide(observe(run(status=st), lease(attempt=2), (pod_obs, pod(2)), now=now))
    assert [k for k in kinds(d.actions) if k in ("WriteStatus", "ReleasePod", "DeletePod")] == expected, d.actions
    if expected == ["WriteStatus"]:
        first = status_of(d.actions).attempts[0]
        assert (first.outcome, first.exit_code) == ("LeaseLost", exit_code)
        assert d.again_now  # then the pod is released, on the next pass
    if expected == []:
        assert d.requeue_after is not None and d.requeue_after <= 4 + 60


def test_a_recorded_exit_code_is_never_replaced() -> None:
    st = held(attempt=2)
    st["attempts"][0]["exitCode"] = 3
    d = decide(observe(run(status=st), lease(attempt=2), (pod(1, "Failed", exit_code=137), pod(2))))
    assert kinds(d.actions) == ["ReleasePod"]


def test_restart_waits_a_full_duration() -> None:
    # After a restart the tracker saw the lease first at mono=500: lapse only at 520.
    d = decide(observe(run(status=held()), lease(last_change=500.0), (pod(),), mono=519.0))
    assert d.actions == [] and d.requeue_after == pytest.approx(1.0)


def test_last_transition_time_kept_when_status_unchanged() -> None:
    first = status_of(decide(observe(run())).actions)
    later = T0 + dt.timedelta(seconds=5)
    body = first.dump()
    second = status_of(decide(observe(run(status=body), lease(renewed=True), (pod(),), now=later)).actions)
    ready_1 = next(c for c in first.conditions if c.type == "Ready")
    ready_2 = next(c for c in second.conditions if c.type == "Ready")
    assert ready_2.last_transition_time == ready_1.last_transition_time == T0  # False -> False
    assert ready_2.reason == "Running"


DELETING = {"deletionTimestamp": T0.isoformat(), "finalizers": ["tether.dev/run-cleanup"]}


def test_deleting_a_held_run_revokes_its_attempt_first() -> None:
    r = run(status=held(), **DELETING)
    d = decide(observe(r, lease(), (pod(),)))
    assert kinds(d.actions) == ["Revoke"] and d.actions[0].pods_to_delete == ("job-a1",)
    s = status_of(d.actions)
    assert s.holder is None and s.fence == 2 and s.phase == Phase.CANCELLED
    assert s.attempts[-1].outcome == Outcome.CANCELLED


def test_deleting_a_run_whose_result_landed_keeps_the_result() -> None:
    r = run(status=held(result={"ok": True}), **DELETING)
    s = status_of(decide(observe(r, lease(), (pod(),))).actions)
    assert s.phase == Phase.SUCCEEDED and s.result == {"ok": True}


@pytest.mark.parametrize("status,lease_obs,pods,budget,expected", [
    # the lease still names the old holder: clear it first
    ({"phase": "Cancelled", "fence": 2, "attempt": 1, "attempts": [], "usage": {"cents": 0, "tokens": 0}},
     lease(holder="job-a1", fence=1), (), None, ["ClearLease"]),
    # usage reported after the revocation write: settle it into the books
    ({"phase": "Cancelled", "fence": 2, "attempt": 1, "usage": {"cents": 3, "tokens": 0},
      "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "outcome": "Cancelled",
                    "usage": {"cents": 3, "tokens": 0}}]},
     lease(holder=None, fence=2, usage=Usage(cents=5, tokens=0)), (), None, ["WriteStatus"]),
    # settled: charge what the budget has not seen
    ({"phase": "Cancelled", "fence": 2, "attempt": 1, "usage": {"cents": 5, "tokens": 0}, "attempts": []},
     None, (), BudgetObservation(name="b", charged=Usage(cents=3, tokens=0)), ["ChargeBudget"]),
    # charged in full: the run records it (budgetCharged) before its mark may leave the ledger
    ({"phase": "Cancelled", "fence": 2, "attempt": 1, "usage": {"cents": 5, "tokens": 0}, "attempts": []},
     None, (pod(),), BudgetObservation(name="b", charged=Usage(cents=5, tokens=0), marked=True),
     ["WriteStatus"]),
    # recorded: release its mark from the budget's ledger
    ({"phase": "Cancelled", "fence": 2, "attempt": 1, "usage": {"cents": 5, "tokens": 0}, "attempts": [],
      "budgetCharged": True, "charged": {"cents": 5, "tokens": 0}},
     None, (pod(),), BudgetObservation(name="b", charged=Usage(cents=5, tokens=0), marked=True),
     ["ReleaseCharge"]),
    # released (no mark, and budgetCharged says never again): delete the running pod, release every
    # pod's finalizer
    ({"phase": "Cancelled", "fence": 2, "attempt": 1, "usage": {"cents": 5, "tokens": 0}, "attempts": [],
      "budgetCharged": True, "charged": {"cents": 5, "tokens": 0}},
     None, (pod(), pod(2, phase="Failed")), BudgetObservation(name="b"),
     ["DeletePod", "ReleasePod", "ReleasePod"]),
    # nothing left: let it go
    ({"phase": "Cancelled", "fence": 2, "attempt": 1, "usage": {"cents": 5, "tokens": 0}, "attempts": [],
      "budgetCharged": True, "charged": {"cents": 5, "tokens": 0}},
     None, (pod(deleting=True, has_finalizer=False),), BudgetObservation(name="b"),
     ["RemoveFinalizer"]),
])
def test_deleting_a_run_settles_then_releases(status: dict[str, Any], lease_obs: LeaseObservation | None,
                                              pods: tuple[PodObservation, ...], budget: BudgetObservation | None,
                                              expected: list[str]) -> None:
    r = run(spec={"budget": {"budgetRef": {"name": "b"}}}, status=status, **DELETING)
    assert kinds(decide(observe(r, lease_obs, pods, budget=budget)).actions) == expected


def test_a_lease_fence_ahead_of_the_run_is_foreign_and_revoked_past() -> None:
    r = run(status=held())
    d = decide(observe(r, lease(fence=9), (pod(),)))
    assert kinds(d.actions) == ["Revoke"] and d.actions[0].pods_to_delete == ("job-a1",)
    s = status_of(d.actions)
    assert s.fence == 10 and s.holder is None and s.phase == Phase.BACKOFF
    assert any(cond.reason == "LeaseTampered" for cond in s.conditions)
    assert d.actions[0].fence == 10 and d.actions[0].status_write.change == Change.LEASE_TAMPERED


def test_a_foreign_fence_on_a_finished_run_moves_its_fence_too() -> None:
    r = run(status={"phase": "Succeeded", "fence": 2, "attempt": 1, "attempts": []})
    d = decide(observe(r, lease(holder=None, fence=5)))
    assert kinds(d.actions) == ["WriteStatus", "ClearLease"] and status_of(d.actions).fence == 6


@pytest.mark.parametrize("available_since,mono,lost", [
    (float("-inf"), 121.0, True),   # API reachable all along: 21 s of silence > 20 s lease
    (None, 500.0, False),           # API unreachable now: silence says nothing
    (110.0, 121.0, False),          # API back at 110: judge nothing before 130
    (110.0, 130.5, True),           # a full duration after it came back, still silent
])
def test_no_lapse_is_judged_until_the_api_answered_for_a_full_duration(
        available_since: float | None, mono: float, lost: bool) -> None:
    o = replace(observe(run(status=held()), lease(last_change=100.0), (pod(),), mono=mono),
                api_available_since=available_since)
    d = decide(o)
    ended = [a.status_write for a in d.actions if isinstance(a, Revoke)]
    assert bool(ended) == lost
    if lost:
        assert ended[0].ends_attempt and ended[0].lapse
    else:
        assert d.requeue_after is not None and d.requeue_after > 0


def test_a_terminating_namespace_gets_no_new_attempt() -> None:
    o = replace(observe(run(status={"phase": "Backoff", "fence": 2, "attempt": 1, "attempts": []})),
                namespace_terminating=True)
    assert decide(o).actions == []


def test_checkpoint_folds_into_status_at_a_bounded_rate() -> None:
    first = decide(observe(run(status=held()), lease(checkpoint="10"), (pod(),)))
    s = status_of(first.actions)
    assert s.checkpoint.cursor == "10" and s.checkpoint.time == T0 and s.fence == 1
    folded = held(checkpoint={"cursor": "10", "time": T0.isoformat()}, foldedAt=T0.isoformat())
    soon = decide(observe(run(status=folded), lease(checkpoint="11"), (pod(),), now=T0 + dt.timedelta(seconds=5)))
    assert soon.actions == []  # a heartbeat alone causes no WorkerRun write
    later = decide(observe(run(status=folded), lease(checkpoint="12"), (pod(),), now=T0 + dt.timedelta(seconds=10)))
    assert status_of(later.actions).checkpoint.cursor == "12"


# --- budgets, caps, progress -----------------------------------------------------


def test_cap_crossed_tells_worker_to_stop_then_ends_budget_exceeded() -> None:
    spec = {"budget": {"capCents": 100}, "stopGraceSeconds": 5}
    first = decide(observe(run(spec, status=held()), lease(usage=Usage(cents=120, tokens=5)), (pod(),)))
    s = status_of(first.actions)
    assert s.stop_requested_at == T0
    sig = json.loads(next(a for a in first.actions if isinstance(a, EnsureSignals)).signals)
    assert sig["stop"] is True and "cap of 100 cents" in sig["reason"] and sig["capCents"] == 100
    asked = held(stopRequestedAt=T0.isoformat())
    late = decide(observe(run(spec, status=asked), lease(usage=Usage(cents=130, tokens=5)), (pod(),),
                          now=T0 + dt.timedelta(seconds=5)))
    s = status_of(late.actions)
    assert s.phase == Phase.BUDGET_EXCEEDED and s.overspend == Usage(cents=30, tokens=0)
    assert s.usage == Usage(cents=130, tokens=5) and s.attempts[-1].usage == Usage(cents=130, tokens=5)
    assert late.actions[0].pods_to_delete == ("job-a1",)


def test_usage_alarm_is_what_remains_of_the_cap() -> None:
    st = held(attempt=2)
    st["attempts"][0]["usage"] = {"cents": 30, "tokens": 0}
    d = decide(observe(run({"budget": {"capCents": 100}}, status=st), lease(attempt=2), (pod(2),)))
    assert d.usage_alarm is not None and d.usage_alarm.cents == 70


def test_usage_folds_at_a_bounded_rate_and_is_charged() -> None:
    budget = BudgetObservation(name="team", remaining=Remaining(cents=1000, tokens=10**6), charged=Usage())
    r = run({"budget": {"budgetRef": {"name": "team"}}}, status=held())
    d = decide(observe(r, lease(usage=Usage(cents=5, tokens=50)), (pod(),), budget=budget))
    assert status_of(d.actions).usage == Usage(cents=5, tokens=50)
    assert ChargeBudget(budget="team", total=Usage(cents=5, tokens=50)) in d.actions
    folded = held(usage={"cents": 5, "tokens": 50}, foldedAt=T0.isoformat())
    soon = decide(observe(run({"budget": {"budgetRef": {"name": "team"}}}, status=folded),
                          lease(usage=Usage(cents=9, tokens=90)), (pod(),), now=T0 + dt.timedelta(seconds=3),
                          budget=replace(budget, charged=Usage(cents=5, tokens=50))))
    assert soon.actions == [] and soon.requeue_after == pytest.approx(7)


def test_exhausted_budget_blocks_admission() -> None:
    budget = BudgetObservation(name="team", exhausted=True, remaining=Remaining(cents=0, tokens=0), next_reset_seconds=3600)
    d = decide(observe(run({"budget": {"budgetRef": {"name": "team"}}}), budget=budget))
    s = status_of(d.actions)
    assert s.phase == Phase.PENDING and s.attempt == 0
    assert cond(s, "Admitted") == ("False", "BudgetExceeded")
    assert kinds(d.actions) == ["WriteStatus"] and d.requeue_after == 3600
    again = decide(observe(run({"budget": {"budgetRef": {"name": "team"}}}, status=s.dump()), budget=budget))
    assert again.actions == []  # no write while nothing changes
    missing = decide(observe(run({"budget": {"budgetRef": {"name": "x"}}}), budget=BudgetObservation(name="x", missing=True)))
    assert cond(status_of(missing.actions), "Admitted") == ("False", "BudgetNotFound")


def test_raised_limit_admits() -> None:
    st = {"phase": "Pending", "conditions": [{"type": "Admitted", "status": "False", "reason": "BudgetExceeded",
                                              "lastTransitionTime": T0.isoformat()}]}
    budget = BudgetObservation(name="team", remaining=Remaining(cents=50, tokens=10**6))
    d = decide(observe(run({"budget": {"budgetRef": {"name": "team"}}}, status=st), budget=budget))
    s = status_of(d.actions)
    assert s.phase == Phase.STARTING and cond(s, "Admitted") == ("True", "Admitted")


def test_a_limit_the_budget_does_not_set_is_never_reached() -> None:
    """A budget without limitTokens has no tokens left to count down (issue 34): a run's tokens,
    however many, neither stop it nor set a token alarm; its cents still do. (Unlimited used to be
    2**53 - 1 tokens left, which a run's saturated total reached.)"""
    from tether.api.models import WorkerBudgetSpec
    from tether.core.actions import UsageAlarm
    from tether.core.budget import remaining

    budget = BudgetObservation(name="team", remaining=remaining(WorkerBudgetSpec(limit_cents=1000), Usage()))
    st = held(attempt=2)
    st["attempts"][0]["usage"] = {"cents": 0, "tokens": MAX_STATUS_NUMBER - 5}
    r = run({"budget": {"budgetRef": {"name": "team"}}}, status=st)
    d = decide(observe(r, lease(attempt=2, usage=Usage(cents=5, tokens=10)), (pod(2),), budget=budget))
    assert status_of(d.actions).stop_requested_at is None and "Revoke" not in kinds(d.actions)
    assert d.usage_alarm == UsageAlarm(cents=1000, tokens=None)
    spent = replace(budget, remaining=remaining(WorkerBudgetSpec(limit_cents=1000), Usage(cents=1000)))
    stopped = decide(observe(r, lease(attempt=2, usage=Usage(cents=5, tokens=10)), (pod(2),), budget=spent))
    assert status_of(stopped.actions).stop_requested_at == T0


def test_finished_run_is_charged_before_ttl_deletes_it() -> None:
    spec = {"budget": {"budgetRef": {"name": "team"}}, "ttlSecondsAfterFinished": 0}
    st = {"phase": "Succeeded", "fence": 2, "finishedAt": T0.isoformat(), "usage": {"cents": 40, "tokens": 4}}
    budget = BudgetObservation(name="team", remaining=Remaining(cents=10, tokens=10), charged=Usage(cents=30, tokens=4))
    d = decide(observe(run(spec, status=st), budget=budget))
    assert d.actions == [ChargeBudget(budget="team", total=Usage(cents=40, tokens=4))]
    charged = decide(observe(run(spec, status=st), budget=replace(budget, charged=Usage(cents=40, tokens=4))))
    assert status_of(charged.actions).budget_charged is True
    done = decide(observe(run(spec, status={**st, "budgetCharged": True}), budget=budget))
    assert done.actions == [DeleteRun()]


def test_progress_deadline_stalls_a_live_worker_without_checkpoints() -> None:
    spec = {"progressDeadlineSeconds": 15}
    alive = lease(last_change=130.0, checkpoint="7", checkpoint_changed=100.0)
    st = held(checkpoint={"cursor": "7", "time": T0.isoformat()}, foldedAt=T0.isoformat())
    before = decide(observe(run(spec, status=st), alive, (pod(),), mono=114.0))
    assert before.actions == [] and before.requeue_after == pytest.approx(1.0)
    d = decide(observe(run(spec, status=st), alive, (pod(),), mono=115.0))
    s = status_of(d.actions)
    assert s.attempts[-1].outcome == Outcome.STALLED and s.phase == Phase.BACKOFF
    assert s.checkpoint is not None and s.checkpoint.cursor == "7"  # the next attempt resumes from it


def test_suspend_is_signalled_to_a_running_worker() -> None:
    d = decide(observe(run(status=held()), lease(), (pod(),)))
    assert d.actions == []
    plain = decide(observe(run(status=held()), lease(), (pod(),))).actions
    o = observe(run({"suspend": True}, status=held()), lease(signals=desired_signals(observe(run(status=held())), None)),
                (pod(),))
    paused = decide(o)
    assert plain == [] and kinds(paused.actions) == ["WriteStatus", "EnsureSignals"]
    assert json.loads(paused.actions[1].signals)["paused"] is True


def test_usage_reported_during_revocation_is_settled_before_the_next_grant() -> None:
    st = {"phase": "Backoff", "attempt": 1, "fence": 2, "startedAt": T0.isoformat(), "usage": {"cents": 20, "tokens": 0},
          "nextAttemptAt": T0.isoformat(),
          "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "outcome": "PodFailed", "endedAt": T0.isoformat(),
                        "usage": {"cents": 20, "tokens": 0}}]}
    cleared = lease(holder=None, fence=2, usage=Usage(cents=27, tokens=3))
    d = decide(observe(run(status=st), cleared, ()))
    s = status_of(d.actions)
    assert s.attempts[0].usage == Usage(cents=27, tokens=3) and s.usage == Usage(cents=27, tokens=3)
    assert s.attempt == 1  # books first; the grant comes in the next round
    settled = decide(observe(run(status=s.dump()), cleared, ()))
    assert status_of(settled.actions).attempt == 2


# --- values the CRD admits never crash the core (issue 9) ------------------------------


def test_deadline_beyond_the_calendar_saturates_instead_of_overflowing() -> None:
    # 10**12 s is beyond the CRD's maximum today, but the core must be total even so:
    # endsAt saturates at the last representable instant, which means "never".
    s = status_of(decide(observe(run({"deadlineSeconds": 10**12}))).actions)
    assert s.ends_at == dt.datetime.max.replace(tzinfo=dt.timezone.utc)


def test_ttl_beyond_the_calendar_waits_instead_of_overflowing() -> None:
    st = {"phase": "Succeeded", "fence": 2, "attempt": 1, "finishedAt": T0.isoformat()}
    d = decide(observe(run({"ttlSecondsAfterFinished": 10**12}, status=st)))
    assert d.actions == []
    # A wait this long is re-checked daily rather than handed to a timer as 10**12 s.
    assert d.requeue_after == MAX_REQUEUE_SECONDS


def test_huge_backoff_factor_saturates_at_max_seconds() -> None:
    spec = {"retry": {"maxAttempts": 5, "backoff": {"initialSeconds": 10, "maxSeconds": 60, "factor": 1e300}}}
    assert [backoff_seconds(run(spec), n) for n in (1, 2, 3, 4, 100, 2**40)] == [10, 60, 60, 60, 60, 60]
    # The third failure used to raise OverflowError (1e300 ** 2) and loop forever.
    d = decide(observe(run(spec, status=held(attempt=3)), lease(3), (pod(3, phase="Failed", exit_code=1),)))
    s = status_of(d.actions)
    assert s.phase == Phase.BACKOFF and s.next_attempt_at == T0 + dt.timedelta(seconds=60)


@pytest.mark.parametrize(("initial", "maximum", "factor", "ended", "seconds"), [
    (0, 600, 100.0, 50, 0),          # no initial delay stays none
    (10, 5, 2.0, 1, 5),              # maxSeconds below initialSeconds caps the first delay too
    (10, 600, 1.0, 10**9, 10),       # factor 1: constant delay, however many attempts
    (86400, 604800, 100.0, 3, 604800),
    (1, 604800, 1.0000001, 10**6, pytest.approx(1.105171)),
])
def test_backoff_is_total_over_the_admitted_domain(initial: int, maximum: int, factor: float, ended: int,
                                                   seconds: float) -> None:
    spec = {"retry": {"backoff": {"initialSeconds": initial, "maxSeconds": maximum, "factor": factor}}}
    assert backoff_seconds(run(spec), ended) == seconds


# --- deadlineSeconds is a control field: status.endsAt follows it --------------------


@pytest.mark.parametrize(("deadline", "now_s", "ends_at_s", "phase"), [
    (600, 30, 600, None),              # unchanged: nothing to write
    (1200, 30, 1200, None),            # raised: endsAt moves later
    (300, 30, 300, None),              # lowered, not yet passed: endsAt moves earlier
    (20, 30, 20, Phase.DEADLINE_EXCEEDED),  # lowered below the time already spent: ends at once
    (None, 30, None, None),            # removed: no deadline any more
])
def test_ends_at_follows_a_changed_deadline(deadline: int | None, now_s: int, ends_at_s: int | None,
                                            phase: Phase | None) -> None:
    # The run started at T0 with deadlineSeconds 600, so endsAt was T0 + 600.
    st = held(endsAt=(T0 + dt.timedelta(seconds=600)).isoformat())
    spec = {} if deadline is None else {"deadlineSeconds": deadline}
    d = decide(observe(run(spec, status=st, generation=2 if deadline != 600 else 1), lease(), (pod(),),
                       now=T0 + dt.timedelta(seconds=now_s)))
    want = None if ends_at_s is None else T0 + dt.timedelta(seconds=ends_at_s)
    if deadline == 600:
        assert not [a for a in d.actions if isinstance(a, WriteStatus)]
        return
    s = status_of(d.actions)
    assert s.ends_at == want
    if phase is not None:
        assert s.phase == phase and s.holder is None
        assert kinds(d.actions) == ["Revoke"]
    else:
        assert s.phase == Phase.RUNNING and s.holder == "job-a1" and s.fence == 1
        # The worker learns the new endsAt from its signals on the next pass, which comes at once.
        assert d.again_now and d.requeue_after is None


def test_new_ends_at_reaches_the_worker_signals() -> None:
    st = held(endsAt=(T0 + dt.timedelta(seconds=1200)).isoformat())
    o = observe(run({"deadlineSeconds": 1200}, status=st), lease(signals=json.dumps({"endsAt": "old"})), (pod(),))
    d = decide(o)
    ensure = [a for a in d.actions if isinstance(a, EnsureSignals)]
    assert len(ensure) == 1
    assert json.loads(ensure[0].signals)["endsAt"].startswith((T0 + dt.timedelta(seconds=1200)).strftime("%Y-%m-%dT%H:%M:%S"))


def test_over_long_checkpoint_is_not_written_into_the_status() -> None:
    # Found by tests/unit/core/test_decide_total.py: Lease annotations admit 256 KiB, the CRD's
    # status.checkpoint.cursor 1024 characters. Folding a longer cursor made every status
    # write fail with 422; it is ignored instead and the recorded checkpoint stands.
    st = held(checkpoint={"cursor": "row-1", "time": T0.isoformat()}, foldedAt=T0.isoformat())
    r = run(status=st)
    long = lease(checkpoint="x" * 1025, usage=Usage(cents=5, tokens=0))
    d = decide(observe(r, long, (pod(),), now=T0 + dt.timedelta(seconds=30)))
    s = status_of(d.actions)
    assert s.checkpoint is not None and s.checkpoint.cursor == "row-1" and s.usage == Usage(cents=5, tokens=0)
    fits = decide(observe(r, lease(checkpoint="y" * 1024), (pod(),), now=T0 + dt.timedelta(seconds=30)))
    assert status_of(fits.actions).checkpoint.cursor == "y" * 1024
    # Nothing new but the over-long cursor: no write at all, rather than one per fold interval.
    idle = decide(observe(r, lease(checkpoint="x" * 1025), (pod(),), now=T0 + dt.timedelta(seconds=30)))
    assert not [a for a in idle.actions if isinstance(a, WriteStatus)]


def test_the_stop_signal_does_not_change_with_each_usage_report_over_the_cap() -> None:
    r = run(spec={"budget": {"capCents": 10}}, status=held(stopRequestedAt=T0.isoformat()))
    first = decide(observe(r, lease(usage=Usage(cents=12, tokens=0), signals="{}"), (pod(),)))
    second = decide(observe(r, lease(usage=Usage(cents=15, tokens=0), signals="{}"), (pod(),)))
    sig = [a.signals for d in (first, second) for a in d.actions if isinstance(a, EnsureSignals)]
    assert len(sig) == 2 and sig[0] == sig[1] and json.loads(sig[0])["stop"] is True


def test_run_usage_saturates_at_the_crds_maximum() -> None:
    # 100 attempts, each reporting the largest plausible usage (10**14 tokens), add up past
    # 2**53 - 1, the CRD's maximum for status.usage: such a status write would be refused forever.
    st = held(attempt=100)
    for a in st["attempts"]:
        a["usage"] = {"cents": 10**11, "tokens": 10**14}
    r = run({"retry": {"maxAttempts": 100}}, status=st)
    d = decide(observe(r, lease(100, usage=Usage(cents=10**11, tokens=10**14)), (pod(100, phase="Failed", exit_code=1),)))
    s = status_of(d.actions)
    assert s.phase == Phase.FAILED
    assert s.usage == Usage(cents=100 * 10**11, tokens=MAX_STATUS_NUMBER)


# --- revocation is one action, its order explicit (issue 9 §4) ----------------------------


def test_an_external_attempt_is_revoked_with_its_tool_claim() -> None:
    r = run({"executor": "External", "template": None}, status=held())
    d = decide(observe(r, lease(), (), mono=200))
    assert kinds(d.actions) == ["Revoke"]
    revoke = d.actions[0]
    # status (fence 1 -> 2, no holder) -> Lease cleared at 2 -> no pod -> job-a1's tool-claim Secret
    assert revoke.status_write.status.fence == revoke.fence == 2 and revoke.status_write.status.holder is None
    assert revoke.pods_to_delete == () and revoke.tool_claim_holders == ("job-a1",)


def test_a_revocation_is_followed_by_the_charge_of_its_final_usage() -> None:
    budget = BudgetObservation(name="team", remaining=Remaining(cents=1000, tokens=10**6))
    r = run({"budget": {"budgetRef": {"name": "team"}}}, status=held())
    d = decide(observe(r, lease(usage=Usage(cents=7, tokens=0)), (pod(),), mono=200, budget=budget))
    assert kinds(d.actions) == ["Revoke", "ChargeBudget"]
    assert d.actions[1] == ChargeBudget(budget="team", total=Usage(cents=7, tokens=0))


# --- the fence range is finite: Lease.spec.leaseTransitions and status.fence are int32 --------

FENCE_MAX = 2**31 - 1


def test_a_foreign_fence_at_the_int32_maximum_fails_the_run_instead_of_overflowing() -> None:
    d = decide(observe(run(status=held()), lease(fence=FENCE_MAX), (pod(),)))
    assert kinds(d.actions) == ["Revoke"] and d.actions[0].pods_to_delete == ("job-a1",)
    write = d.actions[0].status_write
    s = write.status
    assert s.fence == d.actions[0].fence == FENCE_MAX  # never 2**31: the CRD would refuse it (422 loop)
    assert (s.phase, s.holder, s.next_attempt_at) == (Phase.FAILED, None, None)
    assert cond(s, "Failed") == ("True", "FenceExhausted") and cond(s, "Stalled") == ("True", "FenceExhausted")
    assert cond(s, "LeaseHeld") == ("False", "LeaseTampered")
    assert s.error is not None and s.error.code == "FenceExhausted"
    assert {e.reason for e in write.events} >= {"FenceExhausted", "LeaseTampered"}
    assert write.change == Change.FENCE_EXHAUSTED


@pytest.mark.parametrize("lease_fence", [FENCE_MAX - 2, FENCE_MAX - 1, FENCE_MAX])
def test_a_foreign_fence_leaving_no_room_for_an_attempt_fails_a_waiting_run(lease_fence: int) -> None:
    st = {"phase": "Backoff", "attempt": 1, "fence": 2, "nextAttemptAt": T0.isoformat(), "attempts": []}
    d = decide(observe(run(status=st), lease(holder=None, fence=lease_fence)))
    assert kinds(d.actions) == ["WriteStatus", "ClearLease"]
    s = status_of(d.actions)
    assert s.phase == Phase.FAILED and s.fence == min(lease_fence + 1, FENCE_MAX)
    assert d.actions[1] == ClearLease(fence=s.fence)
    # Converged: the next pass sees the Lease at the run's fence and a finished run.
    after_write = decide(observe(run(status=s.dump()), lease(holder=None, fence=s.fence)))
    assert after_write.actions == []


def test_a_foreign_fence_with_room_left_lets_the_run_go_on() -> None:
    st = {"phase": "Backoff", "attempt": 1, "fence": 2, "nextAttemptAt": T0.isoformat(), "attempts": []}
    d = decide(observe(run(status=st), lease(holder=None, fence=FENCE_MAX - 3)))
    s = status_of(d.actions)
    assert s.phase == Phase.BACKOFF and s.fence == FENCE_MAX - 2


def test_a_foreign_fence_at_the_maximum_on_a_finished_run_keeps_its_phase() -> None:
    r = run(status={"phase": "Succeeded", "fence": 2, "attempt": 1, "attempts": [], "result": {"ok": 1}})
    s = status_of(decide(observe(r, lease(holder=None, fence=FENCE_MAX))).actions)
    assert s.phase == Phase.SUCCEEDED and s.fence == FENCE_MAX and s.result == {"ok": 1}


def test_no_grant_without_fences_for_its_revocation() -> None:
    st = {"phase": "Backoff", "attempt": 1, "fence": FENCE_MAX - 1, "nextAttemptAt": T0.isoformat(), "attempts": []}
    d = decide(observe(run(status=st), lease(holder=None, fence=FENCE_MAX - 1)))
    assert kinds(d.actions) == ["WriteStatus"]
    s = status_of(d.actions)
    assert s.phase == Phase.FAILED and s.fence == FENCE_MAX - 1 and cond(s, "Failed")[1] == "FenceExhausted"


# --- no magic values ------------------------------------------------------------------------


def test_a_progress_deadline_sets_no_timer_before_the_first_renewal() -> None:
    # Found while splitting the core: the progress timer ran from the grant, so once it passed
    # the decision asked for a pass "0 s from now" with nothing to do, until the first renewal.
    r = run({"progressDeadlineSeconds": 15}, status=held(phase="Starting"))
    d = decide(observe(r, lease(renewed=False, checkpoint_changed=100.0), (pod(),), mono=120.0))
    assert d.actions == [] and d.requeue_after == pytest.approx(10.0)  # the startup grace, nothing sooner


def test_a_usage_alarm_without_a_token_limit_has_none() -> None:
    d = decide(observe(run({"budget": {"capCents": 100}}, status=held()), lease(), (pod(),)))
    assert d.usage_alarm is not None and (d.usage_alarm.cents, d.usage_alarm.tokens) == (100, None)
    assert d.usage_alarm.reached(Usage(cents=100, tokens=0)) and not d.usage_alarm.reached(Usage(cents=99, tokens=10**14))
    assert decide(observe(run(status=held()), lease(), (pod(),))).usage_alarm is None


def test_grant_signals_come_from_the_status_being_written() -> None:
    # The first grant sets endsAt: the Lease it writes already tells the worker.
    d = decide(observe(run({"budget": {"capCents": 100}, "deadlineSeconds": 600})))
    s = status_of(d.actions)
    sig = json.loads(next(a for a in d.actions if isinstance(a, EnsureLease)).signals)
    assert s.ends_at == T0 + dt.timedelta(seconds=600)
    assert sig["endsAt"].startswith(s.ends_at.strftime("%Y-%m-%dT%H:%M:%S"))
    assert (sig["capCents"], sig["baseCents"], sig["stop"]) == (100, 0, False)
    # A later grant: what ended attempts spent is the base the worker's own reports add to.
    st = {"phase": "Backoff", "attempt": 1, "fence": 2, "startedAt": T0.isoformat(), "nextAttemptAt": T0.isoformat(),
          "endsAt": (T0 + dt.timedelta(seconds=600)).isoformat(),
          "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "outcome": "PodFailed", "endedAt": T0.isoformat(),
                        "usage": {"cents": 30, "tokens": 0}}]}
    d = decide(observe(run({"budget": {"capCents": 100}, "deadlineSeconds": 600}, status=st)))
    assert status_of(d.actions).holder == "job-a2"
    sig = json.loads(next(a for a in d.actions if isinstance(a, EnsureLease)).signals)
    assert (sig["capCents"], sig["baseCents"]) == (100, 30)


def test_a_workers_error_is_not_replaced_when_a_cap_ends_the_run_at_the_same_time() -> None:
    # Found by fault trial seed 324: the worker's accepted error was overwritten by BudgetExceeded.
    r = run(spec={"budget": {"capCents": 10}},
            status=held(stopRequestedAt=T0.isoformat(), error={"code": "Injected", "message": "boom"}))
    d = decide(observe(r, lease(usage=Usage(cents=12, tokens=0)), (pod(),)))
    s = status_of(d.actions)
    assert s.phase == Phase.BUDGET_EXCEEDED
    assert s.error is not None and s.error.code == "Injected"


@pytest.mark.parametrize(("spec", "usage", "outcome"), [
    ({"stop": True}, Usage(), Outcome.CANCELLED),
    ({"budget": {"capCents": 100}}, Usage(cents=120), Outcome.BUDGET_EXCEEDED)])
def test_a_worker_told_to_stop_that_stops_renewing_ends_the_run_not_retried(
        spec: dict[str, Any], usage: Usage, outcome: Outcome) -> None:
    """Found by the conformance kit: an External worker honours stop by going away, and its lease
    lapses. That is the end of the stop (as a pod exiting is), not a lost lease to retry."""
    asked = held(stopRequestedAt=T0.isoformat())
    d = decide(observe(run({**spec, "stopGraceSeconds": 60}, status=asked), lease(usage=usage), (), mono=200))
    s = status_of(d.actions)
    assert s.phase.value == outcome.value and s.attempts[-1].outcome == outcome and s.holder is None
    assert kinds(d.actions) == ["Revoke"] and d.actions[0].status_write.lapse


def test_a_withdrawn_stop_is_forgotten_so_a_later_one_is_told_with_its_full_grace() -> None:
    """Found by review: stopRequestedAt outlived a withdrawn stop (spec.stop cleared, a cap raised,
    a budget period reset), so a stop crossed hours later revoked the worker at once, untold."""
    asked = held(stopRequestedAt=T0.isoformat())
    later = T0 + dt.timedelta(seconds=100)
    withdrawn = decide(observe(run({"budget": {"capCents": 500}, "stopGraceSeconds": 10}, status=asked),
                               lease(usage=Usage(cents=120)), (pod(),), now=later))
    s = status_of(withdrawn.actions)
    assert s.stop_requested_at is None and s.holder == "job-a1" and s.fence == 1
    again = decide(observe(run({"budget": {"capCents": 100}, "stopGraceSeconds": 10},
                               status=held(stopRequestedAt=None)), lease(usage=Usage(cents=120)), (pod(),), now=later))
    assert "Revoke" not in kinds(again.actions)
    assert status_of(again.actions).stop_requested_at == later and again.requeue_after == 10
