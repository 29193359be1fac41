"""How a worker reaches Tether: the Kubernetes API (pods) or the gateway (anywhere).

Both give the same two operations, so WorkerRun's logic (self-fencing, signals,
failure classes) is one piece of code:
  renew(checkpoint, usage, requests) -> Renewal   one conditional lease renewal
  publish(field, value)    -> bool        one fenced status write (False: rejected)
Both raise httpx.HTTPError when there is no answer (ownership unknown, not lost).
What is written, and when a Lease counts as ours, comes from tether.protocol,
which the gateway uses too: the two transports cannot drift apart.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generator, Mapping, Protocol, TypeVar

import httpx
from httpx import USE_CLIENT_DEFAULT

from tether import protocol
from tether.api import constants as c
from tether.api.models import GateDecision, Signals, Usage
from tether.kube import config as kubeconfig
from tether.kube.paths import lease_path, run_path
from tether.worker.errors import ResultInvalid

T = TypeVar("T")
# The approvals this attempt asked for (request_approval), by name: every renewal carries them all.
Requests = Mapping[str, protocol.ApprovalRequest]


@dataclass(frozen=True)
class Renewal:
    ok: bool
    lost: bool = False
    why: str = ""
    signals: Signals | None = None


class Transport(Protocol):
    def renew(self, checkpoint: str | None, usage: Usage | None,
              requests: Requests | None = None) -> Renewal: ...

    def publish(self, field: str, value: dict[str, Any]) -> bool: ...

    def recorded(self, field: str, value: dict[str, Any]) -> bool: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Call:
    """One request of a transport operation, made by whichever client drives it."""

    method: str
    path: str
    json: Any = None
    headers: dict[str, str] | None = None
    timeout: float | None = None  # None: the client's (T)


# An operation without I/O: it yields the requests it needs, is sent each answer, returns its outcome.
Steps = Generator[Call, httpx.Response, T]


class KubeSteps:
    """The pod worker's path — a resourceVersion-conditional Lease update, a fenced JSON patch —
    as steps without I/O, so a blocking worker (KubeTransport) and an asyncio fleet of simulated
    workers (AsyncKubeTransport, benchmarks) run the same protocol code."""

    def __init__(self, namespace: str, name: str, holder: str, fence: int, run_uid: str | None = None) -> None:
        self.namespace, self.name, self.holder, self.fence = namespace, name, holder, fence
        self.run_uid = run_uid  # the Lease and run must be this run's, not a re-created namesake's
        self._lease: dict[str, Any] | None = None

    def _get_lease(self) -> Steps[dict[str, Any] | Renewal]:
        """The Lease, or, when the answer brings none, what that means: gone (lost), or a 200 that is
        not a Lease (unconfirmed, docs/protocol.md §5.2). No answer, or a refusal, raises."""
        resp = yield Call("GET", lease_path(self.namespace, self.name))
        if resp.status_code == 404:
            return Renewal(ok=False, lost=True, why="the lease is gone")
        resp.raise_for_status()
        lease = protocol.parse_lease(resp.content)
        return lease if lease is not None else _not_a_lease("the lease read", resp)

    def _is_mine(self, lease: dict[str, Any] | None) -> bool:
        return protocol.holds(lease, self.holder, self.fence, self.run_uid)

    def renew_steps(self, checkpoint: str | None, usage: Usage | None, requests: Requests | None = None,
                    retry_conflict: bool = True) -> Steps[Renewal]:
        if self._lease is None:
            read = yield from self._get_lease()
            if isinstance(read, Renewal):
                return read
            self._lease = read
        lease = self._lease
        if not self._is_mine(lease):
            return Renewal(ok=False, lost=True, why="the lease names another holder or fence")
        asked = {c.ANN_REQUESTS: protocol.requests_annotation(requests)} if requests else None
        body = protocol.renewal(lease, dt.datetime.now(dt.timezone.utc), checkpoint=checkpoint, usage=usage,
                                extra_annotations=asked)
        resp = yield Call("PUT", lease_path(self.namespace, self.name), json=body)
        if resp.status_code == 200:
            renewed = protocol.parse_lease(resp.content)
            if renewed is None or not self._is_mine(renewed):
                # Not the answer to this renewal (a proxy's page, a Status): it confirms nothing and
                # denies nothing. The last Lease stays; if this PUT landed, the next one conflicts
                # and re-reads.
                return _not_a_lease("the renewal", resp)
            self._lease = renewed
            return Renewal(ok=True, signals=protocol.lease_signals(renewed))
        if resp.status_code == 409:
            # Re-read: still our holder and fence means someone touched the lease harmlessly
            # (the operator updating the signals); retry once.
            read = yield from self._get_lease()
            if isinstance(read, Renewal):
                return read  # unconfirmed: the last Lease stays (§5.2); or gone
            self._lease = read
            if self._is_mine(self._lease) and retry_conflict:
                return (yield from self.renew_steps(checkpoint, usage, requests, retry_conflict=False))
            if not self._is_mine(self._lease):
                return Renewal(ok=False, lost=True, why="renewal conflicted and the lease is no longer ours")
            return Renewal(ok=False, why="renewal conflicted twice")
        if resp.status_code == 404:
            return Renewal(ok=False, lost=True, why="the lease is gone")
        if fenced_by_policy(resp):
            return Renewal(ok=False, lost=True, why=f"the API server's fencing policy refused: {resp.text[:200]}")
        return Renewal(ok=False, why=f"renewal refused: {resp.status_code} {resp.text[:200]}")

    def publish_steps(self, field: str, value: dict[str, Any]) -> Steps[bool]:
        patch = protocol.fenced_patch(self.holder, self.fence, field, value, self.run_uid)
        resp = yield Call("PATCH", run_path(self.namespace, self.name) + "/status", json=patch,
                          headers=protocol.JSON_PATCH, timeout=protocol.PUBLICATION_TIMEOUT)
        # 422 without causes: a `test` failed, the run's uid, fence or holder moved on; 403 from the
        # fencing policy: the same, said by the API server itself. 422 with causes: a bad value.
        if protocol.too_large(resp.status_code, resp.content):  # 413, or etcd's 500: never stored
            raise ResultInvalid(f"the {field} is too large: {_status_message(resp)}")
        if resp.status_code == 422:
            causes = protocol.invalid_causes(resp.text)
            if protocol.refuses_value(causes, field):
                raise ResultInvalid(f"the API server refused the {field}: {_status_message(resp)}", causes)
        return _published(resp, refused=resp.status_code in (404, 409, 422) or fenced_by_policy(resp))

    def recorded_steps(self, field: str, value: dict[str, Any]) -> Steps[bool]:
        resp = yield Call("GET", run_path(self.namespace, self.name), timeout=protocol.PUBLICATION_TIMEOUT)
        if resp.status_code == 404:
            return False
        resp.raise_for_status()
        run = resp.json()
        if self.run_uid is not None and (run.get("metadata") or {}).get("uid") != self.run_uid:
            return False
        return protocol.publication_recorded(run, self.holder, self.fence, field, value)


def drive(steps: Steps[T], send: Callable[[Call], httpx.Response]) -> T:
    """Runs an operation's steps with a blocking client."""
    try:
        call = next(steps)
        while True:
            call = steps.send(send(call))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def drive_async(steps: Steps[T], send: Callable[[Call], Awaitable[httpx.Response]]) -> T:
    """Runs an operation's steps with an asyncio client."""
    try:
        call = next(steps)
        while True:
            call = steps.send(await send(call))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


class KubeTransport(KubeSteps):
    """The pod worker's transport, with its own blocking client."""

    def __init__(self, namespace: str, name: str, holder: str, fence: int, cfg: kubeconfig.KubeConfig,
                 timeout: float, run_uid: str | None = None) -> None:
        super().__init__(namespace, name, holder, fence, run_uid)
        self._http = cfg.sync_client(timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def _send(self, call: Call) -> httpx.Response:
        return self._http.request(call.method, call.path, json=call.json, headers=call.headers,
                                  timeout=call.timeout if call.timeout is not None else USE_CLIENT_DEFAULT)

    def renew(self, checkpoint: str | None, usage: Usage | None, requests: Requests | None = None) -> Renewal:
        return drive(self.renew_steps(checkpoint, usage, requests), self._send)

    def publish(self, field: str, value: dict[str, Any]) -> bool:
        return drive(self.publish_steps(field, value), self._send)

    def recorded(self, field: str, value: dict[str, Any]) -> bool:
        return drive(self.recorded_steps(field, value), self._send)


class AsyncKubeTransport(KubeSteps):
    """The same transport on a shared asyncio client: one process can play thousands of workers."""

    def __init__(self, namespace: str, name: str, holder: str, fence: int, http: httpx.AsyncClient,
                 run_uid: str | None = None) -> None:
        super().__init__(namespace, name, holder, fence, run_uid)
        self._http = http

    async def _send(self, call: Call) -> httpx.Response:
        return await self._http.request(call.method, call.path, json=call.json, headers=call.headers,
                                        timeout=call.timeout if call.timeout is not None else USE_CLIENT_DEFAULT)

    async def renew(self, checkpoint: str | None, usage: Usage | None, requests: Requests | None = None) -> Renewal:
        return await drive_async(self.renew_steps(checkpoint, usage, requests), self._send)

    async def publish(self, field: str, value: dict[str, Any]) -> bool:
        return await drive_async(self.publish_steps(field, value), self._send)

    async def recorded(self, field: str, value: dict[str, Any]) -> bool:
        return await drive_async(self.recorded_steps(field, value), self._send)


class GatewayTransport:
    """The external worker's path: the same operations as JSON calls to the Tether gateway."""

    def __init__(self, base_url: str, namespace: str, name: str, token: str, holder: str, fence: int,
                 timeout: float, verify: Any = True, worker_id: str | None = None,
                 run_uid: str | None = None) -> None:
        self.holder, self.fence, self.run_uid = holder, fence, run_uid or None
        # Every call names the attempt and, when the claim named one, the worker: the gateway
        # accepts calls only from the identity (and worker) that claimed the attempt.
        self._fenced: dict[str, Any] = {"holder": holder, "fence": fence}
        if worker_id:
            self._fenced["workerId"] = worker_id
        if run_uid:
            self._fenced["runUid"] = run_uid
        self._prefix = f"/api/v1/namespaces/{namespace}/workerruns/{name}"
        self._http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"},
                                  timeout=timeout, verify=verify)
        self.tool_claim: dict[str, Any] | None = None

    def close(self) -> None:
        self._http.close()

    def renew(self, checkpoint: str | None, usage: Usage | None, requests: Requests | None = None) -> Renewal:
        body: dict[str, Any] = dict(self._fenced)
        if requests:
            body["requests"] = [{"name": r.name, "details": r.details,
                                 **({"timeoutSeconds": r.timeout_seconds} if r.timeout_seconds is not None else {})}
                                for r in requests.values()]
        if checkpoint is not None:
            body["checkpoint"] = checkpoint
        if usage is not None:
            body["usage"] = {"cents": usage.cents, "tokens": usage.tokens}
        resp = self._http.post(f"{self._prefix}/heartbeat", json=body)
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

    def publish(self, field: str, value: dict[str, Any]) -> bool:
        op, body = ("complete", {"result": value}) if field == "result" else ("fail", {"error": value})
        resp = self._http.post(f"{self._prefix}/{op}", json={**self._fenced, **body}, timeout=protocol.PUBLICATION_TIMEOUT)
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

    def recorded(self, field: str, value: dict[str, Any]) -> bool:
        return False  # the gateway answers a repeated publication of an accepted value with 200


def _not_a_lease(what: str, resp: httpx.Response) -> Renewal:
    return Renewal(ok=False, why=f"{what} answered {resp.status_code} without this attempt's Lease: {resp.text[:200]}")


def fenced_by_policy(resp: httpx.Response) -> bool:
    """A 403 from Tether's admission policy (the write is not this attempt's to make), as opposed
    to RBAC's 403 (a misconfigured worker identity), which says nothing about ownership."""
    return resp.status_code == 403 and "ValidatingAdmissionPolicy" in resp.text and "tether-worker" in resp.text


def _published(resp: httpx.Response, refused: bool) -> bool:
    """True: published. False: refused for good (the attempt is not ours). Anything else raises
    httpx.HTTPStatusError, which the SDK retries until its lease deadline (an answer that says
    nothing about ownership, such as 503)."""
    if resp.status_code == 200:
        return True
    if refused:
        return False
    resp.raise_for_status()
    return False


def _json(resp: httpx.Response) -> Any:
    """The answer's JSON; None when it is not JSON (a proxy in between may answer with anything, and
    that must not break the heartbeat)."""
    try:
        return resp.json()
    except ValueError:
        return None


def error_body(resp: httpx.Response) -> dict[str, Any]:
    """The gateway's error envelope `{"error": {...}}`; empty when the answer is not one."""
    doc = _json(resp)
    error = doc.get("error") if isinstance(doc, dict) else None
    return error if isinstance(error, dict) else {}


def _status_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("message", ""))[:500]
    except (ValueError, AttributeError):
        return resp.text[:500]


def _message(resp: httpx.Response) -> str:
    return str(error_body(resp).get("message", ""))


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
