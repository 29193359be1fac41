package tether

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

type gatewayCall struct {
	op, auth string
	body     map[string]any
}

// fakeGateway answers like the Tether gateway; a test scripts answers per operation (used once
// each, in order), else claim and heartbeat succeed and publications are accepted.
type fakeGateway struct {
	mu      sync.Mutex
	calls   []gatewayCall
	answers map[string][]func(w http.ResponseWriter)
}

func newFakeGateway(t *testing.T) (*fakeGateway, *httptest.Server) {
	g := &fakeGateway{answers: map[string][]func(http.ResponseWriter){}}
	srv := httptest.NewServer(g)
	t.Cleanup(srv.Close)
	return g, srv
}

func (g *fakeGateway) script(op string, answers ...func(http.ResponseWriter)) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.answers[op] = append(g.answers[op], answers...)
}

func (g *fakeGateway) callsTo(op string) []gatewayCall {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []gatewayCall
	for _, c := range g.calls {
		if c.op == op {
			out = append(out, c)
		}
	}
	return out
}

func (g *fakeGateway) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	prefix := "/api/v1/namespaces/agents/workerruns/invoice-8f1b/"
	op, ok := strings.CutPrefix(req.URL.Path, prefix)
	raw, _ := io.ReadAll(req.Body)
	var body map[string]any
	_ = json.Unmarshal(raw, &body)
	g.mu.Lock()
	defer g.mu.Unlock()
	g.calls = append(g.calls, gatewayCall{op, req.Header.Get("Authorization"), body})
	if !ok || req.Method != http.MethodPost {
		gatewayAnswer(404, `{"error":{"code":"NotFound","message":"no route"}}`)(w)
		return
	}
	if scripted := g.answers[op]; len(scripted) > 0 {
		g.answers[op] = scripted[1:]
		scripted[0](w)
		return
	}
	switch op {
	case "claim":
		gatewayAnswer(200, `{"holder":"invoice-8f1b-a2","fence":3,"attempt":2,"leaseDurationSeconds":10,`+
			`"renewIntervalSeconds":3600,"payload":{"invoice":"8f1b"},"checkpoint":"row-40","idempotencyKey":"invoice:8f1b",`+
			`"runUid":"uid-1","leaseExpiresAt":"2026-11-30T16:00:10Z","stop":false,"paused":false,"status":"Starting",`+
			`"toolClaim":{"token":"tool-1","expiresAt":"2026-11-30T16:10:00Z","serviceAccount":"invoice-8f1b-worker"}}`)(w)
	case "heartbeat":
		renewed(`{"endsAt":null,"capRemainingCents":null,"capRemainingTokens":null,"toolClaim":null}`)(w)
	default:
		gatewayAnswer(200, `{"status":"Succeeded","fence":3}`)(w)
	}
}

// renewed is the gateway's reply to a renewal of the fake's attempt (invoice-8f1b-a2, fence 3),
// with `fields` (a JSON object) added or replacing its own.
func renewed(fields string) func(http.ResponseWriter) {
	reply := map[string]any{"holder": "invoice-8f1b-a2", "fence": 3, "runUid": "uid-1",
		"leaseExpiresAt": "2026-11-30T16:00:10Z", "stop": false, "paused": false, "status": "Running"}
	if err := json.Unmarshal([]byte(fields), &reply); err != nil {
		panic(err)
	}
	raw, _ := json.Marshal(reply)
	return gatewayAnswer(200, string(raw))
}

func gatewayAnswer(code int, body string) func(http.ResponseWriter) {
	return func(w http.ResponseWriter) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_, _ = io.WriteString(w, body)
	}
}

func claimTest(t *testing.T, srv *httptest.Server, opts ...Option) *Run {
	t.Helper()
	r, err := Claim(context.Background(), srv.URL+"/", "agents", "invoice-8f1b", "tok",
		append([]Option{WithWorkerID("laptop-1"), WithLogger(discard)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func TestClaim(t *testing.T) {
	g, srv := newFakeGateway(t)
	r := claimTest(t, srv)
	claims := g.callsTo("claim")
	if len(claims) != 1 || claims[0].auth != "Bearer tok" || claims[0].body["workerId"] != "laptop-1" {
		t.Fatalf("claim calls %+v", claims)
	}
	if r.Holder() != "invoice-8f1b-a2" || r.Fence() != 3 || r.Attempt() != 2 || r.CheckpointCursor() != "row-40" ||
		r.IdempotencyKey() != "invoice:8f1b" || string(r.Payload()) != `{"invoice":"8f1b"}` ||
		r.LeaseDuration() != 10*time.Second || r.ToolClaim() == nil || r.ToolClaim().Token != "tool-1" {
		t.Fatalf("claimed run %+v", r.info)
	}
	// Claim renews once before returning, naming the attempt, the worker and the run.
	beats := g.callsTo("heartbeat")
	want := map[string]any{"holder": "invoice-8f1b-a2", "fence": float64(3), "workerId": "laptop-1", "runUid": "uid-1"}
	if len(beats) != 1 || !r.Owned() {
		t.Fatalf("%d heartbeats, %s", len(beats), state(r))
	}
	for k, v := range want {
		if beats[0].body[k] != v {
			t.Fatalf("heartbeat body %v, want %v", beats[0].body, want)
		}
	}
	if _, ok := beats[0].body["usage"]; ok {
		t.Fatalf("a heartbeat reported usage nobody reported: %v", beats[0].body)
	}
	_ = r.ReportUsage(12, 900)
	if err := r.Checkpoint("row-41", true); err != nil {
		t.Fatal(err)
	}
	last := g.callsTo("heartbeat")[1].body
	if last["checkpoint"] != "row-41" || last["usage"].(map[string]any)["cents"] != float64(12) {
		t.Fatalf("heartbeat body %v", last)
	}
}

func TestClaimRefused(t *testing.T) {
	for _, tc := range []struct {
		status int
		body   string
		code   string
	}{
		{409, `{"error":{"code":"HeldByAnother","message":"held by another worker"}}`, "HeldByAnother"},
		{402, `{"error":{"code":"BudgetExceeded","message":"the run's budget is exhausted"}}`, "BudgetExceeded"},
		{502, `<html>bad gateway</html>`, ""},
	} {
		g, srv := newFakeGateway(t)
		g.script("claim", gatewayAnswer(tc.status, tc.body))
		_, err := Claim(context.Background(), srv.URL, "agents", "invoice-8f1b", "tok", WithLogger(discard))
		var refused *ClaimRefusedError
		if !errors.Is(err, ErrClaimRefused) || !errors.As(err, &refused) || refused.Status != tc.status || refused.Code != tc.code {
			t.Errorf("%d: %v", tc.status, err)
		}
		if len(g.callsTo("heartbeat")) != 0 {
			t.Errorf("%d: a refused claim heartbeats", tc.status)
		}
	}
}

func TestClaimUnanswered(t *testing.T) {
	_, srv := newFakeGateway(t)
	srv.Close()
	if _, err := Claim(context.Background(), srv.URL, "agents", "invoice-8f1b", "tok"); err == nil || errors.Is(err, ErrClaimRefused) {
		t.Fatalf("%v", err)
	}
}

func TestGatewayHeartbeatSignals(t *testing.T) {
	g, srv := newFakeGateway(t)
	g.script("heartbeat", renewed(`{"stop":false,"paused":true,"endsAt":"2026-12-01T00:00:00Z",`+
		`"capRemainingCents":380,"capRemainingTokens":null,"status":"Running"}`))
	r := claimTest(t, srv)
	s := r.Signals()
	if !s.Paused || s.EndsAt == nil || deref(s.CapRemainingCents) != int64(380) || s.CapRemainingTokens != nil {
		t.Fatalf("signals %+v", s)
	}
	_ = r.ReportUsage(20, 0) // counted against the usage the heartbeat reported (none)
	if got := deref(r.Signals().CapRemainingCents); got != int64(360) {
		t.Fatalf("remaining %v", got)
	}
	g.script("heartbeat", renewed(`{"stop":true,"paused":false,"capRemainingCents":360}`))
	_ = r.Checkpoint("x", true)
	if s := r.Signals(); !s.Stop || deref(s.CapRemainingCents) != int64(360) || !errors.Is(r.EnsureOwner(), ErrStopRequested) {
		t.Fatalf("signals %+v", s)
	}
}

func TestGatewayHeartbeatAnswers(t *testing.T) {
	for _, tc := range []struct {
		name     string
		answer   func(http.ResponseWriter)
		lost, ok bool
	}{
		{"410 stale fence: lost", gatewayAnswer(410, `{"error":{"code":"StaleFence","message":"no longer current"}}`), true, false},
		{"404: lost", gatewayAnswer(404, `{"error":{"code":"NotFound","message":"gone"}}`), true, false},
		{"403 NotClaimant: lost", gatewayAnswer(403, `{"error":{"code":"NotClaimant","message":"x"}}`), true, false},
		{"409 HeldByAnother: lost", gatewayAnswer(409, `{"error":{"code":"HeldByAnother","message":"x"}}`), true, false},
		{"403 Forbidden (RBAC): unconfirmed", gatewayAnswer(403, `{"error":{"code":"Forbidden","message":"x"}}`), false, false},
		{"401: unconfirmed", gatewayAnswer(401, `{"error":{"code":"Unauthorized","message":"x"}}`), false, false},
		{"503: unconfirmed", gatewayAnswer(503, `{"error":{"code":"Unavailable","message":"x"}}`), false, false},
		{"503 Busy: unconfirmed", gatewayAnswer(503, `{"error":{"code":"Busy","message":"x"}}`), false, false},
		{"422: unconfirmed", gatewayAnswer(422, `{"error":{"code":"MalformedBody","message":"x"}}`), false, false},
		// A 200 confirms only with the gateway's reply, a JSON object.
		{"200 with a proxy's page: unconfirmed", gatewayAnswer(200, `<html>hello</html>`), false, false},
		{"200 with a JSON array: unconfirmed", gatewayAnswer(200, `[1]`), false, false},
		{"200 with JSON null: unconfirmed", gatewayAnswer(200, `null`), false, false},
		{"200 with no body: unconfirmed", gatewayAnswer(200, ``), false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, srv := newFakeGateway(t)
			r := claimTest(t, srv)
			g.script("heartbeat", tc.answer)
			err := r.Checkpoint("1", true)
			if r.Lost() != tc.lost || (err == nil) != tc.ok || errors.Is(err, ErrLeaseLost) != tc.lost {
				t.Fatalf("%v, lost %v", err, r.Lost())
			}
		})
	}
}

func TestGatewayPublish(t *testing.T) {
	for _, tc := range []struct {
		name       string
		answer     func(http.ResponseWriter)
		outcome    publishOutcome
		retryAfter time.Duration
	}{
		{"200", gatewayAnswer(200, `{"status":"Succeeded","fence":3}`), published, 0},
		{"410", gatewayAnswer(410, `{"error":{"code":"StaleFence","message":"x"}}`), refused, 0},
		{"404", gatewayAnswer(404, `{"error":{"code":"NotFound","message":"x"}}`), refused, 0},
		{"409", gatewayAnswer(409, `{"error":{"code":"HeldByAnother","message":"x"}}`), refused, 0},
		{"409 AlreadyPublished", gatewayAnswer(409, `{"error":{"code":"AlreadyPublished","message":"x"}}`), refused, 0},
		{"413", gatewayAnswer(413, `{"error":{"code":"TooLarge","message":"body over 1 MiB"}}`), invalid, 0},
		{"403 NotClaimant", gatewayAnswer(403, `{"error":{"code":"NotClaimant","message":"x"}}`), refused, 0},
		{"403 other", gatewayAnswer(403, `{"error":{"code":"Forbidden","message":"x"}}`), retry, 0},
		{"401", gatewayAnswer(401, `{"error":{"code":"Unauthorized","message":"x"}}`), retry, 0},
		{"400", gatewayAnswer(400, `{"error":{"code":"BadRequest","message":"x"}}`), retry, 0},
		{"502", gatewayAnswer(502, `<html>bad gateway</html>`), retry, 0},
		{"503 Busy Retry-After", func(w http.ResponseWriter) {
			w.Header().Set("Retry-After", "1")
			gatewayAnswer(503, `{"error":{"code":"Busy","message":"x"}}`)(w)
		}, retry, time.Second},
		{"422", gatewayAnswer(422, `{"error":{"code":"MalformedBody","message":"result: Input should be a valid dictionary","field":"result"}}`), invalid, 0},
		{"503 Retry-After", func(w http.ResponseWriter) {
			w.Header().Set("Retry-After", "2")
			gatewayAnswer(503, `{"error":{"code":"Unavailable","message":"x"}}`)(w)
		}, retry, 2 * time.Second},
		{"429", gatewayAnswer(429, `{}`), retry, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, srv := newFakeGateway(t)
			r := claimTest(t, srv)
			g.script("complete", tc.answer)
			res, err := r.tr.publish(context.Background(), "result", json.RawMessage(`{"captured":true}`))
			if err != nil || res.outcome != tc.outcome || res.retryAfter != tc.retryAfter {
				t.Fatalf("publish = %+v, %v", res, err)
			}
			body := g.callsTo("complete")[0].body
			if body["holder"] != "invoice-8f1b-a2" || body["fence"] != float64(3) || body["runUid"] != "uid-1" ||
				body["workerId"] != "laptop-1" || body["result"].(map[string]any)["captured"] != true {
				t.Fatalf("complete body %v", body)
			}
		})
	}
}

func TestGatewayAlreadyPublishedIsNotRetried(t *testing.T) {
	g, srv := newFakeGateway(t)
	r := claimTest(t, srv)
	g.script("complete", gatewayAnswer(409, `{"error":{"code":"AlreadyPublished","message":"another result was accepted"}}`))
	if err := r.Complete(context.Background(), map[string]bool{"captured": true}); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("%v", err)
	}
	if n := len(g.callsTo("complete")); n != 1 {
		t.Fatalf("%d tries", n)
	}
}

func TestGatewayFailAndBadResult(t *testing.T) {
	g, srv := newFakeGateway(t)
	r := claimTest(t, srv)
	g.script("complete", gatewayAnswer(422, `{"error":{"code":"MalformedBody","message":"result: Input should be a valid dictionary","field":"result"}}`))
	err := r.Complete(context.Background(), []int{1})
	var bad *ResultInvalidError
	if !errors.Is(err, ErrResultInvalid) || !errors.As(err, &bad) || r.Lost() || len(bad.Causes) != 1 ||
		bad.Causes[0].Field != "result" || bad.Field != "result" {
		t.Fatalf("bad result: %v", err)
	}
	if err := r.Fail(context.Background(), "ConformanceFailure", "on purpose"); err != nil {
		t.Fatal(err)
	}
	e := g.callsTo("fail")[0].body["error"].(map[string]any)
	if e["code"] != "ConformanceFailure" || e["message"] != "on purpose" {
		t.Fatalf("fail body %v", e)
	}
}

func TestGatewayApprovals(t *testing.T) {
	g, srv := newFakeGateway(t)
	g.script("claim", renewed(`{"attempt":2,"leaseDurationSeconds":10,"renewIntervalSeconds":3600,`+
		`"idempotencyKey":"invoice:8f1b","reviewFeedback":"round the totals"}`))
	r := claimTest(t, srv)
	r.poll = time.Millisecond
	if r.ReviewFeedback() != "round the totals" {
		t.Fatalf("review feedback %q", r.ReviewFeedback())
	}
	pending := `{"stop":false,"paused":false,"status":"Running","decisions":{}}`
	g.script("heartbeat", renewed(pending), renewed(pending), renewed(pending),
		renewed(`{"stop":false,"paused":false,"status":"Running",`+
			`"decisions":{"refund":{"decision":"Deny","reason":"too much","approver":"alice"}}}`))
	d, err := r.RequestApproval(context.Background(), "refund", "42 EUR", ptr(600))
	if err != nil || d != (ApprovalDecision{Decision: "Deny", Reason: "too much", Approver: "alice"}) || d.Approved() {
		t.Fatalf("decision %+v, %v", d, err)
	}
	beats := g.callsTo("heartbeat")[1:] // the first is the start's, before the request
	if len(beats) != 4 {
		t.Fatalf("%d heartbeats while waiting, want 4", len(beats))
	}
	for _, b := range beats {
		want := []any{map[string]any{"name": "refund", "details": "42 EUR", "timeoutSeconds": float64(600)}}
		if !reflect.DeepEqual(b.body["requests"], want) {
			t.Fatalf("heartbeat requests %v", b.body["requests"])
		}
	}
}

func TestGatewayRequestWithoutTimeout(t *testing.T) {
	g, srv := newFakeGateway(t)
	g.script("heartbeat", renewed(`{}`), renewed(`{"decisions":{"ship":{"decision":"TimedOut"}}}`))
	r := claimTest(t, srv)
	if d, err := r.RequestApproval(context.Background(), "ship", "", nil); err != nil || d.Decision != "TimedOut" {
		t.Fatalf("decision %+v, %v", d, err)
	}
	want := []any{map[string]any{"name": "ship", "details": ""}}
	if got := g.callsTo("heartbeat")[1].body["requests"]; !reflect.DeepEqual(got, want) {
		t.Fatalf("requests %v: timeoutSeconds is sent only when set", got)
	}
}

func TestGatewayMalformedDecisionsDecideNothing(t *testing.T) {
	g, srv := newFakeGateway(t)
	r := claimTest(t, srv)
	g.script("heartbeat", renewed(`{"stop":true,"paused":true,"decisions":{"refund":{"decision":"Perhaps"}}}`))
	res, err := r.tr.renew(context.Background(), nil, nil, nil)
	if err != nil || !res.ok || res.signals == nil || !res.signals.Stop || !res.signals.Paused || res.signals.Decisions != nil {
		t.Fatalf("renewal %+v, %v: the other signals must stand", res, err)
	}
}

func TestGatewayHeartbeatYield(t *testing.T) {
	g, srv := newFakeGateway(t)
	g.script("heartbeat", renewed(`{"stop":true,"yield":true,"stopBy":"2026-12-03T12:00:30Z","paused":false,`+
		`"reason":null,"status":"Running"}`))
	r := claimTest(t, srv)
	s := r.Signals()
	if !s.Stop || !s.Yielding || s.StopBy == nil || s.StopBy.Second() != 30 {
		t.Fatalf("a Kueue eviction should reach the worker as a yield: %+v", s)
	}
}

// spawned is the gateway's reply to a spawn or child call of the fake's run: the child `name` for a
// spec, with `status` (a JSON object).
func spawned(name string, spec map[string]any, status string) func(http.ResponseWriter) {
	child := fmt.Sprintf(`{"child":{"metadata":{"name":%q,"labels":{"tether.dev/parent":"invoice-8f1b"},`+
		`"annotations":{"tether.dev/spawn-digest":%q},"ownerReferences":[{"uid":"uid-1"}]},`+
		`"spec":{"parentRef":{"holder":"invoice-8f1b-a2","fence":3}},"status":%s}}`, name, spawnDigest(spec), status)
	return gatewayAnswer(200, child)
}

// toolCall is what TestGatewaySpawn asks for, and the spec the gateway is sent for it.
var toolCall = SpawnOptions{ClassName: "tools", Payload: map[string]any{"q": "x"}, CapCents: int64p(20)}

func toolCallSpec(t *testing.T) map[string]any {
	spec, err := childSpec(parentRun{}, toolCall)
	if err != nil {
		t.Fatal(err)
	}
	return spec
}

func TestGatewaySpawn(t *testing.T) {
	g, srv := newFakeGateway(t)
	r := claimTest(t, srv)
	g.script("spawn", spawned("invoice-8f1b-1a2b3c4d5e", toolCallSpec(t), `{}`))
	child, err := r.Spawn(context.Background(), "tool:1", toolCall)
	if err != nil || child.Name() != "invoice-8f1b-1a2b3c4d5e" {
		t.Fatalf("spawn: %v, %v", child, err)
	}
	// The fenced body, the key and its generation, and the spec as asked: the gateway makes the rest.
	body := g.callsTo("spawn")[0].body
	want := `{"holder":"invoice-8f1b-a2","fence":3,"runUid":"uid-1","workerId":"laptop-1","key":"tool:1","generation":0,` +
		`"spec":{"executor":"Pod","className":"tools","payload":{"q":"x"},"budget":{"capCents":20}}}`
	if !jsonEqual(mustJSON(t, body), json.RawMessage(want)) {
		t.Fatalf("spawn body %s", mustJSON(t, body))
	}
	g.script("child", spawned(child.Name(), toolCallSpec(t), `{"phase":"Running"}`),
		spawned(child.Name(), toolCallSpec(t), `{"phase":"Succeeded","result":{"hits":2}}`))
	got, err := child.Result(context.Background(), time.Millisecond)
	if err != nil || got["hits"] != 2.0 {
		t.Fatalf("result %v, %v", got, err)
	}
	if reads := g.callsTo("child"); len(reads) != 2 || reads[0].body["name"] != child.Name() || reads[0].body["fence"] != 3.0 {
		t.Fatalf("child calls %+v", reads)
	}
	// A key asked for another spec: the gateway answers the child it has, the worker judges.
	g.script("spawn", spawned("invoice-8f1b-1a2b3c4d5e", toolCallSpec(t), `{}`))
	other := toolCall
	other.Payload = map[string]any{"q": "y"}
	if _, err := r.Spawn(context.Background(), "tool:1", other); !errors.Is(err, ErrSpawnConflict) {
		t.Fatalf("conflicting spawn: %v", err)
	}
}

// TestGatewayChildAnswers: what the answers to spawn and child mean. A 200 that is not the gateway's
// reply, and a refusal that says nothing about ownership, are no answer; the answers a heartbeat
// reads as lost are lost here too.
func TestGatewayChildAnswers(t *testing.T) {
	for _, tc := range []struct {
		name   string
		answer func(http.ResponseWriter)
		want   error  // nil: an error that is neither lost nor refused
		only   string // the call it is an answer of ("": both)
	}{
		{"200 {}", gatewayAnswer(200, `{}`), nil, ""},
		{"200 a child that is not an object", gatewayAnswer(200, `{"child":"invoice-8f1b-1"}`), nil, ""},
		{"200 a child without a name", gatewayAnswer(200, `{"child":{"metadata":{}}}`), nil, ""},
		{"200 a child whose name is no string", gatewayAnswer(200, `{"child":{"metadata":{"name":7}}}`), nil, ""},
		{"200 a page", gatewayAnswer(200, `<html>sign in</html>`), nil, ""},
		{"422 SpawnRefused", gatewayAnswer(422, `{"error":{"code":"SpawnRefused","message":"class shell is not one agents may spawn"}}`), ErrSpawnRefused, "spawn"},
		{"409", gatewayAnswer(409, `{"error":{"code":"Conflict","message":"x"}}`), nil, ""},
		{"422 other to spawn", gatewayAnswer(422, `{"error":{"code":"MalformedBody","message":"not one agents may spawn","field":"spec.parentRef"}}`), ErrSpawnRefused, "spawn"},
		{"422 other", gatewayAnswer(422, `{"error":{"code":"MalformedBody","message":"name","field":"name"}}`), nil, "child"},
		{"409 SpawnConflict", gatewayAnswer(409, `{"error":{"code":"SpawnConflict","message":"invoice-8f1b-1 exists and is not a child of invoice"}}`), ErrSpawnConflict, "spawn"},
		{"503", gatewayAnswer(503, `{"error":{"code":"Unavailable","message":"x"}}`), nil, ""},
		{"403 other", gatewayAnswer(403, `{"error":{"code":"Forbidden","message":"x"}}`), nil, "child"},
		{"403 RBAC's, no spawn verb", gatewayAnswer(403, `{"error":{"code":"Forbidden","message":"ext is not one agents may spawn for"}}`), ErrSpawnRefused, "spawn"},
		{"404 ChildNotFound", gatewayAnswer(404, `{"error":{"code":"ChildNotFound","message":"x"}}`), ErrChildFailed, "child"},
		{"404", gatewayAnswer(404, `{"error":{"code":"NotFound","message":"x"}}`), ErrLeaseLost, ""},
		{"410", gatewayAnswer(410, `{"error":{"code":"StaleFence","message":"x"}}`), ErrLeaseLost, ""},
		{"403 NotClaimant", gatewayAnswer(403, `{"error":{"code":"NotClaimant","message":"x"}}`), ErrLeaseLost, ""},
		{"409 HeldByAnother", gatewayAnswer(409, `{"error":{"code":"HeldByAnother","message":"x"}}`), ErrLeaseLost, ""},
	} {
		for _, op := range []string{"spawn", "child"} {
			if tc.only != "" && tc.only != op {
				continue
			}
			t.Run(tc.name+" to "+op, func(t *testing.T) {
				g, srv := newFakeGateway(t)
				r := claimTest(t, srv)
				err := gatewayChildCall(t, g, r, op, tc.answer)
				checkChildAnswer(t, r, err, tc.want)
				var failed *ChildFailedError
				if tc.want == ErrChildFailed && (!errors.As(err, &failed) || failed.Phase != "Deleted") {
					t.Fatalf("%v: want a deleted child", err)
				}
				if tc.want == ErrSpawnRefused && !strings.Contains(err.Error(), "not one agents may spawn") {
					t.Fatalf("refusal without its message: %v", err)
				}
			})
		}
	}
}

// gatewayChildCall spawns the toolCall child, the spawn (op "spawn") or the first read of its
// Result (op "child") answered with `answer`; the error is the call's.
func gatewayChildCall(t *testing.T, g *fakeGateway, r *Run, op string, answer func(http.ResponseWriter)) error {
	t.Helper()
	if op == "spawn" {
		g.script("spawn", answer)
		_, err := r.Spawn(context.Background(), "tool:1", toolCall)
		return err
	}
	g.script("spawn", spawned("invoice-8f1b-1", toolCallSpec(t), `{}`))
	child, err := r.Spawn(context.Background(), "tool:1", toolCall)
	if err != nil {
		t.Fatal(err)
	}
	g.script("child", answer)
	_, err = child.Result(context.Background(), time.Millisecond)
	return err
}

// checkChildAnswer: err is want (nil: an error that is neither lost, nor refused, nor a conflict,
// nor a child's end), and the run is lost exactly when err says so.
func checkChildAnswer(t *testing.T, r *Run, err, want error) {
	t.Helper()
	switch {
	case err == nil:
		t.Fatal("no error")
	case want == nil && (errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrSpawnRefused) ||
		errors.Is(err, ErrSpawnConflict) || errors.Is(err, ErrChildFailed)):
		t.Fatalf("%v: want no answer", err)
	case want != nil && !errors.Is(err, want):
		t.Fatalf("%v: want %v", err, want)
	case r.Lost() != (want == ErrLeaseLost):
		t.Fatalf("%v, and the run is %s", err, state(r))
	}
}
