"""Whether this process can reach the API server, and since when (monotonic clock).

A lease lapse may only be judged once the API server has answered this process
for a full lease duration: during an outage (apiserver paused or restarting,
etcd stalled, the operator partitioned) no renewal can reach the operator, so
silence says nothing about the workers. Failures are noticed by every request
of the operator's client and by a cheap probe (`/readyz`, which checks etcd),
so an idle operator notices an outage too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from tether import gcpause

log = logging.getLogger("tether.apihealth")

# An answer slower than this does not count as the API server being reachable.
SLOW_SECONDS = 2.0


class ApiHealth:
    def __init__(self, mono: Callable[[], float] = time.monotonic) -> None:
        self._mono = mono
        # Start-up counts as the API having just become reachable: after a restart the
        # operator waits a full lease duration before judging anything.
        self._since: float | None = mono()
        self.outages = 0

    @property
    def available_since(self) -> float | None:
        """Start of the current unbroken stretch of timely answers; None while unreachable."""
        return self._since

    def failure(self, why: str) -> None:
        if self._since is not None:
            self.outages += 1
            log.warning("API server unreachable; lapses are not judged until it answers for a full lease "
                        "duration again", extra={"event": "api_unreachable", "reason": why[:200]})
        self._since = None

    def answered(self, latency: float) -> None:
        if latency > SLOW_SECONDS:
            self.failure(f"answer took {latency:.1f}s")
            return
        if self._since is None:
            self._since = self._mono()
            log.info("API server reachable again", extra={"event": "api_reachable"})

    async def probe_forever(self, probe: Callable[[], Awaitable[bool]], interval: float = 1.0) -> None:
        """Calls `probe` (True: healthy answer) every `interval` seconds and records the outcome."""
        while True:
            began, paused = self._mono(), gcpause.paused()
            try:
                ok = await asyncio.wait_for(probe(), timeout=SLOW_SECONDS * 2)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure to answer is an outage
                self.failure(f"probe: {type(exc).__name__}: {exc}")
            else:
                if ok:
                    # Our own garbage collection meanwhile is not the API server's slowness.
                    self.answered(self._mono() - began - (gcpause.paused() - paused))
                else:
                    self.failure("probe: not ready")
            await asyncio.sleep(max(0.0, interval - (self._mono() - began)))
