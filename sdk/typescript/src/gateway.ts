/**
 * The external worker's path: the same operations as JSON calls to the Tether gateway, over Node's
 * built-in fetch. The gateway writes the same fenced Lease renewals and status patches for us.
 */

import { ClaimRefused, LeaseLost, ResultInvalid, SpawnConflict, SpawnRefused, TetherWorkerError, type InvalidCause } from "./errors.js";
import {
  PUBLICATION_TIMEOUT_SECONDS,
  isObject,
  parseDecisions,
  retryAfterSeconds,
  signalsFromRemaining,
  type ApprovalRequest,
  type JsonObject,
  type PublishField,
  type RunObject,
  type Signals,
  type Usage,
} from "./protocol.js";
import { Unanswered, confirmed, unconfirmed, type Renewal, type Transport } from "./transport.js";

/** A short-lived token of the run's ServiceAccount, refreshed on every heartbeat (for tool calls). */
export interface ToolClaim {
  token: string;
  expiresAt: string;
  serviceAccount: string;
}

/** The gateway's answer to a claim: the attempt and its lease contract. */
export interface ClaimReply {
  holder: string;
  fence: number;
  attempt: number;
  runUid: string;
  leaseDurationSeconds: number;
  renewIntervalSeconds: number;
  payload: JsonObject;
  checkpoint: string | null;
  idempotencyKey: string;
  toolClaim: ToolClaim | null;
  /** Why a person denied the previous attempt's result (spec.review.result), for this one to act on. */
  reviewFeedback: string | null;
  /** The attempt's W3C trace context (null from a gateway without tracing). */
  traceparent: string | null;
}

interface GatewayAnswer {
  status: number;
  doc: unknown;
  text: string;
  headers: Headers;
}

/** The gateway's error envelope `{"error": {...}}`; empty when the answer is not one (a proxy in
 * between may answer with anything, and that must not break the heartbeat). */
export function errorBody(doc: unknown): { code?: string; message?: string; field?: string } {
  const error = isObject(doc) ? doc.error : undefined;
  if (!isObject(error)) return {};
  const out: { code?: string; message?: string; field?: string } = {};
  if (typeof error.code === "string") out.code = error.code;
  if (typeof error.message === "string") out.message = error.message;
  if (typeof error.field === "string") out.field = error.field;
  return out;
}

function runUrl(gatewayUrl: string, namespace: string, name: string, op: string): string {
  return `${gatewayUrl.replace(/\/+$/, "")}/api/v1/namespaces/${encodeURIComponent(namespace)}`
    + `/workerruns/${encodeURIComponent(name)}/${op}`;
}

async function post(url: string, token: string, body: unknown, timeoutSeconds: number): Promise<GatewayAnswer> {
  const resp = await fetch(url, {
    method: "POST",
    headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/json", Accept: "application/json" },
    body: JSON.stringify(body),
    signal: AbortSignal.timeout(timeoutSeconds * 1000),
  });
  const text = await resp.text();
  let doc: unknown;
  try {
    doc = JSON.parse(text);
  } catch {
    doc = undefined;
  }
  return { status: resp.status, doc, text, headers: resp.headers };
}

// --- which 200 is the gateway's reply (docs/protocol.md §6.4) --------------------------------

/** The reply to a call that renewed an attempt (claim, heartbeat, checkpoint, approval), its fields
 * checked: the attempt it names and the signals. */
export type GatewayReply = Record<string, unknown> & {
  holder: string;
  fence: number;
  runUid: string;
  stop: boolean;
  paused: boolean;
  yield?: boolean;
  stopBy?: string | null;
  endsAt?: string | null;
  capRemainingCents?: number | null;
  capRemainingTokens?: number | null;
  toolClaim?: ToolClaim | null;
};

const isNull = (v: unknown): v is null | undefined => v === undefined || v === null;
const isInt = (v: unknown): v is number => Number.isSafeInteger(v);

// Absent and null are alike for the fields the gateway may leave empty, as Go's decoder has them.
function isRenewalReply(doc: unknown): doc is GatewayReply {
  return isObject(doc) && typeof doc.holder === "string" && isInt(doc.fence) && typeof doc.runUid === "string"
    && typeof doc.stop === "boolean" && typeof doc.paused === "boolean"
    && typeof doc.leaseExpiresAt === "string" && typeof doc.status === "string"
    && (isNull(doc.endsAt) || (typeof doc.endsAt === "string" && !Number.isNaN(Date.parse(doc.endsAt))))
    && (isNull(doc.capRemainingCents) || isInt(doc.capRemainingCents))
    && (isNull(doc.capRemainingTokens) || isInt(doc.capRemainingTokens))
    && (isNull(doc.decisions) || isObject(doc.decisions))
    && (isNull(doc.toolClaim) || (isObject(doc.toolClaim)
      && ["token", "expiresAt", "serviceAccount"].every((k) => typeof (doc.toolClaim as Record<string, unknown>)[k] === "string")));
}

/**
 * An answer's JSON as the gateway's reply to a renewal of this attempt (holder, fence and, when the
 * call named it, run), or null when it is not one. Such a 200 came from something in between (a
 * proxy's `{}`) and confirms nothing. The Python and Go SDKs draw the same line
 * (sdk/vectors/gateway-replies.json).
 */
export function gatewayReply(doc: unknown, holder: string, fence: number, runUid: string | null): GatewayReply | null {
  if (!isRenewalReply(doc) || doc.holder !== holder || doc.fence !== fence) return null;
  return runUid === null || doc.runUid === runUid ? doc : null;
}

/** An answer's JSON as the gateway's claim reply (a renewal reply of the attempt it hands out, plus
 * the attempt's contract), or null when it is not one. */
export function claimReply(doc: unknown): ClaimReply | null {
  if (!isRenewalReply(doc)) return null;
  const { attempt, leaseDurationSeconds, renewIntervalSeconds, idempotencyKey } = doc;
  const payload = isNull(doc.payload) ? {} : doc.payload;
  const checkpoint = doc.checkpoint ?? null;
  const reviewFeedback = doc.reviewFeedback ?? null;
  // Seconds may have a fraction (the CRD's are whole; a test gateway's need not be).
  if (doc.holder === "" || doc.fence < 1 || doc.runUid === "" || !isInt(attempt) || attempt < 1
    || typeof leaseDurationSeconds !== "number" || !(leaseDurationSeconds > 0)
    || typeof renewIntervalSeconds !== "number" || !(renewIntervalSeconds > 0)
    || typeof idempotencyKey !== "string" || !isObject(payload)
    || !(checkpoint === null || typeof checkpoint === "string")
    || !(reviewFeedback === null || typeof reviewFeedback === "string")) return null;
  return {
    holder: doc.holder, fence: doc.fence, attempt, runUid: doc.runUid, leaseDurationSeconds, renewIntervalSeconds,
    payload: payload as JsonObject, checkpoint, idempotencyKey, toolClaim: doc.toolClaim ?? null, reviewFeedback,
    // Tracing only, never required: a malformed one is dropped, not a reason to refuse the claim.
    traceparent: typeof doc.traceparent === "string" ? doc.traceparent : null,
  };
}

/** Claims the run's open attempt. Throws ClaimRefused with the gateway's status and code, and a
 * TetherWorkerError when a 200 is not the gateway's claim reply (the claim may have landed: the
 * same claimant's next claim is answered alike, so claiming again is safe). */
export async function claimRun(gatewayUrl: string, namespace: string, name: string, token: string,
  workerId: string | null, timeoutSeconds = 30): Promise<ClaimReply> {
  const answer = await post(runUrl(gatewayUrl, namespace, name, "claim"), token, workerId ? { workerId } : {},
    timeoutSeconds);
  if (answer.status !== 200) {
    const error = errorBody(answer.doc);
    throw new ClaimRefused(answer.status, error.code ?? "", error.message ?? answer.text.slice(0, 200));
  }
  const reply = claimReply(answer.doc);
  if (reply === null) {
    throw new TetherWorkerError(`the claim's 200 is not the gateway's claim reply (claiming again is safe): `
      + answer.text.slice(0, 200));
  }
  return reply;
}

/** A `spawn` or `child` 200 as the gateway's reply `{"child": <the child WorkerRun>}`, or null when it
 * is not one (something in between answered): the child, named. */
export function childReply(doc: unknown): RunObject | null {
  const child = isObject(doc) ? doc.child : undefined;
  return isObject(child) && isObject(child.metadata) && typeof child.metadata.name === "string" ? child : null;
}

/** Whether an answer to a call after the claim says the attempt is not this worker's any more
 * (docs/protocol.md §6.3): the run is gone, its fence moved on, or another identity or worker claimed it. */
function losesAttempt(status: number, error: { code?: string }): boolean {
  return status === 404 || status === 410 || error.code === "NotClaimant" || error.code === "HeldByAnother";
}

/** The gateway's flat heartbeat reply as signals (caps counted against the usage it was sent). */
export function gatewaySignals(doc: GatewayReply, usage: Usage | null): Signals {
  const base = signalsFromRemaining(doc.stop, doc.paused, doc.endsAt ?? null,
    doc.capRemainingCents ?? null, doc.capRemainingTokens ?? null, usage);
  const signals = doc.stop && doc.yield === true
    ? { ...base, yield: true, stopBy: typeof doc.stopBy === "string" ? doc.stopBy : null } : base;
  // Malformed decisions decide nothing (the next heartbeat asks again); the other signals stand,
  // as the Python SDK reads the same reply.
  const decisions = doc.decisions === undefined ? null : parseDecisions(doc.decisions);
  return decisions === null ? signals : { ...signals, decisions };
}

export class GatewayTransport implements Transport {
  toolClaim: ToolClaim | null;
  /** Every call names the attempt, the run (never a namesake) and, when claimed with one, the worker:
   * the gateway accepts calls only from the claimant. */
  private readonly fenced: Record<string, string | number>;
  private readonly holder: string;
  private readonly fence: number;
  private readonly runUid: string | null;

  constructor(
    private readonly gatewayUrl: string,
    private readonly namespace: string,
    private readonly name: string,
    private readonly token: string,
    holder: string,
    fence: number,
    private readonly timeoutSeconds: number,
    workerId: string | null,
    runUid: string | null,
    toolClaim: ToolClaim | null = null,
  ) {
    this.holder = holder;
    this.fence = fence;
    this.runUid = runUid || null;
    this.fenced = { holder, fence };
    if (workerId) this.fenced.workerId = workerId;
    if (runUid) this.fenced.runUid = runUid;
    this.toolClaim = toolClaim;
  }

  private async call(op: string, body: Record<string, unknown>, timeoutSeconds = this.timeoutSeconds): Promise<GatewayAnswer> {
    try {
      return await post(runUrl(this.gatewayUrl, this.namespace, this.name, op), this.token, { ...this.fenced, ...body },
        timeoutSeconds);
    } catch (err) {
      // fetch rejects only when there is no (complete) answer: network error, timeout, cut body.
      throw new Unanswered(`${op}: no answer: ${(err as Error).message}`, null, 0, { cause: err });
    }
  }

  async renew(checkpoint: string | null, usage: Usage | null,
    requests: readonly ApprovalRequest[] = []): Promise<Renewal> {
    const body: Record<string, unknown> = {};
    if (requests.length > 0) {
      body.requests = requests.map((r) => ({
        name: r.name, details: r.details, ...(r.timeoutSeconds === null ? {} : { timeoutSeconds: r.timeoutSeconds }),
      }));
    }
    if (checkpoint !== null) body.checkpoint = checkpoint;
    if (usage !== null) body.usage = { cents: usage.cents, tokens: usage.tokens };
    const answer = await this.call("heartbeat", body);
    if (answer.status === 200) {
      // Only the gateway's reply for this attempt confirms: any other 200 (a proxy's page, its `{}`,
      // a cut body) came from something in between and says nothing about the lease.
      const reply = gatewayReply(answer.doc, this.holder, this.fence, this.runUid);
      if (reply === null) {
        return unconfirmed(`heartbeat answered 200 without the gateway's reply for this attempt: ${answer.text.slice(0, 200)}`);
      }
      this.toolClaim = reply.toolClaim ?? this.toolClaim;
      return confirmed(gatewaySignals(reply, usage));
    }
    const error = errorBody(answer.doc);
    if (losesAttempt(answer.status, error)) return unconfirmed(error.message ?? "stale fence", true);
    return unconfirmed(`heartbeat refused: ${answer.status} ${error.message ?? answer.text.slice(0, 200)}`);
  }

  async publish(field: PublishField, value: unknown): Promise<boolean> {
    const answer = field === "result"
      ? await this.call("complete", { result: value }, PUBLICATION_TIMEOUT_SECONDS)
      : await this.call("fail", { error: value }, PUBLICATION_TIMEOUT_SECONDS);
    if (answer.status === 200) return true;
    const error = errorBody(answer.doc);
    if (answer.status === 413) {
      // BodyTooLarge (over the gateway's 1 MiB) or ResultTooLarge (the run would outgrow what the
      // Kubernetes API stores): the message says which.
      throw new ResultInvalid(`the ${field} is too large: ${error.message ?? answer.text.slice(0, 200)}`);
    }
    if (answer.status === 422) {
      // The gateway refused the body, or the API server the value: a bad result, not lost ownership.
      const causes: InvalidCause[] = error.field ? [{ field: error.field, message: error.message ?? "" }] : [];
      throw new ResultInvalid(`the gateway refused the ${field}: ${error.message ?? answer.text.slice(0, 200)}`, causes);
    }
    // 409 is HeldByAnother, or AlreadyPublished (another value of this attempt was accepted): never retried.
    // 503 Busy (a transient conflict) falls through to the retry below, like any 5xx.
    if ([404, 409, 410].includes(answer.status) || error.code === "NotClaimant") return false;
    throw new Unanswered(`${field === "result" ? "complete" : "fail"} answered ${answer.status}: `
      + `${error.message ?? answer.text.slice(0, 200)}`, answer.status, retryAfterSeconds(answer.headers.get("retry-after")));
  }

  /** The gateway itself answers a repeated publication of an accepted value with 200. */
  async recorded(): Promise<boolean> {
    return false;
  }

  /** None: an External worker does not read its run. The gateway builds each child from it (its
   * class, depth and budget), so a spawn sends the spec as the caller asked for it. */
  async parent(): Promise<null> {
    return null;
  }

  /** The gateway's `spawn`: it names, builds and creates the child in this attempt's name. */
  async spawn(key: string, generation: number, spec: JsonObject): Promise<RunObject> {
    return childAnswer("spawn", await this.call("spawn", { key, generation, spec }));
  }

  async child(name: string): Promise<RunObject | null> {
    const answer = await this.call("child", { name });
    if (answer.status === 404 && errorBody(answer.doc).code === "ChildNotFound") return null;
    return childAnswer("child", answer);
  }

  async close(): Promise<void> {}
}

/**
 * The child a `spawn` or `child` call was answered with. Throws LeaseLost when the answer says the
 * attempt is not this worker's, SpawnRefused for a refusal of the child (422, or RBAC's 403), SpawnConflict
 * for a run of its name that is not this run's child (409), and
 * `Unanswered` for anything else, a 200 that is not the gateway's reply included.
 */
function childAnswer(op: string, answer: GatewayAnswer): RunObject {
  const error = errorBody(answer.doc);
  if (answer.status === 200) {
    const child = childReply(answer.doc);
    if (child === null) throw new Unanswered(`${op} answered 200 without the gateway's reply: ${answer.text.slice(0, 200)}`, 200);
    return child;
  }
  if (losesAttempt(answer.status, error)) throw new LeaseLost(`${op}: ${error.message ?? `answered ${answer.status}`}`);
  // 422: the API server's refusal (SpawnRefused) or the gateway's of the spec; 403 (but NotClaimant,
  // which is lost): RBAC does not let this identity `spawn`; 409 SpawnConflict: a run of that name
  // exists that is not this run's child.
  if (op === "spawn" && (answer.status === 422 || answer.status === 403)) {
    throw new SpawnRefused(`the gateway refused the child: ${error.message ?? answer.text.slice(0, 200)}`);
  }
  if (op === "spawn" && answer.status === 409 && error.code === "SpawnConflict") {
    throw new SpawnConflict(error.message ?? "a run of the child's name exists and is not this run's child");
  }
  throw new Unanswered(`${op} answered ${answer.status}: ${error.message ?? answer.text.slice(0, 200)}`, answer.status,
    retryAfterSeconds(answer.headers.get("retry-after")));
}
