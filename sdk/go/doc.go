// Package tether is the Go worker SDK of Tether, a Kubernetes operator for long-running worker
// jobs. A worker proves it owns a run by renewing the run's Lease; the operator fences with an
// integer fence token.
//
// A pod worker starts with FromEnv, an external worker with Claim (through Tether's HTTP
// gateway). Both return a *Run that renews on a goroutine of its own, exposes ownership (Owned,
// OwnershipUnknown, Lost) and the control plane's Signals, carries checkpoints and usage on its
// renewals, sends fenced side effects (Effect) and publishes the attempt's outcome with one fenced
// write (Complete, Fail). It spawns child runs (Spawn, Call), each one tool call as a fenced WorkerRun
// of its own. The outcomes a worker must tell apart are sentinel errors: ErrLeaseLost,
// ErrOwnershipUnknown, ErrStopRequested, ErrToolTimeout, ErrResultInvalid, ErrClaimRefused,
// ErrSpawnConflict, ErrSpawnRefused, ErrChildFailed.
package tether
