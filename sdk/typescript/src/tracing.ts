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

/** A URL fit for `url.full`: credentials (user:password@) become REDACTED:REDACTED, every query
 * value becomes REDACTED (the keys stay), the fragment goes. The same rule in the Python and Go SDKs.
 * Something that is not a URL is dropped whole. */
export function redactUrl(url: string | URL): string {
  let u: URL;
  try {
    u = new URL(String(url));
  } catch {
    return "REDACTED";
  }
  const credentials = u.username || u.password ? "REDACTED:REDACTED@" : "";
  const query = u.search.slice(1).split("&").filter((p) => p !== "")
    .map((p) => (p.includes("=") ? `${p.slice(0, p.indexOf("="))}=REDACTED` : p)).join("&");
  const authority = u.host === "" ? "" : `//${credentials}${u.host}`;
  return `${u.protocol}${authority}${u.pathname}${query ? `?${query}` : ""}`;
}

/** Which renewals are worth a span. A heartbeat renews every few seconds for as long as the attempt
 * runs (2,880 renewals a day at 30 s), all in the attempt's trace: a span each would bury it. So a
 * renewal is a span only when something happened: it was not confirmed (unanswered, refused, lost,
 * or it failed), its outcome differs from the previous renewal's (the first one; confirmed again
 * after unconfirmed ones), it carried something new (checkpoint, usage or approval requests differ
 * from what the previous renewal carried), or it brought new signals. Each span counts the quiet
 * renewals before it (`tether.renewals.unrecorded`). The same rule in the Python and Go SDKs. */
export class Renewals {
  private outcome: string | null = null;
  private carried: string | null = null;
  private quiet = 0;

  news(outcome: string, carried: string, signalsChanged: boolean): boolean {
    const worth = outcome !== "confirmed" || outcome !== this.outcome || carried !== this.carried || signalsChanged;
    this.outcome = outcome;
    this.carried = carried;
    if (!worth) this.quiet += 1;
    return worth;
  }

  /** The quiet renewals since the last span (an attribute of the next one), then none. */
  skipped(): Attributes {
    const quiet = this.quiet;
    this.quiet = 0;
    return quiet ? { "tether.renewals.unrecorded": quiet } : {};
  }
}

export { SpanKind, SpanStatusCode };
