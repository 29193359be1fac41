"""Adversarial review of the restructured controller (pure parts): each test pins one defect.

They are written against the promise, not the code: they fail while the defect is there.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from tether.api.models import Outcome, Phase, WorkerRun
from tether.core.decide import (
    ClearLease,
    EnsureLease,
    EnsurePod,
    ForeignPod,
    LeaseObservation,
    Observed,
    Revoke,
    WriteStatus,
    decide,
    desired_signals,
)

T0 = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.timezone.utc)


def _run(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> WorkerRun:
    return WorkerRun.model_validate({
        "metadata": {"name": "job", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": {"template": {"spec": {"containers": [{"name": "w", "command": ["w"]}]}},
                 "lease": {"durationSeconds": 20, "renewIntervalSeconds": 5, "startupGraceSeconds": 30},
                 "retry": {"maxAttempts": 3, "backoff": {"initialSeconds": 0, "maxSeconds": 60, "factor": 2}},
                 **(spec or {})},
        "status": status or {},
    })


def _held(**extra: Any) -> dict[str, Any]:
    """Attempt 1 holds the run (fence 1) and is running."""
    return {"phase": "Running", "attempt": 1, "fence": 1, "holder": "job-a1", "startedAt": T0.isoformat(),
            "observedGeneration": 1,
            "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "pod": "job-a1",
                          "startedAt": T0.isoformat()}], **extra}


def _observe(run: WorkerRun, holder: str | None, fence: int, now: dt.datetime, mono: float = 105.0) -> Observed:
    lease = LeaseObservation(holder=holder, fence=fence, resource_version="7", last_change=100.0, renewed=True)
    o = Observed(run=run, lease=lease, pods=(), now=now, mono=mono)
    # The Lease already carries the signals the operator wants (no EnsureSignals noise).
    return Observed(run=run, lease=LeaseObservation(**{**lease.__dict__, "signals": desired_signals(o, None)}),
                    pods=(), now=now, mono=mono)


def _status_write(actions: list[Any]) -> WriteStatus:
    writes = [a.status_write if isinstance(a, Revoke) else a for a in actions if isinstance(a, (WriteStatus, Revoke))]
    assert len(writes) == 1, actions
    return writes[0]


def test_a_result_accepted_before_the_deadline_pass_is_not_turned_into_deadline_exceeded() -> None:
    """The worker's fenced result was accepted by the API server (its fence and holder were
    current), but the operator's next pass comes after endsAt (it was restarting, lagging, or the
    result landed in the deadline's last moments). _decide_unfinished checks the deadline before
    the held attempt's result, so the run ends DeadlineExceeded with an error, its attempt recorded
    as DeadlineExceeded: an accepted result is reported as a failure, and whoever waits on the run
    does the work again."""
    run = _run({"deadlineSeconds": 60}, _held(result={"answer": 42}, endsAt=(T0 + dt.timedelta(seconds=60)).isoformat()))
    d = decide(_observe(run, "job-a1", 1, now=T0 + dt.timedelta(seconds=61)))
    s = _status_write(d.actions).status
    assert s.attempts[-1].outcome == Outcome.SUCCEEDED, s.attempts[-1]
    assert s.phase == Phase.SUCCEEDED and s.error is None
    assert s.result == {"answer": 42}


def test_a_run_whose_result_was_accepted_is_never_granted_again_after_a_foreign_lease_write() -> None:
    """A foreign write to the Lease (fence ahead of the run's) meets a run whose holder already
    published its result (accepted; the operator has not ended the attempt yet). decide_foreign_fence
    ignores the result: the attempt ends LeaseLost and the run goes to Backoff with status.result
    still set, and the next pass grants attempt 2 (a new pod that runs the work again) — which the
    following pass ends 'Succeeded' with attempt 1's result."""
    run = _run(status=_held(result={"answer": 42}))
    d1 = decide(_observe(run, "job-a1", 9, now=T0))  # someone wrote leaseTransitions=9
    s1 = _status_write(d1.actions).status
    # The next pass: the status as written, the Lease cleared at the new fence.
    run2 = _run(status=s1.dump())
    d2 = decide(_observe(run2, None, s1.fence, now=T0 + dt.timedelta(seconds=1)))
    granted = [a for a in d2.actions if isinstance(a, (EnsureLease, EnsurePod))
               or (isinstance(a, WriteStatus) and a.grants)]
    assert not granted, f"a run with an accepted result was granted again: {d2.actions}"
    assert s1.phase == Phase.SUCCEEDED and s1.attempts[0].outcome == Outcome.SUCCEEDED, (s1.phase, s1.attempts)


def test_no_attempt_is_granted_while_a_deleted_namesakes_pod_of_that_name_may_still_act() -> None:
    """Seed 378: the old run's pod `job-a1` was still terminating when the run was re-created.
    The API server accepts its worker's pod-bound token until a minute past the pod's
    deletionTimestamp, and that token names pod `job-a1`: granting holder `job-a1` before then
    hands the new run to the old worker (it renewed and completed it). After that the pod may
    linger (a dead node, a foreign finalizer), but it can no longer act: grant."""
    run = _run()

    def decide_with(*pods: ForeignPod) -> Any:
        return decide(Observed(run=run, lease=None, pods=(), now=T0, mono=100.0, foreign_pods=pods))

    def granted(d: Any) -> bool:
        return any(isinstance(a, EnsureLease) and a.holder == "job-a1" for a in d.actions) and \
            any(isinstance(a, EnsurePod) and a.name == "job-a1" for a in d.actions)

    def waits_visibly(d: Any, *words: str) -> WorkerRun:
        """No grant; the run says why it waits, on a condition a user (and kstatus) reads."""
        assert not granted(d) and [type(a) for a in d.actions] == [WriteStatus]
        status = d.actions[0].status
        held = next(cond for cond in status.conditions if cond.type == "LeaseHeld")
        assert status.phase == Phase.PENDING and held.status == "False" and held.reason == "NamesakePodTerminating"
        assert all(w in held.message for w in words), held.message
        return run.model_copy(update={"status": status})

    live = decide_with(ForeignPod("job-a1", None))
    assert live.requeue_after == 1.0
    waiting = waits_visibly(live, "job-a1", "not deleted yet")
    # Said once: the next pass over the same wait writes nothing.
    again = decide(Observed(run=waiting, lease=None, pods=(), now=T0, mono=101.0,
                            foreign_pods=(ForeignPod("job-a1", None),)))
    assert not again.actions and again.requeue_after == 1.0
    dying = decide_with(ForeignPod("job-a1", T0 + dt.timedelta(seconds=42)))
    assert dying.requeue_after == 42.0
    waits_visibly(dying, "job-a1", "terminating", (T0 + dt.timedelta(seconds=42)).isoformat(timespec="seconds"))
    assert granted(decide_with(ForeignPod("job-a1", T0 - dt.timedelta(seconds=1))))  # its token is dead
    assert granted(decide_with(ForeignPod("job-a2", None)))  # another name: not in the way


def _ended_external(ended_ago: float, phase: str = "Backoff") -> WorkerRun:
    ended = (T0 - dt.timedelta(seconds=ended_ago)).isoformat()
    return _run({"executor": "External", "template": None}, {
        "phase": phase, "attempt": 1, "fence": 2, "holder": None, "startedAt": T0.isoformat(),
        "nextAttemptAt": (T0 + dt.timedelta(seconds=60)).isoformat(),
        "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "startedAt": T0.isoformat(),
                      "endedAt": ended, "outcome": "LeaseLost"}]})


def test_an_interrupted_revocation_still_deletes_the_external_attempts_tool_claim() -> None:
    """A revocation interrupted after the Lease clear left the tool-claim Secret, and its tokens
    kept working: nothing deleted it until the run was. Until this operator has seen it deleted
    (and while a token minted before the end may still live), the revocation is finished."""
    cleared = LeaseObservation(holder=None, fence=2, resource_version="9", last_change=100.0, renewed=False)
    for phase in ("Backoff", "Lost"):
        run = _ended_external(5.0, phase)
        pending = decide(Observed(run=run, lease=cleared, pods=(), now=T0, mono=200.0))
        assert ClearLease(fence=2) in pending.actions, phase
        done = decide(Observed(run=run, lease=cleared, pods=(), now=T0, mono=200.0, tool_claims_cleared=True))
        assert ClearLease(fence=2) not in done.actions, phase
    # Tokens live 10 minutes (+70 s of leeway and cache): an attempt that ended longer ago has none left.
    old = decide(Observed(run=_ended_external(800.0), lease=cleared, pods=(), now=T0, mono=200.0))
    assert ClearLease(fence=2) not in old.actions


def test_a_finished_runs_books_close_only_after_its_revocation_and_a_late_report_is_owed_again() -> None:
    """Seed 109: the operator was killed between ending the run (Cancelled, 8 cents recorded)
    and clearing its Lease; the worker's last report said 10. The next pass cleared the Lease and
    marked budgetCharged in the same pass; settling the 10 afterwards left 2 cents uncharged (until
    the run was deleted, had it ever been)."""
    from tether.core.decide import BudgetObservation, ChargeBudget
    from tether.api.models import Remaining, Usage

    ended = T0.isoformat()
    run = _run({"budget": {"budgetRef": {"name": "team"}}}, {
        "phase": "Cancelled", "attempt": 1, "fence": 2, "holder": None, "startedAt": ended, "finishedAt": ended,
        "usage": {"cents": 8, "tokens": 0}, "budgetCharged": True,
        "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "pod": "job-a1", "startedAt": ended,
                      "endedAt": ended, "outcome": "Cancelled", "usage": {"cents": 8, "tokens": 0}}]})
    budget = BudgetObservation(name="team", remaining=Remaining(cents=1000), charged=Usage(cents=8))

    def lease(holder: str | None, fence: int) -> LeaseObservation:
        return LeaseObservation(holder=holder, fence=fence, resource_version="9", last_change=100.0, renewed=True,
                                usage=Usage(cents=10))

    uncleared = decide(Observed(run=run, lease=lease("job-a1", 1), pods=(), now=T0, mono=200.0, budget=budget))
    assert uncleared.actions == [ClearLease(fence=2)]  # nothing booked before the clear
    cleared = decide(Observed(run=run, lease=lease(None, 2), pods=(), now=T0, mono=200.0, budget=budget))
    status = _status_write(cleared.actions).status
    assert status.usage == Usage(cents=10) and status.attempts[-1].usage == Usage(cents=10)
    assert not status.budget_charged  # owed again
    settled = _run({"budget": {"budgetRef": {"name": "team"}}}, status.dump())
    owed = decide(Observed(run=settled, lease=lease(None, 2), pods=(), now=T0, mono=200.0, budget=budget))
    assert ChargeBudget(budget="team", total=Usage(cents=10)) in owed.actions
