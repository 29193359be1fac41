"""The worker protocol's operations as steps without I/O (docs/protocol.md §5, §6).

An operation is a generator: it yields the requests (Call) it needs, is sent each answer (or has
each failure thrown in), and returns its outcome. Whoever drives it does the I/O — a blocking
client (WorkerRun, KubeTransport), an asyncio one (AsyncWorkerRun, the benchmarks' fleet) — so
every flavour of worker runs the same protocol code. What is written, and when a Lease counts as
ours, comes from tether.protocol, which the gateway uses too.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generator, Mapping, TypeVar

import httpx

from tether import protocol
from tether.api import constants as c
from tether.api.models import Signals, Usage
from tether.children.bodies import Parent
from tether.kube.paths import lease_path, run_path
from tether.worker.errors import LeaseLost, ResultInvalid, SpawnRefused

T = TypeVar("T")
Y = TypeVar("Y")
# The approvals this attempt asked for (request_approval), by name: every renewal carries them all.
Requests = Mapping[str, protocol.ApprovalRequest]


@dataclass(frozen=True)
class Renewal:
    ok: bool
    lost: bool = False
    why: str = ""
    signals: Signals | None = None


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

    def parent_steps(self) -> Steps[Parent]:
        """This run as its children name it, read from the run itself."""
        got = yield from self.read_run_steps(self.name)
        if got is None:
            raise LeaseLost(f"run {self.namespace}/{self.name} is gone")
        return Parent.of(got)

    def spawn_steps(self, key: str, generation: int, spec: dict[str, Any], body: dict[str, Any]) -> Steps[dict[str, Any]]:
        """Creates a child run (docs/children.md), or reads the one of that name that exists. A
        refusal (an admission policy, the schema) raises SpawnRefused with the API server's word.
        The API server takes the whole `body` (the gateway builds its own from key, generation and spec)."""
        path = run_path(self.namespace)
        for _ in range(3):
            resp = yield Call("POST", path, json=body)
            if resp.status_code == 201:
                return dict(resp.json())
            if resp.status_code in (400, 403, 422):
                raise SpawnRefused(f"the API server refused child run {body['metadata']['name']}: "
                                   f"{_status_message(resp)}")
            if resp.status_code != 409:
                resp.raise_for_status()
                raise httpx.HTTPStatusError(f"unexpected answer {resp.status_code}", request=resp.request,
                                            response=resp)
            got = yield from self.read_run_steps(body["metadata"]["name"])
            if got is not None:
                return got  # made before: whose and for what, the caller judges
        raise SpawnRefused(f"child run {body['metadata']['name']} kept being deleted as it was made")

    def read_run_steps(self, name: str) -> Steps[dict[str, Any] | None]:
        resp = yield Call("GET", run_path(self.namespace, name))
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return dict(resp.json())

    def recorded_steps(self, field: str, value: dict[str, Any]) -> Steps[bool]:
        resp = yield Call("GET", run_path(self.namespace, self.name), timeout=protocol.PUBLICATION_TIMEOUT)
        if resp.status_code == 404:
            return False
        resp.raise_for_status()
        run = resp.json()
        if self.run_uid is not None and (run.get("metadata") or {}).get("uid") != self.run_uid:
            return False
        return protocol.publication_recorded(run, self.holder, self.fence, field, value)


def drive(steps: Generator[Y, Any, T], perform: Callable[[Y], Any]) -> T:
    """Runs steps with blocking I/O: each answer is sent in, each failure thrown in, where the steps
    may handle it (a publication retries no answer) or let it propagate (a renewal's no answer)."""
    try:
        step = next(steps)
        while True:
            try:
                answer = perform(step)
            except Exception as exc:  # noqa: BLE001 - the steps decide; unhandled, it propagates
                step = steps.throw(exc)
            else:
                step = steps.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def drive_async(steps: Generator[Y, Any, T], perform: Callable[[Y], Awaitable[Any]]) -> T:
    """The same with asyncio I/O. A cancellation (a BaseException) is not thrown in: it leaves the
    steps where they stood, as a blocking client's process ending would."""
    try:
        step = next(steps)
        while True:
            try:
                answer = await perform(step)
            except Exception as exc:  # noqa: BLE001 - as in drive()
                step = steps.throw(exc)
            else:
                step = steps.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


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
