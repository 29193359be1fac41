"""What a worker knows and decides about its attempt, without I/O: shared by WorkerRun (a heartbeat
thread, blocking calls) and AsyncWorkerRun (an asyncio task, awaits).

The state (last confirmed renewal on a monotonic clock, lost, signals, what the next renewal
carries) and the rules (self-fencing, which reports the control plane takes, when a publication
retries and when it gives up) live here once. Where the logic needs I/O — a renewal, a publication,
a wait — it is a generator of ops (tether.worker.ops) that each flavour drives with its own I/O, so
the two cannot drift apart. The state's lock is held only for a few assignments, never across I/O,
so taking it from the event loop does not block it.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any, Callable

import httpx

from tether import protocol
from tether.api.models import Signals, Usage
from tether.children.bodies import Parent, child_spec
from tether.worker.errors import AlreadyPublished, LeaseLost, OwnershipUnknown, ResultInvalid, StopRequested
from tether.worker.ops import (ApprovalDecision, AwaitSignals, ControlSignals, Ops, Renew, Sleep, Transported,
                               cap_used_up, retry_after)
from tether.worker.spawning import Child, spawn_ops, wait_ops
from tether.worker.steps import Renewal
from tether.worker.tracing import AttemptTrace

log = logging.getLogger("tether.worker")

MAX_CURSOR = 1024  # characters: what the operator and the gateway take (docs/protocol.md §5.2)


class RunCore:
    """One attempt of a run, as seen by the worker that holds it, minus the I/O."""

    def __init__(self, *, name: str, namespace: str, holder: str, fence: int, attempt: int, lease_duration: float,
                 renew_interval: float, payload: dict[str, Any] | None = None, checkpoint: str | None = None,
                 idempotency_key: str = "", monotonic: Callable[[], float] = time.monotonic,
                 margin: float | None = None, review_feedback: str | None = None,
                 traceparent: str | None = None) -> None:
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
        self._lock = threading.Lock()  # report_usage may come from any thread (a metering wrapper)
        # Nothing is confirmed until the first renewal succeeds (start() does one at once).
        self._confirmed_at = float("-inf")
        self._lost = False
        self._finished = False  # a result or an error was published
        # One publication per attempt (docs/protocol.md §5.4): what it is, whether one is in flight,
        # and whether one may have landed without a definite answer (a try with no answer yet, or
        # one cut short by a cancellation or a timeout). Set under _lock, never across I/O.
        self._publication: tuple[str, Any] | None = None
        self._publishing = False
        self._in_doubt = False
        self._pending_checkpoint: str | None = None
        self._usage: Usage | None = None
        self._signals = Signals()
        self.signals_seen_at: float | None = None  # monotonic time the current signals arrived
        self._requests: dict[str, protocol.ApprovalRequest] = {}
        self._parent: Parent | None = None  # this run as its children name it, read at the first spawn
        # The attempt's trace (TRACEPARENT / the claim reply): the SDK's spans join it. Tracing only.
        self.trace = AttemptTrace(traceparent, {
            "k8s.namespace.name": namespace, "tether.run.name": name, "tether.attempt": attempt,
            "tether.fence": fence, "tether.holder": holder})

    # --- what the driver provides ------------------------------------------------

    def _on_signals(self) -> None:
        """New signals arrived (request_approval waits for them)."""

    def _wake_heartbeat(self) -> None:
        """Renew now rather than at the end of the interval (or end the heartbeat once finished)."""

    # --- ownership -----------------------------------------------------------

    @property
    def lost(self) -> bool:
        """The API server confirmed that this worker no longer owns the run."""
        return self._lost

    @property
    def finished(self) -> bool:
        """A result or an error of this attempt was published: nothing more is reported."""
        return self._finished

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

    def effect_headers(self, operation: str) -> dict[str, str]:
        """Headers for a side effect: stable across attempts, fenced per attempt."""
        return {"Idempotency-Key": f"{self.idempotency_key}:{operation}", "X-Execution-Fence": str(self.fence)}

    def _effect_request(self, operation: str, kw: dict[str, Any]) -> dict[str, Any]:
        """A side effect's request arguments with the fencing headers, once ownership is confirmed
        (self-fencing: no side effect starts otherwise), and the trace's (for correlation only).
        Merged by name whatever its case, each name once: the trace's headers replace the caller's
        (`traceparent` names the effect's span), the fence headers replace both."""
        self.ensure_owner()
        headers = httpx.Headers(kw.get("headers"))
        headers.update(self.trace.headers())
        headers.update(self.effect_headers(operation))
        return {**kw, "headers": headers}

    @property
    def tool_claim(self) -> dict[str, Any] | None:
        """External workers: the run's short-lived ServiceAccount token, refreshed on every heartbeat."""
        return getattr(getattr(self, "_transport", None), "tool_claim", None)

    def _fields(self, event: str, **extra: Any) -> dict[str, Any]:
        left = self._confirmed_at + self.lease_duration - self._mono()
        return {"event": event, "run": f"{self.namespace}/{self.name}", "attempt": self.attempt,
                "fence": self.fence, "holder": self.holder,
                "leaseDeadlineIn": round(left, 3) if left > -1e9 else None, **extra}

    def _mark_lost(self, why: str) -> None:
        if not self._lost:
            self._lost = True
            log.warning("lease lost: %s", why, extra=self._fields("heartbeat_lost", reason=why))

    # --- renewals --------------------------------------------------------------

    def _renew_ops(self) -> Ops[bool]:
        """One heartbeat: a conditional update of the Lease, carrying the pending checkpoint, usage
        and approval requests. The driver must not run two at once (docs/protocol.md §3)."""
        with self._lock:  # what it carries, so that the trace records only renewals that are news
            carried = (self._pending_checkpoint, self._usage, dict(self._requests))
        return (yield from self.trace.renewal(self._renewal(), carried, lambda: self._signals, outcome=lambda ok:
                                              "confirmed" if ok else "lost" if self._lost else "unconfirmed"))

    def _renewal(self) -> Ops[bool]:
        # The renewal this one waited behind found the lease lost, or a publication it waited behind
        # was accepted (renewing stops then, docs/protocol.md §5.4): nothing more to send.
        if self.lost or self._finished:
            return False
        started = self._mono()  # the confirmation counts from before the request went out
        with self._lock:
            checkpoint, usage, requests = self._pending_checkpoint, self._usage, dict(self._requests)
        try:
            result: Renewal = yield Transported("renew", (checkpoint, usage, requests))
        except httpx.HTTPError as exc:
            # No answer: ownership becomes unknown once the deadline passes, not lost.
            log.warning("heartbeat got no answer", extra=self._fields("heartbeat_unanswered", error=str(exc)))
            return False
        if result.lost:
            self._mark_lost(result.why)
        elif not result.ok:
            log.warning("heartbeat refused", extra=self._fields("heartbeat_refused", reason=result.why))
        if result.ok and result.signals is not None:
            self._take_signals(result.signals)
        if result.ok:
            self._confirmed_at = max(self._confirmed_at, started)  # only ever forward
            log.debug("heartbeat ok", extra=self._fields("heartbeat_ok"))
        return result.ok

    def _renewal_failed(self, exc: BaseException) -> None:
        # Not an httpx error and not an answer (those are Renewals), so a bug. A dead heartbeat
        # would leave the worker believing it owns the run until its deadline passes silently;
        # instead the failure is logged and ownership turns unknown on schedule, and a later
        # renewal can confirm it again.
        log.error("heartbeat failed unexpectedly", exc_info=exc,
                  extra=self._fields("heartbeat_error", error=f"{type(exc).__name__}: {exc}"[:300]))

    def _take_signals(self, signals: Signals) -> None:
        with self._lock:
            changed = signals != self._signals
            self._signals = signals
        if changed:
            self.signals_seen_at = self._mono()
            self._on_signals()
            log.info("control signals changed", extra=self._fields("signals_changed", stop=signals.stop,
                                                                    paused=signals.paused, reason=signals.reason))

    def _owes_last_renewal(self, heartbeat_started: bool) -> bool:
        """Leaving without a result still reports what was spent and how far it got: one last
        renewal carries usage and checkpoint, or the run would be charged less than it used."""
        return heartbeat_started and not self._finished and not self.lost

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
            self.trace.event("tether.checkpoint", **{"tether.checkpoint.flush": True})
            self._wake_heartbeat()

    def report_usage(self, cents: int, tokens: int = 0) -> None:
        """Cumulative usage of this attempt; rides on the next heartbeat. Never blocks on I/O.

        Raises ValueError for a report the operator would refuse (negative, decreasing,
        implausibly large), here where the caller can still fix it. A report that uses up what is
        left of the run's cap (`signals.cap_remaining_cents` / `_tokens` reaching 0) wakes the
        heartbeat: the control plane hears of it at once."""
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (cents, tokens)):
            raise ValueError("usage report refused: cents and tokens are integers")
        usage = Usage(cents=cents, tokens=tokens)
        with self._lock:
            why = protocol.valid_report(usage, self._usage)
            if why is not None:
                raise ValueError(f"usage report refused: {why}")
            used_up = cap_used_up(*protocol.remaining(self._signals, usage))
            crossed = used_up is not None and cap_used_up(*protocol.remaining(self._signals, self._usage)) is None
            self._usage = usage
        if crossed:
            # This report used up what the control plane said was left of a cap: tell it now, not
            # at the end of the renew interval (the meter refuses further requests already).
            log.info("usage report reached the cap; renewing now",
                     extra=self._fields("cap_used_up", reason=used_up))
            self._wake_heartbeat()

    # --- child runs (tether.worker.spawning) -----------------------------------------

    def _spawn_ops(self, key: str, class_name: str | None, payload: dict[str, Any] | None, cap_cents: int | None,
                   max_tokens: int | None, spec: dict[str, Any] | None) -> Ops[Child]:
        self.ensure_owner()  # a stale or stopping attempt spawns nothing
        if self._parent is None:
            self._parent = yield Transported("parent", ())
        body = child_spec(self._parent, class_name, payload, cap_cents, max_tokens, spec)
        child = yield from spawn_ops(self.namespace, self.holder, self.fence, self._parent, key, body)
        log.info("child spawned", extra=self._fields("child_spawned", child=child.name, key=key))
        return child

    def _result_ops(self, child: Child, timeout: float | None, poll: float) -> Ops[dict[str, Any]]:
        yield from wait_ops(child, timeout, poll)
        self.ensure_owner()  # a child's result reaches the parent only through the attempt that holds it
        return child.outcome()

    # --- approvals ---------------------------------------------------------------

    def _approval_ops(self, name: str, details: str, timeout: int | None, poll: float) -> Ops[ApprovalDecision]:
        """Asks for approval `name` (it rides on every renewal of this attempt) and waits for the
        decision on the heartbeat, renewing every `poll` seconds so that it arrives promptly."""
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
        yield Renew()
        while True:
            with self._lock:
                decided = self._signals.decisions.get(name)
            if decided is not None:
                log.info("approval decided", extra=self._fields("approval_decided", request=name,
                                                                decision=decided.decision))
                return ApprovalDecision(decision=decided.decision, reason=decided.reason, approver=decided.approver)
            self.ensure_owner()  # lost, unknown or told to stop: no decision can be acted on
            if not (yield AwaitSignals(poll)):
                yield Renew()

    # --- results ---------------------------------------------------------------

    def _claim_publication(self, field: str, value: dict[str, Any]) -> bool:
        """Reserves this attempt's one publication for `field` = `value`, or raises AlreadyPublished:
        one was accepted, one is in flight, or one of another value may have landed. Returns whether
        the same value was published before without a definite answer (read it back first). The
        flavours call it before their first await (or under the state's lock, from any thread), so
        two callers never both get through."""
        with self._lock:
            if self._finished:
                raise AlreadyPublished(f"the {field} was not published: this attempt already published its "
                                       f"{self._publication[0] if self._publication else 'outcome'}")
            if self._publishing:
                raise AlreadyPublished(f"the {field} was not published: this attempt's "
                                       f"{self._publication[0] if self._publication else 'outcome'} is being "
                                       f"published")
            if self._in_doubt and self._publication != (field, value):
                raise AlreadyPublished(f"the {field} was not published: this attempt's earlier "
                                       f"{self._publication[0] if self._publication else 'publication'} may have "
                                       f"landed (its answer never came); only the same value may be retried")
            retry = self._in_doubt
            self._publishing = True
            self._publication = (field, copy.deepcopy(value))
        return retry

    def _release_publication(self) -> None:
        """The publication ended, however (answered, given up, cancelled): another may be tried, unless
        it was accepted or is in doubt (_claim_publication)."""
        with self._lock:
            self._publishing = False

    def _publish_ops(self, field: str, value: dict[str, Any], retry: bool = False) -> Ops[None]:
        """One fenced publication (docs/protocol.md §5.4): retried on no answer and on answers that
        say nothing about ownership, until the lease deadline; LeaseLost once refused or once the
        heartbeat heard the run is lost; ResultInvalid when the value itself was refused. `retry`:
        the same value was sent before without a definite answer, so it is read back first.
        The caller reserves it first (_claim_publication) and releases it after."""
        return (yield from self.trace.ops("tether.publish", self._publication_steps(field, value, retry),
                                          **{"tether.publication": field}))

    def _publication_steps(self, field: str, value: dict[str, Any], retry: bool) -> Ops[None]:
        if self.lost and not retry:
            log.error("result rejected: lease lost", extra=self._fields("result_rejected", field=field))
            raise LeaseLost("result not published: the lease is lost")
        # Usage and the last checkpoint go out with a final renewal, so nothing is left behind; a
        # confirmed one also moves the deadline below.
        yield Renew(logged=True)
        delay = 0.5
        unanswered = retry  # a request whose answer was lost may have landed
        read_first = retry  # an earlier call's try may have landed: look before sending it again
        while True:
            if self.lost and not unanswered:  # the heartbeat heard it meanwhile: publish nothing more
                log.error("result rejected: lease lost", extra=self._fields("result_rejected", field=field))
                raise LeaseLost(f"the {field} was not published: the lease is lost")
            try:
                accepted = False
                if read_first:
                    read_first = False
                    accepted = yield Transported("recorded", (field, value))
                if not accepted:
                    # In doubt from before the try is sent until a definite answer: a cancellation
                    # or a timeout in between leaves it so (the write may land after).
                    self._in_doubt = True
                    try:
                        accepted = yield Transported("publish", (field, value))
                    except ResultInvalid as exc:
                        self._in_doubt = False  # the value is refused every time: no try of it landed
                        log.error("%s refused as invalid", field,
                                  extra=self._fields("result_invalid", field=field, causes=exc.causes))
                        raise
                    if not accepted and unanswered:
                        accepted = yield Transported("recorded", (field, value))
            except httpx.HTTPError as exc:
                # No answer, or a 5xx (which may come after the write): it may have landed. A 4xx
                # (400, 401, 403, 429) is refused before anything is written.
                if not isinstance(exc, httpx.HTTPStatusError) or exc.response.status_code >= 500:
                    unanswered = True
                self._in_doubt = unanswered
                wait = max(delay, retry_after(exc))  # a server that says when to come back is believed
                # Read after the try, which may have taken TP: the heartbeat went on confirming meanwhile.
                deadline = self._confirmed_at + self.lease_duration
                if self._mono() + wait > deadline:
                    raise OwnershipUnknown(f"could not publish the {field}: {exc}") from exc
                yield Sleep(wait)
                delay = min(delay * 2, 5)
                continue
            self._in_doubt = False
            if accepted:
                self._finished = True
                self._wake_heartbeat()
                log.info("%s published", field, extra=self._fields("result_published", field=field))
                return
            self._mark_lost("the run's fence or holder moved on")
            log.error("result rejected", extra=self._fields("result_rejected", field=field))
            raise LeaseLost(f"the {field} was rejected: fence {self.fence} is no longer current")

    def _fails_on_exit(self, exc: BaseException | None, not_failures: tuple[type[BaseException], ...]) -> bool:
        """Whether leaving the `with` block with `exc` publishes it as the run's failure: the
        program's own errors (sys.exit(2) too) are; being terminated, cancelled or losing ownership
        is not, and nothing is once a publication was accepted, is in flight or may have landed."""
        return exc is not None and not self._finished and not self._publishing and not self._in_doubt and \
            not isinstance(exc, (LeaseLost, OwnershipUnknown, StopRequested, AlreadyPublished, *not_failures))
