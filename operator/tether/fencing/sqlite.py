"""A FenceStore in SQLite: survives restarts, shared by the processes of one host."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Callable

from tether.fencing.core import Accept, Decision, Replay, StoredResponse, in_progress, stale

# An in-flight mark outlives its effect only when the process running the effect died
# (a live process always remembers or releases the key). After this long the mark is
# taken to be such an orphan and a retry may run the effect: a receiver whose effects can
# legitimately run longer raises it, or passes None to keep orphans until an operator
# clears them (a stuck key is safer than a doubled effect, at the cost of a manual step).
IN_FLIGHT_SECONDS = 300.0


class SQLiteStore:
    def __init__(self, path: str | Path, in_flight_seconds: float | None = IN_FLIGHT_SECONDS,
                 clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        # Wall-clock time, not monotonic: other processes on the host read the marks too.
        self._clock = clock
        self._in_flight_seconds = in_flight_seconds
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS fences (entity TEXT PRIMARY KEY, highest INTEGER NOT NULL)")
        self._db.execute("CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, status INTEGER NOT NULL,"
                         " content_type TEXT NOT NULL, body BLOB NOT NULL)")
        self._db.execute("CREATE TABLE IF NOT EXISTS in_flight (key TEXT PRIMARY KEY, since REAL NOT NULL)")

    def admit(self, entity: str, fence: int, key: str) -> Decision:
        with self._lock:
            # IMMEDIATE takes the write lock up front: check, raise and mark are one step,
            # also against other processes using the same file.
            self._db.execute("BEGIN IMMEDIATE")
            try:
                decision = self._admit(entity, fence, key)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT" if isinstance(decision, Accept) else "ROLLBACK")
            return decision

    def _admit(self, entity: str, fence: int, key: str) -> Decision:
        row = self._db.execute("SELECT highest FROM fences WHERE entity = ?", (entity,)).fetchone()
        if row is not None and fence < row[0]:
            return stale(entity, fence, row[0])
        stored = self._db.execute("SELECT status, content_type, body FROM responses WHERE key = ?",
                                  (key,)).fetchone()
        if stored is not None:
            return Replay(StoredResponse(status=stored[0], content_type=stored[1], body=bytes(stored[2])))
        now = self._clock()
        mark = self._db.execute("SELECT since FROM in_flight WHERE key = ?", (key,)).fetchone()
        if mark is not None and (self._in_flight_seconds is None or now - mark[0] < self._in_flight_seconds):
            return in_progress(key)
        self._db.execute("INSERT INTO fences (entity, highest) VALUES (?, ?) "
                         "ON CONFLICT(entity) DO UPDATE SET highest = excluded.highest", (entity, fence))
        self._db.execute("INSERT OR REPLACE INTO in_flight (key, since) VALUES (?, ?)", (key, now))
        return Accept()

    def remember(self, key: str, response: StoredResponse) -> None:
        with self._lock:
            # One transaction: no reader may see the key neither stored nor in flight.
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO responses (key, status, content_type, body) "
                                 "VALUES (?, ?, ?, ?)", (key, response.status, response.content_type, response.body))
                self._db.execute("DELETE FROM in_flight WHERE key = ?", (key,))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def release(self, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM in_flight WHERE key = ?", (key,))

    def highest(self, entity: str) -> int | None:
        with self._lock:
            row = self._db.execute("SELECT highest FROM fences WHERE entity = ?", (entity,)).fetchone()
        return None if row is None else int(row[0])

    def close(self) -> None:
        self._db.close()
