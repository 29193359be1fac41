"""A fake model API, for tests and for trying the examples without a key (`tether dev fake-model`,
examples/agent-loop/fake-model.yaml): OpenAI-compatible chat completions and responses, and
Anthropic messages, streamed (SSE) or not, each answer with a `usage` block as the real APIs send it.

    fake = FakeModel()                      # listens on 127.0.0.1, a free port
    OpenAI(base_url=fake.url + "/v1", api_key="x")
    fake.next(status=500, usage={...})      # the next answer only: an error, a hostile usage block
    fake.requests                           # every request: path, JSON body, and its answer's
                                            # tokens and knobs (what the model billed, how it ended)

Knobs (constructor defaults, or `next()` for one answer): `input_tokens` (default: the request's
JSON length // 4), `output_tokens` (5), `cached_tokens` (0), `cache_write_tokens` (Anthropic only,
0), `model` (the answer's model; default the request's), `usage` (a raw usage block sent as is,
and in a stream on the usage event), `status` (an error answer, JSON), `gzip` (the answer
gzip-encoded), `cut_after` (a stream closed after this many events, the next one half sent),
`gate` (a threading.Event the stream waits on after its first event), `body` (raw bytes answered
instead, with `content_type`), `cut_body` (a whole answer cut after this many bytes of its body:
its Content-Length promises them all, then the connection drops).

A streamed chat completion sends its usage chunk only with stream_options.include_usage, as
OpenAI does. Listens with HTTP/1.0 semantics: a stream ends when the connection closes.
"""

from __future__ import annotations

import argparse
import gzip as gzipmod
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

WORDS = ["Hello", " from", " the", " fake", " model", "."]


class FakeModel:
    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 knobs: Callable[[dict[str, Any]], dict[str, Any]] | None = None, **defaults: Any) -> None:
        """`knobs`: called with each request (path and body) for that answer's knobs, after `next()`'s."""
        self.defaults: dict[str, Any] = {"output_tokens": 5, "cached_tokens": 0, "cache_write_tokens": 0,
                                         **defaults}
        self.requests: list[dict[str, Any]] = []
        self._next: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        outer, knobs_for = self, knobs

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                outer._answer_json(self, 200, {"object": "list", "data": [{"id": "fake", "object": "model"}]}, {})

            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {}
                entry = {"path": self.path, "body": body, "acceptEncoding": self.headers.get("Accept-Encoding")}
                with outer._lock:
                    outer.requests.append(entry)
                    knobs = {**outer.defaults, **(outer._next.pop(0) if outer._next else {})}
                    if knobs_for is not None:
                        knobs.update(knobs_for(entry))
                entry["knobs"] = {k: v for k, v in knobs.items() if k != "gate"}
                entry["tokens"] = outer._serve(self, self.path.split("?")[0], body if isinstance(body, dict) else {},
                                               len(raw), knobs)

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # many clients at once (the default backlog of 5 resets them)

        self.server = Server((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def next(self, **knobs: Any) -> None:
        """Overrides for the next answer only (queued: one call per answer)."""
        with self._lock:
            self._next.append(knobs)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "FakeModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- answers ------------------------------------------------------------------------------

    def _serve(self, h: BaseHTTPRequestHandler, path: str, body: dict[str, Any], size: int, k: dict[str, Any]) -> int:
        """Answers; returns the tokens its usage block bills (0 for an error or a raw body)."""
        model = k.get("model") or body.get("model") or "fake"
        inp = k["input_tokens"] if k.get("input_tokens") is not None else max(1, size // 4)
        out, cached, written = k["output_tokens"], k["cached_tokens"], k["cache_write_tokens"]
        if k.get("body") is not None:
            self._send(h, k.get("status", 200), k["body"], k.get("content_type", "text/html"), k)
            return 0
        anthropic = path.endswith("/messages")
        responses = path.endswith("/responses")
        if anthropic:
            usage = {"input_tokens": inp, "output_tokens": out, "cache_read_input_tokens": cached,
                     "cache_creation_input_tokens": written, "service_tier": "standard"}
        elif responses:
            usage = {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": inp + out}
        else:
            usage = {"prompt_tokens": inp, "completion_tokens": out, "total_tokens": inp + out,
                     "prompt_tokens_details": {"cached_tokens": cached}}
        billed = inp + out + (cached + written if anthropic else 0)
        if "usage" in k:
            usage = k["usage"]
        status = k.get("status", 200)
        if status >= 400:
            err: dict[str, Any] = {"error": {"type": "server_error", "message": "injected"}}
            if "usage" in k:
                err["usage"] = usage
            self._answer_json(h, status, err, k)
            return 0
        text = "".join(WORDS)
        if not body.get("stream"):
            if anthropic:
                doc: dict[str, Any] = {"id": "msg_1", "type": "message", "role": "assistant", "model": model,
                                       "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                                       "usage": usage}
            elif responses:
                doc = {"id": "resp_1", "object": "response", "status": "completed", "model": model,
                       "output": [{"type": "message", "role": "assistant",
                                   "content": [{"type": "output_text", "text": text}]}], "usage": usage}
            else:
                doc = {"id": "chatcmpl-1", "object": "chat.completion", "model": model,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                    "finish_reason": "stop"}], "usage": usage}
            self._answer_json(h, 200, doc, k)
            return billed
        events: list[tuple[str | None, Any]] = []
        if anthropic:
            start_usage = usage if "usage" in k else {**usage, "output_tokens": 1}
            events.append(("message_start", {"type": "message_start", "message": {
                "id": "msg_1", "type": "message", "role": "assistant", "model": model, "content": [],
                "usage": start_usage}}))
            events.append(("content_block_start", {"type": "content_block_start", "index": 0,
                                                   "content_block": {"type": "text", "text": ""}}))
            events += [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                "delta": {"type": "text_delta", "text": w}}) for w in WORDS]
            events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
            events.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                             "usage": {"output_tokens": out} if "usage" not in k else usage}))
            events.append(("message_stop", {"type": "message_stop"}))
        elif responses:
            events.append(("response.created", {"type": "response.created", "response": {
                "id": "resp_1", "status": "in_progress", "model": model, "usage": None}}))
            events += [("response.output_text.delta", {"type": "response.output_text.delta", "delta": w})
                       for w in WORDS]
            events.append(("response.completed", {"type": "response.completed", "response": {
                "id": "resp_1", "status": "completed", "model": model, "usage": usage}}))
        else:
            with_usage = (body.get("stream_options") or {}).get("include_usage") is True
            base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": model}
            for i, w in enumerate(WORDS):
                chunk: dict[str, Any] = {**base, "choices": [{"index": 0, "delta": {"content": w},
                                                              "finish_reason": None}]}
                if with_usage:
                    chunk["usage"] = None
                events.append((None, chunk))
            if with_usage:
                events.append((None, {**base, "choices": [], "usage": usage}))
            events.append((None, "[DONE]"))
        self._stream(h, events, k)
        return billed

    def _answer_json(self, h: BaseHTTPRequestHandler, status: int, doc: Any, k: dict[str, Any]) -> None:
        self._send(h, status, json.dumps(doc).encode(), "application/json", k)

    def _send(self, h: BaseHTTPRequestHandler, status: int, data: bytes, ctype: str, k: dict[str, Any]) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        if k.get("gzip"):
            data = gzipmod.compress(data)
            h.send_header("Content-Encoding", "gzip")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if k.get("cut_body") is not None:
            h.close_connection = True
            h.wfile.write(data[: k["cut_body"]])  # then the connection drops, the body short of its length
            h.wfile.flush()
            return
        h.wfile.write(data)

    def _stream(self, h: BaseHTTPRequestHandler, events: list[tuple[str | None, Any]], k: dict[str, Any]) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Connection", "close")
        comp = None
        if k.get("gzip"):
            h.send_header("Content-Encoding", "gzip")
            import zlib
            comp = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
        h.end_headers()
        h.close_connection = True

        def write(data: bytes) -> None:
            if comp is not None:
                data = comp.compress(data) + comp.flush(2)  # Z_SYNC_FLUSH: each event readable at once
            h.wfile.write(data)
            h.wfile.flush()

        try:
            for i, (name, data) in enumerate(events):
                payload = data if isinstance(data, str) else json.dumps(data)
                event = (f"event: {name}\n" if name else "") + f"data: {payload}\n\n"
                if k.get("cut_after") is not None and i == k["cut_after"]:
                    write(event.encode()[: len(event) // 2])  # half an event, then the connection drops
                    return
                write(event.encode())
                if i == 0 and k.get("gate") is not None:
                    k["gate"].wait(30)
            if comp is not None:
                h.wfile.write(comp.flush())
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away: an abandoned stream


def arguments(parser: argparse.ArgumentParser) -> None:
    """`tether dev fake-model`'s options."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=int, default=8089)
    parser.add_argument("--input-tokens", type=int, help="input tokens each answer bills (default: the request's size / 4)")
    parser.add_argument("--output-tokens", type=int, default=5, help="output tokens each answer bills")


def serve(args: argparse.Namespace) -> int:
    """`tether dev fake-model`: serves until killed."""
    fake = FakeModel(args.host, args.port, input_tokens=args.input_tokens, output_tokens=args.output_tokens)
    print(f"fake model API on {fake.url} (OpenAI base URL {fake.url}/v1)", flush=True)
    threading.Event().wait()
    return 0
