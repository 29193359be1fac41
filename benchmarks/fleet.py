"""A simulated fleet: one asyncio process plays the workers of many WorkerRuns over the real API.

Each simulated worker does what the SDK's pod worker does, with the SDK's own transport code
(tether.worker.transport.AsyncKubeTransport: resourceVersion-conditional Lease renewals at the
renew interval, usage and checkpoint riding on them, a fenced result at the end). What a worker
does besides renewing comes from its run's Plan: freeze (stop renewing, like a stopped process),
crash (stop, and say so), or complete after some seconds. The fleet notices new attempts by
watching the WorkerRuns of its namespace (a holder and fence in the status) and, for pod-backed
runs, starts playing an attempt once its pod exists, as a real worker would start in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import multiprocessing
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import httpx

from tether.api.models import Usage
from tether.kube import config as kubeconfig
from tether.worker.transport import AsyncKubeTransport

log = logging.getLogger("fleet")


@dataclass(frozen=True)
class Plan:
    """What the worker of a run's first attempt does (later attempts just renew, then complete
    when `complete_after` says so). Times are seconds after the worker's first renewal."""

    freeze_after: float | None = None
    crash_after: float | None = None
    complete_after: float | None = None
    cents_per_renewal: int = 0
    checkpoint_every: int = 0  # renewals between checkpoints (0: never); each one reaches the status


@dataclass
class Played:
    """One attempt as the fleet played it (wall-clock times)."""

    run: str
    holder: str
    fence: int
    started: float = 0.0
    last_renewal: float | None = None
    renewals: int = 0
    # When each accepted renewal's answer came: the write landed on the API server before that.
    answered: list[float] = field(default_factory=list)
    ended: str = ""  # frozen, crashed, completed, lost, stopped, or "" while it still renews
    ended_at: float | None = None


@dataclass
class FleetStats:
    played: dict[tuple[str, int], Played] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    # The latest renewals' round trips, and the fleet's own queueing before each (for a slot).
    renew_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=5000))
    slot_wait_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=5000))
    # The longest time between two successful renewals of one worker, and when it ended: a worker
    # silent for a lease is lost by the rules, and this says whether the fleet was the silent one.
    widest_gap: tuple[float, float, str] = (0.0, 0.0, "")


# How long an External run's worker takes "lost" before its first renewal for "the Lease is not written yet".
EARLY_SECONDS = 10.0


class Fleet:
    def __init__(self, cfg: kubeconfig.KubeConfig, namespace: str, plan_for: Callable[[str], Plan],
                 shards: int = 8, connections: int = 4, timeout: float = 10.0) -> None:
        self.cfg, self.namespace, self.plan_for = cfg, namespace, plan_for
        self.stats = FleetStats()
        self._http = cfg.async_client(timeout=timeout)  # the watches
        # httpx's pool checks every connection it holds on each request: many small pools, not one
        # big one (128 connections in one pool cost the fleet most of a core at 170 renewals/s).
        self._shards = [_Shard(cfg.async_client(timeout=timeout, limits=httpx.Limits(
            max_connections=connections, max_keepalive_connections=connections)), connections)
            for _ in range(shards)]
        self._tasks: dict[tuple[str, int], asyncio.Task[None]] = {}
        # Run name -> wall-clock time at which the attempt playing it then freezes (set from any
        # thread: a plain dict write); used once, so the next attempt renews.
        self.freeze_at: dict[str, float] = {}
        # Pod name -> set once the pod exists: a worker starts in its pod (no polling: thousands wait).
        self._pods: dict[str, asyncio.Event] = {}

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await self._http.aclose()
        for shard in self._shards:
            await shard.http.aclose()

    async def run(self) -> None:
        """Watches runs (and pods) until cancelled, playing every attempt that appears."""
        await asyncio.gather(self._follow("apis/tether.dev/v1alpha1", "workerruns", self._on_run),
                             self._follow("api/v1", "pods", self._on_pod))

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if kind == "DELETED":
            self._pods.pop(name, None)
        else:
            self._pods.setdefault(name, asyncio.Event()).set()

    def _on_run(self, kind: str, run: dict[str, Any]) -> None:
        if kind == "DELETED":
            return
        status, meta = run.get("status") or {}, run["metadata"]
        holder, fence = status.get("holder"), status.get("fence")
        key = (meta["name"], int(fence or 0))
        if not holder or key in self._tasks:
            return
        pod_backed = (run.get("spec") or {}).get("executor", "Pod") == "Pod"
        attempt = int(status.get("attempt") or 1)
        plan = self.plan_for(meta["name"]) if attempt == 1 else Plan(
            complete_after=self.plan_for(meta["name"]).complete_after)
        played = Played(run=meta["name"], holder=holder, fence=int(fence))
        self.stats.played[key] = played
        shard = self._shards[hash(meta["name"]) % len(self._shards)]
        def transport() -> AsyncKubeTransport:
            return AsyncKubeTransport(self.namespace, meta["name"], holder, int(fence), shard.http, run_uid=meta["uid"])

        interval = float(((run.get("spec") or {}).get("lease") or {}).get("renewIntervalSeconds") or 10)
        self._tasks[key] = asyncio.create_task(self._play(played, plan, transport, shard.slots, interval,
                                                          pod_backed))

    async def _play(self, played: Played, plan: Plan, new_transport: Callable[[], AsyncKubeTransport],
                    slots: asyncio.Semaphore, interval: float, pod_backed: bool) -> None:
        transport = new_transport()
        if pod_backed:
            await self._pods.setdefault(played.holder, asyncio.Event()).wait()  # it starts in its pod
        played.started = time.time()
        spent = 0
        try:
            while True:
                age = time.time() - played.started
                frozen_at = self.freeze_at.get(played.run)
                if frozen_at is not None and time.time() >= frozen_at:
                    del self.freeze_at[played.run]
                    self._end(played, "frozen")
                    return
                for what, at in (("frozen", plan.freeze_after), ("crashed", plan.crash_after)):
                    if at is not None and age >= at:
                        self._end(played, what)
                        return
                if plan.complete_after is not None and age >= plan.complete_after:
                    async with slots:
                        ok = await transport.publish("result", {"by": played.holder})
                    self._end(played, "completed" if ok else "lost")
                    return
                spent += plan.cents_per_renewal
                queued = time.monotonic()
                # A slot first, then the renewal is composed and sent, as one worker would at once:
                # its renewTime is not older than the request.
                async with slots:
                    began = time.monotonic()
                    try:
                        checkpoint = str(played.renewals) if plan.checkpoint_every and \
                            played.renewals % plan.checkpoint_every == 0 else None
                        renewal = await transport.renew(checkpoint=checkpoint,
                                                        usage=Usage(cents=spent) if plan.cents_per_renewal else None)
                    except httpx.HTTPError as exc:
                        self.stats.counts[f"renewal error {type(exc).__name__}"] += 1
                        renewal = None
                    self.stats.renew_seconds.append(time.monotonic() - began)
                    self.stats.slot_wait_seconds.append(began - queued)
                if renewal is not None and renewal.ok and renewal.signals is not None and renewal.signals.stop:
                    self._end(played, "stopped")  # told to stop (a yield too): it exits, as a worker would
                    return
                if renewal is not None and renewal.ok:
                    now = time.time()
                    if played.last_renewal is not None and now - played.last_renewal > self.stats.widest_gap[0]:
                        self.stats.widest_gap = (now - played.last_renewal, now, played.run)
                    played.last_renewal, played.renewals = now, played.renewals + 1
                    played.answered.append(now)
                    self.stats.counts["renewals"] += 1
                elif renewal is not None and renewal.lost and not pod_backed and not played.renewals \
                        and age < EARLY_SECONDS:
                    # The grant writes the run's status (seen here) before its Lease. A pod starts after
                    # both; an External worker claims through the gateway, which answers after both:
                    # this worker, started by the status alone, is early, not lost.
                    self.stats.counts["renewals before the lease"] += 1
                    transport = new_transport()  # (a transport keeps the Lease it read: read it again)
                    await asyncio.sleep(0.2)
                    continue
                elif renewal is not None and renewal.lost:
                    self._end(played, "lost")
                    return
                elif renewal is not None:
                    self.stats.counts["renewals refused"] += 1
                wait = _next_wait(interval, plan, age)
                if frozen_at is not None:
                    wait = min(wait, max(0.0, frozen_at - time.time()))
                await asyncio.sleep(wait)
        finally:
            self._tasks.pop((played.run, played.fence), None)

    def _end(self, played: Played, how: str) -> None:
        played.ended, played.ended_at = how, time.time()
        self.stats.counts[f"workers {how}"] += 1

    async def _follow(self, prefix: str, resource: str, handle: Callable[[str, dict[str, Any]], None]) -> None:
        async for kind, obj in watch(self._http, f"/{prefix}/namespaces/{self.namespace}/{resource}"):
            handle(kind, obj)


class _Shard:
    """A small client, and as many slots as it has connections: workers wait for a slot, never in
    httpx's pool, which scans every queued request on each hand-over (thousands of workers
    queued there at once made the fleet quadratic, and it stopped renewing in time)."""

    def __init__(self, http: httpx.AsyncClient, connections: int) -> None:
        self.http, self.slots = http, asyncio.Semaphore(connections)


def _next_wait(interval: float, plan: Plan, age: float) -> float:
    """The renew interval, cut short when the plan's next moment comes sooner."""
    moments = [at - age for at in (plan.freeze_after, plan.crash_after, plan.complete_after)
               if at is not None and at > age]
    return max(0.0, min([interval, *moments]))


async def watch(http: httpx.AsyncClient, path: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """List, then watch from the list's resourceVersion; relist when the watch expires (410) or
    breaks. Yields ("ADDED" | "MODIFIED" | "DELETED", object)."""
    while True:
        try:
            listed = (await http.get(path, params={"limit": 500})).raise_for_status().json()
            items, cont = listed["items"], listed["metadata"].get("continue")
            while cont:
                more = (await http.get(path, params={"limit": 500, "continue": cont})).raise_for_status().json()
                items, cont = items + more["items"], more["metadata"].get("continue")
            for obj in items:
                yield "ADDED", obj
            rv = listed["metadata"]["resourceVersion"]
            while True:
                params = {"watch": "1", "resourceVersion": rv, "allowWatchBookmarks": "true", "timeoutSeconds": "300"}
                async with http.stream("GET", path, params=params, timeout=httpx.Timeout(10, read=330)) as resp:
                    resp.raise_for_status()
                    async for line in resp.aiter_lines():
                        if not line:
                            continue
                        event = json.loads(line)
                        if event["type"] == "ERROR":
                            raise _Expired()
                        rv = event["object"]["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            yield event["type"], event["object"]
        except (_Expired, httpx.HTTPError) as exc:
            log.info("watch of %s restarts: %r", path, exc)
            await asyncio.sleep(0.5)


class _Expired(Exception):
    """The watch's resourceVersion is too old: list again."""


ANSWER_SECONDS = 120.0


class FleetProcess:
    """The fleet in a process of its own: its own interpreter lock and core, so the measuring
    process (creating runs from 16 threads, reading metrics) cannot delay a worker's renewal."""

    def __init__(self, kubeconfig_path: Path, namespace: str, plan: Plan) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(str(kubeconfig_path), namespace, plan, child),
                                daemon=True, name=f"fleet-{namespace}")
        self.proc.start()
        child.close()
        self._lock = threading.Lock()

    def _ask(self, *message: Any) -> Any:
        with self._lock:
            self._conn.send(message)
            # A deadline rather than a bare recv(): a fleet process that stops answering (seen once
            # in a smoke test on a loaded machine, both ends in recv) fails the measurement, saying
            # what it asked, instead of hanging the suite past pytest's own timeout.
            if not self._conn.poll(ANSWER_SECONDS):
                raise TimeoutError(f"the fleet process ({self.proc.pid}, alive: {self.proc.is_alive()}) did not "
                                   f"answer {message[0]!r} within {ANSWER_SECONDS:.0f}s")
            return self._conn.recv()

    def renewing(self) -> int:
        """How many runs have a worker that renewed at least once."""
        return int(self._ask("renewing"))

    def freeze(self, at: dict[str, float]) -> None:
        """Run name -> wall-clock time at which its worker stops renewing."""
        self._ask("freeze", at)

    def stats(self) -> FleetStats:
        return self._ask("stats")  # type: ignore[no-any-return]

    def stop(self) -> None:
        try:
            self._ask("stop")
        except (EOFError, OSError):
            pass  # already gone
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


def _serve(kubeconfig_path: str, namespace: str, plan: Plan, conn: Any) -> None:
    """The fleet process: the fleet on this thread's loop, commands answered from another."""
    logging.basicConfig(level=logging.WARNING)
    loop = asyncio.new_event_loop()
    fleet = Fleet(kubeconfig.load(kubeconfig_path), namespace, lambda _: plan)
    running = loop.create_task(fleet.run())

    async def stats() -> FleetStats:  # a copy taken on the loop, never while a worker updates it
        return replace(fleet.stats, played=copy.deepcopy(fleet.stats.played), counts=Counter(fleet.stats.counts),
                       renew_seconds=deque(fleet.stats.renew_seconds, maxlen=5000),
                       slot_wait_seconds=deque(fleet.stats.slot_wait_seconds, maxlen=5000))

    async def renewing() -> int:
        return len({p.run for p in fleet.stats.played.values() if p.renewals})

    async def stop() -> None:
        running.cancel()
        await fleet.close()

    def commands() -> None:
        while True:
            try:
                what, *args = conn.recv()
            except EOFError:  # the measuring process is gone
                what, args = "stop", []
            if what == "freeze":
                loop.call_soon_threadsafe(fleet.freeze_at.update, args[0])
                answer: Any = None
            elif what == "stats":
                answer = asyncio.run_coroutine_threadsafe(stats(), loop).result()
            elif what == "renewing":
                answer = asyncio.run_coroutine_threadsafe(renewing(), loop).result()
            else:
                asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=60)
                loop.call_soon_threadsafe(loop.stop)
                with contextlib.suppress(OSError):
                    conn.send(None)
                return
            conn.send(answer)

    threading.Thread(target=commands, daemon=True).start()
    loop.run_forever()
