/**
 * The ways a worker can lose confidence (lost, unknown, tool timeout, stop), kept apart on purpose,
 * the refusals that say nothing about ownership (a bad result, a refused claim, a refused or
 * conflicting spawn), and a child run that ended without a result.
 */

import type { JsonObject } from "./protocol.js";

/** Base class of the SDK's errors. */
export class TetherWorkerError extends Error {
  override name = "TetherWorkerError";
}

/**
 * The API server (or the gateway) says someone else owns the run now, or no lease is left.
 * Start no side effect and publish nothing: the result would be rejected.
 */
export class LeaseLost extends TetherWorkerError {
  override name = "LeaseLost";
}

/**
 * No renewal was confirmed within the lease duration minus a margin. The worker may still own the
 * run but cannot know: start no new side effect until a renewal succeeds again.
 */
export class OwnershipUnknown extends TetherWorkerError {
  override name = "OwnershipUnknown";
}

/**
 * The control plane told this worker to stop (spec.stop, or a cap or budget crossed).
 * Finish or abandon the current step and exit; start no new side effect.
 */
export class StopRequested extends TetherWorkerError {
  override name = "StopRequested";
  /** Kueue evicted the run: checkpoint first, then exit (the run resumes from the checkpoint). */
  readonly yielding: boolean;

  constructor(message: string, yielding = false) {
    super(message);
    this.yielding = yielding;
  }
}

/**
 * A side-effect call did not answer in time. Ownership is not in question; retrying the call with
 * the same Idempotency-Key is safe.
 */
export class ToolTimeout extends TetherWorkerError {
  override name = "ToolTimeout";
}

/** One field the API server or the gateway refused, as its answer names it. */
export interface InvalidCause {
  field?: string;
  message?: string;
  reason?: string;
}

/**
 * The API server (or the gateway) refused the published value itself: it breaks the WorkerRun
 * schema (for example a result that is not a JSON object). Ownership is not in question: the worker
 * still holds the run and may publish a corrected value.
 */
export class ResultInvalid extends TetherWorkerError {
  override name = "ResultInvalid";
  readonly causes: InvalidCause[];

  constructor(message: string, causes: InvalidCause[] = []) {
    super(message);
    this.causes = causes;
  }
}

/** The gateway did not hand out the run (402 budget, 409 held or nothing open, 403, ...). */
export class ClaimRefused extends TetherWorkerError {
  override name = "ClaimRefused";
  readonly status: number;
  readonly code: string;

  constructor(status: number, code: string, message: string) {
    super(`claim refused: ${status} ${code}: ${message}`);
    this.status = status;
    this.code = code;
  }
}

/**
 * The API server (or the gateway) refused the child run: an admission policy (its class is not one
 * the parent's class lets it spawn, or this pod does not hold the parent) or the schema (an invalid
 * spec). The message says what to fix. Nothing was created.
 */
export class SpawnRefused extends TetherWorkerError {
  override name = "SpawnRefused";
}

/**
 * The key names a child that exists and was asked for something else (another class, payload or
 * share), or that is not this parent's: one key is one tool call, never two.
 */
export class SpawnConflict extends TetherWorkerError {
  override name = "SpawnConflict";
}

/**
 * The child run ended without a result: Rejected before it started (`reason` says why:
 * StaleParent, TreeBudgetExhausted, ...), or Failed, Lost, Cancelled, BudgetExceeded,
 * DeadlineExceeded; or it was deleted (phase and reason `Deleted`). `error` is what its worker
 * published, if anything.
 */
export class ChildFailed extends TetherWorkerError {
  override name = "ChildFailed";
  /** The child run's name (`name` is the error's, as for every Error). */
  readonly childName: string;
  readonly phase: string;
  readonly reason: string;
  readonly error: JsonObject | null;

  constructor(childName: string, phase: string, reason: string, message: string, error: JsonObject | null) {
    super(`child run ${childName} ended ${phase} (${reason}): ${message}`);
    this.childName = childName;
    this.phase = phase;
    this.reason = reason;
    this.error = error;
  }
}
