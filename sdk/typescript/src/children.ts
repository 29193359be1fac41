/**
 * Child runs from the worker's side (docs/children.md): one tool call or stage spawned as a
 * WorkerRun of its own, fenced by the attempt that holds its parent, found again by key after a
 * crash, and waited for. Names, digests and bodies are the Python SDK's (`tether.children.api`,
 * `tether.worker.spawning`) byte for byte: sdk/vectors/children.json.
 *
 * A child's name derives from the parent's UID and the caller's key, so a parent attempt that
 * resumed from its checkpoint re-attaches instead of creating it again. A child the operator
 * rejected as a stale attempt's (StaleParent: the attempt that created it lost the parent before it
 * was admitted) never ran, so the key moves on to its next generation (`<key>#1`, ...),
 * deterministically, and the current attempt spawns it there.
 */

import { createHash } from "node:crypto";

import type { Clock } from "./clock.js";
import { ChildFailed, SpawnConflict } from "./errors.js";
import { GROUP, VERSION, isObject, type Json, type JsonObject, type RunObject } from "./protocol.js";
import type { Transport } from "./transport.js";

/** On each child: its parent's name (a label, to list a parent's children), the caller's key and
 * the digest of what it asked for. */
export const LABEL_PARENT = "tether.dev/parent";
export const ANN_CHILD_KEY = "tether.dev/child-key";
export const ANN_SPAWN_DIGEST = "tether.dev/spawn-digest";

/** A child's name: the parent's name cut to this, a dash, and DIGEST_LENGTH hex digits (run names
 * have at most 58 characters). */
const NAME_PREFIX_LENGTH = 47;
const DIGEST_LENGTH = 10;
/** The caller's key: what an idempotency key may be, a stable name of one tool call. */
const KEY_PATTERN = /^[A-Za-z0-9]([A-Za-z0-9._:/-]{0,126}[A-Za-z0-9])?$/;

/** A child rejected as a stale attempt's moves its key on, at most this often (each is a lost parent). */
const MAX_GENERATIONS = 16;
const STALE_PARENT = "StaleParent";
/** How long a resumed attempt waits for the operator's word on a child an earlier attempt spawned,
 * and how often it looks. */
const JUDGED_WITHIN_SECONDS = 60;
const JUDGED_POLL_SECONDS = 0.5;
/** The phases a run does not leave. */
const TERMINAL_PHASES: readonly string[] = [
  "Succeeded", "Failed", "Lost", "Cancelled", "BudgetExceeded", "DeadlineExceeded", "Rejected",
];

/** What a child's spec says of the run that spawns it, read once from the parent itself. */
export interface Parent {
  name: string;
  uid: string;
  /** The WorkerClass the parent took (`status.class.name`), if any. */
  className: string | null;
  /** The parent's own depth in its tree (0: a root run). */
  depth: number;
  /** The WorkerBudget the parent draws on: its children must draw on it too. */
  budgetRef: string | null;
  /** The parent has a cap in cents (tokens): each child names its share of it. */
  cappedCents: boolean;
  cappedTokens: boolean;
}

/** What a spawn asks for: the child's class, payload, share of this run's caps, and any other spec
 * field (its pod template, ...). */
export interface SpawnOptions {
  className?: string;
  payload?: JsonObject;
  /** Its share of this run's cap in cents: required when this run has one. */
  capCents?: number;
  /** Its share of this run's token cap: required when this run has one. */
  maxTokens?: number;
  /** Any other fields of the child's WorkerRun spec. */
  spec?: JsonObject;
}

/** How `Child.result` waits. */
export interface ChildResultOptions {
  /** Give up (an Error) after this many seconds; null or absent: wait until the child ends. */
  timeoutSeconds?: number | null;
  /** How often to read the child (default 2 s). */
  pollSeconds?: number;
}

export type CallOptions = SpawnOptions & ChildResultOptions;

/** What spawning goes through: a transport's child-run calls. */
export type ChildRuns = Required<Pick<Transport, "spawn" | "child">>;

/** `value` if it is an object, else an empty one (bodies as served may lack any key). */
function asObject(value: unknown): Record<string, unknown> {
  return isObject(value) ? value : {};
}

function sha256(text: string): string {
  return createHash("sha256").update(text, "utf8").digest("hex");
}

/** Whether `key` may name a child (1 to 128 letters, digits and `. _ : / -`, starting and ending with a
 * letter or digit). */
export function validKey(key: string): boolean {
  return KEY_PATTERN.test(key);
}

function keyRefusal(key: string): string {
  return `child key ${JSON.stringify(key)} must be 1 to 128 letters, digits and . _ : / - `
    + "(starting and ending with a letter or digit)";
}

/**
 * The child's name for `key` under this parent (by UID: a namesake parent gets other names);
 * `generation` counts the children of that key rejected as a stale attempt's. Throws RangeError
 * for a malformed key.
 */
export function childName(parentName: string, parentUid: string, key: string, generation = 0): string {
  if (!validKey(key)) throw new RangeError(keyRefusal(key));
  const named = generation === 0 ? key : `${key}#${generation}`;
  const digest = sha256(`${parentUid}/${named}`).slice(0, DIGEST_LENGTH);
  return `${parentName.slice(0, NAME_PREFIX_LENGTH).replace(/[-.]+$/, "")}-${digest}`;
}

/** Orders strings by code point, as Python sorts them (`<` compares UTF-16 units). */
function byCodePoint(a: string, b: string): number {
  return Buffer.compare(Buffer.from(a, "utf8"), Buffer.from(b, "utf8"));
}

/**
 * A number as Python's json.dumps writes it once it has read JSON.stringify's text: integers (no
 * `.` or exponent in that text) alike, other numbers as Python's float repr, which takes the
 * exponent form below 1e-4 and from 1e16, with at least two exponent digits (`1e-07`, not `1e-7`).
 */
function pythonNumber(n: number): string {
  const text = JSON.stringify(n);
  if (!/[.e]/.test(text)) return text;
  const [mantissa, exponent] = n.toExponential().split("e") as [string, string];
  const e = Number(exponent);
  if (e >= -4 && e < 16) return text;
  return `${mantissa}e${e < 0 ? "-" : "+"}${String(Math.abs(e)).padStart(2, "0")}`;
}

/**
 * Compact JSON with every object's keys sorted and non-ASCII kept as it is: Python's
 * `json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)` (JSON.stringify escapes
 * strings alike), so every SDK and the gateway digest one spec alike.
 */
export function canonicalJson(value: Json): string {
  if (Array.isArray(value)) return `[${value.map(canonicalJson).join(",")}]`;
  if (typeof value === "number") return pythonNumber(value);
  if (value === null || typeof value !== "object") return JSON.stringify(value);
  const keys = Object.keys(value).sort(byCodePoint);
  return `{${keys.map((k) => `${JSON.stringify(k)}:${canonicalJson(value[k] as Json)}`).join(",")}}`;
}

/**
 * What a spawn asked for (the child's spec as the caller gave it, before any default), as a
 * digest: two spawns of one key are one child only when they asked for the same.
 */
export function spawnDigest(spec: JsonObject): string {
  return sha256(canonicalJson(spec));
}

/** The parent as its children name it, from the run as served: what `status.class.defaults.budget`
 * gives it fills, field by field, what its `spec.budget` leaves out. */
export function parentOf(run: RunObject): Parent {
  const meta = asObject(run.metadata);
  const spec = asObject(run.spec);
  const taken = asObject(asObject(run.status).class);
  const budget = { ...asObject(asObject(taken.defaults).budget), ...asObject(spec.budget) };
  const budgetRef = asObject(budget.budgetRef).name;
  return {
    name: String(meta.name),
    uid: String(meta.uid),
    className: typeof taken.name === "string" ? taken.name : null,
    depth: Number(asObject(spec.parentRef).depth ?? 0),
    budgetRef: typeof budgetRef === "string" ? budgetRef : null,
    cappedCents: budget.capCents !== undefined && budget.capCents !== null,
    cappedTokens: budget.maxTokens !== undefined && budget.maxTokens !== null,
  };
}

/**
 * The child's spec as the caller asked for it (the digest's input: it has no parentRef, which names
 * the attempt and changes when a resumed attempt re-attaches). With the parent known, the child
 * draws on its WorkerBudget, and a capped parent's child must name its share (RangeError
 * otherwise); `parent` null leaves both to the gateway, which builds the child.
 */
export function childSpec(parent: Parent | null, ask: SpawnOptions): JsonObject {
  const spec: JsonObject = { executor: "Pod", ...(ask.spec ?? {}) };
  if (ask.className !== undefined) spec.className = ask.className;
  if (ask.payload !== undefined) spec.payload = ask.payload;
  const budget = { ...asObject(spec.budget) } as JsonObject;
  if (ask.capCents !== undefined) budget.capCents = ask.capCents;
  if (ask.maxTokens !== undefined) budget.maxTokens = ask.maxTokens;
  if (parent !== null) {
    if (parent.budgetRef !== null && !Object.hasOwn(budget, "budgetRef")) budget.budgetRef = { name: parent.budgetRef };
    if (parent.cappedCents && !Object.hasOwn(budget, "capCents")) {
      throw new RangeError(`run ${parent.name} has a cap in cents: a child names its share of it (capCents)`);
    }
    if (parent.cappedTokens && !Object.hasOwn(budget, "maxTokens")) {
      throw new RangeError(`run ${parent.name} has a token cap: a child names its share of it (maxTokens)`);
    }
  }
  if (Object.keys(budget).length > 0) spec.budget = budget;
  return spec;
}

/** A WorkerRun a spawn creates: named, labelled, owned and fenced as the parent's child. */
export type ChildBody = JsonObject & { metadata: JsonObject & { name: string } };

/** The whole child WorkerRun a pod's spawn creates for `key` at `generation`: the attempt
 * (`holder`, `fence`) that spawns it is its `spec.parentRef`. */
export function childBody(parent: Parent, namespace: string, holder: string, fence: number, key: string,
  generation: number, spec: JsonObject): ChildBody {
  const ref: JsonObject = { name: parent.name, uid: parent.uid, holder, fence, depth: parent.depth + 1 };
  if (parent.className !== null) ref.className = parent.className;
  const apiVersion = `${GROUP}/${VERSION}`;
  return {
    apiVersion, kind: "WorkerRun",
    metadata: {
      name: childName(parent.name, parent.uid, key, generation), namespace,
      labels: { [LABEL_PARENT]: parent.name },
      annotations: { [ANN_CHILD_KEY]: key, [ANN_SPAWN_DIGEST]: spawnDigest(spec) },
      ownerReferences: [{ apiVersion, kind: "WorkerRun", name: parent.name, uid: parent.uid, controller: true }],
    },
    spec: { ...spec, parentRef: ref },
  };
}

function phaseOf(run: RunObject): string | null {
  const phase = run.status?.phase;
  return typeof phase === "string" ? phase : null;
}

/** The run's Ready condition (empty when it has none). */
function ready(run: RunObject): Record<string, unknown> {
  const conditions = run.status?.conditions;
  const found = Array.isArray(conditions) ? conditions.find((c) => asObject(c).type === "Ready") : undefined;
  return asObject(found);
}

/** A spawned child run: its key, name and body as last read. `result()` waits for it to end. */
export class Child {
  /** The child as last read. */
  body: RunObject;

  constructor(
    readonly key: string,
    readonly name: string,
    body: RunObject,
    private readonly wait: (child: Child, options: ChildResultOptions) => Promise<JsonObject>,
  ) {
    this.body = body;
  }

  /** Its phase as last read; null until the operator has judged it. */
  get phase(): string | null {
    return phaseOf(this.body);
  }

  get ended(): boolean {
    return this.phase !== null && TERMINAL_PHASES.includes(this.phase);
  }

  /** Why it is where it is (Ready's reason: StaleParent, TreeBudgetExhausted, ...), else its phase. */
  get reason(): string {
    const reason = ready(this.body).reason;
    return typeof reason === "string" && reason !== "" ? reason : this.phase ?? "";
  }

  /**
   * Waits for the child to end and resolves with its result. Rejects with ChildFailed when it ends
   * without one (or is deleted), with an Error past `timeoutSeconds`, and with LeaseLost,
   * OwnershipUnknown or StopRequested when the attempt that waits no longer holds the parent: a
   * child's result reaches the parent only through the attempt that holds it.
   */
  result(options: ChildResultOptions = {}): Promise<JsonObject> {
    return this.wait(this, options);
  }
}

/** A child that ended: its result once it Succeeded; ChildFailed for any other end. */
export function outcome(child: Child): JsonObject {
  const status = child.body.status ?? {};
  if (child.phase === "Succeeded") return isObject(status.result) ? status.result as JsonObject : {};
  const message = ready(child.body).message;
  throw new ChildFailed(child.name, String(child.phase), child.reason, typeof message === "string" ? message : "",
    isObject(status.error) ? status.error as JsonObject : null);
}

/** Throws SpawnConflict unless `got` is this parent's child and was asked for `digest`. */
function judge(got: RunObject, parent: Pick<Parent, "name" | "uid">, key: string, digest: string): void {
  const meta = asObject(got.metadata);
  const owners = Array.isArray(meta.ownerReferences) ? meta.ownerReferences.map((r) => asObject(r).uid) : [];
  if (!owners.includes(parent.uid) || asObject(meta.labels)[LABEL_PARENT] !== parent.name) {
    throw new SpawnConflict(`${String(meta.name)} exists and is not a child of ${parent.name}`);
  }
  if (asObject(meta.annotations)[ANN_SPAWN_DIGEST] !== digest) {
    throw new SpawnConflict(`key ${JSON.stringify(key)} was spawned before as ${String(meta.name)} with another spec `
      + "(class, payload, caps): one key is one tool call");
  }
}

/**
 * An earlier attempt's child the operator has not judged yet: admitted (it is this call's) or
 * rejected as a stale attempt's (the key moves on). Reads it until it has a phase, for at most
 * JUDGED_WITHIN_SECONDS: the child as last read, or null once it was deleted meanwhile.
 */
async function judgment(runs: ChildRuns, child: RunObject, name: string, clock: Clock): Promise<RunObject | null> {
  let read: RunObject | null = child;
  for (let waited = 0; read !== null && phaseOf(read) === null && waited < JUDGED_WITHIN_SECONDS;
    waited += JUDGED_POLL_SECONDS) {
    await clock.sleep(JUDGED_POLL_SECONDS);
    read = await runs.child(name);
  }
  return read;
}

/**
 * Creates the child for `key`, or finds the one made before (by this attempt or an earlier one):
 * its body as last read. `parent` is the run as its children name it, `holder` and `fence` the
 * attempt that spawns. Throws RangeError for a malformed key, and SpawnConflict for a run of that
 * name that is not this parent's or was asked for something else.
 */
export async function spawnRun(runs: ChildRuns, parent: Pick<Parent, "name" | "uid">, holder: string, fence: number,
  key: string, spec: JsonObject, clock: Clock): Promise<RunObject> {
  if (!validKey(key)) throw new RangeError(keyRefusal(key));
  const digest = spawnDigest(spec);
  let generation = 0;
  for (let tries = 0; generation < MAX_GENERATIONS && tries < 3 * MAX_GENERATIONS; tries++) {
    const got = await runs.spawn(key, generation, spec);
    judge(got, parent, key, digest);
    const name = String(asObject(got.metadata).name);
    const ref = asObject(asObject(got.spec).parentRef);
    const earlier = ref.holder !== holder || ref.fence !== fence;
    const judged = earlier && phaseOf(got) === null ? await judgment(runs, got, name, clock) : got;
    if (judged === null) continue; // deleted while it was waited for: made again, under the same generation
    if (earlier && phaseOf(judged) === null) {
      throw new SpawnConflict(`${name}, spawned for key ${JSON.stringify(key)} by an earlier attempt, was not `
        + `judged within ${JUDGED_WITHIN_SECONDS} s; spawn it again`);
    }
    const neverRan = !Number(judged.status?.attempt ?? 0);
    if (phaseOf(judged) === "Rejected" && ready(judged).reason === STALE_PARENT && neverRan) {
      generation += 1; // a lost attempt's child, never admitted and never run: the key moves on
      continue;
    }
    return judged;
  }
  throw new SpawnConflict(`key ${JSON.stringify(key)}: ${MAX_GENERATIONS} children rejected as stale attempts' `
    + "(or deleted) in a row");
}

/** Reads the child until it ended; an Error after `timeoutSeconds`, ChildFailed once it is deleted. */
export async function waitEnded(runs: ChildRuns, child: Child, options: ChildResultOptions, clock: Clock): Promise<void> {
  const { timeoutSeconds = null, pollSeconds = 2 } = options;
  const deadline = timeoutSeconds === null ? null : clock.now() + timeoutSeconds;
  for (;;) {
    const got = await runs.child(child.name);
    if (got === null) throw new ChildFailed(child.name, "Deleted", "Deleted", "the child run was deleted", null);
    child.body = got;
    if (child.ended) return;
    if (deadline !== null && clock.now() >= deadline) {
      throw new Error(`child run ${child.name} has not ended within ${timeoutSeconds} s (phase ${child.phase})`);
    }
    await clock.sleep(pollSeconds);
  }
}
