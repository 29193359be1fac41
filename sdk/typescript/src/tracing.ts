/**
 * Spans for the attempt's trace, through the OpenTelemetry API only (@opentelemetry/api, a peer
 * dependency): without an SDK registered by the application every call is a no-op. The operator
 * hands each attempt its W3C trace context (TRACEPARENT in a pod, `traceparent` in the gateway's
 * claim reply); the SDK's spans (renewals, publications, checkpoint flushes, side effects) are
 * parented on it, so they join the attempt's trace. The context is a correlation id: nothing in
 * Tether trusts it (docs/operations.md, "Tracing").
 */

import {
  ROOT_CONTEXT, SpanKind, SpanStatusCode, TraceFlags, context, propagation, trace,
  type Attributes, type Context, type Span, type SpanContext,
} from "@opentelemetry/api";

export const TRACER_NAME = "@tether-dev/worker";
/** The environment variable that carries the attempt's context in a pod. */
export const ENV_TRACEPARENT = "TRACEPARENT";

const TRACEPARENT = /^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$/;

/** A `traceparent` as W3C Trace Context level 1 reads it, or null when invalid (spans then start as
 * roots: tracing never stops work). */
export function parseTraceparent(value: string | null | undefined): SpanContext | null {
  if (!value) return null;
  const m = TRACEPARENT.exec(value.trim());
  if (m === null) return null;
  const [, version, traceId, spanId, flags, rest] = m as unknown as [string, string, string, string, string, string?];
  if (version === "ff" || (version === "00" && rest)) return null;
  if (/^0+$/.test(traceId) || /^0+$/.test(spanId)) return null;
  return { traceId, spanId, traceFlags: parseInt(flags, 16) & TraceFlags.SAMPLED, isRemote: true };
}

/** `traceparent` of a span context (version 00). */
export function formatTraceparent(sc: SpanContext): string {
  const flags = (sc.traceFlags & TraceFlags.SAMPLED) ? "01" : "00";
  return `00-${sc.traceId}-${sc.spanId}-${flags}`;
}

/** The attempt's context: the root context with the operator's attempt span as remote parent. */
export function attemptContext(traceparent: string | null | undefined): Context {
  const parent = parseTraceparent(traceparent);
  return parent === null ? ROOT_CONTEXT : trace.setSpanContext(ROOT_CONTEXT, parent);
}

/** Where a span of the SDK starts: under the caller's active span when there is one (the
 * application's own span, itself in the attempt's trace if it was parented on it), else under the
 * attempt. Background work (the heartbeat) always starts under the attempt. */
export function parentFor(attempt: Context, background = false): Context {
  if (!background && trace.getSpanContext(context.active()) !== undefined) return context.active();
  return attempt;
}

/** Runs `fn` in a span; ended on every path, an exception recorded (and rethrown). */
export async function inSpan<T>(name: string, parent: Context, attributes: Attributes, kind: SpanKind,
  fn: (span: Span) => Promise<T>): Promise<T> {
  const span = trace.getTracer(TRACER_NAME).startSpan(name, { kind, attributes }, parent);
  try {
    return await context.with(trace.setSpan(parent, span), () => fn(span));
  } catch (err) {
    span.recordException(err as Error);
    span.setStatus({ code: SpanStatusCode.ERROR, message: String((err as Error)?.name ?? err) });
    throw err;
  } finally {
    span.end();
  }
}

/** Adds the span's context to a side effect's headers: `traceparent` always (when the span context
 * is valid), and whatever the application's registered propagator adds (tracestate, baggage). */
export function injectTraceHeaders(span: Span, headers: Headers): void {
  const sc = span.spanContext();
  if (!trace.isSpanContextValid(sc)) return;
  headers.set("traceparent", formatTraceparent(sc));
  propagation.inject(trace.setSpan(context.active(), span), headers, {
    set: (carrier, key, value) => carrier.set(key, value),
  });
}

export { SpanKind, SpanStatusCode };
