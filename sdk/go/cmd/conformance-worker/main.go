// Command conformance-worker is the Go SDK's conformance worker: the program described in
// conformance/WORKER.md, written with the SDK's public API only. The conformance kit starts it as
// a pod's command, or as a local process for an External run (TETHER_GATEWAY_URL set), and judges
// it only through the protocol.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"os"
	"os/signal"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	tether "github.com/tether-dev/tether/sdk/go"
)

// Exit codes of the program (conformance/WORKER.md; the same as the Python and TypeScript ones).
const (
	exitDone        = 0  // published, or stopped as told, or cannot afford the next step
	exitLost        = 1  // ownership lost (or the receiver said our fence is stale)
	exitUnknown     = 2  // ownership unknown until the lease deadline
	exitCrash       = 3  // crashed on purpose
	exitNotStarted  = 4  // the attempt could not start (a refused claim, no environment, ...)
	exitInvalidTook = 5  // the invalid result was accepted: the SDK failed to report it
	exitBroken      = 70 // the program itself failed: never mistaken for lost (1) or unknown (2)
)

// gatePoll is how often the gate looks again (at most 100 ms), and how long a step waits before
// going back to it after a side effect that did not happen (not a busy loop against the receiver).
const gatePoll = 100 * time.Millisecond

// childPoll is how often the program reads the child it waits for (at most every second).
const childPoll = 500 * time.Millisecond

// script is the run's payload.
type script struct {
	Steps          int     `json:"steps"`
	StepSeconds    float64 `json:"stepSeconds"`
	EffectURL      string  `json:"effectUrl"`
	CentsPerStep   int64   `json:"centsPerStep"`
	TokensPerStep  int64   `json:"tokensPerStep"`
	CrashAttempts  []int   `json:"crashAttempts"`
	CrashAfterStep int     `json:"crashAfterStep"`
	FailAttempts   []int   `json:"failAttempts"`
	BadResultFirst bool    `json:"badResultFirst"`
	// OversizeResultFirst: characters of padding in a result tried first, larger than the API
	// server or the gateway accepts (0: none).
	OversizeResultFirst int `json:"oversizeResultFirst"`
	Approval            *struct {
		Name           string `json:"name"`
		Details        string `json:"details"`
		TimeoutSeconds *int   `json:"timeoutSeconds"`
	} `json:"approval"`
	Spawn *spawnScript `json:"spawn"`
}

// spawnScript is the child run the script spawns before the first step of every attempt.
type spawnScript struct {
	Key       string         `json:"key"`
	ClassName string         `json:"className"`
	Payload   map[string]any `json:"payload"`
	CapCents  *int64         `json:"capCents"`
	MaxTokens *int64         `json:"maxTokens"`
	Spec      map[string]any `json:"spec"`
}

// options asks for the script's child with this payload.
func (s *spawnScript) options(payload map[string]any) tether.SpawnOptions {
	return tether.SpawnOptions{ClassName: s.ClassName, Payload: payload, CapCents: s.CapCents, MaxTokens: s.MaxTokens,
		Spec: s.Spec}
}

func main() {
	// The crash's code reaches os.Exit straight from run, which leaves that Run unclosed.
	os.Exit(run())
}

// run is the program; it returns the exit code. Every exit but the crash closes the run first: its
// last renewal reports the usage and checkpoint of the steps done since the previous one.
func run() (code int) {
	// The program models a worker on a partitioned node, whose kubelet cannot tell it the pod was
	// deleted: only the protocol may stop it.
	signal.Ignore(syscall.SIGTERM)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	slog.SetDefault(log)
	defer recovered(log, &code)
	ctx := context.Background()

	var r *tether.Run
	r, code = start(ctx, log)
	if r == nil {
		return code
	}
	code = guarded(log, func() int { return attempt(ctx, log, r) })
	if code != exitCrash { // the crash leaves as a crash does, reporting nothing more
		_ = r.Close()
	}
	return code
}

// recovered, deferred, turns a panic into the program's own failure: Go's exit code for one, 2,
// would read as "ownership unknown".
func recovered(log *slog.Logger, code *int) {
	if p := recover(); p != nil {
		log.Error("the program failed", "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
		*code = exitBroken
	}
}

// guarded runs f; a panic in it is exitBroken, so that the run is still closed after it.
func guarded(log *slog.Logger, f func() int) (code int) {
	defer recovered(log, &code)
	return f()
}

// attempt runs the started attempt: its child (when the script spawns one), its steps, then its
// publication. It never closes the run.
func attempt(ctx context.Context, log *slog.Logger, r *tether.Run) int {
	s := script{Steps: 3, StepSeconds: 0.5, CrashAfterStep: 1}
	if err := json.Unmarshal(r.Payload(), &s); err != nil {
		log.Error("the payload is not a conformance script", "error", err)
		return exitBroken
	}
	cursor := 0
	if c := r.CheckpointCursor(); c != "" {
		n, err := strconv.Atoi(c)
		if err != nil {
			log.Error("the checkpoint is not a step number", "checkpoint", c)
			return exitBroken
		}
		cursor = n
	}
	log.Info("attempt started", "run", r.Name(), "attempt", r.Attempt(), "fence", r.Fence(), "resumeFrom", cursor)

	spawned, code, ok := spawnChild(ctx, log, r, s)
	if !ok {
		return code
	}
	var done int64
	for step := cursor; step < s.Steps; step++ {
		if code, ok := doStep(ctx, log, r, s, step); !ok {
			return code
		}
		done++
		cp := strconv.Itoa(step + 1)
		if err := r.Checkpoint(cp, false); err != nil {
			log.Error("checkpoint refused", "error", err)
			return exitBroken
		}
		if err := r.ReportUsage(done*s.CentsPerStep, done*s.TokensPerStep); err != nil {
			log.Error("usage refused", "error", err)
			return exitBroken
		}
		if slices.Contains(s.CrashAttempts, r.Attempt()) && step+1 == s.CrashAfterStep {
			if err := flush(r, cp); err != nil {
				log.Warn("the checkpoint before the crash was not confirmed", "error", err)
			}
			log.Info("crashing on purpose", "step", step)
			return exitCrash
		}
	}
	return publish(ctx, log, r, s, spawned)
}

// spawnChild spawns the script's child (when it has one), waits for its result, then spawns its
// key again with another payload, which the SDK must refuse as a conflict: what it adds to the
// result. ok false: exit with code (a child that ended without a result, or a spawn refused, was
// published as the attempt's failure).
func spawnChild(ctx context.Context, log *slog.Logger, r *tether.Run, s script) (map[string]any, int, bool) {
	sp := s.Spawn
	if sp == nil {
		return nil, 0, true
	}
	child, err := r.Spawn(ctx, sp.Key, sp.options(sp.Payload))
	if err != nil {
		return nil, spawnFailed(ctx, log, r, err), false
	}
	log.Info("child spawned", "child", child.Name(), "phase", child.Phase())
	result, err := child.Result(ctx, childPoll)
	if err != nil {
		return nil, spawnFailed(ctx, log, r, err), false
	}
	_, err = r.Spawn(ctx, sp.Key, sp.options(map[string]any{"conflict": true}))
	conflictRefused := errors.Is(err, tether.ErrSpawnConflict)
	if err != nil && !conflictRefused {
		return nil, spawnFailed(ctx, log, r, err), false
	}
	log.Info("the child ended", "child", child.Name(), "conflictRefused", conflictRefused)
	return map[string]any{"child": map[string]any{"name": child.Name(), "result": result},
		"conflictRefused": conflictRefused}, 0, true
}

// spawnFailed ends the attempt after a spawn or a wait for the child failed: a child that ended
// without a result and a spawn refused are published as the attempt's failure; told to stop, it
// stops; the rest ends as a publication's outcome would.
func spawnFailed(ctx context.Context, log *slog.Logger, r *tether.Run, err error) int {
	var failed *tether.ChildFailedError
	switch {
	case errors.As(err, &failed):
		log.Info("the child ended without a result", "error", err)
		return outcome(log, r.Fail(ctx, "ConformanceChildFailed",
			fmt.Sprintf("%s ended %s (%s)", failed.Name, failed.Phase, failed.Reason)))
	case errors.Is(err, tether.ErrSpawnRefused):
		log.Info("the spawn was refused", "error", err)
		return outcome(log, r.Fail(ctx, "ConformanceSpawnRefused", err.Error()))
	case errors.Is(err, tether.ErrStopRequested):
		log.Info("stopping as told", "error", err)
		return exitDone
	}
	return outcome(log, err)
}

// flush renews with the checkpoint until a renewal is confirmed or the run is lost, at most once per
// renew interval (like the heartbeat) and for at most the lease duration: the checkpoint must land
// before the crash. It returns the last renewal's failure.
func flush(r *tether.Run, cp string) error {
	deadline := time.Now().Add(r.LeaseDuration())
	for {
		err := r.Checkpoint(cp, true)
		if err == nil || errors.Is(err, tether.ErrLeaseLost) || !time.Now().Before(deadline) {
			return err
		}
		time.Sleep(r.RenewInterval())
	}
}

// start begins the attempt: from the pod's environment, or by claiming it through the gateway.
func start(ctx context.Context, log *slog.Logger) (*tether.Run, int) {
	gateway := os.Getenv("TETHER_GATEWAY_URL")
	if gateway == "" {
		r, err := tether.FromEnv(ctx)
		if err != nil {
			log.Error("cannot start the attempt", "error", err)
			return nil, exitNotStarted
		}
		return r, 0
	}
	token, err := os.ReadFile(os.Getenv("TETHER_GATEWAY_TOKEN_FILE"))
	if err != nil {
		log.Error("cannot read the gateway token", "error", err)
		return nil, exitNotStarted
	}
	var opts []tether.Option
	if id := os.Getenv("TETHER_WORKER_ID"); id != "" {
		opts = append(opts, tether.WithWorkerID(id))
	}
	r, err := tether.Claim(ctx, gateway, os.Getenv("TETHER_NAMESPACE"), os.Getenv("TETHER_RUN"),
		strings.TrimSpace(string(token)), opts...)
	if err != nil {
		log.Error("claim failed", "error", err)
		return nil, exitNotStarted
	}
	return r, 0
}

// doStep runs one step: gate, work, side effect. ok false: exit with code.
func doStep(ctx context.Context, log *slog.Logger, r *tether.Run, s script, step int) (int, bool) {
	for {
		if code, ok := gate(log, r, s); !ok {
			return code, false
		}
		time.Sleep(time.Duration(s.StepSeconds * float64(time.Second)))
		if s.EffectURL == "" {
			return 0, true
		}
		req, err := effectRequest(ctx, r, s.EffectURL, step)
		if err != nil {
			log.Error("cannot make the side effect's request", "step", step, "error", err)
			return exitBroken, false
		}
		status, refusal, err := sendEffect(r, req, step)
		switch {
		case err != nil:
			// Refused by the SDK (lost, unknown, stop), or no answer (a tool timeout, a connection
			// error): back to the gate, for the same key.
			log.Warn("side effect not sent or not answered: back to the gate", "step", step, "error", err)
		case status >= 200 && status < 300:
			return 0, true
		case status == http.StatusConflict && refusal == "InProgress":
			// An earlier try of this very key is still running at the receiver: not a stale fence.
			log.Info("the receiver is still running this step's effect: back to the gate", "step", step)
		case status == http.StatusConflict && refusal == "StaleFence":
			log.Error("the receiver refused our fence", "step", step)
			return exitLost, false
		case status >= 500:
			// A receiver stores no 5xx: the effect did not happen.
			log.Warn("the receiver failed: back to the gate", "step", step, "status", status)
		default:
			log.Error("the receiver answered what the program has no rule for", "step", step, "status", status,
				"error", refusal)
			return exitBroken, false
		}
		time.Sleep(gatePoll)
	}
}

// gate waits until the step may start; ok false: exit with code.
func gate(log *slog.Logger, r *tether.Run, s script) (int, bool) {
	for {
		sig := r.Signals()
		switch {
		case sig.Stop:
			log.Info("stopping as told", "reason", sig.Reason)
			return exitDone, false
		case sig.CapRemainingCents != nil && *sig.CapRemainingCents < s.CentsPerStep,
			sig.CapRemainingTokens != nil && *sig.CapRemainingTokens < s.TokensPerStep:
			log.Info("the cap cannot afford the next step")
			return exitDone, false
		case r.Lost():
			log.Error("ownership lost")
			return exitLost, false
		case sig.Paused || r.OwnershipUnknown():
			time.Sleep(gatePoll)
		default:
			return 0, true
		}
	}
}

// effectRequest is the step's side effect: {"run", "attempt", "fence", "step"} to url.
func effectRequest(ctx context.Context, r *tether.Run, url string, step int) (*http.Request, error) {
	body, err := json.Marshal(map[string]any{"run": r.Name(), "attempt": r.Attempt(), "fence": r.Fence(), "step": step})
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	return req, nil
}

// sendEffect sends the step's side effect through the SDK's fenced call; it returns the answer's
// status and the receiver's error ({"error": "InProgress" | "StaleFence"}; "" when the body has
// none). An error: the SDK refused to send it, or it got no answer.
func sendEffect(r *tether.Run, req *http.Request, step int) (int, string, error) {
	resp, err := r.Effect(req.Context(), req, fmt.Sprintf("step-%d", step))
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	var answer struct {
		Error string `json:"error"`
	}
	_ = json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&answer) // any body: only the error matters
	return resp.StatusCode, answer.Error, nil
}

// publish ends the attempt with its error, or with its result (after the approval and the invalid
// result, when the script asks for them), with what the child adds (spawned).
func publish(ctx context.Context, log *slog.Logger, r *tether.Run, s script, spawned map[string]any) int {
	if slices.Contains(s.FailAttempts, r.Attempt()) {
		return outcome(log, r.Fail(ctx, "ConformanceFailure", fmt.Sprintf("attempt %d fails on purpose", r.Attempt())))
	}
	result := map[string]any{"steps": s.Steps, "attempt": r.Attempt(), "sdk": "go"}
	maps.Copy(result, spawned)
	if a := s.Approval; a != nil {
		d, err := r.RequestApproval(ctx, a.Name, a.Details, a.TimeoutSeconds)
		if errors.Is(err, tether.ErrStopRequested) {
			log.Info("stopped while waiting for an approval: nothing published", "error", err)
			return exitDone
		}
		if err != nil {
			return outcome(log, err)
		}
		result["approval"] = map[string]any{"decision": d.Decision, "reason": d.Reason, "approver": d.Approver}
	}
	var bad []any // results the SDK must refuse as bad ones, tried in this order
	if s.BadResultFirst {
		bad = append(bad, []int{1})
	}
	if s.OversizeResultFirst > 0 {
		bad = append(bad, map[string]any{"pad": strings.Repeat("x", s.OversizeResultFirst)})
	}
	for _, value := range bad {
		if code, ok := refusedAsBad(ctx, log, r, value); !ok {
			return code
		}
	}
	err := r.Complete(ctx, result)
	if errors.Is(err, tether.ErrResultInvalid) {
		// WORKER.md: a real result refused as a bad one is followed by a failure, so a refusal
		// mistaken for a bad result shows as a second publication.
		err = r.Fail(ctx, "ConformanceBadResult", err.Error())
	}
	return outcome(log, err)
}

// refusedAsBad publishes a value the API server or the gateway refuses (one the CRD does not
// admit, or too large): true when the SDK reported it as a bad result, else the exit code.
func refusedAsBad(ctx context.Context, log *slog.Logger, r *tether.Run, value any) (int, bool) {
	err := r.Complete(ctx, value)
	switch {
	case err == nil:
		log.Error("a bad result was accepted")
		return exitInvalidTook, false
	case !errors.Is(err, tether.ErrResultInvalid):
		return outcome(log, err), false
	}
	log.Info("the bad result was refused as expected", "error", err)
	return 0, true
}

func outcome(log *slog.Logger, err error) int {
	switch {
	case err == nil:
		log.Info("published")
		return exitDone
	case errors.Is(err, tether.ErrLeaseLost):
		log.Error("ownership lost: not published", "error", err)
		return exitLost
	case errors.Is(err, tether.ErrOwnershipUnknown):
		log.Error("ownership unknown until the lease deadline", "error", err)
		return exitUnknown
	default:
		log.Error("not published", "error", err)
		return exitBroken
	}
}
