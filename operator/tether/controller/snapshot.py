"""What one reconcile decides from: a Snapshot of the cache, and the conversions from the
bodies the API server sends to the observations the core reads (and to what the cache keeps)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from tether import protocol
from tether.api import constants as c
from tether.api.models import WorkerRun
from tether.controller.views import RunKey
from tether.core.classes import ClassResolution
from tether.core.observe import ApprovalObservation, ForeignPod, LeaseObservation, PodObservation


@dataclass(frozen=True)
class Snapshot:
    """What one reconcile decided from. `body` is the run exactly as read: never mutated,
    and its resourceVersion is the precondition of the status write."""

    key: RunKey
    body: dict[str, Any]
    run: WorkerRun
    lease: LeaseObservation | None
    pods: tuple[PodObservation, ...]
    # Pods labelled for this run's name that another (deleted) run controls.
    foreign_pods: tuple[ForeignPod, ...] = ()
    # The Lease as this pass last read it ((None,): absent); None: not read. A write based on it
    # is still a compare-and-swap, so a stale read costs a conflict and a re-read, nothing more.
    lease_read: tuple[dict[str, Any] | None] | None = None
    # What the run takes from its WorkerClass while unpinned (`run` has it applied); None: pinned.
    run_class: ClassResolution | None = None

    @property
    def uid(self) -> str:
        return self.run.metadata.uid

    @property
    def resource_version(self) -> str:
        return str(self.body["metadata"]["resourceVersion"])


# kube-apiserver accepts a pod-bound token until a minute (its JWT leeway) past the pod's
# deletionTimestamp, and caches a successful authentication for 10 s; 15 s more for clock skew.
BOUND_TOKEN_AFTER_DELETION = dt.timedelta(seconds=85)
# Once the pod is gone its token fails the API server's lookup, except from that 10 s cache and
# its pod lister's lag.
BOUND_TOKEN_AFTER_GONE = dt.timedelta(seconds=20)


def approval_observation(body: dict[str, Any]) -> ApprovalObservation | None:
    """A WorkerRunApproval as decide reads it (None for one the schema should have refused)."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    created = protocol.parse_time(meta.get("creationTimestamp"))
    ref = spec.get("runRef") or {}
    if created is None or not ref.get("name") or spec.get("decision") not in ("Approve", "Deny"):
        return None
    return ApprovalObservation(name=meta["name"], gate=str(spec.get("gate", "")), decision=spec["decision"],
                               approver=str(spec.get("approver", "")), reason=str(spec.get("reason") or ""),
                               created=created, run_uid=ref.get("uid") or None,
                               attempt=spec["attempt"] if isinstance(spec.get("attempt"), int) else None)


def foreign_pod(pod: dict[str, Any], gone_at: dt.datetime | None = None) -> ForeignPod:
    """A pod another run controls, and until when the API server may accept its bound token."""
    deleting = protocol.parse_time(pod["metadata"].get("deletionTimestamp"))
    dead_at = deleting + BOUND_TOKEN_AFTER_DELETION if deleting else None
    if gone_at is not None:
        dead_at = min(dead_at, gone_at + BOUND_TOKEN_AFTER_GONE) if dead_at else gone_at + BOUND_TOKEN_AFTER_GONE
    return ForeignPod(name=pod["metadata"]["name"], token_dead_at=dead_at)


# What the caches keep of a pod: what pod_observation, foreign_pod and the stray release read.
_POD_META = ("name", "namespace", "uid", "resourceVersion", "labels", "ownerReferences", "finalizers",
             "deletionTimestamp")
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def lean_run(body: dict[str, Any]) -> dict[str, Any]:
    """The run as cached: without managedFields and kubectl's copy of the last applied manifest,
    which together are about half of it. A status PUT of this body changes only the status (the
    subresource ignores the rest) and keeps the stored managedFields (omitted, not emptied)."""
    meta = body.get("metadata") or {}
    ann = meta.get("annotations") or {}
    if "managedFields" not in meta and LAST_APPLIED not in ann:
        return body
    slim = {k: v for k, v in meta.items() if k != "managedFields"}
    if LAST_APPLIED in ann:
        slim["annotations"] = {k: v for k, v in ann.items() if k != LAST_APPLIED}
    return {**body, "metadata": slim}


def lean_pod(body: dict[str, Any]) -> dict[str, Any]:
    """The pod as cached: its identity, owner, finalizers and how its containers ended (a full pod
    with managedFields is six times that; thousands of runs keep thousands of pods)."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    states = [{"state": cs.get("state")} for cs in status.get("containerStatuses") or []]
    return {"metadata": {k: meta[k] for k in _POD_META if k in meta},
            "status": {"phase": status.get("phase"), "containerStatuses": states}}


def pod_observation(pod: dict[str, Any]) -> PodObservation | None:
    meta, status = pod["metadata"], pod.get("status", {}) or {}
    try:
        attempt = int(meta.get("labels", {}).get(c.LABEL_ATTEMPT, ""))
    except ValueError:
        return None
    exit_code = None
    for cs in status.get("containerStatuses", []) or []:
        term = (cs.get("state") or {}).get("terminated")
        if term is not None:
            exit_code = term.get("exitCode")
            break
    return PodObservation(name=meta["name"], attempt=attempt, phase=status.get("phase", "Pending"),
                          exit_code=exit_code, deleting=bool(meta.get("deletionTimestamp")),
                          deletion_due=protocol.parse_time(meta.get("deletionTimestamp")),
                          has_finalizer=c.POD_FINALIZER in (meta.get("finalizers") or []))
