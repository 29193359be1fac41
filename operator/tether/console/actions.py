"""What a person does to a run, for `kubectl tether` and the console alike: the control switches
(stop, suspend, resume) and a decision on a gate, which names the run's UID, the attempt of the
pending request and the approver.

The approver is whoever the API server says the caller is (SelfSubjectReview): the admission
policy accepts no other name, so asking is the only way to get it right for every kind of user.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx

from tether.kube.client import MERGE_PATCH, server_says
from tether.kube.paths import approval_path, run_path, self_subject_review_path

CONTROLS: dict[str, dict[str, bool]] = {"stop": {"stop": True}, "suspend": {"suspend": True},
                                        "resume": {"suspend": False}}


class ActionError(Exception):
    """Nothing was changed or recorded; the message says why (the API server's words where it refused).
    `server` is the API server's refusal as kubectl words it, when it was one (the plugin prints that)."""

    def __init__(self, message: str, server: str | None = None) -> None:
        super().__init__(message)
        self.server = server

    @classmethod
    def refused(cls, resp: httpx.Response, prefix: str = "") -> "ActionError":
        return cls(prefix + _message(resp), server=server_says(resp.status_code, resp.text))


class Replaced(ActionError):
    """The run of that name is not the one the caller named by UID: deleted and re-created since."""


@dataclass(frozen=True)
class Recorded:
    name: str  # the WorkerRunApproval's
    run: dict[str, Any]  # the run as read just before
    gate: str
    decision: str
    attempt: int
    approver: str
    request: dict[str, Any]  # the pending gate decided, as the run's status showed it


def normalize_gate(gate: str) -> str:
    """`start`/`result` mean the gates; a request's name is lower case, so it cannot be those."""
    return {"start": "Start", "result": "Result"}.get(gate.lower(), gate)


def pending_requests(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's gates awaiting a person, oldest first: status.review.requests without a decision.

    An operator that predates status.review.requests still holds a gated run in AwaitingApproval:
    that run is shown as one pending Start request opened at its creation."""
    status = run.get("status") or {}
    requests = (status.get("review") or {}).get("requests") or []
    pending = [r for r in requests if not r.get("decision")]
    if status.get("phase") == "AwaitingApproval" and not any(r.get("gate") == "Start" for r in requests):
        pending.insert(0, {"gate": "Start", "attempt": 0, "requestedAt": run["metadata"].get("creationTimestamp")})
    return sorted(pending, key=lambda r: r.get("requestedAt") or "")


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("message", resp.text))
    except ValueError:
        return resp.text


async def control(http: httpx.AsyncClient, ns: str, name: str, command: str, uid: str | None = None) -> None:
    """stop (spec.stop: the kill switch), suspend or resume (spec.suspend): a merge patch of the spec.

    With `uid`, the patch carries it as metadata.uid, a precondition: the API server answers 409
    when the run of that name is another object (a namesake created since the caller looked)."""
    patch: dict[str, Any] = {"spec": CONTROLS[command]}
    if uid is not None:
        patch["metadata"] = {"uid": uid}
    resp = await http.patch(run_path(ns, name), json=patch, headers=MERGE_PATCH)
    if resp.status_code == 409 and uid is not None:
        raise Replaced(f"workerrun {ns}/{name} was deleted and re-created since: {_message(resp)}")
    if resp.status_code >= 400:
        raise ActionError.refused(resp)


async def whoami(http: httpx.AsyncClient) -> str:
    me = await http.post(self_subject_review_path(),
                         json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    if me.status_code >= 400:
        raise ActionError.refused(me, "who am I: ")
    return str(me.json()["status"]["userInfo"]["username"])


async def record_decision(http: httpx.AsyncClient, ns: str, name: str, gate: str, decision: str, reason: str,
                          attempt: int | None = None, uid: str | None = None) -> Recorded:
    """Creates a WorkerRunApproval naming the run's UID and the attempt of its pending request.

    `attempt` picks among pending requests of the same gate; unset, the newest is decided. `uid`,
    if given, must be the run's: a decision made looking at one run never lands on a namesake. The gate
    must be pending: a decision on nothing would be recorded and never count. The approval is owned
    by the run (no blocking owner reference), so it lives as long as the run and no longer."""
    gate = normalize_gate(gate)
    resp = await http.get(run_path(ns, name))
    if resp.status_code >= 400:
        raise ActionError.refused(resp, f"workerrun {ns}/{name}: ")
    run = resp.json()
    if uid is not None and run["metadata"]["uid"] != uid:
        raise Replaced(f"workerrun {ns}/{name} was deleted and re-created since (uid {run['metadata']['uid']}, "
                       f"not {uid}); nothing recorded, reload to see the new one")
    pending = [r for r in pending_requests(run)
               if r.get("gate") == gate and (attempt is None or r.get("attempt") == attempt)]
    if not pending:
        phase = (run.get("status") or {}).get("phase") or "new"
        waiting = ", ".join(f"{r.get('gate')} (attempt {r.get('attempt')})" for r in pending_requests(run))
        raise ActionError(f"workerrun {ns}/{name} ({phase}) has no pending {gate} gate"
                          + (f" of attempt {attempt}" if attempt is not None else "")
                          + (f"; pending: {waiting}" if waiting else "; nothing to decide"))
    attempt = int(pending[-1].get("attempt") or 0)
    user = await whoami(http)
    stem = re.sub(r"[^a-z0-9-]+", "-", f"{name[:40]}-{gate.lower()[:10]}").strip("-")
    uid = run["metadata"]["uid"]
    spec: dict[str, Any] = {"runRef": {"name": name, "uid": uid}, "gate": gate, "attempt": attempt,
                            "decision": decision, "reason": reason, "approver": user}
    body = {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunApproval",
            "metadata": {"generateName": f"{stem}-", "labels": {"tether.dev/run": name},
                         "ownerReferences": [{"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
                                              "name": name, "uid": uid}]},
            "spec": spec}
    created = await http.post(approval_path(ns), json=body)
    if created.status_code >= 400:
        raise ActionError.refused(created)
    return Recorded(name=created.json()["metadata"]["name"], run=run, gate=gate, decision=decision,
                    attempt=attempt, approver=user, request=pending[-1])
