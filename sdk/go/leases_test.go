package tether

// sdk/vectors/leases.json: what an answer to a Lease request means, alike in the Python,
// TypeScript and Go SDKs (issue 21, defect 7: a 200 that is not a Lease was read as lost).

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"
)

type vectorAnswer struct {
	Method      string          `json:"method"`
	Status      int             `json:"status"`
	ContentType string          `json:"contentType"`
	Text        *string         `json:"text"`
	JSON        json.RawMessage `json:"json"`
	Landed      bool            `json:"landed"`
}

func (a vectorAnswer) body() []byte {
	if a.Text != nil {
		return []byte(*a.Text)
	}
	return a.JSON
}

type leaseVectors struct {
	Lease      json.RawMessage `json:"lease"`
	ParseLease []struct {
		vectorAnswer
		Name  string `json:"name"`
		Lease bool   `json:"lease"`
	} `json:"parseLease"`
	Renewals []struct {
		Name    string         `json:"name"`
		Answers []vectorAnswer `json:"answers"`
		Outcome string         `json:"outcome"`
		Then    string         `json:"then"`
	} `json:"renewals"`
}

func readLeaseVectors(t *testing.T) leaseVectors {
	t.Helper()
	raw, err := os.ReadFile("../vectors/leases.json")
	if err != nil {
		t.Fatal(err)
	}
	var v leaseVectors
	if err := json.Unmarshal(raw, &v); err != nil || len(v.ParseLease) == 0 || len(v.Renewals) == 0 {
		t.Fatalf("vectors: %v", err)
	}
	return v
}

func TestParseLeaseIsEverySDKs(t *testing.T) {
	for _, v := range readLeaseVectors(t).ParseLease {
		lease, err := parseLease(v.body())
		if got := err == nil && lease != nil; got != v.Lease {
			t.Errorf("%s: a Lease = %v (%v), want %v", v.Name, got, err, v.Lease)
		}
	}
}

// vectorAPI is the vectors' API server: their Lease, compare-and-swapped by resourceVersion; the
// script's answers replace its own, in order.
type vectorAPI struct {
	t       *testing.T
	mu      sync.Mutex
	lease   map[string]any
	script  []vectorAnswer
	methods []string
}

func (a *vectorAPI) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(req.Body)
	a.mu.Lock()
	defer a.mu.Unlock()
	a.methods = append(a.methods, req.Method)
	answer := vectorAnswer{Method: req.Method}
	if len(a.script) > 0 {
		answer, a.script = a.script[0], a.script[1:]
	}
	if answer.Method != req.Method {
		a.t.Errorf("the worker sent %s, the vector expects %s", req.Method, answer.Method)
	}
	if answer.Status == 0 || answer.Landed {
		code, own := a.serve(req.Method, body)
		if answer.Status == 0 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(code)
			_, _ = w.Write(own)
			return
		}
	}
	contentType := answer.ContentType
	if contentType == "" {
		contentType = "application/json"
	}
	w.Header().Set("Content-Type", contentType)
	w.WriteHeader(answer.Status)
	_, _ = w.Write(answer.body())
}

func (a *vectorAPI) serve(method string, body []byte) (int, []byte) {
	if method == http.MethodPut {
		var sent map[string]any
		if err := json.Unmarshal(body, &sent); err != nil {
			a.t.Errorf("PUT body: %v", err)
		}
		rv := a.lease["metadata"].(map[string]any)["resourceVersion"].(string)
		if sent["metadata"].(map[string]any)["resourceVersion"] != rv {
			return http.StatusConflict, []byte(`{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Conflict","code":409}`)
		}
		next, _ := strconv.Atoi(rv)
		sent["metadata"].(map[string]any)["resourceVersion"] = strconv.Itoa(next + 1)
		a.lease = sent
	}
	out, err := json.Marshal(a.lease)
	if err != nil {
		a.t.Fatal(err)
	}
	return http.StatusOK, out
}

func outcome(res renewResult, err error) string {
	switch {
	case err == nil && res.ok:
		return "confirmed"
	case err == nil && res.lost:
		return "lost"
	default:
		return "unconfirmed"
	}
}

func TestKubeRenewalAnswersMeanWhatTheyMeanToEverySDK(t *testing.T) {
	vectors := readLeaseVectors(t)
	for _, v := range vectors.Renewals {
		t.Run(v.Name, func(t *testing.T) {
			api := &vectorAPI{t: t, script: v.Answers}
			if err := json.Unmarshal(vectors.Lease, &api.lease); err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(api)
			t.Cleanup(srv.Close)
			kt := newTestKube(t, srv, "uid-1")
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			if got := outcome(kt.renew(ctx, nil, nil, nil)); got != v.Outcome {
				t.Errorf("outcome %s, want %s", got, v.Outcome)
			}
			api.mu.Lock()
			methods := api.methods
			api.mu.Unlock()
			want := make([]string, len(v.Answers))
			for i, a := range v.Answers {
				want[i] = a.Method
			}
			if !slices.Equal(methods, want) {
				t.Errorf("the worker sent %v, want %v", methods, want)
			}
			if v.Then != "" {
				if got := outcome(kt.renew(ctx, nil, nil, nil)); got != v.Then {
					t.Errorf("then %s, want %s", got, v.Then)
				}
			}
		})
	}
}

// TestFromEnvBehindAProxysPage: a proxy's page (an HTML 200) at the start leaves ownership
// unknown, not lost, and the next renewal confirms it.
func TestFromEnvBehindAProxysPage(t *testing.T) {
	api, srv := newFakeAPIServer(t, httptest.NewTLSServer)
	api.script("GET lease", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Success","code":200}`)
	})
	podEnv(t, srv, "t")
	r, err := FromEnv(context.Background(), WithLogger(discard))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Lost() || !r.OwnershipUnknown() {
		t.Fatalf("after a 200 that is not a Lease: %s", state(r))
	}
	if err := r.Checkpoint("3", true); err != nil || !r.Owned() {
		t.Fatalf("the next renewal: %v, %s", err, state(r))
	}
}
