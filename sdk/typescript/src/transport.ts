/**
 * How a worker reaches Tether: the Kubernetes API (pods, `KubeTransport`) or the gateway (anywhere,
 * `GatewayTransport`). Both give the same operations, so WorkerRun's logic (self-fencing, signals,
 * failure classes) is one piece of code, and a test can drive it with a fake transport.
 */

import type { Parent } from "./children.js";
import type { ApprovalRequest, JsonObject, PublishField, RunObject, Signals, Usage } from "./protocol.js";

/** The outcome of one renewal. */
export interface Renewal {
  /** Confirmed: the lease is extended. */
  ok: boolean;
  /** The API server (or gateway) said the run is no longer this attempt's. */
  lost: boolean;
  /** Why it was not confirmed (for logs). */
  why: string;
  /** The signals the answer carried; null when none or malformed (keep the previous ones). */
  signals: Signals | null;
}

export function confirmed(signals: Signals | null): Renewal {
  return { ok: true, lost: false, why: "", signals };
}

export function unconfirmed(why: string, lost = false): Renewal {
  return { ok: false, lost, why, signals: null };
}

/**
 * A request that got no answer (`status` null), or an answer that says nothing about ownership (400,
 * 401, an RBAC 403, 429, 5xx): the caller may retry, no sooner than `retryAfterSeconds`.
 */
export class Unanswered extends Error {
  override name = "Unanswered";
  readonly status: number | null;
  readonly retryAfterSeconds: number;

  constructor(message: string, status: number | null = null, retryAfterSeconds = 0, options?: { cause?: unknown }) {
    super(message, options);
    this.status = status;
    this.retryAfterSeconds = retryAfterSeconds;
  }
}

export interface Transport {
  /**
   * One conditional renewal carrying the pending checkpoint, the attempt's usage and every approval
   * request it made (each renewal carries them all). Answers that refuse it come back as a Renewal;
   * no answer at all throws `Unanswered`.
   */
  renew(checkpoint: string | null, usage: Usage | null, requests: readonly ApprovalRequest[]): Promise<Renewal>;
  /**
   * One fenced write of the result or error. true: published; false: refused for good (the attempt
   * is not this worker's any more). Throws `ResultInvalid` (the value was refused) or `Unanswered`
   * (retry until the lease deadline).
   */
  publish(field: PublishField, value: unknown): Promise<boolean>;
  /** Whether the run already records this attempt's `field` with `value` (see protocol). */
  recorded(field: PublishField, value: unknown): Promise<boolean>;
  close(): Promise<void>;
  // Child runs (docs/children.md): a transport without these three cannot spawn. An answer that says
  // the run is not this attempt's any more throws LeaseLost; no answer throws `Unanswered`.
  /**
   * What a child's spec takes from this run (its WorkerBudget, whether its caps need a share), read
   * once; null where the other side builds the child (the gateway: an External worker does not read
   * its run).
   */
  parent?(): Promise<Parent | null>;
  /**
   * Creates this attempt's child for `key` at `generation` with `spec` (as the caller asked for it),
   * or returns the run of that name that exists: whose it is and what it was asked for, the caller
   * judges. Throws `SpawnRefused` when the API server refuses it.
   */
  spawn?(key: string, generation: number, spec: JsonObject): Promise<RunObject>;
  /** A child run as served now; null once it is gone. */
  child?(name: string): Promise<RunObject | null>;
}
