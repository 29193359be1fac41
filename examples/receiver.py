"""An example side-effect service (say, a payment capture) fenced with tether.fencing.

Workers call it through the SDK (`run.http_client().effect(...)`), which sends
Idempotency-Key and X-Execution-Fence. The middleware refuses stale fences
(409) and replays the stored response for a repeated key, so a worker that
wakes up too late cannot charge twice. Each capture it makes is logged as one JSON line
(`"event": "capture"`, with the fence and key it came with).

    python examples/receiver.py --port 8099 --db /tmp/receiver.sqlite
    kubectl apply -f examples/agent-loop/receiver.yaml      # the same in a pod, with a Service
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from tether import logs
from tether.fencing import FencingMiddleware, SQLiteStore

log = logging.getLogger("receiver")


class CaptureApp:
    """The business logic: it never sees a stale or repeated request."""

    def __init__(self) -> None:
        self.captures: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] != "POST" or scope["path"] != "/captures":
            await _json(send, 404, {"error": "NotFound"})
            return
        headers = dict((k.decode(), v.decode()) for k, v in scope["headers"])
        capture = {"id": len(self.captures) + 1, "fence": int(headers["x-execution-fence"]),
                   "request": json.loads(body or b"{}")}
        self.captures.append(capture)
        # The request body may hold personal data: only what identifies the capture is logged.
        log.info("capture", extra={"event": "capture", "id": capture["id"], "fence": capture["fence"],
                                   "idempotencyKey": headers.get("idempotency-key")})
        await _json(send, 201, capture)


async def _json(send: Any, status: int, doc: dict[str, Any]) -> None:
    payload = json.dumps(doc).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def build(db: str) -> tuple[FencingMiddleware, CaptureApp]:
    app = CaptureApp()
    return FencingMiddleware(app, SQLiteStore(db)), app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--db", default="receiver.sqlite")
    args = parser.parse_args()
    logs.setup()
    fenced, _ = build(args.db)
    uvicorn.run(fenced, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
