"""Pure rules for judging worker liveness without trusting the operator's own view too far.

Two separate controls, as DESIGN.md asks: the lease (is the worker alive?) and the progress
deadline (is it still producing checkpoints?). Both are judged on the operator's monotonic
clock, from when *it* observed each change, and neither is judged until the API server has
answered for a full lease duration: an outage hides renewals.

Kubernetes' node lifecycle controller faces the same question for kubelets: when a large
share of heartbeats stop together, the likelier cause is the control plane or the observer's
connection to it, not that every worker died at the same moment.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from tether.api.conditions import get_condition
from tether.api.constants import COND_SUSPENDED, GATE_RESULT, GATE_START, REASON_BUDGET_PAUSED
from tether.api.models import AttemptRecord, Phase, WorkerRun
from tether.core.observe import LeaseObservation

# At least this many overdue leases, and at least this share of the held ones, is a mass lapse
# (the node lifecycle controller's --unhealthy-zone-threshold is 55 %, from 3 nodes).
MASS_LAPSE_MIN = 3
MASS_LAPSE_SHARE = 0.55


def mass_lapse(overdue: int, active: int) -> bool:
    return active > 0 and overdue >= MASS_LAPSE_MIN and overdue >= MASS_LAPSE_SHARE * active


def judge_from(api_available_since: float | None, duration: float) -> float | None:
    """The earliest monotonic time a lapse may be judged: a full lease duration after the API
    server became reachable (again). None while it is unreachable: judge nothing."""
    if api_available_since is None:
        return None
    return api_available_since + duration


def lapse_deadline(run: WorkerRun, lease: LeaseObservation, api_available_since: float | None = float("-inf")) -> float:
    """Monotonic time at which the current holder's lease counts as lapsed: a full duration of
    silence, and a full duration of the API server answering us (an outage hides renewals)."""
    spec = run.spec.lease
    renewed = lease.renewed or run.status.phase == Phase.RUNNING
    silence = spec.duration_seconds if renewed else max(spec.startup_grace_seconds, spec.duration_seconds)
    judge = judge_from(api_available_since, spec.duration_seconds)
    if judge is None:
        return math.inf
    return max(lease.last_change + silence, judge)


def progress_held(run: WorkerRun) -> bool:
    """The holder does what it was told and cannot make progress meanwhile: paused by
    spec.suspend or by its budget (the Suspended condition says BudgetPaused), or waiting for a
    person's decision on a request of its own attempt."""
    if run.spec.suspend:
        return True
    s = run.status
    paused = get_condition(s.conditions, COND_SUSPENDED)
    if paused is not None and (paused.status, paused.reason) == ("True", REASON_BUDGET_PAUSED):
        return True
    return s.review is not None and any(
        r.attempt == s.attempt and r.gate not in (GATE_START, GATE_RESULT) for r in s.review.pending())


def progress_deadline(run: WorkerRun, lease: LeaseObservation, api_available_since: float | None,
                      held_at: float | None = None) -> float | None:
    """Monotonic time at which a renewing holder without a new checkpoint counts as stalled.
    None: no progressDeadlineSeconds, the holder has not renewed yet (until then the lease
    alone judges it, and its first renewal brings a new pass anyway), or its progress is held
    (progress_held). The clock does not run while held: it counts from the later of the last
    checkpoint and the last moment this operator saw the run held (`held_at`)."""
    pd = run.spec.progress_deadline_seconds
    if pd is None or not lease.renewed or progress_held(run):
        return None
    judge = judge_from(api_available_since, run.spec.lease.duration_seconds)
    since = max(lease.checkpoint_changed, held_at if held_at is not None else -math.inf)
    return math.inf if judge is None else max(since + pd, judge)


@dataclass(frozen=True)
class Verdict:
    """The lease's verdict on the current attempt: lapsed, stalled, or look again later."""

    lapsed: bool = False
    stalled: bool = False
    silence: float = 0.0  # seconds without a renewal observed, when lapsed
    recheck_in: float | None = None  # seconds until the verdict can change, when neither


def judge(run: WorkerRun, lease: LeaseObservation, mono: float, api_available_since: float | None,
          progress_held_at: float | None = None) -> Verdict:
    lapse = lapse_deadline(run, lease, api_available_since)
    progress = progress_deadline(run, lease, api_available_since, progress_held_at)
    if mono >= lapse:
        return Verdict(lapsed=True, silence=mono - lease.last_change)
    if progress is not None and mono >= progress:
        return Verdict(stalled=True)
    if math.isinf(lapse):
        # The API server is unreachable: look again after a lease duration (no sooner is useful:
        # once it answers, a full duration must pass before anything is judged).
        return Verdict(recheck_in=run.spec.lease.duration_seconds)
    return Verdict(recheck_in=min(lapse, progress if progress is not None else math.inf) - mono)


def never_leased_wait(run: WorkerRun, cur: AttemptRecord, now: dt.datetime, mono: float,
                      api_available_since: float | None) -> float | None:
    """An attempt whose Lease was never written is judged like one that never renewed: after the
    startup grace from its grant (the operator's own timestamp), and only once the API server
    has answered for a full duration. Seconds until then; None: it has lapsed."""
    spec = run.spec.lease
    grace = max(spec.startup_grace_seconds, spec.duration_seconds)
    judge = judge_from(api_available_since, spec.duration_seconds)
    if judge is None:
        return float(spec.duration_seconds)
    left = max(grace - (now - cur.started_at).total_seconds(), judge - mono) if cur.started_at else grace
    return left if left > 0 else None
