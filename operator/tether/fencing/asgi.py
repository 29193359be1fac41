"""ASGI middleware: fences every mutating request before the application sees it."""

from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, Callable

from tether.fencing.core import FenceStore, InProgress, Reject, Replay, StoredResponse, check

log = logging.getLogger("tether.fencing")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def entity_of_key(key: str) -> str:
    """Default entity: the Idempotency-Key without its operation (`<idempotencyKey>:<operation>`)."""
    return key.rsplit(":", 1)[0]


class FencingMiddleware:
    def __init__(self, app: ASGIApp, store: FenceStore,
                 entity: Callable[[Scope, str], str] = lambda scope, key: entity_of_key(key),
                 methods: frozenset[str] = MUTATING) -> None:
        self.app = app
        self.store = store
        self.entity = entity
        self.methods = methods

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.methods:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key = headers.get("idempotency-key")
        decision = check(self.store, self.entity(scope, key or ""), headers.get("x-execution-fence"), key)
        if isinstance(decision, InProgress):
            # Not a stale worker: the same request is running. The client retries later and
            # then receives the stored response.
            log.info("duplicate of an effect in progress", extra={"event": "effect_in_progress"})
            body = {"error": decision.code, "message": decision.message}
            await _respond(send, StoredResponse(decision.status, json.dumps(body).encode()),
                           extra=[(b"retry-after", b"1")])
            return
        if isinstance(decision, Reject):
            log.warning("side effect refused", extra={"event": "effect_refused", "status": decision.status,
                                                      "reason": decision.message})
            body = {"error": "StaleFence" if decision.status == 409 else "BadRequest", "message": decision.message}
            if decision.highest >= 0:
                body["highestFence"] = decision.highest
            await _respond(send, StoredResponse(decision.status, json.dumps(body).encode()))
            return
        if isinstance(decision, Replay):
            await _respond(send, decision.response, replayed=True)
            return
        assert key is not None  # check() accepts only requests that carry a key
        captured: dict[str, Any] = {"status": 500, "content_type": "application/json", "body": b""}

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                captured["status"] = message["status"]
                for k, v in message.get("headers", []):
                    if k.lower() == b"content-type":
                        captured["content_type"] = v.decode("latin-1")
            elif message["type"] == "http.response.body":
                captured["body"] += message.get("body", b"")
            await send(message)

        stored = False
        try:
            await self.app(scope, receive, capture)
            if captured["status"] < 500:
                self.store.remember(key, StoredResponse(captured["status"], captured["body"], captured["content_type"]))
                stored = True
        finally:
            if not stored:
                # A server error, an exception or a cancelled request: the effect may be retried
                # with the same key, so the key must not stay in flight.
                self.store.release(key)


async def _respond(send: Send, response: StoredResponse, replayed: bool = False,
                   extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", response.content_type.encode()), (b"content-length", str(len(response.body)).encode())]
    if replayed:
        headers.append((b"idempotent-replayed", b"true"))
    headers += extra or []
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})
