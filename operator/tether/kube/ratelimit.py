"""Client-side request rate limit: a token bucket like client-go's (QPS, Burst).

Every non-watch request of the operator's client takes a token first, so a
burst of reconciles (start-up, an outage ending) turns into latency instead of
a request storm against the API server.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


class TokenBucket:
    def __init__(self, qps: float, burst: int, mono: Callable[[], float] = time.monotonic) -> None:
        if qps <= 0 or burst < 1:
            raise ValueError("qps must be > 0 and burst >= 1")
        self.qps, self.burst = qps, burst
        self._mono = mono
        self._tokens = float(burst)
        self._stamp = mono()
        self._lock = asyncio.Lock()
        self.waited_seconds = 0.0  # total time callers spent waiting (for benchmarks)

    def _refill(self) -> None:
        now = self._mono()
        self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.qps)
        self._stamp = now

    def try_acquire(self) -> bool:
        """Takes a token if one is there now; never waits (for best-effort writes such as Events)."""
        self._refill()
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    async def acquire(self) -> None:
        # The lock makes waiters take tokens in arrival order (no starvation).
        async with self._lock:
            self._refill()
            if self._tokens < 1.0:
                wait = (1.0 - self._tokens) / self.qps
                self.waited_seconds += wait
                await asyncio.sleep(wait)
                self._refill()
            self._tokens -= 1.0
