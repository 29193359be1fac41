"""The controller manager: named reconcilers, each with its own work queue, its own concurrency
and the watches it declared when it was registered (controller-runtime's builder: `For`, `Owns`,
`Watches` with a mapping function).

Every event of a kind, whether a watch brought it or the operator read it itself, enters by
`feed(kind, ...)`: the kind's observer updates what is held, once, and describes the change;
each reconciler watching that kind then maps the change to the keys it reconciles again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Hashable, Iterable, Mapping, Sequence, TypeVar

from tether.controller.loop import ReconcileLoop, Reconciler
from tether.controller.workqueue import ExponentialBackoff, WorkQueue

K = TypeVar("K", bound=Hashable)
C = TypeVar("C")


@dataclass(frozen=True)
class Wake(Generic[K]):
    """A key to reconcile again."""

    key: K
    after: float = 0.0  # seconds from now (0: at once)
    # A fold timer: one per key however many heartbeats, and never cutting an error backoff short.
    fold: bool = False
    new_spec: bool = False  # the object's generation moved: its error backoff starts over


@dataclass(frozen=True)
class Watch(Generic[C]):
    """Which of a reconciler's keys a change of `kind` wakes (the change its observer describes)."""

    kind: str
    keys: Callable[[C], Iterable[Wake[Any]]]


Observer = Callable[[str | None, dict[str, Any]], Any]  # (event type, body) -> change, None: no change


@dataclass
class Registered(Generic[K]):
    name: str
    queue: WorkQueue[K]
    loop: ReconcileLoop[K]

    def wake(self, wakes: Iterable[Wake[K]]) -> None:
        queue = self.queue
        for w in wakes:
            if w.new_spec:
                queue.forget(w.key)  # an error backoff of the old spec no longer applies
            if w.fold and queue.backoff.failures(w.key):
                continue  # never cut an error backoff short
            if w.after > 0:
                queue.add_after(w.key, w.after)
            else:
                queue.add(w.key)


class Manager:
    def __init__(self, mono: Callable[[], float]) -> None:
        self.mono = mono
        self._observers: dict[str, tuple[str, Observer]] = {}  # kind fed -> (kind watched, observer)
        self._registered: dict[str, Registered[Any]] = {}
        self._watches: dict[str, list[tuple[Registered[Any], Watch[Any]]]] = {}

    def observe(self, kind: str, observer: Observer, watched_as: str | None = None) -> None:
        """What updates the store for events of `kind`; `watched_as`: the watches of that kind
        see its changes (a fresh read of a run is a run's change)."""
        self._observers[kind] = (watched_as or kind, observer)

    def register(self, name: str, reconciler: Reconciler[K], workers: int, watches: Sequence[Watch[Any]],
                 backoff: ExponentialBackoff[K] | None = None, key_field: str = "run") -> Registered[K]:
        """A reconciler under `name` (its queue's and its metrics' label), woken by `watches`;
        `key_field`: the log field naming its keys."""
        if name in self._registered:
            raise ValueError(f"a reconciler named {name} is registered already")
        observed = {watched for watched, _ in self._observers.values()}
        for watch in watches:  # all checked before anything exists: a refusal leaves nothing behind
            if watch.kind not in observed:
                raise ValueError(f"{name} watches {watch.kind}, which nothing observes")
        queue: WorkQueue[K] = WorkQueue(backoff or ExponentialBackoff(base=0.05, cap=300.0), self.mono, name)
        registered = Registered(name, queue, ReconcileLoop(name, reconciler, queue, workers, key_field))
        for watch in watches:
            self._watches.setdefault(watch.kind, []).append((registered, watch))
        self._registered[name] = registered
        return registered

    def feed(self, kind: str, event_type: str | None, body: dict[str, Any]) -> None:
        watched, observer = self._observers[kind]
        change = observer(event_type, body)
        if change is None:
            return
        for registered, watch in self._watches.get(watched, ()):
            registered.wake(watch.keys(change))

    def wake(self, name: str, wakes: Iterable[Wake[Any]]) -> None:
        """Keys a reconciler's own work found due (not a watch event)."""
        self._registered[name].wake(wakes)

    def queues(self) -> Mapping[str, WorkQueue[Any]]:
        return {name: r.queue for name, r in self._registered.items()}

    def start(self) -> None:
        for registered in self._registered.values():
            registered.loop.start()

    async def stop(self) -> None:
        for registered in self._registered.values():
            await registered.loop.stop()
