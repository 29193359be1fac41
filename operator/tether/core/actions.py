"""What the core asks the executor to do: actions, and the Decision that carries them.

Every action is a frozen value. The executor runs a Decision's actions in list order and
stops at the first failure, then decides again from fresh observations, so every action must
be safe to repeat. Where the order is a safety property it is not left to the list:
revocation is one action, `Revoke`, whose steps have a fixed, documented order.

The core names what happened (`Change`, the ended attempt's `Outcome`); the words the
operator logs for it are the executor's business.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from tether.api.models import Outcome, Usage, WorkerRunStatus

# The longest requeue a decision asks for. Longer waits (a TTL of months, a deadline far
# away) are re-decided daily instead, so no executor timer is handed a delay beyond its range.
MAX_REQUEUE_SECONDS = 86400.0


class Change(enum.Enum):
    """What a status write records, beyond the status itself (for the log and metrics)."""

    GRANTED = "granted"  # an attempt started: the fence moved and names a holder
    RENEWED = "renewed"  # the holder's first renewal was seen: Starting -> Running
    STOP_REQUESTED = "stop_requested"  # the holder is told to stop (spec.stop, a cap, the budget)
    ATTEMPT_ENDED = "attempt_ended"  # the attempt ended; WriteStatus.ended says how
    LEASE_TAMPERED = "lease_tampered"  # the Lease carried a fence the run never issued
    FENCE_EXHAUSTED = "fence_exhausted"  # no fence is left for another attempt: the run failed
    BUDGET_CHARGED = "budget_charged"  # a finished run's usage is charged in full


class Confirm(enum.Enum):
    """A fresh read an action rests on. Each action declares what it requires; the controller's
    confirmer makes those reads before the first action runs, and any that contradicts the
    decision (or cannot be made in time) sends it back to be decided again."""

    # Ending an attempt: the Lease is as decided on, so its final usage report is in the books.
    LEASE_FINAL = "lease-final"
    # A lapse: that read was timely, met no outage, and this is not one of many lapsing at once.
    LAPSE = "lapse"
    # A grant: the Lease the grant overwrites is as decided on (an ended attempt's uncleared
    # Lease is cleared and its report settled first, never overwritten).
    LEASE_FOR_GRANT = "lease-for-grant"
    # A grant: no pod of another (deleted) run carries the new holder's name.
    HOLDER_NAME_FREE = "holder-name-free"
    # A retry's grant: the namespace is not being deleted (its pods vanish for that reason).
    NAMESPACE_LIVE = "namespace-live"
    # The books close: the Lease holds no usage report the status lacks.
    BOOKS = "books"
    # The run is let go: its mark has left the budget's ledger.
    LEDGER = "ledger"
    # The run's quota is given back or used again (released, finished, its Workload deleted or
    # deactivated, its budget check told Retry, a retry granted under the admission it keeps): a
    # fresh list shows none of its pods may still run (the pod cache may not list them yet).
    PODS_GONE = "pods-gone"
    # A repair that no status write precedes: the run is unchanged since the snapshot (a status
    # compare-and-swap earlier in the same decision proves that for the actions after it).
    RUN_UNMOVED = "run-unmoved"


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class WriteDetails:
    """Facts about a status write that its log line and the metrics carry (unset: not this write's)."""

    silence_seconds: float | None = None  # a lapse: how long no renewal was observed
    eviction_reason: str | None = None  # Kueue evicted the attempt this write ends
    queued_seconds: float | None = None  # a queued run's grant: how long it waited for admission
    reason: str | None = None  # a stop told to the worker: why
    lease_fence: int | None = None  # a Lease carrying a fence the run never issued: that fence
    approvals: tuple[tuple[str, str, float], ...] = ()  # gate decisions: (gate, decision, seconds waited)

    def log_fields(self) -> dict[str, object]:
        """The set facts, under the log's field names."""
        fields: dict[str, object] = {"silenceSeconds": self.silence_seconds, "evictionReason": self.eviction_reason,
                                     "queuedSeconds": self.queued_seconds, "reason": self.reason,
                                     "leaseFence": self.lease_fence, "approvals": list(self.approvals) or None}
        return {k: v for k, v in fields.items() if v is not None}


@dataclass(frozen=True)
class WriteStatus:
    """Replace status with a resourceVersion precondition (compare-and-swap)."""

    status: WorkerRunStatus
    events: tuple[Event, ...] = ()
    change: Change | None = None
    details: WriteDetails = WriteDetails()
    ended: Outcome | None = None  # the attempt this write ends, and how
    lapse: bool = False  # ends the attempt for silence: the executor confirms it with a timely read
    grants: bool = False  # starts an attempt (bumps the fence and names a holder)
    # A grant's own reads, asked for by a capability's gate (Kueue: its Workload still admitted).
    rests_on: tuple[enum.Enum, ...] = ()

    pins_run: ClassVar[bool] = True  # a compare-and-swap against the snapshot

    @property
    def ends_attempt(self) -> bool:
        return self.ended is not None

    @property
    def requires(self) -> tuple[enum.Enum, ...]:
        if self.grants:
            retry = (Confirm.NAMESPACE_LIVE,) if self.status.attempt > 1 else ()
            return (Confirm.LEASE_FOR_GRANT, Confirm.HOLDER_NAME_FREE, *retry, *self.rests_on)
        return (Confirm.BOOKS,) if self.change == Change.BUDGET_CHARGED else ()


@dataclass(frozen=True)
class EnsureLease:
    holder: str
    fence: int
    duration_seconds: int
    signals: str = ""

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = (Confirm.RUN_UNMOVED,)


@dataclass(frozen=True)
class ClearLease:
    fence: int

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = ()


@dataclass(frozen=True)
class EnsurePod:
    name: str
    attempt: int
    fence: int
    holder: str

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = (Confirm.RUN_UNMOVED,)


@dataclass(frozen=True)
class DeletePod:
    name: str

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = ()


@dataclass(frozen=True)
class ReleasePod:
    """Remove Tether's finalizer: the attempt's end is recorded."""

    name: str

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = ()


@dataclass(frozen=True)
class DeleteRun:
    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = (Confirm.BOOKS, Confirm.LEDGER)


@dataclass(frozen=True)
class RemoveFinalizer:
    """Let a deleted run go: its attempt is ended, its usage charged, its pods released."""

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = (Confirm.BOOKS, Confirm.LEDGER)


@dataclass(frozen=True)
class EnsureSignals:
    """Write the control signals onto the current holder's Lease (tested fence)."""

    fence: int
    signals: str

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = ()


@dataclass(frozen=True)
class ChargeBudget:
    """Charge the run's whole usage so far to its budget; the budget adds only what is new."""

    budget: str
    total: Usage

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = (Confirm.RUN_UNMOVED,)


@dataclass(frozen=True)
class ReleaseCharge:
    """Drop the run's mark from its budget: the run's own status records that it is charged in
    full and nothing more can come (finished, Lease cleared), so the ledger keeps live runs only."""

    budget: str

    pins_run: ClassVar[bool] = False
    requires: ClassVar[tuple[Confirm, ...]] = (Confirm.BOOKS, Confirm.RUN_UNMOVED)


@dataclass(frozen=True)
class Revoke:
    """End the current attempt. The executor runs the steps in exactly this order and stops at
    the first failure:

    1. `status_write`: the fence moves past the holder's and `holder` is cleared (compare-and-
       swap). From here on nothing the old holder writes is accepted, so this comes first.
    2. the Lease is cleared at the new fence: the old holder's renewals fail.
    3. `pods_to_delete`: the attempt's pod, once it can no longer write anything that counts.
    4. `tool_claim_holders`: their tool-claim Secrets, so every tool credential minted for the
       attempt dies with them.

    Every step is idempotent. A pass interrupted after step 1 finds a run without a holder
    whose Lease still names one, clears it (`ClearLease`), and deletes the leftover pod as
    a pod of an ended attempt.
    """

    status_write: WriteStatus
    pods_to_delete: tuple[str, ...] = ()
    tool_claim_holders: tuple[str, ...] = ()

    pins_run: ClassVar[bool] = True  # its first step is a compare-and-swap against the snapshot

    @property
    def fence(self) -> int:
        """The fence the Lease is cleared at: the one the status write moves to."""
        return self.status_write.status.fence

    @property
    def requires(self) -> tuple[Confirm, ...]:
        return (Confirm.LEASE_FINAL, Confirm.LAPSE) if self.status_write.lapse else (Confirm.LEASE_FINAL,)


class Extra(Protocol):
    """An action of a capability: its package defines it, executes it and confirms what it
    requires (core.capability)."""

    @property
    def pins_run(self) -> bool: ...

    @property
    def requires(self) -> tuple[enum.Enum, ...]: ...


Action = (WriteStatus | Revoke | EnsureLease | ClearLease | EnsurePod | DeletePod | ReleasePod | DeleteRun
          | EnsureSignals | ChargeBudget | ReleaseCharge | RemoveFinalizer | Extra)


@dataclass(frozen=True)
class UsageAlarm:
    """The current attempt's own usage at which a cap or the budget is reached; None: that count
    has no limit."""

    cents: int | None = None
    tokens: int | None = None

    def reached(self, usage: Usage) -> bool:
        return (self.cents is not None and usage.cents >= self.cents) or \
            (self.tokens is not None and usage.tokens >= self.tokens)


@dataclass
class Decision:
    actions: list[Action] = field(default_factory=list)
    # Decide again after this many seconds even if nothing changes (None: only on change).
    requeue_after: float | None = None
    # Decide again as soon as these actions are done: the next step depends on what they wrote.
    again_now: bool = False
    # Wake up as soon as the current attempt's reported usage reaches this (a cap or budget).
    usage_alarm: UsageAlarm | None = None

    def wake(self, seconds: float) -> None:
        """Ask for a timed pass `seconds` from now (the earliest of all asked for wins)."""
        seconds = min(max(seconds, 0.0), MAX_REQUEUE_SECONDS)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)

    def again(self) -> None:
        self.again_now = True

    def add(self, action: Action | None) -> None:
        if action is not None:
            self.actions.append(action)

    def confirmations(self) -> tuple[enum.Enum, ...]:
        """What the actions require, in order, each once. RUN_UNMOVED is met for the actions after
        a compare-and-swap of the run (it fails if the run moved)."""
        out: list[enum.Enum] = []
        pinned = False
        for action in self.actions:
            for need in action.requires:
                if need not in out and not (need == Confirm.RUN_UNMOVED and pinned):
                    out.append(need)
            pinned = pinned or action.pins_run
        return tuple(out)
