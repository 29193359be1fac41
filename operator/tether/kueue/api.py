"""Typed views of the Kueue objects Tether reads (kueue.x-k8s.io/v1beta2): a run's Workload and the
ResourceFlavors its admission names. Only the fields Tether decides from; the rest is ignored.

The labels a user puts on a WorkerRun are Kueue's own (`kueue.x-k8s.io/queue-name`,
`kueue.x-k8s.io/priority-class`); Tether never adds a queue of its own.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from tether.api.constants import LABEL_PRIORITY_CLASS, LABEL_QUEUE_NAME  # noqa: F401 - re-exported: the labels Kueue reads
from tether.api.models import Condition, _Model

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
KUEUE_API_VERSION = f"{KUEUE_GROUP}/{KUEUE_VERSION}"
WORKLOAD_PLURAL = "workloads"
LABEL_JOB_UID = "kueue.x-k8s.io/job-uid"
# Copied onto the Workload as spec.maximumExecutionTimeSeconds (policies/workerrun-kueue-labels.yaml
# checks it): past it, Kueue deactivates the Workload, and the run yields and waits, as a Job stays suspended.
LABEL_MAX_EXEC_TIME = "kueue.x-k8s.io/max-exec-time-seconds"
# The condition types and reasons of Kueue's Workload API that Tether reads or writes.
WL_QUOTA_RESERVED = "QuotaReserved"
WL_ADMITTED = "Admitted"
WL_EVICTED = "Evicted"
WL_PREEMPTED = "Preempted"
WL_REQUEUED = "Requeued"
WL_PODS_READY = "PodsReady"
WL_FINISHED = "Finished"
# PodsReady's reasons, as Kueue's job framework sets them: waitForPodsReady's `timeout` applies
# to WaitForStart (counted from admission), its `recoveryTimeout` to WaitForRecovery (counted
# from the condition's change: the pods were ready once, and are not now).
PODS_STARTED, PODS_RECOVERED = "Started", "Recovered"
PODS_WAIT_FOR_START, PODS_WAIT_FOR_RECOVERY = "WaitForStart", "WaitForRecovery"
# Field managers, as Kueue's job framework names them: the admission status (quota reservation,
# Admitted, Finished) is owned by `kueue-admission`; a job controller's conditions by
# `kueue-job-controller-<type>`. Tether writes those parts of a Workload the same way.
ADMISSION_MANAGER = "kueue-admission"
JOB_CONTROLLER_MANAGER = "kueue-job-controller"
# The conditions the admission manager owns (Kueue's pkg/workload/patching admissionManagedConditions).
ADMISSION_CONDITIONS = (WL_QUOTA_RESERVED, "BlockedOnPreemptionGates", WL_EVICTED, WL_ADMITTED, WL_PREEMPTED,
                        WL_REQUEUED, "DeactivationTarget", WL_FINISHED, WL_PODS_READY)
# On a run's Workload: the digest of the run's execution fields it was made from (its pod set).
ANN_EXECUTION_DIGEST = "tether.dev/execution-digest"
# Kueue adds this to a Workload's priority (feature gate PriorityBoost): Tether keeps a running
# run's at how much work its preemption would lose.
ANN_PRIORITY_BOOST = "kueue.x-k8s.io/priority-boost"
# Kueue admits no Workload while this names a gate (comma-separated; set at creation, only removed
# later). Tether's: a start review not approved yet, a budget that cannot pay when it was made.
ANN_ADMISSION_GATED_BY = "kueue.x-k8s.io/admission-gated-by"
GATE_START_REVIEW = "tether.dev/start-review"
GATE_BUDGET = "tether.dev/budget"
# The controllerName of Tether's AdmissionCheck: a ClusterQueue listing one reserves no quota for a
# run whose budget or cap cannot pay (the check says Retry, Kueue frees the quota and requeues).
BUDGET_CHECK_CONTROLLER = "tether.dev/budget"
# On a Workload Tether deactivated (spec.active false) because its run would not start if admitted
# (suspended, waiting for a person or money, spec changed): why. Only such a Workload is
# activated again by Tether; one a person deactivated stays so.
ANN_DEACTIVATED = "tether.dev/deactivated"
AC_ACTIVE = "Active"
# The only pod set of a run's Workload: one worker per attempt.
POD_SET = "main"


def max_exec_seconds(labels: dict[str, str]) -> int | None:
    """The run's maximum execution time under Kueue, from its label; None when unset or not a value
    the admission policy admits (a run made before the policy was installed)."""
    value = labels.get(LABEL_MAX_EXEC_TIME, "")
    return int(value) if re.fullmatch(r"[1-9][0-9]{0,9}", value) and int(value) <= 2**31 - 1 else None


class OwnerReference(_Model):
    api_version: str
    kind: str
    name: str
    uid: str
    controller: bool | None = None


class WorkloadMeta(_Model):
    name: str
    namespace: str
    uid: str = ""
    resource_version: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    owner_references: list[OwnerReference] = Field(default_factory=list)
    deletion_timestamp: str | None = None


class WorkloadSpec(_Model):
    queue_name: str | None = None
    active: bool | None = None
    maximum_execution_time_seconds: int | None = None


class PodSetAssignment(_Model):
    name: str
    flavors: dict[str, str] = Field(default_factory=dict)
    count: int | None = None


class Admission(_Model):
    cluster_queue: str
    pod_set_assignments: list[PodSetAssignment] = Field(default_factory=list)


class PodSetUpdate(_Model):
    name: str
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)


class AdmissionCheckState(_Model):
    name: str
    state: str = "Pending"
    message: str = ""
    requeue_after_seconds: int | None = None
    pod_set_updates: list[PodSetUpdate] = Field(default_factory=list)


class Eviction(_Model):
    reason: str
    underlying_cause: str = ""
    count: int = 0


class SchedulingStats(_Model):
    evictions: list[Eviction] = Field(default_factory=list)


class WorkloadStatus(_Model):
    conditions: list[Condition] = Field(default_factory=list)
    admission: Admission | None = None
    admission_checks: list[AdmissionCheckState] = Field(default_factory=list)
    scheduling_stats: SchedulingStats | None = None


class Workload(_Model):
    metadata: WorkloadMeta
    spec: WorkloadSpec = Field(default_factory=WorkloadSpec)
    status: WorkloadStatus = Field(default_factory=WorkloadStatus)

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.status.conditions if c.type == type_), None)

    def is_true(self, type_: str) -> bool:
        cond = self.condition(type_)
        return cond is not None and cond.status == "True"

    @property
    def evictions(self) -> int:
        """How often Kueue evicted it, all reasons together (a counter that only grows)."""
        stats = self.status.scheduling_stats
        return sum(e.count for e in stats.evictions) if stats is not None else 0

    @property
    def gates(self) -> tuple[str, ...]:
        """The admission gates it waits on (kueue.x-k8s.io/admission-gated-by)."""
        value = self.metadata.annotations.get(ANN_ADMISSION_GATED_BY, "")
        return tuple(g.strip() for g in value.split(",") if g.strip())

    def owned_by(self, uid: str) -> bool:
        return any(r.uid == uid and r.controller for r in self.metadata.owner_references)


class ResourceFlavorSpec(_Model):
    node_labels: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)


class FlavorMeta(_Model):
    name: str


class ResourceFlavor(_Model):
    metadata: FlavorMeta
    spec: ResourceFlavorSpec = Field(default_factory=ResourceFlavorSpec)
