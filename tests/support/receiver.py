"""A side-effect service for tests, fenced with tether.fencing (plain-function form)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tether.fencing import Accept, MemoryStore, Reject, Replay, StoredResponse, check


class FencedReceiver:
    def __init__(self) -> None:
        self.store = MemoryStore()
        self.accepted: list[dict[str, Any]] = []
        self.refused: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                key = self.headers.get("Idempotency-Key")
                fence = self.headers.get("X-Execution-Fence")
                entity = (key or "").rsplit(":", 1)[0]
                decision = check(receiver.store, entity, fence, key)
                if isinstance(decision, Reject):
                    with receiver.lock:
                        receiver.refused.append({"fence": fence, "key": key, **body})
                    self._send(409, json.dumps({"error": "StaleFence", "message": decision.message}).encode())
                elif isinstance(decision, Replay):
                    self._send(decision.response.status, decision.response.body)
                else:
                    assert isinstance(decision, Accept)
                    with receiver.lock:
                        receiver.accepted.append({"fence": int(fence or 0), "key": key, **body})
                    payload = json.dumps({"accepted": True, "fence": int(fence or 0)}).encode()
                    receiver.store.remember(key or "", StoredResponse(200, payload))
                    self._send(200, payload)

            def _send(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
