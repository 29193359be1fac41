package tether

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeClock is a monotonic clock the test moves by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Duration
}

func (c *fakeClock) now() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t += d
	c.mu.Unlock()
}

type renewCall struct {
	checkpoint *string
	usage      *usage
	requests   []approvalRequest
}

// fakeTransport answers as the test scripts it; by default every renewal is confirmed.
type fakeTransport struct {
	mu         sync.Mutex
	renewFn    func(n int) (renewResult, error)
	publishFn  func(n int) (publishResult, error)
	recordedFn func() (bool, error)
	renews     []renewCall
	publishes  []string
	recordeds  int
	closed     bool
	children   *childClient // the runs a spawn makes (children_test.go)
}

func (f *fakeTransport) renew(_ context.Context, checkpoint *string, u *usage, requests []approvalRequest) (renewResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.renews = append(f.renews, renewCall{checkpoint, u, requests})
	if f.renewFn == nil {
		return renewResult{ok: true, signals: &signalState{}}, nil
	}
	return f.renewFn(len(f.renews))
}

func (f *fakeTransport) publish(_ context.Context, field string, value json.RawMessage) (publishResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.publishes = append(f.publishes, field+" "+string(value))
	return f.publishFn(len(f.publishes))
}

func (f *fakeTransport) recorded(context.Context, string, json.RawMessage) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.recordeds++
	return f.recordedFn()
}

func (f *fakeTransport) parent(context.Context) (parentRun, error) { return f.children.api.parent, nil }

func (f *fakeTransport) spawn(_ context.Context, req spawnRequest) (*childView, error) {
	return f.children.spawn(req)
}

func (f *fakeTransport) child(_ context.Context, name string) (*childView, error) {
	return f.children.api.read(name)
}

func (f *fakeTransport) close() {
	f.mu.Lock()
	f.closed = true
	f.mu.Unlock()
}

func (f *fakeTransport) renewCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.renews)
}

func (f *fakeTransport) lastRenew() renewCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.renews[len(f.renews)-1]
}

var discard = slog.New(slog.DiscardHandler)

// testRun is a started Run on a fake transport and clock: lease 10 s (margin 1 s), and a renew
// interval so long that the heartbeat goroutine never fires on its own.
func testRun(t *testing.T, tr *fakeTransport, clock *fakeClock, opts ...Option) (*Run, *[]time.Duration) {
	t.Helper()
	info := attemptInfo{name: "job", namespace: "ns", holder: "job-a1", fence: 1, attempt: 1,
		leaseDuration: 10 * time.Second, renewInterval: time.Hour}
	return testRunOf(t, info, tr, clock, opts...)
}

// testRunOf is testRun for the attempt `info` describes.
func testRunOf(t *testing.T, info attemptInfo, tr *fakeTransport, clock *fakeClock, opts ...Option) (*Run, *[]time.Duration) {
	t.Helper()
	r := newRun(context.Background(), info, tr, newSettings(append([]Option{WithClock(clock.now), WithLogger(discard)}, opts...)))
	var mu sync.Mutex
	waits := []time.Duration{}
	r.sleep = func(_ context.Context, d time.Duration) error {
		mu.Lock()
		waits = append(waits, d)
		mu.Unlock()
		clock.advance(d)
		return nil
	}
	r.start(context.Background())
	t.Cleanup(func() { _ = r.Close() })
	return r, &waits
}

func state(r *Run) string {
	switch {
	case r.Lost():
		return "lost"
	case r.OwnershipUnknown():
		return "unknown"
	case r.Owned():
		return "owned"
	}
	return "?"
}

func TestOwnershipOwnedUnknownLost(t *testing.T) {
	clock := &fakeClock{}
	tr := &fakeTransport{}
	r, _ := testRun(t, tr, clock)
	if tr.renewCount() != 1 || state(r) != "owned" || r.EnsureOwner() != nil {
		t.Fatalf("after start: %d renewals, %s", tr.renewCount(), state(r))
	}
	clock.advance(9 * time.Second) // confirmedAt + L - margin: still owned
	if state(r) != "owned" {
		t.Fatalf("at the edge: %s", state(r))
	}
	clock.advance(time.Nanosecond)
	if state(r) != "unknown" || !errors.Is(r.EnsureOwner(), ErrOwnershipUnknown) {
		t.Fatalf("past the edge: %s, %v", state(r), r.EnsureOwner())
	}
	tr.renewFn = func(int) (renewResult, error) { return renewResult{}, errors.New("connection refused") }
	if err := r.renewOnce(context.Background()); err == nil || state(r) != "unknown" {
		t.Fatalf("no answer: %v, %s", err, state(r))
	}
	tr.renewFn = nil
	_ = r.renewOnce(context.Background())
	if state(r) != "owned" {
		t.Fatalf("renewed again: %s", state(r))
	}
	tr.renewFn = func(int) (renewResult, error) { return renewResult{lost: true, why: "another holder"}, nil }
	if err := r.renewOnce(context.Background()); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("lost renewal: %v", err)
	}
	if state(r) != "lost" || !errors.Is(r.EnsureOwner(), ErrLeaseLost) || r.OwnershipUnknown() {
		t.Fatalf("after loss: %s, %v", state(r), r.EnsureOwner())
	}
	n := tr.renewCount()
	if err := r.renewOnce(context.Background()); !errors.Is(err, ErrLeaseLost) || tr.renewCount() != n {
		t.Fatal("a lost run renewed again")
	}
}

func TestUnknownBeforeTheFirstRenewal(t *testing.T) {
	tr := &fakeTransport{renewFn: func(int) (renewResult, error) { return renewResult{why: "429"}, nil }}
	r, _ := testRun(t, tr, &fakeClock{t: time.Hour})
	if state(r) != "unknown" || !errors.Is(r.EnsureOwner(), ErrOwnershipUnknown) {
		t.Fatalf("unconfirmed start: %s", state(r))
	}
}

func TestConfirmedAtIsWhenTheRenewalWasSent(t *testing.T) {
	clock := &fakeClock{}
	tr := &fakeTransport{}
	r, _ := testRun(t, tr, clock)
	tr.renewFn = func(int) (renewResult, error) {
		clock.advance(3 * time.Second) // a slow answer
		return renewResult{ok: true}, nil
	}
	clock.advance(5 * time.Second)
	_ = r.renewOnce(context.Background()) // sent at 5 s, answered at 8 s
	clock.advance(6 * time.Second)        // 14 s = 5 + 9: the edge
	if state(r) != "owned" {
		t.Fatalf("at sent + L - margin: %s", state(r))
	}
	clock.advance(time.Millisecond)
	if state(r) != "unknown" {
		t.Fatalf("past sent + L - margin: %s", state(r))
	}
}

func TestSignalsAndStop(t *testing.T) {
	tr := &fakeTransport{}
	r, _ := testRun(t, tr, &fakeClock{})
	ends := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	tr.renewFn = func(int) (renewResult, error) {
		return renewResult{ok: true, signals: &signalState{Paused: true, EndsAt: &ends, CapCents: ptr[int64](100),
			BaseCents: 30}}, nil
	}
	_ = r.ReportUsage(20, 5)
	_ = r.renewOnce(context.Background())
	s := r.Signals()
	if !s.Paused || s.Stop || !s.EndsAt.Equal(ends) || deref(s.CapRemainingCents) != int64(50) || s.CapRemainingTokens != nil {
		t.Fatalf("signals = %+v", s)
	}
	_ = r.ReportUsage(25, 5) // counted at once, before any renewal
	if got := deref(r.Signals().CapRemainingCents); got != int64(45) {
		t.Fatalf("remaining after a new report = %v", got)
	}
	// Malformed signals (nil) keep the previous ones.
	tr.renewFn = func(int) (renewResult, error) { return renewResult{ok: true}, nil }
	_ = r.renewOnce(context.Background())
	if !r.Signals().Paused {
		t.Fatal("malformed signals replaced the previous ones")
	}
	tr.renewFn = func(int) (renewResult, error) {
		return renewResult{ok: true, signals: &signalState{Stop: true, Reason: "budget exceeded"}}, nil
	}
	_ = r.renewOnce(context.Background())
	if err := r.EnsureOwner(); !errors.Is(err, ErrStopRequested) || r.Lost() || !r.Owned() {
		t.Fatalf("stop: %v, %s", err, state(r))
	}
}

func TestCheckpointAndUsageRideOnRenewals(t *testing.T) {
	tr := &fakeTransport{}
	r, _ := testRun(t, tr, &fakeClock{})
	if c := tr.lastRenew(); c.checkpoint != nil || c.usage != nil {
		t.Fatalf("first renewal carried reports: %+v", c)
	}
	if err := r.Checkpoint("4", false); err != nil || tr.renewCount() != 1 || r.CheckpointCursor() != "4" {
		t.Fatalf("checkpoint without flush: %v, %d renewals", err, tr.renewCount())
	}
	if err := r.ReportUsage(6, 10); err != nil {
		t.Fatal(err)
	}
	if err := r.Checkpoint("5", true); err != nil || tr.renewCount() != 2 {
		t.Fatalf("flush: %v, %d renewals", err, tr.renewCount())
	}
	if c := tr.lastRenew(); *c.checkpoint != "5" || *c.usage != (usage{Cents: 6, Tokens: 10}) {
		t.Fatalf("flushed renewal carried %+v", c)
	}
	// Attached while ownership is unknown too: a renewal only succeeds while the lease is ours.
	tr.renewFn = func(int) (renewResult, error) { return renewResult{lost: true, why: "gone"}, nil }
	if err := r.Checkpoint("6", true); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("flush on a lost lease: %v", err)
	}
	if err := r.Checkpoint(string(make([]byte, maxCursorChars+1)), false); err == nil || r.CheckpointCursor() != "6" {
		t.Fatalf("an oversized cursor was taken: %v", err)
	}
}

func TestReportUsageValidation(t *testing.T) {
	r, _ := testRun(t, &fakeTransport{}, &fakeClock{})
	if err := r.ReportUsage(10, 100); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name          string
		cents, tokens int64
	}{
		{"negative", -1, 100},
		{"decreasing cents", 9, 100},
		{"decreasing tokens", 10, 99},
		{"too many cents", maxCents + 1, 100},
		{"too many tokens", 10, maxTokens + 1},
	} {
		if err := r.ReportUsage(tc.cents, tc.tokens); !errors.Is(err, ErrUsageRefused) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
	if err := r.ReportUsage(10, 100); err != nil {
		t.Errorf("the same total again: %v", err)
	}
	if err := r.Checkpoint("x", true); err != nil {
		t.Fatal(err)
	}
}

func published200(int) (publishResult, error) { return publishResult{outcome: published}, nil }

func TestCompletePublishesAfterAFlushingRenewal(t *testing.T) {
	tr := &fakeTransport{publishFn: published200}
	r, _ := testRun(t, tr, &fakeClock{})
	_ = r.ReportUsage(3, 0)
	_ = r.Checkpoint("9", false)
	if err := r.Complete(context.Background(), map[string]int{"steps": 9}); err != nil {
		t.Fatal(err)
	}
	if tr.renewCount() != 2 || *tr.lastRenew().checkpoint != "9" || tr.lastRenew().usage.Cents != 3 {
		t.Fatalf("no flushing renewal before publishing: %d renewals", tr.renewCount())
	}
	if len(tr.publishes) != 1 || tr.publishes[0] != `result {"steps":9}` {
		t.Fatalf("published %v", tr.publishes)
	}
	select { // the heartbeat ends once published
	case <-r.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the heartbeat goes on after publishing")
	}
}

func TestPublishWhenLostPublishesNothing(t *testing.T) {
	tr := &fakeTransport{renewFn: func(int) (renewResult, error) { return renewResult{lost: true, why: "gone"}, nil }}
	r, _ := testRun(t, tr, &fakeClock{})
	if err := r.Fail(context.Background(), "X", "y"); !errors.Is(err, ErrLeaseLost) || len(tr.publishes) != 0 {
		t.Fatalf("%v, %d publishes", err, len(tr.publishes))
	}
}

func TestPublishRefused(t *testing.T) {
	tr := &fakeTransport{publishFn: func(int) (publishResult, error) { return publishResult{outcome: refused, why: "422"}, nil }}
	r, _ := testRun(t, tr, &fakeClock{})
	err := r.Complete(context.Background(), map[string]bool{"ok": true})
	if !errors.Is(err, ErrLeaseLost) || !r.Lost() || tr.recordeds != 0 {
		t.Fatalf("%v, lost %v, %d lookups", err, r.Lost(), tr.recordeds)
	}
}

func TestResultInvalidIsNotLost(t *testing.T) {
	tr := &fakeTransport{publishFn: func(n int) (publishResult, error) {
		if n == 1 {
			return publishResult{outcome: invalid, why: "status.result must be an object",
				causes: []InvalidCause{{Field: "status.result", Message: "must be of type object"}}}, nil
		}
		return publishResult{outcome: published}, nil
	}}
	r, _ := testRun(t, tr, &fakeClock{})
	err := r.Complete(context.Background(), []int{1})
	var bad *ResultInvalidError
	if !errors.Is(err, ErrResultInvalid) || errors.Is(err, ErrLeaseLost) || r.Lost() || !r.Owned() ||
		!errors.As(err, &bad) || bad.Causes[0].Field != "status.result" {
		t.Fatalf("invalid result: %v, %s", err, state(r))
	}
	if err := r.Complete(context.Background(), map[string]int{"steps": 1}); err != nil {
		t.Fatalf("the corrected result: %v", err)
	}
}

func TestPublishBacksOffAndHonoursRetryAfter(t *testing.T) {
	tr := &fakeTransport{publishFn: func(n int) (publishResult, error) {
		switch n {
		case 1:
			return publishResult{outcome: retry, why: "500"}, nil
		case 2:
			return publishResult{outcome: retry, why: "429", retryAfter: 3 * time.Second}, nil
		case 3:
			return publishResult{}, errors.New("timeout")
		case 4:
			return publishResult{outcome: retry, why: "503", retryAfter: time.Second}, nil
		}
		return publishResult{outcome: published}, nil
	}}
	r, waits := testRun(t, tr, &fakeClock{})
	if err := r.Complete(context.Background(), map[string]int{}); err != nil {
		t.Fatal(err)
	}
	want := []time.Duration{500 * time.Millisecond, 3 * time.Second, 2 * time.Second, 4 * time.Second}
	if len(*waits) != len(want) {
		t.Fatalf("waits %v, want %v", *waits, want)
	}
	for i := range want {
		if (*waits)[i] != want[i] {
			t.Fatalf("waits %v, want %v", *waits, want)
		}
	}
}

func TestPublishUnansweredUntilTheDeadlineIsUnknown(t *testing.T) {
	tr := &fakeTransport{publishFn: func(int) (publishResult, error) { return publishResult{}, errors.New("no route") }}
	clock := &fakeClock{}
	r, waits := testRun(t, tr, clock)
	err := r.Complete(context.Background(), map[string]int{})
	if !errors.Is(err, ErrOwnershipUnknown) || r.Lost() {
		t.Fatalf("%v, lost %v", err, r.Lost())
	}
	// 0.5 + 1 + 2 + 4 = 7.5 s; the next wait (5 s) would pass confirmedAt + L = 10 s.
	if len(*waits) != 4 || clock.now() != 7500*time.Millisecond {
		t.Fatalf("waits %v, clock %v", *waits, clock.now())
	}
}

func TestPublishDeadlineIsReadAfterATryThatWaitedLong(t *testing.T) {
	clock := &fakeClock{}
	var r *Run
	tr := &fakeTransport{publishFn: func(n int) (publishResult, error) {
		if n > 1 {
			return publishResult{outcome: published}, nil
		}
		// The publication timeout without an answer, while the heartbeat confirmed every second
		// (its confirmation recorded as the heartbeat records it; the transport's lock is held here).
		for range 30 {
			clock.advance(time.Second)
			r.mu.Lock()
			r.confirmed, r.confirmedAt = true, clock.now()
			r.mu.Unlock()
		}
		return publishResult{}, errors.New("no answer within the publication timeout")
	}}
	r, waits := testRun(t, tr, clock)
	if err := r.Complete(context.Background(), map[string]int{}); err != nil {
		t.Fatalf("gave up although the heartbeat confirmed ownership throughout: %v", err)
	}
	if len(tr.publishes) != 2 || len(*waits) != 1 {
		t.Fatalf("publishes %v, waits %v", tr.publishes, *waits)
	}
}

func TestPublishedAfterALostAnswer(t *testing.T) {
	for _, tc := range []struct {
		name     string
		recorded bool
		want     error
	}{
		{"the first try landed", true, nil},
		{"it did not", false, ErrLeaseLost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := &fakeTransport{
				publishFn: func(n int) (publishResult, error) {
					if n == 1 {
						return publishResult{}, errors.New("connection reset")
					}
					return publishResult{outcome: refused, why: "422"}, nil
				},
				recordedFn: func() (bool, error) { return tc.recorded, nil },
			}
			r, _ := testRun(t, tr, &fakeClock{})
			err := r.Complete(context.Background(), map[string]int{"steps": 3})
			if !errors.Is(err, tc.want) && !(tc.want == nil && err == nil) {
				t.Fatalf("%v, want %v", err, tc.want)
			}
			if tr.recordeds != 1 || r.Lost() != (tc.want != nil) {
				t.Fatalf("%d lookups, lost %v", tr.recordeds, r.Lost())
			}
		})
	}
}

func TestRecordedLookupUnansweredRetries(t *testing.T) {
	lookups := 0
	tr := &fakeTransport{
		publishFn: func(n int) (publishResult, error) {
			if n == 1 {
				return publishResult{}, errors.New("timeout")
			}
			return publishResult{outcome: refused}, nil
		},
		recordedFn: func() (bool, error) {
			lookups++
			if lookups == 1 {
				return false, errors.New("timeout")
			}
			return true, nil
		},
	}
	r, waits := testRun(t, tr, &fakeClock{})
	if err := r.Complete(context.Background(), map[string]int{}); err != nil || len(*waits) != 2 {
		t.Fatalf("%v, waits %v", err, *waits)
	}
}

func TestPublishStopsWithItsContext(t *testing.T) {
	tr := &fakeTransport{publishFn: func(int) (publishResult, error) { return publishResult{}, errors.New("timeout") }}
	r, _ := testRun(t, tr, &fakeClock{})
	ctx, cancel := context.WithCancel(context.Background())
	r.sleep = func(context.Context, time.Duration) error { cancel(); return context.Canceled }
	if err := r.Complete(ctx, map[string]int{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("%v", err)
	}
}

func TestHeartbeatGoroutine(t *testing.T) {
	tr := &fakeTransport{publishFn: published200}
	info := attemptInfo{name: "job", namespace: "ns", holder: "job-a1", fence: 1, attempt: 1,
		leaseDuration: 10 * time.Second, renewInterval: 5 * time.Millisecond}
	r := newRun(context.Background(), info, tr, newSettings([]Option{WithLogger(discard)}))
	r.start(context.Background())
	deadline := time.Now().Add(5 * time.Second)
	for tr.renewCount() < 5 && time.Now().Before(deadline) {
		_ = r.ReportUsage(int64(tr.renewCount()), 0) // the user's goroutine, racing the heartbeat
		_ = r.Signals()
		time.Sleep(time.Millisecond)
	}
	if tr.renewCount() < 5 || !r.Owned() {
		t.Fatalf("%d renewals, %s", tr.renewCount(), state(r))
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	n := tr.renewCount()
	time.Sleep(30 * time.Millisecond)
	if tr.renewCount() != n || !tr.closed {
		t.Fatal("the heartbeat goes on after Close")
	}
	_ = r.Close() // twice is fine
}

func TestHeartbeatSurvivesAPanic(t *testing.T) {
	tr := &fakeTransport{}
	tr.renewFn = func(n int) (renewResult, error) {
		if n == 2 {
			panic("a malformed answer")
		}
		return renewResult{ok: true}, nil
	}
	info := attemptInfo{name: "job", namespace: "ns", holder: "job-a1", fence: 1, attempt: 1,
		leaseDuration: 10 * time.Second, renewInterval: 5 * time.Millisecond}
	r := newRun(context.Background(), info, tr, newSettings([]Option{WithLogger(discard)}))
	r.start(context.Background())
	defer r.Close()
	deadline := time.Now().Add(5 * time.Second)
	for tr.renewCount() < 4 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if tr.renewCount() < 4 {
		t.Fatalf("the heartbeat died: %d renewals", tr.renewCount())
	}
}

func TestEffect(t *testing.T) {
	var mu sync.Mutex
	var got http.Header // the last headers received
	received := func() http.Header {
		mu.Lock()
		defer mu.Unlock()
		return got
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path == "/slow" {
			time.Sleep(300 * time.Millisecond)
			return
		}
		mu.Lock()
		got = req.Header.Clone()
		mu.Unlock()
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()
	clock := &fakeClock{}
	tr := &fakeTransport{}
	r, _ := testRun(t, tr, clock, WithEffectClient(&http.Client{Timeout: 100 * time.Millisecond}))
	r.info.idempotencyKey = "invoice:8f1b"

	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/capture", nil)
	req.Header.Set("Idempotency-Key", "mine")
	req.Header.Set("X-Trace", "t1")
	resp, err := r.Effect(context.Background(), req, "step-2")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if h := received(); resp.StatusCode != http.StatusCreated || h.Get("Idempotency-Key") != "invoice:8f1b:step-2" ||
		h.Get("X-Execution-Fence") != "1" || h.Get("X-Trace") != "t1" {
		t.Fatalf("headers sent: %v", h)
	}
	if h := r.EffectHeaders("capture"); h.Get("Idempotency-Key") != "invoice:8f1b:capture" {
		t.Fatalf("EffectHeaders = %v", h)
	}

	slow, _ := http.NewRequest(http.MethodPost, srv.URL+"/slow", nil)
	if _, err := r.Effect(context.Background(), slow, "s"); !errors.Is(err, ErrToolTimeout) || errors.Is(err, ErrOwnershipUnknown) {
		t.Fatalf("client timeout: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := r.Effect(ctx, slow, "s"); !errors.Is(err, ErrToolTimeout) {
		t.Fatalf("context deadline: %v", err)
	}

	clock.advance(9500 * time.Millisecond)
	mu.Lock()
	got = nil
	mu.Unlock()
	if _, err := r.Effect(context.Background(), req, "x"); !errors.Is(err, ErrOwnershipUnknown) || received() != nil {
		t.Fatalf("unknown ownership sent the effect: %v", err)
	}
	tr.renewFn = func(int) (renewResult, error) {
		return renewResult{ok: true, signals: &signalState{Stop: true}}, nil
	}
	_ = r.renewOnce(context.Background())
	if _, err := r.Effect(context.Background(), req, "x"); !errors.Is(err, ErrStopRequested) || received() != nil {
		t.Fatalf("a stopped worker sent the effect: %v", err)
	}
}

func TestCloseReportsWhatWasSpentWithOneLastRenewal(t *testing.T) {
	clock := &fakeClock{}
	tr := &fakeTransport{}
	r, _ := testRun(t, tr, clock)
	before := tr.renewCount()
	if err := r.ReportUsage(7, 3); err != nil {
		t.Fatal(err)
	}
	_ = r.Close()
	if got := tr.renewCount(); got != before+1 {
		t.Fatalf("renewals on Close: %d, want 1", got-before)
	}
	if u := tr.lastRenew().usage; u == nil || u.Cents != 7 || u.Tokens != 3 {
		t.Fatalf("last renewal carried usage %+v, want 7¢/3 tokens", u)
	}
	_ = r.Close()
	if tr.renewCount() != before+1 || !tr.closed {
		t.Fatalf("a second Close renewed again or the transport stayed open")
	}
}

func TestTheRenewalBeforePublishingMovesTheDeadline(t *testing.T) {
	tr := &fakeTransport{publishFn: func(int) (publishResult, error) { return publishResult{}, errors.New("no route") }}
	clock := &fakeClock{}
	r, waits := testRun(t, tr, clock)
	clock.advance(5 * time.Second)
	if err := r.Complete(context.Background(), map[string]int{}); !errors.Is(err, ErrOwnershipUnknown) {
		t.Fatalf("%v", err)
	}
	// Confirmed again at 5 s (the renewal before publishing): deadline 15 s, so 0.5 + 1 + 2 + 4 s
	// were waited; from the first confirmation (deadline 10 s) only 0.5 + 1 + 2.
	if len(*waits) != 4 || clock.now() != 12500*time.Millisecond {
		t.Fatalf("waits %v, clock %v", *waits, clock.now())
	}
}

func TestThePublicationDeadlineFollowsTheHeartbeat(t *testing.T) {
	tr := &fakeTransport{publishFn: func(n int) (publishResult, error) {
		if n <= 8 {
			return publishResult{}, errors.New("no route")
		}
		return publishResult{outcome: published}, nil
	}}
	clock := &fakeClock{}
	r, waits := testRun(t, tr, clock)
	r.sleep = func(ctx context.Context, d time.Duration) error { // the heartbeat confirms meanwhile
		*waits = append(*waits, d)
		clock.advance(d)
		return r.renewOnce(ctx)
	}
	if err := r.Complete(context.Background(), map[string]int{}); err != nil {
		t.Fatalf("%v after waits %v", err, *waits)
	}
	// 27.5 s of retries, far past the first deadline (10 s).
	if len(*waits) != 8 || clock.now() != 27500*time.Millisecond {
		t.Fatalf("waits %v, clock %v", *waits, clock.now())
	}
}

func TestPublishNothingWhenTheRenewalBeforeItHearsTheRunIsLost(t *testing.T) {
	tr := &fakeTransport{
		renewFn: func(n int) (renewResult, error) {
			if n == 1 {
				return renewResult{ok: true}, nil
			}
			return renewResult{lost: true, why: "another holder"}, nil
		},
		publishFn: published200,
	}
	r, _ := testRun(t, tr, &fakeClock{})
	if err := r.Complete(context.Background(), map[string]int{}); !errors.Is(err, ErrLeaseLost) || len(tr.publishes) != 0 {
		t.Fatalf("%v, %d publishes", err, len(tr.publishes))
	}
}

func TestPublishStopsOnceTheHeartbeatHearsTheRunIsLost(t *testing.T) {
	for _, tc := range []struct {
		name           string
		answer         publishResult
		err            error
		tries, lookUps int
		want           error
	}{
		{"after a 401", publishResult{outcome: retry, status: 401}, nil, 1, 0, ErrLeaseLost},
		{"after an RBAC 403", publishResult{outcome: retry, status: 403}, nil, 1, 0, ErrLeaseLost},
		{"after a 429", publishResult{outcome: retry, status: 429, retryAfter: time.Second}, nil, 1, 0, ErrLeaseLost},
		{"after a 400", publishResult{outcome: retry, status: 400}, nil, 1, 0, ErrLeaseLost},
		// The first try may have landed: one more try, refused, then the look-up finds it.
		{"after no answer", publishResult{}, errors.New("timeout"), 2, 1, nil},
		{"after a 503", publishResult{outcome: retry, status: 503}, nil, 2, 1, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := &fakeTransport{
				renewFn: func(n int) (renewResult, error) {
					if n <= 2 { // the start, the renewal before publishing
						return renewResult{ok: true}, nil
					}
					return renewResult{lost: true, why: "another holder"}, nil
				},
				publishFn: func(n int) (publishResult, error) {
					if n == 1 {
						return tc.answer, tc.err
					}
					return publishResult{outcome: refused, status: 422}, nil
				},
				recordedFn: func() (bool, error) { return true, nil },
			}
			clock := &fakeClock{}
			r, _ := testRun(t, tr, clock)
			r.sleep = func(ctx context.Context, d time.Duration) error { // the heartbeat renews meanwhile
				clock.advance(d)
				_ = r.renewOnce(ctx)
				return nil
			}
			err := r.Complete(context.Background(), map[string]int{})
			if !errors.Is(err, tc.want) && !(tc.want == nil && err == nil) {
				t.Fatalf("%v, want %v", err, tc.want)
			}
			if len(tr.publishes) != tc.tries || tr.recordeds != tc.lookUps {
				t.Fatalf("%d tries, %d look-ups", len(tr.publishes), tr.recordeds)
			}
		})
	}
}

func TestCloseSendsNoLastRenewalWhenLostOrPublished(t *testing.T) {
	lost := &fakeTransport{renewFn: func(int) (renewResult, error) { return renewResult{lost: true, why: "gone"}, nil }}
	r, _ := testRun(t, lost, &fakeClock{})
	_ = r.ReportUsage(7, 0)
	_ = r.Close()
	if n := lost.renewCount(); n != 1 {
		t.Fatalf("a lost run renewed on Close: %d renewals", n)
	}
	done := &fakeTransport{publishFn: published200}
	r, _ = testRun(t, done, &fakeClock{})
	if err := r.Complete(context.Background(), map[string]int{}); err != nil {
		t.Fatal(err)
	}
	before := done.renewCount()
	_ = r.Close()
	if n := done.renewCount(); n != before {
		t.Fatalf("a published run renewed on Close: %d renewals", n-before)
	}
}

// decidedAfter confirms every renewal, and from the n-th on carries these decisions.
func decidedAfter(n int, decisions map[string]ApprovalDecision) func(int) (renewResult, error) {
	return func(i int) (renewResult, error) {
		if i < n {
			return renewResult{ok: true, signals: &signalState{}}, nil
		}
		return renewResult{ok: true, signals: &signalState{Decisions: decisions}}, nil
	}
}

func TestRequestApprovalRefusesAMalformedRequestBeforeSending(t *testing.T) {
	tr := &fakeTransport{}
	r, _ := testRun(t, tr, &fakeClock{})
	for _, tc := range []struct {
		name, details string
		timeout       *int
	}{{"Refund", "", nil}, {"result", "", nil}, {"refund", strings.Repeat("x", 4097), nil}, {"refund", "", ptr(0)}} {
		if _, err := r.RequestApproval(context.Background(), tc.name, tc.details, tc.timeout); !errors.Is(err, ErrRequestRefused) {
			t.Errorf("%+v: %v", tc, err)
		}
	}
	if n := tr.renewCount(); n != 1 {
		t.Fatalf("%d renewals: a refused request sends nothing", n)
	}
	_ = r.renewOnce(context.Background())
	if got := tr.lastRenew().requests; len(got) != 0 {
		t.Fatalf("a refused request was kept: %+v", got)
	}
}

func TestRequestApprovalRidesOnRenewalsUntilDecided(t *testing.T) {
	tr := &fakeTransport{}
	r, _ := testRun(t, tr, &fakeClock{})
	r.poll = time.Millisecond
	tr.renewFn = decidedAfter(5, map[string]ApprovalDecision{"refund": {Decision: "Approve", Approver: "alice"}})
	d, err := r.RequestApproval(context.Background(), "refund", "42 EUR", ptr(600))
	if err != nil || !d.Approved() || d.Approver != "alice" {
		t.Fatalf("decision %+v, %v", d, err)
	}
	if n := tr.renewCount(); n != 5 {
		t.Fatalf("%d renewals, want 5 (the start's, the request's, then one per poll until decided)", n)
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for i, c := range tr.renews[1:] {
		if len(c.requests) != 1 || c.requests[0].Name != "refund" || c.requests[0].Details != "42 EUR" ||
			*c.requests[0].TimeoutSeconds != 600 {
			t.Fatalf("renewal %d carried %+v", i+2, c.requests)
		}
	}
}

func TestRequestApprovalAgainAndAtMostTwenty(t *testing.T) {
	tr := &fakeTransport{}
	r, _ := testRun(t, tr, &fakeClock{})
	decided := map[string]ApprovalDecision{}
	for i := range 20 {
		decided[fmt.Sprintf("step-%d", i)] = ApprovalDecision{Decision: "Deny", Reason: "no"}
	}
	tr.renewFn = decidedAfter(0, decided)
	for name := range decided {
		if d, err := r.RequestApproval(context.Background(), name, "", nil); err != nil || d.Approved() {
			t.Fatalf("%s: %+v, %v", name, d, err)
		}
	}
	if _, err := r.RequestApproval(context.Background(), "step-20", "", nil); !errors.Is(err, ErrRequestRefused) {
		t.Fatalf("a 21st request: %v", err)
	}
	if d, err := r.RequestApproval(context.Background(), "step-3", "other details", ptr(5)); err != nil || d.Reason != "no" {
		t.Fatalf("asking again: %+v, %v", d, err)
	}
	if got := tr.lastRenew().requests; len(got) != 20 {
		t.Fatalf("%d requests on the last renewal, want 20", len(got))
	}
}

func TestRequestApprovalStaysWithin64KiB(t *testing.T) {
	tr := &fakeTransport{}
	r, _ := testRun(t, tr, &fakeClock{})
	tr.renewFn = decidedAfter(0, map[string]ApprovalDecision{"a": {Decision: "Approve"}, "b": {Decision: "Approve"},
		"c": {Decision: "Approve"}, "d": {Decision: "Approve"}, "e": {Decision: "Approve"}})
	details := strings.Repeat("€", 4096) // 12 KiB in UTF-8: the sixth would pass 64 KiB
	for _, name := range []string{"a", "b", "c", "d", "e"} {
		if _, err := r.RequestApproval(context.Background(), name, details, nil); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	if _, err := r.RequestApproval(context.Background(), "f", details, nil); !errors.Is(err, ErrRequestRefused) ||
		!strings.Contains(err.Error(), "65536 bytes") {
		t.Fatalf("a request past 64 KiB: %v", err)
	}
	if n := len(tr.lastRenew().requests); n != 5 {
		t.Fatalf("%d requests on the last renewal, want 5", n)
	}
}

func TestRequestApprovalEndsWithoutADecision(t *testing.T) {
	for _, tc := range []struct {
		name  string
		renew func(clock *fakeClock) func(int) (renewResult, error)
		want  error
	}{
		{"lost", func(*fakeClock) func(int) (renewResult, error) {
			return func(int) (renewResult, error) { return renewResult{lost: true, why: "another holder"}, nil }
		}, ErrLeaseLost},
		{"told to stop", func(*fakeClock) func(int) (renewResult, error) {
			return func(int) (renewResult, error) {
				return renewResult{ok: true, signals: &signalState{Stop: true, Reason: "budget"}}, nil
			}
		}, ErrStopRequested},
		{"no answer until the lease deadline", func(clock *fakeClock) func(int) (renewResult, error) {
			return func(int) (renewResult, error) {
				clock.advance(3 * time.Second)
				return renewResult{}, errors.New("no answer")
			}
		}, ErrOwnershipUnknown},
	} {
		tr, clock := &fakeTransport{}, &fakeClock{}
		r, _ := testRun(t, tr, clock)
		r.poll = time.Millisecond
		tr.mu.Lock()
		tr.renewFn = tc.renew(clock)
		tr.mu.Unlock()
		if _, err := r.RequestApproval(context.Background(), "refund", "", nil); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
}

func TestRequestApprovalEndsWithItsContextOrTheRun(t *testing.T) {
	tr := &fakeTransport{}
	r, _ := testRun(t, tr, &fakeClock{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := r.RequestApproval(ctx, "refund", "", nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("cancelled: %v", err)
	}
	go func() {
		time.Sleep(20 * time.Millisecond)
		_ = r.Close()
	}()
	if _, err := r.RequestApproval(context.Background(), "refund", "", nil); !errors.Is(err, ErrStopRequested) {
		t.Fatalf("closed: %v", err)
	}
}

func TestRequestApprovalWakesOnTheHeartbeatsDecision(t *testing.T) {
	tr := &fakeTransport{}
	r, _ := testRun(t, tr, &fakeClock{})
	r.poll = time.Hour // only the heartbeat's renewal can bring the decision in time
	tr.mu.Lock()
	tr.renewFn = decidedAfter(3, map[string]ApprovalDecision{"refund": {Decision: "Approve"}})
	tr.mu.Unlock()
	go func() {
		time.Sleep(20 * time.Millisecond)
		r.heartbeatOnce()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if d, err := r.RequestApproval(ctx, "refund", "", nil); err != nil || !d.Approved() {
		t.Fatalf("decision %+v, %v", d, err)
	}
}
