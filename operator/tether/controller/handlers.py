"""Thin kopf handlers: they feed watch events to the controller's manager and nothing else.

kopf only watches here: no handler stores progress on objects, so kopf writes
nothing to WorkerRuns (ownership-dependent writes go through tether.kube). Settings and the
controller live in kopf's `memo` (handed in by `tether operator`), not in module globals.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import kopf

from tether import metrics
from tether.api import constants as c
from tether.api.models import BUDGET_PLURAL, GROUP, MAX_ATTEMPT_HISTORY, PLURAL, VERSION
from tether.api.workerclass import CLASS_PLURAL
from tether.controller.capability import Capability
from tether.controller.controller import RunController
from tether.kube import config as kubeconfig
from tether.kube.client import KubeClient
from tether.kube.ratelimit import TokenBucket


@dataclass
class Settings:
    """The operator's settings: `may_act` (with leader election, only the leader acts), the
    client-side rate limits, concurrent reconciles, the worker identity, the attempt records kept,
    and the capabilities the operator runs with (tether/capabilities.py; `watch` their sources)."""

    may_act: Callable[[], bool] = lambda: True
    qps: float = 100.0
    burst: int = 200
    event_qps: float = 25.0
    event_burst: int = 50
    workers: int = 16
    worker_identity: str = "namespace"
    attempt_history: int = MAX_ATTEMPT_HISTORY
    capabilities: Sequence[Capability] = ()


def memo(settings: Settings) -> kopf.Memo:
    """What kopf hands every handler: the settings, and the controller once it is started. The
    capabilities' kinds are watched from here, so what is watched and what is attached are one list."""
    watch(settings.capabilities)
    return kopf.Memo(settings=settings, controller=None, unexport=None)


def stop_exporting(memo: kopf.Memo) -> None:
    """No fleet gauges from a controller that stopped: kopf's cleanup, and the operator's exit in
    case kopf failed before its cleanup ran."""
    unexport: Callable[[], None] | None = memo.get("unexport")
    memo.unexport = None
    if unexport is not None:
        unexport()


class _NoDiffBase(kopf.DiffBaseStorage):
    """Tether has no create/update handlers, so kopf's diff of each event is never used; building
    it deep-copied every body (16% of the operator's CPU re-listing 5,000 runs after a restart)."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return kopf.BodyEssence()

    def fetch(self, *, body: Any) -> Any:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = f"{c.PREFIX}/kopf-finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.PREFIX)
    settings.persistence.diffbase_storage = _NoDiffBase()
    # Tether posts its own Events, one per change; kopf's log lines stay in the log.
    settings.posting.enabled = False
    # Guard against silently stalled watches (kopf issues #585, #955).
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    ours: Settings | None = memo.get("settings")
    if ours is None:
        # Started some other way than `tether operator` (kopf run): without its settings the
        # operator would run without its capabilities (a queued run granted without Kueue).
        raise kopf.PermanentError("start the operator with `tether operator` (its settings are missing)")
    fold = float(os.environ.get("TETHER_FOLD_INTERVAL_SECONDS", "10"))
    # (Off the event loop: loading may run a kubeconfig's exec credential plugin.)
    kube = KubeClient(await asyncio.to_thread(kubeconfig.load), limiter=TokenBucket(ours.qps, ours.burst),
                      event_limiter=TokenBucket(ours.event_qps, ours.event_burst))
    ctl = RunController(kube, fold_interval=fold, may_act=ours.may_act, workers=ours.workers,
                        namespace_identity=ours.worker_identity == "namespace",
                        attempt_history=ours.attempt_history, capabilities=ours.capabilities)
    # Exported before it starts: an export that failed would otherwise leave a started controller
    # behind each time kopf retried the startup.
    memo.unexport = metrics.export(ctl)
    ctl.start()
    memo.controller = ctl
    logging.getLogger("tether.operator").info("tether operator started", extra={"event": "operator_started"})


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    ctl: RunController | None = memo.get("controller")
    memo.controller = None
    stop_exporting(memo)
    if ctl is not None:
        await ctl.stop()
        await ctl.kube.close()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def run_event(event: dict[str, Any], memo: kopf.Memo, **_: Any) -> None:
    memo.controller.feed("run", event.get("type"), event["object"])


@kopf.on.event("coordination.k8s.io", "v1", "leases", labels={c.LABEL_RUN: kopf.PRESENT})
async def lease_event(event: dict[str, Any], memo: kopf.Memo, **_: Any) -> None:
    memo.controller.feed("lease", event.get("type"), event["object"])


@kopf.on.event(GROUP, VERSION, "workerrunapprovals")
async def approval_event(event: dict[str, Any], memo: kopf.Memo, **_: Any) -> None:
    memo.controller.feed("approval", event.get("type"), event["object"])


@kopf.on.event("", "v1", "pods", labels={c.LABEL_RUN: kopf.PRESENT})
async def pod_event(event: dict[str, Any], memo: kopf.Memo, **_: Any) -> None:
    memo.controller.feed("pod", event.get("type"), event["object"])


@kopf.on.event(GROUP, VERSION, CLASS_PLURAL)
async def class_event(event: dict[str, Any], memo: kopf.Memo, **_: Any) -> None:
    memo.controller.feed("workerclass", event.get("type"), event["object"])


@kopf.on.event(GROUP, VERSION, BUDGET_PLURAL)
async def budget_event(event: dict[str, Any], memo: kopf.Memo, **_: Any) -> None:
    memo.controller.feed("budget", event.get("type"), event["object"])


def watch(capabilities: Sequence[Capability]) -> None:
    """kopf handlers for the kinds the capabilities watch, each feeding the manager (called before
    kopf starts: its registry is read as it starts); each once per process, however many operators
    it starts (kopf's registry outlives them)."""
    for capability in capabilities:
        for source in capability.sources:
            handler_id = f"{capability.name}/{source.kind}"
            if handler_id in _WATCHED:
                continue
            _WATCHED.add(handler_id)

            async def feed(event: dict[str, Any], memo: kopf.Memo, kind: str = source.kind, **_: Any) -> None:
                memo.controller.feed(kind, event.get("type"), event["object"])

            kopf.on.event(source.group, source.version, source.plural, id=handler_id)(feed)


_WATCHED: set[str] = set()  # the handler ids registered in kopf's registry
