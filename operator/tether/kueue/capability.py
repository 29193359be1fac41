"""Queueing through Kueue as one capability (controller.capability): what the operator watches for
it, its reconciler of AdmissionChecks, the run reconciler's watches it adds, each queued run's
slice of the observation, the executors and the confirmation of its Workload writes, and its
metrics. Registered by one line in tether/capabilities.py; the operator without that line runs
runs as if no Kueue were installed (a queue-name label then queues nothing)."""

from __future__ import annotations

import os
from typing import Any, Awaitable, Callable

from prometheus_client import Counter, Histogram

from tether import metrics
from tether.api.models import WorkerRun
from tether.controller.capability import Attached, Context, Source, Step
from tether.controller.errors import Again, NotLeader, SpecError
from tether.controller.loop import Result
from tether.controller.manager import Wake, Watch
from tether.controller.snapshot import Snapshot
from tether.controller.views import RunKey
from tether.core.actions import Decision, WriteStatus
from tether.core.capability import Rules
from tether.kube.client import ApiError, NotFound
from tether.kueue import api as k
from tether.kueue.actions import (AnswerBudgetCheck, DeleteWorkload, EnsureWorkload, FinishWorkload, KueueConfirm,
                                  MarkPodsReady, ReleaseQuota, SetPriorityBoost, SetWorkloadActive, UngateWorkload)
from tether.kueue.book import QueueBook
from tether.kueue.decide import BOOST_SECONDS, RULES

EVICTIONS = Counter("tether_kueue_evictions_total", "Attempts Kueue evicted (told to yield, then fenced), "
                    "by Kueue's reason (Preempted, PodsReadyTimeout, ClusterQueueStopped, ...).", ["reason"],
                    registry=metrics.REGISTRY)
QUEUED = Histogram("tether_kueue_queued_to_admitted_seconds", "From a queued run's creation (or its last "
                   "eviction) to the grant Kueue's admission allowed.",
                   buckets=(0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600, 14400, 86400), registry=metrics.REGISTRY)

# The AdmissionChecks' reconciler: few checks, one write each.
CHECKS = "kueue_admissioncheck"
# A check not marked yet is looked at again this often: by a replica that does not lead (it marks
# what is left once it leads), and after a refused mark (no backoff to minutes: a ClusterQueue
# listing an inactive check admits nothing meanwhile).
RETRY_SECONDS = 5.0


class Kueue:
    name = "kueue"
    rules: Rules = RULES
    sources = (Source("workload", k.KUEUE_GROUP, k.KUEUE_VERSION, k.WORKLOAD_PLURAL),
               Source("localqueue", k.KUEUE_GROUP, k.KUEUE_VERSION, "localqueues"),
               Source("admissioncheck", k.KUEUE_GROUP, k.KUEUE_VERSION, "admissionchecks"))

    def __init__(self, boost_seconds: float | None = None) -> None:
        self.boost_seconds = boost_seconds

    def attach(self, ctx: Context) -> Attached:
        boost = self.boost_seconds if self.boost_seconds is not None else \
            float(os.environ.get("TETHER_KUEUE_BOOST_SECONDS", str(BOOST_SECONDS)))
        book = QueueBook(ctx.kube, ctx.now, boost)
        cache = ctx.cache

        def on_workload(event_type: str | None, body: dict[str, Any]) -> RunKey | None:
            """A run's Workload changed (admitted, evicted, finished): that run."""
            key = book.on_workload(event_type, body)
            return key if key is not None and key in cache.runs else None

        def queued(namespace: str | None = None) -> list[RunKey]:
            """The runs waiting for Kueue (in `namespace`, or everywhere): a check they may wait on
            changed, or where they wait."""
            return [key for key in list(cache.runs) if namespace in (None, key[0])
                    and (run := cache.run(key)) is not None and run.holder is None
                    and run.phase in ("Queued", "Pending")]

        def on_local_queue(event_type: str | None, body: dict[str, Any]) -> list[RunKey]:
            """A LocalQueue's ClusterQueue is named in its runs' Queued message."""
            book.on_local_queue(event_type, body)
            return queued((body.get("metadata") or {}).get("namespace"))

        ctx.manager.observe("workload", on_workload)
        ctx.manager.observe("localqueue", on_local_queue)
        ctx.manager.observe("admissioncheck", book.on_admission_check)
        ctx.manager.register(CHECKS, _CheckMarker(book, ctx.leadership.may_act), 1,
                             [Watch("admissioncheck", lambda change: [Wake(change[0])])], key_field="check")

        async def ensure_workload(snap: Snapshot, action: EnsureWorkload) -> Snapshot:
            """Refused (the Workload webhook, a missing WorkloadPriorityClass, Kueue not installed):
            said on the run."""
            ns = snap.run.metadata.namespace
            try:
                await ctx.refusable(book.ensure_workload(snap, action), "WorkloadRefused", ns)
            except NotFound as exc:
                raise SpecError("KueueNotFound", exc) from None
            return snap

        async def admitted(snap: Snapshot, decision: Decision) -> None:
            """A queued run's grant: Kueue admits its Workload now, and has not evicted it since
            the admission the attempt records (a cached admission may be one Kueue took back)."""
            grant = next(a for a in decision.actions if isinstance(a, WriteStatus) and a.grants)
            cur = grant.status.current()
            assert cur is not None and cur.admission is not None  # asked for exactly then (decide.queue_allows)
            if not await book.confirm_admitted(snap, cur.admission.evictions):
                raise Again("the Workload is not admitted as the grant saw it")

        return Attached(
            run_watches=[Watch("workload", lambda key: [Wake(key)]),
                         Watch("localqueue", lambda keys: [Wake(key) for key in keys]),
                         Watch("admissioncheck", lambda change: [Wake(key) for key in queued()] if change[1] else [])],
            observe=book.observe,
            steps={EnsureWorkload: ensure_workload, MarkPodsReady: _then(book.mark_pods_ready),
                   ReleaseQuota: _then(book.release_quota), DeleteWorkload: _then(book.delete_workload),
                   FinishWorkload: _then(book.finish_workload), SetPriorityBoost: _then(book.set_priority_boost),
                   UngateWorkload: _then(book.ungate), AnswerBudgetCheck: _then(book.answer_budget_check),
                   SetWorkloadActive: _then(book.set_active)},
            checks={KueueConfirm.ADMITTED: admitted},
            written=_count,
        )


class _CheckMarker:
    """Tether's AdmissionChecks not yet Active are marked (a ClusterQueue listing an inactive
    check admits nothing), by whichever replica leads, also one that came to lead after their
    last event."""

    def __init__(self, book: QueueBook, may_act: Callable[[], bool]) -> None:
        self.book, self.may_act = book, may_act

    def exists(self, key: str) -> bool:
        return key in self.book.unmarked

    async def reconcile(self, key: str) -> Result:
        if not self.may_act():
            return Result(requeue_after=RETRY_SECONDS)
        try:
            await self.book.mark_active(key)
        except (ApiError, NotLeader):
            return Result(requeue_after=RETRY_SECONDS)  # said in the log by mark_active
        return Result()


def _then(step: Callable[[Snapshot, Any], Awaitable[object]]) -> Step:
    """A step that leaves the run's snapshot as it was (the Workload writes)."""
    async def run(snap: Snapshot, action: Any) -> Snapshot:
        await step(snap, action)
        return snap
    return run


def _count(write: WriteStatus, run: WorkerRun) -> None:
    details = write.details
    if details.eviction_reason is not None:
        EVICTIONS.labels(details.eviction_reason).inc()
    if details.queued_seconds is not None:
        QUEUED.observe(details.queued_seconds)


CAPABILITY = Kueue()
