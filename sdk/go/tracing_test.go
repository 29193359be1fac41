package tether

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

const (
	testTrace       = "4bf92f3577b34da6a3ce929d0e0e4736"
	testAttemptSpan = "00f067aa0ba902b7"
	testTraceparent = "00-" + testTrace + "-" + testAttemptSpan + "-01"
)

func TestParseTraceparentFollowsW3C(t *testing.T) {
	vectors := map[string]string{
		testTraceparent: testTraceparent,
		"00-" + testTrace + "-" + testAttemptSpan + "-00":       "00-" + testTrace + "-" + testAttemptSpan + "-00",
		" " + testTraceparent + " ":                             testTraceparent,
		"01-" + testTrace + "-" + testAttemptSpan + "-03-extra": testTraceparent, // a later version's first four fields
		"":        "",
		"garbage": "",
		"00-" + strings.Repeat("0", 32) + "-" + testAttemptSpan + "-01": "",
		"00-" + testTrace + "-" + strings.Repeat("0", 16) + "-01":       "",
		"ff-" + testTrace + "-" + testAttemptSpan + "-01":               "",
		testTraceparent + "-x":           "",
		strings.ToUpper(testTraceparent): "",
	}
	for in, want := range vectors {
		got := ""
		if sc, ok := ParseTraceparent(in); ok {
			got = FormatTraceparent(sc)
		}
		if got != want {
			t.Errorf("ParseTraceparent(%q) = %q, want %q", in, got, want)
		}
	}
}

// tracedRun is testRun's run with the attempt's trace context, publications landing.
func tracedRun(t *testing.T, tr *fakeTransport) *Run {
	t.Helper()
	if tr.publishFn == nil {
		tr.publishFn = published200
	}
	clock := &fakeClock{}
	info := attemptInfo{name: "job", namespace: "ns", holder: "job-a1", fence: 1, attempt: 1, runUID: "uid-9",
		leaseDuration: 10 * time.Second, renewInterval: time.Hour, traceparent: testTraceparent}
	r := newRun(context.Background(), info, tr, newSettings([]Option{WithClock(clock.now), WithLogger(discard)}))
	r.start(context.Background())
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// One test sets the global provider (it is process-wide): spans before and after are compared.
func TestSpansJoinTheAttemptsTraceAndTheReceiverGetsTraceparent(t *testing.T) {
	var mu sync.Mutex
	var headers []http.Header
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		mu.Lock()
		headers = append(headers, req.Header.Clone())
		mu.Unlock()
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	effect := func(r *Run, ctx context.Context) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/effects", strings.NewReader("{}"))
		resp, err := r.Effect(ctx, req, "charge")
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
	}

	// No SDK: nothing records, and the receiver still gets the attempt's own context.
	r := tracedRun(t, &fakeTransport{})
	effect(r, context.Background())
	if got := headers[0].Get("traceparent"); got != testTraceparent {
		t.Fatalf("traceparent without an SDK = %q, want %q", got, testTraceparent)
	}
	_ = r.Close()

	exporter := tracetest.NewInMemoryExporter()
	provider := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	otel.SetTracerProvider(provider)
	r = tracedRun(t, &fakeTransport{})
	if err := r.Checkpoint("row-1", true); err != nil {
		t.Fatal(err)
	}
	ctx, mine := otel.Tracer("app").Start(r.TraceContext(context.Background()), "app work")
	effect(r, ctx)
	mine.End()
	if err := r.Complete(context.Background(), map[string]any{"ok": true}); err != nil {
		t.Fatal(err)
	}
	_ = r.Close()
	spans := exporter.GetSpans()
	byName := map[string][]tracetest.SpanStub{}
	for _, s := range spans {
		if s.SpanContext.TraceID().String() != testTrace {
			t.Errorf("%s is in trace %s", s.Name, s.SpanContext.TraceID())
		}
		byName[s.Name] = append(byName[s.Name], s)
	}
	attrs := func(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
		m := map[attribute.Key]attribute.Value{}
		for _, kv := range s.Attributes {
			m[kv.Key] = kv.Value
		}
		return m
	}
	renew := byName["tether.renew"]
	if len(renew) < 2 || renew[0].Parent.SpanID().String() != testAttemptSpan { // the first, the flush: quiet ones are no spans
		t.Fatalf("renewals %v", renew)
	}
	if a := attrs(renew[0]); a["tether.fence"].AsInt64() != 1 || a["tether.attempt"].AsInt64() != 1 ||
		a["tether.run.uid"].AsString() != "uid-9" ||
		a["tether.renewal"].AsString() != "confirmed" || a["tether.run.name"].AsString() != "job" {
		t.Errorf("renewal attributes %v", a)
	}
	checkpoint := byName["tether.checkpoint"][0]
	if renew[1].Parent.SpanID() != checkpoint.SpanContext.SpanID() {
		t.Errorf("the flush's renewal is not the checkpoint span's child")
	}
	eff := byName["tether.effect"][0]
	if eff.Parent.SpanID() != byName["app work"][0].SpanContext.SpanID() {
		t.Errorf("the effect is not under the application's span")
	}
	if got, want := headers[1].Get("traceparent"), FormatTraceparent(eff.SpanContext); got != want {
		t.Errorf("receiver got traceparent %q, want the effect span's %q", got, want)
	}
	if headers[1].Get("X-Execution-Fence") != "1" || attrs(eff)["http.response.status_code"].AsInt64() != 200 {
		t.Errorf("effect headers %v attributes %v", headers[1], attrs(eff))
	}
	publish := byName["tether.publish"][0]
	if publish.Parent.SpanID().String() != testAttemptSpan || attrs(publish)["tether.publication"].AsString() != "result" {
		t.Errorf("publication span %v", publish)
	}

	// An attempt lost: its renewal span says so, as an error.
	exporter.Reset()
	r = tracedRun(t, &fakeTransport{renewFn: func(n int) (renewResult, error) {
		if n == 1 {
			return renewResult{ok: true, signals: &signalState{}}, nil
		}
		return renewResult{lost: true, why: "another holder"}, nil
	}})
	_ = r.Checkpoint("row-2", true)
	_ = r.Close()
	var sawLost bool
	for _, s := range exporter.GetSpans() {
		if s.Name == "tether.renew" && attrs(s)["tether.renewal"].AsString() == "lost" {
			sawLost = s.Status.Code == codes.Error
		}
	}
	if !sawLost {
		t.Errorf("no lost renewal span with an error status: %v", exporter.GetSpans())
	}
}

func TestRedactURLDropsCredentialsAndQueryValues(t *testing.T) {
	for in, want := range map[string]string{
		// the same vector as the Python and TypeScript SDKs' tests
		"http://user:password@receiver:8443/effects?api_key=s3cr3t&mode=live&flag#token=t0k": "http://REDACTED:REDACTED@receiver:8443/effects?api_key=REDACTED&mode=REDACTED&flag",
		"https://api.example.com/v1/charge":                                                  "https://api.example.com/v1/charge",
		"https://api.example.com/v1?a=1&a=2&=x":                                              "https://api.example.com/v1?a=REDACTED&a=REDACTED&=REDACTED",
		"https://token@api.example.com/":                                                     "https://REDACTED:REDACTED@api.example.com/",
	} {
		u, err := url.Parse(in)
		if err != nil {
			t.Fatal(err)
		}
		if got := redactURL(u); got != want {
			t.Errorf("redactURL(%q) = %q, want %q", in, got, want)
		}
	}
}

// Sets the global provider, as TestSpansJoinTheAttemptsTraceAndTheReceiverGetsTraceparent does.
func TestOnlyRenewalsThatAreNewsAreSpansAndEffectURLsAreRedacted(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }))
	defer srv.Close()
	exporter := tracetest.NewInMemoryExporter()
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter)))
	r := tracedRun(t, &fakeTransport{renewFn: func(n int) (renewResult, error) {
		if n > 6 {
			return renewResult{lost: true, why: "another holder"}, nil
		}
		return renewResult{ok: true, signals: &signalState{}}, nil
	}}) // renewal 1: the first (news)
	host := strings.TrimPrefix(srv.URL, "http://")
	req, _ := http.NewRequest(http.MethodPost, "http://user:password@"+host+"/effects?api_key=s3cr3t#frag", nil)
	resp, err := r.Effect(context.Background(), req, "charge")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	for range 5 { // renewal 2 carries the checkpoint (news), 3-6 carry the same (quiet)
		if err := r.Checkpoint("row-1", true); err != nil {
			t.Fatal(err)
		}
	}
	_ = r.Checkpoint("row-1", true) // renewal 7: lost
	_ = r.Close()
	var outcomes []string
	var unrecorded int64
	for _, s := range exporter.GetSpans() {
		for _, kv := range s.Attributes {
			if s.Name == "tether.renew" && kv.Key == "tether.renewal" {
				outcomes = append(outcomes, kv.Value.AsString())
			}
			if s.Name == "tether.renew" && kv.Key == "tether.renewals.unrecorded" {
				unrecorded = kv.Value.AsInt64()
			}
			if s.Name == "tether.effect" && kv.Key == "url.full" {
				if want := "http://REDACTED:REDACTED@" + host + "/effects?api_key=REDACTED"; kv.Value.AsString() != want {
					t.Errorf("url.full = %q, want %q", kv.Value.AsString(), want)
				}
			}
		}
	}
	if strings.Join(outcomes[:3], ",") != "confirmed,confirmed,lost" || unrecorded != 4 {
		t.Errorf("renewal spans %v (unrecorded before the lost one: %d), want confirmed,confirmed,lost and 4", outcomes, unrecorded)
	}
}
