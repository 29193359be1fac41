"""A FenceStore in SQLite: survives restarts, shared by the processes of one host."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from tether.fencing.core import Accept, Decision, Reject, Replay, StoredResponse


class SQLiteStore:
    def __init__(self, path: str | Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS fences (entity TEXT PRIMARY KEY, highest INTEGER NOT NULL)")
        self._db.execute("CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, status INTEGER NOT NULL,"
                         " content_type TEXT NOT NULL, body BLOB NOT NULL)")

    def admit(self, entity: str, fence: int, key: str) -> Decision:
        with self._lock:
            # IMMEDIATE takes the write lock up front: check and raise are one step,
            # also against other processes using the same file.
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT highest FROM fences WHERE entity = ?", (entity,)).fetchone()
                if row is not None and fence < row[0]:
                    self._db.execute("ROLLBACK")
                    return Reject(row[0], f"fence {fence} is stale: {entity} already accepted fence {row[0]}")
                stored = self._db.execute("SELECT status, content_type, body FROM responses WHERE key = ?",
                                          (key,)).fetchone()
                if stored is not None:
                    self._db.execute("ROLLBACK")
                    return Replay(StoredResponse(status=stored[0], content_type=stored[1], body=bytes(stored[2])))
                self._db.execute("INSERT INTO fences (entity, highest) VALUES (?, ?) "
                                 "ON CONFLICT(entity) DO UPDATE SET highest = excluded.highest", (entity, fence))
                self._db.execute("COMMIT")
                return Accept()
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def remember(self, key: str, response: StoredResponse) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses (key, status, content_type, body) VALUES (?, ?, ?, ?)",
                             (key, response.status, response.content_type, response.body))

    def highest(self, entity: str) -> int | None:
        with self._lock:
            row = self._db.execute("SELECT highest FROM fences WHERE entity = ?", (entity,)).fetchone()
        return None if row is None else int(row[0])

    def close(self) -> None:
        self._db.close()
