package tether

// The pod worker's path: a resourceVersion-conditional update of the run's Lease, and a fenced
// JSON patch on the WorkerRun's status, both through client-go's REST client as raw JSON.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clienttransport "k8s.io/client-go/transport"
)

// The environment the operator gives a worker pod.
const (
	envRun             = "TETHER_RUN"
	envNamespace       = "TETHER_NAMESPACE"
	envRunUID          = "TETHER_RUN_UID"
	envHolder          = "TETHER_HOLDER"
	envFence           = "TETHER_FENCE"
	envAttempt         = "TETHER_ATTEMPT"
	envLeaseDuration   = "TETHER_LEASE_DURATION_SECONDS"
	envRenewInterval   = "TETHER_RENEW_INTERVAL_SECONDS"
	envPayload         = "TETHER_PAYLOAD"
	envPayloadFrom     = "TETHER_PAYLOAD_FROM" // "spec.payload": too large for the environment, read the run
	envCheckpoint      = "TETHER_CHECKPOINT"
	envIdempotencyKey  = "TETHER_IDEMPOTENCY_KEY"
	envReviewFeedback  = "TETHER_REVIEW_FEEDBACK"
	payloadFromRun     = "spec.payload"
	inClusterTokenFile = "/var/run/secrets/kubernetes.io/serviceaccount/token"
)

var (
	workerRunsGV = schema.GroupVersion{Group: "tether.dev", Version: "v1alpha1"}
	leasesGV     = schema.GroupVersion{Group: "coordination.k8s.io", Version: "v1"}
)

// FromEnv starts the attempt this pod was launched for: it reads the environment the operator
// sets (TETHER_RUN, TETHER_HOLDER, TETHER_FENCE, ...), reaches the API server in-cluster or
// through $KUBECONFIG (whose user may name a tokenFile, re-read as it rotates), renews the Lease
// once and starts the heartbeat. The Run is returned even when that first renewal failed: Lost
// and OwnershipUnknown say so. Close it when done.
func FromEnv(ctx context.Context, opts ...Option) (*Run, error) {
	s := newSettings(opts)
	get := os.Getenv
	var missing []string
	for _, key := range []string{envRun, envNamespace, envHolder, envFence, envAttempt, envLeaseDuration, envRenewInterval} {
		if get(key) == "" {
			missing = append(missing, key)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("tether: not a Tether worker pod: %s unset", strings.Join(missing, ", "))
	}
	info := attemptInfo{name: get(envRun), namespace: get(envNamespace), holder: get(envHolder),
		checkpoint: get(envCheckpoint), idempotencyKey: get(envIdempotencyKey), reviewFeedback: get(envReviewFeedback),
		runUID: get(envRunUID), traceparent: get(envTraceparent)}
	var err error
	if info.fence, err = strconv.ParseInt(get(envFence), 10, 64); err != nil {
		return nil, fmt.Errorf("tether: %s: %w", envFence, err)
	}
	if info.attempt, err = strconv.Atoi(get(envAttempt)); err != nil {
		return nil, fmt.Errorf("tether: %s: %w", envAttempt, err)
	}
	if info.leaseDuration, err = seconds(get(envLeaseDuration)); err != nil {
		return nil, fmt.Errorf("tether: %s: %w", envLeaseDuration, err)
	}
	if info.renewInterval, err = seconds(get(envRenewInterval)); err != nil {
		return nil, fmt.Errorf("tether: %s: %w", envRenewInterval, err)
	}
	cfg, err := restConfig(get)
	if err != nil {
		return nil, err
	}
	kt, err := newKubeTransport(cfg, info, get(envRunUID))
	if err != nil {
		return nil, err
	}
	if info.payload, err = kt.loadPayload(ctx); err != nil {
		kt.close()
		return nil, err
	}
	r := newRun(ctx, info, kt, s)
	r.start(ctx)
	return r, nil
}

func seconds(text string) (time.Duration, error) {
	f, err := strconv.ParseFloat(text, 64)
	if err != nil {
		return 0, err
	}
	if f <= 0 {
		return 0, fmt.Errorf("%s is not a positive number of seconds", text)
	}
	return time.Duration(f * float64(time.Second)), nil
}

// restConfig is the in-cluster configuration when the pod has one and no $KUBECONFIG says
// otherwise, else the kubeconfig's (client-go reads a user's tokenFile, and re-reads it every
// minute and after a 401).
func restConfig(get func(string) string) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if get("KUBECONFIG") == "" && get("KUBERNETES_SERVICE_HOST") != "" && fileExists(inClusterTokenFile) {
		cfg, err = rest.InClusterConfig()
	} else {
		cfg, err = clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
			clientcmd.NewDefaultClientConfigLoadingRules(), &clientcmd.ConfigOverrides{}).ClientConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("tether: no Kubernetes client configuration: %w", err)
	}
	return tune(cfg), nil
}

// tune adapts a client configuration to a worker's traffic.
func tune(cfg *rest.Config) *rest.Config {
	cfg = rest.CopyConfig(cfg)
	// A worker makes about one request per renewal interval: a client-side rate limiter would only
	// delay a renewal past its timeout. Every call carries its own deadline (its context).
	cfg.QPS = -1
	cfg.Timeout = 0
	// JSON on the wire: a worker's bodies are small, and whatever answers like the API server (a
	// proxy, a test double) speaks it.
	cfg.ContentType = "application/json"
	cfg.AcceptContentTypes = "application/json"
	cfg.UserAgent = "tether-go-sdk"
	if cfg.BearerTokenFile != "" {
		// client-go re-reads a token file every minute; a worker also re-reads it after a 401 (the
		// kubelet rotated it), which client-go's resettable token source does.
		source := clienttransport.NewCachedFileTokenSource(cfg.BearerTokenFile)
		cfg.BearerToken, cfg.BearerTokenFile = "", ""
		cfg.Wrap(clienttransport.ResettableTokenSourceWrapTransport(source))
	}
	return cfg
}

func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// kubeTransport is the pod worker's transport.
type kubeTransport struct {
	http      *http.Client
	leases    rest.Interface
	runs      rest.Interface
	namespace string
	name      string
	holder    string
	fence     int64
	runUID    string    // the Lease and run must be this run's, not a re-created namesake's
	lease     *leaseDoc // the last one seen; the Run serialises renewals
}

func newKubeTransport(cfg *rest.Config, info attemptInfo, runUID string) (*kubeTransport, error) {
	cfg = rest.CopyConfig(cfg)
	cfg.Wrap(func(next http.RoundTripper) http.RoundTripper { return retryAfterKeeper{next} })
	httpClient, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("tether: %w", err)
	}
	leases, err := restClient(cfg, httpClient, leasesGV)
	if err != nil {
		return nil, err
	}
	runs, err := restClient(cfg, httpClient, workerRunsGV)
	if err != nil {
		return nil, err
	}
	return &kubeTransport{http: httpClient, leases: leases, runs: runs,
		namespace: info.namespace, name: info.name, holder: info.holder, fence: info.fence, runUID: runUID}, nil
}

// restClient is a REST client for one API group: objects go both ways as raw JSON.
func restClient(cfg *rest.Config, httpClient *http.Client, gv schema.GroupVersion) (rest.Interface, error) {
	c := rest.CopyConfig(cfg)
	c.GroupVersion = &gv
	c.APIPath = "/apis"
	c.NegotiatedSerializer = scheme.Codecs.WithoutConversion()
	client, err := rest.RESTClientForConfigAndClient(c, httpClient)
	if err != nil {
		return nil, fmt.Errorf("tether: %w", err)
	}
	return client, nil
}

func (t *kubeTransport) close() { t.http.CloseIdleConnections() }

// retryAfterSlot keys, in a request's context, where its answer's Retry-After header goes.
type retryAfterSlot struct{}

// withRetryAfterSlot is ctx with a place for the Retry-After header of its request's answer.
func withRetryAfterSlot(ctx context.Context, header *string) context.Context {
	return context.WithValue(ctx, retryAfterSlot{}, header)
}

// retryAfterKeeper hands the Retry-After header of an answer to the request's caller, when its
// context has a place for it (withRetryAfterSlot). client-go's error keeps only a Status body's
// details.retryAfterSeconds, or a header in whole seconds for other bodies; the protocol reads the
// header, decimals included (docs/protocol.md §3).
type retryAfterKeeper struct{ next http.RoundTripper }

func (k retryAfterKeeper) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := k.next.RoundTrip(req)
	if slot, ok := req.Context().Value(retryAfterSlot{}).(*string); ok && resp != nil {
		*slot = resp.Header.Get("Retry-After")
	}
	return resp, err
}

// WrappedRoundTripper lets client-go walk the transport chain past this wrapper, as past its own.
func (k retryAfterKeeper) WrappedRoundTripper() http.RoundTripper { return k.next }

// resultBody is a request's answer, or its failure as the API server's Status tells it (Raw alone
// gives a generic error for a refusal, without the message the fencing policy is recognised by).
func resultBody(res rest.Result) ([]byte, error) {
	if err := res.Error(); err != nil {
		return nil, err
	}
	return res.Raw()
}

// getRaw reads the object `name` of `resource` (this run's, or a child run) as JSON; found is false
// (and no error) when it is gone. MaxRetries(0) here and below: the Run retries by the protocol's
// rules (the next interval, or the publication's backoff), never client-go.
func (t *kubeTransport) getRaw(ctx context.Context, client rest.Interface, resource, name string) (raw []byte, found bool, err error) {
	raw, err = resultBody(client.Get().Namespace(t.namespace).Resource(resource).Name(name).MaxRetries(0).Do(ctx))
	if apierrors.IsNotFound(err) {
		return nil, false, nil
	}
	return raw, err == nil, err
}

// getLease reads the Lease; nil when it is gone. An answer that is not a Lease is an error, like no
// answer: unconfirmed (docs/protocol.md §5.2).
func (t *kubeTransport) getLease(ctx context.Context) (*leaseDoc, error) {
	raw, found, err := t.getRaw(ctx, t.leases, "leases", t.name)
	if err != nil || !found {
		return nil, err
	}
	return parseLease(raw)
}

// mine says whether a Lease (nil: gone) is this attempt's.
func (t *kubeTransport) mine(lease *leaseDoc) bool {
	return lease != nil && holds(&lease.view, t.holder, t.fence, t.runUID)
}

func (t *kubeTransport) renew(ctx context.Context, checkpoint *string, u *usage, requests []approvalRequest) (renewResult, error) {
	return t.renewAttempt(ctx, checkpoint, u, requests, true)
}

func (t *kubeTransport) renewAttempt(ctx context.Context, checkpoint *string, u *usage, requests []approvalRequest,
	retryConflict bool) (renewResult, error) {
	if t.lease == nil {
		lease, err := t.getLease(ctx)
		if err != nil {
			return renewResult{}, err
		}
		if lease == nil {
			return renewResult{lost: true, why: "the lease is gone"}, nil
		}
		t.lease = lease
	}
	if !t.mine(t.lease) {
		return renewResult{lost: true, why: "the lease names another holder or fence"}, nil
	}
	var asked map[string]string // no requests, no annotation: a worker that asks nothing writes what it always did
	if len(requests) > 0 {
		asked = map[string]string{annRequests: requestsAnnotation(requests)}
	}
	renewed, err := renewal(t.lease.raw, time.Now(), checkpoint, u, asked)
	if err != nil {
		return renewResult{}, fmt.Errorf("the Lease as read: %w", err)
	}
	raw, err := resultBody(t.leases.Put().Namespace(t.namespace).Resource("leases").Name(t.name).
		SetHeader("Content-Type", "application/json").Body([]byte(renewed)).MaxRetries(0).Do(ctx))
	if err == nil {
		// An answer that is not this renewal's (a proxy's page, a Status) confirms nothing and denies
		// nothing. The last Lease stays; if this PUT landed, the next one conflicts and re-reads.
		updated, err := parseLease(raw)
		if err != nil {
			return renewResult{}, fmt.Errorf("the renewal's answer: %w", err)
		}
		if !t.mine(updated) {
			return renewResult{}, fmt.Errorf("the renewal's answer is not this attempt's Lease: %s", clip(string(raw)))
		}
		t.lease = updated
		res := renewResult{ok: true}
		if sig, ok := leaseSignals(&updated.view); ok {
			res.signals = &sig
		}
		return res, nil
	}
	var status *apierrors.StatusError
	if !errors.As(err, &status) {
		return renewResult{}, err
	}
	switch code := status.ErrStatus.Code; {
	case code == http.StatusConflict:
		// Re-read: still our holder and fence means someone touched the Lease harmlessly (the
		// operator updating the signals); retry once.
		lease, err := t.getLease(ctx)
		if err != nil {
			return renewResult{}, err
		}
		t.lease = lease
		mine := t.mine(lease)
		if mine && retryConflict {
			return t.renewAttempt(ctx, checkpoint, u, requests, false)
		}
		if !mine {
			return renewResult{lost: true, why: "renewal conflicted and the lease is no longer ours"}, nil
		}
		return renewResult{why: "renewal conflicted twice"}, nil
	case code == http.StatusNotFound:
		t.lease = nil
		return renewResult{lost: true, why: "the lease is gone"}, nil
	case fencedByPolicy(status):
		return renewResult{lost: true, why: "the API server's fencing policy refused: " + clip(status.ErrStatus.Message)}, nil
	default:
		// 400, 422 (a bug in the body), 401 (client-go re-reads the token file), RBAC's 403, 429,
		// 5xx: nothing about ownership.
		return renewResult{why: fmt.Sprintf("renewal refused: %d %s", code, clip(status.ErrStatus.Message))}, nil
	}
}

// fencedByPolicy tells a 403 from Tether's admission policy (the write is not this attempt's to
// make) from RBAC's 403 (a misconfigured identity), which says nothing about ownership.
func fencedByPolicy(status *apierrors.StatusError) bool {
	msg := status.ErrStatus.Message
	return status.ErrStatus.Code == http.StatusForbidden &&
		strings.Contains(msg, "ValidatingAdmissionPolicy") && strings.Contains(msg, "tether-worker")
}

// tooLargeMessages: etcd refuses a write that would make one object larger than it stores (1.5 MiB;
// its client's 2 MiB past that), and the API server passes it on as a 500 with only this message.
var tooLargeMessages = []string{"etcdserver: request is too large", "trying to send message larger than max"}

// tooLarge tells whether the API server refused a write as too large: 413 (over its request
// limit) or a 500 Status with etcd's message. Either refuses the same value every time: a bad
// result, never an outage to retry (sdk/vectors/publications.json, shared with the Python and
// TypeScript SDKs). A 500 that was not a Status (client-go quotes the body in its message) is not.
func tooLarge(status *apierrors.StatusError) bool {
	switch status.ErrStatus.Code {
	case http.StatusRequestEntityTooLarge:
		return true
	case http.StatusInternalServerError:
		if d := status.ErrStatus.Details; d != nil {
			for _, c := range d.Causes {
				if c.Type == metav1.CauseTypeUnexpectedServerResponse {
					return false
				}
			}
		}
		for _, m := range tooLargeMessages {
			if strings.Contains(status.ErrStatus.Message, m) {
				return true
			}
		}
	}
	return false
}

// statusCauses are the fields a refusal names (details.causes); a body that was not a Status names
// none (client-go's "unexpected server response" cause has no field).
func statusCauses(status *apierrors.StatusError) []InvalidCause {
	var causes []InvalidCause
	if d := status.ErrStatus.Details; d != nil {
		for _, c := range d.Causes {
			causes = append(causes, InvalidCause{Field: c.Field, Message: c.Message})
		}
	}
	return causes
}

func (t *kubeTransport) publish(ctx context.Context, field string, value json.RawMessage) (publishResult, error) {
	body, err := json.Marshal(fencedPatch(t.holder, t.fence, field, value, t.runUID))
	if err != nil {
		return publishResult{}, err
	}
	// MaxRetries(0): the Run retries by the protocol's rules (backoff within the lease deadline).
	var retryAfter string
	err = t.runs.Patch(types.JSONPatchType).Namespace(t.namespace).Resource("workerruns").Name(t.name).
		SubResource("status").Body(body).MaxRetries(0).Do(withRetryAfterSlot(ctx, &retryAfter)).Error()
	if err == nil {
		return publishResult{outcome: published}, nil
	}
	var status *apierrors.StatusError
	if !errors.As(err, &status) {
		return publishResult{}, err
	}
	code := int(status.ErrStatus.Code)
	why := fmt.Sprintf("%d %s", code, clip(status.ErrStatus.Message))
	causes := statusCauses(status)
	switch {
	case tooLarge(status):
		// 413, or etcd's 500: the run would outgrow what the API server stores in one object.
		return publishResult{outcome: invalid, status: code, why: "too large: " + why}, nil
	case code == http.StatusUnprocessableEntity && refusesValue(causes, field):
		// The CRD's schema refused the value (a cause names the field): a bad result.
		return publishResult{outcome: invalid, status: code, why: why, causes: causes}, nil
	case code == http.StatusUnprocessableEntity, code == http.StatusNotFound, code == http.StatusConflict,
		fencedByPolicy(status):
		// Any other 422: a test failed, the uid, fence or holder moved on; the policy's 403 says the
		// same from the API server itself.
		return publishResult{outcome: refused, status: code, why: why}, nil
	default:
		// 400, 401, RBAC's 403, 429, 5xx: nothing about ownership.
		return publishResult{outcome: retry, status: code, why: why, retryAfter: retryAfterHeader(retryAfter, time.Now())}, nil
	}
}

func (t *kubeTransport) recorded(ctx context.Context, field string, value json.RawMessage) (bool, error) {
	raw, found, err := t.getRaw(ctx, t.runs, "workerruns", t.name)
	if err != nil || !found {
		return false, err
	}
	var run runView
	if err := json.Unmarshal(raw, &run); err != nil {
		return false, err
	}
	if t.runUID != "" && run.Metadata.UID != t.runUID {
		return false, nil
	}
	return publicationRecorded(run, t.holder, t.fence, field, value), nil
}

// parent reads this run as its children name it; ErrLeaseLost when it is gone, or was re-created
// under its name since this pod started (its children would be the namesake's).
func (t *kubeTransport) parent(ctx context.Context) (parentRun, error) {
	raw, found, err := t.getRaw(ctx, t.runs, "workerruns", t.name)
	if err != nil {
		return parentRun{}, err
	}
	if !found {
		return parentRun{}, fmt.Errorf("%w: run %s/%s is gone", ErrLeaseLost, t.namespace, t.name)
	}
	p, err := parentOf(raw)
	if err != nil {
		return parentRun{}, err
	}
	if t.runUID != "" && p.uid != t.runUID {
		return parentRun{}, fmt.Errorf("%w: %s was re-created (uid %s is gone)", ErrLeaseLost, t.name, t.runUID)
	}
	return p, nil
}

// spawn creates the child run (with the pod's own credentials), or reads the one of that name that
// exists. A refusal (an admission policy, RBAC, the schema) is ErrSpawnRefused with the API
// server's words; a child deleted between the conflict and the read is created again, three times
// at most.
func (t *kubeTransport) spawn(ctx context.Context, req spawnRequest) (*childView, error) {
	body, err := json.Marshal(childBody(req.parent, t.namespace, t.holder, t.fence, req.key, req.generation, req.spec))
	if err != nil {
		return nil, err
	}
	name := childName(req.parent.name, req.parent.uid, req.key, req.generation)
	for range 3 {
		raw, err := resultBody(t.runs.Post().Namespace(t.namespace).Resource("workerruns").
			SetHeader("Content-Type", "application/json").Body(body).MaxRetries(0).Do(ctx))
		if err == nil {
			return parseChild(raw)
		}
		var status *apierrors.StatusError
		if !errors.As(err, &status) {
			return nil, err
		}
		switch status.ErrStatus.Code {
		case http.StatusBadRequest, http.StatusForbidden, http.StatusUnprocessableEntity:
			return nil, fmt.Errorf("%w: the API server refused child run %s: %s", ErrSpawnRefused, name,
				status.ErrStatus.Message)
		case http.StatusConflict: // made before: whose and for what, the Run judges
		default:
			return nil, err
		}
		found, err := t.child(ctx, name)
		if err != nil || found != nil {
			return found, err
		}
	}
	return nil, fmt.Errorf("%w: child run %s kept being deleted as it was made", ErrSpawnRefused, name)
}

// child reads a child run; nil when it is gone.
func (t *kubeTransport) child(ctx context.Context, name string) (*childView, error) {
	raw, found, err := t.getRaw(ctx, t.runs, "workerruns", name)
	if err != nil || !found {
		return nil, err
	}
	return parseChild(raw)
}

// loadPayload is the run's payload: inline in TETHER_PAYLOAD or, when it was too large for the
// environment (TETHER_PAYLOAD_FROM=spec.payload), read from the pod's own WorkerRun.
func (t *kubeTransport) loadPayload(ctx context.Context) (json.RawMessage, error) {
	if inline, ok := os.LookupEnv(envPayload); ok {
		if inline == "" {
			return json.RawMessage("{}"), nil
		}
		if !json.Valid([]byte(inline)) {
			return nil, fmt.Errorf("tether: %s is not JSON", envPayload)
		}
		return json.RawMessage(inline), nil
	}
	source, ok := os.LookupEnv(envPayloadFrom)
	if !ok {
		return json.RawMessage("{}"), nil
	}
	if source != payloadFromRun {
		return nil, fmt.Errorf("tether: %s=%q: this SDK reads only %q", envPayloadFrom, source, payloadFromRun)
	}
	const attempts = 3
	backoff := time.Second
	for attempt := 1; ; attempt++ {
		raw, err := t.getRun(ctx)
		if err == nil {
			return t.payloadOf(raw)
		}
		var status *apierrors.StatusError
		// 403/404 will not heal: the attempt fails and says why. A brief API hiccup at start-up
		// (no answer, 5xx) should not cost the attempt.
		if attempt == attempts || (errors.As(err, &status) && status.ErrStatus.Code < 500) {
			return nil, fmt.Errorf("tether: reading the payload from the run: %w", err)
		}
		if err := sleepCtx(ctx, backoff); err != nil {
			return nil, err
		}
		backoff *= 2
	}
}

func (t *kubeTransport) getRun(ctx context.Context) ([]byte, error) {
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return resultBody(t.runs.Get().Namespace(t.namespace).Resource("workerruns").Name(t.name).
		MaxRetries(0).Do(rctx))
}

func (t *kubeTransport) payloadOf(raw []byte) (json.RawMessage, error) {
	var run struct {
		Metadata struct {
			UID string `json:"uid"`
		} `json:"metadata"`
		Spec struct {
			Payload json.RawMessage `json:"payload"`
		} `json:"spec"`
	}
	if err := json.Unmarshal(raw, &run); err != nil {
		return nil, fmt.Errorf("tether: reading the payload from the run: %w", err)
	}
	if t.runUID != "" && run.Metadata.UID != t.runUID {
		// Re-created under the same name since this pod started: not our input.
		return nil, fmt.Errorf("%w: %s was re-created (uid %s is gone)", ErrLeaseLost, t.name, t.runUID)
	}
	if len(run.Spec.Payload) == 0 || string(run.Spec.Payload) == "null" {
		return json.RawMessage("{}"), nil
	}
	return run.Spec.Payload, nil
}

// clip shortens a server message for a log line or an error.
func clip(s string) string {
	if len(s) > 200 {
		return s[:200]
	}
	return s
}
