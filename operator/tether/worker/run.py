"""The worker side of the ownership protocol, for pods that run Python (blocking code).

A worker renews its run's Lease on a thread of its own (a blocked tool call must not stop the
heartbeat), with the resourceVersion it last saw, so a renewal can only succeed while the lease is
still its own. It fences itself on a monotonic clock, and publishes its result with one JSON patch
that tests its fence and holder first. The rules are tether.worker.core's, shared with the asyncio
flavour (tether.worker.aio); this module only drives them with a thread and blocking calls.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Mapping

import httpx

from tether.kube import config as kubeconfig
from tether.worker.core import MAX_CURSOR, RunCore
from tether.worker.errors import AlreadyPublished, LeaseLost, OwnershipUnknown, ToolTimeout
from tether.worker.gateway_steps import claim_steps
from tether.worker.ops import (ApprovalDecision, ControlSignals, Op, Renew, Sleep, Transported, claimed,
                               from_env_fields, inline_payload, payload_steps, request_timeout, retry_after)
from tether.worker.spawning import Child
from tether.worker.steps import Call, drive
from tether.worker.transport import GatewayTransport, KubeTransport, Transport, claimed_transport, gateway_client, send

__all__ = ["MAX_CURSOR", "ApprovalDecision", "ControlSignals", "FencedClient", "Terminated", "WorkerRun",
           "load_payload", "retry_after"]

log = logging.getLogger("tether.worker")


def load_payload(env: Mapping[str, str], kube: kubeconfig.KubeConfig | None = None,
                 attempts: int = 3, backoff: float = 1.0) -> dict[str, Any]:
    """The run's payload: inline in TETHER_PAYLOAD, or, when it was too large for the environment
    (TETHER_PAYLOAD_FROM=spec.payload), read from the pod's own WorkerRun with its own credentials."""
    inline = inline_payload(env)
    if inline is not None:
        return inline
    with (kube or kubeconfig.load()).sync_client(timeout=30) as http:
        return drive(payload_steps(env, attempts, backoff),
                     lambda step: send(http, step) if isinstance(step, Call) else time.sleep(step.seconds))


class WorkerRun(RunCore):
    """One attempt of a run, as seen by the worker that holds it."""

    def __init__(self, *, kube: kubeconfig.KubeConfig | None = None, transport: Transport | None = None,
                 run_uid: str | None = None, **kw: Any) -> None:
        """kw: RunCore's (name, namespace, holder, fence, attempt, lease_duration, renew_interval, ...)."""
        super().__init__(**kw)
        # T (docs/protocol.md §3): each request's timeout, and the wait for the renewal lock.
        self._request_timeout = request_timeout(self.renew_interval)
        self._transport: Transport = transport or KubeTransport(
            self.namespace, self.name, self.holder, self.fence, kube or kubeconfig.load(),
            timeout=self._request_timeout, run_uid=run_uid)
        # One renewal at a time: the heartbeat, a flush and the renewal before publishing share the
        # cached Lease, and an older checkpoint or usage must never overtake a newer one.
        self._renewing = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._signal_event = threading.Event()  # new signals arrived (request_approval waits on it)
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- construction --------------------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kw: Any) -> "WorkerRun":
        """Reads what the operator put into the pod's environment."""
        e = os.environ if env is None else env
        return cls(**from_env_fields(e), payload=load_payload(e, kw.get("kube")), **kw)

    @classmethod
    def claim(cls, gateway: str, namespace: str, name: str, token: str, worker_id: str | None = None,
              verify: Any = True, **kw: Any) -> "WorkerRun":
        """An external worker: claims the run's open attempt through the Tether gateway.

        Raises ClaimRefused (with the HTTP status: 402 budget, 409 held or nothing open, ...);
        TetherWorkerError when a 200 is not the gateway's claim reply; httpx.HTTPError on no answer.
        """
        with gateway_client(httpx.Client, gateway, token, 30, verify) as http:
            doc = drive(claim_steps(namespace, name, worker_id), lambda call: send(http, call))
        transport = claimed_transport(GatewayTransport, gateway, namespace, name, token, doc, verify, worker_id)
        return cls(name=name, namespace=namespace, transport=transport, **claimed(doc), **kw)

    # --- the ops of tether.worker.core, done with blocking calls ------------------

    def _perform(self, op: Op) -> Any:
        if isinstance(op, Transported):
            return getattr(self._transport, op.operation)(*op.args)
        if isinstance(op, Renew):
            return self._renew_logged() if op.logged else self.renew()
        if isinstance(op, Sleep):
            time.sleep(op.seconds)
            return None
        self._signal_event.clear()
        return self._signal_event.wait(timeout=op.timeout)

    def _on_signals(self) -> None:
        self._signal_event.set()

    def _wake_heartbeat(self) -> None:
        self._wake.set()

    # --- heartbeat -----------------------------------------------------------

    def start(self) -> "WorkerRun":
        """Renews once (so ownership is confirmed before any work), then heartbeats on a thread."""
        if self._thread is None:
            _exit_on_sigterm()
            self.renew()
            self._thread = threading.Thread(target=self._heartbeat_loop, name="tether-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the heartbeat. A worker that leaves without publishing (stopped, gave up) still
        reports what it spent and how far it got with one last renewal."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.renew_interval + 15)
        if self._owes_last_renewal(self._thread is not None):
            try:
                if self._lock_renewals():
                    try:
                        drive(self._renew_ops(), self._perform)
                    finally:
                        self._renewing.release()
            except Exception as exc:  # noqa: BLE001 - leaving must not fail; what was not reported is not charged
                log.warning("last renewal failed", extra=self._fields("heartbeat_unanswered", error=str(exc)[:300]))
        self._transport.close()

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set() and not self._lost and not self._finished:
            self._renew_logged()
            self._wake.wait(timeout=self.renew_interval)
            self._wake.clear()

    def _renew_logged(self) -> bool:
        """A renewal whose failure, whatever it is, only leaves ownership unconfirmed: for the
        heartbeat, which must outlive any one failure, and the renewal before publishing, which must
        not stop the publication (docs/protocol.md §5.4)."""
        try:
            return self.renew()
        except Exception as exc:  # noqa: BLE001 - a bug; logged, and ownership turns unknown on schedule
            self._renewal_failed(exc)
            return False

    @property
    def heartbeating(self) -> bool:
        """Whether the heartbeat thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def renew(self) -> bool:
        """One heartbeat: a conditional update of the Lease. Returns True when confirmed."""
        if self.lost or not self._lock_renewals():
            return False
        try:
            return drive(self._renew_ops(), self._perform)
        finally:
            self._renewing.release()

    def _lock_renewals(self) -> bool:
        """Takes the renewal lock within T, as AsyncWorkerRun does: the renewal holding it may wait
        far longer (an exec credential plugin, up to EXEC_TIMEOUT), and complete(), fail() and
        stop() must not."""
        return self._renewing.acquire(timeout=self._request_timeout) or renewal_lock_busy(self, self._request_timeout)

    # --- approvals and results ------------------------------------------------------

    def request_approval(self, name: str, details: str = "", timeout: int | None = None,
                         poll: float = 2.0) -> ApprovalDecision:
        """Asks a person to approve a step (a WorkerRunApproval with gate `name`), and blocks until
        the control plane says Approve, Deny or TimedOut (after `timeout` seconds, counted by the
        operator from when it saw the request). The request rides on this attempt's renewals, which
        only its holder can write; the decision comes back on them, and only for this attempt.
        While waiting, it renews every `poll` seconds so the decision arrives promptly.

        Raises ValueError for a request the control plane would refuse, and LeaseLost,
        OwnershipUnknown or StopRequested when the attempt cannot act on any decision. Asking
        again for a decided name returns that decision."""
        return drive(self._approval_ops(name, details, timeout, poll), self._perform)

    def spawn(self, key: str, *, class_name: str | None = None, payload: dict[str, Any] | None = None,
              cap_cents: int | None = None, max_tokens: int | None = None,
              spec: dict[str, Any] | None = None) -> Child:
        """Spawns one tool call as a child run of this one (docs/children.md): a WorkerRun of class
        `class_name` with `payload`, its share of the tree's caps (`cap_cents`, `max_tokens`: required
        when this run has such a cap) and any other spec fields in `spec`. `key` names the call
        stably: spawning it again, from this attempt or a later one that resumed from a checkpoint,
        finds the same child instead of creating another; the same key with another spec raises
        SpawnConflict. Raises SpawnRefused when the API server refuses it, and LeaseLost,
        OwnershipUnknown or StopRequested when this attempt may not act. `child.result()` waits."""
        child = drive(self._spawn_ops(key, class_name, payload, cap_cents, max_tokens, spec), self._perform)
        child._wait = lambda c, timeout, poll: drive(self._result_ops(c, timeout, poll), self._perform)
        return child

    def call(self, key: str, *, timeout: float | None = None, poll: float = 2.0, **spawn: Any) -> dict[str, Any]:
        """spawn() and wait for the child's result (ChildFailed if it ends without one)."""
        result: dict[str, Any] = self.spawn(key, **spawn).result(timeout=timeout, poll=poll)
        return result

    def complete(self, result: dict[str, Any]) -> None:
        """Publishes the result with one fenced JSON patch. Raises LeaseLost if rejected because
        the run moved on, ResultInvalid if the value itself was refused (still the owner),
        AlreadyPublished if this attempt published (or is publishing) already: one per attempt."""
        self._publish("result", result)

    def fail(self, code: str, message: str = "") -> None:
        """Publishes a failure with one fenced JSON patch; retry rules decide what follows."""
        self._publish("error", {"code": code, "message": message})

    def _publish(self, field: str, value: dict[str, Any]) -> None:
        retry = self._claim_publication(field, value)  # under the state's lock: one caller gets through
        try:
            drive(self._publish_ops(field, value, retry), self._perform)
        finally:
            self._release_publication()

    # --- side effects ----------------------------------------------------------

    def http_client(self, timeout: float = 30.0, **kw: Any) -> "FencedClient":
        return FencedClient(self, timeout=timeout, **kw)

    # --- context manager -------------------------------------------------------

    def __enter__(self) -> "WorkerRun":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            # Being terminated (SIGTERM, below; Ctrl-C) is not the run failing.
            if self._fails_on_exit(exc, (Terminated, KeyboardInterrupt)):
                try:
                    self.fail(type(exc).__name__, str(exc)[:500])
                except (LeaseLost, OwnershipUnknown, AlreadyPublished, httpx.HTTPError):
                    pass
        finally:
            self.stop()


def renewal_lock_busy(run: RunCore, waited: float) -> bool:
    """Both flavours' renewal that did not get the renewal lock within T: not sent, it counts as
    unanswered (ownership turns unknown on schedule if none is confirmed)."""
    log.warning("renewal not sent: another one held the lock", extra=run._fields(
        "heartbeat_unanswered", error=f"the renewal lock was not free within {waited:g}s"))
    return False


class FencedClient(httpx.Client):
    """httpx client for side effects: every request carries the fence, and a request
    is only started while ownership is confirmed (self-fencing)."""

    def __init__(self, run: WorkerRun, **kw: Any) -> None:
        super().__init__(**kw)
        self.run = run

    def effect(self, method: str, url: str, operation: str, **kw: Any) -> httpx.Response:
        """Sends one side effect with Idempotency-Key `<idempotencyKey>:<operation>`."""
        with self.run.trace.effect(method, url, operation) as span:
            kw = self.run._effect_request(operation, kw)
            try:
                response = self.request(method, url, **kw)
            except httpx.TimeoutException as exc:
                raise ToolTimeout(f"{method} {url} did not answer: {exc}") from exc
            span.set_attribute("http.response.status_code", response.status_code)
            return response


def _exit_on_sigterm() -> None:
    """In a container the worker is usually PID 1, and PID 1 ignores SIGTERM unless it has a handler:
    a deleted pod would sit out its whole grace period and die by SIGKILL (exit 137). Exit as any
    other process would (143), through `with`/`stop()`, so what was spent is still reported. A
    program that set its own SIGTERM handler keeps it."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)


class Terminated(SystemExit):
    """SIGTERM, as the SDK's handler raises it: the process ends (143), the run does not fail."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(128 + signum)
