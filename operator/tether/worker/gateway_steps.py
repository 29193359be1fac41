"""The external worker's path (docs/protocol.md §6) as steps without I/O: claim, heartbeat,
complete and fail as JSON calls to the Tether gateway, so the blocking and the asyncio SDK send the
same requests and read each answer alike."""

from __future__ import annotations

from typing import Any

from tether import protocol
from tether.api.models import GateDecision, Signals, Usage
from tether.children.bodies import Parent
from tether.worker.errors import (ClaimRefused, LeaseLost, ResultInvalid, SpawnConflict, SpawnRefused,
                                  TetherWorkerError)
from tether.worker.steps import Call, Renewal, Requests, Steps, _message, _published, error_body


def runs_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/workerruns/{name}"


def claim_steps(namespace: str, name: str, worker_id: str | None = None) -> Steps[dict[str, Any]]:
    """The claim: the gateway's reply (holder, fence, lease, payload, ...).

    Raises ClaimRefused (with the HTTP status: 402 budget, 409 held or nothing open, ...);
    TetherWorkerError when a 200 is not the gateway's claim reply; httpx.HTTPError on no answer."""
    resp = yield Call("POST", f"{runs_path(namespace, name)}/claim", json={"workerId": worker_id} if worker_id else {})
    if resp.status_code != 200:
        raise ClaimRefused(resp.status_code, error_body(resp))
    doc = protocol.claim_reply(resp.content)
    if doc is None:
        # Something in between answered (a proxy's page or `{}`): not a refusal, and the claim
        # may have landed, which the same claimant's next claim is answered alike for.
        raise TetherWorkerError(f"the claim's 200 is not the gateway's claim reply (claiming again is safe): "
                                f"{resp.text[:200]}")
    return doc


class GatewaySteps:
    """One claimed attempt's calls. The client that drives them carries the bearer token and the
    gateway's base URL."""

    def __init__(self, namespace: str, name: str, holder: str, fence: int, worker_id: str | None = None,
                 run_uid: str | None = None) -> None:
        self.holder, self.fence, self.run_uid = holder, fence, run_uid or None
        # Every call names the attempt and, when the claim named one, the worker: the gateway
        # accepts calls only from the identity (and worker) that claimed the attempt.
        self._fenced: dict[str, Any] = {"holder": holder, "fence": fence}
        if worker_id:
            self._fenced["workerId"] = worker_id
        if run_uid:
            self._fenced["runUid"] = run_uid
        self._prefix = runs_path(namespace, name)
        self.name = name
        self.tool_claim: dict[str, Any] | None = None

    def renew_steps(self, checkpoint: str | None, usage: Usage | None,
                    requests: Requests | None = None) -> Steps[Renewal]:
        body: dict[str, Any] = dict(self._fenced)
        if requests:
            body["requests"] = [{"name": r.name, "details": r.details,
                                 **({"timeoutSeconds": r.timeout_seconds} if r.timeout_seconds is not None else {})}
                                for r in requests.values()]
        if checkpoint is not None:
            body["checkpoint"] = checkpoint
        if usage is not None:
            body["usage"] = {"cents": usage.cents, "tokens": usage.tokens}
        resp = yield Call("POST", f"{self._prefix}/heartbeat", json=body)
        if resp.status_code == 200:
            doc = protocol.gateway_reply(resp.content, self.holder, self.fence, self.run_uid)
            if doc is None:
                # Only the gateway's reply for this attempt confirms: any other 200 (a proxy's page,
                # its `{}`) came from something in between and says nothing about the lease.
                return Renewal(ok=False, why="heartbeat answered 200 without the gateway's reply for this attempt: "
                                             f"{resp.text[:200]}")
            self.tool_claim = doc.get("toolClaim") or self.tool_claim
            return Renewal(ok=True, signals=gateway_signals(doc, usage))
        if resp.status_code in (404, 410) or error_body(resp).get("code") in ("NotClaimant", "HeldByAnother"):
            return Renewal(ok=False, lost=True, why=_message(resp) or "stale fence")
        return Renewal(ok=False, why=f"heartbeat refused: {resp.status_code} {_message(resp) or resp.text[:200]}")

    def publish_steps(self, field: str, value: dict[str, Any]) -> Steps[bool]:
        op, body = ("complete", {"result": value}) if field == "result" else ("fail", {"error": value})
        resp = yield Call("POST", f"{self._prefix}/{op}", json={**self._fenced, **body},
                          timeout=protocol.PUBLICATION_TIMEOUT)
        if resp.status_code == 413:
            # BodyTooLarge (over the gateway's 1 MiB) or ResultTooLarge (the run would outgrow what
            # the Kubernetes API stores): the message says which.
            raise ResultInvalid(f"the {field} is too large: {_message(resp)}")
        if resp.status_code == 422:  # the gateway refused the body or the API server the value
            error = error_body(resp)
            field_name = error.get("field")
            raise ResultInvalid(f"the gateway refused the {field}: {error.get('message', resp.text[:200])}",
                                [{"field": field_name, "message": error.get("message")}] if field_name else [])
        refused = resp.status_code in (404, 409, 410) or error_body(resp).get("code") == "NotClaimant"
        return _published(resp, refused)

    def recorded_steps(self, field: str, value: dict[str, Any]) -> Steps[bool]:
        # The gateway answers a repeated publication of an accepted value with 200: nothing to read.
        return False
        yield  # pragma: no cover - makes this a generator like the others


    # --- child runs: the gateway builds and reads them for this attempt (docs/protocol.md §6.2) ---

    def parent_steps(self) -> Steps[Parent]:
        if self.run_uid is None:
            raise TetherWorkerError("the claim named no runUid: this gateway is too old to spawn child runs")
        return Parent.by_name(self.name, self.run_uid)
        yield  # pragma: no cover - makes this a generator like the others

    def spawn_steps(self, key: str, generation: int, spec: dict[str, Any], body: dict[str, Any]) -> Steps[dict[str, Any]]:
        """The child for key and generation, made now or found (the gateway builds the body itself)."""
        resp = yield Call("POST", f"{self._prefix}/spawn",
                          json={**self._fenced, "key": key, "generation": generation, "spec": spec})
        code = error_body(resp).get("code")
        # 422: the API server's refusal (SpawnRefused), or the gateway's of the spec; 403 (but
        # NotClaimant, which is lost): RBAC does not let this identity `spawn` for the run.
        if resp.status_code == 422 or (resp.status_code == 403 and code != "NotClaimant"):
            raise SpawnRefused(f"the gateway refused child key {key!r}: {_message(resp) or resp.text[:200]}")
        if resp.status_code == 409 and code == "SpawnConflict":
            raise SpawnConflict(_message(resp))
        return self._child(resp, f"spawn of {key!r}")

    def read_run_steps(self, name: str) -> Steps[dict[str, Any] | None]:
        resp = yield Call("POST", f"{self._prefix}/child", json={**self._fenced, "name": name})
        if resp.status_code == 404 and error_body(resp).get("code") == "ChildNotFound":
            return None
        return self._child(resp, f"read of child {name}")

    def _child(self, resp: Any, what: str) -> dict[str, Any]:
        if resp.status_code in (404, 410) or error_body(resp).get("code") in ("NotClaimant", "HeldByAnother"):
            raise LeaseLost(f"the gateway refused the {what}: {_message(resp) or 'stale fence'}")
        if resp.status_code != 200:
            raise TetherWorkerError(f"the gateway answered the {what} {resp.status_code}: "
                                    f"{_message(resp) or resp.text[:200]}")
        child = protocol.child_reply(resp.content)
        if child is None:
            raise TetherWorkerError(f"the {what}'s 200 is not the gateway's reply: {resp.text[:200]}")
        return child


def gateway_signals(doc: dict[str, Any], usage: Usage | None) -> Signals:
    """The gateway's flat reply as the SDK's signals (caps counted against the reported usage)."""
    signals = protocol.signals_from_remaining(bool(doc.get("stop")), bool(doc.get("paused")), doc.get("endsAt"),
                                              doc.get("capRemainingCents"), doc.get("capRemainingTokens"), usage)
    if doc.get("yield") is True and signals.stop:
        signals.yield_ = True
        signals.stop_by = protocol.parse_time(doc["stopBy"]) if isinstance(doc.get("stopBy"), str) else None
    decisions = doc.get("decisions")
    if isinstance(decisions, dict) and decisions:
        try:
            signals.decisions = {k: GateDecision.model_validate(v) for k, v in decisions.items()}
        except ValueError:
            pass  # a malformed reply decides nothing; the next heartbeat asks again
    return signals
