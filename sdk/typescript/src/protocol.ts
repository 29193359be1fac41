/**
 * The ownership protocol's vocabulary: pure functions, no I/O. They mirror the operator's
 * `tether/protocol.py`, so a TypeScript worker writes exactly what the Python SDK and the gateway
 * write, and reads Leases, signals and answers the same way.
 */

import type { InvalidCause } from "./errors.js";

export const GROUP = "tether.dev";
export const VERSION = "v1alpha1";
export const PLURAL = "workerruns";

/** Lease annotations the worker writes on each renewal (one write carries both). */
export const ANN_CHECKPOINT = "tether.dev/checkpoint";
export const ANN_USAGE = "tether.dev/usage";
/** Lease annotation the worker writes on each renewal: every approval request of its attempt (§9). */
export const ANN_REQUESTS = "tether.dev/requests";
/** Lease annotation the operator writes: the control signals, read from every renewal's answer. */
export const ANN_SIGNALS = "tether.dev/signals";

/** Environment the operator gives a worker pod. */
export const ENV = {
  run: "TETHER_RUN",
  namespace: "TETHER_NAMESPACE",
  holder: "TETHER_HOLDER",
  runUid: "TETHER_RUN_UID",
  fence: "TETHER_FENCE",
  attempt: "TETHER_ATTEMPT",
  leaseDuration: "TETHER_LEASE_DURATION_SECONDS",
  renewInterval: "TETHER_RENEW_INTERVAL_SECONDS",
  payload: "TETHER_PAYLOAD",
  payloadFrom: "TETHER_PAYLOAD_FROM",
  checkpoint: "TETHER_CHECKPOINT",
  idempotencyKey: "TETHER_IDEMPOTENCY_KEY",
  reviewFeedback: "TETHER_REVIEW_FEEDBACK",
} as const;

/** TETHER_PAYLOAD_FROM's only value: the payload was too large for the environment. */
export const PAYLOAD_FROM_RUN = "spec.payload";

export const JSON_PATCH = "application/json-patch+json";

/** Reports beyond these are malformed, not spending (the CRD's own bounds). */
export const MAX_CENTS = 1e11;
export const MAX_TOKENS = 1e14;

export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };
export type JsonObject = { [key: string]: Json };

export interface OwnerReference {
  kind?: string;
  uid?: string;
  controller?: boolean;
}

/** The parts of a Kubernetes object (as JSON) the protocol reads; the rest is carried along. */
export interface KubeObject {
  metadata?: {
    uid?: string;
    resourceVersion?: string;
    annotations?: Record<string, string>;
    ownerReferences?: OwnerReference[];
    [key: string]: unknown;
  };
  [key: string]: unknown;
}

export interface LeaseObject extends KubeObject {
  spec?: {
    holderIdentity?: string | null;
    leaseTransitions?: number | null;
    renewTime?: string | null;
    [key: string]: unknown;
  };
}

export interface AttemptRecord {
  holder?: string;
  fence?: number;
  outcome?: string;
  [key: string]: unknown;
}

export interface RunObject extends KubeObject {
  status?: {
    holder?: string | null;
    fence?: number | null;
    result?: unknown;
    error?: unknown;
    attempts?: AttemptRecord[];
    [key: string]: unknown;
  };
}

/** Cumulative usage of one attempt. */
export interface Usage {
  cents: number;
  tokens: number;
}

/** A person's decision on one of the attempt's approval requests (docs/protocol.md §9). */
export interface GateDecision {
  decision: "Approve" | "Deny" | "TimedOut";
  reason: string | null;
  approver: string | null;
}

/** The control signals as the operator writes them on the Lease (`tether.dev/signals`). */
export interface Signals {
  stop: boolean;
  /** With stop: Kueue evicted the run. Checkpoint and exit: it resumes from that checkpoint. */
  yield: boolean;
  /** With yield: when the attempt is revoked whatever the worker does (RFC 3339). */
  stopBy: string | null;
  paused: boolean;
  reason: string | null;
  endsAt: string | null;
  capCents: number | null;
  capTokens: number | null;
  /** Spent by earlier attempts: the worker's own reports count from zero. */
  baseCents: number;
  baseTokens: number;
  /** Decisions on this attempt's approval requests, by request name (only this attempt's: the
   * operator rewrites the Lease at every grant). */
  decisions: Readonly<Record<string, GateDecision>>;
}

export const NO_SIGNALS: Readonly<Signals> = Object.freeze({
  stop: false, yield: false, stopBy: null, paused: false, reason: null, endsAt: null,
  capCents: null, capTokens: null, baseCents: 0, baseTokens: 0, decisions: Object.freeze({}),
});

/** What the control plane says, as the worker sees it: caps counted against its own usage. */
export interface ControlSignals {
  readonly stop: boolean;
  /** stop is a yield (a Kueue eviction): checkpoint, then exit; the run resumes from there. */
  readonly yielding: boolean;
  readonly stopBy: Date | null;
  readonly paused: boolean;
  readonly reason: string | null;
  readonly endsAt: Date | null;
  readonly capRemainingCents: number | null;
  readonly capRemainingTokens: number | null;
}

export type PublishField = "result" | "error";

// --- timing ---------------------------------------------------------------------------------

/** How long before the lease's end a worker stops trusting it: max(1 s, 10% of the duration). */
export function safetyMargin(leaseDurationSeconds: number): number {
  return Math.max(1, 0.1 * leaseDurationSeconds);
}

/** A request unanswered within this many seconds counts as no answer: min(10 s, max(R, 1 s)). */
export function requestTimeout(renewIntervalSeconds: number): number {
  return Math.min(10, Math.max(renewIntervalSeconds, 1));
}

/**
 * A publication (and the read that checks whether a lost one landed) waits this long for its answer,
 * not T (docs/protocol.md §3): its body may be megabytes the API server decodes and validates before
 * answering, and the heartbeat goes on meanwhile, while T would count a slow answer as none and send
 * the same megabytes again and again.
 */
export const PUBLICATION_TIMEOUT_SECONDS = 30;

export type Ownership = "owned" | "unknown" | "lost";

/**
 * Ownership at monotonic time `now`: lost once the API server said so; unknown past
 * (start of the last confirmed renewal) + duration − margin; otherwise owned.
 */
export function ownership(lost: boolean, now: number, confirmedAt: number, leaseDurationSeconds: number,
  margin: number): Ownership {
  if (lost) return "lost";
  return now > confirmedAt + leaseDurationSeconds - margin ? "unknown" : "owned";
}

/** The next publish retry delay: doubling from 0.5 s up to 5 s. */
export function nextDelay(delay: number): number {
  return Math.min(delay * 2, 5);
}

/** Seconds a Retry-After header asks for (an HTTP date counts as 0: the doubling delay applies). */
export function retryAfterSeconds(header: string | null | undefined): number {
  if (!header) return 0;
  const seconds = Number(header.trim());
  return Number.isFinite(seconds) && seconds > 0 ? seconds : 0;
}

// --- time stamps ----------------------------------------------------------------------------

/** Kubernetes MicroTime (Lease times): RFC 3339, UTC, microseconds, 'Z'. */
export function microTime(t: Date): string {
  return `${t.toISOString().slice(0, 23)}000Z`;
}

// --- who holds the Lease ----------------------------------------------------------------------

/**
 * An answer's text as a Lease, or null when it is not one: not JSON (a proxy's HTML page), JSON of
 * another shape (a Status, null, a proxy's error), or a Lease whose fields the protocol reads have
 * other types. Such an answer says nothing about ownership (docs/protocol.md §5.2): unconfirmed.
 * The Python and Go SDKs draw the same line (sdk/vectors/leases.json).
 */
export function parseLease(text: string): LeaseObject | null {
  let doc: unknown;
  try {
    doc = JSON.parse(text);
  } catch {
    return null;
  }
  return isLease(doc) ? doc : null;
}

const isNull = (v: unknown): v is null | undefined => v === undefined || v === null;
const stringOrNull = (v: unknown): boolean => isNull(v) || typeof v === "string";

// Absent and null are alike, as Go's decoder has them.
function isLease(doc: unknown): doc is LeaseObject {
  if (!isObject(doc) || !(isNull(doc.kind) || doc.kind === "Lease")
    || !(isNull(doc.apiVersion) || doc.apiVersion === "coordination.k8s.io/v1")) return false;
  const meta = doc.metadata;
  const spec = isNull(doc.spec) ? {} : doc.spec;
  if (!isObject(meta) || !isObject(spec)) return false;
  const ann = isNull(meta.annotations) ? {} : meta.annotations;
  const refs = isNull(meta.ownerReferences) ? [] : meta.ownerReferences;
  const fence = spec.leaseTransitions;
  return typeof meta.resourceVersion === "string" && meta.resourceVersion !== "" // else a PUT is no compare-and-swap
    && isObject(ann) && Object.values(ann).every((v) => typeof v === "string")
    && Array.isArray(refs) && refs.every(isOwnerReference)
    && stringOrNull(spec.holderIdentity) && (isNull(fence) || Number.isInteger(fence));
}

function isOwnerReference(ref: unknown): boolean {
  return isObject(ref) && stringOrNull(ref.kind) && stringOrNull(ref.uid)
    && (isNull(ref.controller) || typeof ref.controller === "boolean");
}

export function annotations(obj: KubeObject | null | undefined): Record<string, string> {
  return { ...(obj?.metadata?.annotations ?? {}) };
}

/** The UID of the WorkerRun that controls this object (its Lease), if any. */
export function controllerUid(obj: KubeObject | null | undefined): string | null {
  for (const ref of obj?.metadata?.ownerReferences ?? []) {
    if (ref.kind === "WorkerRun" && ref.controller) return String(ref.uid);
  }
  return null;
}

/**
 * Whether the Lease names exactly this holder and fence and, when `runUid` is given, belongs to that
 * run (a run re-created under its name starts again at holder `<name>-a1` and fence 1; only the UID
 * tells the two apart). A cleared Lease matches nobody.
 */
export function holds(lease: LeaseObject | null | undefined, holder: string, fence: number,
  runUid: string | null = null): boolean {
  if (!lease) return false;
  const spec = lease.spec ?? {};
  return spec.holderIdentity === holder && spec.leaseTransitions === fence
    && (runUid === null || controllerUid(lease) === runUid);
}

// --- usage ------------------------------------------------------------------------------------

/** The `tether.dev/usage` value: the attempt's cumulative usage, compact JSON. */
export function usageAnnotation(usage: Usage): string {
  return JSON.stringify({ cents: usage.cents, tokens: usage.tokens });
}

/** Why a cumulative usage report is refused (what the operator would refuse), or null. */
export function validReport(report: Usage, previous: Usage | null): string | null {
  if (!Number.isSafeInteger(report.cents) || !Number.isSafeInteger(report.tokens)) {
    return "cents and tokens must be integers";
  }
  if (report.cents < 0 || report.tokens < 0) return "negative usage";
  if (report.cents > MAX_CENTS || report.tokens > MAX_TOKENS) return "implausibly large usage";
  if (previous !== null && (report.cents < previous.cents || report.tokens < previous.tokens)) {
    return "usage decreased; reports are cumulative";
  }
  return null;
}

/** The longest checkpoint cursor the gateway and the operator accept, in characters. */
export const MAX_CURSOR_CHARS = 1024;

/** Why a checkpoint cursor is refused, or null. */
export function validCursor(cursor: string): string | null {
  const chars = [...cursor].length;
  return chars > MAX_CURSOR_CHARS ? `checkpoint cursor of ${chars} characters exceeds ${MAX_CURSOR_CHARS}` : null;
}

// --- control signals and caps -----------------------------------------------------------------

/** A JSON object (not null, not an array). */
export function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function optionalInt(v: unknown): number | null | undefined {
  if (v === undefined || v === null) return null;
  return typeof v === "number" && Number.isSafeInteger(v) ? v : undefined;
}

/**
 * The signals annotation's value; absent means no signal (defaults). null when it is malformed:
 * the caller keeps the last good signals rather than guess.
 */
export function parseSignals(raw: string | null | undefined): Signals | null {
  if (!raw) return { ...NO_SIGNALS };
  let doc: unknown;
  try {
    doc = JSON.parse(raw);
  } catch {
    return null;
  }
  if (!isObject(doc)) return null;
  const { stop = false, paused = false, reason = null, endsAt = null, stopBy = null } = doc;
  const yieldSignal = doc.yield ?? false;
  const capCents = optionalInt(doc.capCents);
  const capTokens = optionalInt(doc.capTokens);
  // Absent: 0; null is malformed, as for every signal §7 does not allow null for.
  const baseCents = doc.baseCents === null ? undefined : optionalInt(doc.baseCents);
  const baseTokens = doc.baseTokens === null ? undefined : optionalInt(doc.baseTokens);
  if (typeof stop !== "boolean" || typeof paused !== "boolean" || typeof yieldSignal !== "boolean") return null;
  if (stopBy !== null && (typeof stopBy !== "string" || Number.isNaN(Date.parse(stopBy)))) return null;
  if (reason !== null && typeof reason !== "string") return null;
  if (endsAt !== null && (typeof endsAt !== "string" || Number.isNaN(Date.parse(endsAt)))) return null;
  if (capCents === undefined || capTokens === undefined || baseCents === undefined || baseTokens === undefined) {
    return null;
  }
  // Absent: none decided; null or any other malformed value makes the whole annotation malformed,
  // as a wrong type in any other signal does (§7).
  const decisions = doc.decisions === undefined ? {} : parseDecisions(doc.decisions);
  if (decisions === null) return null;
  return {
    stop, yield: yieldSignal, stopBy, paused, reason, endsAt, capCents, capTokens,
    baseCents: baseCents ?? 0, baseTokens: baseTokens ?? 0, decisions,
  };
}

const DECISIONS: readonly string[] = ["Approve", "Deny", "TimedOut"];

function optionalString(v: unknown): string | null | undefined {
  if (v === undefined || v === null) return null;
  return typeof v === "string" ? v : undefined;
}

/**
 * The `decisions` signal: `{"<name>": {"decision", "reason"?, "approver"?}}`. null when it is not
 * that (any entry malformed): a decision is acted upon, so none is taken from a value that is wrong
 * anywhere. Unknown keys of an entry are ignored, as the operator's own model does.
 */
export function parseDecisions(v: unknown): Record<string, GateDecision> | null {
  if (!isObject(v)) return null;
  const out: Record<string, GateDecision> = {};
  for (const [name, entry] of Object.entries(v)) {
    if (!isObject(entry) || typeof entry.decision !== "string" || !DECISIONS.includes(entry.decision)) return null;
    const reason = optionalString(entry.reason);
    const approver = optionalString(entry.approver);
    if (reason === undefined || approver === undefined) return null;
    out[name] = { decision: entry.decision as GateDecision["decision"], reason, approver };
  }
  return out;
}

/** The operator's signals on a Lease (see `parseSignals`). */
export function leaseSignals(lease: LeaseObject | null | undefined): Signals | null {
  return parseSignals(annotations(lease)[ANN_SIGNALS]);
}

/** What is left of a cap for this attempt: cap − earlier attempts' spend − own report. null: no cap. */
export function capRemaining(cap: number | null, base: number, own: number): number | null {
  return cap === null ? null : cap - base - own;
}

/**
 * Why the attempt may not spend any more of the run's own caps, or null: what the control plane
 * last said was left of a cap, less what the attempt reported since (ControlSignals'
 * capRemainingCents / capRemainingTokens; null: no cap), is used up -- nothing left, or less. The
 * meter refuses requests on it, and the run renews at once when a report makes it true.
 */
export function capUsedUp(centsLeft: number | null | undefined, tokensLeft: number | null | undefined): string | null {
  if (typeof centsLeft === "number" && centsLeft <= 0) return `the run's cap is used up (${centsLeft} cents left)`;
  if (typeof tokensLeft === "number" && tokensLeft <= 0) return `the run's token cap is used up (${tokensLeft} tokens left)`;
  return null;
}

/** The signals as the worker sees them, caps counted against its own (latest) usage. */
export function controlSignals(signals: Signals, own: Usage | null): ControlSignals {
  const usage = own ?? { cents: 0, tokens: 0 };
  return {
    stop: signals.stop,
    yielding: signals.stop && signals.yield,
    stopBy: signals.stopBy === null ? null : new Date(signals.stopBy),
    paused: signals.paused,
    reason: signals.reason,
    endsAt: signals.endsAt === null ? null : new Date(signals.endsAt),
    capRemainingCents: capRemaining(signals.capCents, signals.baseCents, usage.cents),
    capRemainingTokens: capRemaining(signals.capTokens, signals.baseTokens, usage.tokens),
  };
}

/**
 * The inverse of `controlSignals`' cap arithmetic: signals equivalent to a gateway reply that says
 * what was left when `own` was reported, so usage reported after that reply counts too.
 */
export function signalsFromRemaining(stop: boolean, paused: boolean, endsAt: string | null,
  centsLeft: number | null, tokensLeft: number | null, own: Usage | null): Signals {
  const usage = own ?? { cents: 0, tokens: 0 };
  return {
    stop, yield: false, stopBy: null, paused, reason: null, endsAt,
    capCents: centsLeft === null ? null : centsLeft + usage.cents,
    capTokens: tokensLeft === null ? null : tokensLeft + usage.tokens,
    baseCents: 0, baseTokens: 0, decisions: {},
  };
}

// --- the worker's two writes --------------------------------------------------------------------

/**
 * The body of a heartbeat: the Lease as last seen (its resourceVersion makes the PUT a
 * compare-and-swap), renewTime set, checkpoint and usage (and `extraAnnotations`, the approval
 * requests) riding on the same write.
 */
export function renewal(lease: LeaseObject, now: Date, checkpoint: string | null = null,
  usage: Usage | null = null, extraAnnotations: Readonly<Record<string, string>> = {}): LeaseObject {
  const body = structuredClone(lease);
  body.spec = { ...(body.spec ?? {}), renewTime: microTime(now) };
  const ann = annotations(body);
  if (checkpoint !== null) ann[ANN_CHECKPOINT] = checkpoint;
  if (usage !== null) ann[ANN_USAGE] = usageAnnotation(usage);
  Object.assign(ann, extraAnnotations);
  body.metadata = { ...(body.metadata ?? {}), annotations: ann };
  return body;
}

export interface PatchOperation {
  op: "test" | "add";
  path: string;
  value: unknown;
}

/**
 * The JSON patch that publishes a result or an error only while `fence` and `holder` are still the
 * run's (and, given `runUid`, only to that run): the API server applies the `add` only if every
 * `test` holds (else 422).
 */
export function fencedPatch(holder: string, fence: number, field: PublishField, value: unknown,
  runUid: string | null = null): PatchOperation[] {
  const sameRun: PatchOperation[] = runUid === null ? [] : [{ op: "test", path: "/metadata/uid", value: runUid }];
  return [
    ...sameRun,
    { op: "test", path: "/status/fence", value: fence },
    { op: "test", path: "/status/holder", value: holder },
    { op: "add", path: `/status/${field}`, value },
  ];
}

/** The attempt outcome only a published result or error produces. */
export const PUBLISHED_OUTCOME: Readonly<Record<PublishField, string>> = { result: "Succeeded", error: "WorkerFailed" };

/** JSON equality: objects compare by keys, not by key order. */
export function jsonEqual(a: unknown, b: unknown): boolean {
  if (a === b) return true;
  if (Array.isArray(a) || Array.isArray(b)) {
    return Array.isArray(a) && Array.isArray(b) && a.length === b.length && a.every((x, i) => jsonEqual(x, b[i]));
  }
  if (!isObject(a) || !isObject(b)) return false;
  const keys = Object.keys(a);
  return keys.length === Object.keys(b).length
    && keys.every((k) => Object.prototype.hasOwnProperty.call(b, k) && jsonEqual(a[k], b[k]));
}

/**
 * Whether the run shows that this attempt's `field` was accepted: after a request whose answer was
 * lost, the retry is refused (a success moves the fence too), yet the first one landed.
 */
export function publicationRecorded(run: RunObject, holder: string, fence: number, field: PublishField,
  value: unknown): boolean {
  const status = run.status ?? {};
  if (status.holder === holder && status.fence === fence) return jsonEqual(status[field], value);
  const mine = (status.attempts ?? []).filter((a) => a.holder === holder && a.fence === fence);
  const last = mine[mine.length - 1];
  return last !== undefined && last.outcome === PUBLISHED_OUTCOME[field]
    && (field !== "result" || jsonEqual(status.result, value));
}

// --- approval requests (docs/protocol.md §9) -----------------------------------------------------

/** A request's name: what a WorkerRunApproval's spec.gate names to decide it. */
const REQUEST_NAME = /^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$/;
/** start and result name the run's own gates (Start, Result), which a worker cannot ask for. */
const RESERVED_REQUEST_NAMES: readonly string[] = ["start", "result"];
export const MAX_REQUESTS_PER_ATTEMPT = 20;
export const MAX_REQUEST_DETAILS = 4096;
export const MAX_REQUEST_TIMEOUT = 31_536_000;
/** The requests annotation as a whole, in UTF-8 bytes: the Lease's annotations share 256 KiB with
 * the operator's signals, and the admission policy refuses a worker's larger one. */
export const MAX_REQUESTS_BYTES = 65_536;

/** One approval a worker asks for: its name, what it wants to do, how long it waits (null: forever). */
export interface ApprovalRequest {
  name: string;
  details: string;
  timeoutSeconds: number | null;
}

/** Why an approval request is malformed (what the operator and the gateway would refuse), or null. */
export function requestRefusal(name: string, details: string, timeoutSeconds: number | null): string | null {
  if (!REQUEST_NAME.test(name)) return "a request's name is lower-case letters, digits and '-', 1 to 63 characters";
  if (RESERVED_REQUEST_NAMES.includes(name)) return `'${name}' names a gate of the run itself (Start, Result), not a request`;
  // Characters as the operator counts them: code points, not UTF-16 units.
  if ([...details].length > MAX_REQUEST_DETAILS) return `details must be a string of at most ${MAX_REQUEST_DETAILS} characters`;
  if (timeoutSeconds !== null && !(Number.isSafeInteger(timeoutSeconds) && timeoutSeconds >= 1
    && timeoutSeconds <= MAX_REQUEST_TIMEOUT)) {
    return `timeoutSeconds must be an integer from 1 to ${MAX_REQUEST_TIMEOUT}`;
  }
  return null;
}

/**
 * The `tether.dev/requests` value: every request of the attempt, by name. Byte for byte what the
 * Python SDK writes (sorted keys, compact, `timeoutSeconds` only when set; JSON.stringify escapes
 * strings as Python's json.dumps does with ensure_ascii=False), so every SDK sends the same
 * annotation for the same requests.
 */
export function requestsAnnotation(requests: readonly ApprovalRequest[]): string {
  const entries = [...requests].sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0)).map((r) => {
    const timeout = r.timeoutSeconds === null ? "" : `,"timeoutSeconds":${r.timeoutSeconds}`;
    return `${JSON.stringify(r.name)}:{"details":${JSON.stringify(r.details)}${timeout}}`;
  });
  return `{${entries.join(",")}}`;
}

// --- reading the API server's answers -------------------------------------------------------------

/** The API server's Status object, or null when the body is not one (a proxy's page). */
function statusDoc(statusBody: string | unknown): Record<string, unknown> | null {
  let doc: unknown = statusBody;
  if (typeof doc === "string") {
    try {
      doc = JSON.parse(doc);
    } catch {
      return null;
    }
  }
  return isObject(doc) ? doc : null;
}

/**
 * etcd refuses a write that would make one object larger than it stores (1.5 MiB; its client's
 * 2 MiB past that): the API server passes it on as a 500 with only this message, no reason.
 */
export const TOO_LARGE_MESSAGES = ["etcdserver: request is too large", "trying to send message larger than max"];

/**
 * Whether the API server refused a write as too large: 413 (over its request limit) or a 500 Status
 * with etcd's message. Either refuses the same value every time: a bad result, never an outage to
 * retry (sdk/vectors/publications.json, shared with the Python and Go SDKs).
 */
export function tooLarge(status: number, statusBody: string | unknown): boolean {
  if (status === 413) return true;
  const message = status === 500 ? statusDoc(statusBody)?.message : undefined;
  return typeof message === "string" && TOO_LARGE_MESSAGES.some((m) => message.includes(m));
}

/**
 * The fields a 422 Status names (`details.causes`); empty when it names none. A 422 without causes
 * is a JSON-patch `test` that did not hold (the run's uid, fence or holder moved on: lost ownership);
 * with causes, the CRD's schema refused the value (a bad result, not lost ownership).
 */
export function invalidCauses(statusBody: string | unknown): InvalidCause[] {
  const details = statusDoc(statusBody)?.details;
  const causes = isObject(details) ? details.causes : undefined;
  if (!Array.isArray(causes)) return [];
  return causes.filter(isObject).map((c) => {
    const cause: InvalidCause = {};
    if (typeof c.field === "string") cause.field = c.field;
    if (typeof c.message === "string") cause.message = c.message;
    if (typeof c.reason === "string") cause.reason = c.reason;
    return cause;
  });
}

/**
 * Whether a 422's causes name the published value itself (`status.<field>`, or a part of it:
 * `status.<field>.x`, `status.<field>[0]`): only then is it a bad value. Causes about other fields
 * say nothing this publication can fix, so that 422 is the failed ownership test.
 */
export function refusesValue(causes: InvalidCause[], field: PublishField): boolean {
  const name = `status.${field}`;
  return causes.some((c) => c.field !== undefined
    && (c.field === name || c.field.startsWith(`${name}.`) || c.field.startsWith(`${name}[`)));
}

/**
 * A 403 from Tether's admission policy (the write is not this attempt's to make: lost ownership), as
 * opposed to RBAC's 403 (a misconfigured identity), which says nothing about ownership.
 */
export function fencedByPolicy(status: number, body: string): boolean {
  return status === 403 && body.includes("ValidatingAdmissionPolicy") && body.includes("tether-worker");
}
