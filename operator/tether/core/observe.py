"""What one decision sees: the run, its Lease as this operator observed it, its pods, its
budget, and both clocks. Frozen values: the core reads them and never changes them.

The wall clock (`now`) stamps the status and measures deadlines; the monotonic clock (`mono`)
times lease lapses, because the operator judges silence by when *it* saw each renewal, never by
the worker's timestamps.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from typing import Mapping, TypeVar

from tether import protocol
from tether.api.models import MAX_ATTEMPT_HISTORY, Remaining, Usage, WorkerRun
from tether.core.classes import ClassResolution

# Progress reported on heartbeats reaches the run's status at most this often.
FOLD_INTERVAL_SECONDS = 10.0

P = TypeVar("P")


@dataclass(frozen=True)
class LeaseObservation:
    holder: str | None
    fence: int | None
    resource_version: str
    # Monotonic time when this operator first saw the current resourceVersion
    # (or wrote it). The worker's own timestamps are never used.
    last_change: float
    # Whether a resourceVersion written by the holder (not by the grant) was seen.
    renewed: bool
    checkpoint: str | None = None
    usage: Usage | None = None
    # Monotonic time the checkpoint last changed (progress), and the signals on the lease now.
    checkpoint_changed: float = 0.0
    signals: str | None = None
    # The approvals the holder asked for on the Lease (tether.dev/requests), as last well-formed.
    requests: tuple[protocol.ApprovalRequest, ...] = ()


@dataclass(frozen=True)
class BudgetObservation:
    """The run's WorkerBudget, refreshed for `now` (period rolled over if due)."""

    name: str
    missing: bool = False
    exhausted: bool = False
    remaining: Remaining = field(default_factory=Remaining)  # None: the budget sets no such limit
    charged: Usage = field(default_factory=Usage)  # this run's mark
    marked: bool = False  # the budget holds a mark for this run (released once it is charged in full)
    next_reset_seconds: float | None = None


# A deleted pod's containers are killed when its grace period ends (its deletionTimestamp). One that
# has not reported its end this long after that is on a node that no longer reports (unreachable or
# gone): its exit status is given up on, and it no longer counts as running (Kueue's quota).
UNREPORTED_EXIT_SECONDS = 60.0


@dataclass(frozen=True)
class PodObservation:
    name: str
    attempt: int
    phase: str
    exit_code: int | None = None
    deleting: bool = False
    has_finalizer: bool = True
    # The pod's deletionTimestamp: when its grace period ends and the kubelet kills what is left.
    deletion_due: dt.datetime | None = None

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    def may_still_run(self, now: dt.datetime) -> bool:
        """Its containers may still run: it has not ended, and if it was deleted, its node has had
        UNREPORTED_EXIT_SECONDS past the grace period to say so (a node that is gone never does)."""
        return not self.terminated and not (self.deleting and self.deletion_due is not None
                                            and (now - self.deletion_due).total_seconds() >= UNREPORTED_EXIT_SECONDS)

    def given_up_in(self, now: dt.datetime) -> float | None:
        """Seconds until a deleted pod that has not ended is given up on (None: not deleted yet)."""
        if self.deletion_due is None or self.terminated:
            return None
        return max(0.0, (self.deletion_due - now).total_seconds() + UNREPORTED_EXIT_SECONDS)


@dataclass(frozen=True)
class PodRefusal:
    """The API server refused to create the pod of the grant at `fence` (422, or 403 by a policy):
    that attempt never started. Its answer, as this operator last heard it."""

    fence: int
    pod: str
    message: str


@dataclass(frozen=True)
class ApprovalObservation:
    """A WorkerRunApproval naming this run (by name; `run_uid` when it also names the UID)."""

    name: str
    gate: str
    decision: str  # Approve | Deny
    approver: str
    reason: str
    created: dt.datetime
    run_uid: str | None = None
    attempt: int | None = None  # the attempt whose gate it decides (0: Start); None: any made before it


@dataclass(frozen=True)
class ForeignPod:
    name: str
    # When the API server stops accepting the pod's bound token (kube-apiserver: a minute past
    # the pod's deletionTimestamp); None while the pod is not being deleted.
    token_dead_at: dt.datetime | None


@dataclass(frozen=True)
class Observed:
    run: WorkerRun
    lease: LeaseObservation | None
    pods: tuple[PodObservation, ...]
    now: dt.datetime
    mono: float
    budget: BudgetObservation | None = None
    # How often heartbeat-borne progress and usage may reach the run's status (bounded writes).
    fold_interval: float = FOLD_INTERVAL_SECONDS
    # How many attempt records status.attempts keeps (the fault trials keep few, so that totals are
    # judged past the history's end).
    attempt_history: int = MAX_ATTEMPT_HISTORY
    # Monotonic time since which the API server has answered this operator without a break
    # (None: unreachable now). No lapse is judged within a lease duration of it.
    api_available_since: float | None = float("-inf")
    # The namespace refused a create because it is being deleted: start no new attempt.
    namespace_terminating: bool = False
    # Pods labelled for this run's name that another run controls: a deleted namesake's. Its
    # worker would own a holder of the same name while its token is accepted.
    foreign_pods: tuple["ForeignPod", ...] = ()
    # The API server refused the pod of a grant (None: no refusal heard since this operator started).
    pod_refusal: PodRefusal | None = None
    # This operator deleted the tool-claim Secrets of the run's ended attempts at its current fence.
    tool_claims_cleared: bool = False
    # WorkerRunApprovals in the namespace that name this run (review gates); None when they could
    # not be listed: no gate is decided or timed out then, and everything else goes on.
    approvals: tuple["ApprovalObservation", ...] | None = ()
    # Monotonic time this operator last saw the run's progress held (liveness.progress_held): the
    # progress deadline counts from then at the earliest. None: never seen held.
    progress_held_at: float | None = None
    # What an unpinned run takes from its WorkerClass (`run` has it applied already); None once
    # pinned (api/workerclass.py): a class edit no longer concerns the run.
    run_class: ClassResolution | None = None
    # The capabilities' slices of this observation, by type (core.capability; Kueue's: a queued
    # run's Workload and where it waits).
    parts: Mapping[type, object] = field(default_factory=dict)

    def part(self, kind: type[P]) -> P | None:
        found = self.parts.get(kind)
        return found if isinstance(found, kind) else None

    def pod_of(self, attempt: int) -> PodObservation | None:
        return next((p for p in self.pods if p.attempt == attempt), None)


def current_lease(o: Observed) -> LeaseObservation | None:
    """The Lease if it names exactly the run's holder and fence, else None: only then do its
    renewals, usage and checkpoint speak for the current attempt."""
    s = o.run.status
    if o.lease is not None and protocol.same_owner(o.lease.holder, o.lease.fence, s.holder, s.fence):
        return o.lease
    return None
