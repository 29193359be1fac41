package tether

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
)

const (
	leasePath  = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/job"
	runsPath   = "/apis/tether.dev/v1alpha1/namespaces/ns/workerruns"
	runPath    = runsPath + "/job"
	statusPath = runPath + "/status"
)

type apiCall struct {
	method, path, contentType, auth string
	body                            []byte
}

// fakeAPI answers like the API server: a Lease with resourceVersion compare-and-swap, the
// WorkerRun, and Status bodies for refusals. A test scripts exceptions per route ("PUT lease",
// "GET lease", "PATCH status", "GET run", "POST runs": a spawn, "GET child": another run); they are
// used once each, in order.
type fakeAPI struct {
	t     *testing.T
	mu    sync.Mutex
	lease *coordinationv1.Lease
	// future holds Lease fields of a newer API server, which the Lease type does not know, per
	// section ("metadata", "spec"): served with the Lease, and kept only as long as a PUT sends them.
	future  map[string]map[string]json.RawMessage
	rv      int
	run     string
	answers map[string][]http.HandlerFunc
	calls   []apiCall
	token   string // when set, any other bearer token is answered 401
}

func newFakeAPI(t *testing.T) (*fakeAPI, *httptest.Server) {
	return newFakeAPIServer(t, httptest.NewServer)
}

// newFakeAPIServer serves the fake API with TLS or without (clientcmd sends credentials only
// over TLS).
func newFakeAPIServer(t *testing.T, serve func(http.Handler) *httptest.Server) (*fakeAPI, *httptest.Server) {
	api := &fakeAPI{t: t, lease: lease("job-a1", 1, "uid-1"), rv: 7, answers: map[string][]http.HandlerFunc{},
		run: `{"metadata":{"uid":"uid-1"},"spec":{"payload":{"steps":4}},"status":{"holder":"job-a1","fence":1}}`}
	srv := serve(api)
	t.Cleanup(srv.Close)
	return api, srv
}

func (a *fakeAPI) script(route string, answers ...http.HandlerFunc) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.answers[route] = append(a.answers[route], answers...)
}

func (a *fakeAPI) callsTo(method, path string) []apiCall {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []apiCall
	for _, c := range a.calls {
		if c.method == method && c.path == path {
			out = append(out, c)
		}
	}
	return out
}

func (a *fakeAPI) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(req.Body)
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls = append(a.calls, apiCall{req.Method, req.URL.Path, req.Header.Get("Content-Type"),
		req.Header.Get("Authorization"), body})
	if a.token != "" && req.Header.Get("Authorization") != "Bearer "+a.token {
		status(http.StatusUnauthorized, metav1.StatusReasonUnauthorized, "Unauthorized")(w, req)
		return
	}
	route := map[string]string{leasePath: "lease", statusPath: "status", runPath: "run", runsPath: "runs"}[req.URL.Path]
	if route == "" && strings.HasPrefix(req.URL.Path, runsPath+"/") {
		route = "child"
	}
	key := req.Method + " " + route
	if scripted := a.answers[key]; len(scripted) > 0 {
		a.answers[key] = scripted[1:]
		scripted[0](w, req)
		return
	}
	switch key {
	case "GET lease":
		if a.lease == nil {
			status(http.StatusNotFound, metav1.StatusReasonNotFound, `leases.coordination.k8s.io "job" not found`)(w, req)
			return
		}
		a.lease.ResourceVersion = strconv.Itoa(a.rv)
		a.writeLease(w)
	case "PUT lease":
		var sent coordinationv1.Lease
		if err := json.Unmarshal(body, &sent); err != nil {
			a.t.Errorf("PUT body: %v", err)
		}
		if a.lease == nil {
			status(http.StatusNotFound, metav1.StatusReasonNotFound, "not found")(w, req)
			return
		}
		if sent.ResourceVersion != strconv.Itoa(a.rv) {
			status(http.StatusConflict, metav1.StatusReasonConflict, "the object has been modified")(w, req)
			return
		}
		a.rv++
		sent.ResourceVersion = strconv.Itoa(a.rv)
		a.lease = &sent
		a.future = unknownFields(a.t, body, &sent) // the object stored is the one sent, whole
		a.writeLease(w)
	case "PATCH status", "GET run":
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, a.run)
	case "POST runs": // created as sent
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(body)
	default:
		status(http.StatusNotFound, metav1.StatusReasonNotFound, "no route "+key)(w, req)
	}
}

// writeLease answers with the Lease, the fields of a newer API server included.
func (a *fakeAPI) writeLease(w http.ResponseWriter) {
	doc := sections(a.t, mustJSON(a.t, a.lease))
	for section, fields := range a.future {
		for k, v := range fields {
			doc[section][k] = v
		}
	}
	top := map[string]json.RawMessage{}
	if err := json.Unmarshal(mustJSON(a.t, a.lease), &top); err != nil {
		a.t.Fatal(err)
	}
	for section, fields := range doc {
		top[section] = mustJSON(a.t, fields)
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(mustJSON(a.t, top))
}

// sections splits a Lease's JSON into its metadata and spec members.
func sections(t *testing.T, raw []byte) map[string]map[string]json.RawMessage {
	var doc struct {
		Metadata map[string]json.RawMessage `json:"metadata"`
		Spec     map[string]json.RawMessage `json:"spec"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Errorf("a Lease: %v", err)
	}
	out := map[string]map[string]json.RawMessage{"metadata": doc.Metadata, "spec": doc.Spec}
	for k, v := range out {
		if v == nil {
			out[k] = map[string]json.RawMessage{}
		}
	}
	return out
}

// unknownFields are the members of a Lease's JSON that its Lease type does not keep.
func unknownFields(t *testing.T, raw []byte, typed *coordinationv1.Lease) map[string]map[string]json.RawMessage {
	known := sections(t, mustJSON(t, typed))
	out := map[string]map[string]json.RawMessage{}
	for section, fields := range sections(t, raw) {
		out[section] = map[string]json.RawMessage{}
		for k, v := range fields {
			if _, ok := known[section][k]; !ok {
				out[section][k] = v
			}
		}
	}
	return out
}

func mustJSON(t *testing.T, v any) []byte {
	raw, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

// status answers with a metav1.Status, as the API server does.
func status(code int, reason metav1.StatusReason, message string, causes ...metav1.StatusCause) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		st := metav1.Status{TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"}, Status: metav1.StatusFailure,
			Code: int32(code), Reason: reason, Message: message}
		if len(causes) > 0 {
			st.Details = &metav1.StatusDetails{Name: "job", Causes: causes}
		}
		writeJSON(w, code, st)
	}
}

func withRetryAfter(seconds string, h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set("Retry-After", seconds)
		h(w, req)
	}
}

func newTestKube(t *testing.T, srv *httptest.Server, runUID string) *kubeTransport {
	t.Helper()
	info := attemptInfo{name: "job", namespace: "ns", holder: "job-a1", fence: 1}
	kt, err := newKubeTransport(tune(&rest.Config{Host: srv.URL}), info, runUID)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kt.close)
	return kt
}

func ctx2s(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestKubeRenewal(t *testing.T) {
	api, srv := newFakeAPI(t)
	api.lease.Annotations = map[string]string{annSignals: `{"capCents":500,"baseCents":20}`}
	kt := newTestKube(t, srv, "uid-1")
	res, err := kt.renew(ctx2s(t), ptr("3"), &usage{Cents: 6, Tokens: 1}, nil)
	if err != nil || !res.ok || res.signals == nil || deref(res.signals.CapCents) != int64(500) || res.signals.BaseCents != 20 {
		t.Fatalf("renewal: %+v, %v", res, err)
	}
	puts := api.callsTo(http.MethodPut, leasePath)
	var sent coordinationv1.Lease
	if err := json.Unmarshal(puts[0].body, &sent); err != nil {
		t.Fatal(err)
	}
	if sent.ResourceVersion != "7" || sent.Annotations[annCheckpoint] != "3" ||
		sent.Annotations[annUsage] != `{"cents":6,"tokens":1}` || sent.Spec.RenewTime == nil {
		t.Fatalf("PUT body: %s", puts[0].body)
	}
	var raw struct {
		Spec struct {
			RenewTime string `json:"renewTime"`
		} `json:"spec"`
	}
	_ = json.Unmarshal(puts[0].body, &raw)
	if _, err := time.Parse("2006-01-02T15:04:05.000000Z", raw.Spec.RenewTime); err != nil {
		t.Fatalf("renewTime %q is not RFC 3339 UTC microseconds", raw.Spec.RenewTime)
	}
	// The next renewal writes the object the PUT returned: no second read.
	if res, err := kt.renew(ctx2s(t), nil, nil, nil); err != nil || !res.ok {
		t.Fatalf("second renewal: %+v, %v", res, err)
	}
	if gets := api.callsTo(http.MethodGet, leasePath); len(gets) != 1 {
		t.Fatalf("%d GETs of the Lease, want 1", len(gets))
	}
}

func TestKubeRenewalCarriesTheRequests(t *testing.T) {
	api, srv := newFakeAPI(t)
	api.lease.Annotations = map[string]string{annSignals: `{"decisions":{"ship":{"decision":"TimedOut"}}}`}
	kt := newTestKube(t, srv, "uid-1")
	if res, err := kt.renew(ctx2s(t), nil, nil, nil); err != nil || !res.ok ||
		res.signals.Decisions["ship"] != (ApprovalDecision{Decision: "TimedOut"}) {
		t.Fatalf("renewal: %+v, %v", res, err)
	}
	requests := []approvalRequest{{Name: "ship"}, {Name: "refund", Details: "42 €", TimeoutSeconds: ptr(600)}}
	if res, err := kt.renew(ctx2s(t), nil, nil, requests); err != nil || !res.ok {
		t.Fatalf("renewal: %+v, %v", res, err)
	}
	puts := api.callsTo(http.MethodPut, leasePath)
	var first, second coordinationv1.Lease
	if json.Unmarshal(puts[0].body, &first) != nil || json.Unmarshal(puts[1].body, &second) != nil {
		t.Fatal("PUT bodies are not Leases")
	}
	if _, ok := first.Annotations[annRequests]; ok {
		t.Errorf("a renewal without requests wrote %q", first.Annotations[annRequests])
	}
	if got := second.Annotations[annRequests]; got != `{"refund":{"details":"42 €","timeoutSeconds":600},"ship":{"details":""}}` {
		t.Errorf("requests annotation %s", got)
	}
}

func TestKubeRenewalKeepsFieldsItDoesNotKnow(t *testing.T) {
	api, srv := newFakeAPI(t)
	api.future = map[string]map[string]json.RawMessage{
		"metadata": {"futureMeta": json.RawMessage(`{"a":12345678901234567890}`)},
		"spec":     {"futureField": json.RawMessage(`"kept"`), "futureList": json.RawMessage(`[1.50,{"b":null}]`)},
	}
	kt := newTestKube(t, srv, "uid-1")
	for i := 0; i < 2; i++ { // the first PUT sends the Lease as read, the second as the first PUT returned it
		if res, err := kt.renew(ctx2s(t), ptr("3"), nil, nil); err != nil || !res.ok {
			t.Fatalf("renewal %d: %+v, %v", i, res, err)
		}
	}
	for i, put := range api.callsTo(http.MethodPut, leasePath) {
		if put.contentType != "application/json" {
			t.Errorf("PUT %d as %q", i, put.contentType)
		}
		got := sections(t, put.body)
		if string(got["metadata"]["futureMeta"]) != `{"a":12345678901234567890}` ||
			string(got["spec"]["futureField"]) != `"kept"` || string(got["spec"]["futureList"]) != `[1.50,{"b":null}]` {
			t.Errorf("PUT %d dropped or changed a field the SDK does not know: %s", i, put.body)
		}
	}
	if len(api.future["spec"]) != 2 || len(api.future["metadata"]) != 1 {
		t.Errorf("the Lease stored lost fields: %v", api.future)
	}
}

func TestKubeRenewalAnswers(t *testing.T) {
	policy := "ValidatingAdmissionPolicy 'tether-worker-lease-fencing' with binding 'tether-worker-lease-fencing' " +
		"denied request: pod job-a1 does not hold Lease job"
	for _, tc := range []struct {
		name    string
		setup   func(*fakeAPI)
		ok      bool
		lost    bool
		noReply bool
		puts    int
	}{
		{"conflict, still ours: retried once", func(a *fakeAPI) {
			a.script("PUT lease", status(409, metav1.StatusReasonConflict, "modified"))
		}, true, false, false, 2},
		{"conflict twice: unconfirmed", func(a *fakeAPI) {
			a.script("PUT lease", status(409, metav1.StatusReasonConflict, "modified"),
				status(409, metav1.StatusReasonConflict, "modified"))
		}, false, false, false, 2},
		{"conflict, still ours; the retry conflicts and the re-read shows another holder: lost", func(a *fakeAPI) {
			a.script("PUT lease", status(409, metav1.StatusReasonConflict, "modified"),
				func(w http.ResponseWriter, req *http.Request) {
					a.lease.Spec.HolderIdentity = ptr("job-a2")
					status(409, metav1.StatusReasonConflict, "modified")(w, req)
				})
		}, false, true, false, 2},
		{"conflict, then another holder: lost", func(a *fakeAPI) {
			a.script("PUT lease", func(w http.ResponseWriter, req *http.Request) {
				a.lease.Spec.HolderIdentity = ptr("job-a2")
				status(409, metav1.StatusReasonConflict, "modified")(w, req)
			})
		}, false, true, false, 1},
		{"another holder: lost, nothing written", func(a *fakeAPI) { a.lease.Spec.LeaseTransitions = ptr[int32](2) }, false, true, false, 0},
		{"a namesake's Lease: lost", func(a *fakeAPI) { a.lease.OwnerReferences[1].UID = "uid-2" }, false, true, false, 0},
		{"no Lease: lost", func(a *fakeAPI) { a.lease = nil }, false, true, false, 0},
		{"404 on the write: lost", func(a *fakeAPI) {
			a.script("PUT lease", status(404, metav1.StatusReasonNotFound, "gone"))
		}, false, true, false, 1},
		{"the fencing policy's 403: lost", func(a *fakeAPI) {
			a.script("PUT lease", status(403, metav1.StatusReasonForbidden, policy))
		}, false, true, false, 1},
		{"RBAC's 403: unconfirmed", func(a *fakeAPI) {
			a.script("PUT lease", status(403, metav1.StatusReasonForbidden,
				`leases.coordination.k8s.io "job" is forbidden: User "x" cannot update resource "leases"`))
		}, false, false, false, 1},
		{"401: unconfirmed", func(a *fakeAPI) {
			a.script("PUT lease", status(401, metav1.StatusReasonUnauthorized, "Unauthorized"))
		}, false, false, false, 1},
		{"500: unconfirmed", func(a *fakeAPI) {
			a.script("PUT lease", status(500, metav1.StatusReasonInternalError, "etcd down"))
		}, false, false, false, 1},
		{"a proxy's HTML page: no answer", func(a *fakeAPI) {
			a.script("PUT lease", func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Content-Type", "text/html")
				_, _ = io.WriteString(w, "<html>hello</html>")
			})
		}, false, false, true, 1},
		{"the GET fails: no answer", func(a *fakeAPI) {
			a.script("GET lease", status(503, metav1.StatusReasonServiceUnavailable, "unavailable"))
		}, false, false, true, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			api, srv := newFakeAPI(t)
			tc.setup(api)
			kt := newTestKube(t, srv, "uid-1")
			res, err := kt.renew(ctx2s(t), nil, nil, nil)
			if (err != nil) != tc.noReply || res.ok != tc.ok || res.lost != tc.lost {
				t.Fatalf("renew = %+v, %v", res, err)
			}
			if puts := len(api.callsTo(http.MethodPut, leasePath)); puts != tc.puts {
				t.Fatalf("%d PUTs, want %d", puts, tc.puts)
			}
		})
	}
}

// TestKubeRenewalRereadsAfterTheRetrysConflict: a retry refused with 409 is followed by a read of
// the Lease, whichever way it decides (docs/protocol.md §5.2).
func TestKubeRenewalRereadsAfterTheRetrysConflict(t *testing.T) {
	api, srv := newFakeAPI(t)
	api.script("PUT lease", status(409, metav1.StatusReasonConflict, "modified"),
		status(409, metav1.StatusReasonConflict, "modified"))
	kt := newTestKube(t, srv, "uid-1")
	res, err := kt.renew(ctx2s(t), nil, nil, nil)
	if err != nil || res.ok || res.lost {
		t.Fatalf("renew = %+v, %v; want unconfirmed, not lost", res, err)
	}
	var methods []string
	api.mu.Lock()
	for _, c := range api.calls {
		methods = append(methods, c.method)
	}
	api.mu.Unlock()
	if got := strings.Join(methods, " "); got != "GET PUT GET PUT GET" {
		t.Fatalf("calls %s, want GET PUT GET PUT GET", got)
	}
}

func TestKubeRenewalNoAnswer(t *testing.T) {
	api, srv := newFakeAPI(t)
	release := make(chan struct{})
	api.script("GET lease", func(http.ResponseWriter, *http.Request) { <-release })
	defer close(release)
	kt := newTestKube(t, srv, "")
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := kt.renew(ctx, nil, nil, nil); err == nil {
		t.Fatal("a request without an answer was taken for one")
	}
}

func TestKubePublish(t *testing.T) {
	badValue := metav1.StatusCause{Type: metav1.CauseTypeFieldValueInvalid, Field: "status.result",
		Message: `Invalid value: "array": result in body must be of type object`}
	policy := "ValidatingAdmissionPolicy 'tether-worker-status-fencing' with binding 'tether-worker-status-fencing' denied request"
	otherField := metav1.StatusCause{Type: metav1.CauseTypeFieldValueInvalid, Field: "metadata.annotations",
		Message: "Invalid value"}
	for _, tc := range []struct {
		name       string
		answer     http.HandlerFunc
		outcome    publishOutcome
		retryAfter time.Duration
	}{
		{"200", nil, published, 0},
		{"422 with causes: the value", status(422, metav1.StatusReasonInvalid, "WorkerRun is invalid", badValue), invalid, 0},
		{"422 without causes: a test failed", status(422, metav1.StatusReasonInvalid,
			"the server rejected our request due to an error in our request"), refused, 0},
		{"422 whose causes name another field", status(422, metav1.StatusReasonInvalid, "WorkerRun is invalid",
			otherField), refused, 0},
		{"413: too large", status(413, metav1.StatusReasonRequestEntityTooLarge,
			"Request entity too large: limit is 3145728"), invalid, 0},
		{"422 not from the API server", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "text/plain")
			w.WriteHeader(422)
			_, _ = io.WriteString(w, "no")
		}, refused, 0},
		{"404", status(404, metav1.StatusReasonNotFound, "gone"), refused, 0},
		{"409", status(409, metav1.StatusReasonConflict, "conflict"), refused, 0},
		{"the fencing policy's 403", status(403, metav1.StatusReasonForbidden, policy), refused, 0},
		{"RBAC's 403", status(403, metav1.StatusReasonForbidden, "forbidden"), retry, 0},
		{"400", status(400, metav1.StatusReasonBadRequest, "bad request"), retry, 0},
		{"401", status(401, metav1.StatusReasonUnauthorized, "Unauthorized"), retry, 0},
		{"429 with Retry-After", withRetryAfter("3", func(w http.ResponseWriter, _ *http.Request) {
			st := metav1.Status{TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"}, Status: metav1.StatusFailure,
				Code: 429, Reason: metav1.StatusReasonTooManyRequests, Message: "slow down",
				Details: &metav1.StatusDetails{RetryAfterSeconds: 3}}
			writeJSON(w, 429, st)
		}), retry, 3 * time.Second},
		{"503 from a proxy with Retry-After", withRetryAfter("2", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "text/plain")
			w.WriteHeader(503)
			_, _ = io.WriteString(w, "upstream unavailable")
		}), retry, 2 * time.Second},
		// The header, not the Status body (which names no delay), and in decimal seconds.
		{"503 Status with Retry-After 1.5", withRetryAfter("1.5", status(503, metav1.StatusReasonServiceUnavailable,
			"etcd leader changed")), retry, 1500 * time.Millisecond},
		{"429 Status with Retry-After 0.5", withRetryAfter("0.5", status(429, metav1.StatusReasonTooManyRequests,
			"slow down")), retry, 500 * time.Millisecond},
		{"500", status(500, metav1.StatusReasonInternalError, "boom"), retry, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			api, srv := newFakeAPI(t)
			if tc.answer != nil {
				api.script("PATCH status", tc.answer)
			}
			kt := newTestKube(t, srv, "uid-1")
			res, err := kt.publish(ctx2s(t), "result", json.RawMessage(`{"steps":3}`))
			if err != nil || res.outcome != tc.outcome || res.retryAfter != tc.retryAfter {
				t.Fatalf("publish = %+v, %v", res, err)
			}
			if tc.outcome == invalid && res.status == 422 && (len(res.causes) != 1 || res.causes[0].Field != "status.result") {
				t.Fatalf("causes %+v", res.causes)
			}
			patches := api.callsTo(http.MethodPatch, statusPath)
			if len(patches) != 1 {
				t.Fatalf("%d patches: client-go retried on its own", len(patches))
			}
			want := `[{"op":"test","path":"/metadata/uid","value":"uid-1"},{"op":"test","path":"/status/fence","value":1},` +
				`{"op":"test","path":"/status/holder","value":"job-a1"},{"op":"add","path":"/status/result","value":{"steps":3}}]`
			if string(patches[0].body) != want || patches[0].contentType != "application/json-patch+json" {
				t.Fatalf("patch %s (%s)", patches[0].body, patches[0].contentType)
			}
		})
	}
}

// podParent is the run job as its children name it (TestKubeParent).
var podParent = parentRun{name: "job", uid: "uid-1", className: "agents", depth: 1, budgetRef: "team", cappedCents: true}

func TestKubeParent(t *testing.T) {
	api, srv := newFakeAPI(t)
	api.run = `{"metadata":{"name":"job","uid":"uid-1"},"spec":{"budget":{"capCents":50},"parentRef":{"depth":1}},` +
		`"status":{"class":{"name":"agents","defaults":{"budget":{"budgetRef":{"name":"team"}}}}}}`
	if p, err := newTestKube(t, srv, "uid-1").parent(ctx2s(t)); err != nil || p != podParent {
		t.Fatalf("parent %+v, %v", p, err)
	}
	// A namesake created since this pod started, or no run at all: this attempt holds nothing.
	if _, err := newTestKube(t, srv, "uid-0").parent(ctx2s(t)); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("a namesake's: %v", err)
	}
	api.script("GET run", status(http.StatusNotFound, metav1.StatusReasonNotFound, "not found"))
	if _, err := newTestKube(t, srv, "uid-1").parent(ctx2s(t)); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("gone: %v", err)
	}
}

func TestKubeSpawn(t *testing.T) {
	spec := map[string]any{"executor": "Pod", "className": "tools", "budget": map[string]any{"capCents": json.Number("5")}}
	req := spawnRequest{parent: podParent, key: "tool:1", spec: spec}
	name := childName("job", "uid-1", "tool:1", 0)
	childPath := runsPath + "/" + name
	existing := fmt.Sprintf(`{"metadata":{"name":%q},"status":{"phase":"Running"}}`, name)
	api, srv := newFakeAPI(t)
	kt := newTestKube(t, srv, "uid-1")

	got, err := kt.spawn(ctx2s(t), req)
	posts := api.callsTo(http.MethodPost, runsPath)
	if err != nil || got.Metadata.Name != name || len(posts) != 1 ||
		!jsonEqual(posts[0].body, mustJSON(t, childBody(podParent, "ns", "job-a1", 1, "tool:1", 0, spec))) {
		t.Fatalf("spawn: %+v, %v, posts %+v", got, err, posts)
	}

	// Made before: the run of that name, whoever's it is (the Run judges).
	api.script("POST runs", status(http.StatusConflict, metav1.StatusReasonAlreadyExists, "exists"))
	api.script("GET child", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, 200, json.RawMessage(existing)) })
	if got, err := kt.spawn(ctx2s(t), req); err != nil || got.Status.Phase != "Running" || len(api.callsTo("GET", childPath)) != 1 {
		t.Fatalf("spawn of an existing child: %+v, %v", got, err)
	}

	// Deleted between the conflict and the read: created again.
	before := len(api.callsTo(http.MethodPost, runsPath))
	api.script("POST runs", status(http.StatusConflict, metav1.StatusReasonAlreadyExists, "exists"))
	if got, err := kt.spawn(ctx2s(t), req); err != nil || got.Metadata.Name != name ||
		len(api.callsTo(http.MethodPost, runsPath)) != before+2 {
		t.Fatalf("spawn of a child deleted meanwhile: %+v, %v", got, err)
	}
	conflict := status(http.StatusConflict, metav1.StatusReasonAlreadyExists, "exists")
	api.script("POST runs", conflict, conflict, conflict)
	if _, err := kt.spawn(ctx2s(t), req); !errors.Is(err, ErrSpawnRefused) || !strings.Contains(err.Error(), "kept being deleted") {
		t.Fatalf("spawn of a child always deleted: %v", err)
	}

	for code, refusal := range map[int]string{
		http.StatusForbidden:           "ValidatingAdmissionPolicy 'tether-child-classes' denied request: class shell is not one planners may spawn",
		http.StatusUnprocessableEntity: `WorkerRun.tether.dev "x" is invalid: spec.budget.capCents: Invalid value: -1`,
		http.StatusBadRequest:          "the body is not a WorkerRun",
	} {
		api.script("POST runs", status(code, metav1.StatusReasonForbidden, refusal))
		if _, err := kt.spawn(ctx2s(t), req); !errors.Is(err, ErrSpawnRefused) || !strings.Contains(err.Error(), refusal) {
			t.Fatalf("%d: %v", code, err)
		}
	}
	api.script("POST runs", status(http.StatusServiceUnavailable, metav1.StatusReasonServiceUnavailable, "busy"))
	if _, err := kt.spawn(ctx2s(t), req); err == nil || errors.Is(err, ErrSpawnRefused) || errors.Is(err, ErrLeaseLost) {
		t.Fatalf("503: %v", err)
	}
}

func TestKubeChild(t *testing.T) {
	api, srv := newFakeAPI(t)
	kt := newTestKube(t, srv, "uid-1")
	api.script("GET child",
		func(w http.ResponseWriter, _ *http.Request) {
			writeJSON(w, 200, json.RawMessage(`{"metadata":{"name":"job-1"},"status":{"phase":"Succeeded","result":{"n":1}}}`))
		},
		func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, 200, json.RawMessage(`{"kind":"Status"}`)) })
	if got, err := kt.child(ctx2s(t), "job-1"); err != nil || got.Status.Phase != "Succeeded" || got.Status.Result["n"] != 1.0 {
		t.Fatalf("child %+v, %v", got, err)
	}
	if got, err := kt.child(ctx2s(t), "job-1"); err == nil {
		t.Fatalf("an answer that is not a run: %+v", got)
	}
	if got, err := kt.child(ctx2s(t), "job-1"); got != nil || err != nil { // the fake's 404
		t.Fatalf("a deleted child: %+v, %v", got, err)
	}
}

func TestKubeRecorded(t *testing.T) {
	api, srv := newFakeAPI(t)
	kt := newTestKube(t, srv, "uid-1")
	api.run = `{"metadata":{"uid":"uid-1"},"status":{"fence":2,"result":{"steps":3},` +
		`"attempts":[{"holder":"job-a1","fence":1,"outcome":"Succeeded"}]}}`
	if ok, err := kt.recorded(ctx2s(t), "result", json.RawMessage(`{"steps":3}`)); err != nil || !ok {
		t.Fatalf("recorded = %v, %v", ok, err)
	}
	api.run = strings.Replace(api.run, "uid-1", "uid-2", 1) // a namesake
	if ok, err := kt.recorded(ctx2s(t), "result", json.RawMessage(`{"steps":3}`)); err != nil || ok {
		t.Fatalf("a namesake's record: %v, %v", ok, err)
	}
	api.script("GET run", status(404, metav1.StatusReasonNotFound, "gone"))
	if ok, err := kt.recorded(ctx2s(t), "result", json.RawMessage(`{"steps":3}`)); err != nil || ok {
		t.Fatalf("a deleted run: %v, %v", ok, err)
	}
	api.script("GET run", status(503, metav1.StatusReasonServiceUnavailable, "down"))
	if _, err := kt.recorded(ctx2s(t), "result", json.RawMessage(`{"steps":3}`)); err == nil {
		t.Fatal("a 503 was taken for an answer")
	}
}

// podEnv sets the environment the operator and the kubelet give a worker pod, with a kubeconfig
// whose user reads its token from a file. srv serves TLS.
func podEnv(t *testing.T, srv *httptest.Server, token string) string {
	t.Helper()
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(token), 0o600); err != nil {
		t.Fatal(err)
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	doc := fmt.Sprintf(`apiVersion: v1
kind: Config
current-context: pod
clusters: [{name: pod, cluster: {server: %q, certificate-authority: %q}}]
users: [{name: pod, user: {tokenFile: %q}}]
contexts: [{name: pod, context: {cluster: pod, user: pod, namespace: ns}}]
`, srv.URL, ca, tokenFile)
	if err := os.WriteFile(kubeconfig, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{
		"KUBECONFIG": kubeconfig, "KUBERNETES_SERVICE_HOST": "127.0.0.1", envRun: "job", envNamespace: "ns",
		envRunUID: "uid-1", envHolder: "job-a1", envFence: "1", envAttempt: "1", envLeaseDuration: "10",
		envRenewInterval: "3600", envPayload: `{"steps":4}`, envCheckpoint: "2", envIdempotencyKey: "invoice:8f1b",
		envReviewFeedback: "round the totals",
	} {
		t.Setenv(k, v)
	}
	return tokenFile
}

func TestFromEnvWithATokenFile(t *testing.T) {
	api, srv := newFakeAPIServer(t, httptest.NewTLSServer)
	api.token = "token-1"
	tokenFile := podEnv(t, srv, "token-1")
	r, err := FromEnv(context.Background(), WithLogger(discard))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if !r.Owned() || r.Name() != "job" || r.Holder() != "job-a1" || r.Fence() != 1 || r.Attempt() != 1 ||
		string(r.Payload()) != `{"steps":4}` || r.CheckpointCursor() != "2" || r.IdempotencyKey() != "invoice:8f1b" ||
		r.LeaseDuration() != 10*time.Second || r.ReviewFeedback() != "round the totals" {
		t.Fatalf("run from the environment: %s %+v", state(r), r.info)
	}
	// The kubelet rotates the token: the old one is refused (401, unconfirmed), and the next
	// request reads the file again.
	if err := os.WriteFile(tokenFile, []byte("token-2"), 0o600); err != nil {
		t.Fatal(err)
	}
	api.mu.Lock()
	api.token = "token-2"
	api.mu.Unlock()
	if err := r.Checkpoint("3", true); err == nil || r.Lost() {
		t.Fatalf("a renewal with the old token: %v, lost %v", err, r.Lost())
	}
	if err := r.Checkpoint("3", true); err != nil {
		t.Fatalf("the token file was not read again: %v", err)
	}
}

func TestFromEnvPayloadFromTheRun(t *testing.T) {
	_, srv := newFakeAPIServer(t, httptest.NewTLSServer)
	podEnv(t, srv, "t")
	_ = os.Unsetenv(envPayload)
	t.Setenv(envPayloadFrom, "spec.payload")
	r, err := FromEnv(context.Background(), WithLogger(discard))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if string(r.Payload()) != `{"steps":4}` {
		t.Fatalf("payload %s", r.Payload())
	}
}

func TestFromEnvPayloadOfANamesake(t *testing.T) {
	api, srv := newFakeAPIServer(t, httptest.NewTLSServer)
	api.run = `{"metadata":{"uid":"uid-2"},"spec":{"payload":{"steps":4}}}`
	podEnv(t, srv, "t")
	_ = os.Unsetenv(envPayload)
	t.Setenv(envPayloadFrom, "spec.payload")
	if _, err := FromEnv(context.Background(), WithLogger(discard)); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("a re-created run's payload: %v", err)
	}
}

func TestFromEnvOutsideAPod(t *testing.T) {
	t.Setenv(envRun, "")
	if _, err := FromEnv(context.Background()); err == nil || !strings.Contains(err.Error(), envRun) {
		t.Fatalf("%v", err)
	}
}
