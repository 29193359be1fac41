"""Builders of the objects Tether creates for a run: Lease, worker Pod, and the worker's RBAC.

Pure functions of the run, so they are tested without a cluster.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
from typing import Any

from tether.api import constants as c
from tether import tracecontext
from tether.api.models import API_VERSION, GROUP, PLURAL, WorkerRun
from tether.kube.paths import role_binding_path, role_path, service_account_path
from tether.protocol import micro_time  # noqa: F401  (Lease times; callers use resources.micro_time)


def owner_ref(run: WorkerRun) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "WorkerRun", "name": run.metadata.name,
            "uid": run.metadata.uid, "controller": True}


def run_labels(run: WorkerRun) -> dict[str, str]:
    return {c.LABEL_RUN: run.metadata.name, "app.kubernetes.io/managed-by": "tether"}


def lease_spec(holder: str | None, fence: int, duration: int, now: dt.datetime) -> dict[str, Any]:
    spec: dict[str, Any] = {"holderIdentity": holder, "leaseTransitions": fence,
                            "leaseDurationSeconds": duration}
    if holder is not None:
        spec["acquireTime"] = micro_time(now)
        spec["renewTime"] = micro_time(now)
    return spec


def build_lease(run: WorkerRun, holder: str, fence: int, duration: int, now: dt.datetime,
                signals: str = "") -> dict[str, Any]:
    annotations = {c.ANN_FENCE: str(fence)}
    if signals:
        annotations[c.ANN_SIGNALS] = signals
    return {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": run.metadata.name, "namespace": run.metadata.namespace,
                     "labels": run_labels(run), "ownerReferences": [owner_ref(run)],
                     "annotations": annotations},
        "spec": lease_spec(holder, fence, duration, now),
    }


def regrant_lease(current: dict[str, Any], holder: str | None, fence: int, duration: int,
                  now: dt.datetime, signals: str = "") -> dict[str, Any]:
    """The current Lease rewritten for a new holder (or none), keeping its resourceVersion.

    Every report on a Lease is its holder's: a new grant drops the previous attempt's usage,
    checkpoint (the run's status carries it to whoever resumes) and claimer, and approval
    requests go with any rewrite. Clearing keeps the holder's final usage report, which is then
    settled into that holder's attempt; a Lease that already names nobody drops it when
    rewritten, since its report belongs to an attempt that is settled already (an interrupted
    grant's revocation must not book it into the attempt that never got the Lease).
    """
    lease = copy.deepcopy(current)
    ann = lease["metadata"].setdefault("annotations", {}) or {}
    lease["metadata"]["annotations"] = ann
    ann[c.ANN_FENCE] = str(fence)
    ann.pop(c.ANN_REQUESTS, None)
    if holder is not None or not (current.get("spec") or {}).get("holderIdentity"):
        ann.pop(c.ANN_USAGE, None)
    if holder is not None:
        ann.pop(c.ANN_CHECKPOINT, None)
        ann.pop(c.ANN_CLAIMED_BY, None)
    if signals:
        ann[c.ANN_SIGNALS] = signals
    else:
        ann.pop(c.ANN_SIGNALS, None)
    lease["spec"] = lease_spec(holder, fence, duration, now)
    return lease


# The worker identity every pod-backed run of a namespace shares (--worker-identity=namespace).
NAMESPACE_WORKER = "tether-worker"


def shares_namespace_identity(run: WorkerRun, shared: bool) -> bool:
    """Pod runs without an account of their own use the namespace's worker identity when the
    admission policy is in force (it scopes each pod-bound token to its own run). External
    runs keep one per run: the gateway mints their tool claims for it."""
    template_spec = (run.spec.template or {}).get("spec", {}) or {}
    return shared and run.spec.executor == "Pod" and not template_spec.get("serviceAccountName")


def run_service_account(run: WorkerRun) -> str:
    """The ServiceAccount Tether makes for one run (owned by it)."""
    return f"{run.metadata.name}-worker"


def worker_service_account(run: WorkerRun, shared: bool = False) -> str:
    """The pod's ServiceAccount: the template's own, else the namespace's (shared), else one per run.
    An External run always gets the one Tether makes: the gateway mints its tool claims for that
    account, and naming an account in a run must never be a way to obtain its tokens."""
    if run.spec.executor == "External":
        return run_service_account(run)
    template_spec = (run.spec.template or {}).get("spec", {}) or {}
    if shares_namespace_identity(run, shared):
        return NAMESPACE_WORKER
    return template_spec.get("serviceAccountName") or run_service_account(run)


def tool_claim_service_account(run: WorkerRun) -> str:
    """Whose tokens the gateway hands an External run's claimant: only ever the run's own account."""
    return run_service_account(run)


def build_namespace_worker_rbac(ns: str) -> list[tuple[str, dict[str, Any]]]:
    """The namespace's worker identity: a ServiceAccount, and a Role that lets it read and renew
    run Leases, patch run status and create child runs in the namespace — which run, the admission
    policies decide from the pod its token names. Owned by no run: deleting one must not take it
    from the rest."""
    meta = {"name": NAMESPACE_WORKER, "namespace": ns, "labels": {"app.kubernetes.io/managed-by": "tether"}}
    return [
        (service_account_path(ns), {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}),
        (role_path(ns), {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
            "rules": [
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "update", "patch"]},
                # create: a child run of the run the pod holds, and nothing else (policies/child-runs.yaml).
                {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "create"]},
                {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
            ]}),
        (role_binding_path(ns), {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAMESPACE_WORKER},
            "subjects": [{"kind": "ServiceAccount", "name": NAMESPACE_WORKER, "namespace": ns}]}),
    ]


def build_worker_rbac(run: WorkerRun) -> list[tuple[str, dict[str, Any]]]:
    """(collection path, object) pairs: a ServiceAccount (unless the template names one), and a
    Role that lets that account touch only this run's Lease and status."""
    ns, name = run.metadata.namespace, run.metadata.name
    sa = worker_service_account(run)
    meta = lambda n: {"name": n, "namespace": ns, "labels": run_labels(run),  # noqa: E731
                      "ownerReferences": [owner_ref(run)]}
    role_name = f"tether-worker-{name}"
    objects: list[tuple[str, dict[str, Any]]] = []
    if sa == run_service_account(run):
        objects.append((service_account_path(ns),
                        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(sa)}))
    objects.append((role_path(ns), {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(role_name),
        "rules": [
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [name],
             "verbs": ["get", "update", "patch"]},
            # `claim` is the gateway's verb: an external worker may use this token's identity too.
            {"apiGroups": [GROUP], "resources": [PLURAL], "resourceNames": [name], "verbs": ["get", "claim"]},
            {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "resourceNames": [name],
             "verbs": ["get", "patch"]},
        ],
    }))
    objects.append((role_binding_path(ns), {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(role_name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
    }))
    return objects


# Payloads up to this size (compact JSON, UTF-8) ride in TETHER_PAYLOAD. Linux refuses to exec
# a process with one environment string over 128 KiB (MAX_ARG_STRLEN): the pod exits 127 on every
# attempt. Larger payloads stay in the WorkerRun, and the worker reads spec.payload from there.
INLINE_PAYLOAD_BYTES = 32 * 1024


def payload_env(run: WorkerRun) -> dict[str, str]:
    """How the worker gets its payload: inline, or a pointer to its WorkerRun's spec.payload."""
    inline = json.dumps(run.spec.payload or {}, separators=(",", ":"))
    if len(inline.encode()) <= INLINE_PAYLOAD_BYTES:
        return {c.ENV_PAYLOAD: inline}
    return {c.ENV_PAYLOAD_FROM: c.PAYLOAD_FROM_RUN}


def worker_env(run: WorkerRun, holder: str, attempt: int, fence: int) -> list[dict[str, str]]:
    s = run.status
    env = {
        c.ENV_RUN: run.metadata.name,
        c.ENV_NAMESPACE: run.metadata.namespace,
        c.ENV_RUN_UID: run.metadata.uid,
        c.ENV_HOLDER: holder,
        c.ENV_FENCE: str(fence),
        c.ENV_ATTEMPT: str(attempt),
        c.ENV_LEASE_DURATION: str(run.spec.lease.duration_seconds),
        c.ENV_RENEW_INTERVAL: str(run.spec.lease.renew_interval_seconds),
        **payload_env(run),
        c.ENV_IDEMPOTENCY_KEY: run.idempotency_key,
        # The attempt's trace (W3C), derived from uid, attempt and fence: the worker's spans join it.
        tracecontext.ENV_TRACEPARENT: tracecontext.attempt_traceparent(run.metadata.uid or "", attempt, fence),
    }
    if s.checkpoint is not None:
        env[c.ENV_CHECKPOINT] = s.checkpoint.cursor
    if s.review is not None and s.review.feedback:
        env[c.ENV_REVIEW_FEEDBACK] = s.review.feedback  # why the last result was denied
    return [{"name": k, "value": v} for k, v in env.items()]


def build_pod(run: WorkerRun, name: str, attempt: int, fence: int, holder: str,
              shared: bool = False) -> dict[str, Any]:
    template = copy.deepcopy(run.spec.template or {})
    meta = template.get("metadata", {}) or {}
    spec = template.get("spec", {}) or {}
    record = next((a for a in run.status.attempts if a.attempt == attempt), None)
    admission = record.admission if record is not None else None
    if admission is not None:
        # Where Kueue admitted the attempt: its flavor's node labels and tolerations, and what
        # admission checks added (Tether's own labels and annotations stay Tether's).
        if admission.node_selector:
            spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **admission.node_selector}
        if admission.tolerations:
            spec["tolerations"] = [*(spec.get("tolerations") or []), *admission.tolerations]
        meta = {"labels": {**(meta.get("labels") or {}), **admission.labels},
                "annotations": {**(meta.get("annotations") or {}), **admission.annotations}}
    labels = {**(meta.get("labels") or {}), **run_labels(run), c.LABEL_ATTEMPT: str(attempt)}
    annotations = {**(meta.get("annotations") or {}), c.ANN_FENCE: str(fence)}
    # Retries are attempts with new fences, never container restarts under the same one.
    spec["restartPolicy"] = "Never"
    spec["serviceAccountName"] = worker_service_account(run, shared)
    env = worker_env(run, holder, attempt, fence)
    # Both payload variables are Tether's: a template's own would shadow the real payload.
    ours = {e["name"] for e in env} | {c.ENV_PAYLOAD, c.ENV_PAYLOAD_FROM}
    for container in spec.get("containers", []):
        container["env"] = [e for e in container.get("env", []) or [] if e.get("name") not in ours] + env
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": run.metadata.namespace, "labels": labels,
                     "annotations": annotations, "ownerReferences": [owner_ref(run)],
                     "finalizers": [c.POD_FINALIZER]},
        "spec": spec,
    }
