package tether

// sdk/vectors/publications.json: what the answer to a publication means, alike in the Python,
// TypeScript and Go SDKs (a 500 with etcd's "request is too large" was retried as a 5xx).

import (
	"context"
	"encoding/json"
	"os"
	"testing"
	"time"

	"k8s.io/client-go/rest"
)

type publicationVectors struct {
	Worker struct {
		Namespace, Name, Holder, RunUID, WorkerID string
		Fence                                     int64
	} `json:"worker"`
	Result  json.RawMessage `json:"result"`
	Pod     []publicationVector
	Gateway []publicationVector
}

type publicationVector struct {
	gatewayVector
	Outcome string `json:"outcome"`
}

func readPublicationVectors(t *testing.T) publicationVectors {
	t.Helper()
	raw, err := os.ReadFile("../vectors/publications.json")
	if err != nil {
		t.Fatal(err)
	}
	var v publicationVectors
	if err := json.Unmarshal(raw, &v); err != nil {
		t.Fatalf("vectors: %v", err)
	}
	return v
}

// outcomeName is the vectors' name for what one publication did.
func outcomeName(res publishResult, err error) string {
	if err != nil {
		return "retry" // no answer the Run could read: retried like one that says nothing
	}
	return map[publishOutcome]string{published: "published", refused: "lost", invalid: "bad result", retry: "retry"}[res.outcome]
}

func TestPodPublicationAnswersAreEverySDKs(t *testing.T) {
	vectors := readPublicationVectors(t)
	w := vectors.Worker
	for _, v := range vectors.Pod {
		t.Run(v.Name, func(t *testing.T) {
			srv := v.serve(t)
			info := attemptInfo{name: w.Name, namespace: w.Namespace, holder: w.Holder, fence: w.Fence}
			kt, err := newKubeTransport(tune(&rest.Config{Host: srv.URL}), info, w.RunUID)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(kt.close)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			res, err := kt.publish(ctx, "result", vectors.Result)
			if got := outcomeName(res, err); got != v.Outcome {
				t.Fatalf("%s (%+v, %v), want %s", got, res, err, v.Outcome)
			}
		})
	}
}

func TestGatewayPublicationAnswersAreEverySDKs(t *testing.T) {
	vectors := readPublicationVectors(t)
	w := vectors.Worker
	for _, v := range vectors.Gateway {
		t.Run(v.Name, func(t *testing.T) {
			srv := v.serve(t)
			g := &gatewayTransport{client: srv.Client(), token: "tok", clock: time.Now,
				base:   srv.URL + "/api/v1/namespaces/" + w.Namespace + "/workerruns/" + w.Name,
				holder: w.Holder, fence: w.Fence, runUID: w.RunUID, workerID: w.WorkerID}
			res, err := g.publish(context.Background(), "result", vectors.Result)
			if got := outcomeName(res, err); got != v.Outcome {
				t.Fatalf("%s (%+v, %v), want %s", got, res, err, v.Outcome)
			}
		})
	}
}
