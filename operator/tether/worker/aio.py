"""The worker SDK for asyncio programs: the same protocol as tether.worker.WorkerRun, without ever
blocking the event loop.

    async with AsyncWorkerRun.from_env() as run:        # first renewal, then a heartbeat task
        async with run.http_client() as http:
            await http.effect("POST", url, operation="step-1", json={...})
        run.checkpoint("1")
        await run.complete({"ok": True})

The rules (self-fencing, renewal bookkeeping, publication retries until the lease deadline, the
approval wait) are tether.worker.core's, shared with WorkerRun; this module drives them with awaits:
the heartbeat is a task, renewals are serialised by an asyncio.Lock, waits are asyncio.sleep, and
everything that reads files or may run a credential plugin (the kubeconfig, TLS contexts) runs on a
thread. A blocked event loop stops the heartbeat too: run blocking work with asyncio.to_thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from typing import Any, Mapping

import httpx

from tether.kube import config as kubeconfig
from tether.worker.core import RunCore
from tether import protocol
from tether.worker.errors import AlreadyPublished, LeaseLost, OwnershipUnknown, ToolTimeout
from tether.worker.gateway_steps import claim_steps
from tether.worker.ops import (ApprovalDecision, Op, Renew, Sleep, Transported, claimed, from_env_fields,
                               inline_payload, payload_steps, request_timeout)
from tether.worker.run import Terminated, renewal_lock_busy
from tether.worker.spawning import Child
from tether.worker.steps import Call, drive_async
from tether.worker.transport import (AsyncGatewayTransport, AsyncKubeTransport, AsyncTransport, claimed_transport,
                                     gateway_client, send_async)

__all__ = ["AsyncFencedClient", "AsyncWorkerRun", "load_payload_async"]

log = logging.getLogger("tether.worker")


async def load_payload_async(env: Mapping[str, str], kube: kubeconfig.KubeConfig, attempts: int = 3,
                             backoff: float = 1.0) -> dict[str, Any]:
    """tether.worker.run.load_payload with an asyncio client (the same steps)."""
    inline = inline_payload(env)
    if inline is not None:
        return inline
    async with kube.async_client(timeout=30) as http:
        return await drive_async(payload_steps(env, attempts, backoff),
                                 lambda step: send_async(http, step) if isinstance(step, Call)
                                 else asyncio.sleep(step.seconds))


class AsyncWorkerRun(RunCore):
    """One attempt of a run, as seen by an asyncio worker that holds it."""

    def __init__(self, *, kube: kubeconfig.KubeConfig | None = None, transport: AsyncTransport | None = None,
                 run_uid: str | None = None, **kw: Any) -> None:
        """kw: RunCore's (name, namespace, holder, fence, attempt, lease_duration, renew_interval, ...).
        Without a transport, the pod's one is made in start(): loading a kubeconfig reads files."""
        super().__init__(**kw)
        self._transport: AsyncTransport | None = transport
        self._kube, self._run_uid = kube, run_uid
        self._payload_env: Mapping[str, str] | None = None  # the payload is read from the run in start()
        # One renewal at a time (docs/protocol.md §3), as WorkerRun's threading.Lock.
        self._renewing = asyncio.Lock()
        # T (docs/protocol.md §3) bounds a whole renewal and the wait for this lock: httpx's own
        # timeout does not cover an exec credential plugin refreshing the token on a thread.
        self._request_timeout = request_timeout(self.renew_interval)
        self._stopping = False
        self._wake = asyncio.Event()
        self._signal_event = asyncio.Event()  # new signals arrived (request_approval waits on it)
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The task doing the run's work, which SIGTERM cancels: the one entering `async with`, else
        # the one that called start(). Done (start() ran in a task of its own, as wait_for(start())
        # on Python 3.11 does): SIGTERM ends the process as WorkerRun's handler does.
        self._owner: asyncio.Task[Any] | None = None
        self._terminated = False
        self._closed = False

    # --- construction --------------------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kw: Any) -> "AsyncWorkerRun":
        """Reads what the operator put into the pod's environment. Does no I/O, so it can be
        entered at once (`async with AsyncWorkerRun.from_env() as run`): a payload too large for the
        environment (TETHER_PAYLOAD_FROM) is read from the run in start(), before the first renewal."""
        e = os.environ if env is None else env
        inline = inline_payload(e)
        run = cls(**from_env_fields(e), payload=inline, **kw)
        run._payload_env = e if inline is None else None
        return run

    @classmethod
    async def claim(cls, gateway: str, namespace: str, name: str, token: str, worker_id: str | None = None,
                    verify: Any = True, **kw: Any) -> "AsyncWorkerRun":
        """An external worker: claims the run's open attempt through the Tether gateway (raises as
        WorkerRun.claim does). Enter the run it returns: `async with await AsyncWorkerRun.claim(...)`."""
        # An httpx client loads its TLS trust store from disk: made on a thread.
        http = await asyncio.to_thread(gateway_client, httpx.AsyncClient, gateway, token, 30, verify)
        async with http:
            doc = await drive_async(claim_steps(namespace, name, worker_id), lambda call: send_async(http, call))
        transport = await asyncio.to_thread(claimed_transport, AsyncGatewayTransport, gateway, namespace, name,
                                            token, doc, verify, worker_id)
        return cls(name=name, namespace=namespace, transport=transport, **claimed(doc), **kw)

    async def _connect(self) -> AsyncTransport:
        if self._transport is None:
            kube = self._kube or await asyncio.to_thread(kubeconfig.load)
            if self._payload_env is not None:
                self.payload = await load_payload_async(self._payload_env, kube)
            http = await asyncio.to_thread(kube.async_client, request_timeout(self.renew_interval))
            self._transport = AsyncKubeTransport(self.namespace, self.name, self.holder, self.fence, http,
                                                 run_uid=self._run_uid, own_client=True)
        return self._transport

    # --- the ops of tether.worker.core, done with awaits ----------------------------

    async def _perform(self, op: Op) -> Any:
        if isinstance(op, Transported):
            transport = await self._connect()
            # Each try within T (a renewal) or TP (a publication, its read-back), whatever it waits
            # for: past that it is a try without an answer, as the protocol's timeouts make it.
            bound = self._request_timeout if op.operation == "renew" else protocol.PUBLICATION_TIMEOUT
            return await _bounded(getattr(transport, op.operation)(*op.args), bound, op.operation)
        if isinstance(op, Renew):
            return await (self._renew_logged() if op.logged else self.renew())
        if isinstance(op, Sleep):
            await asyncio.sleep(op.seconds)
            return None
        self._signal_event.clear()
        try:
            await asyncio.wait_for(self._signal_event.wait(), timeout=op.timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _on_signals(self) -> None:
        self._signal_event.set()  # renewals run on the loop: no other thread sets it

    def _wake_heartbeat(self) -> None:
        # checkpoint(flush=True) may come from another thread (a metering wrapper): an asyncio.Event
        # is set from its own loop's thread only.
        loop = self._loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or loop is here:
            self._wake.set()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    # --- heartbeat -----------------------------------------------------------

    async def start(self) -> "AsyncWorkerRun":
        """Reads the payload if it must, renews once (so ownership is confirmed before any work),
        then heartbeats on a task of its own."""
        if self._task is None and not self._closed:
            self._loop = asyncio.get_running_loop()
            if self._owner is None or self._owner.done():
                self._owner = asyncio.current_task()
            _watch_sigterm(self)
            try:
                await self._connect()
                await self.renew()
            except BaseException:
                await self._close()  # SIGTERM or a cancellation during start-up: nothing to report yet
                raise
            self._task = asyncio.create_task(self._heartbeat(), name=f"tether-heartbeat-{self.name}")
        return self

    async def stop(self) -> None:
        """Ends the heartbeat. Leaving without publishing still reports what was spent and how far it
        got with one last renewal (RunCore._owes_last_renewal)."""
        if self._closed or self._stopping:  # a second stop() (the program's and `async with`'s) sends nothing
            return
        self._stopping = True
        self._wake.set()
        task = self._task
        try:
            if task is not None and not task.done():
                # Let a renewal in flight end (it is bounded by T) rather than cancel it: answered, it
                # confirms or denies; cancelled, it would be neither.
                await asyncio.wait({task}, timeout=self.renew_interval + 15)
            if self._owes_last_renewal(task is not None):
                try:
                    if await self._lock_renewals():
                        try:
                            await drive_async(self._renew_ops(), self._perform)
                        finally:
                            self._renewing.release()
                except Exception as exc:  # noqa: BLE001 - leaving must not fail; what was not reported is not charged
                    log.warning("last renewal failed", extra=self._fields("heartbeat_unanswered", error=str(exc)[:300]))
        finally:
            await self._close()

    async def _close(self) -> None:
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()  # only when stop() itself was cancelled or the renewal outlived its bound
        _unwatch_sigterm(self)
        if self._transport is not None:
            await self._transport.aclose()

    async def _heartbeat(self) -> None:
        while not self._stopping and not self._lost and not self._finished:
            await self._renew_logged()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.renew_interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def _renew_logged(self) -> bool:
        """A renewal whose failure, whatever it is, only leaves ownership unconfirmed (the heartbeat
        must outlive any one failure; the renewal before publishing must not stop the publication)."""
        try:
            return await self.renew()
        except Exception as exc:  # noqa: BLE001 - a bug; logged, and ownership turns unknown on schedule
            self._renewal_failed(exc)
            return False

    @property
    def heartbeating(self) -> bool:
        """Whether the heartbeat task is running."""
        return self._task is not None and not self._task.done()

    async def renew(self) -> bool:
        """One heartbeat: a conditional update of the Lease. Returns True when confirmed."""
        if self.lost:
            return False
        if not await self._lock_renewals():
            return False
        try:
            return await drive_async(self._renew_ops(), self._perform)
        finally:
            self._renewing.release()

    async def _lock_renewals(self) -> bool:
        """Takes the renewal lock within T (a renewal holding it is itself bounded by T); False, and
        the renewal counts as unanswered, when it is not free by then."""
        if not self._renewing.locked():
            return await self._renewing.acquire()  # free: taken at once, without a task for the bound
        try:
            await asyncio.wait_for(self._renewing.acquire(), self._request_timeout)
            return True
        except asyncio.TimeoutError:
            return renewal_lock_busy(self, self._request_timeout)

    # --- approvals and results ------------------------------------------------------

    async def request_approval(self, name: str, details: str = "", timeout: int | None = None,
                               poll: float = 2.0) -> ApprovalDecision:
        """WorkerRun.request_approval, awaiting the decision instead of blocking."""
        return await drive_async(self._approval_ops(name, details, timeout, poll), self._perform)

    async def spawn(self, key: str, *, class_name: str | None = None, payload: dict[str, Any] | None = None,
                    cap_cents: int | None = None, max_tokens: int | None = None,
                    spec: dict[str, Any] | None = None) -> Child:
        """WorkerRun.spawn, awaiting the API server; `await child.result()` waits for the child."""
        child = await drive_async(self._spawn_ops(key, class_name, payload, cap_cents, max_tokens, spec),
                                  self._perform)
        child._wait = lambda c, timeout, poll: drive_async(self._result_ops(c, timeout, poll), self._perform)
        return child

    async def call(self, key: str, *, timeout: float | None = None, poll: float = 2.0,
                   **spawn: Any) -> dict[str, Any]:
        """spawn() and await the child's result (ChildFailed if it ends without one)."""
        child = await self.spawn(key, **spawn)
        result: dict[str, Any] = await child.result(timeout=timeout, poll=poll)
        return result

    async def complete(self, result: dict[str, Any]) -> None:
        """Publishes the result with one fenced write (raises as WorkerRun.complete does: one
        publication per attempt, AlreadyPublished for any other). Cancelled or timed out once its
        try was sent, the publication is in doubt: only the same value may be published again,
        which reads back first whether the earlier try landed."""
        await self._publish("result", result)

    async def fail(self, code: str, message: str = "") -> None:
        """Publishes a failure with one fenced write; retry rules decide what follows."""
        await self._publish("error", {"code": code, "message": message})

    async def _publish(self, field: str, value: dict[str, Any]) -> None:
        retry = self._claim_publication(field, value)  # before any await: one caller gets through
        try:
            await drive_async(self._publish_ops(field, value, retry), self._perform)
        finally:
            self._release_publication()

    def http_client(self, timeout: float = 30.0, **kw: Any) -> "AsyncFencedClient":
        return AsyncFencedClient(self, timeout=timeout, **kw)

    # --- context manager -------------------------------------------------------

    async def __aenter__(self) -> "AsyncWorkerRun":
        self._owner = asyncio.current_task()  # the task that does the work inside `async with`
        try:
            return await self.start()
        except asyncio.CancelledError:
            self._raise_if_terminated()
            raise

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            # Being terminated (SIGTERM), cancelled or interrupted is not the run failing.
            if self._fails_on_exit(exc, (Terminated, KeyboardInterrupt, asyncio.CancelledError)):
                try:
                    await self.fail(type(exc).__name__, str(exc)[:500])
                except (LeaseLost, OwnershipUnknown, AlreadyPublished, httpx.HTTPError):
                    pass
        except asyncio.CancelledError:  # SIGTERM while publishing the failure: stop() still runs
            self._raise_if_terminated()
            raise
        finally:
            try:
                await self.stop()
            except asyncio.CancelledError:  # SIGTERM during the last renewal: stop() closed anyway
                self._raise_if_terminated()
                raise
        if isinstance(exc, asyncio.CancelledError):
            self._raise_if_terminated()

    def _raise_if_terminated(self) -> None:
        """The cancellation SIGTERM caused ends the process with 143, as WorkerRun's handler does."""
        if self._terminated:
            raise Terminated(128 + signal.SIGTERM) from None


class AsyncFencedClient(httpx.AsyncClient):
    """httpx.AsyncClient for side effects: every request carries the fence, and a request is only
    started while ownership is confirmed (self-fencing)."""

    def __init__(self, run: AsyncWorkerRun, **kw: Any) -> None:
        super().__init__(**kw)
        self.run = run

    async def effect(self, method: str, url: str, operation: str, **kw: Any) -> httpx.Response:
        """Sends one side effect with Idempotency-Key `<idempotencyKey>:<operation>`."""
        with self.run.trace.effect(method, url, operation) as span:
            kw = self.run._effect_request(operation, kw)
            try:
                response = await self.request(method, url, **kw)
            except httpx.TimeoutException as exc:
                raise ToolTimeout(f"{method} {url} did not answer: {exc}") from exc
            span.set_attribute("http.response.status_code", response.status_code)
            return response


# SIGTERM (docs/protocol.md §4.2): the runs started on each loop. The loop's handler marks them
# terminated and cancels the tasks that started them, so each `async with` unwinds through stop()
# (the last renewal reports what was spent), publishes nothing, and raises Terminated (143).
_WATCHED: dict[asyncio.AbstractEventLoop, set[AsyncWorkerRun]] = {}


def _watch_sigterm(run: AsyncWorkerRun) -> None:
    loop = asyncio.get_running_loop()
    runs = _WATCHED.get(loop)
    if runs is None:
        # A program that set its own SIGTERM handler keeps it; loop handlers need the main thread.
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        try:
            loop.add_signal_handler(signal.SIGTERM, _terminate, loop)
        except (NotImplementedError, RuntimeError):
            return  # a loop without signal support (Windows' proactor)
        runs = _WATCHED[loop] = set()
    runs.add(run)


def _unwatch_sigterm(run: AsyncWorkerRun) -> None:
    loop = run._loop
    runs = _WATCHED.get(loop) if loop is not None else None
    if runs is None:
        return
    runs.discard(run)
    if not runs and loop is not None:
        del _WATCHED[loop]
        if not loop.is_closed():
            loop.remove_signal_handler(signal.SIGTERM)  # back to the default: the process ends


def _terminate(loop: asyncio.AbstractEventLoop) -> None:
    orphaned = False
    for run in list(_WATCHED.get(loop, ())):
        run._terminated = True
        if run._owner is not None and not run._owner.done():
            run._owner.cancel()
        else:
            orphaned = True
    if orphaned:
        # No task of the run's own to cancel (start() ran in one that has ended): end the process as
        # WorkerRun's handler does. SystemExit leaves the loop; asyncio.run then cancels every task,
        # so a `finally: await run.stop()` still sends the last renewal, and the process exits 143.
        raise Terminated(128 + signal.SIGTERM)


async def _bounded(awaitable: Any, seconds: float, what: str) -> Any:
    """Awaits `awaitable` for at most `seconds`; past that, raises httpx.TimeoutException (no answer)
    and abandons it, cancelled, even where a cancellation does not reach at once (a thread)."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except BaseException:
        task.cancel()
        raise
    if not done:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody awaits it any more
        raise httpx.TimeoutException(f"{what}: no answer within {seconds:g}s")
    return task.result()
