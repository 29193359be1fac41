"""The Kueue Workload of a queued run, and the status writes Kueue's job framework makes on a
job's Workload, built the way that framework builds them (sigs.k8s.io/kueue pkg/workload/patching):
server-side applies whose field manager owns exactly the fields it sets, conditional on the
Workload's resourceVersion.

Why not the framework itself (a Go controller beside the operator)? Its other half, eviction as
a fenced, checkpointed yield, is decided by the run controller's one pure decision from the same
observation as every grant and revocation; a second controller writing the run would split that
decision across two processes. The writes Kueue expects from a job controller are these three.
"""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

from tether.kueue import api as k
from tether.api.models import WorkerRun
from tether.kube.resources import owner_ref
from tether.protocol import parse_time, rfc3339

# An External run's pod set asks for one of these instead of a pod's resources, so a ClusterQueue
# can cap how many External runs hold leases at once (coveredResources: ["tether.dev/runs"]).
EXTERNAL_RUN_RESOURCE = "tether.dev/runs"


def pod_set_template(run: WorkerRun) -> dict[str, Any]:
    """The pod set's template: the run's pod template, or for an External run a placeholder
    that asks for one `tether.dev/runs` (no pod is ever made from it)."""
    if run.spec.executor == "Pod":
        template = copy.deepcopy(run.spec.template or {})
        return {"metadata": {k_: v for k_, v in (template.get("metadata") or {}).items()
                             if k_ in ("labels", "annotations")},
                "spec": template.get("spec") or {}}
    return {"spec": {"restartPolicy": "Never", "containers": [{
        "name": "worker", "image": "external",
        "resources": {"requests": {EXTERNAL_RUN_RESOURCE: "1"}, "limits": {EXTERNAL_RUN_RESOURCE: "1"}}}]}}


def workload_body(run: WorkerRun, name: str, queue: str, priority: tuple[str, int] | None, digest: str,
                  gates: tuple[str, ...] = (), inactive_reason: str | None = None) -> dict[str, Any]:
    """The Workload Kueue queues the run by: owned by it (a controller reference, so Kueue and the
    garbage collector see whose it is), one pod set of one pod, the run's LocalQueue and priority, and
    the admission gates that hold it back when it is made, and its maximum execution time (the label,
    as Kueue's job framework copies it from a Job's)."""
    spec: dict[str, Any] = {
        "queueName": queue,
        "podSets": [{"name": k.POD_SET, "count": 1, "template": pod_set_template(run)}],
    }
    max_exec = k.max_exec_seconds(run.metadata.labels)
    if max_exec is not None:
        spec["maximumExecutionTimeSeconds"] = max_exec
    if inactive_reason is not None:
        spec["active"] = False
    if priority is not None:
        spec["priorityClassRef"] = {"group": k.KUEUE_GROUP, "kind": "WorkloadPriorityClass", "name": priority[0]}
        spec["priority"] = priority[1]
    return {
        "apiVersion": k.KUEUE_API_VERSION, "kind": "Workload",
        "metadata": {"name": name, "namespace": run.metadata.namespace,
                     "labels": {k.LABEL_JOB_UID: run.metadata.uid},
                     # What its pod set was made from: a spec edited while queued makes it again.
                     "annotations": {k.ANN_EXECUTION_DIGEST: digest,
                                     **({k.ANN_ADMISSION_GATED_BY: ",".join(gates)} if gates else {}),
                                     **({k.ANN_DEACTIVATED: inactive_reason} if inactive_reason else {})},
                     "ownerReferences": [{**owner_ref(run), "controller": True}]},
        "spec": spec,
    }


def _condition(type_: str, status: str, reason: str, message: str, generation: int, now: dt.datetime) -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message[:32768],
            "observedGeneration": generation, "lastTransitionTime": rfc3339(now)}


def _set(conditions: list[dict[str, Any]], new: dict[str, Any]) -> list[dict[str, Any]]:
    """metav1 SetStatusCondition: the transition time moves only when the status does."""
    out, found = [], False
    for cond in conditions:
        if cond.get("type") == new["type"]:
            found = True
            if cond.get("status") == new["status"]:
                new = {**new, "lastTransitionTime": cond.get("lastTransitionTime", new["lastTransitionTime"])}
            out.append(new)
        else:
            out.append(cond)
    return out if found else out + [new]


def pods_ready_status(workload: dict[str, Any], ready: bool, reason: str, message: str,
                      now: dt.datetime) -> dict[str, Any]:
    """What `kueue-job-controller-PodsReady` applies: the one condition it owns, with the job
    framework's reason (see kueue.api's PODS_* reasons)."""
    gen = int(workload["metadata"].get("generation") or 1)
    return {"conditions": [_condition(k.WL_PODS_READY, "True" if ready else "False", reason, message, gen, now)]}


def finished_status(workload: dict[str, Any], succeeded: bool, message: str, now: dt.datetime) -> dict[str, Any]:
    """What `kueue-admission` applies to finish a Workload: its whole admission status (as the
    framework's admission patch carries it) with Finished=True, so no field it owns is dropped."""
    gen = int(workload["metadata"].get("generation") or 1)
    status = workload.get("status") or {}
    conditions = _set(list(status.get("conditions") or []),
                      _condition(k.WL_FINISHED, "True", "Succeeded" if succeeded else "Failed", message, gen, now))
    return _admission_status({**status, "conditions": conditions})


def released_status(workload: dict[str, Any], now: dt.datetime) -> dict[str, Any]:
    """What `kueue-admission` applies once an evicted job has stopped (the framework's eviction
    path): the quota reservation and admission cleared, Admitted synced, and Requeued set (True
    after a preemption or node failure), so Kueue queues the Workload again."""
    gen = int(workload["metadata"].get("generation") or 1)
    status = dict(workload.get("status") or {})
    conditions = list(status.get("conditions") or [])
    evicted = next((c for c in conditions if c.get("type") == k.WL_EVICTED), None) or {}
    reason, message = str(evicted.get("reason") or "Evicted"), str(evicted.get("message") or "")
    requeued = "True" if reason in ("Preempted", "NodeFailures") else "False"
    conditions = _set(conditions, _condition(k.WL_REQUEUED, requeued, reason, message, gen, now))
    conditions = _set(conditions, _condition(k.WL_QUOTA_RESERVED, "False", "Pending", message, gen, now))
    checks_ready = all(a.get("state") == "Ready" for a in status.get("admissionChecks") or [])
    admitted = next((c for c in conditions if c.get("type") == k.WL_ADMITTED), None) or {}
    since = parse_time(admitted.get("lastTransitionTime"))
    if admitted.get("status") == "True" and since is not None:
        # Admitted turns False here, not in Kueue: the time it was admitted is added up here too (as
        # Kueue's SyncAdmittedCondition does), or maximumExecutionTimeSeconds would restart at each readmission.
        status["accumulatedPastExecutionTimeSeconds"] = int(status.get("accumulatedPastExecutionTimeSeconds") or 0) \
            + max(0, int((now - since).total_seconds()))
    conditions = _set(conditions, _condition(
        k.WL_ADMITTED, "False", "NoReservation" if checks_ready else "NoReservationUnsatisfiedChecks",
        "The workload has no reservation" + ("" if checks_ready else " and not all checks ready"), gen, now))
    status.pop("admission", None)
    return _admission_status({**status, "conditions": conditions})


def budget_check_status(check: str, state: str, message: str, requeue_after_seconds: int | None,
                        now: dt.datetime) -> dict[str, Any]:
    """What Tether's budget check applies (as its controller, `tether.dev/budget`): its own entry of
    the admission checks (a list keyed by name)."""
    entry: dict[str, Any] = {"name": check, "state": state, "message": message[:32768],
                             "lastTransitionTime": rfc3339(now)}
    if requeue_after_seconds is not None:
        entry["requeueAfterSeconds"] = requeue_after_seconds
    return {"admissionChecks": [entry]}


def activation_patch(active: bool, reason: str | None, resource_version: str) -> dict[str, Any]:
    """spec.active, with why Tether deactivated it (removed when it activates it again), conditional
    on `resource_version` (a merge patch)."""
    return {"metadata": {"resourceVersion": resource_version, "annotations": {k.ANN_DEACTIVATED: reason}},
            "spec": {"active": active}}


def check_active_status(generation: int, now: dt.datetime) -> dict[str, Any]:
    """An AdmissionCheck of Tether's controller is served: Active=True (a ClusterQueue listing an
    inactive check admits nothing)."""
    return {"conditions": [_condition(k.AC_ACTIVE, "True", "Active", "Tether answers this check from WorkerBudgets",
                                      generation, now)]}


def _admission_status(status: dict[str, Any]) -> dict[str, Any]:
    """The fields the admission manager owns (the framework's admissionStatusPatch)."""
    out: dict[str, Any] = {}
    if status.get("admission") is not None:
        out["admission"] = status["admission"]
        out["resourceRequests"] = []
    elif status.get("resourceRequests"):
        out["resourceRequests"] = status["resourceRequests"]
    requeue = status.get("requeueState") or {}
    if requeue.get("count") is not None or requeue.get("requeueAt") is not None:
        out["requeueState"] = requeue
    out["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") in k.ADMISSION_CONDITIONS]
    for key in ("accumulatedPastExecutionTimeSeconds", "clusterName", "nominatedClusterNames", "unhealthyNodes",
                "preemptionGates"):
        if status.get(key) is not None:
            out[key] = status[key]
    evictions = (status.get("schedulingStats") or {}).get("evictions")
    if evictions:
        out["schedulingStats"] = {"evictions": evictions}
    if status.get("admissionChecks"):
        out["admissionChecks"] = status["admissionChecks"]
    return out
