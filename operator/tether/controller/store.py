"""The one store type for objects the operator keeps in memory (runs, pods, budgets, Workloads),
read as a mapping, written by three routes, each with the rule written once here:

- `put`: a watch event (or a relist): kept when newer than what is held (`newer`: by default
  another object of the name, or the same one at a resourceVersion not older);
- `read`: the answer to the operator's own read (Stamps.mark taken before it was sent): taken
  for a fact of the moment it was answered, so it neither overwrites nor revives what the watch
  brought or removed meanwhile (a 404, `None`, drops only what was held before the read);
- `written`: the answer to the operator's own compare-and-swap against what it held at
  `resource_version`: nothing came between, so it is kept unless the watch moved on meanwhile.

Named indexes (runs by budget, pods by run) follow every change. Decision state (usage alarms,
progress-held times) is not kept here: it is the controller's, not the cluster's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Generic, Hashable, Iterator, TypeVar

from tether.controller.stamps import Stamps

K = TypeVar("K", bound=Hashable)
Body = dict[str, Any]


def resource_version(body: Body) -> str:
    return str((body.get("metadata") or {}).get("resourceVersion") or "")


def not_older(body: Body, held: Body) -> bool:
    """Another object of the name (a new UID), or the same one at a resourceVersion not older
    (numeric, as every API server this project supports serves them; one that is not numeric
    counts as newer: the watch's order stands)."""
    if (body.get("metadata") or {}).get("uid") != (held.get("metadata") or {}).get("uid"):
        return True
    try:
        return int(resource_version(body)) >= int(resource_version(held))
    except ValueError:
        return True


class Store(Mapping[K, Body], Generic[K]):
    def __init__(self, mono: Callable[[], float], newer: Callable[[Body, Body], bool] = not_older,
                 keep: Callable[[Body], Body] = lambda body: body,
                 indexes: Mapping[str, Callable[[Body], Hashable | None]] | None = None,
                 stamps: Stamps | None = None) -> None:
        self._objects: dict[K, Body] = {}
        self._newer, self._keep = newer, keep
        self._index_of = dict(indexes or {})
        self._indexes: dict[str, dict[Hashable, set[K]]] = {name: {} for name in self._index_of}
        self.stamps = stamps or Stamps(mono)

    # --- read as a mapping -----------------------------------------------------------

    def __getitem__(self, key: K) -> Body:
        return self._objects[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._objects)

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: object) -> bool:
        return key in self._objects

    def copy(self) -> dict[K, Body]:
        """A copy taken in one step (the metrics thread reads it while the event loop writes)."""
        return self._objects.copy()

    def add_index(self, name: str, index_of: Callable[[Body], Hashable | None]) -> None:
        """A named index more (a capability's, as it attaches), built over what is held already."""
        if name in self._index_of:
            raise ValueError(f"an index named {name} exists already")
        self._index_of[name], self._indexes[name] = index_of, {}
        for key, body in self._objects.items():
            value = index_of(body)
            if value is not None:
                self._indexes[name].setdefault(value, set()).add(key)

    def by(self, index: str, value: Hashable) -> frozenset[K]:
        """The keys whose object `index` maps to `value`."""
        return frozenset(self._indexes[index].get(value, ()))

    # --- the three routes in -----------------------------------------------------------

    def is_news(self, key: K, body: Body) -> bool:
        """A watch event's object is newer than what is held (`newer`), or nothing is held."""
        held = self._objects.get(key)
        return held is None or self._newer(body, held)

    def put(self, key: K, body: Body) -> bool:
        """A watch event's object: stored unless older than what is held; True when stored."""
        if not self.is_news(key, body):
            return False
        self.store(key, body)
        return True

    def read(self, key: K, body: Body | None, mark: int) -> bool:
        """The answer to our own read (`mark`: Stamps.mark before it was sent); True when taken."""
        if not self.stamps.before(key, mark):
            return False  # the watch stored or removed it since: what the watch says stands
        if body is None:
            self.remove(key)
        else:
            self.store(key, body)
        return True

    def written(self, key: K, body: Body, *replaced: str | None) -> bool:
        """Our own write's answer, made against the object at one of the resourceVersions it
        `replaced`: kept while that is still what is held (an event that arrived during the write
        stays, and the watch brings our write in its turn; a deletion seen is never undone)."""
        held = self._objects.get(key)
        if held is None or resource_version(held) not in replaced:
            return False
        self.store(key, body)
        return True

    # --- below the rules -------------------------------------------------------------

    def store(self, key: K, body: Body) -> Body | None:
        """Stores `body` whatever is held (a route above decided it is news); returns what it replaced."""
        previous = self._objects.get(key)
        kept = self._keep(body)
        self._unindex(key, previous)
        self._objects[key] = kept
        for name, index_of in self._index_of.items():
            value = index_of(kept)
            if value is not None:
                self._indexes[name].setdefault(value, set()).add(key)
        self.stamps.stamp(key)
        return previous

    def remove(self, key: K) -> Body | None:
        previous = self._objects.pop(key, None)
        self._unindex(key, previous)
        self.stamps.drop(key)
        return previous

    def _unindex(self, key: K, body: Body | None) -> None:
        if body is None:
            return
        for name, index_of in self._index_of.items():
            value = index_of(body)
            keys = self._indexes[name].get(value) if value is not None else None
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._indexes[name][value]
