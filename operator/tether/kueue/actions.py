"""The writes a queued run asks of its Kueue Workload (executed by tether.kueue.book, each
conditional on the Workload as decided on)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from tether.core.actions import Confirm


class KueueConfirm(enum.Enum):
    """Kueue's own fresh read (the grant's, asked for by the admission gate)."""

    # A queued run's grant: a fresh read of its Workload shows it admitted, under the admission
    # (eviction count) the attempt records. A cached admission may be one Kueue took back.
    ADMITTED = "admitted"


@dataclass(frozen=True)
class EnsureWorkload:
    """Create the queued run's Kueue Workload (owned by the run; its pod set from the template),
    gated by what holds the run back now (a start review, a budget): it reserves no quota then."""

    name: str
    gates: tuple[str, ...] = ()
    inactive_reason: str | None = None  # made deactivated (spec.active false), saying why

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = (Confirm.RUN_UNMOVED,)


@dataclass(frozen=True)
class MarkPodsReady:
    """Tell Kueue whether the run's worker is up (Workload condition PodsReady, with the job
    framework's reason): True at an attempt's first renewal, False once that attempt ended and
    the next one's worker is awaited. Each Workload write is conditional on the resourceVersion
    the decision saw."""

    name: str
    message: str
    resource_version: str
    ready: bool = True
    reason: str = "Started"

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = ()


@dataclass(frozen=True)
class ReleaseQuota:
    """An evicted run has stopped (fenced, its pod gone): clear its Workload's quota reservation,
    as Kueue's job framework does, so Kueue queues it again."""

    name: str
    resource_version: str

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = (Confirm.RUN_UNMOVED, Confirm.PODS_GONE)


@dataclass(frozen=True)
class DeleteWorkload:
    """The run's spec (or its time limit) no longer matches its Workload: delete it (UID
    precondition); the next pass makes it again from the spec. Deleting gives its quota back, so
    none of the run's pods may still run (read fresh)."""

    name: str
    uid: str

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = (Confirm.RUN_UNMOVED, Confirm.PODS_GONE)


@dataclass(frozen=True)
class SetPriorityBoost:
    """Keep the running run's Workload annotated with how much work its preemption would lose
    (`kueue.x-k8s.io/priority-boost`; None removes it), so Kueue evicts the one that loses least."""

    name: str
    boost: int | None
    resource_version: str

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = ()


@dataclass(frozen=True)
class UngateWorkload:
    """What gated the Workload no longer holds the run back: remove Tether's gates (`keep` are the
    gates that stay, others' or Tether's still closed)."""

    name: str
    keep: tuple[str, ...]
    resource_version: str

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = ()


@dataclass(frozen=True)
class SetWorkloadActive:
    """Deactivate the Workload of a run that would not start if admitted (`reason`: why; Kueue frees
    its quota and does not queue it), or activate again one Tether deactivated (reason None)."""

    name: str
    active: bool
    reason: str | None
    resource_version: str

    pins_run: ClassVar[bool] = False

    @property
    def gives_quota_back(self) -> bool:
        return not self.active

    @property
    def requires(self) -> tuple[Confirm, ...]:
        return (Confirm.PODS_GONE,) if self.gives_quota_back else ()


@dataclass(frozen=True)
class AnswerBudgetCheck:
    """Tether's budget AdmissionCheck on a Workload holding quota: Ready when the run's budget and
    caps can pay, else Retry (Kueue frees the quota and requeues it after `requeue_after_seconds`)."""

    name: str
    check: str
    state: str
    message: str
    requeue_after_seconds: int | None
    resource_version: str

    pins_run: ClassVar[bool] = False

    @property
    def gives_quota_back(self) -> bool:
        return self.state == "Retry"

    @property
    def requires(self) -> tuple[Confirm, ...]:
        return (Confirm.PODS_GONE,) if self.gives_quota_back else ()


@dataclass(frozen=True)
class FinishWorkload:
    """Tell Kueue the run ended (Workload condition Finished): its quota is released at once, so
    only once none of its pods still runs (read fresh)."""

    name: str
    succeeded: bool
    message: str
    resource_version: str

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = (Confirm.PODS_GONE,)


WorkloadAction = (EnsureWorkload | MarkPodsReady | ReleaseQuota | DeleteWorkload | FinishWorkload | SetPriorityBoost
                  | UngateWorkload | AnswerBudgetCheck | SetWorkloadActive)
