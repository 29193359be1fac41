"""The operator's OpenTelemetry tracing: opt-in, configured by the standard OTEL_* environment.

Off unless an exporter is configured (OTEL_TRACES_EXPORTER, or an OTLP endpoint): then every call
here goes to the API's no-op tracer and costs a few attribute lookups. On, spans leave through a
BatchSpanProcessor: ending a span only appends it to a bounded in-memory queue, and a background
thread exports (with the exporter's own timeout), so a slow or absent collector never holds up a
reconcile; when the queue is full, spans are dropped, never waited for.

Spans (docs/operations.md, "Tracing"):
- `reconcile WorkerRun`, one per reconcile pass, a trace of its own (a run reconciles every few
  seconds for days: as children of the attempt they would bury its trace) with a link to the
  attempt's trace, and the run, attempt, fence and decision as attributes;
- `tether.attempt`, the root of the attempt's trace (tracecontext.py derives its ids), exported
  once, by whichever replica's compare-and-swap ended the attempt, from the attempt record's
  start and end times. Nothing is held open in memory while an attempt runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from tether.tracecontext import TraceContext, attempt_context

if TYPE_CHECKING:
    from tether.api.models import AttemptRecord, WorkerRun
    from tether.core.actions import Action

log = logging.getLogger("tether.operator")

SCOPE = "tether.operator"
DEFAULT_SERVICE_NAME = "tether-operator"
_tracer: trace.Tracer = trace.get_tracer(SCOPE)
_provider: Any = None  # the SDK's TracerProvider once configure() installed one
# The attempt spans' tracer: always sampled (the workers were told so by the traceparent's flag),
# whatever OTEL_TRACES_SAMPLER does to the reconcile spans. Same processors, so same export.
_attempt_tracer: trace.Tracer | None = None

# The ids the next span must take (the attempt span's derived ids); read by _AttemptIds.
_forced: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar("tether_forced_ids", default=None)


def enabled_by(env: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces: OTEL_SDK_DISABLED=true wins; then an explicit
    OTEL_TRACES_EXPORTER (anything but `none`); else an OTLP endpoint being set. The spec's
    default exporter (otlp to localhost) is not assumed: an operator nobody configured exports
    nothing and pays nothing."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return any(e.strip() not in ("", "none") for e in exporters.split(","))
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _exporters(env: Mapping[str, str]) -> list[Any]:
    out: list[Any] = []
    for name in (env.get("OTEL_TRACES_EXPORTER", "").strip().lower() or "otlp").split(","):
        name = name.strip()
        if name == "otlp":
            protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                        or "http/protobuf").strip()
            if protocol == "grpc":
                # Not in tether[otel]; installed beside it, it is used.
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
                out.append(Grpc())
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
                out.append(OTLPSpanExporter())  # endpoint, headers, timeout, TLS: OTEL_EXPORTER_OTLP_*
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter
            out.append(ConsoleSpanExporter())
        elif name not in ("", "none"):
            log.warning("unknown trace exporter ignored", extra={"event": "tracing_exporter_unknown", "exporter": name})
    return out


def configure(env: Mapping[str, str] | None = None) -> bool:
    """Installs the SDK's tracer provider when the environment asks for traces (False: tracing
    stays off). Without tether[otel] installed it says so once and stays off: never fatal."""
    global _provider, _attempt_tracer
    env = os.environ if env is None else env
    if _provider is not None or not enabled_by(env):
        return _provider is not None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON
        exporters = _exporters(env)
    except ImportError as exc:
        log.warning("tracing asked for, but the OpenTelemetry SDK or exporter is not installed (pip install "
                    "'tether-operator[otel]'): tracing stays off",
                    extra={"event": "tracing_unavailable", "error": str(exc)})
        return False
    if not exporters:
        return False
    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    resource = Resource.create({} if named else {"service.name": DEFAULT_SERVICE_NAME})
    provider = TracerProvider(resource=resource, id_generator=attempt_ids())
    attempts = TracerProvider(resource=resource, id_generator=attempt_ids(), sampler=ALWAYS_ON, shutdown_on_exit=False)
    for exporter in exporters:
        processor = BatchSpanProcessor(exporter)  # queue size, delays: OTEL_BSP_*
        provider.add_span_processor(processor)
        attempts.add_span_processor(processor)  # shut down with `provider`
    trace.set_tracer_provider(provider)
    _provider, _attempt_tracer = provider, attempts.get_tracer(SCOPE)
    log.info("tracing on", extra={"event": "tracing_configured",
                                  "exporters": [type(e).__name__ for e in exporters]})
    return True


def shutdown_timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds shutdown() may take: OTEL_EXPORTER_OTLP_TRACES_TIMEOUT or OTEL_EXPORTER_OTLP_TIMEOUT,
    read as the OTLP exporter reads them (seconds), default 10."""
    env = os.environ if env is None else env
    raw = env.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or env.get("OTEL_EXPORTER_OTLP_TIMEOUT") or "10"
    try:
        return max(0.0, float(raw))
    except ValueError:
        return 10.0


def shutdown(timeout: float | None = None) -> bool:
    """Exports what is queued, within `timeout` seconds overall (shutdown_timeout()): the exporter's
    own timeout bounds each request, not its retries nor the processor's flush, and a collector that
    accepts and never answers held the operator past its pod's grace period. The provider shuts down
    on a daemon thread that is left behind at the deadline (what it still holds is lost). False when
    the deadline passed. Blocking: call it off the loop."""
    provider = _provider
    if provider is None:
        return True
    timeout = shutdown_timeout() if timeout is None else timeout
    worker = threading.Thread(target=provider.shutdown, name="tether-tracing-shutdown", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        log.warning("tracing shutdown gave up after %.1fs: queued spans are lost", timeout,
                    extra={"event": "tracing_shutdown_timeout", "timeoutSeconds": timeout})
        return False
    return True


def attempt_ids() -> Any:
    """The SDK's random ids, except for a span started under `_forced` (the attempt span)."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class AttemptIds(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            forced = _forced.get()
            return forced.trace_id if forced is not None else super().generate_trace_id()

        def generate_span_id(self) -> int:
            forced = _forced.get()
            return forced.span_id if forced is not None else super().generate_span_id()

    return AttemptIds()


# --- attributes -------------------------------------------------------------------


def run_attributes(run: WorkerRun) -> dict[str, Any]:
    s = run.status
    attrs: dict[str, Any] = {"k8s.namespace.name": run.metadata.namespace, "tether.run.name": run.metadata.name,
                             "tether.run.uid": run.metadata.uid or "", "tether.attempt": s.attempt,
                             "tether.fence": s.fence}
    if s.holder:
        attrs["tether.holder"] = s.holder
    if s.phase is not None:
        attrs["tether.phase"] = s.phase.value
    return attrs


def _span_context(ctx: TraceContext) -> SpanContext:
    return SpanContext(ctx.trace_id, ctx.span_id, is_remote=True,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED if ctx.sampled else TraceFlags.DEFAULT))


def attempt_link(run: WorkerRun) -> Link | None:
    """A link to the trace of the run's latest attempt (None before its first)."""
    rec = run.status.attempts[-1] if run.status.attempts else None
    if rec is None or not run.metadata.uid:
        return None
    return Link(_span_context(attempt_context(run.metadata.uid, rec.attempt, rec.fence)),
                {"tether.attempt": rec.attempt, "tether.fence": rec.fence})


def describe(actions: list[Action]) -> list[str]:
    """The decision as span attribute values: each action's name, and what a status write records."""
    from tether.core.actions import Revoke, WriteStatus

    out = []
    for a in actions:
        write = a.status_write if isinstance(a, Revoke) else a if isinstance(a, WriteStatus) else None
        what = [type(a).__name__]
        if write is not None and write.change is not None:
            what.append(write.change.value)
        if write is not None and write.ended is not None:
            what.append(write.ended.value)
        out.append(":".join(what))
    return out


# --- spans ------------------------------------------------------------------------


@contextlib.contextmanager
def reconcile_span(namespace: str, name: str, benign: tuple[type[BaseException], ...] = ()) -> Iterator[trace.Span]:
    """The span of one reconcile pass, current while it runs and ended however the pass ends:
    a `benign` exception (decide again, not the leader) is an outcome, any other an error."""
    with _tracer.start_as_current_span("reconcile WorkerRun", kind=SpanKind.INTERNAL,
                                       attributes={"k8s.namespace.name": namespace, "tether.run.name": name},
                                       record_exception=False, set_status_on_exception=False) as span:
        try:
            yield span
        except benign as exc:
            span.set_attribute("tether.reconcile.result", type(exc).__name__)
            raise
        except BaseException as exc:
            span.set_attribute("tether.reconcile.result", type(exc).__name__)
            if isinstance(exc, Exception):
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:256]))
            raise


def on_snapshot(run: WorkerRun) -> None:
    """What the current reconcile span learns from the run it is about to decide on."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attributes(run_attributes(run))
    link = attempt_link(run)
    if link is not None:
        span.add_link(link.context, link.attributes)


def on_decision(actions: list[Action]) -> None:
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("tether.decision", describe(actions) or ["none"])


def on_status_written(run: WorkerRun, grants: bool, ends_attempt: bool) -> None:
    """After a status compare-and-swap landed: a grant links the reconcile to the new attempt's
    trace; an ended attempt's span is exported (exactly once: only one write ends it)."""
    if _provider is None and not trace.get_current_span().is_recording():
        return
    if grants:
        link = attempt_link(run)
        span = trace.get_current_span()
        if link is not None and span.is_recording():
            span.add_link(link.context, {**(link.attributes or {}), "tether.granted": True})
    if ends_attempt:
        ended = [a for a in run.status.attempts if a.outcome is not None]
        if ended:
            export_attempt(run, ended[-1])


def _ns(t: dt.datetime | None) -> int | None:
    return int(t.timestamp() * 1e9) if t is not None else None


def export_attempt(run: WorkerRun, rec: AttemptRecord) -> None:
    """The attempt's root span, with its derived ids, from its start to its end."""
    from tether.api.models import Outcome

    ctx = attempt_context(run.metadata.uid or "", rec.attempt, rec.fence)
    attrs: dict[str, Any] = {"k8s.namespace.name": run.metadata.namespace, "tether.run.name": run.metadata.name,
                             "tether.run.uid": run.metadata.uid or "", "tether.attempt": rec.attempt,
                             "tether.fence": rec.fence, "tether.executor": run.spec.executor}
    if rec.holder:
        attrs["tether.holder"] = rec.holder
    if rec.outcome is not None:
        attrs["tether.outcome"] = rec.outcome.value
    token = _forced.set(ctx)
    try:
        # An empty context: a root span, whatever span is current (the reconcile's).
        span = (_attempt_tracer or _tracer).start_span("tether.attempt", context=otel_context.Context(), kind=SpanKind.INTERNAL,
                                  attributes=attrs, start_time=_ns(rec.started_at or rec.ended_at))
    finally:
        _forced.reset(token)
    if rec.outcome is not None and rec.outcome not in (Outcome.SUCCEEDED, Outcome.CANCELLED):
        span.set_status(Status(StatusCode.ERROR, rec.outcome.value))
    span.end(end_time=_ns(rec.ended_at))
