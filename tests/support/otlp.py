"""An OTLP/HTTP trace receiver for tests: it accepts ExportTraceServiceRequest (protobuf, optionally
gzip) on POST /v1/traces, decodes it with opentelemetry-proto, and keeps every span it got."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from testkit.kube import eventually


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root
    service: str
    scope: str
    kind: int
    start_ns: int
    end_ns: int
    status_code: int
    attributes: dict[str, Any] = field(default_factory=dict)
    links: tuple[tuple[str, str, dict[str, Any]], ...] = ()  # (trace id, span id, attributes)


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[Span]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        service = str(_attrs(rs.resource.attributes).get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), service,
                                ss.scope.name, s.kind, s.start_time_unix_nano, s.end_time_unix_nano, s.status.code,
                                _attrs(s.attributes),
                                tuple((ln.trace_id.hex(), ln.span_id.hex(), _attrs(ln.attributes)) for ln in s.links)))
    return out


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, *args: Any) -> None:  # quiet: the test reads spans, not access lines
        return

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces" or "protobuf" not in (self.headers.get("Content-Type") or ""):
            self.send_response(415 if self.path == "/v1/traces" else 404)
            self.end_headers()
            return
        self.server.receiver.add(decode(body))
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)


class _Server(ThreadingHTTPServer):
    receiver: "OtlpReceiver"


class OtlpReceiver:
    """POST http://127.0.0.1:<port>/v1/traces. `endpoint` is what OTEL_EXPORTER_OTLP_ENDPOINT takes."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._spans: list[Span] = []
        self.requests = 0
        self._lock = threading.Lock()
        self.server = _Server((host, 0), _Handler)
        self.server.receiver = self
        self.port = self.server.server_address[1]
        self.endpoint = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def add(self, spans: list[Span]) -> None:
        with self._lock:
            self._spans.extend(spans)
            self.requests += 1

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, pick: Callable[[list[Span]], Any], timeout: float = 30, what: str = "spans") -> Any:
        """Polls until `pick(spans)` is truthy (then returns it), or fails at the deadline."""
        return eventually(lambda: pick(self.spans()) or None, timeout=timeout, what=what)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
