"""The seam a capability plugs into (Kueue's queueing is one: tether/kueue, registered by one line
in tether/capabilities.py). From its own package a capability brings:

- `sources`: the kinds it watches (kopf's handlers feed their events to the manager by kind);
- `rules`: its say in the pure decision (core.capability: gates, a stop, every pass, deletion);
- `attach(ctx)`: once the controller exists, its observers and reconcilers on the manager, and
  an `Attached`: the run reconciler's watches it adds, its slice of each run's observation, the
  executors of its actions, the fresh reads its actions rest on, what it hears of each status
  write (its metrics), and its life cycle.

The controller imports no capability: the list is handed in (`RunController(capabilities=...)`).
"""

from __future__ import annotations

import datetime as dt
import enum
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence

from tether.api.models import WorkerRun
from tether.controller.cache import RunCache
from tether.controller.leader import Leadership
from tether.controller.manager import Manager, Watch
from tether.controller.snapshot import Snapshot
from tether.controller.store import Store
from tether.core.actions import Decision, WriteStatus
from tether.core.capability import Rules
from tether.kube.client import KubeClient

# An executor step: the action done, the snapshot the next one works from.
Step = Callable[[Snapshot, Any], Awaitable[Snapshot]]
# A fresh read a decision's actions rest on: raises errors.Again when it contradicts the decision.
Check = Callable[[Snapshot, Decision], Awaitable[None]]
# (refusable) A write built from the run's spec: the API server's refusal becomes a SpecError.
Refusable = Callable[[Awaitable[dict[str, Any]], str, str], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Source:
    """A kind the operator watches for a capability, fed to the manager as `kind`."""

    kind: str
    group: str
    version: str
    plural: str


@dataclass(frozen=True)
class Context:
    """What the controller lends a capability as it attaches."""

    kube: KubeClient
    cache: RunCache
    manager: Manager
    leadership: Leadership
    now: Callable[[], dt.datetime]
    refusable: Refusable
    budgets: Store[tuple[str, str]]  # WorkerBudgets, by (namespace, name)


async def _nothing(run: WorkerRun) -> object | None:
    return None


@dataclass
class Attached:
    run_watches: Sequence[Watch[Any]] = ()
    # Its slice of a run's observation (Observed.part), gathered for each pass; None: none.
    observe: Callable[[WorkerRun], Awaitable[object | None]] = _nothing
    steps: Mapping[type, Step] = field(default_factory=dict)
    checks: Mapping[enum.Enum, Check] = field(default_factory=dict)
    written: Callable[[WriteStatus, WorkerRun], None] = lambda write, run: None
    stop: Callable[[], Awaitable[None]] | None = None


class Capability(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def rules(self) -> Rules: ...

    @property
    def sources(self) -> Sequence[Source]: ...

    def attach(self, ctx: Context) -> Attached: ...
