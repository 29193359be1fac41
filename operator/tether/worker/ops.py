"""The vocabulary of a worker's own steps, above the transport's: what WorkerRun's logic (renewal
bookkeeping, publication retries, the approval wait, reading the payload) asks its driver to do.
WorkerRun performs these with a thread and blocking calls, AsyncWorkerRun with awaits; the logic
that decides what to ask is written once (tether.worker.core)."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any, Generator, Mapping, TypeVar

import httpx

from tether.api import constants as c
from tether.kube.paths import run_path
from tether.tracecontext import ENV_TRACEPARENT
from tether.worker.errors import LeaseLost
from tether.worker.steps import Call

T = TypeVar("T")


@dataclass(frozen=True)
class Transported:
    """One operation of the run's transport: `renew`, `publish` or `recorded`, with its arguments."""

    operation: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Renew:
    """One renewal through the run's own renew(), which keeps renewals from overlapping. logged: any
    failure only leaves ownership unconfirmed (the renewal before publishing, docs/protocol.md §5.4)."""

    logged: bool = False


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class AwaitSignals:
    """Waits for new control signals, at most `timeout` seconds; answered True when they came."""

    timeout: float


Op = Transported | Renew | Sleep | AwaitSignals
Ops = Generator[Op, Any, T]


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


def cap_used_up(cents_left: int | None, tokens_left: int | None) -> str | None:
    """Why the attempt may not spend any more of the run's own caps, or None: what the control
    plane last said was left of a cap, less what the attempt reported since (ControlSignals'
    cap_remaining_cents / _tokens; None: no cap), is used up -- nothing left, or less than nothing.
    The meter refuses requests on it, and the run renews at once when a report makes it true."""
    if isinstance(cents_left, int) and cents_left <= 0:
        return f"the run's cap is used up ({cents_left} cents left)"
    if isinstance(tokens_left, int) and tokens_left <= 0:
        return f"the run's token cap is used up ({tokens_left} tokens left)"
    return None


def retry_after(exc: httpx.HTTPError) -> float:
    """Seconds a 429/503 answer asked the client to wait (Retry-After, in seconds), else 0."""
    if not isinstance(exc, httpx.HTTPStatusError):
        return 0.0
    try:
        return max(0.0, float(exc.response.headers.get("Retry-After", "0")))
    except ValueError:
        return 0.0  # an HTTP date: rare from the API server; the doubling delay applies


def inline_payload(env: Mapping[str, str]) -> dict[str, Any] | None:
    """The payload when the environment carries it (or there is none); None when it must be read
    from the run (TETHER_PAYLOAD_FROM=spec.payload, a payload too large for the environment)."""
    if c.ENV_PAYLOAD in env:
        return json.loads(env[c.ENV_PAYLOAD] or "{}")  # type: ignore[no-any-return]
    source = env.get(c.ENV_PAYLOAD_FROM)
    if source is None:
        return {}
    if source != c.PAYLOAD_FROM_RUN:
        raise ValueError(f"{c.ENV_PAYLOAD_FROM}={source!r}: this SDK reads only {c.PAYLOAD_FROM_RUN!r}")
    return None


def payload_steps(env: Mapping[str, str], attempts: int = 3,
                  backoff: float = 1.0) -> Generator[Call | Sleep, Any, dict[str, Any]]:
    """Reads the payload from the pod's own WorkerRun, with its own credentials (docs/protocol.md §4.1)."""
    path = run_path(env[c.ENV_NAMESPACE], env[c.ENV_RUN])
    for attempt in range(attempts):
        try:
            resp = yield Call("GET", path)
            if resp.status_code < 500 or attempt + 1 == attempts:
                resp.raise_for_status()  # 403/404 will not heal: the attempt fails and says why
                run = resp.json()
                uid = env.get(c.ENV_RUN_UID)
                if uid and (run.get("metadata") or {}).get("uid") != uid:
                    # Re-created under the same name since this pod started: not our input.
                    raise LeaseLost(f"{env[c.ENV_RUN]} was re-created (uid {uid} is gone)")
                return run.get("spec", {}).get("payload") or {}  # type: ignore[no-any-return]
        except httpx.TransportError:
            if attempt + 1 == attempts:
                raise
        yield Sleep(backoff * 2**attempt)  # a brief API hiccup at start-up should not cost the attempt
    raise AssertionError("unreachable: the last attempt returns or raises")


def claimed(doc: dict[str, Any]) -> dict[str, Any]:
    """A run's constructor arguments from the gateway's claim reply."""
    return {"holder": doc["holder"], "fence": doc["fence"], "attempt": doc["attempt"],
            "lease_duration": doc["leaseDurationSeconds"], "renew_interval": doc["renewIntervalSeconds"],
            "payload": doc.get("payload"), "checkpoint": doc.get("checkpoint"),
            "idempotency_key": doc["idempotencyKey"], "review_feedback": doc.get("reviewFeedback"),
            "traceparent": doc.get("traceparent") if isinstance(doc.get("traceparent"), str) else None}


def request_timeout(renew_interval: float) -> float:
    """T: a request may take up to the renew interval, within [1 s, 10 s]."""
    return min(10.0, max(float(renew_interval), 1.0))


def from_env_fields(e: Mapping[str, str]) -> dict[str, Any]:
    """A run's constructor arguments from what the operator put into the pod's environment (all but
    the payload, which may need a read)."""
    return dict(name=e[c.ENV_RUN], namespace=e[c.ENV_NAMESPACE], holder=e[c.ENV_HOLDER], fence=int(e[c.ENV_FENCE]),
                attempt=int(e[c.ENV_ATTEMPT]), lease_duration=float(e[c.ENV_LEASE_DURATION]),
                renew_interval=float(e[c.ENV_RENEW_INTERVAL]), checkpoint=e.get(c.ENV_CHECKPOINT),
                idempotency_key=e.get(c.ENV_IDEMPOTENCY_KEY, ""), run_uid=e.get(c.ENV_RUN_UID) or None,
                review_feedback=e.get(c.ENV_REVIEW_FEEDBACK) or None, traceparent=e.get(ENV_TRACEPARENT) or None)
