package main

import (
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

// heartbeat is one heartbeat the fake gateway answered.
type heartbeat struct {
	checkpoint string
	status     int
}

// fakeGateway hands out attempt 1 of ns/job with a script, L = 10 s and R = renew seconds (default
// 1 h: the heartbeat never renews on its own during a test); heartbeats get the scripted answers
// in order, then 200 (410 once retired). A spawn makes the child job-c1 for the spec it asks for (a
// spawn again answers that child), or is refused with spawnRefusal; a read of the child answers
// childStatus.
type fakeGateway struct {
	mu           sync.Mutex
	payload      string
	renew        float64
	answers      []int // heartbeat statuses
	heartbeats   []heartbeat
	beatAt       []time.Time
	completes    int
	fails        int
	retired      bool
	spawnRefusal string
	child        string // the child, once spawned ({"child": ...} without its status)
	childStatus  string
	calls        map[string][]map[string]any // the bodies of the calls but claim and heartbeat
}

// renewed is the gateway's reply to a renewal of attempt 1 (docs/protocol.md §6.4).
const renewed = `"holder":"job-a1","fence":1,"runUid":"uid-1","leaseExpiresAt":"2026-11-30T12:00:10Z",` +
	`"stop":false,"paused":false,"status":"Running"`

func (g *fakeGateway) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	raw, _ := io.ReadAll(req.Body)
	g.mu.Lock()
	defer g.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	op := strings.TrimPrefix(req.URL.Path, "/api/v1/namespaces/ns/workerruns/job/")
	var body map[string]any
	_ = json.Unmarshal(raw, &body)
	if g.calls == nil {
		g.calls = map[string][]map[string]any{}
	}
	g.calls[op] = append(g.calls[op], body)
	switch op {
	case "claim":
		renew := g.renew
		if renew == 0 {
			renew = 3600
		}
		_, _ = fmt.Fprintf(w, `{%s,"attempt":1,"leaseDurationSeconds":10,`+
			`"renewIntervalSeconds":%g,"idempotencyKey":"key","payload":%s}`, renewed, renew, g.payload)
	case "heartbeat":
		var body struct {
			Checkpoint string `json:"checkpoint"`
		}
		_ = json.Unmarshal(raw, &body)
		status := http.StatusOK
		switch {
		case g.retired:
			status = http.StatusGone
		case len(g.answers) > 0:
			status, g.answers = g.answers[0], g.answers[1:]
		}
		g.heartbeats = append(g.heartbeats, heartbeat{body.Checkpoint, status})
		g.beatAt = append(g.beatAt, time.Now())
		w.WriteHeader(status)
		switch status {
		case http.StatusOK:
			_, _ = io.WriteString(w, "{"+renewed+"}")
		case http.StatusGone:
			_, _ = io.WriteString(w, `{"error":{"code":"StaleFence","message":"fence 1 is no longer current"}}`)
		default:
			_, _ = io.WriteString(w, `{"error":{"code":"Busy","message":"try again"}}`)
		}
	case "complete":
		g.completes++
		_, _ = io.WriteString(w, `{"status":"Succeeded","fence":2}`)
	case "fail":
		g.fails++
		_, _ = io.WriteString(w, `{"status":"Failed","fence":2}`)
	case "spawn":
		g.spawn(w, body)
	case "child":
		_, _ = fmt.Fprintf(w, `{"child":{%s,"status":%s}}`, g.child, g.childStatus)
	}
}

// spawn makes the child for the spec asked for, the first time: its digest is the spec's (the
// tests' specs are JSON that encoding/json writes as Python's json.dumps does, keys sorted).
func (g *fakeGateway) spawn(w http.ResponseWriter, body map[string]any) {
	if g.spawnRefusal != "" {
		w.WriteHeader(http.StatusUnprocessableEntity)
		_, _ = fmt.Fprintf(w, `{"error":{"code":"SpawnRefused","message":%q}}`, g.spawnRefusal)
		return
	}
	if g.child == "" {
		spec, _ := json.Marshal(body["spec"])
		g.child = fmt.Sprintf(`"metadata":{"name":"job-c1","labels":{"tether.dev/parent":"job"},`+
			`"annotations":{"tether.dev/spawn-digest":"%x"},"ownerReferences":[{"uid":"uid-1"}]},`+
			`"spec":{"parentRef":{"holder":"job-a1","fence":1}}`, sha256.Sum256(spec))
	}
	_, _ = fmt.Fprintf(w, `{"child":{%s,"status":{}}}`, g.child)
}

// sent is the bodies of the calls `op` the gateway got.
func (g *fakeGateway) sent(op string) []map[string]any {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.calls[op]
}

// seen is what the gateway saw, once the program has ended: heartbeats, and publications.
func (g *fakeGateway) seen() ([]heartbeat, int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]heartbeat(nil), g.heartbeats...), g.completes + g.fails
}

// retire answers later heartbeats 410 and waits for one: a crashed program's heartbeat, which its
// os.Exit would have ended, then stops renewing within the test.
func (g *fakeGateway) retire(t *testing.T) {
	t.Helper()
	g.mu.Lock()
	g.retired = true
	g.mu.Unlock()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		g.mu.Lock()
		last := g.heartbeats[len(g.heartbeats)-1]
		g.mu.Unlock()
		if last.status == http.StatusGone {
			return
		}
	}
	t.Fatal("no heartbeat after the crash: the program closed the run, or its heartbeat died")
}

// answer is one scripted receiver answer; drop closes the connection without one.
type answer struct {
	status int
	body   string
	drop   bool
}

// receiver answers the side effects with the scripted answers in order, then 200.
type receiver struct {
	mu      sync.Mutex
	answers []answer
	keys    []string
}

func (rc *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.keys = append(rc.keys, req.Header.Get("Idempotency-Key"))
	a := answer{status: http.StatusOK, body: `{"ok":true}`}
	if len(rc.answers) > 0 {
		a, rc.answers = rc.answers[0], rc.answers[1:]
	}
	if a.drop {
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			_ = conn.Close()
		}
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(a.status)
	_, _ = io.WriteString(w, a.body)
}

func (rc *receiver) seen() []string {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return rc.keys
}

// runExternal runs the program as the kit does for an External run, against the fake gateway.
func runExternal(t *testing.T, g *fakeGateway) int {
	t.Helper()
	srv := httptest.NewServer(g)
	t.Cleanup(srv.Close)
	token := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(token, []byte("tok\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{"TETHER_GATEWAY_URL": srv.URL, "TETHER_GATEWAY_TOKEN_FILE": token,
		"TETHER_NAMESPACE": "ns", "TETHER_RUN": "job", "TETHER_WORKER_ID": ""} {
		t.Setenv(k, v)
	}
	return run()
}

func withReceiver(t *testing.T, rc *receiver) string {
	t.Helper()
	srv := httptest.NewServer(rc)
	t.Cleanup(srv.Close)
	return srv.URL + "/effect"
}

// effectScript is a one-step script whose side effect goes to the receiver.
func effectScript(t *testing.T, rc *receiver) string {
	return `{"steps":1,"stepSeconds":0,"effectUrl":"` + withReceiver(t, rc) + `"}`
}

func TestAReceiverStillRunningTheStepSendsItAgain(t *testing.T) {
	rc := &receiver{answers: []answer{{status: 409, body: `{"error":"InProgress","message":"in progress; retry later"}`}}}
	g := &fakeGateway{payload: effectScript(t, rc)}
	if code := runExternal(t, g); code != exitDone {
		t.Fatalf("exit %d", code)
	}
	if _, published := g.seen(); strings.Join(rc.seen(), " ") != "key:step-0 key:step-0" || published != 1 {
		t.Fatalf("effects %v, %d publications", rc.seen(), published)
	}
}

func TestAReceiverFailureOrNoAnswerSendsTheStepAgain(t *testing.T) {
	for name, first := range map[string]answer{
		"503":                  {status: 503, body: `{"error":"Unavailable"}`},
		"500 without a body":   {status: 500},
		"a dropped connection": {drop: true},
	} {
		t.Run(name, func(t *testing.T) {
			rc := &receiver{answers: []answer{first}}
			g := &fakeGateway{payload: effectScript(t, rc)}
			if code := runExternal(t, g); code != exitDone {
				t.Fatalf("exit %d", code)
			}
			if _, published := g.seen(); strings.Join(rc.seen(), " ") != "key:step-0 key:step-0" || published != 1 {
				t.Fatalf("effects %v, %d publications", rc.seen(), published)
			}
		})
	}
}

// TestTheProgramClosesTheRunBeforeItExits: every exit but the crash sends a last renewal (the
// start's renewal is the first heartbeat, the closing one the second).
func TestTheProgramClosesTheRunBeforeItExits(t *testing.T) {
	for _, tc := range []struct {
		name   string
		answer answer
		code   int
	}{
		{"a stale fence at the receiver", answer{status: 409, body: `{"error":"StaleFence","message":"fence 1 < 2","highestFence":2}`}, exitLost},
		{"a 400 from the receiver", answer{status: 400, body: `{"error":"BadRequest"}`}, exitBroken},
		{"a 409 without a known error", answer{status: 409, body: `{"error":"Duplicate"}`}, exitBroken},
		{"a 409 without a body", answer{status: 409}, exitBroken},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rc := &receiver{answers: []answer{tc.answer}}
			g := &fakeGateway{payload: effectScript(t, rc)}
			if code := runExternal(t, g); code != tc.code {
				t.Fatalf("exit %d, want %d", code, tc.code)
			}
			beats, published := g.seen()
			if len(rc.seen()) != 1 || published != 0 || len(beats) != 2 {
				t.Fatalf("effects %v, %d publications, heartbeats %+v", rc.seen(), published, beats)
			}
		})
	}
}

func TestTheProgramsOwnFailuresExit70(t *testing.T) {
	for name, payload := range map[string]string{
		"a payload that is not a script": `{"steps":"three"}`,
		"an effect URL that is not one":  `{"steps":1,"stepSeconds":0,"effectUrl":"http://[::1"}`,
	} {
		t.Run(name, func(t *testing.T) {
			g := &fakeGateway{payload: payload}
			if code := runExternal(t, g); code != exitBroken {
				t.Fatalf("exit %d", code)
			}
			if beats, published := g.seen(); len(beats) != 2 || published != 0 {
				t.Fatalf("heartbeats %+v, %d publications: the run was not closed", beats, published)
			}
		})
	}
}

func TestAPanicExits70(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	if code := guarded(log, func() int { panic("a bug") }); code != exitBroken {
		t.Fatalf("exit %d", code)
	}
}

func TestNoBadResultInAnAttemptThatFailsOnPurpose(t *testing.T) {
	g := &fakeGateway{payload: `{"steps":1,"stepSeconds":0,"failAttempts":[1],"badResultFirst":true}`}
	if code := runExternal(t, g); code != exitDone {
		t.Fatalf("exit %d", code)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.completes != 0 || g.fails != 1 {
		t.Fatalf("%d completes, %d fails", g.completes, g.fails)
	}
}

func TestACrashRenewsUntilTheCheckpointIsConfirmed(t *testing.T) {
	g := &fakeGateway{payload: `{"steps":3,"stepSeconds":0,"crashAttempts":[1],"crashAfterStep":1}`, renew: 0.2,
		answers: []int{http.StatusOK, http.StatusServiceUnavailable, http.StatusServiceUnavailable}}
	if code := runExternal(t, g); code != exitCrash {
		t.Fatalf("exit %d", code)
	}
	// The start, two busy answers, then confirmed ones (the heartbeat renews too, and may be
	// confirmed before the flush's own renewal).
	beats, published := g.seen()
	g.retire(t)
	if len(beats) < 4 || beats[3] != (heartbeat{"1", http.StatusOK}) || beats[len(beats)-1] != beats[3] || published != 0 {
		t.Fatalf("heartbeats %+v, %d publications", beats, published)
	}
}

func TestACrashRenewsAtMostOncePerInterval(t *testing.T) {
	const renew = 400 * time.Millisecond
	busy := http.StatusServiceUnavailable
	g := &fakeGateway{payload: `{"steps":3,"stepSeconds":0,"crashAttempts":[1],"crashAfterStep":1}`,
		renew: renew.Seconds(), answers: []int{http.StatusOK, busy, busy, busy, busy}}
	if code := runExternal(t, g); code != exitCrash {
		t.Fatalf("exit %d", code)
	}
	g.mu.Lock()
	at := append([]time.Time(nil), g.beatAt...)
	g.mu.Unlock()
	g.retire(t)
	// Two sources renew, the heartbeat and the crash's flush, each at most once per R: of any three
	// renewals in a row, two come from one source, so they span at least R.
	for i := 2; i < len(at); i++ {
		if span := at[i].Sub(at[i-2]); span < renew*9/10 {
			t.Fatalf("renewals %d..%d within %v", i-2, i, span)
		}
	}
}

func TestACrashClosesNothing(t *testing.T) {
	g := &fakeGateway{payload: `{"steps":3,"stepSeconds":0,"crashAttempts":[1],"crashAfterStep":1}`}
	if code := runExternal(t, g); code != exitCrash {
		t.Fatalf("exit %d", code)
	}
	// The start's renewal, the flush's: no last renewal, as after a real crash.
	if beats, _ := g.seen(); len(beats) != 2 {
		t.Fatalf("heartbeats %+v", beats)
	}
}

func TestACrashStopsRenewingOnceLost(t *testing.T) {
	g := &fakeGateway{payload: `{"steps":3,"stepSeconds":0,"crashAttempts":[1],"crashAfterStep":1}`,
		answers: []int{http.StatusOK, http.StatusGone}}
	if code := runExternal(t, g); code != exitCrash {
		t.Fatalf("exit %d", code)
	}
	if beats, _ := g.seen(); len(beats) != 2 {
		t.Fatalf("heartbeats %+v", beats)
	}
}

// withChild is a script that spawns tool:1 before its one step.
const withChild = `{"steps":1,"stepSeconds":0,"spawn":{"key":"tool:1","className":"tools","payload":{"q":"x"},` +
	`"capCents":5,"spec":{"executor":"External"}}}`

func TestTheChildsResultIsPublished(t *testing.T) {
	g := &fakeGateway{payload: withChild, childStatus: `{"phase":"Succeeded","result":{"hits":1}}`}
	if code := runExternal(t, g); code != exitDone {
		t.Fatalf("exit %d", code)
	}
	spawns, completes := g.sent("spawn"), g.sent("complete")
	if len(spawns) != 2 || len(completes) != 1 {
		t.Fatalf("spawns %v, completes %v", spawns, completes)
	}
	// The key again with another payload (the same class, share and spec): refused as a conflict.
	wantSpec := `{"executor":"External","className":"tools","payload":{"q":"x"},"budget":{"capCents":5}}`
	conflictSpec := `{"executor":"External","className":"tools","payload":{"conflict":true},"budget":{"capCents":5}}`
	for i, want := range []string{wantSpec, conflictSpec} {
		if spawns[i]["key"] != "tool:1" || !sameJSON(t, spawns[i]["spec"], want) {
			t.Fatalf("spawn %d: %v, want spec %s", i, spawns[i], want)
		}
	}
	want := `{"steps":1,"attempt":1,"sdk":"go","child":{"name":"job-c1","result":{"hits":1}},"conflictRefused":true}`
	if !sameJSON(t, completes[0]["result"], want) {
		t.Fatalf("result %v, want %s", completes[0]["result"], want)
	}
}

func TestAChildEndedWithoutAResultFailsTheAttempt(t *testing.T) {
	g := &fakeGateway{payload: withChild,
		childStatus: `{"phase":"Failed","conditions":[{"type":"Ready","reason":"WorkerFailed","message":"boom"}]}`}
	if code := runExternal(t, g); code != exitDone {
		t.Fatalf("exit %d", code)
	}
	fails := g.sent("fail")
	if len(fails) != 1 || len(g.sent("complete")) != 0 || len(g.sent("spawn")) != 1 {
		t.Fatalf("fails %v", fails)
	}
	failure := fails[0]["error"].(map[string]any)
	if failure["code"] != "ConformanceChildFailed" || failure["message"] != "job-c1 ended Failed (WorkerFailed)" {
		t.Fatalf("failure %v", failure)
	}
}

func TestARefusedSpawnFailsTheAttempt(t *testing.T) {
	g := &fakeGateway{payload: withChild, spawnRefusal: "class tools is not one jobs may spawn"}
	if code := runExternal(t, g); code != exitDone {
		t.Fatalf("exit %d", code)
	}
	fails := g.sent("fail")
	if len(fails) != 1 || len(g.sent("complete")) != 0 {
		t.Fatalf("fails %v", fails)
	}
	failure := fails[0]["error"].(map[string]any)
	if failure["code"] != "ConformanceSpawnRefused" || !strings.Contains(failure["message"].(string), "not one jobs may spawn") {
		t.Fatalf("failure %v", failure)
	}
}

// TestTheChildComesBeforeTheStepsAndTheCrash: the kit's spawn scenario, attempt 1: the child's result
// and the refused conflict, then the step, then the crash, which publishes nothing.
func TestTheChildComesBeforeTheStepsAndTheCrash(t *testing.T) {
	g := &fakeGateway{payload: strings.Replace(withChild, `"steps":1,`, `"steps":2,"crashAttempts":[1],"crashAfterStep":1,`, 1),
		childStatus: `{"phase":"Succeeded","result":{"hits":1}}`}
	if code := runExternal(t, g); code != exitCrash {
		t.Fatalf("exit %d", code)
	}
	beats, published := g.seen()
	if len(g.sent("spawn")) != 2 || len(g.sent("child")) != 1 || published != 0 || beats[len(beats)-1].checkpoint != "1" {
		t.Fatalf("spawns %v, reads %v, heartbeats %+v, %d publications", g.sent("spawn"), g.sent("child"), beats, published)
	}
}

// sameJSON compares a decoded JSON value with a JSON text by value.
func sameJSON(t *testing.T, got any, want string) bool {
	t.Helper()
	var w any
	if err := json.Unmarshal([]byte(want), &w); err != nil {
		t.Fatal(err)
	}
	return reflect.DeepEqual(got, w)
}
