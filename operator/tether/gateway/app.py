"""The gateway: six JSON calls for workers outside the cluster, on the same fenced
Lease and status operations as a pod worker (one protocol, two transports).

POST /api/v1/namespaces/{ns}/workerruns/{name}/{claim|heartbeat|checkpoint|complete|fail|cancel}

200 ok · 401/403 auth · 402 budget exceeded (admission first) · 404 no such run ·
409 held by another / nothing to claim · 410 stale fence · 422 malformed body (names the field)
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import logging
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tether.api import constants as c
from tether.api.models import Signals as LeaseSignals
from tether.api.models import WorkerRun
from tether.gateway import models as m
from tether.gateway.auth import AuthError, Authenticator, Caller
from tether.gateway.openapi import openapi_document
from tether.kube import resources
from tether.kube.client import ApiError, Conflict, Invalid, KubeClient, NotFound, lease_path

log = logging.getLogger("tether.gateway")

ANN_CLAIMED_BY = c.ANN_CLAIMED_BY
TOOL_CLAIM_SECONDS = 600  # the shortest the TokenRequest API allows; never lengthened


class Failure(Exception):
    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field


def _error(status: int, code: str, message: str, field: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if field:
        body["field"] = field
    return JSONResponse({"error": body}, status_code=status)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Gateway:
    def __init__(self, kube: KubeClient, audience: str | None = None) -> None:
        self.kube = kube
        self.auth = Authenticator(kube, audience)
        # holder -> uid of its tool-claim Secret (one per attempt; the operator deletes it on revocation)
        self._secrets: dict[str, str] = {}

    # --- plumbing ------------------------------------------------------------

    async def _body(self, request: Request, model: type[BaseModel]) -> Any:
        raw = await request.body()
        try:
            doc = json.loads(raw or b"{}")
        except ValueError as exc:
            raise Failure(422, "MalformedBody", f"the body is not JSON: {exc}") from exc
        try:
            return model.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "(body)"
            raise Failure(422, "MalformedBody", f"{field}: {first['msg']}", field) from exc

    async def _run(self, ns: str, name: str) -> WorkerRun:
        try:
            return WorkerRun.model_validate(await self.kube.get_run(ns, name))
        except NotFound as exc:
            raise Failure(404, "NotFound", f"workerrun {ns}/{name} not found") from exc

    async def _caller(self, request: Request, ns: str, name: str) -> Caller:
        caller = await self.auth.authenticate(request.headers.get("authorization"))
        await self.auth.authorize(caller, ns, name)
        return caller

    def _signals(self, run: WorkerRun, lease: dict[str, Any], usage: m.UsageReport | None) -> dict[str, Any]:
        ann = (lease.get("metadata") or {}).get("annotations") or {}
        try:
            sig = LeaseSignals.model_validate_json(ann[c.ANN_SIGNALS]) if ann.get(c.ANN_SIGNALS) else LeaseSignals()
        except ValueError:
            sig = LeaseSignals()
        own_c, own_t = (usage.cents, usage.tokens) if usage else _lease_usage(lease)
        return {
            "leaseExpiresAt": _iso(_now() + dt.timedelta(seconds=run.spec.lease.duration_seconds)),
            "stop": sig.stop, "paused": sig.paused,
            "endsAt": _iso(sig.ends_at) if sig.ends_at else None,
            "capRemainingCents": None if sig.cap_cents is None else sig.cap_cents - sig.base_cents - own_c,
            "capRemainingTokens": None if sig.cap_tokens is None else sig.cap_tokens - sig.base_tokens - own_t,
            "status": run.status.phase.value if run.status.phase else "Pending",
        }

    async def _tool_claim(self, run: WorkerRun, holder: str) -> dict[str, Any] | None:
        """A short-lived token of the run's ServiceAccount, bound to a per-attempt Secret that
        the operator deletes on revocation (which invalidates every such token at once)."""
        ns = run.metadata.namespace
        sa = resources.worker_service_account(run)
        secret = f"{holder}-toolclaim"
        key = f"{ns}/{secret}"
        try:
            if key not in self._secrets:
                secret_obj = await self.kube.apply(f"/api/v1/namespaces/{ns}/secrets", {
                    "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": {"name": secret, "namespace": ns, "labels": resources.run_labels(run),
                                 "ownerReferences": [resources.owner_ref(run)]}})
                self._secrets[key] = secret_obj["metadata"]["uid"]
            resp = await self.kube.create(f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", {
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": TOOL_CLAIM_SECONDS,
                         "boundObjectRef": {"kind": "Secret", "apiVersion": "v1", "name": secret,
                                            "uid": self._secrets[key]}}})
        except ApiError as exc:
            self._secrets.pop(key, None)
            log.warning("no tool claim", extra={"event": "tool_claim_failed", "run": f"{ns}/{run.metadata.name}",
                                                "status": exc.status})
            return None
        return {"token": resp["status"]["token"], "expiresAt": resp["status"]["expirationTimestamp"],
                "serviceAccount": sa}

    async def _fenced_lease(self, run: WorkerRun, body: m.Fenced) -> dict[str, Any]:
        lease = await self.kube.get_lease(run.metadata.namespace, run.metadata.name)
        spec = (lease or {}).get("spec") or {}
        if lease is None or spec.get("holderIdentity") != body.holder or spec.get("leaseTransitions") != body.fence:
            raise Failure(410, "StaleFence", f"fence {body.fence} of {body.holder} is no longer current")
        return lease

    async def _renew(self, run: WorkerRun, body: m.Fenced, usage: m.UsageReport | None,
                     checkpoint: str | None, claimed_by: str | None = None) -> dict[str, Any]:
        """The same conditional Lease update a pod worker makes (resourceVersion precondition)."""
        for _ in range(2):
            lease = await self._fenced_lease(run, body)
            updated = copy.deepcopy(lease)
            updated["spec"]["renewTime"] = resources.micro_time(_now())
            ann = updated["metadata"].setdefault("annotations", {}) or {}
            updated["metadata"]["annotations"] = ann
            if usage is not None:
                prev = _lease_usage(lease)
                if usage.cents < prev[0] or usage.tokens < prev[1]:
                    raise Failure(422, "MalformedBody", "usage: reports are cumulative and may not decrease", "usage")
                ann[c.ANN_USAGE] = json.dumps(usage.model_dump(), separators=(",", ":"))
            if checkpoint is not None:
                ann[c.ANN_CHECKPOINT] = checkpoint
            if claimed_by is not None:
                ann[ANN_CLAIMED_BY] = claimed_by
            try:
                return await self.kube.replace_lease(updated)
            except Conflict:
                continue
        raise Failure(409, "Conflict", "the lease changed twice during the call; retry")

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
        who = caller.username + (f"/{body.workerId}" if body.workerId else "")
        fenced = m.Fenced(holder=s.holder, fence=s.fence)
        try:
            lease = await self._fenced_lease(run, fenced)
        except Failure as exc:
            raise Failure(409, "NotClaimable", "the attempt is being granted; retry shortly") from exc
        current = ((lease.get("metadata") or {}).get("annotations") or {}).get(ANN_CLAIMED_BY)
        if current and current != who:
            raise Failure(409, "HeldByAnother", f"attempt {s.attempt} is held by another worker")
        lease = await self._renew(run, fenced, None, None, claimed_by=who)
        if current is None:
            log.info("claimed", extra={"event": "job_claimed", "run": f"{ns}/{name}", "attempt": s.attempt,
                                       "fence": s.fence, "holder": s.holder, "worker": who})
        return {**self._signals(run, lease, None), "holder": s.holder, "fence": s.fence, "attempt": s.attempt,
                "leaseDurationSeconds": run.spec.lease.duration_seconds,
                "renewIntervalSeconds": run.spec.lease.renew_interval_seconds,
                "payload": run.spec.payload or {}, "checkpoint": s.checkpoint.cursor if s.checkpoint else None,
                "idempotencyKey": run.idempotency_key, "toolClaim": await self._tool_claim(run, s.holder)}

    async def heartbeat(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        await self._caller(request, ns, name)
        body: m.HeartbeatRequest = await self._body(request, m.HeartbeatRequest)
        run = await self._run(ns, name)
        lease = await self._renew(run, body, body.usage, body.checkpoint)
        return {**self._signals(run, lease, body.usage), "toolClaim": await self._tool_claim(run, body.holder)}

    async def checkpoint(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        await self._caller(request, ns, name)
        body: m.CheckpointRequest = await self._body(request, m.CheckpointRequest)
        run = await self._run(ns, name)
        lease = await self._renew(run, body, body.usage, body.cursor)
        return self._signals(run, lease, body.usage)

    async def _publish(self, request: Request, ns: str, name: str, model: type[m.Fenced], field: str) -> dict[str, Any]:
        await self._caller(request, ns, name)
        body = await self._body(request, model)
        value = {"result": lambda: body.result, "error": lambda: body.error.model_dump(),
                 "cancel": lambda: {"code": "WorkerCancelled", "message": body.reason}}[field]()
        patch = [{"op": "test", "path": "/status/fence", "value": body.fence},
                 {"op": "test", "path": "/status/holder", "value": body.holder},
                 {"op": "add", "path": f"/status/{'result' if field == 'result' else 'error'}", "value": value}]
        try:
            written = await self.kube.patch_run_status(ns, name, patch)
        except Invalid as exc:
            log.warning("result rejected", extra={"event": "result_rejected", "run": f"{ns}/{name}",
                                                  "fence": body.fence, "holder": body.holder})
            raise Failure(410, "StaleFence", f"fence {body.fence} of {body.holder} is no longer current") from exc
        except NotFound as exc:
            raise Failure(404, "NotFound", f"workerrun {ns}/{name} not found") from exc
        return {"status": (written.get("status") or {}).get("phase", ""), "fence": body.fence}

    async def complete(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        return await self._publish(request, ns, name, m.CompleteRequest, "result")

    async def fail(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        return await self._publish(request, ns, name, m.FailRequest, "error")

    async def cancel(self, request: Request, ns: str, name: str) -> dict[str, Any]:
        return await self._publish(request, ns, name, m.CancelRequest, "cancel")


def _lease_usage(lease: dict[str, Any]) -> tuple[int, int]:
    raw = ((lease.get("metadata") or {}).get("annotations") or {}).get(c.ANN_USAGE)
    try:
        doc = json.loads(raw) if raw else {}
        return int(doc.get("cents", 0)), int(doc.get("tokens", 0))
    except (ValueError, TypeError, AttributeError):
        return 0, 0


OPERATIONS = ("claim", "heartbeat", "checkpoint", "complete", "fail", "cancel")


def build_app(kube: KubeClient, audience: str | None = None) -> Starlette:
    gateway = Gateway(kube, audience)

    def endpoint(op: str):  # type: ignore[no-untyped-def]
        handler = getattr(gateway, op)

        async def call(request: Request) -> JSONResponse:
            ns, name = request.path_params["namespace"], request.path_params["name"]
            try:
                return JSONResponse(await handler(request, ns, name))
            except AuthError as exc:
                return _error(exc.status, exc.code, exc.message)
            except Failure as exc:
                return _error(exc.status, exc.code, exc.message, exc.field)
            except ApiError as exc:
                log.error("API error", extra={"event": "gateway_api_error", "op": op, "status": exc.status})
                return _error(502, "UpstreamError", f"the Kubernetes API answered {exc.status}")

        return call

    async def openapi(_: Request) -> JSONResponse:
        return JSONResponse(openapi_document())

    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    routes = [Route(f"/api/v1/namespaces/{{namespace}}/workerruns/{{name}}/{op}", endpoint(op), methods=["POST"])
              for op in OPERATIONS]
    routes += [Route("/openapi.json", openapi, methods=["GET"]), Route("/healthz", healthz, methods=["GET"])]
    return Starlette(routes=routes)
