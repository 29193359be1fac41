"""The fencing decision and the store it needs, independent of any web framework."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StoredResponse:
    status: int
    body: bytes
    content_type: str = "application/json"


@dataclass(frozen=True)
class Accept:
    """Perform the effect, then store its response under the key with `remember` (or, if the
    effect did not happen and may be retried, free the key with `release`).

    Until then the key is *in flight*: a request repeating it is answered `InProgress`, so a
    retry that arrives while the first call is still running cannot run the effect again."""


@dataclass(frozen=True)
class Reject:
    highest: int
    message: str
    status: int = 409  # 409 stale fence; 400 missing or malformed headers


@dataclass(frozen=True)
class InProgress(Reject):
    """The key's first request is still running: answer 409 and let the client retry later,
    when it gets the stored response (the IETF Idempotency-Key draft's and Stripe's answer to
    a concurrent duplicate). It is a Reject, so a caller written before it existed refuses the
    duplicate instead of running the effect a second time."""

    code: str = "InProgress"


@dataclass(frozen=True)
class Replay:
    response: StoredResponse


Decision = Accept | Reject | Replay


def in_progress(key: str) -> InProgress:
    return InProgress(-1, f"a request with Idempotency-Key {key!r} is in progress; retry later")


class FenceStore(Protocol):
    def admit(self, entity: str, fence: int, key: str) -> Decision:
        """Atomically: refuse a fence below the entity's highest, replay a known key, refuse a
        key that is in flight, or raise the entity's highest fence, mark the key in flight
        and accept."""

    def remember(self, key: str, response: StoredResponse) -> None:
        """Stores the response of an accepted effect for replays (the key is no longer in flight)."""

    def release(self, key: str) -> None:
        """Frees an in-flight key whose effect did not happen (or failed retryably), so the
        next request with it runs the effect."""


class MemoryStore:
    """In-process store; state is lost on restart (tests, single-replica services)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._highest: dict[str, int] = {}
        self._responses: dict[str, StoredResponse] = {}
        # Keys accepted whose effect has not finished. In memory they die with the process,
        # which is also when the effects they guard stop running.
        self._in_flight: set[str] = set()

    def admit(self, entity: str, fence: int, key: str) -> Decision:
        with self._lock:
            highest = self._highest.get(entity, -1)
            if fence < highest:
                return stale(entity, fence, highest)
            stored = self._responses.get(key)
            if stored is not None:
                return Replay(stored)
            if key in self._in_flight:
                return in_progress(key)
            self._highest[entity] = fence
            self._in_flight.add(key)
            return Accept()

    def remember(self, key: str, response: StoredResponse) -> None:
        with self._lock:
            self._responses[key] = response
            self._in_flight.discard(key)

    def release(self, key: str) -> None:
        with self._lock:
            self._in_flight.discard(key)

    def highest(self, entity: str) -> int | None:
        with self._lock:
            return self._highest.get(entity)


def stale(entity: str, fence: int, highest: int) -> Reject:
    return Reject(highest, f"fence {fence} is stale: {entity} already accepted fence {highest}")


def check(store: FenceStore, entity: str, fence: str | int | None, key: str | None) -> Decision:
    """Validates the headers a Tether worker sends, then asks the store.

    The fence is checked before the key, so a stale owner learns it is stale
    (409) instead of receiving somebody else's stored response.
    """
    if fence is None or key is None or not key:
        return Reject(-1, "X-Execution-Fence and Idempotency-Key headers are required", 400)
    try:
        value = int(fence)
    except (TypeError, ValueError):
        return Reject(-1, f"X-Execution-Fence must be an integer, got {fence!r}", 400)
    if value < 0:
        return Reject(-1, "X-Execution-Fence must not be negative", 400)
    return store.admit(entity, value, key)
