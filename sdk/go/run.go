package tether

// One attempt of a run, as seen by the worker that holds it. The worker renews its run's Lease on
// a goroutine of its own (a blocked tool call must not stop the heartbeat), fences itself on a
// monotonic clock, and publishes its result with one fenced write.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// Clock reads a monotonic clock: any origin, never going back. Ownership deadlines are measured
// on it, never on the wall clock.
type Clock func() time.Duration

var processStart = time.Now()

// monotonic is the default Clock (time.Since reads Go's monotonic clock).
func monotonic() time.Duration { return time.Since(processStart) }

// Signals is what the control plane says, as of the last confirmed renewal.
type Signals struct {
	Stop   bool       // stop now (spec.stop, a cap or a budget crossed)
	Paused bool       // spec.suspend: hold on (the heartbeat goes on) and resume from where you were
	Reason string     // why, when the control plane said
	EndsAt *time.Time // the run's deadline, if it has one
	// What is left of the run's caps, counting the usage this attempt reported; nil: no cap.
	CapRemainingCents  *int64
	CapRemainingTokens *int64
	// Yielding: the stop is a Kueue eviction. Checkpoint, then exit: the run is queued again and
	// its next attempt resumes from that checkpoint; at StopBy the attempt is revoked regardless.
	Yielding bool
	StopBy   *time.Time
}

// ApprovalDecision is a person's decision on a RequestApproval: Decision is Approve, Deny or
// TimedOut (nobody decided within the request's timeout); Reason and Approver are "" when the
// decision names none.
type ApprovalDecision struct {
	Decision string
	Reason   string
	Approver string
}

// Approved says whether the decision is Approve (Deny and TimedOut are not).
func (d ApprovalDecision) Approved() bool { return d.Decision == "Approve" }

// approvalPoll is how often a RequestApproval renews while it waits, so the decision arrives
// promptly (the heartbeat alone would bring it one renew interval later at worst).
const approvalPoll = 2 * time.Second

// ToolClaim is a short-lived token of the run's ServiceAccount, minted by the gateway on every
// heartbeat for external workers.
type ToolClaim struct {
	Token          string `json:"token"`
	ExpiresAt      string `json:"expiresAt"`
	ServiceAccount string `json:"serviceAccount"`
}

// renewResult is one renewal's answer. Not ok and not lost: unconfirmed (try again later).
type renewResult struct {
	ok      bool
	lost    bool
	why     string
	signals *signalState // nil: none came back, or they were malformed (keep the previous)
}

// publishOutcome classifies an answer to a publication.
type publishOutcome int

const (
	published publishOutcome = iota
	refused                  // the run moved on: this attempt no longer owns it
	invalid                  // the value itself was refused; ownership is not in question
	retry                    // an answer that says nothing about ownership (429, 5xx, ...)
)

type publishResult struct {
	outcome    publishOutcome
	status     int // a refusal's HTTP status
	why        string
	causes     []InvalidCause // invalid: the refused fields, when the answer named them
	retryAfter time.Duration  // the answer's Retry-After, when it had one
}

// transport is how a Run reaches Tether: the Kubernetes API (pods) or the gateway (anywhere).
// An error means no answer (or an answer that is not one): ownership unknown, not lost.
type transport interface {
	// renew carries every approval request of the attempt: each renewal carries them all.
	renew(ctx context.Context, checkpoint *string, u *usage, requests []approvalRequest) (renewResult, error)
	publish(ctx context.Context, field string, value json.RawMessage) (publishResult, error)
	// recorded says whether the run already shows this publication (its earlier answer was lost).
	recorded(ctx context.Context, field string, value json.RawMessage) (bool, error)
	// parent is this run as its children name it (docs/children.md).
	parent(ctx context.Context) (parentRun, error)
	// spawn creates the child run a request asks for, or returns the run of that name that exists:
	// whose it is and what it was asked for, the Run judges. ErrSpawnRefused when it was refused,
	// ErrLeaseLost when the answer says the attempt is not the run's.
	spawn(ctx context.Context, req spawnRequest) (*childView, error)
	// child reads a child run by name; nil (and no error) when it is gone.
	child(ctx context.Context, name string) (*childView, error)
	close()
}

// spawnRequest is one try of a spawn: the key's child at a generation, with the spec as asked.
type spawnRequest struct {
	parent     parentRun
	key        string
	generation int
	spec       map[string]any
}

// toolClaimer is a transport that receives tool claims (the gateway's).
type toolClaimer interface {
	toolClaim() *ToolClaim
}

// attemptInfo is what a worker is told about its attempt (environment or claim reply).
type attemptInfo struct {
	name, namespace, holder string
	fence                   int64
	attempt                 int
	leaseDuration           time.Duration
	renewInterval           time.Duration
	payload                 json.RawMessage
	checkpoint              string
	idempotencyKey          string
	reviewFeedback          string // why a person denied the previous attempt's result
	runUID                  string
	traceparent             string // the attempt's W3C trace context: tracing only, it grants nothing
}

// Run is one attempt of a run, held by this worker. Create it with FromEnv (pods) or Claim
// (external workers through the gateway), and Close it when done. Its methods are safe for
// concurrent use.
type Run struct {
	info    attemptInfo
	margin  time.Duration
	timeout time.Duration // a request unanswered for this long counts as no answer
	poll    time.Duration // RequestApproval's renewal period while it waits

	tr           transport
	clock        Clock
	sleep        func(context.Context, time.Duration) error
	effectClient *http.Client
	log          *slog.Logger

	ctx       context.Context // the heartbeat's, cancelled by Close
	cancel    context.CancelFunc
	wake      chan struct{}
	done      chan struct{} // closed when the heartbeat goroutine has ended
	closeOnce sync.Once

	renewMu      sync.Mutex // one renewal at a time: they share the transport's last Lease
	renewalSpans renewals   // which renewals are spans; guarded by renewMu

	mu                sync.Mutex // guards what follows
	confirmed         bool
	confirmedAt       time.Duration // clock() when the last confirmed renewal was sent
	lost              bool
	finished          bool
	pendingCheckpoint *string
	cursor            string
	usage             *usage
	signals           signalState
	requests          []approvalRequest // every approval this attempt asked for, in order
	parent            *parentRun        // this run as its children name it, read at the first Spawn
	// changed is closed (and replaced) when something a waiting RequestApproval acts on changes:
	// new signals, or lost ownership.
	changed chan struct{}
}

func newRun(ctx context.Context, info attemptInfo, tr transport, s settings) *Run {
	if info.idempotencyKey == "" {
		info.idempotencyKey = info.namespace + "/" + info.name
	}
	if len(info.payload) == 0 {
		info.payload = json.RawMessage("{}")
	}
	r := &Run{
		info: info, margin: margin(info.leaseDuration), timeout: requestTimeout(info.renewInterval), poll: approvalPoll,
		changed: make(chan struct{}), tr: tr, clock: s.clock, sleep: sleepCtx, effectClient: s.effectClient, log: s.logger,
		wake: make(chan struct{}, 1), done: make(chan struct{}), cursor: info.checkpoint,
	}
	r.ctx, r.cancel = context.WithCancel(context.WithoutCancel(ctx))
	return r
}

// start renews once, so that ownership is confirmed before any work, then heartbeats on a
// goroutine of its own. A first renewal that fails is no error: Lost and OwnershipUnknown say so.
func (r *Run) start(ctx context.Context) {
	_ = r.renewOnce(ctx)
	go r.heartbeat()
}

// Close stops the heartbeat, sends one last renewal with the usage and checkpoint (unless lost or
// published) and releases the connections. It publishes nothing: a worker that ends without
// Complete or Fail lets its lease lapse, and retry rules decide what follows.
func (r *Run) Close() error {
	r.closeOnce.Do(func() {
		r.cancel()
		<-r.done
		// A worker that leaves without publishing (stopped, crashed out, gave up) still reports
		// what it spent and how far it got: one last renewal carries its usage and checkpoint, or
		// the run would be charged less than it used. Its outcome changes nothing here.
		r.mu.Lock()
		flush := !r.lost && !r.finished
		r.mu.Unlock()
		if flush {
			_ = r.renewOnce(context.Background())
		}
		r.tr.close()
	})
	return nil
}

// --- what the worker was told ----------------------------------------------------

// Name is the WorkerRun's name (its Lease has the same name).
func (r *Run) Name() string { return r.info.name }

// Namespace is the WorkerRun's namespace.
func (r *Run) Namespace() string { return r.info.namespace }

// Holder is this attempt's identity, <run>-a<N>.
func (r *Run) Holder() string { return r.info.holder }

// Fence is this attempt's fencing token.
func (r *Run) Fence() int64 { return r.info.fence }

// Attempt is the attempt number, from 1.
func (r *Run) Attempt() int { return r.info.attempt }

// Payload is the run's spec.payload as JSON ("{}" when it has none).
func (r *Run) Payload() json.RawMessage { return r.info.payload }

// IdempotencyKey is the run's idempotency key (spec.idempotencyKey, default the run's UID).
func (r *Run) IdempotencyKey() string { return r.info.idempotencyKey }

// ReviewFeedback is why a person denied the previous attempt's result (spec.review.result), for
// this attempt to act on; "" when none was (TETHER_REVIEW_FEEDBACK, or the claim's reviewFeedback).
func (r *Run) ReviewFeedback() string { return r.info.reviewFeedback }

// LeaseDuration is the lease's duration: ownership is unknown once no renewal was confirmed for
// this long, minus a margin.
func (r *Run) LeaseDuration() time.Duration { return r.info.leaseDuration }

// RenewInterval is how often the heartbeat renews.
func (r *Run) RenewInterval() time.Duration { return r.info.renewInterval }

// CheckpointCursor is the cursor to resume from: the one this attempt started with, or the last
// one it checkpointed ("" when none).
func (r *Run) CheckpointCursor() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cursor
}

// ToolClaim is the run's short-lived ServiceAccount token (external workers; nil for pods or
// when the gateway minted none).
func (r *Run) ToolClaim() *ToolClaim {
	if tc, ok := r.tr.(toolClaimer); ok {
		return tc.toolClaim()
	}
	return nil
}

// --- ownership -------------------------------------------------------------------

// Lost says whether the API server confirmed that this worker no longer owns the run.
func (r *Run) Lost() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lost
}

// Finished says whether a result or an error of this attempt was published: nothing more is reported.
func (r *Run) Finished() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.finished
}

// OwnershipUnknown says whether no renewal was confirmed recently enough to be sure of ownership
// (and it is not lost).
func (r *Run) OwnershipUnknown() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.unknownLocked()
}

func (r *Run) unknownLocked() bool {
	return !r.lost && (!r.confirmed || r.clock() > r.confirmedAt+r.info.leaseDuration-r.margin)
}

// Owned says whether ownership is confirmed: not lost, and not unknown.
func (r *Run) Owned() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return !r.lost && !r.unknownLocked()
}

// Signals is stop, paused, endsAt and what is left of the caps, as of the last renewal.
func (r *Run) Signals() Signals {
	r.mu.Lock()
	sig, own := r.signals, r.usage
	r.mu.Unlock()
	cents, tokens := sig.remaining(own)
	return Signals{Stop: sig.Stop, Paused: sig.Paused, Reason: sig.Reason, EndsAt: sig.EndsAt,
		CapRemainingCents: cents, CapRemainingTokens: tokens, Yielding: sig.Stop && sig.Yield, StopBy: sig.StopBy}
}

// EnsureOwner is the check before every side effect: ErrStopRequested, ErrLeaseLost or
// ErrOwnershipUnknown, or nil while ownership is confirmed.
func (r *Run) EnsureOwner() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.signals.Stop:
		reason := r.signals.Reason
		if reason == "" {
			reason = "the control plane asked this worker to stop"
		}
		return fmt.Errorf("%w: %s", ErrStopRequested, reason)
	case r.lost:
		return fmt.Errorf("%w: %s lost run %s/%s (fence %d)", ErrLeaseLost, r.info.holder, r.info.namespace,
			r.info.name, r.info.fence)
	case r.unknownLocked():
		if !r.confirmed {
			return fmt.Errorf("%w: no renewal confirmed yet", ErrOwnershipUnknown)
		}
		return fmt.Errorf("%w: no renewal confirmed for %.1fs", ErrOwnershipUnknown,
			(r.clock() - r.confirmedAt).Seconds())
	}
	return nil
}

// logAttrs are the fields every log line about this attempt carries.
func (r *Run) logAttrs(event string, extra ...any) []any {
	r.mu.Lock()
	var left any
	if r.confirmed {
		left = (r.confirmedAt + r.info.leaseDuration - r.clock()).Round(time.Millisecond).Seconds()
	}
	r.mu.Unlock()
	return append([]any{"event", event, "run", r.info.namespace + "/" + r.info.name, "attempt", r.info.attempt,
		"fence", r.info.fence, "holder", r.info.holder, "leaseDeadlineIn", left}, extra...)
}

func (r *Run) markLost(why string) {
	r.mu.Lock()
	already := r.lost
	r.lost = true
	if !already {
		r.notifyLocked()
	}
	r.mu.Unlock()
	if !already {
		r.log.Warn("lease lost", r.logAttrs("heartbeat_lost", "reason", why)...)
	}
}

// --- heartbeat -------------------------------------------------------------------

func (r *Run) heartbeat() {
	defer close(r.done)
	for {
		timer := time.NewTimer(r.info.renewInterval)
		select {
		case <-r.ctx.Done():
			timer.Stop()
			return
		case <-r.wake:
			timer.Stop()
		case <-timer.C:
		}
		r.mu.Lock()
		over := r.lost || r.finished
		r.mu.Unlock()
		if over {
			return
		}
		r.heartbeatOnce()
	}
}

// heartbeatOnce renews, surviving any failure: a dead heartbeat would leave the worker believing it
// owns the run until its deadline passes silently; a failed renewal only confirms nothing, so
// ownership turns unknown on schedule and a later renewal can confirm it again.
func (r *Run) heartbeatOnce() {
	defer func() {
		if p := recover(); p != nil {
			r.log.Error("heartbeat failed unexpectedly", r.logAttrs("heartbeat_error", "error", fmt.Sprint(p))...)
		}
	}()
	_ = r.renewOnce(r.ctx)
}

// renewOnce is one renewal: nil when confirmed, an ErrLeaseLost when the lease is lost, another
// error when unconfirmed (refused, or no answer). A span of the attempt's trace, ended however it ends.
// It is a tether.renew span only when it is news (renewalSpans), made afterwards with its start time.
func (r *Run) renewOnce(ctx context.Context) (err error) {
	r.renewMu.Lock()
	defer r.renewMu.Unlock()
	start := time.Now()
	r.mu.Lock()
	carried, _ := json.Marshal([]any{r.pendingCheckpoint, r.usage, r.requests})
	signals := r.signals
	r.mu.Unlock()
	err = r.renewTry(ctx)
	r.mu.Lock()
	signalsChanged := !sameSignals(signals, r.signals)
	r.mu.Unlock()
	outcome := renewalOutcome(err)
	if r.renewalSpans.news(outcome, string(carried), signalsChanged) {
		_, span := r.startSpanAt(ctx, start, "tether.renew", trace.SpanKindClient,
			append(r.renewalSpans.skipped(), attribute.String("tether.renewal", outcome))...)
		endSpan(span, err)
	}
	return err
}

// renewTry is one renewal; r.renewMu is held.
func (r *Run) renewTry(ctx context.Context) error {
	r.mu.Lock()
	lost, checkpoint, own, requests := r.lost, r.pendingCheckpoint, r.usage, slices.Clone(r.requests)
	r.mu.Unlock()
	if lost {
		return fmt.Errorf("%w: not renewing", ErrLeaseLost)
	}
	started := r.clock()
	rctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	res, err := r.tr.renew(rctx, checkpoint, own, requests)
	switch {
	case err != nil:
		r.log.Warn("heartbeat got no answer", r.logAttrs("heartbeat_unanswered", "error", err.Error())...)
		return fmt.Errorf("tether: renewal got no answer: %w", err)
	case res.lost:
		r.markLost(res.why)
		return fmt.Errorf("%w: %s", ErrLeaseLost, res.why)
	case !res.ok:
		r.log.Warn("heartbeat refused", r.logAttrs("heartbeat_refused", "reason", res.why)...)
		return fmt.Errorf("tether: renewal not confirmed: %s", res.why)
	}
	r.mu.Lock()
	r.confirmed, r.confirmedAt = true, started
	changed := false
	if res.signals != nil {
		changed = !sameSignals(*res.signals, r.signals)
		r.signals = *res.signals
		if changed {
			r.notifyLocked()
		}
	}
	r.mu.Unlock()
	r.log.Debug("heartbeat ok", r.logAttrs("heartbeat_ok")...)
	if changed {
		s := *res.signals
		r.log.Info("control signals changed", r.logAttrs("signals_changed", "stop", s.Stop, "paused", s.Paused,
			"reason", s.Reason)...)
	}
	return nil
}

// sameSignals compares two signal states by value (their optional fields are pointers).
func sameSignals(a, b signalState) bool {
	eqInt := func(x, y *int64) bool { return (x == nil) == (y == nil) && (x == nil || *x == *y) }
	eqTime := func(x, y *time.Time) bool { return (x == nil) == (y == nil) && (x == nil || x.Equal(*y)) }
	return a.Stop == b.Stop && a.Paused == b.Paused && a.Reason == b.Reason && a.BaseCents == b.BaseCents &&
		a.BaseTokens == b.BaseTokens && eqInt(a.CapCents, b.CapCents) && eqInt(a.CapTokens, b.CapTokens) &&
		eqTime(a.EndsAt, b.EndsAt) && maps.Equal(a.Decisions, b.Decisions) && a.Yield == b.Yield &&
		eqTime(a.StopBy, b.StopBy)
}

// --- approvals -------------------------------------------------------------------

// notifyLocked wakes a waiting RequestApproval; r.mu is held.
func (r *Run) notifyLocked() {
	close(r.changed)
	r.changed = make(chan struct{})
}

// RequestApproval asks a person to approve a step (a WorkerRunApproval with spec.gate name) and
// waits until the control plane says Approve, Deny or TimedOut (after timeoutSeconds, counted by
// the operator from when it saw the request; nil: no timeout). The request rides on this
// attempt's renewals, which only its holder can write; the decision comes back on them, and only
// for this attempt. While waiting it renews every 2 s so the decision arrives promptly. Asking
// again for a name already asked returns its decision (the first details and timeout stand).
//
// Errors: ErrRequestRefused for a request the control plane would refuse (nothing is sent): a
// malformed one, a 21st of the attempt, or one that would make its requests exceed 64 KiB; ErrLeaseLost, ErrOwnershipUnknown or ErrStopRequested when the
// attempt can act on no decision (ownership lost or unknown, told to stop, or the Run closed
// meanwhile); the context's error.
func (r *Run) RequestApproval(ctx context.Context, name, details string, timeoutSeconds *int) (ApprovalDecision, error) {
	if why := requestRefusal(name, details, timeoutSeconds); why != "" {
		return ApprovalDecision{}, fmt.Errorf("%w: %s", ErrRequestRefused, why)
	}
	r.mu.Lock()
	known := slices.ContainsFunc(r.requests, func(q approvalRequest) bool { return q.Name == name })
	if !known && len(r.requests) >= maxRequestsPerAttempt {
		r.mu.Unlock()
		return ApprovalDecision{}, fmt.Errorf("%w: an attempt may make at most %d requests", ErrRequestRefused,
			maxRequestsPerAttempt)
	}
	if !known {
		asked := append(slices.Clone(r.requests), approvalRequest{Name: name, Details: details, TimeoutSeconds: timeoutSeconds})
		if len(requestsAnnotation(asked)) > maxRequestsBytes {
			r.mu.Unlock()
			return ApprovalDecision{}, fmt.Errorf("%w: this attempt's requests would exceed %d bytes", ErrRequestRefused,
				maxRequestsBytes)
		}
		r.requests = asked
	}
	r.mu.Unlock()
	r.log.Info("approval requested", r.logAttrs("approval_requested", "request", name)...)
	_ = r.renewOnce(ctx) // its failure shows in EnsureOwner below, in time
	for {
		r.mu.Lock()
		decided, ok := r.signals.Decisions[name]
		changed := r.changed
		r.mu.Unlock()
		if ok {
			r.log.Info("approval decided", r.logAttrs("approval_decided", "request", name, "decision", decided.Decision)...)
			return decided, nil
		}
		if err := r.EnsureOwner(); err != nil { // lost, unknown or told to stop: no decision can be acted on
			return ApprovalDecision{}, err
		}
		timer := time.NewTimer(r.poll)
		select {
		case <-ctx.Done():
			timer.Stop()
			return ApprovalDecision{}, ctx.Err()
		case <-r.ctx.Done(): // closed: no renewal will bring a decision
			timer.Stop()
			return ApprovalDecision{}, fmt.Errorf("%w: the run was closed while waiting for an approval", ErrStopRequested)
		case <-changed:
			timer.Stop()
		case <-timer.C:
			_ = r.renewOnce(ctx)
		}
	}
}

// --- child runs (docs/children.md) -------------------------------------------------

const (
	// judgedWithin is how long a resumed attempt waits for the operator's word on a child an earlier
	// attempt spawned, reading it every judgePoll.
	judgedWithin = 60 * time.Second
	judgePoll    = 500 * time.Millisecond
	// childPoll is how often Result reads the child unless told otherwise.
	childPoll = 2 * time.Second
)

// SpawnOptions is what a child run is asked to do.
type SpawnOptions struct {
	ClassName string         // its WorkerClass ("": none)
	Payload   map[string]any // its spec.payload (nil: none)
	// Its share of this run's caps: a capped run's child names one for each cap.
	CapCents  *int64
	MaxTokens *int64
	Spec      map[string]any // any other WorkerRun spec fields, such as its pod template
}

// Child is a child run this attempt spawned (Spawn): its name, and its state as last read.
type Child struct {
	run       *Run
	key, name string

	mu   sync.Mutex
	view *childView
}

// Name is the child WorkerRun's name.
func (c *Child) Name() string { return c.name }

// Key is the key it was spawned for.
func (c *Child) Key() string { return c.key }

// Phase is the child's status.phase as last read ("" while it has none).
func (c *Child) Phase() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.view.Status.Phase
}

// Spawn starts one tool call as a child run of this one (docs/children.md): a WorkerRun of its own,
// with its own lease, retries and result, fenced by this attempt and under this run's budget. The
// key names the call stably (1 to 128 letters, digits and . _ : / -, starting and ending with a
// letter or digit): spawning it again, from this attempt or a later one that resumed from a
// checkpoint, finds the same child instead of creating another. A child that an earlier attempt
// spawned and the operator rejected as a stale attempt's (it never ran) moves the key to its next
// generation; one the operator has not judged yet is waited for, up to a minute.
//
// Errors: ErrStopRequested, ErrLeaseLost or ErrOwnershipUnknown (this attempt may not act: nothing
// is sent); ErrSpawnConflict (the key's child was asked for another spec, or a run of its name is
// not this run's child); ErrSpawnRefused (the API server, or the gateway for it, refused it, with
// why); another error for a malformed key, a pod's capped run's child that names no share of a cap
// (through the gateway: ErrSpawnRefused), or no answer.
func (r *Run) Spawn(ctx context.Context, key string, opts SpawnOptions) (*Child, error) {
	if err := r.EnsureOwner(); err != nil { // a stale or stopping attempt spawns nothing
		return nil, err
	}
	if !childKey.MatchString(key) {
		return nil, fmt.Errorf("tether: child key %q must be 1 to 128 letters, digits and . _ : / - "+
			"(starting and ending with a letter or digit)", key)
	}
	p, err := r.asParent(ctx)
	if err != nil {
		return nil, err
	}
	spec, err := childSpec(p, opts)
	if err != nil {
		return nil, err
	}
	view, err := r.spawnChild(ctx, p, key, spec)
	if err != nil {
		return nil, err
	}
	r.log.Info("child spawned", r.logAttrs("child_spawned", "child", view.Metadata.Name, "key", key)...)
	return &Child{run: r, key: key, name: view.Metadata.Name, view: view}, nil
}

// Call spawns the child (Spawn) and waits for its result (Child.Result).
func (r *Run) Call(ctx context.Context, key string, opts SpawnOptions, poll time.Duration) (map[string]any, error) {
	child, err := r.Spawn(ctx, key, opts)
	if err != nil {
		return nil, err
	}
	return child.Result(ctx, poll)
}

// asParent is this run as its children name it, read once, at the first spawn.
func (r *Run) asParent(ctx context.Context) (parentRun, error) {
	r.mu.Lock()
	known := r.parent
	r.mu.Unlock()
	if known != nil {
		return *known, nil
	}
	p, err := childCall(ctx, r, r.tr.parent)
	if err != nil {
		return parentRun{}, err
	}
	r.mu.Lock()
	r.parent = &p
	r.mu.Unlock()
	return p, nil
}

// spawnChild creates the child for key, or finds the one made before (by this attempt or an
// earlier one), past the children of that key rejected as stale attempts': each moves the key to
// its next generation, deterministically, so every attempt finds the same.
func (r *Run) spawnChild(ctx context.Context, p parentRun, key string, spec map[string]any) (*childView, error) {
	digest := spawnDigest(spec)
	generation := 0
	for tries := 0; generation < maxGenerations && tries < 3*maxGenerations; tries++ {
		req := spawnRequest{parent: p, key: key, generation: generation, spec: spec}
		got, err := childCall(ctx, r, func(ctx context.Context) (*childView, error) { return r.tr.spawn(ctx, req) })
		if err != nil {
			return nil, err
		}
		if err := got.conflict(p, key, digest); err != nil {
			return nil, err
		}
		if !got.spawnedBy(r.info.holder, r.info.fence) && got.Status.Phase == "" {
			// An earlier attempt's child the operator has not judged yet: admitted (it is this call's)
			// or rejected as a stale attempt's (the key moves on). Wait for the word.
			if got, err = r.judged(ctx, got.Metadata.Name); err != nil {
				return nil, err
			}
			if got == nil {
				continue // deleted while it was waited for: made again, under the same generation
			}
		}
		if got.staleRejected() {
			generation++ // a lost attempt's child, never admitted and never run: the key moves on
			continue
		}
		return got, nil
	}
	return nil, fmt.Errorf("%w: key %q: %d children rejected as stale attempts' (or deleted) in a row",
		ErrSpawnConflict, key, maxGenerations)
}

// judged reads an earlier attempt's child until the operator has judged it (it has a phase); nil
// when it was deleted meanwhile.
func (r *Run) judged(ctx context.Context, name string) (*childView, error) {
	for waited := time.Duration(0); waited < judgedWithin; waited += judgePoll {
		if err := r.sleep(ctx, judgePoll); err != nil {
			return nil, err
		}
		got, err := r.readChild(ctx, name)
		if err != nil || got == nil || got.Status.Phase != "" {
			return got, err
		}
	}
	return nil, fmt.Errorf("%w: %s, spawned by an earlier attempt, was not judged within %v; spawn it again",
		ErrSpawnConflict, name, judgedWithin)
}

// readChild reads a child run within the request timeout; nil when it is gone.
func (r *Run) readChild(ctx context.Context, name string) (*childView, error) {
	return childCall(ctx, r, func(ctx context.Context) (*childView, error) { return r.tr.child(ctx, name) })
}

// childCall is one transport call of a spawn or of a wait for a child, within the request timeout.
// An answer that says the attempt is not the run's marks it lost; the caller's context ending is
// the error.
func childCall[T any](ctx context.Context, r *Run, call func(context.Context) (T, error)) (T, error) {
	cctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	got, err := call(cctx)
	switch {
	case err == nil:
	case ctx.Err() != nil:
		return got, ctx.Err()
	case errors.Is(err, ErrLeaseLost):
		r.markLost(err.Error())
	}
	return got, err
}

// Result waits until the child run ended, reading it every poll (0: every 2 s), and returns its
// result once it Succeeded. A child's result reaches only an attempt that holds this run: once the
// child ended, this attempt must still own the run.
//
// Errors: a *ChildFailedError (errors.Is ErrChildFailed) for any other end, or when the child was
// deleted meanwhile; ErrLeaseLost, ErrOwnershipUnknown or ErrStopRequested when this attempt may
// not act on the result; the context's error; another error when a read got no answer (Result may
// be called again).
func (c *Child) Result(ctx context.Context, poll time.Duration) (map[string]any, error) {
	if poll <= 0 {
		poll = childPoll
	}
	ended, err := c.waitEnded(ctx, poll)
	if err != nil {
		return nil, err
	}
	if err := c.run.EnsureOwner(); err != nil {
		return nil, err
	}
	return ended.outcome()
}

// waitEnded reads the child every poll until it ended.
func (c *Child) waitEnded(ctx context.Context, poll time.Duration) (*childView, error) {
	for {
		got, err := c.run.readChild(ctx, c.name)
		if err != nil {
			return nil, err
		}
		if got == nil {
			return nil, &ChildFailedError{Name: c.name, Phase: "Deleted", Reason: "Deleted",
				Message: "the child run was deleted"}
		}
		c.mu.Lock()
		c.view = got
		c.mu.Unlock()
		if got.ended() {
			return got, nil
		}
		if err := c.run.sleep(ctx, poll); err != nil {
			return nil, err
		}
	}
}

// --- progress --------------------------------------------------------------------

// Checkpoint records progress: the cursor rides on the next renewal. With flush it renews now and
// returns that renewal's failure (an ErrLeaseLost when the lease is lost), so a worker about to
// exit knows its checkpoint went out. A cursor over 1024 characters is refused.
func (r *Run) Checkpoint(cursor string, flush bool) error {
	if why := validCursor(cursor); why != "" {
		return fmt.Errorf("tether: %s", why)
	}
	r.mu.Lock()
	r.pendingCheckpoint = &cursor
	r.cursor = cursor
	r.mu.Unlock()
	if flush {
		ctx, span := r.startSpan(r.ctx, "tether.checkpoint", trace.SpanKindInternal)
		err := r.renewOnce(ctx)
		endSpan(span, err)
		return err
	}
	return nil
}

// ReportUsage records this attempt's cumulative usage; it rides on the next renewal. A report the
// operator would refuse (negative, decreasing, over 10^11 cents or 10^14 tokens) is an
// ErrUsageRefused, and the previous report stands. A report that uses up what is left of the run's
// cap (Signals().CapRemainingCents / CapRemainingTokens reaching 0) wakes the heartbeat: the
// control plane hears of it at once.
func (r *Run) ReportUsage(cents, tokens int64) error {
	report := usage{Cents: cents, Tokens: tokens}
	r.mu.Lock()
	if why := validReport(report, r.usage); why != "" {
		r.mu.Unlock()
		return fmt.Errorf("%w: %s", ErrUsageRefused, why)
	}
	usedUp := capUsedUp(r.signals.remaining(&report))
	crossed := usedUp != "" && capUsedUp(r.signals.remaining(r.usage)) == ""
	r.usage = &report
	r.mu.Unlock()
	if crossed {
		// This report used up what the control plane said was left of a cap: tell it now, not at
		// the end of the renew interval (the meter refuses further requests already).
		r.log.Info("usage report reached the cap; renewing now", r.logAttrs("cap_used_up", "reason", usedUp)...)
		r.wakeHeartbeat()
	}
	return nil
}

// --- results ---------------------------------------------------------------------

// Complete publishes the result (a JSON object) with one fenced write. Errors: ErrLeaseLost (the
// run moved on; nothing was published), ErrResultInvalid (the value was refused; the worker still
// owns the run and may publish a corrected one), ErrOwnershipUnknown (no answer until the lease
// deadline), or the context's error.
func (r *Run) Complete(ctx context.Context, result any) error {
	return r.publish(ctx, "result", result)
}

// Fail publishes a failure {"code","message"} with one fenced write; retry rules decide what
// follows. Its errors are Complete's.
func (r *Run) Fail(ctx context.Context, code, message string) error {
	return r.publish(ctx, "error", map[string]string{"code": code, "message": message})
}

func (r *Run) publish(ctx context.Context, field string, value any) (err error) {
	ctx, span := r.startSpan(ctx, "tether.publish", trace.SpanKindClient, attribute.String("tether.publication", field))
	defer func() { endSpan(span, err) }()
	return r.publishTraced(ctx, field, value)
}

func (r *Run) publishTraced(ctx context.Context, field string, value any) error {
	raw, err := json.Marshal(value)
	if err != nil {
		return fmt.Errorf("tether: the %s is not JSON: %w", field, err)
	}
	// Usage and the last checkpoint go out with a final renewal, so nothing is left behind; a
	// confirmed one also moves the deadline below. Its failure is no reason not to try.
	_ = r.renewOnce(ctx)
	delay := 500 * time.Millisecond
	// A try with no answer, or a 5xx (which does not say whether the write was applied), may have
	// landed; a 4xx was refused before any write.
	unanswered := false
	for {
		// Lost (the final renewal, or the heartbeat meanwhile): publish nothing more, unless an
		// earlier try may have landed; then the retry and the look-up below tell.
		if !unanswered && r.Lost() {
			r.log.Error("result rejected: lease lost", r.logAttrs("result_rejected", "field", field)...)
			return fmt.Errorf("%w: the %s was not published", ErrLeaseLost, field)
		}
		res, err := r.tryPublish(ctx, field, raw)
		if err == nil && res.outcome == refused && unanswered {
			var landed bool
			if landed, err = r.lookUp(ctx, field, raw); err == nil && landed {
				res.outcome = published
			}
		}
		if err == nil && res.outcome != retry {
			return r.settle(field, res)
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil || res.status >= http.StatusInternalServerError {
			unanswered = true
		}
		why := res.why
		if err != nil {
			why = err.Error()
		}
		wait := max(delay, res.retryAfter)
		// Read after the try, which may have taken the publication timeout: the heartbeat went on
		// confirming meanwhile, and the deadline follows it.
		r.mu.Lock()
		deadline, confirmed := r.confirmedAt+r.info.leaseDuration, r.confirmed
		r.mu.Unlock()
		if !confirmed || r.clock()+wait > deadline {
			r.log.Error("publication unanswered until the lease deadline",
				r.logAttrs("result_unknown", "field", field, "error", why)...)
			return fmt.Errorf("%w: could not publish the %s: %s", ErrOwnershipUnknown, field, why)
		}
		r.log.Warn("publication not answered; retrying", r.logAttrs("result_retry", "field", field,
			"error", why, "retryIn", wait.Seconds())...)
		if err := r.sleep(ctx, wait); err != nil {
			return err
		}
		delay = min(2*delay, 5*time.Second)
	}
}

// tryPublish is one try of a publication, within the publication timeout.
func (r *Run) tryPublish(ctx context.Context, field string, raw json.RawMessage) (publishResult, error) {
	pctx, cancel := context.WithTimeout(ctx, publicationTimeout)
	defer cancel()
	return r.tr.publish(pctx, field, raw)
}

// lookUp asks whether an earlier try whose answer was lost landed, within the publication timeout.
func (r *Run) lookUp(ctx context.Context, field string, raw json.RawMessage) (bool, error) {
	lctx, cancel := context.WithTimeout(ctx, publicationTimeout)
	defer cancel()
	return r.tr.recorded(lctx, field, raw)
}

// settle turns a definite answer to a publication into the Run's state and the caller's error.
func (r *Run) settle(field string, res publishResult) error {
	switch res.outcome {
	case published:
		r.mu.Lock()
		r.finished = true
		r.mu.Unlock()
		r.wakeHeartbeat() // it sees finished and ends
		r.log.Info(field+" published", r.logAttrs("result_published", "field", field)...)
		return nil
	case invalid:
		r.log.Error(field+" refused as invalid", r.logAttrs("result_invalid", "field", field, "reason", res.why)...)
		return &ResultInvalidError{Field: field, Message: res.why, Causes: res.causes}
	default:
		r.markLost("the run's fence or holder moved on")
		r.log.Error(field+" rejected", r.logAttrs("result_rejected", "field", field, "reason", res.why)...)
		return fmt.Errorf("%w: the %s was rejected: fence %d is no longer current (%s)", ErrLeaseLost, field,
			r.info.fence, res.why)
	}
}

func (r *Run) wakeHeartbeat() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// --- side effects ----------------------------------------------------------------

// EffectHeaders are the headers of a side effect: Idempotency-Key <idempotencyKey>:<operation>,
// stable across attempts, and X-Execution-Fence, this attempt's fence.
func (r *Run) EffectHeaders(operation string) http.Header {
	h := http.Header{}
	h.Set("Idempotency-Key", r.info.idempotencyKey+":"+operation)
	h.Set("X-Execution-Fence", fmt.Sprint(r.info.fence))
	return h
}

// Effect sends one side effect, fenced: it refuses to start unless ownership is confirmed
// (EnsureOwner's errors), and sends EffectHeaders(operation) with the request. A call that does
// not answer in time (the effect client's timeout, or the context's deadline) is an
// ErrToolTimeout, not a question of ownership. The caller closes the response body.
func (r *Run) Effect(ctx context.Context, req *http.Request, operation string) (*http.Response, error) {
	if err := r.EnsureOwner(); err != nil {
		return nil, err
	}
	ctx, span := r.startSpan(ctx, "tether.effect", trace.SpanKindClient, attribute.String("tether.operation", operation),
		attribute.String("http.request.method", req.Method), attribute.String("url.full", redactURL(req.URL)))
	out := req.Clone(ctx)
	// The receiver may join the trace; it must trust the fence below, never this.
	injectTraceHeaders(ctx, out.Header)
	for k, v := range r.EffectHeaders(operation) {
		out.Header[k] = v
	}
	resp, err := r.effectClient.Do(out)
	if err == nil {
		span.SetAttributes(attribute.Int("http.response.status_code", resp.StatusCode))
	}
	endSpan(span, err)
	if err != nil {
		var ne net.Error
		if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
			return nil, fmt.Errorf("%w: %s %s: %w", ErrToolTimeout, req.Method, redactURL(req.URL), err)
		}
		return nil, err
	}
	return resp, nil
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
