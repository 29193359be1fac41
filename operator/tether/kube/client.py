"""Async Kubernetes client for the operator (httpx): the few calls Tether makes.

Every ownership-dependent write here is conditional: a resourceVersion
precondition (PUT) or a JSON patch whose `test` operations must hold.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any, Callable

import httpx

from tether import gcpause, metrics
from tether.api.models import API_VERSION
from tether.kube.config import KubeConfig
from tether.kube.paths import budget_path, event_path, lease_path, pod_path, run_path, secret_path, service_account_path
from tether.protocol import JSON_PATCH, rfc3339
from tether.kube.health import ApiHealth
from tether.kube.ratelimit import TokenBucket

SLOW_PROBE_TIMEOUT = 4.0
MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}


def server_says(status: int, body: str) -> str:
    """A refusal as kubectl words it: `Error from server (Forbidden): ...`."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if status == 401:
        return "error: You must be logged in to the server (Unauthorized)"
    if isinstance(doc, dict) and doc.get("kind") == "Status" and doc.get("message"):
        reason = f" ({doc['reason']})" if doc.get("reason") else ""
        return f"Error from server{reason}: {doc['message']}"
    return f"error: the server responded with the status code {status} but did not return more information"


class ApiError(Exception):
    def __init__(self, status: int, body: str, what: str) -> None:
        self.status = status
        self.body = body
        self.what = what
        try:
            self.message = json.loads(body).get("message", body)
        except ValueError:
            self.message = body
        super().__init__(f"{what}: {status} {self.message}")


class Conflict(ApiError):
    """409: the resourceVersion precondition failed (or the object exists)."""


class NotFound(ApiError):
    """404."""


class Invalid(ApiError):
    """422: validation failed, or a JSON patch `test` did not hold."""


class Forbidden(ApiError):
    """403: RBAC, or the namespace is being terminated."""

    @property
    def namespace_terminating(self) -> bool:
        return "being terminated" in self.message

    @property
    def refuses_the_object(self) -> bool:
        """The object itself is not allowed, whenever it is sent: Pod Security, an admission webhook or
        a ValidatingAdmissionPolicy denied it. Any other 403 may pass on its own and is tried again: a
        namespace being deleted, a used-up or not yet counted ResourceQuota, a ServiceAccount being
        made again, the operator's own RBAC during an upgrade."""
        m = self.message
        return ("violates PodSecurity" in m or ("admission webhook" in m and "denied the request" in m)
                or "ValidatingAdmissionPolicy" in m)


class Unavailable(ApiError):
    """The API server did not answer usefully (transport error, timeout, 429, 5xx): try later."""


def _raise_for(resp: httpx.Response, what: str) -> None:
    if resp.status_code < 300:
        return
    if resp.status_code == 429 or resp.status_code >= 500:
        raise Unavailable(resp.status_code, resp.text, what)
    # 400: an object the API server cannot even decode (e.g. cpu: "abc"), a refusal like 422.
    cls = {409: Conflict, 404: NotFound, 400: Invalid, 422: Invalid, 403: Forbidden}.get(resp.status_code, ApiError)
    raise cls(resp.status_code, resp.text, what)


class KubeClient:
    """`limiter` bounds the request rate (client-go's QPS/Burst); `health` learns of every
    failure to reach the API server, so lapses are not judged during an outage."""

    def __init__(self, cfg: KubeConfig, timeout: float = 15.0, limiter: TokenBucket | None = None,
                 health: ApiHealth | None = None, event_limiter: TokenBucket | None = None) -> None:
        self.cfg = cfg
        self.http = cfg.async_client(timeout=timeout)
        self.limiter = limiter
        # Events are best effort (as client-go's recorder drops what its spam filter refuses): they
        # have a budget of their own and never queue ahead of, or behind, a reconcile's writes.
        self.event_limiter = event_limiter
        self.health = health or ApiHealth()
        self.requests = 0
        # Called before every write, after the rate limit's wait (the controller's leadership check):
        # a replica deposed while it waited for a token writes nothing.
        self.write_gate: Callable[[], None] | None = None

    async def close(self) -> None:
        await self.http.aclose()

    async def _call(self, method: str, path: str, what: str, limited: bool = True, **kw: Any) -> dict[str, Any]:
        if limited and self.limiter is not None:
            await self.limiter.acquire()
        if method != "GET" and self.write_gate is not None:
            self.write_gate()
        self.requests += 1
        try:
            resp = await self.http.request(method, path, **kw)
        except httpx.TransportError as exc:
            metrics.REST_REQUESTS.labels(method, "<error>").inc()
            self.health.failure(f"{what}: {type(exc).__name__}")
            raise Unavailable(0, str(exc) or type(exc).__name__, what) from exc
        metrics.REST_REQUESTS.labels(method, str(resp.status_code)).inc()
        # A 5xx or 429 is an answer (a broken webhook, an oversized write, priority and fairness):
        # reachability is judged from transport failures and the /readyz probe, not from those.
        _raise_for(resp, what)
        return resp.json() if resp.content else {}

    async def timed_get(self, path: str, what: str) -> tuple[dict[str, Any] | None, float]:
        """A GET and how long it took (monotonic seconds); None for 404."""
        if self.limiter is not None:
            await self.limiter.acquire()  # waiting for our own rate limit is not the API's latency
        began, paused = time.monotonic(), gcpause.paused()
        try:
            body: dict[str, Any] | None = await self._call("GET", path, what, limited=False)
        except NotFound:
            body = None
        return body, time.monotonic() - began - (gcpause.paused() - paused)  # our own GC is not the API's

    async def ready(self) -> bool:
        """The API server's /readyz (it checks etcd too), without the rate limit: a probe must
        not queue behind a burst of reconciles and mistake that for an outage."""
        resp = await self.http.get("/readyz", timeout=SLOW_PROBE_TIMEOUT)
        return resp.status_code == 200

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", path, f"create {path}", json=body)

    # --- WorkerRuns ----------------------------------------------------------

    async def get_run(self, ns: str, name: str) -> dict[str, Any]:
        return await self._call("GET", run_path(ns, name), f"get workerrun {ns}/{name}")

    async def replace_run_status(self, run: dict[str, Any]) -> dict[str, Any]:
        """PUT status with the run's resourceVersion: a compare-and-swap on the whole status."""
        meta = run["metadata"]
        return await self._call("PUT", run_path(meta["namespace"], meta["name"]) + "/status",
                                f"replace status of {meta['namespace']}/{meta['name']}", json=run)

    async def patch_run_status(self, ns: str, name: str, patch: list[dict[str, Any]],
                               timeout: float | None = None) -> dict[str, Any]:
        """A JSON patch on the status subresource; its `test` operations make it conditional.
        `timeout`: this request's, instead of the client's (a large result takes longer)."""
        return await self._call("PATCH", run_path(ns, name) + "/status", f"patch status of {ns}/{name}",
                                json=patch, headers=JSON_PATCH,
                                **({"timeout": timeout} if timeout is not None else {}))

    async def set_run_finalizers(self, ns: str, name: str, resource_version: str, finalizers: list[str]) -> dict[str, Any]:
        """Replaces the finalizer list, conditional on the resourceVersion the change was decided on."""
        patch = {"metadata": {"resourceVersion": resource_version, "finalizers": finalizers}}
        return await self._call("PATCH", run_path(ns, name), f"set finalizers of {ns}/{name}", json=patch,
                                headers=MERGE_PATCH)

    async def delete_run(self, ns: str, name: str, uid: str, resource_version: str) -> None:
        """Deletes the run exactly as it was judged (UID and resourceVersion preconditions):
        Conflict if it changed since."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1",
                "preconditions": {"uid": uid, "resourceVersion": resource_version},
                "propagationPolicy": "Background"}
        try:
            await self._call("DELETE", run_path(ns, name), f"delete workerrun {ns}/{name}", json=body)
        except NotFound:
            pass

    # --- WorkerBudgets -------------------------------------------------------

    async def get_budget(self, ns: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", budget_path(ns, name), f"get workerbudget {ns}/{name}")
        except NotFound:
            return None

    async def replace_budget_status(self, budget: dict[str, Any]) -> dict[str, Any]:
        """PUT status with the budget's resourceVersion (compare-and-swap)."""
        meta = budget["metadata"]
        return await self._call("PUT", budget_path(meta["namespace"], meta["name"]) + "/status",
                                f"replace status of workerbudget {meta['namespace']}/{meta['name']}", json=budget)

    # --- Leases --------------------------------------------------------------

    async def get_lease(self, ns: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", lease_path(ns, name), f"get lease {ns}/{name}")
        except NotFound:
            return None

    async def get_service_account(self, ns: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", service_account_path(ns, name), f"get serviceaccount {ns}/{name}")
        except NotFound:
            return None

    async def create_lease(self, lease: dict[str, Any]) -> dict[str, Any]:
        ns = lease["metadata"]["namespace"]
        return await self._call("POST", lease_path(ns), f"create lease {ns}/{lease['metadata']['name']}", json=lease)

    async def replace_lease(self, lease: dict[str, Any]) -> dict[str, Any]:
        """PUT with the lease's resourceVersion (compare-and-swap)."""
        meta = lease["metadata"]
        return await self._call("PUT", lease_path(meta["namespace"], meta["name"]),
                                f"replace lease {meta['namespace']}/{meta['name']}", json=lease)

    async def patch_lease_signals(self, ns: str, name: str, fence: int, signals: str) -> dict[str, Any]:
        """Sets the signals annotation only while the lease still carries `fence`."""
        patch = [{"op": "test", "path": "/spec/leaseTransitions", "value": fence},
                 {"op": "add", "path": "/metadata/annotations/tether.dev~1signals", "value": signals}]
        return await self._call("PATCH", lease_path(ns, name), f"signal lease {ns}/{name}", json=patch,
                                headers=JSON_PATCH)

    # --- Pods ----------------------------------------------------------------

    async def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        ns = pod["metadata"]["namespace"]
        return await self._call("POST", pod_path(ns), f"create pod {ns}/{pod['metadata']['name']}", json=pod)

    async def get_pod(self, ns: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", pod_path(ns, name), f"get pod {ns}/{name}")
        except NotFound:
            return None

    async def delete_pod(self, ns: str, name: str, uid: str | None = None) -> dict[str, Any] | None:
        """Returns the pod as the deletion left it (None when it is gone). With `uid`, only that pod:
        names are deterministic, and another pod of the same name may have replaced it."""
        options: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if uid is not None:
            options["preconditions"] = {"uid": uid}
        try:
            body = await self._call("DELETE", pod_path(ns, name), f"delete pod {ns}/{name}", json=options)
        except NotFound:
            return None
        except Conflict:
            if uid is None:
                raise
            return None  # the precondition failed: the pod of that UID is gone
        return body if body.get("kind") == "Pod" else None

    async def remove_finalizer(self, ns: str, name: str, finalizer: str, uid: str | None = None) -> dict[str, Any] | None:
        """JSON patch that tests the finalizer's position (and, with `uid`, the pod's UID), so a
        concurrent change cannot be clobbered. Returns the pod as it is now (None when it is gone)."""
        pod = await self.get_pod(ns, name)
        if pod is None or (uid is not None and pod["metadata"].get("uid") != uid):
            return None
        finalizers = pod["metadata"].get("finalizers", [])
        if finalizer not in finalizers:
            return pod
        i = finalizers.index(finalizer)
        patch = [{"op": "test", "path": "/metadata/uid", "value": pod["metadata"]["uid"]},
                 {"op": "test", "path": f"/metadata/finalizers/{i}", "value": finalizer},
                 {"op": "remove", "path": f"/metadata/finalizers/{i}"}]
        try:
            return await self._call("PATCH", pod_path(ns, name), f"release pod {ns}/{name}", json=patch,
                                    headers=JSON_PATCH)
        except NotFound:
            return None
        except Invalid as exc:  # the `test` failed: the finalizers changed between the read and the patch
            raise Conflict(409, exc.body, f"release pod {ns}/{name}: finalizers moved") from None

    async def list_objects(self, path: str, label_selector: str = "", field_selector: str = "") -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else {}
        if field_selector:
            params["fieldSelector"] = field_selector
        return list((await self._call("GET", path, f"list {path}", params=params)).get("items") or [])

    # --- other kinds (a capability's: Kueue's Workloads and AdmissionChecks) ---------

    async def apply_status(self, path: str, api_version: str, kind: str, meta: dict[str, str],
                           status: dict[str, Any], manager: str) -> dict[str, Any]:
        """Server-side apply of an object's status as field manager `manager` (forced, as Kueue's
        job framework does); a `resourceVersion` in `meta` makes it a compare-and-swap."""
        body = {"apiVersion": api_version, "kind": kind, "metadata": meta, "status": status}
        return await self._call("PATCH", f"{path}/status", f"apply {kind} {meta['name']} status",
                                params={"fieldManager": manager, "force": "true"}, content=json.dumps(body),
                                headers={"Content-Type": "application/apply-patch+yaml"})

    async def json_patch(self, path: str, patch: list[dict[str, Any]], what: str) -> dict[str, Any]:
        """A JSON patch; its `test` operations make it conditional (Invalid when one fails)."""
        return await self._call("PATCH", path, what, json=patch, headers=JSON_PATCH)

    async def replace_status(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        """PUT an object's status with its resourceVersion: a compare-and-swap on the whole status."""
        return await self._call("PUT", f"{path}/status", f"replace status of {what}", json=body)

    async def merge_patch(self, path: str, patch: dict[str, Any], what: str) -> dict[str, Any]:
        """A merge patch; a metadata.resourceVersion in it makes it conditional."""
        return await self._call("PATCH", path, what, json=patch, headers=MERGE_PATCH)

    # --- RBAC and service accounts for workers -------------------------------

    async def apply(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create, or leave alone if it exists (these objects are immutable per run)."""
        try:
            return await self._call("POST", path, f"create {path}/{body['metadata']['name']}", json=body)
        except Conflict:
            return await self._call("GET", f"{path}/{body['metadata']['name']}", f"get {path}")

    async def get_object(self, path: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", path, f"get {path}")
        except NotFound:
            return None

    async def delete_object(self, path: str, uid: str) -> None:
        """Deletes exactly the object with this UID (a precondition), never a namesake."""
        try:
            await self._call("DELETE", path, f"delete {path}",
                             json={"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": uid}})
        except (NotFound, Conflict):
            pass

    async def delete_secret(self, ns: str, name: str) -> None:
        try:
            await self._call("DELETE", secret_path(ns, name), f"delete secret {ns}/{name}")
        except NotFound:
            pass

    # --- Events --------------------------------------------------------------

    async def post_event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = obj["metadata"]
        now = rfc3339(dt.datetime.now(dt.timezone.utc))
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": obj.get("apiVersion", API_VERSION), "kind": obj.get("kind", "WorkerRun"),
                               "name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid")},
            "reason": reason, "message": message[:1024], "type": type_,
            "source": {"component": "tether"}, "reportingComponent": "tether.dev/operator",
            "reportingInstance": "tether", "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        if self.event_limiter is not None and not self.event_limiter.try_acquire():
            metrics.EVENTS_DROPPED.inc()
            return
        await self._call("POST", event_path(meta['namespace']), "post event", json=event,
                         limited=self.event_limiter is None)
