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
    """Perform the effect, then store its response under the key with `remember`."""


@dataclass(frozen=True)
class Reject:
    highest: int
    message: str
    status: int = 409  # 409 stale fence; 400 missing or malformed headers


@dataclass(frozen=True)
class Replay:
    response: StoredResponse


Decision = Accept | Reject | Replay


class FenceStore(Protocol):
    def admit(self, entity: str, fence: int, key: str) -> Decision:
        """Atomically: refuse a fence below the entity's highest, replay a known key,
        or raise the entity's highest fence and accept."""

    def remember(self, key: str, response: StoredResponse) -> None:
        """Stores the response of an accepted effect for replays."""


class MemoryStore:
    """In-process store; state is lost on restart (tests, single-replica services)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._highest: dict[str, int] = {}
        self._responses: dict[str, StoredResponse] = {}

    def admit(self, entity: str, fence: int, key: str) -> Decision:
        with self._lock:
            highest = self._highest.get(entity, -1)
            if fence < highest:
                return Reject(highest, f"fence {fence} is stale: {entity} already accepted fence {highest}")
            stored = self._responses.get(key)
            if stored is not None:
                return Replay(stored)
            self._highest[entity] = fence
            return Accept()

    def remember(self, key: str, response: StoredResponse) -> None:
        with self._lock:
            self._responses[key] = response

    def highest(self, entity: str) -> int | None:
        with self._lock:
            return self._highest.get(entity)


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
