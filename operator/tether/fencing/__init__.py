"""Receiver-side fencing for side-effect services.

A service that performs side effects for Tether workers (charge a card, send
an email, update a record) remembers the highest fence it accepted per
entity, refuses lower fences (a worker that woke up too late), and replays
the stored response when the same Idempotency-Key comes again. While the first
request with a key is still running, a repeat is answered 409 "in progress"
(InProgress), never run a second time.
"""

from tether.fencing.asgi import FencingMiddleware, entity_of_key
from tether.fencing.core import (Accept, Decision, FenceStore, InProgress, MemoryStore, Reject, Replay,
                                 StoredResponse, check)
from tether.fencing.sqlite import SQLiteStore

__all__ = ["check", "Accept", "Reject", "InProgress", "Replay", "Decision", "FenceStore", "MemoryStore", "SQLiteStore",
           "StoredResponse", "FencingMiddleware", "entity_of_key"]
