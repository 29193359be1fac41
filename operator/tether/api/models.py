"""pydantic models of the WorkerRun API; they mirror crds/workerruns.tether.dev.yaml.

tests/unit/api/test_models_match_crd.py proves that both describe the same fields.
"""

from __future__ import annotations

import datetime as dt
from enum import Enum
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "tether.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
PLURAL = "workerruns"

# The CRDs' maximum for status counters (usage, spend, generations): the largest integer JSON
# carries exactly. Sums saturate here, because a larger value makes the API server refuse the write.
MAX_STATUS_NUMBER = 2**53 - 1
# status.attempts' maxItems in the CRD: older attempts leave the list, their spend stays counted.
MAX_ATTEMPT_HISTORY = 100


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def dump(self) -> dict[str, Any]:
        """JSON-ready dict with API field names, without unset optionals."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def clone(self) -> Self:
        """A deep copy to change: rebuilt from its fields, about five times cheaper than
        model_copy(deep=True), whose copy.deepcopy walk was a third of a grant's CPU (every pass
        of every run copies its status)."""
        return self.model_validate(self.model_dump())


class Phase(str, Enum):
    PENDING = "Pending"
    # Waiting for Kueue to admit its Workload (kueue.x-k8s.io/queue-name).
    QUEUED = "Queued"
    AWAITING_APPROVAL = "AwaitingApproval"
    AWAITING_REVIEW = "AwaitingReview"
    STARTING = "Starting"
    RUNNING = "Running"
    BACKOFF = "Backoff"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    LOST = "Lost"
    CANCELLED = "Cancelled"
    BUDGET_EXCEEDED = "BudgetExceeded"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    REJECTED = "Rejected"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_PHASES


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED, Phase.LOST, Phase.CANCELLED,
                             Phase.BUDGET_EXCEEDED, Phase.DEADLINE_EXCEEDED, Phase.REJECTED})


class Outcome(str, Enum):
    """How one attempt ended."""

    SUCCEEDED = "Succeeded"
    WORKER_FAILED = "WorkerFailed"
    POD_FAILED = "PodFailed"
    POD_VANISHED = "PodVanished"
    LEASE_LOST = "LeaseLost"
    STALLED = "Stalled"
    CANCELLED = "Cancelled"
    BUDGET_EXCEEDED = "BudgetExceeded"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    # A person denied the result the attempt published (spec.review.result).
    RESULT_REJECTED = "ResultRejected"
    # Kueue evicted the run's Workload (preemption, PodsReady timeout, a stopped queue): the worker
    # was told to yield and fenced; the run is queued again and this attempt uses up no retry.
    PREEMPTED = "Preempted"
    # The API server refused the attempt's pod (an invalid template, a policy): it never started.
    POD_REFUSED = "PodRefused"


# --- spec -------------------------------------------------------------------


class LeaseSpec(_Model):
    duration_seconds: int = 90
    renew_interval_seconds: int = 30
    startup_grace_seconds: int = 120


class BackoffSpec(_Model):
    initial_seconds: int = 10
    max_seconds: int = 600
    factor: float = 2.0


class ExitCodeRule(_Model):
    operator: Literal["In", "NotIn"]
    values: list[int]


class RetryRule(_Model):
    action: Literal["Retry", "FailRun"]
    on_exit_codes: ExitCodeRule | None = None
    on_reasons: list[Outcome] | None = None


class RetrySpec(_Model):
    max_attempts: int = 3
    backoff: BackoffSpec = Field(default_factory=BackoffSpec)
    rules: list[RetryRule] = Field(default_factory=list)


class BudgetRef(_Model):
    name: str


class BudgetSpec(_Model):
    cap_cents: int | None = None
    max_tokens: int | None = None
    budget_ref: BudgetRef | None = None
    # What reaching a cap or an exhausted WorkerBudget does to a held attempt: Stop ends it
    # BudgetExceeded; Pause tells its worker to pause, as spec.suspend does, until there is room.
    on_exhausted: Literal["Stop", "Pause"] = "Stop"


class ReviewSpec(_Model):
    start: bool = False
    start_timeout_seconds: int | None = None
    result: bool = False
    result_timeout_seconds: int | None = None


class ParentRef(_Model):
    """A child run's parent, and the parent's attempt that spawned it (children/api.py)."""

    name: str
    uid: str
    holder: str
    fence: int
    depth: int = 1
    class_name: str | None = None


class RunSpec(_Model):
    """What a run is, as a template of runs has it too (a WorkerRunSchedule's)."""

    executor: Literal["Pod", "External"] = "Pod"
    # A WorkerClass (api/workerclass.py); None: the default class, if there is one.
    class_name: str | None = None
    template: dict[str, Any] | None = None
    payload: dict[str, Any] | None = None
    idempotency_key: str | None = None
    lease: LeaseSpec = Field(default_factory=LeaseSpec)
    retry: RetrySpec = Field(default_factory=RetrySpec)
    budget: BudgetSpec | None = None
    deadline_seconds: int | None = None
    progress_deadline_seconds: int | None = None
    review: ReviewSpec = Field(default_factory=ReviewSpec)
    suspend: bool = False
    stop: bool = False
    stop_grace_seconds: int = 30
    ttl_seconds_after_finished: int | None = None


class WorkerRunSpec(RunSpec):
    parent_ref: ParentRef | None = None  # a child run's (children/api.py)


# --- status -----------------------------------------------------------------


class Usage(_Model):
    cents: int = 0
    tokens: int = 0


class Checkpoint(_Model):
    cursor: str
    time: dt.datetime | None = None


class AttemptAdmission(_Model):
    """The Kueue admission an attempt runs under, and what it put on the attempt's pod."""

    cluster_queue: str
    flavors: dict[str, str] = Field(default_factory=dict)
    # The Workload's eviction count when the attempt was granted: an eviction after it is this
    # attempt's (the count only grows, even once Kueue admits the Workload again).
    evictions: int = 0
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class ErrorInfo(_Model):
    code: str | None = None
    message: str | None = None


class AttemptRecord(_Model):
    attempt: int
    fence: int
    holder: str | None = None
    pod: str | None = None
    started_at: dt.datetime | None = None
    ended_at: dt.datetime | None = None
    outcome: Outcome | None = None
    exit_code: int | None = None
    message: str | None = None
    error: ErrorInfo | None = None  # what its worker published, whatever ended the attempt
    usage: Usage | None = None
    admission: AttemptAdmission | None = None


class ReviewRequest(_Model):
    """One gate awaiting or given a person's decision: Start, Result or a worker's named request."""

    gate: str
    attempt: int = 0  # the attempt whose gate this is; 0 for Start
    requested_at: dt.datetime
    deadline: dt.datetime | None = None
    details: str | None = None
    decision: Literal["Approve", "Deny", "TimedOut", "Withdrawn"] | None = None  # None: pending
    approver: str | None = None
    reason: str | None = None
    decided_at: dt.datetime | None = None
    # Start: the digest of the execution fields the gate asks to approve (core/execution.py).
    execution_digest: str | None = None


class ReviewStatus(_Model):
    feedback: str | None = None  # the last denied result's reason, handed to the next attempt
    requests: list[ReviewRequest] = Field(default_factory=list)

    def pending(self) -> list[ReviewRequest]:
        return [r for r in self.requests if r.decision is None]

    def find(self, gate: str, attempt: int) -> ReviewRequest | None:
        return next((r for r in self.requests if r.gate == gate and r.attempt == attempt), None)


class QueueStatus(_Model):
    """Where a queued run waits: its LocalQueue, the ClusterQueue behind it, and its Workload."""

    name: str
    workload: str
    cluster_queue: str | None = None


class RunClassStatus(_Model):
    """status.class: the WorkerClass a run took (name None: none) and that class's spec.defaults
    as the run has them: it takes from them whatever its spec leaves out (api/workerclass.py)."""

    name: str | None = None
    defaults: dict[str, Any] = Field(default_factory=dict)


class ChildEntry(_Model):
    """A child the parent's tree admitted and has not settled yet: what it holds of the tree."""

    name: str
    uid: str
    reserved_cents: int = 0
    reserved_tokens: int = 0


class ChildrenStatus(_Model):
    """status.children of a parent: the tree's ledger (children/ledger.py). Each child is admitted
    once (a compare-and-swap on this status, while the attempt that spawned it holds the parent) and
    settled once when it ends (its final usage moves from reserved to spent)."""

    admitted: int = 0  # children admitted so far, settled or not (bounds.maxChildren)
    reserved_cents: int = 0  # what live children hold of the tree (their caps)
    reserved_tokens: int = 0
    spent_cents: int = 0  # what settled children spent, all of them
    spent_tokens: int = 0
    live: list[ChildEntry] = Field(default_factory=list)


class Condition(_Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str | None = None
    observed_generation: int | None = None
    last_transition_time: dt.datetime


class WorkerRunStatus(_Model):
    observed_generation: int | None = None
    phase: Phase | None = None
    attempt: int = 0
    fence: int = 0
    holder: str | None = None
    last_renew_time: dt.datetime | None = None
    lease_expires_at: dt.datetime | None = None
    started_at: dt.datetime | None = None
    ends_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    next_attempt_at: dt.datetime | None = None
    folded_at: dt.datetime | None = None
    checkpoint: Checkpoint | None = None
    usage: Usage | None = None
    attempts: list[AttemptRecord] = Field(default_factory=list)
    # What attempts no longer in `attempts` (it keeps the last MAX_ATTEMPT_HISTORY) spent: totals
    # must not depend on how much history is kept.
    trimmed_usage: Usage | None = None
    result: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    stop_requested_at: dt.datetime | None = None
    overspend: Usage | None = None
    budget_charged: bool | None = None
    charged: Usage | None = None  # what the budget was charged for this run (baseline once released)
    review: ReviewStatus | None = None
    # The digest of the execution fields as approved or first granted; every grant must match it.
    execution_digest: str | None = None
    queue: QueueStatus | None = None
    class_: RunClassStatus | None = Field(default=None, alias="class")
    # Attempts Kueue preempted: they use up none of spec.retry.maxAttempts (a counter, because the
    # attempt history keeps only the last MAX_ATTEMPT_HISTORY).
    preemptions: int = 0
    children: ChildrenStatus | None = None
    conditions: list[Condition] = Field(default_factory=list)

    def current(self) -> AttemptRecord | None:
        return self.attempts[-1] if self.attempts else None


class ObjectMeta(_Model):
    name: str
    namespace: str
    uid: str = ""
    generation: int = 1
    resource_version: str = ""
    creation_timestamp: dt.datetime | None = None
    deletion_timestamp: dt.datetime | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    finalizers: list[str] = Field(default_factory=list)


class WorkerRun(_Model):
    api_version: str = API_VERSION
    kind: str = "WorkerRun"
    metadata: ObjectMeta
    spec: WorkerRunSpec
    status: WorkerRunStatus = Field(default_factory=WorkerRunStatus)

    @property
    def key(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"

    @property
    def idempotency_key(self) -> str:
        return self.spec.idempotency_key or self.metadata.uid


class GateDecision(_Model):
    """A decision on a request the worker made, as its Lease tells it."""

    decision: Literal["Approve", "Deny", "TimedOut"]
    reason: str | None = None
    approver: str | None = None


class Signals(_Model):
    """What the control plane tells the worker, carried on the Lease it renews."""

    stop: bool = False
    # With stop: the stop is a yield (Kueue evicted the run; it is queued again and resumes from
    # its last checkpoint), and `stop_by` is when the operator revokes the attempt whatever it does.
    yield_: bool = Field(default=False, alias="yield")
    stop_by: dt.datetime | None = None
    paused: bool = False
    reason: str | None = None
    ends_at: dt.datetime | None = None
    cap_cents: int | None = None
    cap_tokens: int | None = None
    # Spent by earlier attempts: the worker's own reports count from zero.
    base_cents: int = 0
    base_tokens: int = 0
    # Decisions on this attempt's requests (request_approval), by request name; only this
    # attempt's: the Lease is rewritten at every grant.
    decisions: dict[str, GateDecision] = Field(default_factory=dict)


# --- WorkerBudget -------------------------------------------------------------

BUDGET_PLURAL = "workerbudgets"


class WorkerBudgetSpec(_Model):
    limit_cents: int | None = None
    limit_tokens: int | None = None
    period: Literal["None", "Daily", "Weekly", "Monthly"] = "None"
    time_zone: str = "UTC"


class Charge(_Model):
    run: str | None = None
    cents: int = 0
    tokens: int = 0


class Remaining(_Model):
    """What a budget has left of each limit it sets: a limit it does not set has nothing to say
    (None, absent from the status), which means unlimited, never zero."""

    cents: int | None = None
    tokens: int | None = None


class WorkerBudgetStatus(_Model):
    observed_generation: int | None = None
    period_start: dt.datetime | None = None
    spent: Usage = Field(default_factory=Usage)
    remaining: Remaining | None = None
    charges: dict[str, Charge] = Field(default_factory=dict)
    conditions: list[Condition] = Field(default_factory=list)


class WorkerBudget(_Model):
    api_version: str = API_VERSION
    kind: str = "WorkerBudget"
    metadata: ObjectMeta
    spec: WorkerBudgetSpec
    status: WorkerBudgetStatus = Field(default_factory=WorkerBudgetStatus)
