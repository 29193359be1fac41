"""Which cached entry changed after which, so that a read's answer is taken for what it is: a fact
of the moment it was answered. What the watch brought (or removed) while the read was on its way
is as new or newer, so the read's answer neither overwrites nor revives it: a GET answered 404, or
a list that lacks an object, drops only entries cached before the read was sent, and a GET's body
is stored only if nothing happened to the entry since."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable

# How long a drop is remembered: longer than any read is in flight (the client's timeouts are far
# shorter), so no read's answer outlives it; bounded, so deleted names do not pile up.
DROP_MEMORY_SECONDS = 300.0


class Stamps:
    def __init__(self, mono: Callable[[], float]) -> None:
        self.mono = mono
        self._count = 0
        self._at: dict[Hashable, int] = {}
        self._dropped: OrderedDict[Hashable, float] = OrderedDict()  # key -> when, oldest first

    def mark(self) -> int:
        """Taken before a read is sent."""
        return self._count

    def stamp(self, key: Hashable) -> None:
        """The entry was stored."""
        self._count += 1
        self._at[key] = self._count
        self._dropped.pop(key, None)

    def drop(self, key: Hashable) -> None:
        """The entry was removed: remembered for a while, so a read sent before cannot revive it."""
        self._count += 1
        self._at[key] = self._count
        now = self.mono()
        self._dropped[key] = now
        self._dropped.move_to_end(key)
        while self._dropped:
            old, when = next(iter(self._dropped.items()))
            if now - when < DROP_MEMORY_SECONDS:
                break
            del self._dropped[old]
            self._at.pop(old, None)

    def before(self, key: Hashable, mark: int) -> bool:
        """Whether nothing was stored or removed under `key` since `mark` was taken."""
        return self._at.get(key, 0) <= mark
