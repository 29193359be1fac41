package tether

// sdk/vectors/gateway-replies.json: what a gateway answer means, alike in the Python, TypeScript
// and Go SDKs (a 200 that is not the gateway's reply for this attempt, such as a proxy's `{}`,
// confirmed ownership).

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"
)

type gatewayVector struct {
	Name        string          `json:"name"`
	Status      int             `json:"status"`
	ContentType string          `json:"contentType"`
	Text        *string         `json:"text"`
	JSON        json.RawMessage `json:"json"`
}

func (v gatewayVector) body() []byte {
	if v.Text != nil {
		return []byte(*v.Text)
	}
	return v.JSON
}

// serve answers every request with the vector.
func (v gatewayVector) serve(t *testing.T) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.Copy(io.Discard, req.Body)
		contentType, status := v.ContentType, v.Status
		if contentType == "" {
			contentType = "application/json"
		}
		if status == 0 {
			status = http.StatusOK
		}
		w.Header().Set("Content-Type", contentType)
		w.WriteHeader(status)
		_, _ = w.Write(v.body())
	}))
	t.Cleanup(srv.Close)
	return srv
}

type gatewayVectors struct {
	Worker struct {
		Namespace, Name, Holder, RunUID, WorkerID string
		Fence                                     int64
	} `json:"worker"`
	Heartbeats []struct {
		gatewayVector
		Outcome string `json:"outcome"`
	} `json:"heartbeats"`
	Claims []struct {
		gatewayVector
		Claim bool `json:"claim"`
	} `json:"claims"`
}

func readGatewayVectors(t *testing.T) gatewayVectors {
	t.Helper()
	raw, err := os.ReadFile("../vectors/gateway-replies.json")
	if err != nil {
		t.Fatal(err)
	}
	var v gatewayVectors
	// The worker's keys are camelCase in the file; encoding/json matches them case-insensitively.
	if err := json.Unmarshal(raw, &v); err != nil || len(v.Heartbeats) == 0 || len(v.Claims) == 0 || v.Worker.RunUID == "" {
		t.Fatalf("vectors: %v", err)
	}
	return v
}

func TestGatewayHeartbeatRepliesAreEverySDKs(t *testing.T) {
	vectors := readGatewayVectors(t)
	w := vectors.Worker
	for _, v := range vectors.Heartbeats {
		t.Run(v.Name, func(t *testing.T) {
			srv := v.serve(t)
			g := &gatewayTransport{client: srv.Client(), token: "tok", clock: time.Now,
				base:   srv.URL + "/api/v1/namespaces/" + w.Namespace + "/workerruns/" + w.Name,
				holder: w.Holder, fence: w.Fence, runUID: w.RunUID, workerID: w.WorkerID}
			res, err := g.renew(context.Background(), nil, nil, nil)
			outcome := "unconfirmed" // an error is an answer that says nothing, like none
			switch {
			case err == nil && res.ok:
				outcome = "confirmed"
			case err == nil && res.lost:
				outcome = "lost"
			}
			if outcome != v.Outcome {
				t.Fatalf("%s (%+v, %v), want %s", outcome, res, err, v.Outcome)
			}
			// An answer that is not the reply hands out no credential either.
			var sent struct{ ToolClaim *ToolClaim }
			if res.ok {
				_ = json.Unmarshal(v.body(), &sent)
			}
			if (g.toolClaim() != nil) != (sent.ToolClaim != nil) {
				t.Fatalf("tool claim %+v after a %s renewal", g.toolClaim(), outcome)
			}
		})
	}
}

func TestGatewayClaimRepliesAreEverySDKs(t *testing.T) {
	for _, v := range readGatewayVectors(t).Claims {
		t.Run(v.Name, func(t *testing.T) {
			// Every answer is the vector's: a claim reply is a heartbeat reply of its own attempt too.
			srv := v.serve(t)
			r, err := Claim(context.Background(), srv.URL, "ns", "job", "tok", WithLogger(discard))
			if !v.Claim {
				if err == nil || errors.Is(err, ErrClaimRefused) || !strings.Contains(err.Error(), "not the gateway's claim reply") {
					t.Fatalf("claim: %v, want an answer that is not the gateway's claim reply (not refused)", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = r.Close() }()
			var doc struct {
				Holder         string
				Fence, Attempt int64
				IdempotencyKey string
			}
			_ = json.Unmarshal(v.JSON, &doc)
			if r.Holder() != doc.Holder || r.Fence() != doc.Fence || int64(r.Attempt()) != doc.Attempt ||
				r.IdempotencyKey() != doc.IdempotencyKey || !r.Owned() {
				t.Fatalf("claimed %+v, owned %v", r.info, r.Owned())
			}
		})
	}
}
