package tether

// The external worker's path: the same operations as JSON calls to the Tether gateway, which
// writes the same fenced Lease and status operations as a pod worker would.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// maxReplyBytes bounds what is read of a gateway answer.
const maxReplyBytes = 4 << 20

// gatewayError is the gateway's error envelope {"error": {"code","message","field"}}.
type gatewayError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	Field   string `json:"field"`
}

// renewalReply is the gateway's reply to a call that renewed an attempt (claim, heartbeat,
// checkpoint, approval): the attempt it names and the signals, flat. Pointers tell a field that was
// given from one absent or null (docs/protocol.md §6.4).
type renewalReply struct {
	Holder             *string         `json:"holder"`
	Fence              *int64          `json:"fence"`
	RunUID             *string         `json:"runUid"`
	LeaseExpiresAt     *string         `json:"leaseExpiresAt"`
	Status             *string         `json:"status"`
	Stop               *bool           `json:"stop"`
	Paused             *bool           `json:"paused"`
	Yield              *bool           `json:"yield"`
	StopBy             *string         `json:"stopBy"`
	EndsAt             *string         `json:"endsAt"`
	CapRemainingCents  *int64          `json:"capRemainingCents"`
	CapRemainingTokens *int64          `json:"capRemainingTokens"`
	ToolClaim          *toolClaimReply `json:"toolClaim"`
	// Raw, so that malformed decisions do not make the whole reply unreadable (see renew).
	Decisions json.RawMessage `json:"decisions"`
}

type toolClaimReply struct {
	Token          *string `json:"token"`
	ExpiresAt      *string `json:"expiresAt"`
	ServiceAccount *string `json:"serviceAccount"`
}

// claimReply is the gateway's answer to a claim: a renewal reply of the attempt it hands out, plus
// the attempt's contract.
type claimReply struct {
	renewalReply
	Attempt              *int64          `json:"attempt"`
	LeaseDurationSeconds *float64        `json:"leaseDurationSeconds"`
	RenewIntervalSeconds *float64        `json:"renewIntervalSeconds"`
	Payload              json.RawMessage `json:"payload"`
	Checkpoint           *string         `json:"checkpoint"`
	IdempotencyKey       *string         `json:"idempotencyKey"`
	ReviewFeedback       *string         `json:"reviewFeedback"`
	// Tracing only, never required: a gateway without it sends none.
	Traceparent *string `json:"traceparent"`
}

// wellFormed: the fields the gateway always sends are there, and every field has its type (the
// decoder has checked the types of those given; absent and null are alike).
func (r *renewalReply) wellFormed() bool {
	if r.Holder == nil || r.Fence == nil || r.RunUID == nil || r.LeaseExpiresAt == nil || r.Status == nil ||
		r.Stop == nil || r.Paused == nil {
		return false
	}
	if r.EndsAt != nil {
		if _, err := parseTime(*r.EndsAt); err != nil {
			return false
		}
	}
	if t := r.ToolClaim; t != nil && (t.Token == nil || t.ExpiresAt == nil || t.ServiceAccount == nil) {
		return false
	}
	return objectOrNull(r.Decisions)
}

func (r *renewalReply) toolClaim() *ToolClaim {
	if r.ToolClaim == nil {
		return nil
	}
	return &ToolClaim{Token: *r.ToolClaim.Token, ExpiresAt: *r.ToolClaim.ExpiresAt, ServiceAccount: *r.ToolClaim.ServiceAccount}
}

// objectOrNull: a raw JSON value that is absent, null or an object.
func objectOrNull(raw json.RawMessage) bool {
	v := bytes.TrimSpace(raw)
	return len(v) == 0 || string(v) == "null" || v[0] == '{'
}

// parseGatewayReply reads an answer as the gateway's reply to a renewal of this attempt (holder,
// fence and, when the call named it, run); an error when it is not one. Such a 200 came from
// something in between (a proxy's `{}`) and confirms nothing. The Python and TypeScript SDKs draw
// the same line (sdk/vectors/gateway-replies.json).
func parseGatewayReply(body []byte, holder string, fence int64, runUID string) (*renewalReply, error) {
	var reply renewalReply
	if err := json.Unmarshal(body, &reply); err != nil || !reply.wellFormed() || *reply.Holder != holder ||
		*reply.Fence != fence || (runUID != "" && *reply.RunUID != runUID) {
		return nil, fmt.Errorf("the heartbeat's 200 is not the gateway's reply for this attempt: %q", clip(string(body)))
	}
	return &reply, nil
}

// parseClaimReply reads an answer as the gateway's claim reply; an error when it is not one.
func parseClaimReply(body []byte) (*claimReply, error) {
	var reply claimReply
	// Seconds may have a fraction (the CRD's are whole; a test gateway's need not be).
	if err := json.Unmarshal(body, &reply); err != nil || !reply.wellFormed() || *reply.Holder == "" ||
		*reply.Fence < 1 || *reply.RunUID == "" || reply.Attempt == nil || *reply.Attempt < 1 ||
		reply.LeaseDurationSeconds == nil || *reply.LeaseDurationSeconds <= 0 ||
		reply.RenewIntervalSeconds == nil || *reply.RenewIntervalSeconds <= 0 ||
		reply.IdempotencyKey == nil || !objectOrNull(reply.Payload) {
		return nil, fmt.Errorf("tether: the claim's 200 is not the gateway's claim reply (claiming again is safe): %q",
			clip(string(body)))
	}
	return &reply, nil
}

// Claim claims the open attempt of the run namespace/name through the Tether gateway at
// gatewayURL, with a Kubernetes bearer token (audience tether-gateway) allowed the verb "claim"
// on the run; then it renews once and starts the heartbeat. A refusal is a *ClaimRefusedError
// (errors.Is ErrClaimRefused) with the HTTP status: 402 budget exceeded, 409 held by another
// worker or nothing open, ...; a 200 that is not the gateway's claim reply is another error (the
// claim may have landed: claiming again is safe). Close the Run when done.
func Claim(ctx context.Context, gatewayURL, namespace, name, token string, opts ...Option) (*Run, error) {
	s := newSettings(opts)
	g := &gatewayTransport{
		client: s.httpClient, token: token, clock: time.Now, name: name,
		base: strings.TrimRight(gatewayURL, "/") + "/api/v1/namespaces/" + url.PathEscape(namespace) +
			"/workerruns/" + url.PathEscape(name),
	}
	claim := map[string]any{}
	if s.workerID != "" {
		claim["workerId"] = s.workerID
	}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	status, body, _, err := g.post(cctx, "claim", claim)
	if err != nil {
		return nil, fmt.Errorf("tether: claim got no answer: %w", err)
	}
	if status != http.StatusOK {
		e := errorOf(body)
		if e.Message == "" && e.Code == "" {
			e.Message = clip(string(body))
		}
		return nil, &ClaimRefusedError{Status: status, Code: e.Code, Message: e.Message}
	}
	reply, err := parseClaimReply(body)
	if err != nil {
		return nil, err
	}
	g.holder, g.fence, g.runUID, g.workerID = *reply.Holder, *reply.Fence, *reply.RunUID, s.workerID
	g.claim = reply.toolClaim()
	info := attemptInfo{name: name, namespace: namespace, holder: g.holder, fence: g.fence,
		attempt: int(*reply.Attempt), payload: reply.Payload, idempotencyKey: *reply.IdempotencyKey,
		leaseDuration: time.Duration(*reply.LeaseDurationSeconds * float64(time.Second)),
		renewInterval: time.Duration(*reply.RenewIntervalSeconds * float64(time.Second))}
	if reply.Checkpoint != nil {
		info.checkpoint = *reply.Checkpoint
	}
	if reply.ReviewFeedback != nil {
		info.reviewFeedback = *reply.ReviewFeedback
	}
	if reply.Traceparent != nil {
		info.traceparent = *reply.Traceparent
	}
	info.runUID = g.runUID
	if string(info.payload) == "null" {
		info.payload = nil
	}
	r := newRun(ctx, info, g, s)
	r.start(ctx)
	return r, nil
}

// gatewayTransport is the external worker's transport.
type gatewayTransport struct {
	client *http.Client
	base   string // {gateway}/api/v1/namespaces/{ns}/workerruns/{name}
	name   string // the run's
	token  string
	clock  func() time.Time // wall clock, for Retry-After dates
	// Every call names the attempt and, when the claim named one, the worker and the run's UID:
	// the gateway accepts calls only from the identity (and worker) that claimed the attempt, and
	// acts only on that run, never on a namesake created since. Its replies name them back.
	holder, runUID, workerID string
	fence                    int64

	mu    sync.Mutex
	claim *ToolClaim
}

func (g *gatewayTransport) close() { g.client.CloseIdleConnections() }

func (g *gatewayTransport) toolClaim() *ToolClaim {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.claim
}

// post sends one gateway call; an error means no answer.
func (g *gatewayTransport) post(ctx context.Context, op string, body map[string]any) (int, []byte, http.Header, error) {
	data, err := json.Marshal(body)
	if err != nil {
		return 0, nil, nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.base+"/"+op, bytes.NewReader(data))
	if err != nil {
		return 0, nil, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+g.token)
	resp, err := g.client.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	reply, err := io.ReadAll(io.LimitReader(resp.Body, maxReplyBytes))
	if err != nil {
		return 0, nil, nil, err
	}
	return resp.StatusCode, reply, resp.Header, nil
}

// withFence is a call's body: the attempt's identification plus the call's own fields.
func (g *gatewayTransport) withFence(extra map[string]any) map[string]any {
	body := make(map[string]any, 4+len(extra))
	body["holder"], body["fence"] = g.holder, g.fence
	if g.workerID != "" {
		body["workerId"] = g.workerID
	}
	if g.runUID != "" {
		body["runUid"] = g.runUID
	}
	for k, v := range extra {
		body[k] = v
	}
	return body
}

// errorOf reads the gateway's error envelope; empty when the answer is not one (a proxy in
// between may answer with anything).
func errorOf(body []byte) gatewayError {
	var env struct {
		Error gatewayError `json:"error"`
	}
	_ = json.Unmarshal(body, &env)
	return env.Error
}

func describe(status int, body []byte) string {
	if e := errorOf(body); e.Code != "" || e.Message != "" {
		return fmt.Sprintf("%d %s: %s", status, e.Code, e.Message)
	}
	return fmt.Sprintf("%d %s", status, clip(string(body)))
}

// approvalAsk is one approval request as the gateway's heartbeat takes it.
type approvalAsk struct {
	Name           string `json:"name"`
	Details        string `json:"details"`
	TimeoutSeconds *int   `json:"timeoutSeconds,omitempty"`
}

func (g *gatewayTransport) renew(ctx context.Context, checkpoint *string, u *usage, requests []approvalRequest) (renewResult, error) {
	extra := map[string]any{}
	if len(requests) > 0 {
		asks := make([]approvalAsk, len(requests))
		for i, r := range requests {
			asks[i] = approvalAsk(r)
		}
		extra["requests"] = asks
	}
	if checkpoint != nil {
		extra["checkpoint"] = *checkpoint
	}
	if u != nil {
		extra["usage"] = *u
	}
	status, body, _, err := g.post(ctx, "heartbeat", g.withFence(extra))
	if err != nil {
		return renewResult{}, err
	}
	if status == http.StatusOK {
		// Only the gateway's reply for this attempt confirms: any other 200 (a proxy's page, its
		// `{}`) came from something in between and says nothing about the lease, like no answer.
		reply, err := parseGatewayReply(body, g.holder, g.fence, g.runUID)
		if err != nil {
			return renewResult{}, err
		}
		var endsAt *time.Time
		if reply.EndsAt != nil {
			endsAt, _ = parseTime(*reply.EndsAt) // checked by parseGatewayReply
		}
		if claim := reply.toolClaim(); claim != nil {
			g.mu.Lock()
			g.claim = claim
			g.mu.Unlock()
		}
		sig := signalsFromRemaining(*reply.Stop, *reply.Paused, endsAt, reply.CapRemainingCents,
			reply.CapRemainingTokens, u)
		if sig.Stop && reply.Yield != nil && *reply.Yield {
			// A Kueue eviction (docs/protocol.md §7): an unreadable stopBy leaves only the time out.
			sig.Yield = true
			if reply.StopBy != nil {
				sig.StopBy, _ = parseTime(*reply.StopBy)
			}
		}
		// Malformed decisions decide nothing (the next heartbeat asks again); the other signals
		// stand, as the Python SDK reads the same reply.
		if len(reply.Decisions) > 0 {
			sig.Decisions, _ = parseDecisions(reply.Decisions)
		}
		return renewResult{ok: true, signals: &sig}, nil
	}
	if lostAnswer(status, body) {
		return renewResult{lost: true, why: describe(status, body)}, nil
	}
	return renewResult{why: "heartbeat refused: " + describe(status, body)}, nil
}

// lostAnswer says whether a refusal of a call after the claim says the attempt is not ours: gone,
// a moved fence, or another identity (NotClaimant) or worker (HeldByAnother) claimed it. Anything
// else (401, RBAC's 403, 422, 429, 5xx) says nothing about ownership.
func lostAnswer(status int, body []byte) bool {
	code := errorOf(body).Code
	return status == http.StatusNotFound || status == http.StatusGone || code == "NotClaimant" || code == "HeldByAnother"
}

func (g *gatewayTransport) publish(ctx context.Context, field string, value json.RawMessage) (publishResult, error) {
	op, extra := "complete", map[string]any{"result": value}
	if field == "error" {
		op, extra = "fail", map[string]any{"error": value}
	}
	status, body, header, err := g.post(ctx, op, g.withFence(extra))
	if err != nil {
		return publishResult{}, err
	}
	why := describe(status, body)
	switch {
	case status == http.StatusOK:
		return publishResult{outcome: published}, nil
	case status == http.StatusNotFound, status == http.StatusConflict, status == http.StatusGone,
		errorOf(body).Code == "NotClaimant":
		// 409 is HeldByAnother, or AlreadyPublished (another value of this attempt was accepted):
		// never retried.
		return publishResult{outcome: refused, status: status, why: why}, nil
	case status == http.StatusRequestEntityTooLarge:
		// BodyTooLarge (over the gateway's 1 MiB) or ResultTooLarge (the run would outgrow what the
		// Kubernetes API stores): the message says which.
		return publishResult{outcome: invalid, status: status, why: "too large: " + why}, nil
	case status == http.StatusUnprocessableEntity:
		// The gateway refused the body, or the API server the value: a bad result, not lost.
		var causes []InvalidCause
		if e := errorOf(body); e.Field != "" {
			causes = []InvalidCause{{Field: e.Field, Message: e.Message}}
		}
		return publishResult{outcome: invalid, status: status, why: why, causes: causes}, nil
	default:
		// 400, 401, RBAC's 403, 429, 5xx (503 Busy: a transient conflict): nothing about ownership.
		return publishResult{outcome: retry, status: status, why: why,
			retryAfter: retryAfterHeader(header.Get("Retry-After"), g.clock())}, nil
	}
}

// recorded is false: the gateway itself answers a repeated publication of an accepted value with 200.
func (g *gatewayTransport) recorded(context.Context, string, json.RawMessage) (bool, error) {
	return false, nil
}

// parent is all an External worker knows of its run, which it cannot read: its name and UID. The
// gateway, which reads it, builds the child's body itself (name, parentRef, label, owner reference,
// the digest of the spec as sent) and the parent's part of its budget: the run's WorkerBudget, and
// the refusal of a capped run's child that names no share (422, ErrSpawnRefused).
func (g *gatewayTransport) parent(context.Context) (parentRun, error) {
	return parentRun{name: g.name, uid: g.runUID}, nil
}

// spawn asks the gateway for the child (docs/protocol.md §6.2): the spec as asked, the key and its
// generation; the gateway answers with the child it created or the run of that name that exists. A
// 422 or RBAC's 403 is a refusal of the child (the API server's, SpawnRefused, or the gateway's of
// the spec), a 409 SpawnConflict a run of the child's name that is not this run's child.
func (g *gatewayTransport) spawn(ctx context.Context, req spawnRequest) (*childView, error) {
	status, body, _, err := g.post(ctx, "spawn",
		g.withFence(map[string]any{"key": req.key, "generation": req.generation, "spec": req.spec}))
	if err != nil {
		return nil, err
	}
	switch e := errorOf(body); {
	case status == http.StatusUnprocessableEntity, status == http.StatusForbidden && e.Code != "NotClaimant":
		// 422: the API server's refusal or the gateway's of the spec; 403: RBAC does not let this
		// identity `spawn` for the run (NotClaimant is lost, below).
		return nil, fmt.Errorf("%w: the gateway refused child key %q: %s", ErrSpawnRefused, req.key, describe(status, body))
	case status == http.StatusConflict && e.Code == "SpawnConflict":
		return nil, fmt.Errorf("%w: %s", ErrSpawnConflict, e.Message)
	}
	return childReply("spawn", status, body)
}

// child reads a child run through the gateway; nil when no run of that name is this run's child.
func (g *gatewayTransport) child(ctx context.Context, name string) (*childView, error) {
	status, body, _, err := g.post(ctx, "child", g.withFence(map[string]any{"name": name}))
	if err != nil {
		return nil, err
	}
	if status == http.StatusNotFound && errorOf(body).Code == "ChildNotFound" {
		return nil, nil
	}
	return childReply("child", status, body)
}

// childReply reads the answer to a spawn or child call: `{"child": <the WorkerRun>}`. A 200 with
// anything else came from something in between and is no answer, as is a refusal that says nothing
// about ownership; ErrLeaseLost when the refusal says the attempt is not ours.
func childReply(op string, status int, body []byte) (*childView, error) {
	switch {
	case status == http.StatusOK:
		var reply struct {
			Child json.RawMessage `json:"child"`
		}
		if json.Unmarshal(body, &reply) == nil {
			if child, err := parseChild(reply.Child); err == nil {
				return child, nil
			}
		}
		return nil, fmt.Errorf("tether: the %s call's 200 is not the gateway's reply: %q", op, clip(string(body)))
	case lostAnswer(status, body):
		return nil, fmt.Errorf("%w: the %s call was refused: %s", ErrLeaseLost, op, describe(status, body))
	default:
		return nil, fmt.Errorf("tether: the %s call was refused: %s", op, describe(status, body))
	}
}
