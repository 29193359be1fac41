"""A rate-limited work queue of keys, with client-go's workqueue semantics, on asyncio.

- The queue holds keys, never objects: a reconcile reads the current snapshot when it starts.
- A key that is already waiting is not added twice (a burst of events is one reconcile).
- A key being processed is never handed to a second worker; if it is added meanwhile,
  it is queued again once the worker calls `done`.
- `add_after` schedules a timed pass (a lease deadline); the earliest pending time wins.
- `add_rate_limited` backs a failing key off exponentially (per key), `forget` resets it.
- client-go's workqueue metrics, labelled by the queue's name, timed on the injected clock.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Callable, Generic, Hashable, TypeVar

from tether import metrics

K = TypeVar("K", bound=Hashable)

_GAUGES = (metrics.WORKQUEUE_DEPTH, metrics.WORKQUEUE_UNFINISHED, metrics.WORKQUEUE_LONGEST)
# Which queue each name's gauges read now (the newest of that name), so that a queue shutting down
# removes its gauges only while they are still its own.
_gauged: "dict[str, WorkQueue[Any]]" = {}


class ExponentialBackoff(Generic[K]):
    """Per-key delay base * 2**failures, capped (client-go's ItemExponentialFailureRateLimiter)."""

    def __init__(self, base: float = 0.05, cap: float = 300.0) -> None:
        self.base, self.cap = base, cap
        self._failures: dict[K, int] = {}

    def when(self, key: K) -> float:
        n = self._failures.get(key, 0)
        self._failures[key] = n + 1
        # Past 2**30 the cap has long been reached; stop the exponent from growing.
        return min(self.cap, self.base * 2 ** min(n, 30))

    def failures(self, key: K) -> int:
        return self._failures.get(key, 0)

    def forget(self, key: K) -> None:
        self._failures.pop(key, None)


class WorkQueue(Generic[K]):
    def __init__(self, backoff: ExponentialBackoff[K] | None = None,
                 mono: Callable[[], float] = time.monotonic, name: str = "") -> None:
        self.backoff: ExponentialBackoff[K] = backoff or ExponentialBackoff()
        self.mono = mono
        self.name = name
        self._queue: deque[K] = deque()
        self._dirty: set[K] = set()
        # Key -> when it was added (queue duration) / when a worker took it (work duration).
        self._added: dict[K, float] = {}
        self._processing: dict[K, float] = {}
        self._adds = metrics.WORKQUEUE_ADDS.labels(name)
        self._retries = metrics.WORKQUEUE_RETRIES.labels(name)
        self._waited = metrics.WORKQUEUE_QUEUE_DURATION.labels(name)
        self._worked = metrics.WORKQUEUE_WORK_DURATION.labels(name)
        if name:  # the gauges read the newest queue of each name at scrape time, until it shuts down
            _gauged[name] = self
            metrics.WORKQUEUE_DEPTH.labels(name).set_function(lambda: float(len(self)))
            metrics.WORKQUEUE_UNFINISHED.labels(name).set_function(lambda: sum(self.in_progress()))
            metrics.WORKQUEUE_LONGEST.labels(name).set_function(lambda: max(self.in_progress(), default=0.0))
        self._timers: dict[K, tuple[float, asyncio.TimerHandle]] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._shutdown = False

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, key: K) -> None:
        if self._shutdown or key in self._dirty:
            return
        self._adds.inc()
        self._dirty.add(key)
        self._added.setdefault(key, self.mono())
        if key in self._processing:
            return  # queued again by done()
        self._queue.append(key)
        self._notify()

    def add_after(self, key: K, delay: float) -> None:
        """Adds the key after `delay` seconds, unless an earlier pass is already scheduled."""
        if self._shutdown:
            return
        if delay <= 0:
            self.add(key)
            return
        due = self.mono() + delay
        pending = self._timers.get(key)
        if pending is not None:
            if pending[0] <= due:
                return
            pending[1].cancel()
        handle = asyncio.get_running_loop().call_later(delay, self._fire, key)
        self._timers[key] = (due, handle)

    def add_rate_limited(self, key: K) -> float:
        self._retries.inc()
        delay = self.backoff.when(key)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        self.backoff.forget(key)

    def drop(self, key: K) -> None:
        """Forgets everything about a key that no longer exists (timers, backoff)."""
        pending = self._timers.pop(key, None)
        if pending is not None:
            pending[1].cancel()
        self.backoff.forget(key)

    def pending_timers(self) -> int:
        return len(self._timers)

    def in_progress(self) -> list[float]:
        """Seconds each key being processed has been at it (the unfinished-work gauges)."""
        now = self.mono()
        return [now - began for began in self._processing.copy().values()]

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def _notify(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def get(self) -> K | None:
        """The next key to process (None after shutdown). Call `done(key)` when finished."""
        while not self._queue and not self._shutdown:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._notify()  # pass the wake-up on to another worker
                raise
        if self._shutdown:
            return None
        key = self._queue.popleft()
        self._dirty.discard(key)
        now = self.mono()
        self._waited.observe(max(0.0, now - self._added.pop(key, now)))
        self._processing[key] = now
        return key

    def done(self, key: K) -> None:
        began = self._processing.pop(key, None)
        if began is not None:
            self._worked.observe(max(0.0, self.mono() - began))
        if key in self._dirty:
            self._queue.append(key)
            self._notify()

    def shutdown(self) -> None:
        self._shutdown = True
        if self.name and _gauged.get(self.name) is self:
            del _gauged[self.name]
            for gauge in _GAUGES:
                gauge.remove(self.name)  # no gauges of a stopped controller's queue
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()
