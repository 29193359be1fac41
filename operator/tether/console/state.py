"""What the console knows, from list+watch with one credential in one namespace scope: runs,
budgets, WorkerRun events, the runs' Leases (liveness) and pods (exit codes, log targets), a usage
series per run, and the browsers to tell about changes.

One watch per resource and scope, however many browsers look (they get Server-Sent Events from
here), so a room full of open consoles costs the API server five watches, not a poll each.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tether import protocol
from tether.api.constants import LABEL_RUN
from tether.api.models import API_VERSION
from tether.kube.paths import object_path

log = logging.getLogger("tether.console")

# The API server ends each watch after this long; the next resumes from the last resourceVersion.
WATCH_SECONDS = 290
SERIES_POINTS = 720  # per run: a point per status change, so hours of a run's folds
RETRY_MAX_SECONDS = 30.0
REFUSALS = frozenset({401, 403, 404})  # answers a retry will not change soon (unlike 429 or 5xx)
LEASES, CORE = "coordination.k8s.io/v1", "v1"
RUN_OBJECTS = {"labelSelector": LABEL_RUN}  # the Leases and pods the operator made for runs, nothing else

Changed = Callable[[str, "dict[str, Any] | None"], None]


def scoped_path(namespace: str | None, plural: str, api_version: str = API_VERSION) -> str:
    return object_path(api_version, plural, namespace or None)


def object_key(obj: dict[str, Any]) -> str:
    return f"{obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}"


def _slim(obj: dict[str, Any]) -> dict[str, Any]:
    """managedFields and kubectl's last-applied copy are most of an object and never shown."""
    meta = obj.get("metadata") or {}
    meta.pop("managedFields", None)
    (meta.get("annotations") or {}).pop("kubectl.kubernetes.io/last-applied-configuration", None)
    return obj


def _slim_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """Of a pod: which containers it has and how they ended; the rest (env, volumes) is never shown."""
    status = pod.get("status") or {}
    return {"metadata": _slim(pod)["metadata"],
            "spec": {"containers": [{"name": c.get("name")} for c in (pod.get("spec") or {}).get("containers") or []]},
            "status": {k: status[k] for k in ("phase", "containerStatuses") if k in status}}


class Gone(Exception):
    """410: the resourceVersion is too old to resume from; list again."""


class Watch:
    """A list, then a watch resumed from the last resourceVersion seen; `on_change(key, obj)` for
    every object that changed (obj None: deleted). `error` holds why the last try failed, if it did."""

    def __init__(self, http: httpx.AsyncClient, path: str, on_change: Changed,
                 params: dict[str, str] | None = None,
                 slim: Callable[[dict[str, Any]], dict[str, Any]] = _slim) -> None:
        self.http, self.path, self.on_change, self.slim = http, path, on_change, slim
        self.params = params or {}
        self.objects: dict[str, dict[str, Any]] = {}
        self.error: str | None = None
        self.settled = asyncio.Event()  # listed once, or refused
        self.listed = False  # the last list succeeded and nothing was refused since

    async def run(self) -> None:
        version: str | None = None
        delay = 0.5
        while True:
            try:
                if version is None:
                    version = await self._list()
                version = await self._watch(version)
                delay = 0.5
            except Gone:
                version = None
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in REFUSALS:
                    self._forget()
                    self.settled.set()  # no use waiting for a list the API server refuses: show why
                self._failed(str(exc) or type(exc).__name__)
                await asyncio.sleep(delay)  # the next try's pace, not a wait for a condition
                delay = min(delay * 2, RETRY_MAX_SECONDS)
                version = None

    def _forget(self) -> None:
        """What the credential may no longer list (RBAC removed, token expired) is shown no longer."""
        self.listed = False
        for key in list(self.objects):
            del self.objects[key]
            self.on_change(key, None)

    def _failed(self, why: str) -> None:
        if why != self.error:
            self.error = why
            log.warning("console watch of %s failed: %s", self.path, why,
                        extra={"event": "console_watch_failed", "path": self.path, "error": why})
            self.on_change("", None)  # the pages show the error

    async def _list(self) -> str:
        resp = await self.http.get(self.path, params=self.params)
        if resp.status_code >= 400:
            raise httpx.HTTPStatusError(_message(resp), request=resp.request, response=resp)
        body = resp.json()
        fresh = {object_key(o): self.slim(o) for o in body.get("items") or []}
        for key in set(self.objects) - set(fresh):
            del self.objects[key]
            self.on_change(key, None)
        for key, obj in fresh.items():
            if self.objects.get(key, {}).get("metadata", {}).get("resourceVersion") != obj["metadata"].get(
                    "resourceVersion"):
                self.objects[key] = obj
                self.on_change(key, obj)
        if self.error is not None:
            self.error = None
            self.on_change("", None)
        self.listed = True
        self.settled.set()
        return str(body["metadata"]["resourceVersion"])

    async def _watch(self, version: str) -> str:
        params = {**self.params, "watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(WATCH_SECONDS)}
        timeout = httpx.Timeout(10.0, read=WATCH_SECONDS + 30)
        async with self.http.stream("GET", self.path, params=params, timeout=timeout) as resp:
            if resp.status_code == 410:
                raise Gone()
            if resp.status_code >= 400:
                await resp.aread()
                raise httpx.HTTPStatusError(_message(resp), request=resp.request, response=resp)
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event["object"]
                if event["type"] == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise ValueError(obj.get("message", "watch error"))
                version = obj["metadata"]["resourceVersion"]
                if event["type"] == "BOOKMARK":
                    continue
                key = object_key(obj)
                if event["type"] == "DELETED":
                    self.objects.pop(key, None)
                    self.on_change(key, None)
                else:
                    self.objects[key] = self.slim(obj)
                    self.on_change(key, self.objects[key])
        return version


def _message(resp: httpx.Response) -> str:
    try:
        return f"{resp.status_code} {resp.json().get('message', resp.text)}"
    except ValueError:
        return f"{resp.status_code} {resp.text[:200]}"


@dataclass(frozen=True)
class Point:
    """One observation of a run's progress (wall-clock seconds since the epoch)."""

    time: float
    cents: int
    tokens: int
    cursor: str | None
    # Reached along a straight line from the point before, rather than a step held until this one:
    # an attempt's spend known only at its start and end.
    ramp: bool = False


class Listener:
    """One browser's stream: which keys changed since it last rendered (a burst is one render)."""

    def __init__(self) -> None:
        self.changed: set[str] = set()
        self.wake = asyncio.Event()
        self.ended = False  # its scope was closed (logout, an expired token): the stream ends

    def end(self) -> None:
        self.ended = True
        self.wake.set()

    def notify(self, key: str) -> None:
        self.changed.add(key)
        self.wake.set()

    def take(self) -> set[str]:
        self.wake.clear()
        keys, self.changed = self.changed, set()
        return keys

    async def next(self) -> set[str]:
        await self.wake.wait()
        return self.take()


@dataclass
class Scope:
    """Everything one credential sees in one namespace (None: all namespaces)."""

    http: httpx.AsyncClient
    namespace: str | None
    series: dict[str, list[Point]] = field(default_factory=dict)
    listeners: set[Listener] = field(default_factory=set)
    last_used: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.runs = Watch(self.http, scoped_path(self.namespace, "workerruns"), self._run_changed)
        self.budgets = Watch(self.http, scoped_path(self.namespace, "workerbudgets"),
                             lambda key, _: self._notify(f"budget:{key}"))
        self.schedules = Watch(self.http, scoped_path(self.namespace, "workerrunschedules"),
                               lambda key, _: self._notify(f"schedule:{key}"))
        # Only WorkerRuns' events: the refusals, stale results and lapses a timeline marks.
        self.events = Watch(self.http, scoped_path(self.namespace, "events", api_version=CORE), self._event_changed,
                            params={"fieldSelector": "involvedObject.kind=WorkerRun"})
        # Liveness is the Lease's renewTime (status.lastRenewTime is folded only when progress moves).
        self.leases = Watch(self.http, scoped_path(self.namespace, "leases", api_version=LEASES), self._owned_changed,
                            params=RUN_OBJECTS)
        self.pods = Watch(self.http, scoped_path(self.namespace, "pods", api_version=CORE), self._owned_changed,
                          params=RUN_OBJECTS, slim=_slim_pod)
        self._run_of: dict[str, str] = {}  # a Lease's or pod's key: its run's, kept to tell of its deletion
        self._tasks: list[asyncio.Task[None]] = []

    def _watches(self) -> tuple[tuple[str, Watch], ...]:
        return (("runs", self.runs), ("budgets", self.budgets), ("schedules", self.schedules), ("events", self.events),
                ("leases", self.leases), ("pods", self.pods))

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(w.run()) for _, w in self._watches()]

    async def close(self) -> None:
        for listener in self.listeners:
            listener.end()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.http.aclose()

    def listen(self) -> Listener:
        listener = Listener()
        self.listeners.add(listener)
        self.last_used = time.monotonic()
        return listener

    def leave(self, listener: Listener) -> None:
        self.listeners.discard(listener)
        self.last_used = time.monotonic()

    def errors(self) -> list[str]:
        return [f"{name}: {w.error}" for name, w in self._watches() if w.error]

    def run_events(self, uid: str) -> list[dict[str, Any]]:
        return [e for e in self.events.objects.values() if (e.get("involvedObject") or {}).get("uid") == uid]

    def lease_of(self, run: dict[str, Any]) -> dict[str, Any] | None:
        """The run's Lease (named as the run), not one a deleted namesake left behind."""
        lease = self.leases.objects.get(object_key(run))
        return lease if lease is not None and protocol.controller_uid(lease) in (None, run["metadata"]["uid"]) \
            else None

    def pods_of(self, run: dict[str, Any]) -> list[dict[str, Any]]:
        meta = run["metadata"]
        return [p for p in self.pods.objects.values() if p["metadata"].get("namespace") == meta["namespace"]
                and (p["metadata"].get("labels") or {}).get(LABEL_RUN) == meta["name"]
                and protocol.controller_uid(p) in (None, meta["uid"])]

    def _notify(self, key: str) -> None:
        for listener in self.listeners:
            listener.notify(key)

    def _run_changed(self, key: str, run: dict[str, Any] | None) -> None:
        if run is None:
            self.series.pop(key, None)
        else:
            record(self.series.setdefault(key, []), run, time.time())
        self._notify(f"run:{key}")

    def _owned_changed(self, key: str, obj: dict[str, Any] | None) -> None:
        """A Lease or pod changed: its run's pages render again."""
        if obj is None:
            self._notify(f"run:{self._run_of.pop(key)}" if key in self._run_of else "")
            return
        meta = obj["metadata"]
        run = self._run_of[key] = f"{meta.get('namespace', '')}/{(meta.get('labels') or {}).get(LABEL_RUN, '')}"
        self._notify(f"run:{run}")

    def _event_changed(self, _: str, event: dict[str, Any] | None) -> None:
        involved = (event or {}).get("involvedObject") or {}
        self._notify(f"run:{involved.get('namespace', '')}/{involved.get('name', '')}" if involved else "")


def record(series: list[Point], run: dict[str, Any], now: float) -> None:
    """Appends the run's usage and checkpoint when either moved (a status write that changed
    neither adds nothing)."""
    status = run.get("status") or {}
    usage = status.get("usage") or {}
    point = Point(now, int(usage.get("cents") or 0), int(usage.get("tokens") or 0),
                  (status.get("checkpoint") or {}).get("cursor"))
    if series and (series[-1].cents, series[-1].tokens, series[-1].cursor) == (point.cents, point.tokens,
                                                                                 point.cursor):
        return
    series.append(point)
    del series[:-SERIES_POINTS]
