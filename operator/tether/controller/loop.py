"""The reconcile loop, apart from what it reconciles (controller-runtime's reconcileHandler).

Workers take keys from a rate-limited work queue; a reconciler turns a key into a `Result` or
raises one of `errors`; the loop requeues accordingly, backs errors off per key, logs each
problem once per change, and counts everything under the controller's name.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Generic, Hashable, Protocol, TypeVar

from tether import metrics
from tether.controller.errors import Again, Inconclusive, NotLeader, SpecError
from tether.controller.workqueue import WorkQueue
from tether.kube.client import Conflict, NotFound, Unavailable

K = TypeVar("K", bound=Hashable)
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)

log = logging.getLogger("tether.controller")

# A pass that acted is followed at once by another; past this many in a row that all acted, the
# next ones back off (a decision that never converges must not spin).
MAX_ACTING_STREAK = 8


@dataclass(frozen=True)
class Result:
    """What a reconcile asks for next."""

    requeue_after: float | None = None  # a timed pass in this many seconds (None: only on change)
    acted: bool = False  # it wrote something: pass again at once, on the state its writes produced


class Reconciler(Protocol[K_contra]):
    async def reconcile(self, key: K_contra) -> Result: ...

    def exists(self, key: K_contra) -> bool:
        """Whether the key still names something (its loop state is dropped once it does not)."""
        ...


def key_name(key: Hashable) -> str:
    return "/".join(key) if isinstance(key, tuple) else str(key)


class ReconcileLoop(Generic[K]):
    def __init__(self, name: str, reconciler: Reconciler[K], queue: WorkQueue[K], workers: int,
                 key_field: str = "run") -> None:
        self.name, self.reconciler, self.queue, self.workers = name, reconciler, queue, workers
        self.key_field = key_field  # the log field that names a key ("run", "budget")
        self._streak: dict[K, int] = {}
        self._problem: dict[K, str] = {}  # the last problem logged per key: each is logged once
        self._tasks: list[asyncio.Task[None]] = []
        # Exported at 0 from the start: rate() and increase() see the first error (a series that
        # appears at 1 has no earlier sample to rise from).
        metrics.RECONCILE_ERRORS.labels(name)
        metrics.RECONCILE_TOTAL.labels(name, "error")

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._worker(), name=f"{self.name} worker {i}")
                           for i in range(self.workers)]

    async def stop(self) -> None:
        self.queue.shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _worker(self) -> None:
        while (key := await self.queue.get()) is not None:
            began = self.queue.mono()
            try:
                await self.process(key)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a worker must outlive any bug in error handling
                log.exception("reconcile worker caught an error", extra={self.key_field: key_name(key), "event": "reconcile_bug"})
                self.queue.add_rate_limited(key)
            finally:
                self.queue.done(key)
                metrics.RECONCILE_TIME.labels(self.name).observe(self.queue.mono() - began)

    async def process(self, key: K) -> None:
        """One reconcile of `key` and what follows from how it ended."""
        try:
            result = await self.reconciler.reconcile(key)
        except asyncio.CancelledError:
            raise
        except NotLeader:
            self._count("requeue")
            self.queue.add_after(key, 1.0)  # a leader again (or exited) by then
        except Again as exc:
            self._count("requeue")
            delay = self.queue.add_rate_limited(key)
            log.debug("deciding again", extra={self.key_field: key_name(key), "event": "reconcile_again",
                                               "reason": str(exc), "retryIn": round(delay, 3)})
            if self.queue.backoff.failures(key) == MAX_ACTING_STREAK:
                self.report(key, "the state keeps moving under its reconciles", "reconcile_churn",
                            str(exc), logging.WARNING)
        except Inconclusive as exc:
            self._count("requeue")
            self.report(key, "lapse not judged yet", "lapse_inconclusive", str(exc), logging.INFO)
            self.queue.add_after(key, exc.retry_in)
        except SpecError as exc:
            delay = self._failed(key)
            self.report(key, "the API server refused an object built from the spec", "reconcile_refused",
                        str(exc), logging.WARNING, retryIn=round(delay, 3), reason=exc.reason)
        except (Unavailable, Conflict, NotFound) as exc:
            delay = self._failed(key)
            self.report(key, "reconcile failed; retrying", "reconcile_failed", str(exc), logging.WARNING,
                        retryIn=round(delay, 3))
        except Exception as exc:  # noqa: BLE001 - a bug: log its traceback, keep the other keys going
            delay = self._failed(key)
            if self._problem.get(key) != f"bug:{exc}":
                self._problem[key] = f"bug:{exc}"
                log.exception("reconcile failed unexpectedly; retrying",
                              extra={self.key_field: key_name(key), "retryIn": round(delay, 3), "event": "reconcile_bug"})
        else:
            self._succeeded(key, result)

    def _count(self, result: str) -> None:
        metrics.RECONCILE_TOTAL.labels(self.name, result).inc()

    def _failed(self, key: K) -> float:
        self._count("error")
        metrics.RECONCILE_ERRORS.labels(self.name).inc()
        return self.queue.add_rate_limited(key)

    def _succeeded(self, key: K, result: Result) -> None:
        self._count("success" if result.requeue_after is None else "requeue")
        if self._problem.pop(key, None):
            log.info("reconcile succeeded again", extra={self.key_field: key_name(key), "event": "reconcile_recovered"})
        if result.acted:
            streak = self._streak[key] = self._streak.get(key, 0) + 1
            if streak > MAX_ACTING_STREAK:
                self.queue.add_rate_limited(key)
            else:
                self.queue.add(key)
            return
        self._streak.pop(key, None)
        self.queue.forget(key)
        if result.requeue_after is not None:
            self.queue.add_after(key, result.requeue_after)
        if not self.reconciler.exists(key):
            self._problem.pop(key, None)
            self.queue.drop(key)

    def report(self, key: K, msg: str, event: str, detail: str, level: int, **extra: Any) -> None:
        """Logs a problem once per change, not on every retry."""
        if self._problem.get(key) == f"{event}:{detail}":
            return
        self._problem[key] = f"{event}:{detail}"
        log.log(level, msg, extra={self.key_field: key_name(key), "event": event, "error": detail[:500], **extra})
