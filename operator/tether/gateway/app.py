"""The gateway: JSON calls for workers outside the cluster, on the same fenced Lease and status
operations as a pod worker (one protocol, two transports), and the child runs it spawns.

POST /api/v1/namespaces/{ns}/workerruns/{name}/{claim|heartbeat|checkpoint|complete|fail|cancel|approval|spawn|child}

200 ok · 401/403 auth (403 NotClaimant: the attempt was claimed by another identity) ·
402 budget exceeded (admission first) · 404 no such run · 409 held by another / nothing to claim ·
409 AlreadyPublished: this attempt's result or error is in, a different one is refused ·
410 stale fence · 413 body too large, or a result the run cannot hold (ResultTooLarge) ·
422 malformed body (names the field) ·
503 the Kubernetes API cannot be reached, or the run or Lease kept changing (Retry-After) · every answer, errors included, is JSON:
`{"error": {"code", "message", "field"?}}`.

What is written to the Lease and the run's status, and when a Lease counts as the caller's, comes
from tether.protocol, the module the SDK's pod transport uses: the gateway translates HTTP onto
the protocol, it does not re-implement it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import httpx
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from tether import protocol, tracecontext
from tether.api import constants as c
from tether.api.models import Signals, Usage, WorkerRun
from tether.api.workerclass import effective_body
from tether.gateway import children
from tether.gateway import models as m
from tether.gateway.auth import AuthError, Authenticator, Caller
from tether.gateway.failure import Failure
from tether.gateway.openapi import openapi_document
from tether.kube import resources
from tether.kube.identity import IdentityTaken, WorkerIdentity
from tether.kube.client import ApiError, Conflict, Forbidden, Invalid, KubeClient, NotFound
from tether.kube.paths import secret_path, service_account_path, token_request_path

log = logging.getLogger("tether.gateway")

TOOL_CLAIM_SECONDS = 600  # the shortest the TokenRequest API allows; never lengthened
# A result must fit in the run's status, which etcd stores in one value (1.5 MiB by default):
# larger bodies are refused before they are read, never forwarded to the API server.
MAX_BODY_BYTES = 1024 * 1024
# Real results are shallow; deep nesting only exhausts recursion (json, pydantic, the API server).
MAX_DEPTH = 32
RETRY_AFTER_SECONDS = 5
# The status patch of a publication waits this long (its other requests the client's 5 s): a result
# of up to 1 MiB takes the API server a while on a loaded control plane, and a 503 for it would have
# the worker send the same megabyte again. With one read each before it, the call fits the worker's
# TP (30 s); conflicts that make it read again can outlast TP, and the worker's retry is then
# recognised as the same publication.
PUBLICATION_WRITE_SECONDS = 15.0
# What a namespace's and a run's name may be (Kubernetes' rules): anything else is answered 404.
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# Tool-claim Secret uids remembered per attempt; forgetting one costs one extra GET.
SECRET_CACHE = 4096


def _error(status: int, code: str, message: str, field: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if field:
        body["field"] = field
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def _unavailable(what: str) -> Failure:
    return Failure(503, "Unavailable", f"the Kubernetes API cannot be reached ({what}); retry later",
                   headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the body exceeds {limit} bytes")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it is known to exceed `limit` (never read whole): the gateway's
    calls and the console's forms alike, since either is reachable before signing in."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise BodyTooLarge(limit)
    return bytes(raw)


def _depth(doc: Any) -> int:
    """Nesting depth of a parsed JSON document, without recursion (which is what is at risk)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


@dataclass(frozen=True)
class Claimant:
    """Who claimed an attempt: the authenticated identity and, optionally, which of its processes.

    Stored in the Lease annotation `tether.dev/claimed-by`. For a given holder and fence it is
    written once (by the claim's compare-and-swap) and never changed: a new grant changes the
    holder and fence and drops it. So a later call that finds the caller's claim on the Lease
    still holding its fence may act on that attempt."""

    user: str
    uid: str
    worker: str | None = None
    legacy: str | None = None  # a claim written before claimants were JSON: "<user>[/<worker>]"

    @classmethod
    def of(cls, caller: Caller, worker: str | None) -> "Claimant":
        return cls(caller.username, caller.uid, worker or None)

    def encode(self) -> str:
        return json.dumps({"user": self.user, "uid": self.uid, "workerId": self.worker}, separators=(",", ":"),
                          sort_keys=True)

    @classmethod
    def parse(cls, raw: str | None) -> "Claimant | None":
        if not raw:
            return None
        try:
            doc = json.loads(raw)
            return cls(str(doc["user"]), str(doc.get("uid") or ""), doc.get("workerId") or None)
        except (ValueError, TypeError, KeyError):
            return cls("", "", None, legacy=raw)

    def is_claim_of(self, caller: Caller, worker: str | None) -> bool:
        """Whether a claim by `caller` (as `worker`) is this very claim (a repeated claim is idempotent)."""
        if self.legacy is not None:
            return self.legacy == caller.username + (f"/{worker}" if worker else "")
        return self.same_identity(caller) and self.worker == (worker or None)

    def same_identity(self, caller: Caller) -> bool:
        if self.legacy is not None:
            return self.legacy == caller.username or self.legacy.startswith(f"{caller.username}/")
        return self.user == caller.username and self.uid == caller.uid

    def same_worker(self, worker: str | None) -> bool:
        if self.legacy is not None:
            return worker is None or self.legacy.endswith(f"/{worker}")
        return worker is None or self.worker is None or worker == self.worker


def _names_attempt(run: WorkerRun, body: m.Fenced) -> bool:
    """Whether the run's status still names the caller's attempt (holder, fence, and the run's UID
    when the caller sent it). Revocation writes the status first and clears the Lease second, so
    the status is where a lost attempt shows first."""
    return (run.status.holder, run.status.fence) == (body.holder, body.fence) and \
        body.runUid in (None, run.metadata.uid)


def _done(run: dict[str, Any], fence: int) -> dict[str, Any]:
    """A publication's reply: the run's phase as just read or written (`Running` until the operator
    concludes the attempt, then `Succeeded`/`Failed`/...), never empty (docs/protocol.md §6.2)."""
    return {"status": (run.get("status") or {}).get("phase") or "Pending", "fence": fence}


def _lost(body: m.Fenced, claim: bool) -> Failure:
    """The answer to a call whose attempt is no longer the run's: a claim may retry on the next one."""
    if claim:
        return Failure(409, "NotClaimable", "the attempt is being granted or revoked; retry shortly")
    return Failure(410, "StaleFence", f"fence {body.fence} of {body.holder} is no longer current")


@dataclass(frozen=True)
class Renewal:
    """A Lease renewal that landed for a current attempt: the Lease as written and as it was before,
    and the run as read after the write (what the answer is built from)."""

    lease: dict[str, Any]
    before: dict[str, Any]
    run: WorkerRun


class Gateway:
    def __init__(self, kube: KubeClient, audience: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.kube = kube
        self.auth = Authenticator(kube, audience)
        self.identity = WorkerIdentity(kube)
        self.max_body_bytes = max_body_bytes
        # "<ns>/<holder>-toolclaim" -> uid of the attempt's tool-claim Secret (the operator deletes it on revocation)
        self._secrets: OrderedDict[str, str] = OrderedDict()

    # --- plumbing ------------------------------------------------------------

    async def _body(self, request: Request, model: type[BaseModel]) -> Any:
        try:
            raw = await read_body(request, self.max_body_bytes)
        except BodyTooLarge as exc:
            raise Failure(413, "BodyTooLarge", str(exc)) from exc
        try:
            doc = json.loads(raw or b"{}")
        except RecursionError as exc:
            raise Failure(422, "MalformedBody", f"the body is nested deeper than {MAX_DEPTH} levels") from exc
        except ValueError as exc:
            raise Failure(422, "MalformedBody", f"the body is not JSON: {exc}") from exc
        if _depth(doc) > MAX_DEPTH:
            raise Failure(422, "MalformedBody", f"the body is nested deeper than {MAX_DEPTH} levels")
        try:
            # What the API server could not store either: NaN or Infinity, a lone surrogate (\ud800).
            json.dumps(doc, ensure_ascii=False, allow_nan=False).encode()
        except (ValueError, UnicodeEncodeError) as exc:
            raise Failure(422, "MalformedBody", f"the body holds what JSON cannot carry: {exc}") from exc
        try:
            return model.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "(body)"
            raise Failure(422, "MalformedBody", f"{field}: {first['msg']}", field) from exc

    async def _raw_run(self, ns: str, name: str) -> dict[str, Any]:
        try:
            return await self.kube.get_run(ns, name)
        except NotFound as exc:
            raise Failure(404, "NotFound", f"workerrun {ns}/{name} not found") from exc

    async def _run(self, ns: str, name: str) -> WorkerRun:
        # The lease it was granted under may be its class's (api/workerclass.py).
        return WorkerRun.model_validate(effective_body(await self._raw_run(ns, name)))

    async def _caller(self, request: Request, ns: str, name: str) -> Caller:
        caller = await self.auth.authenticate(request.headers.get("authorization"))
        await self.auth.authorize(caller, ns, name)
        return caller

    def _signals(self, renewed: Renewal, attempt: m.Fenced, usage: m.UsageReport | None) -> dict[str, Any]:
        """The reply to a call that renewed `attempt`: it names the attempt, so that a worker can
        tell it from any other 200 (docs/protocol.md §6.4), and carries the signals."""
        run, lease = renewed.run, renewed.lease
        sig = protocol.lease_signals(lease) or Signals()
        own = Usage(cents=usage.cents, tokens=usage.tokens) if usage else protocol.lease_usage(lease)
        cents, tokens = protocol.remaining(sig, own)
        return {
            "holder": attempt.holder, "fence": attempt.fence, "runUid": run.metadata.uid,
            "leaseExpiresAt": protocol.rfc3339(_now() + dt.timedelta(seconds=run.spec.lease.duration_seconds)),
            "stop": sig.stop, "paused": sig.paused,
            # A Kueue eviction: checkpoint and exit; the attempt is revoked at stopBy regardless.
            "yield": sig.stop and sig.yield_, "stopBy": protocol.rfc3339(sig.stop_by) if sig.stop_by else None,
            "endsAt": protocol.rfc3339(sig.ends_at) if sig.ends_at else None,
            "capRemainingCents": cents, "capRemainingTokens": tokens,
            "status": run.status.phase.value if run.status.phase else "Pending",
            "decisions": {k: v.dump() for k, v in sig.decisions.items()},
        }

    @staticmethod
    def _check_claimant(lease: dict[str, Any], caller: Caller, worker: str | None, attempt: str) -> None:
        """Only the claimant drives an attempt: a caller with `claim` RBAC on the run may claim
        an open attempt, not heartbeat, checkpoint or publish one that someone else claimed."""
        claimant = Claimant.parse(protocol.annotations(lease).get(c.ANN_CLAIMED_BY))
        if claimant is None:
            raise Failure(403, "NotClaimant", f"{attempt} has not been claimed: claim it first")
        if not claimant.same_identity(caller):
            raise Failure(403, "NotClaimant", f"{attempt} was claimed by another identity; only the claimant "
                                              "may drive it")
        if not claimant.same_worker(worker):
            raise Failure(409, "HeldByAnother", f"{attempt} was claimed by another worker of this identity")

    async def _ensure_identity(self, run: WorkerRun) -> None:
        """The run's account, Role and RoleBinding (kube/identity.py). What the API server refuses for
        good (someone's own account of that name, a quota, a policy) refuses the claim, never to be
        retried as it is, and says so on the run (a Warning Event: its attempts lapse unclaimed)."""
        try:
            await self.identity.ensure(run)
        except (IdentityTaken, Invalid, Forbidden) as exc:
            reason = "WorkerIdentityTaken" if isinstance(exc, IdentityTaken) else "WorkerIdentityRefused"
            message = exc.message if isinstance(exc, IdentityTaken) else \
                f"the API server refused the run's account {resources.tool_claim_service_account(run)}: {exc.message}"
            involved = {"metadata": {"name": run.metadata.name, "namespace": run.metadata.namespace,
                                     "uid": run.metadata.uid}}
            with contextlib.suppress(Exception):  # best effort, as every Event
                await self.kube.post_event(involved, "Warning", reason, message)
            raise Failure(409, reason, message) from None
        except Conflict as exc:  # an object made and deleted again meanwhile: busy
            raise Failure(503, "Busy", f"the run's account kept changing ({exc.message}); retry",
                          headers={"Retry-After": "1"}) from None

    async def _tool_claim(self, run: WorkerRun, holder: str, fence: int) -> dict[str, Any] | None:
        """A short-lived token of the ServiceAccount Tether made for the run (never one the run
        names), bound to a per-attempt Secret that the operator deletes on revocation (which
        invalidates every such token at once)."""
        ns, name = run.metadata.namespace, run.metadata.name
        sa = resources.tool_claim_service_account(run)
        secret = f"{holder}-toolclaim"
        key = f"{ns}/{secret}"
        try:
            uid = self._secrets.get(key)
            if uid is None:
                account = await self.kube.get_object(service_account_path(ns, sa))
                if account is None or not any(ref.get("uid") == run.metadata.uid for ref in
                                              (account.get("metadata") or {}).get("ownerReferences") or []):
                    # Not the account Tether made for this run (gone, or someone's own of that name): no
                    # tokens of it now; made again by the next heartbeat's or claim's tool claim (or
                    # the claim refused, WorkerIdentityTaken).
                    self.identity.forget(run.metadata.uid or "")
                    with contextlib.suppress(ApiError):
                        await self.identity.ensure(run)  # the run as read after this call's write
                    log.warning("tool claim withheld: the account is not the run's", extra={
                        "event": "tool_claim_foreign_account", "run": f"{ns}/{name}", "serviceAccount": sa})
                    return None
                created = await self.kube.apply(secret_path(ns), {
                    "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": {"name": secret, "namespace": ns, "labels": resources.run_labels(run),
                                 "ownerReferences": [resources.owner_ref(run)]}})
                uid = created["metadata"]["uid"]
                # Revocation may have landed since the caller's renewal: it cleared the Lease and
                # then deleted a Secret that did not exist yet. A fresh read *after* the create
                # settles it: still held means the clearing, and the operator's delete that
                # follows it, come later and will find this Secret; not held means we delete it.
                if not protocol.holds(await self.kube.get_lease(ns, name), holder, fence, run.metadata.uid):
                    await self.kube.delete_secret(ns, secret)
                    log.info("tool claim withheld: attempt revoked", extra={
                        "event": "tool_claim_revoked", "run": f"{ns}/{name}", "holder": holder, "fence": fence})
                    return None
                self._secrets[key] = uid
                while len(self._secrets) > SECRET_CACHE:
                    self._secrets.popitem(last=False)
            resp = await self.kube.create(token_request_path(ns, sa), {
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": TOOL_CLAIM_SECONDS,
                         "boundObjectRef": {"kind": "Secret", "apiVersion": "v1", "name": secret, "uid": uid}}})
        except ApiError as exc:
            # Typically the Secret is gone (revoked): every token bound to it is dead too.
            self._secrets.pop(key, None)
            log.warning("no tool claim", extra={"event": "tool_claim_failed", "run": f"{ns}/{name}",
                                                "status": exc.status})
            return None
        return {"token": resp["status"]["token"], "expiresAt": resp["status"]["expirationTimestamp"],
                "serviceAccount": sa}

    async def _renew(self, run: WorkerRun, caller: Caller, body: m.Fenced, usage: m.UsageReport | None,
                     checkpoint: str | None, claim: bool = False,
                     asks: list[m.ApprovalAsk] | None = None) -> Renewal:
        """The pod worker's conditional Lease renewal, with the claimant inside the compare-and-swap,
        judged on a read of the run made after the write.

        Every check (holder and fence, claimant, usage) is made on the very Lease object whose
        resourceVersion the PUT carries, so a concurrent claim or grant makes the PUT fail with
        409 and the checks run again on the newer object; none of them can be outdated when the
        write lands. A claim writes the claimant; every other call must come from it.
        But revocation moves the run's status before it clears the Lease, so a PUT can land
        between the two: only a read of the run after the write tells whether the attempt was
        still current when it landed. Every answer that says so, and every tool claim, rests on it."""
        ns, name = run.metadata.namespace, run.metadata.name
        attempt = f"attempt {body.holder} (fence {body.fence})"
        if not claim and not _names_attempt(run, body):
            # Already revoked: renew nothing (its usage, checkpoint and requests would be the old attempt's).
            raise _lost(body, claim)
        for _ in range(2):  # the protocol's rule: on a conflict re-read, and retry once if still ours
            lease = await self.kube.get_lease(ns, name)
            if lease is None or not protocol.holds(lease, body.holder, body.fence, body.runUid):
                raise _lost(body, claim)
            if claim:
                current = Claimant.parse(protocol.annotations(lease).get(c.ANN_CLAIMED_BY))
                if current is not None and not current.is_claim_of(caller, body.workerId):
                    raise Failure(409, "HeldByAnother", f"{attempt} is held by another worker")
            else:
                self._check_claimant(lease, caller, body.workerId, attempt)
            report = Usage(cents=usage.cents, tokens=usage.tokens) if usage is not None else None
            if report is not None:
                why = protocol.valid_report(report, protocol.lease_usage(lease))
                if why is not None:
                    raise Failure(422, "MalformedBody", f"usage: {why}", "usage")
            extra = {c.ANN_CLAIMED_BY: Claimant.of(caller, body.workerId).encode()} if claim else {}
            if asks:
                extra[c.ANN_REQUESTS] = _with_requests(lease, asks)
            updated = protocol.renewal(lease, _now(), checkpoint=checkpoint, usage=report,
                                       extra_annotations=extra or None)
            try:
                written = await self.kube.replace_lease(updated)
            except Conflict:
                continue
            after = await self._run(ns, name)
            if not _names_attempt(after, body):
                # The revocation's Lease clear, which comes after its status write, overwrites this renewal.
                log.info("renewal landed after revocation", extra={
                    "event": "renewal_revoked", "run": f"{ns}/{name}", "holder": body.holder, "fence": body.fence})
                raise _lost(body, claim)
            return Renewal(written, lease, after)
        raise Failure(503, "Busy", "the lease changed twice during the call; retry", headers={"Retry-After": "1"})

    # --- the six calls -------------------------------------------------------

    async def claim(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        caller = await self._caller(request, ns, name)
        body: m.ClaimRequest = await self._body(request, m.ClaimRequest)
        run = await self._run(ns, name)
        if run.spec.executor != "External":
            raise Failure(409, "NotExternal", f"{ns}/{name} runs in pods (executor {run.spec.executor})")
        admitted = next((x for x in run.status.conditions if x.type == c.COND_ADMITTED), None)
        if admitted is not None and admitted.status == "False":
            raise Failure(402, admitted.reason, admitted.message or "the run's budget is exhausted")
        s = run.status
        if s.holder is None:
            raise Failure(409, "NotClaimable", f"no attempt is open (phase {s.phase.value if s.phase else 'Pending'})")
        fenced = m.Fenced(holder=s.holder, fence=s.fence, workerId=body.workerId, runUid=run.metadata.uid)
        renewed = await self._renew(run, caller, fenced, None, None, claim=True)
        run, s = renewed.run, renewed.run.status
        # The run's own account, which its tool claims are minted for: made here, at the first claim,
        # rather than at every grant (a grant writes only the status and the Lease); made for the run
        # as read after the claim's write, which names this attempt (never a deleted namesake).
        await self._ensure_identity(run)
        if c.ANN_CLAIMED_BY not in protocol.annotations(renewed.before):
            log.info("claimed", extra={"event": "job_claimed", "run": f"{ns}/{name}", "attempt": s.attempt,
                                       "fence": s.fence, "holder": s.holder, "worker": body.workerId})
        return {**self._signals(renewed, fenced, None), "attempt": s.attempt,
                "leaseDurationSeconds": run.spec.lease.duration_seconds,
                "renewIntervalSeconds": run.spec.lease.renew_interval_seconds,
                "payload": run.spec.payload or {}, "checkpoint": s.checkpoint.cursor if s.checkpoint else None,
                "idempotencyKey": run.idempotency_key,
                "toolClaim": await self._tool_claim(run, fenced.holder, fenced.fence),
                "reviewFeedback": s.review.feedback if s.review is not None else None,
                # The attempt's trace context, as a pod worker finds it in TRACEPARENT.
                "traceparent": tracecontext.attempt_traceparent(run.metadata.uid or "", s.attempt, fenced.fence)}

    async def heartbeat(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        caller = await self._caller(request, ns, name)
        body: m.HeartbeatRequest = await self._body(request, m.HeartbeatRequest)
        renewed = await self._renew(await self._run(ns, name), caller, body, body.usage, body.checkpoint,
                                    asks=body.requests)
        return {**self._signals(renewed, body, body.usage),
                "toolClaim": await self._tool_claim(renewed.run, body.holder, body.fence)}

    async def approval(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        caller = await self._caller(request, ns, name)
        body: m.ApprovalRequest = await self._body(request, m.ApprovalRequest)
        ask = m.ApprovalAsk(name=body.name, details=body.details, timeoutSeconds=body.timeoutSeconds)
        renewed = await self._renew(await self._run(ns, name), caller, body, None, None, asks=[ask])
        signals = self._signals(renewed, body, None)
        if ask.name not in protocol.annotations(renewed.before).get(c.ANN_REQUESTS, ""):
            log.info("approval requested", extra={"event": "approval_requested", "run": f"{ns}/{name}",
                                                  "holder": body.holder, "fence": body.fence, "request": ask.name})
        return {**signals, "decision": signals["decisions"].get(ask.name)}

    async def checkpoint(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        caller = await self._caller(request, ns, name)
        body: m.CheckpointRequest = await self._body(request, m.CheckpointRequest)
        renewed = await self._renew(await self._run(ns, name), caller, body, body.usage, body.cursor)
        return self._signals(renewed, body, body.usage)

    async def _publish(self, request: Request, ns: str, name: str, model: type[m.Fenced], field: str) -> dict[str, Any]:
        caller = await self._caller(request, ns, name)
        body = await self._body(request, model)
        value = {"result": lambda: body.result, "error": lambda: body.error.model_dump(),
                 "cancel": lambda: {"code": "WorkerCancelled", "message": body.reason}}[field]()
        stale = Failure(410, "StaleFence", f"fence {body.fence} of {body.holder} is no longer current")
        fld = "result" if field == "result" else "error"
        lease = await self.kube.get_lease(ns, name)
        if lease is None or not protocol.holds(lease, body.holder, body.fence, body.runUid):
            recorded = await self._recorded(ns, name, body, fld, value)
            if recorded is not None:
                return _done(recorded, body.fence)  # a retry of an accepted call: its answer was lost
            self._rejected(ns, name, body)
            raise stale
        # The claimant of a holder and fence never changes (see Claimant), so checking it here and
        # publishing with the fence `test` below is as strict as one compare-and-swap of both.
        self._check_claimant(lease, caller, body.workerId, f"attempt {body.holder} (fence {body.fence})")
        # The gateway writes as the operator, whom the admission policy does not hold to "a result
        # or error, once there, is never replaced": it keeps that promise itself. It publishes only
        # onto a status with neither, compare-and-swapped on the resourceVersion it read.
        for _ in range(3):
            try:
                run = await self.kube.get_run(ns, name)
            except NotFound as exc:
                raise Failure(404, "NotFound", f"workerrun {ns}/{name} not found") from exc
            status = run.get("status") or {}
            if self._holds_publication(run, body, fld, value):
                return _done(run, body.fence)  # a retry of an accepted call
            if not _names_attempt(WorkerRun.model_validate(run), body):
                # Revoked since the Lease read (the status moves first, the Lease clear follows).
                self._rejected(ns, name, body)
                raise stale
            if status.get("result") is not None or status.get("error") is not None:
                raise Failure(409, "AlreadyPublished", f"attempt {body.holder} already published its result or "
                                                       "error; an accepted one is never replaced")
            patch = protocol.fenced_patch(body.holder, body.fence, fld, value, body.runUid,
                                          resource_version=run["metadata"]["resourceVersion"])
            try:
                written = await self.kube.patch_run_status(ns, name, patch, timeout=PUBLICATION_WRITE_SECONDS)
            except Invalid as exc:
                causes = protocol.invalid_causes(exc.body)
                if protocol.refuses_value(causes, fld):
                    # The schema refused the value: a bad request, not a stale fence.
                    raise Failure(422, "InvalidResult", f"the WorkerRun refused the {fld}: {exc.message}",
                                  field=f"status.{fld}") from exc
                continue  # a `test` failed: the status moved (any write) or the attempt did; look again
            except NotFound as exc:
                raise Failure(404, "NotFound", f"workerrun {ns}/{name} not found") from exc
            except ApiError as exc:
                if protocol.too_large(exc.status, exc.body):
                    # Under the body limit, yet the run would outgrow what etcd stores: the same
                    # value is refused every time, so a bad result like BodyTooLarge, not a 503.
                    raise Failure(413, "ResultTooLarge", f"the {fld} would make the WorkerRun larger than the "
                                                         f"Kubernetes API stores: {exc.message}",
                                  field=f"status.{fld}") from exc
                raise
            return _done(written, body.fence)
        raise Failure(503, "Busy", "the run's status changed during each of three tries; retry",
                      headers={"Retry-After": "1"})

    async def _recorded(self, ns: str, name: str, body: m.Fenced, field: str, value: Any) -> dict[str, Any] | None:
        """The run, when it already holds exactly this attempt's publication (see protocol)."""
        try:
            run = await self.kube.get_run(ns, name)
        except NotFound:
            return None
        return run if self._holds_publication(run, body, field, value) else None

    @staticmethod
    def _holds_publication(run: dict[str, Any], body: m.Fenced, field: str, value: Any) -> bool:
        """Whether this run (not a namesake) holds exactly this attempt's publication (see protocol)."""
        return body.runUid in (None, run["metadata"].get("uid")) and \
            protocol.publication_recorded(run, body.holder, body.fence, field, value)

    @staticmethod
    def _rejected(ns: str, name: str, body: m.Fenced) -> None:
        log.warning("result rejected", extra={"event": "result_rejected", "run": f"{ns}/{name}",
                                              "fence": body.fence, "holder": body.holder})

    async def complete(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        return await self._publish(request, ns, name, m.CompleteRequest, "result")

    async def fail(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        return await self._publish(request, ns, name, m.FailRequest, "error")

    async def cancel(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        return await self._publish(request, ns, name, m.CancelRequest, "cancel")

    # --- child runs (tether.gateway.children) ----------------------------------

    async def _acting(self, request: Request, ns: str, name: str, model: type[m.Fenced],
                      also: str | None = None) -> tuple[Any, dict[str, Any]]:
        """A call in the name of an attempt that neither renews nor publishes: its caller is the
        claimant of the attempt the body names, which holds the run now (its status and Lease), and
        RBAC lets it `also` do this. Returns the body and the run as read."""
        caller = await self._caller(request, ns, name)
        if also is not None:
            await self.auth.authorize(caller, ns, name, verb=also)
        body = await self._body(request, model)
        raw = await self._raw_run(ns, name)
        run = WorkerRun.model_validate(effective_body(raw))
        if run.spec.executor != "External":
            raise Failure(409, "NotExternal", f"{ns}/{name} runs in pods (executor {run.spec.executor})")
        # runUid is required here: a namesake re-created since is another run, whatever its attempt.
        if run.metadata.uid != body.runUid or not _names_attempt(run, body):
            raise _lost(body, False)
        lease = await self.kube.get_lease(ns, name)
        if lease is None or not protocol.holds(lease, body.holder, body.fence, body.runUid):
            raise _lost(body, False)
        self._check_claimant(lease, caller, body.workerId, f"attempt {body.holder} (fence {body.fence})")
        return body, raw

    async def spawn(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        # The child runs a pod the worker describes, made with the operator's rights: only an
        # identity RBAC lets `spawn` for this run may (as `claim` lets it drive the run).
        body, parent = await self._acting(request, ns, name, m.SpawnRequest, also="spawn")
        return await children.spawn(self.kube, parent, body)

    async def child(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        body, parent = await self._acting(request, ns, name, m.ChildRequest)
        return await children.read(self.kube, parent, body.name)


OPERATIONS = ("claim", "heartbeat", "checkpoint", "complete", "fail", "cancel", "approval", "spawn", "child")


def _with_requests(lease: dict[str, Any], asks: list[m.ApprovalAsk]) -> str:
    """The requests annotation with `asks` added to the attempt's earlier requests (a request
    already made keeps its first details and timeout, as the operator recorded them)."""
    try:
        known = {r.name: r for r in protocol.parse_requests(protocol.annotations(lease).get(c.ANN_REQUESTS))}
    except ValueError:
        known = {}  # only the gateway writes an External run's requests; start over rather than fail
    for ask in asks:
        why = protocol.request_refusal(ask.name, ask.details, ask.timeoutSeconds)
        if why is not None:
            raise Failure(422, "MalformedBody", f"request {ask.name!r}: {why}", "name")
        known.setdefault(ask.name, protocol.ApprovalRequest(ask.name, ask.details, ask.timeoutSeconds))
    if len(known) > protocol.MAX_REQUESTS_PER_ATTEMPT:
        raise Failure(422, "MalformedBody", f"an attempt may make at most {protocol.MAX_REQUESTS_PER_ATTEMPT} "
                                            "approval requests", "requests")
    return protocol.requests_annotation(known)

Handler = Callable[[Request, str, str], Awaitable[dict[str, Any]]]


def _answer(op: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def call(request: Request) -> Response:
        ns, name = request.path_params["namespace"], request.path_params["name"]
        if not (DNS_LABEL.fullmatch(ns) and DNS_SUBDOMAIN.fullmatch(name)):
            # Never forwarded into an API path ("..", "%2F", ...): no run can be named so.
            return _error(404, "NotFound", f"no workerrun {name!r} in namespace {ns!r}")
        try:
            return JSONResponse(await handler(request, ns, name))
        except AuthError as exc:
            return _error(exc.status, exc.code, exc.message)
        except Failure as exc:
            return _error(exc.status, exc.code, exc.message, exc.field, exc.headers)
        except ApiError as exc:
            if exc.status == 0 or exc.status == 429 or exc.status >= 500:  # 0: no answer at all
                log.warning("API unavailable", extra={"event": "gateway_api_unavailable", "op": op,
                                                      "status": exc.status})
                failure = _unavailable(f"HTTP {exc.status}" if exc.status else "no answer")
                return _error(failure.status, failure.code, failure.message, headers=failure.headers)
            log.error("API error", extra={"event": "gateway_api_error", "op": op, "status": exc.status})
            return _error(502, "UpstreamError", f"the Kubernetes API answered {exc.status}")
        except httpx.TransportError as exc:
            log.warning("API unreachable", extra={"event": "gateway_api_unavailable", "op": op,
                                                  "error": type(exc).__name__})
            failure = _unavailable(type(exc).__name__)
            return _error(failure.status, failure.code, failure.message, headers=failure.headers)
        except Exception as exc:  # noqa: BLE001 - a bug still gets a JSON answer
            return await _bug(request, exc)

    return call


async def _http_error(_: Request, exc: Exception) -> Response:
    """Starlette's own answers (unknown route 404, wrong method 405) in the error envelope."""
    assert isinstance(exc, HTTPException)
    code = {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, "HTTPError")
    return _error(exc.status_code, code, str(exc.detail), headers=dict(exc.headers or {}))


async def _bug(request: Request, exc: Exception) -> Response:
    """Anything unforeseen: logged once with its traceback (it is a bug), answered in the envelope."""
    log.error("gateway bug", exc_info=exc, extra={"event": "gateway_bug", "path": request.url.path})
    return _error(500, "InternalError", "the gateway failed; the error is logged")


def build_app(kube: KubeClient, audience: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
              mounts: Sequence[Mount] = ()) -> Starlette:
    """The gateway's routes, and `mounts` beside them (the operator mounts the web console at
    /console: the console builds on the gateway's sign-in, so the gateway does not import it)."""
    gateway = Gateway(kube, audience, max_body_bytes)

    async def openapi(_: Request) -> JSONResponse:
        return JSONResponse(openapi_document())

    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    routes = [Route(f"/api/v1/namespaces/{{namespace}}/workerruns/{{name}}/{op}", _answer(op, getattr(gateway, op)),
                    methods=["POST"]) for op in OPERATIONS]
    routes += [Route("/openapi.json", openapi, methods=["GET"]), Route("/healthz", healthz, methods=["GET"])]
    routes += mounts
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _bug})
    app.state.gateway = gateway  # for tests and introspection
    return app
