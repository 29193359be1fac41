"""Which cached entry was stored after which, so that a read's absence is taken for what it is: a
fact of the moment it was answered. A GET answered 404, or a list that lacks an object, drops only
entries cached before the read was sent; one the watch brought in the meantime is newer (a run
re-created under the same name while the 404 was on its way) and stays."""

from __future__ import annotations

from typing import Hashable


class Stamps:
    def __init__(self) -> None:
        self._count = 0
        self._at: dict[Hashable, int] = {}

    def mark(self) -> int:
        """Taken before a read is sent."""
        return self._count

    def stamp(self, key: Hashable) -> None:
        self._count += 1
        self._at[key] = self._count

    def drop(self, key: Hashable) -> None:
        self._at.pop(key, None)

    def before(self, key: Hashable, mark: int) -> bool:
        """Whether the entry under `key` was stored before `mark` was taken."""
        return self._at.get(key, 0) <= mark
