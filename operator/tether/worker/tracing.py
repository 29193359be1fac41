"""The worker SDK's spans, through the OpenTelemetry API only (opentelemetry-api): until the
application installs an SDK (a TracerProvider), every call here is a no-op.

The operator hands each attempt its W3C trace context (TRACEPARENT in a pod, `traceparent` in the
gateway's claim reply). Renewals, publications, checkpoint flushes and side effects are spans of
that trace, so they sit under the operator's `tether.attempt` span. Shared by WorkerRun and
AsyncWorkerRun through RunCore: the ops generators are wrapped (a span is never made current across
a yield, which may resume on another thread or task), and the fenced clients open the effect's span.

The context is a correlation id, never a credential: nothing in Tether trusts it, and a receiver
must judge a side effect by its fence (docs/operations.md, "Tracing").
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Generator, Iterator, TypeVar
from urllib.parse import urlsplit, urlunsplit

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from tether.tracecontext import parse_traceparent

SCOPE = "tether.worker"
T = TypeVar("T")


class AttemptTrace:
    """An attempt's trace: its parent context and the attributes every span of it carries."""

    def __init__(self, traceparent: str | None, attributes: dict[str, Any]) -> None:
        self.traceparent = traceparent
        self.attributes = attributes
        self.renewals = Renewals()
        parsed = parse_traceparent(traceparent)
        self._parent = otel_context.Context()  # a root, not whatever is current where the run was made
        if parsed is not None:
            flags = TraceFlags(TraceFlags.SAMPLED if parsed.sampled else TraceFlags.DEFAULT)
            remote = SpanContext(parsed.trace_id, parsed.span_id, is_remote=True, trace_flags=flags)
            self._parent = trace.set_span_in_context(NonRecordingSpan(remote), self._parent)

    def context(self) -> otel_context.Context:
        """The attempt's context, to parent the application's own spans on."""
        return self._parent

    def parent(self, background: bool = False) -> otel_context.Context:
        """The caller's current span when it has one (the application's, parented on the attempt
        if it chose), else the attempt. Background work (the heartbeat) is always the attempt's."""
        if not background and trace.get_current_span().get_span_context().is_valid:
            return otel_context.get_current()
        return self._parent

    def _start(self, name: str, kind: SpanKind, attrs: dict[str, Any], background: bool = False) -> trace.Span:
        return _tracer().start_span(name, context=self.parent(background), kind=kind,
                                                  attributes={**self.attributes, **attrs})

    def ops(self, name: str, steps: Generator[Any, Any, T], kind: SpanKind = SpanKind.CLIENT,
            background: bool = False, outcome: Callable[[T], dict[str, Any]] | None = None,
            **attrs: Any) -> Generator[Any, Any, T]:
        """`steps` (an ops generator) inside a span, ended however they end; the span is not
        current while they wait (a yield may resume elsewhere)."""
        span = self._start(name, kind, attrs, background)
        try:
            result = yield from steps
            if outcome is not None:
                span.set_attributes(outcome(result))
            return result
        except BaseException as exc:
            _record(span, exc)
            raise
        finally:
            span.end()

    def renewal(self, steps: Generator[Any, Any, T], carried: Any, signals: Callable[[], Any],
                outcome: Callable[[T], str]) -> Generator[Any, Any, T]:
        """A renewal (`steps`), recorded as a `tether.renew` span only when Renewals says it is news;
        the span is made afterwards with the renewal's start time (it is never current while the
        renewal waits, like ops()). The tracer is the one of the renewal's start, as ops()'s span's; a
        renewal abandoned unfinished (its generator closed, maybe by the garbage collector long
        after) has no outcome to tell, and no span."""
        parent, start, before = self.parent(background=True), time.time_ns(), signals()
        tracer = _tracer()
        try:
            result = yield from steps
        except GeneratorExit:
            raise
        except BaseException as exc:
            span = tracer.start_span("tether.renew", context=parent, kind=SpanKind.CLIENT,
                                     attributes={**self.attributes, **self.renewals.skipped()}, start_time=start)
            _record(span, exc)
            span.end()
            raise
        name = outcome(result)
        if self.renewals.news(name, carried, signals() != before):
            tracer.start_span("tether.renew", context=parent, kind=SpanKind.CLIENT, start_time=start, attributes={
                **self.attributes, **self.renewals.skipped(), "tether.renewal": name}).end()
        return result

    def event(self, name: str, **attrs: Any) -> None:
        """A span with no duration of its own (a checkpoint flush: the heartbeat sends it)."""
        self._start(name, SpanKind.INTERNAL, attrs).end()

    @contextlib.contextmanager
    def effect(self, method: str, url: str, operation: str) -> Iterator[trace.Span]:
        """A side effect's span, current while it is sent (headers() reads it). Within one call:
        a thread's or a task's context never leaves it."""
        span = self._start("tether.effect", SpanKind.CLIENT,
                           {"tether.operation": operation, "http.request.method": method.upper(),
                            "url.full": redact_url(str(url))})
        try:
            with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                yield span
        except BaseException as exc:
            _record(span, exc)
            raise
        finally:
            span.end()

    def headers(self) -> dict[str, str]:
        """The trace headers of a request sent now: `traceparent` of the current span (the effect's;
        the attempt's own context when no SDK records), and what the application's propagator adds."""
        current = trace.get_current_span()
        sc = current.get_span_context() if current.get_span_context().is_valid else \
            trace.get_current_span(self._parent).get_span_context()
        if not sc.is_valid:
            return {}
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(NonRecordingSpan(sc)))
        carrier["traceparent"] = f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{'01' if sc.trace_flags.sampled else '00'}"
        return carrier


class Renewals:
    """Which renewals are worth a span. A heartbeat renews every few seconds for as long as the
    attempt runs (2,880 renewals a day at 30 s), all in the attempt's trace: a span each would bury
    it. So a renewal is a span only when something happened: it was not confirmed (unanswered,
    refused, lost, or it failed), its outcome differs from the previous renewal's (the first one;
    confirmed again after unconfirmed ones), it carried something new (a checkpoint, usage or the
    approval requests differ from what the previous renewal carried), or it brought new signals.
    Each span counts the quiet renewals before it (`tether.renewals.unrecorded`). The same rule in
    the TypeScript and Go SDKs; docs/operations.md, "Tracing"."""

    def __init__(self) -> None:
        self._outcome: str | None = None
        self._carried: Any = None
        self._quiet = 0

    def news(self, outcome: str, carried: Any, signals_changed: bool) -> bool:
        worth = outcome != "confirmed" or outcome != self._outcome or carried != self._carried or signals_changed
        self._outcome, self._carried = outcome, carried
        if not worth:
            self._quiet += 1
        return worth

    def skipped(self) -> dict[str, int]:
        """The quiet renewals since the last span (an attribute of the next one), then none."""
        quiet, self._quiet = self._quiet, 0
        return {"tether.renewals.unrecorded": quiet} if quiet else {}


def redact_url(url: str) -> str:
    """A URL fit for `url.full`: credentials (user:password@) become REDACTED:REDACTED, every query
    value becomes REDACTED (the keys stay), the fragment goes. The same rule in the TypeScript and Go
    SDKs. Something that is not a URL is dropped whole."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = "REDACTED:REDACTED@" + netloc.rpartition("@")[2]
        query = "&".join(p.split("=", 1)[0] + "=REDACTED" if "=" in p else p for p in parts.query.split("&") if p)
        return urlunsplit((parts.scheme, netloc, parts.path, query, ""))
    except ValueError:
        return "REDACTED"


def _record(span: trace.Span, exc: BaseException) -> None:
    span.set_attribute("exception.type", type(exc).__name__)
    if isinstance(exc, Exception):
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:256]))


def _tracer() -> trace.Tracer:
    """The global provider's tracer, looked up per span: an SDK installed after the run was made counts."""
    return trace.get_tracer(SCOPE)
