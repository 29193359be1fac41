package tether

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Tracing goes through the OpenTelemetry API only (go.opentelemetry.io/otel): without a
// TracerProvider set by the application (otel.SetTracerProvider) every span is a no-op. The
// operator hands each attempt its W3C trace context (TRACEPARENT in a pod, traceparent in the
// gateway's claim reply); the SDK's spans (renewals, publications, checkpoint flushes, side
// effects) are parented on it. The context is a correlation id: nothing in Tether trusts it.

// TracerName is the instrumentation scope of the SDK's spans.
const TracerName = "github.com/tether-dev/tether/sdk/go"

const envTraceparent = "TRACEPARENT"

var traceparentRE = regexp.MustCompile(`^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$`)

// ParseTraceparent reads a traceparent as W3C Trace Context level 1 does; false when it is invalid
// (spans then start as roots: tracing never stops work).
func ParseTraceparent(value string) (trace.SpanContext, bool) {
	m := traceparentRE.FindStringSubmatch(strings.TrimSpace(value))
	if m == nil || m[1] == "ff" || (m[1] == "00" && m[5] != "") {
		return trace.SpanContext{}, false
	}
	tid, err1 := trace.TraceIDFromHex(m[2])
	sid, err2 := trace.SpanIDFromHex(m[3])
	if err1 != nil || err2 != nil { // also the all-zero ids, which are invalid
		return trace.SpanContext{}, false
	}
	var flags trace.TraceFlags
	if b, err := strconv.ParseUint(m[4], 16, 8); err == nil && b&1 == 1 {
		flags = trace.FlagsSampled
	}
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: flags, Remote: true}), true
}

// FormatTraceparent is a span context's traceparent (version 00).
func FormatTraceparent(sc trace.SpanContext) string {
	flags := "00"
	if sc.IsSampled() {
		flags = "01"
	}
	return "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-" + flags
}

// Traceparent is the attempt's W3C trace context as the operator handed it ("" when none).
func (r *Run) Traceparent() string { return r.info.traceparent }

// TraceContext returns ctx with the attempt's span as its remote parent: parent your own spans on it
// (the SDK's are).
func (r *Run) TraceContext(ctx context.Context) context.Context {
	if sc, ok := ParseTraceparent(r.info.traceparent); ok {
		return trace.ContextWithRemoteSpanContext(ctx, sc)
	}
	return ctx
}

// startSpan starts one of the SDK's spans: under the caller's span when ctx has one (the
// application's own, itself in the attempt's trace if it was parented on it), else under the attempt.
func (r *Run) startSpan(ctx context.Context, name string, kind trace.SpanKind, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	return r.startSpanAt(ctx, time.Time{}, name, kind, attrs...)
}

// startSpanAt is startSpan for a span that began at start (now, when zero).
func (r *Run) startSpanAt(ctx context.Context, start time.Time, name string, kind trace.SpanKind, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		ctx = r.TraceContext(ctx)
	}
	base := []attribute.KeyValue{
		attribute.String("k8s.namespace.name", r.info.namespace), attribute.String("tether.run.name", r.info.name),
		attribute.Int("tether.attempt", r.info.attempt), attribute.Int64("tether.fence", r.info.fence),
		attribute.String("tether.holder", r.info.holder),
	}
	if r.info.runUID != "" {
		base = append(base, attribute.String("tether.run.uid", r.info.runUID))
	}
	opts := []trace.SpanStartOption{trace.WithSpanKind(kind), trace.WithAttributes(append(base, attrs...)...)}
	if !start.IsZero() {
		opts = append(opts, trace.WithTimestamp(start))
	}
	return otel.Tracer(TracerName).Start(ctx, name, opts...)
}

// endSpan ends a span, an error recorded on it.
func endSpan(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// renewalOutcome names how a renewal ended, for its span.
func renewalOutcome(err error) string {
	switch {
	case err == nil:
		return "confirmed"
	case errors.Is(err, ErrLeaseLost):
		return "lost"
	default:
		return "unconfirmed"
	}
}

// injectTraceHeaders adds the span's context to a side effect's headers: traceparent always (when
// valid), and whatever the application's propagator adds (tracestate, baggage).
func injectTraceHeaders(ctx context.Context, h http.Header) {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return
	}
	h.Set("traceparent", FormatTraceparent(sc))
	otel.GetTextMapPropagator().Inject(ctx, propagation.HeaderCarrier(h))
}

// renewals says which renewals are worth a span. A heartbeat renews every few seconds for as long as
// the attempt runs (2,880 renewals a day at 30 s), all in the attempt's trace: a span each would bury
// it. So a renewal is a span only when something happened: it was not confirmed (no answer,
// refused, lost), its outcome differs from the previous renewal's (the first one; confirmed again
// after unconfirmed ones), it carried something new (checkpoint, usage or approval requests differ
// from what the previous renewal carried), or it brought new signals. Each span counts the quiet
// renewals before it (tether.renewals.unrecorded). The same rule in the Python and TypeScript SDKs.
type renewals struct {
	outcome, carried string
	quiet            int
}

func (n *renewals) news(outcome, carried string, signalsChanged bool) bool {
	worth := outcome != "confirmed" || outcome != n.outcome || carried != n.carried || signalsChanged
	n.outcome, n.carried = outcome, carried
	if !worth {
		n.quiet++
	}
	return worth
}

// skipped is the quiet renewals since the last span (an attribute of the next one), then none.
func (n *renewals) skipped() []attribute.KeyValue {
	quiet := n.quiet
	n.quiet = 0
	if quiet == 0 {
		return nil
	}
	return []attribute.KeyValue{attribute.Int("tether.renewals.unrecorded", quiet)}
}

// redactURL is a URL fit for url.full: credentials (user:password@) become REDACTED:REDACTED, every
// query value becomes REDACTED (the keys stay), the fragment goes. The same rule in the Python and
// TypeScript SDKs. (URL.Redacted keeps the query and the user name.)
func redactURL(u *url.URL) string {
	if u == nil {
		return "REDACTED"
	}
	c := *u
	if c.User != nil {
		c.User = url.UserPassword("REDACTED", "REDACTED")
	}
	var parts []string
	for _, p := range strings.Split(c.RawQuery, "&") {
		if key, _, found := strings.Cut(p, "="); found {
			parts = append(parts, key+"=REDACTED")
		} else if p != "" {
			parts = append(parts, p)
		}
	}
	c.RawQuery, c.ForceQuery, c.Fragment, c.RawFragment = strings.Join(parts, "&"), false, "", ""
	return c.String()
}
