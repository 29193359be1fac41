"""The worker side of the ownership protocol, for pods that run Python.

A worker renews its run's Lease on a thread of its own (a blocked tool call
must not stop the heartbeat), with the resourceVersion it last saw, so a
renewal can only succeed while the lease is still its own. It fences itself
on a monotonic clock, and publishes its result with one JSON patch that tests
its fence and holder first.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
import json
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Mapping

import httpx

from tether import protocol
from tether.api import constants as c
from tether.api.models import GROUP, PLURAL, VERSION, Signals, Usage
from tether.kube import config as kubeconfig
from tether.worker.errors import (ClaimRefused, LeaseLost, OwnershipUnknown, ResultInvalid, StopRequested,
                                  TetherWorkerError, ToolTimeout)
from tether.worker.transport import GatewayTransport, KubeTransport, Transport, error_body

log = logging.getLogger("tether.worker")

MAX_CURSOR = 1024  # characters: what the operator and the gateway take (docs/protocol.md §5.2)


def load_payload(env: Mapping[str, str], kube: kubeconfig.KubeConfig | None = None,
                 attempts: int = 3, backoff: float = 1.0) -> dict[str, Any]:
    """The run's payload: inline in TETHER_PAYLOAD, or, when it was too large for the environment
    (TETHER_PAYLOAD_FROM=spec.payload), read from the pod's own WorkerRun with its own credentials."""
    if c.ENV_PAYLOAD in env:
        return json.loads(env[c.ENV_PAYLOAD] or "{}")
    source = env.get(c.ENV_PAYLOAD_FROM)
    if source is None:
        return {}
    if source != c.PAYLOAD_FROM_RUN:
        raise ValueError(f"{c.ENV_PAYLOAD_FROM}={source!r}: this SDK reads only {c.PAYLOAD_FROM_RUN!r}")
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{env[c.ENV_NAMESPACE]}/{PLURAL}/{env[c.ENV_RUN]}"
    with (kube or kubeconfig.load()).sync_client(timeout=30) as http:
        for attempt in range(attempts):
            try:
                resp = http.get(path)
                if resp.status_code < 500 or attempt + 1 == attempts:
                    resp.raise_for_status()  # 403/404 will not heal: the attempt fails and says why
                    run = resp.json()
                    uid = env.get(c.ENV_RUN_UID)
                    if uid and (run.get("metadata") or {}).get("uid") != uid:
                        # Re-created under the same name since this pod started: not our input.
                        raise LeaseLost(f"{env[c.ENV_RUN]} was re-created (uid {uid} is gone)")
                    return run.get("spec", {}).get("payload") or {}
            except httpx.TransportError:
                if attempt + 1 == attempts:
                    raise
            time.sleep(backoff * 2**attempt)  # a brief API hiccup at start-up should not cost the attempt
    raise AssertionError("unreachable: the last attempt returns or raises")


@dataclass(frozen=True)
class ApprovalDecision:
    """A person's decision on a request_approval: Approve, Deny or TimedOut."""

    decision: str
    reason: str | None = None
    approver: str | None = None

    @property
    def approved(self) -> bool:
        return self.decision == "Approve"


@dataclass(frozen=True)
class ControlSignals:
    """What the control plane says, as of the last confirmed heartbeat."""

    stop: bool = False
    paused: bool = False
    reason: str | None = None
    ends_at: dt.datetime | None = None
    cap_remaining_cents: int | None = None
    cap_remaining_tokens: int | None = None
    # With stop: Kueue evicted the run. Checkpoint and exit: the run is queued again and its next
    # attempt resumes from the checkpoint; at stop_by the attempt is revoked whatever happens.
    yielding: bool = False
    stop_by: dt.datetime | None = None


class WorkerRun:
    """One attempt of a run, as seen by the worker that holds it."""

    def __init__(
        self,
        *,
        name: str,
        namespace: str,
        holder: str,
        fence: int,
        attempt: int,
        lease_duration: float,
        renew_interval: float,
        payload: dict[str, Any] | None = None,
        checkpoint: str | None = None,
        idempotency_key: str = "",
        kube: kubeconfig.KubeConfig | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        margin: float | None = None,
        transport: Transport | None = None,
        run_uid: str | None = None,
        review_feedback: str | None = None,
    ) -> None:
        self.name = name
        self.namespace = namespace
        self.holder = holder
        self.fence = fence
        self.attempt = attempt
        self.lease_duration = float(lease_duration)
        self.renew_interval = float(renew_interval)
        self.payload = payload or {}
        self.checkpoint_cursor = checkpoint
        # Why a person denied the previous attempt's result (spec.review.result), for this one to act on.
        self.review_feedback = review_feedback
        self.idempotency_key = idempotency_key or f"{namespace}/{name}"
        self.margin = margin if margin is not None else max(1.0, 0.1 * self.lease_duration)
        self._mono = monotonic
        self._transport: Transport = transport or KubeTransport(
            namespace, name, holder, fence, kube or kubeconfig.load(), timeout=min(10.0, max(self.renew_interval, 1.0)),
            run_uid=run_uid)
        self._lock = threading.Lock()
        # One renewal at a time: the heartbeat, a flush and the renewal before publishing share the
        # cached Lease, and an older checkpoint or usage must never overtake a newer one.
        self._renewing = threading.Lock()
        # Nothing is confirmed until the first renewal succeeds (start() does one at once).
        self._confirmed_at = float("-inf")
        self._lost = threading.Event()
        self._finished = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pending_checkpoint: str | None = None
        self._usage: Usage | None = None
        self._signals = Signals()
        self.signals_seen_at: float | None = None  # monotonic time the current signals arrived
        self._signalled = threading.Event()  # new signals arrived (request_approval waits on it)
        self._requests: dict[str, protocol.ApprovalRequest] = {}

    # --- construction --------------------------------------------------------

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **kw: Any) -> "WorkerRun":
        """Reads what the operator put into the pod's environment."""
        e = os.environ if env is None else env
        return cls(
            name=e[c.ENV_RUN],
            namespace=e[c.ENV_NAMESPACE],
            holder=e[c.ENV_HOLDER],
            fence=int(e[c.ENV_FENCE]),
            attempt=int(e[c.ENV_ATTEMPT]),
            lease_duration=float(e[c.ENV_LEASE_DURATION]),
            renew_interval=float(e[c.ENV_RENEW_INTERVAL]),
            payload=load_payload(e, kw.get("kube")),
            checkpoint=e.get(c.ENV_CHECKPOINT),
            idempotency_key=e.get(c.ENV_IDEMPOTENCY_KEY, ""),
            run_uid=e.get(c.ENV_RUN_UID) or None,
            review_feedback=e.get(c.ENV_REVIEW_FEEDBACK) or None,
            **kw,
        )

    @classmethod
    def claim(cls, gateway: str, namespace: str, name: str, token: str, worker_id: str | None = None,
              verify: Any = True, **kw: Any) -> "WorkerRun":
        """An external worker: claims the run's open attempt through the Tether gateway.

        Raises ClaimRefused (with the HTTP status: 402 budget, 409 held or nothing open, ...);
        TetherWorkerError when a 200 is not the gateway's claim reply; httpx.HTTPError on no answer.
        """
        body = {"workerId": worker_id} if worker_id else {}
        with httpx.Client(base_url=gateway, verify=verify, timeout=30,
                          headers={"Authorization": f"Bearer {token}"}) as http:
            resp = http.post(f"/api/v1/namespaces/{namespace}/workerruns/{name}/claim", json=body)
        if resp.status_code != 200:
            raise ClaimRefused(resp.status_code, error_body(resp))
        doc = protocol.claim_reply(resp.content)
        if doc is None:
            # Something in between answered (a proxy's page or `{}`): not a refusal, and the claim
            # may have landed, which the same claimant's next claim is answered alike for.
            raise TetherWorkerError(f"the claim's 200 is not the gateway's claim reply (claiming again is safe): "
                                    f"{resp.text[:200]}")
        transport = GatewayTransport(gateway, namespace, name, token, doc["holder"], doc["fence"],
                                     timeout=min(10.0, max(float(doc["renewIntervalSeconds"]), 1.0)), verify=verify,
                                     worker_id=worker_id, run_uid=doc["runUid"])
        transport.tool_claim = doc.get("toolClaim")
        return cls(name=name, namespace=namespace, holder=doc["holder"], fence=doc["fence"], attempt=doc["attempt"],
                   lease_duration=doc["leaseDurationSeconds"], renew_interval=doc["renewIntervalSeconds"],
                   payload=doc.get("payload"), checkpoint=doc.get("checkpoint"),
                   idempotency_key=doc["idempotencyKey"], transport=transport,
                   review_feedback=doc.get("reviewFeedback"), **kw)

    @property
    def tool_claim(self) -> dict[str, Any] | None:
        """External workers: the run's short-lived ServiceAccount token, refreshed on every heartbeat."""
        return getattr(self._transport, "tool_claim", None)

    # --- ownership -----------------------------------------------------------

    @property
    def lost(self) -> bool:
        """The API server confirmed that this worker no longer owns the run."""
        return self._lost.is_set()

    @property
    def ownership_unknown(self) -> bool:
        """No renewal confirmed recently enough to be sure of ownership."""
        return not self.lost and self._mono() > self._confirmed_at + self.lease_duration - self.margin

    @property
    def owned(self) -> bool:
        return not self.lost and not self.ownership_unknown

    @property
    def signals(self) -> ControlSignals:
        """stop, paused, endsAt and what is left of the run's caps, as of the last heartbeat."""
        with self._lock:
            sig, usage = self._signals, self._usage
        cents, tokens = protocol.remaining(sig, usage)
        return ControlSignals(stop=sig.stop, paused=sig.paused, reason=sig.reason, ends_at=sig.ends_at,
                              cap_remaining_cents=cents, cap_remaining_tokens=tokens,
                              yielding=sig.stop and sig.yield_, stop_by=sig.stop_by)

    def ensure_owner(self) -> None:
        """Call before every side effect: raises LeaseLost, OwnershipUnknown or StopRequested."""
        if self._signals.stop:
            raise StopRequested(self._signals.reason or "the control plane asked this worker to stop",
                                yielding=self._signals.yield_)
        if self.lost:
            raise LeaseLost(f"{self.holder} lost run {self.namespace}/{self.name} (fence {self.fence})")
        if self.ownership_unknown:
            raise OwnershipUnknown(f"no renewal confirmed for {self._mono() - self._confirmed_at:.1f}s")

    def _fields(self, event: str, **extra: Any) -> dict[str, Any]:
        left = self._confirmed_at + self.lease_duration - self._mono()
        return {"event": event, "run": f"{self.namespace}/{self.name}", "attempt": self.attempt,
                "fence": self.fence, "holder": self.holder,
                "leaseDeadlineIn": round(left, 3) if left > -1e9 else None, **extra}

    def _mark_lost(self, why: str) -> None:
        if not self._lost.is_set():
            self._lost.set()
            log.warning("lease lost: %s", why, extra=self._fields("heartbeat_lost", reason=why))

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
        reports what it spent and how far it got: one last renewal carries its usage and
        checkpoint, or the run would be charged less than it used."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.renew_interval + 15)
        if self._thread is not None and not self._finished.is_set() and not self.lost:
            try:
                with self._renewing:
                    self._renew_once()
            except Exception as exc:  # noqa: BLE001 - leaving must not fail; what was not reported is not charged
                log.warning("last renewal failed", extra=self._fields("heartbeat_unanswered", error=str(exc)[:300]))
        self._transport.close()

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set() and not self._lost.is_set() and not self._finished.is_set():
            self._renew_logged()
            self._wake.wait(timeout=self.renew_interval)
            self._wake.clear()

    def _renew_logged(self) -> bool:
        """A renewal whose failure, whatever it is, only leaves ownership unconfirmed: for the
        heartbeat, which must outlive any one failure, and the renewal before publishing, which must
        not stop the publication (docs/protocol.md §5.4)."""
        try:
            return self.renew()
        except Exception as exc:  # noqa: BLE001
            # Not an httpx error and not an answer (those are Renewals), so a bug. A dead thread
            # would leave the worker believing it owns the run until its deadline passes silently;
            # instead the failure is logged and ownership turns unknown on schedule, and a later
            # renewal can confirm it again.
            log.error("heartbeat failed unexpectedly", exc_info=exc,
                      extra=self._fields("heartbeat_error", error=f"{type(exc).__name__}: {exc}"[:300]))
            return False

    @property
    def heartbeating(self) -> bool:
        """Whether the heartbeat thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def renew(self) -> bool:
        """One heartbeat: a conditional update of the Lease. Returns True when confirmed."""
        if self.lost:
            return False
        with self._renewing:
            started = self._mono()
            try:
                ok = self._renew_once()
            except httpx.HTTPError as exc:
                # No answer: ownership becomes unknown once the deadline passes, not lost.
                log.warning("heartbeat got no answer", extra=self._fields("heartbeat_unanswered", error=str(exc)))
                return False
        if ok:
            self._confirmed_at = max(self._confirmed_at, started)
            log.debug("heartbeat ok", extra=self._fields("heartbeat_ok"))
        return ok

    def _renew_once(self) -> bool:
        with self._lock:
            checkpoint, usage, requests = self._pending_checkpoint, self._usage, dict(self._requests)
        result = self._transport.renew(checkpoint, usage, requests)
        if result.lost:
            self._mark_lost(result.why)
        elif not result.ok:
            log.warning("heartbeat refused", extra=self._fields("heartbeat_refused", reason=result.why))
        if result.ok and result.signals is not None:
            self._take_signals(result.signals)
        return result.ok

    def _take_signals(self, signals: Signals) -> None:
        with self._lock:
            changed = signals != self._signals
            self._signals = signals
        if changed:
            self.signals_seen_at = self._mono()
            self._signalled.set()
            log.info("control signals changed", extra=self._fields("signals_changed", stop=signals.stop,
                                                                    paused=signals.paused, reason=signals.reason))

    # --- progress --------------------------------------------------------------

    def checkpoint(self, cursor: str, flush: bool = False) -> None:
        """Records progress; it rides on the next heartbeat (or now, with flush=True).

        Raises ValueError for a cursor the control plane would not take (not a string, or over
        1024 characters), here where the caller can still fix it."""
        if not isinstance(cursor, str) or len(cursor) > MAX_CURSOR:
            raise ValueError(f"a checkpoint cursor is a string of at most {MAX_CURSOR} characters")
        with self._lock:
            self._pending_checkpoint = cursor
        self.checkpoint_cursor = cursor
        if flush:
            self._wake.set()

    def report_usage(self, cents: int, tokens: int = 0) -> None:
        """Cumulative usage of this attempt; rides on the next heartbeat.

        Raises ValueError for a report the operator would refuse (negative, decreasing,
        implausibly large), here where the caller can still fix it."""
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (cents, tokens)):
            raise ValueError("usage report refused: cents and tokens are integers")
        usage = Usage(cents=cents, tokens=tokens)
        with self._lock:
            why = protocol.valid_report(usage, self._usage)
            if why is not None:
                raise ValueError(f"usage report refused: {why}")
            self._usage = usage

    # --- approvals ---------------------------------------------------------------

    def request_approval(self, name: str, details: str = "", timeout: int | None = None,
                         poll: float = 2.0) -> "ApprovalDecision":
        """Asks a person to approve a step (a WorkerRunApproval with gate `name`), and blocks until
        the control plane says Approve, Deny or TimedOut (after `timeout` seconds, counted by the
        operator from when it saw the request). The request rides on this attempt's renewals, which
        only its holder can write; the decision comes back on them, and only for this attempt.
        While waiting, it renews every `poll` seconds so the decision arrives promptly.

        Raises ValueError for a request the control plane would refuse, and LeaseLost,
        OwnershipUnknown or StopRequested when the attempt cannot act on any decision. Asking
        again for a decided name returns that decision."""
        why = protocol.request_refusal(name, details, timeout)
        if why is not None:
            raise ValueError(f"approval request refused: {why}")
        with self._lock:
            known = self._requests.get(name)
            if known is None and len(self._requests) >= protocol.MAX_REQUESTS_PER_ATTEMPT:
                raise ValueError(f"approval request refused: an attempt may make at most "
                                 f"{protocol.MAX_REQUESTS_PER_ATTEMPT} requests")
            if known is None:
                asked = {**self._requests, name: protocol.ApprovalRequest(name, details, timeout)}
                if len(protocol.requests_annotation(asked).encode()) > protocol.MAX_REQUESTS_BYTES:
                    raise ValueError(f"approval request refused: this attempt's requests would exceed "
                                     f"{protocol.MAX_REQUESTS_BYTES} bytes")
                self._requests = asked
        log.info("approval requested", extra=self._fields("approval_requested", request=name))
        self.renew()
        while True:
            with self._lock:
                decided = self._signals.decisions.get(name)
            if decided is not None:
                log.info("approval decided", extra=self._fields("approval_decided", request=name,
                                                                decision=decided.decision))
                return ApprovalDecision(decision=decided.decision, reason=decided.reason, approver=decided.approver)
            self.ensure_owner()  # lost, unknown or told to stop: no decision can be acted on
            self._signalled.clear()
            if not self._signalled.wait(timeout=poll):
                self.renew()

    # --- results ---------------------------------------------------------------

    def complete(self, result: dict[str, Any]) -> None:
        """Publishes the result with one fenced JSON patch. Raises LeaseLost if rejected because
        the run moved on, ResultInvalid if the value itself was refused (still the owner)."""
        self._publish("result", result)

    def fail(self, code: str, message: str = "") -> None:
        """Publishes a failure with one fenced JSON patch; retry rules decide what follows."""
        self._publish("error", {"code": code, "message": message})

    def _publish(self, field: str, value: dict[str, Any]) -> None:
        if self.lost:
            log.error("result rejected: lease lost", extra=self._fields("result_rejected", field=field))
            raise LeaseLost("result not published: the lease is lost")
        # Usage and the last checkpoint go out with a final renewal, so nothing is left behind; a
        # confirmed one also moves the deadline below.
        self._renew_logged()
        delay = 0.5
        unanswered = False  # a request whose answer was lost may have landed
        while True:
            if self.lost and not unanswered:  # the heartbeat heard it meanwhile: publish nothing more
                log.error("result rejected: lease lost", extra=self._fields("result_rejected", field=field))
                raise LeaseLost(f"the {field} was not published: the lease is lost")
            try:
                try:
                    accepted = self._transport.publish(field, value)
                except ResultInvalid as exc:
                    log.error("%s refused as invalid", field,
                              extra=self._fields("result_invalid", field=field, causes=exc.causes))
                    raise
                if not accepted and unanswered:
                    accepted = self._transport.recorded(field, value)
            except httpx.HTTPError as exc:
                # No answer, or a 5xx (which may come after the write): it may have landed. A 4xx
                # (400, 401, 403, 429) is refused before anything is written.
                if not isinstance(exc, httpx.HTTPStatusError) or exc.response.status_code >= 500:
                    unanswered = True
                wait = max(delay, retry_after(exc))  # a server that says when to come back is believed
                # Read after the try, which may have taken TP: the heartbeat went on confirming meanwhile.
                deadline = self._confirmed_at + self.lease_duration
                if self._mono() + wait > deadline:
                    raise OwnershipUnknown(f"could not publish the {field}: {exc}") from exc
                time.sleep(wait)
                delay = min(delay * 2, 5)
                continue
            if accepted:
                self._finished.set()
                self._wake.set()
                log.info("%s published", field, extra=self._fields("result_published", field=field))
                return
            self._mark_lost("the run's fence or holder moved on")
            log.error("result rejected", extra=self._fields("result_rejected", field=field))
            raise LeaseLost(f"the {field} was rejected: fence {self.fence} is no longer current")

    # --- side effects ----------------------------------------------------------

    def effect_headers(self, operation: str) -> dict[str, str]:
        """Headers for a side effect: stable across attempts, fenced per attempt."""
        return {"Idempotency-Key": f"{self.idempotency_key}:{operation}", "X-Execution-Fence": str(self.fence)}

    def http_client(self, timeout: float = 30.0, **kw: Any) -> "FencedClient":
        return FencedClient(self, timeout=timeout, **kw)

    # --- context manager -------------------------------------------------------

    def __enter__(self) -> "WorkerRun":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            # The program's own errors (sys.exit(2) too) are the run's failure; being terminated
            # (SIGTERM, below; Ctrl-C) or losing ownership is not.
            if exc is not None and not self._finished.is_set() and \
                    not isinstance(exc, (LeaseLost, OwnershipUnknown, StopRequested, Terminated, KeyboardInterrupt)):
                try:
                    self.fail(type(exc).__name__, str(exc)[:500])
                except (LeaseLost, OwnershipUnknown, httpx.HTTPError):
                    pass
        finally:
            self.stop()


def retry_after(exc: httpx.HTTPError) -> float:
    """Seconds a 429/503 answer asked the client to wait (Retry-After, in seconds), else 0."""
    if not isinstance(exc, httpx.HTTPStatusError):
        return 0.0
    try:
        return max(0.0, float(exc.response.headers.get("Retry-After", "0")))
    except ValueError:
        return 0.0  # an HTTP date: rare from the API server; the doubling delay applies


class FencedClient(httpx.Client):
    """httpx client for side effects: every request carries the fence, and a request
    is only started while ownership is confirmed (self-fencing)."""

    def __init__(self, run: WorkerRun, **kw: Any) -> None:
        super().__init__(**kw)
        self.run = run

    def effect(self, method: str, url: str, operation: str, **kw: Any) -> httpx.Response:
        """Sends one side effect with Idempotency-Key `<idempotencyKey>:<operation>`."""
        self.run.ensure_owner()
        headers = {**(kw.pop("headers", None) or {}), **self.run.effect_headers(operation)}
        try:
            return self.request(method, url, headers=headers, **kw)
        except httpx.TimeoutException as exc:
            raise ToolTimeout(f"{method} {url} did not answer: {exc}") from exc


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
