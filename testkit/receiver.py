"""A side-effect service for tests, fenced with tether.fencing (plain-function form): it records
every request it gets, with the fence and key it carried, its arrival time and what it decided."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tether.fencing import Accept, MemoryStore, Reject, Replay, StoredResponse, check


@dataclass(frozen=True)
class Effect:
    """One side-effect request as the receiver saw it."""

    fence: int | None
    key: str
    step: int | None
    attempt: int | None
    at: float  # wall clock, comparable with the audit log's times on this machine
    decision: str  # accepted | refused | replayed | in-progress
    traceparent: str | None = None  # the W3C trace context the request carried (correlation only)


class Receiver:
    """A side-effect service fenced with tether.fencing, recording every request and its time."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        """`host`: the address to listen on (a real node's pods reach the host side of its veth)."""
        self.store = MemoryStore()
        self.effects: list[Effect] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                arrived = time.time()
                try:  # a malformed body is still an effect that was sent: recorded, never a crash
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                    body = body if isinstance(body, dict) else {}
                except ValueError:
                    body = {}
                key, fence = self.headers.get("Idempotency-Key") or "", self.headers.get("X-Execution-Fence")
                decision = check(outer.store, key.rsplit(":", 1)[0], fence, key)
                status, answer, verdict = 200, b'{"ok":true}', "accepted"
                if isinstance(decision, Reject):
                    code = getattr(decision, "code", "StaleFence")  # InProgress: the same key is running
                    status, verdict = 409, "refused" if code == "StaleFence" else "in-progress"
                    answer = json.dumps({"error": code, "message": decision.message}).encode()
                elif isinstance(decision, Replay):
                    status, answer, verdict = decision.response.status, decision.response.body, "replayed"
                else:
                    assert isinstance(decision, Accept)
                    outer.store.remember(key, StoredResponse(200, answer))
                with outer._lock:
                    outer.effects.append(Effect(int(fence) if (fence or "").isdigit() else None, key, body.get("step"),
                                                body.get("attempt"), arrived, verdict,
                                                self.headers.get("traceparent")))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}/effect"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def seen(self) -> list[Effect]:
        with self._lock:
            return list(self.effects)

    def accepted(self) -> list[Effect]:
        return [e for e in self.seen() if e.decision == "accepted"]

    def refused(self) -> list[Effect]:
        """Refused as stale (a lower fence), or for missing or malformed headers."""
        return [e for e in self.seen() if e.decision == "refused"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
