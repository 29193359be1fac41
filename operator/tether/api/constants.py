"""Names shared by the operator, the worker SDK and tools: labels, annotations, env, conditions."""

from __future__ import annotations

PREFIX = "tether.dev"

# Kueue's own labels a user puts on a WorkerRun to queue it (a WorkerClass may default them); the
# Kueue package (tether.kueue) reads them.
LABEL_QUEUE_NAME = "kueue.x-k8s.io/queue-name"
LABEL_PRIORITY_CLASS = "kueue.x-k8s.io/priority-class"

# Labels on Leases and Pods that belong to a run.
LABEL_RUN = f"{PREFIX}/run"
LABEL_ATTEMPT = f"{PREFIX}/attempt"
# Pods carry this finalizer so that Tether sees every attempt's end, even a deleted pod's
# (the Kubernetes Job controller tracks its pods the same way).
POD_FINALIZER = f"{PREFIX}/attempt-tracking"
# WorkerRuns carry this finalizer so that deleting one ends its attempt, charges its final
# usage and releases its pods before it is gone.
RUN_FINALIZER = f"{PREFIX}/run-cleanup"

# Lease annotations written by the worker on each heartbeat (one write carries all).
ANN_CHECKPOINT = f"{PREFIX}/checkpoint"
ANN_USAGE = f"{PREFIX}/usage"
# Lease annotation written by the worker: the approvals it asks for (docs/protocol.md §9).
ANN_REQUESTS = f"{PREFIX}/requests"
# Lease annotations written by the operator: the fence the lease was granted with, and the
# control signals (JSON) the worker reads from every renewal's response.
ANN_FENCE = f"{PREFIX}/fence"
ANN_SIGNALS = f"{PREFIX}/signals"
# Lease annotation written by the gateway: which external worker claimed the current attempt.
ANN_CLAIMED_BY = f"{PREFIX}/claimed-by"

# Environment the operator gives a worker pod.
ENV_RUN = "TETHER_RUN"
ENV_NAMESPACE = "TETHER_NAMESPACE"
ENV_HOLDER = "TETHER_HOLDER"
# Why the previous attempt's result was denied (spec.review.result).
ENV_REVIEW_FEEDBACK = "TETHER_REVIEW_FEEDBACK"
# The run's UID: a run re-created under the same name reuses holder and fence, never the UID.
ENV_RUN_UID = "TETHER_RUN_UID"
ENV_FENCE = "TETHER_FENCE"
ENV_ATTEMPT = "TETHER_ATTEMPT"
ENV_LEASE_DURATION = "TETHER_LEASE_DURATION_SECONDS"
ENV_RENEW_INTERVAL = "TETHER_RENEW_INTERVAL_SECONDS"
ENV_PAYLOAD = "TETHER_PAYLOAD"
# Set instead of TETHER_PAYLOAD when the payload is too large for the environment: its value,
# "spec.payload", says where the worker reads it (its own WorkerRun, with its own credentials).
ENV_PAYLOAD_FROM = "TETHER_PAYLOAD_FROM"
PAYLOAD_FROM_RUN = "spec.payload"
ENV_CHECKPOINT = "TETHER_CHECKPOINT"
ENV_IDEMPOTENCY_KEY = "TETHER_IDEMPOTENCY_KEY"

# Condition types.
COND_READY = "Ready"
COND_RECONCILING = "Reconciling"
COND_STALLED = "Stalled"
COND_SUCCEEDED = "Succeeded"
COND_FAILED = "Failed"
COND_ADMITTED = "Admitted"
COND_LEASE_HELD = "LeaseHeld"
COND_APPROVED = "Approved"
# Like the Job controller's: True while spec.suspend is set, False (reason Resumed) once cleared.
COND_SUSPENDED = "Suspended"

# Event reasons (CamelCase, one per change).
EV_ATTEMPT_STARTED = "AttemptStarted"
EV_LEASE_RENEWED = "LeaseRenewed"
EV_LEASE_LOST = "LeaseLost"
EV_ATTEMPT_ENDED = "AttemptEnded"
EV_RESULT_REJECTED = "ResultRejected"
EV_SUCCEEDED = "Succeeded"
EV_FAILED = "Failed"
EV_CANCELLED = "Cancelled"
EV_DEADLINE_EXCEEDED = "DeadlineExceeded"
EV_BACKOFF = "BackoffStarted"
EV_SUSPENDED = "Suspended"
EV_RESUMED = "Resumed"
EV_BUDGET_EXCEEDED = "BudgetExceeded"
EV_STOP_REQUESTED = "StopRequested"
EV_STOP_WITHDRAWN = "StopWithdrawn"
EV_PREEMPTED = "Preempted"
EV_POD_REFUSED = "PodRefused"
EV_STALLED = "Stalled"
# The run's own review gates (spec.review); a worker's requests have lower-case names.
GATE_START = "Start"
GATE_RESULT = "Result"

EV_APPROVAL_PENDING = "ApprovalPending"
EV_APPROVED = "Approved"
EV_REJECTED = "Rejected"
EV_APPROVAL_DENIED = "ApprovalDenied"
EV_RESULT_DENIED = "ResultDenied"
EV_APPROVAL_TIMED_OUT = "ApprovalTimedOut"
# Why nobody holds a re-created run yet: a pod of its deleted namesake has the next holder's name.
REASON_NAMESAKE_POD = "NamesakePodTerminating"

# Condition and Event reason when the Lease's fence was moved by someone other than Tether.
REASON_LEASE_TAMPERED = "LeaseTampered"
# Condition and Event reason when the execution fields differ from those approved or first run.
REASON_SPEC_CHANGED = "SpecChanged"
# Pending before its first attempt: its WorkerClass does not exist, or it breaks a bound of it.
REASON_CLASS_NOT_FOUND = "ClassNotFound"
REASON_CLASS_BOUNDS_EXCEEDED = "ClassBoundsExceeded"
REASON_CLASSES_UNKNOWN = "ClassesUnknown"
# Admitted's reasons for a run queued through Kueue (kueue.x-k8s.io/queue-name).
REASON_QUEUED = "Queued"
REASON_ADMITTED = "Admitted"
# Ready's reason (the REASON column) while a worker holds the run and is told to pause.
REASON_WORKER_PAUSED = "WorkerPaused"
# A held run told to pause because a cap or its WorkerBudget is reached (spec.budget.onExhausted: Pause).
REASON_BUDGET_PAUSED = "BudgetPaused"
# Ready's reason while a worker holds the run and a request it made waits for a person's decision
# (its phase stays Running): the word the start gate's phase uses for the same wait.
REASON_AWAITING_APPROVAL = "AwaitingApproval"
