package main

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// heartbeat is one heartbeat the fake gateway answered.
type heartbeat struct {
	checkpoint string
	status     int
}

// fakeGateway hands out attempt 1 of ns/job with a script; heartbeats get the scripted answers in
// order, then 200.
type fakeGateway struct {
	mu         sync.Mutex
	payload    string
	answers    []int // heartbeat statuses
	heartbeats []heartbeat
	published  int
}

func (g *fakeGateway) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	raw, _ := io.ReadAll(req.Body)
	g.mu.Lock()
	defer g.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	switch strings.TrimPrefix(req.URL.Path, "/api/v1/namespaces/ns/workerruns/job/") {
	case "claim":
		_, _ = io.WriteString(w, `{"holder":"job-a1","fence":1,"attempt":1,"runUid":"uid-1","leaseDurationSeconds":10,`+
			`"renewIntervalSeconds":3600,"idempotencyKey":"key","payload":`+g.payload+`}`)
	case "heartbeat":
		var body struct {
			Checkpoint string `json:"checkpoint"`
		}
		_ = json.Unmarshal(raw, &body)
		status := http.StatusOK
		if len(g.answers) > 0 {
			status, g.answers = g.answers[0], g.answers[1:]
		}
		g.heartbeats = append(g.heartbeats, heartbeat{body.Checkpoint, status})
		w.WriteHeader(status)
		switch status {
		case http.StatusOK:
			_, _ = io.WriteString(w, `{"stop":false,"paused":false}`)
		case http.StatusGone:
			_, _ = io.WriteString(w, `{"error":{"code":"StaleFence","message":"fence 1 is no longer current"}}`)
		default:
			_, _ = io.WriteString(w, `{"error":{"code":"Busy","message":"try again"}}`)
		}
	default: // complete, fail
		g.published++
		_, _ = io.WriteString(w, `{"status":"Succeeded","fence":2}`)
	}
}

// seen is what the gateway saw, once the program has ended.
func (g *fakeGateway) seen() ([]heartbeat, int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.heartbeats, g.published
}

// receiver answers the side effects with the scripted answers in order, then 200.
type receiver struct {
	mu      sync.Mutex
	answers []string // 409 bodies
	keys    []string
}

func (rc *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.keys = append(rc.keys, req.Header.Get("Idempotency-Key"))
	w.Header().Set("Content-Type", "application/json")
	if len(rc.answers) > 0 {
		w.WriteHeader(http.StatusConflict)
		_, _ = io.WriteString(w, rc.answers[0])
		rc.answers = rc.answers[1:]
		return
	}
	_, _ = io.WriteString(w, `{"ok":true}`)
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

func TestAReceiverStillRunningTheStepSendsItAgain(t *testing.T) {
	rc := &receiver{answers: []string{`{"error":"InProgress","message":"in progress; retry later"}`}}
	g := &fakeGateway{payload: `{"steps":1,"stepSeconds":0,"effectUrl":"` + withReceiver(t, rc) + `"}`}
	if code := runExternal(t, g); code != exitDone {
		t.Fatalf("exit %d", code)
	}
	if _, published := g.seen(); strings.Join(rc.seen(), " ") != "key:step-0 key:step-0" || published != 1 {
		t.Fatalf("effects %v, %d publications", rc.seen(), published)
	}
}

func TestAStaleFenceAtTheReceiverIsLost(t *testing.T) {
	rc := &receiver{answers: []string{`{"error":"StaleFence","message":"fence 1 < 2","highestFence":2}`}}
	g := &fakeGateway{payload: `{"steps":1,"stepSeconds":0,"effectUrl":"` + withReceiver(t, rc) + `"}`}
	if code := runExternal(t, g); code != exitLost {
		t.Fatalf("exit %d", code)
	}
	if _, published := g.seen(); len(rc.seen()) != 1 || published != 0 {
		t.Fatalf("effects %v, %d publications", rc.seen(), published)
	}
}

func TestACrashRenewsUntilTheCheckpointIsConfirmed(t *testing.T) {
	g := &fakeGateway{payload: `{"steps":3,"stepSeconds":0,"crashAttempts":[1],"crashAfterStep":1}`,
		answers: []int{http.StatusOK, http.StatusServiceUnavailable, http.StatusServiceUnavailable}}
	if code := runExternal(t, g); code != exitCrash {
		t.Fatalf("exit %d", code)
	}
	// The start, two busy answers, then the confirmed one.
	beats, published := g.seen()
	if len(beats) < 4 || beats[3] != (heartbeat{"1", http.StatusOK}) || published != 0 {
		t.Fatalf("heartbeats %+v, %d publications", beats, published)
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
