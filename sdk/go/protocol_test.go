package tether

import (
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

func ptr[T any](v T) *T { return &v }

func TestTiming(t *testing.T) {
	for _, tc := range []struct {
		lease, renew, margin, timeout time.Duration
	}{
		{lease: 10 * time.Second, renew: 2 * time.Second, margin: time.Second, timeout: 2 * time.Second},
		{lease: 90 * time.Second, renew: 30 * time.Second, margin: 9 * time.Second, timeout: 10 * time.Second},
		{lease: 5 * time.Second, renew: 500 * time.Millisecond, margin: time.Second, timeout: time.Second},
		{lease: 20 * time.Second, renew: 3 * time.Second, margin: 2 * time.Second, timeout: 3 * time.Second},
	} {
		if got := margin(tc.lease); got != tc.margin {
			t.Errorf("margin(%v) = %v, want %v", tc.lease, got, tc.margin)
		}
		if got := requestTimeout(tc.renew); got != tc.timeout {
			t.Errorf("requestTimeout(%v) = %v, want %v", tc.renew, got, tc.timeout)
		}
	}
}

func TestValidReport(t *testing.T) {
	for _, tc := range []struct {
		name     string
		report   usage
		previous *usage
		refused  string
	}{
		{"first report", usage{Cents: 3, Tokens: 900}, nil, ""},
		{"zero", usage{}, nil, ""},
		{"same again", usage{Cents: 3, Tokens: 900}, &usage{Cents: 3, Tokens: 900}, ""},
		{"growing", usage{Cents: 4, Tokens: 900}, &usage{Cents: 3, Tokens: 900}, ""},
		{"negative cents", usage{Cents: -1}, nil, "negative"},
		{"negative tokens", usage{Tokens: -1}, nil, "negative"},
		{"at the bounds", usage{Cents: maxCents, Tokens: maxTokens}, nil, ""},
		{"too many cents", usage{Cents: maxCents + 1}, nil, "implausibly large"},
		{"too many tokens", usage{Tokens: maxTokens + 1}, nil, "implausibly large"},
		{"cents decreased", usage{Cents: 2, Tokens: 900}, &usage{Cents: 3, Tokens: 900}, "decreased"},
		{"tokens decreased", usage{Cents: 3, Tokens: 899}, &usage{Cents: 3, Tokens: 900}, "decreased"},
	} {
		got := validReport(tc.report, tc.previous)
		if (tc.refused == "") != (got == "") || !strings.Contains(got, tc.refused) {
			t.Errorf("%s: validReport = %q, want %q", tc.name, got, tc.refused)
		}
	}
}

func TestValidCursor(t *testing.T) {
	if why := validCursor(strings.Repeat("é", maxCursorChars)); why != "" {
		t.Errorf("1024 characters refused: %s", why)
	}
	if why := validCursor(strings.Repeat("x", maxCursorChars+1)); why == "" {
		t.Error("1025 characters accepted")
	}
}

func TestUsageAnnotation(t *testing.T) {
	if got := usageAnnotation(usage{Cents: 12, Tokens: 900}); got != `{"cents":12,"tokens":900}` {
		t.Errorf("usageAnnotation = %s", got)
	}
}

func lease(holder string, fence int32, runUID string) *coordinationv1.Lease {
	l := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: "job", Namespace: "ns", ResourceVersion: "7"}}
	if holder != "" {
		l.Spec.HolderIdentity = ptr(holder)
	}
	l.Spec.LeaseTransitions = ptr(fence)
	if runUID != "" {
		l.OwnerReferences = []metav1.OwnerReference{
			{Kind: "Pod", Name: "x", UID: "pod-uid", Controller: ptr(false)},
			{Kind: "WorkerRun", Name: "job", UID: types.UID(runUID), Controller: ptr(true)},
		}
	}
	return l
}

func TestHolds(t *testing.T) {
	notController := lease("job-a1", 1, "")
	notController.OwnerReferences = []metav1.OwnerReference{{Kind: "WorkerRun", UID: "uid-1"}}
	for _, tc := range []struct {
		name   string
		lease  *coordinationv1.Lease
		runUID string
		want   bool
	}{
		{"ours", lease("job-a1", 1, "uid-1"), "uid-1", true},
		{"ours, uid not checked", lease("job-a1", 1, "uid-1"), "", true},
		{"no lease", nil, "", false},
		{"cleared", lease("", 1, "uid-1"), "uid-1", false},
		{"another holder", lease("job-a2", 1, "uid-1"), "uid-1", false},
		{"another fence", lease("job-a1", 2, "uid-1"), "uid-1", false},
		{"a namesake's", lease("job-a1", 1, "uid-2"), "uid-1", false},
		{"no owner", lease("job-a1", 1, ""), "uid-1", false},
		{"owner not controller", notController, "uid-1", false},
	} {
		var view *leaseView
		if tc.lease != nil {
			doc, err := parseLease(mustJSON(t, tc.lease))
			if err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
			view = &doc.view
		}
		if got := holds(view, "job-a1", 1, tc.runUID); got != tc.want {
			t.Errorf("%s: holds = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestRenewal(t *testing.T) {
	// A newer API server's Lease: fields this SDK's Lease type does not know must go back unchanged.
	l := json.RawMessage(`{"apiVersion":"coordination.k8s.io/v1","kind":"Lease","metadata":{"name":"job",` +
		`"resourceVersion":"7","annotations":{"tether.dev/signals":"{\"stop\":false}","tether.dev/checkpoint":"1"},` +
		`"futureMeta":{"big":12345678901234567890}},"spec":{"holderIdentity":"job-a1","leaseTransitions":1,` +
		`"futureField":[1.50,"x"]},"futureTop":true}`)
	original := string(l)
	now := time.Date(2026, 11, 30, 16, 0, 0, 123456789, time.FixedZone("x", 3600))
	body, err := renewal(l, now, ptr("4"), &usage{Cents: 8, Tokens: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Metadata struct {
			ResourceVersion string            `json:"resourceVersion"`
			Annotations     map[string]string `json:"annotations"`
			FutureMeta      json.RawMessage   `json:"futureMeta"`
		} `json:"metadata"`
		Spec struct {
			HolderIdentity   string          `json:"holderIdentity"`
			LeaseTransitions int             `json:"leaseTransitions"`
			RenewTime        string          `json:"renewTime"`
			FutureField      json.RawMessage `json:"futureField"`
		} `json:"spec"`
		FutureTop bool `json:"futureTop"`
	}
	if err := json.Unmarshal(body, &got); err != nil {
		t.Fatal(err)
	}
	if got.Metadata.ResourceVersion != "7" || got.Spec.HolderIdentity != "job-a1" || got.Spec.LeaseTransitions != 1 {
		t.Errorf("renewal lost the Lease's identity: %s", body)
	}
	if string(got.Metadata.FutureMeta) != `{"big":12345678901234567890}` || string(got.Spec.FutureField) != `[1.50,"x"]` ||
		!got.FutureTop {
		t.Errorf("renewal changed fields it does not know: %s", body)
	}
	want := map[string]string{annSignals: `{"stop":false}`, annCheckpoint: "4", annUsage: `{"cents":8,"tokens":2}`}
	if len(got.Metadata.Annotations) != len(want) {
		t.Errorf("annotations %v, want %v", got.Metadata.Annotations, want)
	}
	for k, v := range want {
		if got.Metadata.Annotations[k] != v {
			t.Errorf("annotation %s = %q, want %q", k, got.Metadata.Annotations[k], v)
		}
	}
	if got.Spec.RenewTime != "2026-11-30T15:00:00.123456Z" {
		t.Errorf("renewTime = %s, want RFC 3339 UTC microseconds", got.Spec.RenewTime)
	}
	if string(l) != original {
		t.Error("renewal changed the Lease it was given")
	}
	plain, err := renewal(l, now, nil, nil, nil)
	if err != nil || !strings.Contains(string(plain), `"tether.dev/checkpoint":"1"`) || strings.Contains(string(plain), annUsage) {
		t.Errorf("a renewal without reports changed them: %s, %v", plain, err)
	}
	bare, err := renewal(json.RawMessage(`{"metadata":{"annotations":null},"spec":null}`), now, ptr("2"), nil, nil)
	if err != nil || string(bare) != `{"metadata":{"annotations":{"tether.dev/checkpoint":"2"}},"spec":{"renewTime":"2026-11-30T15:00:00.123456Z"}}` {
		t.Errorf("a Lease without annotations or spec: %s, %v", bare, err)
	}
	if _, err := renewal(json.RawMessage(`{"spec":"x"}`), now, nil, nil, nil); err == nil {
		t.Error("a malformed Lease was renewed")
	}
}

func TestRefusesValue(t *testing.T) {
	for _, tc := range []struct {
		field  string
		causes []string
		want   bool
	}{
		{"result", []string{"status.result"}, true},
		{"result", []string{"status.result.steps"}, true},
		{"result", []string{"status.result[0]"}, true},
		{"error", []string{"status.error.code"}, true},
		{"result", []string{"metadata.annotations", "status.result"}, true},
		{"result", []string{"status.error"}, false},
		{"result", []string{"status.resultx"}, false},
		{"result", []string{"metadata.annotations"}, false},
		{"result", []string{"status"}, false},
		{"result", []string{""}, false},
		{"result", nil, false},
	} {
		var causes []InvalidCause
		for _, f := range tc.causes {
			causes = append(causes, InvalidCause{Field: f})
		}
		if got := refusesValue(causes, tc.field); got != tc.want {
			t.Errorf("refusesValue(%v, %s) = %v, want %v", tc.causes, tc.field, got, tc.want)
		}
	}
}

func TestParseSignals(t *testing.T) {
	ends := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name string
		raw  string
		ok   bool
		want signalState
	}{
		{"absent", "", true, signalState{}},
		{"empty object", "{}", true, signalState{}},
		{"full", `{"stop":true,"paused":true,"reason":"cap","endsAt":"2026-12-01T00:00:00Z","capCents":500,` +
			`"capTokens":9000,"baseCents":120,"baseTokens":10}`, true,
			signalState{Stop: true, Paused: true, Reason: "cap", EndsAt: &ends, CapCents: ptr[int64](500),
				CapTokens: ptr[int64](9000), BaseCents: 120, BaseTokens: 10}},
		{"nullable nulls", `{"reason":null,"endsAt":null,"capCents":null,"capTokens":null}`, true, signalState{}},
		{"unknown keys ignored", `{"later":1,"stop":true}`, true, signalState{Stop: true}},
		{"integral float", `{"capCents":5.0}`, true, signalState{CapCents: ptr[int64](5)}},
		{"offset time", `{"endsAt":"2026-12-01T01:00:00+01:00"}`, true, signalState{EndsAt: &ends}},
		{"not JSON", `{"stop":`, false, signalState{}},
		{"not an object", `[1]`, false, signalState{}},
		{"null document", `null`, false, signalState{}},
		{"stop not a bool", `{"stop":"yes"}`, false, signalState{}},
		{"stop null", `{"stop":null}`, false, signalState{}},
		{"fractional cap", `{"capCents":1.5}`, false, signalState{}},
		{"bad time", `{"endsAt":"tomorrow"}`, false, signalState{}},
		{"a Kueue eviction", `{"stop":true,"yield":true,"stopBy":"2026-12-01T00:00:00Z"}`, true,
			signalState{Stop: true, Yield: true, StopBy: &ends}},
		{"yield not a bool", `{"stop":true,"yield":"yes"}`, false, signalState{}},
		{"stopBy not a time", `{"stop":true,"yield":true,"stopBy":"soon"}`, false, signalState{}},
		{"base null", `{"baseCents":null}`, false, signalState{}},
		{"decisions", `{"decisions":{"refund":{"decision":"Approve","approver":"alice"},"ship":{"decision":"TimedOut","reason":null}}}`,
			true, signalState{Decisions: map[string]ApprovalDecision{"refund": {Decision: "Approve", Approver: "alice"},
				"ship": {Decision: "TimedOut"}}}},
		{"a decision's unknown keys ignored", `{"decisions":{"a":{"decision":"Deny","reason":"no","at":1}}}`, true,
			signalState{Decisions: map[string]ApprovalDecision{"a": {Decision: "Deny", Reason: "no"}}}},
		{"decisions null", `{"stop":true,"decisions":null}`, false, signalState{}},
		{"decisions not an object", `{"decisions":[]}`, false, signalState{}},
		{"a decision not an object", `{"decisions":{"a":"Approve"}}`, false, signalState{}},
		{"a decision missing", `{"decisions":{"a":{"reason":"x"}}}`, false, signalState{}},
		{"an unknown decision", `{"decisions":{"a":{"decision":"Maybe"}},"stop":true}`, false, signalState{}},
		{"a decision's reason not a string", `{"decisions":{"a":{"decision":"Deny","reason":3}}}`, false, signalState{}},
		{"a decision's approver not a string", `{"decisions":{"a":{"decision":"Deny","approver":true}}}`, false, signalState{}},
	} {
		got, ok := parseSignals(tc.raw)
		if ok != tc.ok || (ok && !sameSignals(got, tc.want)) {
			t.Errorf("%s: parseSignals = %+v, %v; want %+v, %v", tc.name, got, ok, tc.want, tc.ok)
		}
	}
}

func deref(p *int64) any {
	if p == nil {
		return nil
	}
	return *p
}

func TestRemaining(t *testing.T) {
	for _, tc := range []struct {
		name          string
		signals       signalState
		own           *usage
		cents, tokens any
	}{
		{"no caps", signalState{}, &usage{Cents: 5}, nil, nil},
		{"cap, nothing spent", signalState{CapCents: ptr[int64](500)}, nil, int64(500), nil},
		{"cap minus base minus own", signalState{CapCents: ptr[int64](500), BaseCents: 120, CapTokens: ptr[int64](10),
			BaseTokens: 4}, &usage{Cents: 80, Tokens: 7}, int64(300), int64(-1)},
	} {
		c, k := tc.signals.remaining(tc.own)
		if deref(c) != tc.cents || deref(k) != tc.tokens {
			t.Errorf("%s: remaining = %v, %v; want %v, %v", tc.name, deref(c), deref(k), tc.cents, tc.tokens)
		}
	}
}

func TestSignalsFromRemainingInvertsRemaining(t *testing.T) {
	sent := &usage{Cents: 120, Tokens: 9}
	s := signalsFromRemaining(true, false, nil, ptr[int64](380), nil, sent)
	if c, k := s.remaining(sent); deref(c) != int64(380) || k != nil {
		t.Errorf("remaining at the reported usage = %v, %v; want 380, nil", deref(c), deref(k))
	}
	if c, _ := s.remaining(&usage{Cents: 150, Tokens: 9}); deref(c) != int64(350) {
		t.Errorf("usage reported after the reply counts: %v, want 350", deref(c))
	}
	if !s.Stop || s.Paused {
		t.Errorf("flags lost: %+v", s)
	}
}

func TestFencedPatch(t *testing.T) {
	for _, tc := range []struct {
		name   string
		field  string
		runUID string
		want   string
	}{
		{"result with uid", "result", "uid-1", `[{"op":"test","path":"/metadata/uid","value":"uid-1"},` +
			`{"op":"test","path":"/status/fence","value":3},{"op":"test","path":"/status/holder","value":"job-a2"},` +
			`{"op":"add","path":"/status/result","value":{"ok":true}}]`},
		{"error without uid", "error", "", `[{"op":"test","path":"/status/fence","value":3},` +
			`{"op":"test","path":"/status/holder","value":"job-a2"},{"op":"add","path":"/status/error","value":{"ok":true}}]`},
	} {
		raw, err := json.Marshal(fencedPatch("job-a2", 3, tc.field, json.RawMessage(`{"ok":true}`), tc.runUID))
		if err != nil || string(raw) != tc.want {
			t.Errorf("%s: fencedPatch = %s (%v)\nwant %s", tc.name, raw, err, tc.want)
		}
	}
}

func TestPublicationRecorded(t *testing.T) {
	view := func(doc string) runView {
		var v runView
		if err := json.Unmarshal([]byte(doc), &v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	value := json.RawMessage(`{"steps": 3, "sdk": "go"}`)
	for _, tc := range []struct {
		name  string
		run   string
		field string
		want  bool
	}{
		{"still ours, our value", `{"status":{"holder":"job-a1","fence":1,"result":{"sdk":"go","steps":3.0}}}`, "result", true},
		{"still ours, another value", `{"status":{"holder":"job-a1","fence":1,"result":{"sdk":"py","steps":3}}}`, "result", false},
		{"still ours, nothing yet", `{"status":{"holder":"job-a1","fence":1}}`, "result", false},
		{"moved on, our attempt succeeded", `{"status":{"holder":null,"fence":2,"result":{"steps":3,"sdk":"go"},` +
			`"attempts":[{"holder":"job-a1","fence":1,"outcome":"Succeeded"}]}}`, "result", true},
		{"moved on, succeeded with another result", `{"status":{"fence":2,"result":{"steps":4},` +
			`"attempts":[{"holder":"job-a1","fence":1,"outcome":"Succeeded"}]}}`, "result", false},
		{"moved on, our attempt lost", `{"status":{"fence":2,"attempts":[{"holder":"job-a1","fence":1,"outcome":"LeaseLost"}]}}`, "result", false},
		{"moved on, our error recorded", `{"status":{"fence":2,"error":{"code":"other"},` +
			`"attempts":[{"holder":"job-a1","fence":1,"outcome":"WorkerFailed"}]}}`, "error", true},
		{"the last record of ours counts", `{"status":{"fence":2,"attempts":[{"holder":"job-a1","fence":1,"outcome":"WorkerFailed"},` +
			`{"holder":"job-a1","fence":1,"outcome":"PodFailed"}]}}`, "error", false},
		{"no record of ours", `{"status":{"fence":3,"attempts":[{"holder":"job-a2","fence":2,"outcome":"Succeeded"}]}}`, "error", false},
	} {
		if got := publicationRecorded(view(tc.run), "job-a1", 1, tc.field, value); got != tc.want {
			t.Errorf("%s: publicationRecorded = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestRetryAfterHeader(t *testing.T) {
	now := time.Date(2026, 11, 30, 16, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		value string
		want  time.Duration
	}{
		{"", 0},
		{"3", 3 * time.Second},
		{" 2 ", 2 * time.Second},
		{"-1", 0},
		{"1.5", 1500 * time.Millisecond},
		{"0.25", 250 * time.Millisecond},
		{"NaN", 0},
		{"Inf", maxRetryAfter},
		{"1e300", maxRetryAfter},
		{"99999999999999999999", maxRetryAfter},
		{"Mon, 30 Nov 2026 16:00:04 GMT", 4 * time.Second},
		{"Mon, 30 Nov 2026 15:00:00 GMT", 0},
		{"soon", 0},
	} {
		if got := retryAfterHeader(tc.value, now); got != tc.want {
			t.Errorf("retryAfterHeader(%q) = %v, want %v", tc.value, got, tc.want)
		}
	}
}

// The vectors are shared with the TypeScript SDK's tests, generated with operator/tether/protocol.py.
func TestRequestsAnnotationIsPythons(t *testing.T) {
	raw, err := os.ReadFile("../vectors/approvals.json")
	if err != nil {
		t.Fatal(err)
	}
	var vectors struct {
		RequestsAnnotation []struct {
			Name     string `json:"name"`
			Requests []struct {
				Name           string `json:"name"`
				Details        string `json:"details"`
				TimeoutSeconds *int   `json:"timeoutSeconds"`
			} `json:"requests"`
			Annotation string `json:"annotation"`
		} `json:"requestsAnnotation"`
	}
	if err := json.Unmarshal(raw, &vectors); err != nil || len(vectors.RequestsAnnotation) == 0 {
		t.Fatalf("vectors: %v", err)
	}
	for _, v := range vectors.RequestsAnnotation {
		requests := make([]approvalRequest, len(v.Requests))
		for i, r := range v.Requests {
			requests[i] = approvalRequest(r)
		}
		if got := requestsAnnotation(requests); got != v.Annotation {
			t.Errorf("%s:\n got %s\nwant %s", v.Name, got, v.Annotation)
		}
	}
}

func TestRequestRefusal(t *testing.T) {
	for _, tc := range []struct {
		name, request, details string
		timeout                *int
		ok                     bool
	}{
		{"a plain request", "send-report", "POST it", ptr(600), true},
		{"no timeout", "a", "", nil, true},
		{"63 characters", strings.Repeat("a", 63), "", nil, true},
		{"4096 characters of 4 bytes", "a", strings.Repeat("😀", 4096), nil, true},
		{"the longest timeout", "a", "", ptr(31_536_000), true},
		{"64 characters", strings.Repeat("a", 64), "", nil, false},
		{"upper case", "Refund", "", nil, false},
		{"a trailing dash", "refund-", "", nil, false},
		{"a trailing newline", "refund\n", "", nil, false},
		{"empty", "", "", nil, false},
		{"the run's start gate", "start", "", nil, false},
		{"the run's result gate", "result", "", nil, false},
		{"4097 characters of details", "a", strings.Repeat("x", 4097), nil, false},
		{"a zero timeout", "a", "", ptr(0), false},
		{"a timeout over a year", "a", "", ptr(31_536_001), false},
	} {
		if why := requestRefusal(tc.request, tc.details, tc.timeout); (why == "") != tc.ok {
			t.Errorf("%s: refusal %q, want accepted %v", tc.name, why, tc.ok)
		}
	}
	if why := requestRefusal("start", "", nil); why != "'start' names a gate of the run itself (Start, Result), not a request" {
		t.Errorf("reserved: %q", why)
	}
}

func TestRenewalCarriesExtraAnnotations(t *testing.T) {
	body, err := renewal(json.RawMessage(`{"metadata":{"annotations":{"a":"1"}}}`), time.Now(), nil, nil,
		map[string]string{annRequests: "{}"})
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Metadata struct {
			Annotations map[string]string `json:"annotations"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(body, &got); err != nil || len(got.Metadata.Annotations) != 2 ||
		got.Metadata.Annotations[annRequests] != "{}" || got.Metadata.Annotations["a"] != "1" {
		t.Fatalf("annotations %v, %v", got.Metadata.Annotations, err)
	}
}

// TestSignalVectors runs sdk/vectors/signals.json, shared with the Python and TypeScript SDKs'
// tests: which signals annotation values are malformed (null only where docs/protocol.md §7
// allows it) and what the others say.
func TestSignalVectors(t *testing.T) {
	raw, err := os.ReadFile("../vectors/signals.json")
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Cases []struct {
			Name    string `json:"name"`
			Raw     string `json:"raw"`
			Signals *struct {
				Stop      bool   `json:"stop"`
				Paused    bool   `json:"paused"`
				BaseCents int64  `json:"baseCents"`
				CapCents  *int64 `json:"capCents"`
			} `json:"signals"`
		} `json:"cases"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatalf("vectors: %v", err)
	}
	for _, v := range doc.Cases {
		t.Run(v.Name, func(t *testing.T) {
			got, ok := parseSignals(v.Raw)
			if ok != (v.Signals != nil) {
				t.Fatalf("parseSignals(%q) ok = %v, want %v", v.Raw, ok, v.Signals != nil)
			}
			if !ok {
				return
			}
			w := v.Signals
			if got.Stop != w.Stop || got.Paused != w.Paused || got.BaseCents != w.BaseCents ||
				(got.CapCents == nil) != (w.CapCents == nil) || (got.CapCents != nil && *got.CapCents != *w.CapCents) {
				t.Fatalf("parseSignals(%q) = %+v, want %+v", v.Raw, got, *w)
			}
		})
	}
}
