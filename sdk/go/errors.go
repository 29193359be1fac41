package tether

import (
	"errors"
	"fmt"
)

// The outcomes a worker must tell apart. They are sentinels: test them with errors.Is, since the
// SDK wraps them with the details of the case.
var (
	// ErrLeaseLost: the API server (or the gateway) says someone else owns the run now, or no
	// lease is left. Start no side effect and publish nothing; a result would be rejected.
	ErrLeaseLost = errors.New("tether: lease lost")
	// ErrOwnershipUnknown: no renewal was confirmed within the lease duration minus a margin. The
	// worker may still own the run but cannot know: start no new side effect until a renewal
	// succeeds again.
	ErrOwnershipUnknown = errors.New("tether: ownership unknown")
	// ErrStopRequested: the control plane told this worker to stop (spec.stop, a cap or a budget
	// crossed). Finish or abandon the current step and exit; start no new side effect.
	ErrStopRequested = errors.New("tether: stop requested")
	// ErrToolTimeout: a side-effect call did not answer in time. Ownership is not in question;
	// retrying the call with the same Idempotency-Key is safe.
	ErrToolTimeout = errors.New("tether: tool call timed out")
	// ErrResultInvalid: the API server (the CRD schema) or the gateway refused the published value
	// itself. The worker still owns the run and may publish a corrected value. The error is a
	// *ResultInvalidError.
	ErrResultInvalid = errors.New("tether: result refused as invalid")
	// ErrClaimRefused: the gateway did not hand out the run. The error is a *ClaimRefusedError.
	ErrClaimRefused = errors.New("tether: claim refused")
	// ErrUsageRefused: a usage report the operator would refuse (negative, decreasing, implausibly
	// large), refused here where the caller can still fix it.
	ErrUsageRefused = errors.New("tether: usage report refused")
	// ErrRequestRefused: an approval request the control plane would refuse (a malformed name,
	// details or timeout, or more than 20 requests in one attempt), refused here before it is sent.
	ErrRequestRefused = errors.New("tether: approval request refused")
	// ErrSpawnRefused: the API server (or the gateway, for it) refused a child run: an admission
	// policy (its class is not one the parent's class may spawn, this pod does not hold the parent),
	// the schema (an invalid spec). The message says what to fix. Nothing was created; ownership is
	// not in question.
	ErrSpawnRefused = errors.New("tether: spawn refused")
	// ErrSpawnConflict: the key names a child that exists and was asked for something else (another
	// class, payload, caps or spec), or a run that is not this run's child: one key is one tool
	// call, never two.
	ErrSpawnConflict = errors.New("tether: spawn conflict")
	// ErrChildFailed: a child run ended without a result. The error is a *ChildFailedError.
	ErrChildFailed = errors.New("tether: child run failed")
)

// ClaimRefusedError is the gateway's refusal of a claim: 402 budget exceeded, 409 held by another
// worker or no attempt open, 401/403 not allowed, 404 no such run, ...
type ClaimRefusedError struct {
	Status  int    // the HTTP status
	Code    string // the gateway's error code, e.g. "HeldByAnother"
	Message string
}

func (e *ClaimRefusedError) Error() string {
	return fmt.Sprintf("tether: claim refused: %d %s: %s", e.Status, e.Code, e.Message)
}

// Is makes errors.Is(err, ErrClaimRefused) true for every refusal.
func (e *ClaimRefusedError) Is(target error) bool { return target == ErrClaimRefused }

// ResultInvalidError is the refusal of a published value itself (a result that is not a JSON
// object, an error code that is not a string): a bad result, not lost ownership.
type ResultInvalidError struct {
	Field   string         // what was published: "result" or "error"
	Message string         // the API server's or the gateway's message
	Causes  []InvalidCause // the refused fields, when the answer named them
}

// InvalidCause is one refused field of a value.
type InvalidCause struct {
	Field   string // e.g. "status.result"
	Message string
}

func (e *ResultInvalidError) Error() string {
	return fmt.Sprintf("tether: the %s was refused as invalid: %s", e.Field, e.Message)
}

// Is makes errors.Is(err, ErrResultInvalid) true for every such refusal.
func (e *ResultInvalidError) Is(target error) bool { return target == ErrResultInvalid }

// ChildFailedError is a child run's end without a result: Rejected before it started (Reason says
// why: StaleParent, TreeBudgetExhausted, ...), or Failed, Lost, Cancelled, BudgetExceeded,
// DeadlineExceeded; Phase and Reason "Deleted" when it was deleted while waited for.
type ChildFailedError struct {
	Name    string
	Phase   string
	Reason  string         // its Ready condition's reason, else its phase
	Message string         // its Ready condition's message
	Failure map[string]any // what its worker published (status.error: code, message); nil when none
}

func (e *ChildFailedError) Error() string {
	return fmt.Sprintf("tether: child run %s ended %s (%s): %s", e.Name, e.Phase, e.Reason, e.Message)
}

// Is makes errors.Is(err, ErrChildFailed) true for every such end.
func (e *ChildFailedError) Is(target error) bool { return target == ErrChildFailed }
