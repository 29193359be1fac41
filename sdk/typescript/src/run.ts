/**
 * The worker side of the ownership protocol. A WorkerRun renews its run's lease on a timer of its own
 * (the user's work does not delay it, as long as it does not block the event loop), with the
 * resourceVersion it last saw, so a renewal can only succeed while the lease is still its own. It
 * fences itself on a monotonic clock, and publishes its result with one fenced write.
 */

import type { KubeConfig } from "@kubernetes/client-node";
import { context, trace, type Attributes, type Context } from "@opentelemetry/api";

import {
  Child, childSpec, outcome, spawnRun, waitEnded, type CallOptions, type ChildResultOptions, type ChildRuns,
  type SpawnOptions,
} from "./children.js";
import { systemClock, type Clock } from "./clock.js";
import { LeaseLost, OwnershipUnknown, ResultInvalid, StopRequested, TetherWorkerError, ToolTimeout } from "./errors.js";
import { GatewayTransport, claimRun, type ToolClaim } from "./gateway.js";
import { KubeTransport, loadKubeConfig } from "./kube.js";
import { jsonLogger, type LogLevel, type Logger } from "./log.js";
import {
  ENV,
  MAX_REQUESTS_BYTES,
  MAX_REQUESTS_PER_ATTEMPT,
  NO_SIGNALS,
  PAYLOAD_FROM_RUN,
  capUsedUp,
  controlSignals,
  jsonEqual,
  nextDelay,
  ownership,
  requestRefusal,
  requestTimeout,
  requestsAnnotation,
  safetyMargin,
  validCursor,
  validReport,
  type ApprovalRequest,
  type ControlSignals,
  type GateDecision,
  type JsonObject,
  type Ownership,
  type PublishField,
  type Signals,
  type Usage,
} from "./protocol.js";
import {
  ENV_TRACEPARENT, Renewals, SpanKind, SpanStatusCode, TRACER_NAME, attemptContext, inSpan, injectTraceHeaders, parentFor,
  redactUrl,
} from "./tracing.js";
import { Unanswered, type Renewal, type Transport } from "./transport.js";

// Node 20.0–20.3 lack the well-known symbol that `await using` looks up.
(Symbol as unknown as { asyncDispose?: symbol }).asyncDispose ??= Symbol("Symbol.asyncDispose");

// In a container the worker is usually PID 1, and PID 1 ignores SIGTERM unless something listens:
// a deleted pod would sit out its grace period and die by SIGKILL (137). Unless the program listens
// itself, SIGTERM closes every running WorkerRun (its last renewal reports what was spent) and exits
// 143, as any other process would.
const running = new Set<WorkerRun>();
let sigtermInstalled = false;

function exitOnSigterm(run: WorkerRun): void {
  running.add(run);
  if (sigtermInstalled || process.listenerCount("SIGTERM") > 0) return;
  sigtermInstalled = true;
  process.once("SIGTERM", () => {
    void Promise.allSettled([...running].map((r) => r.close())).finally(() => process.exit(143));
  });
}

export interface WorkerRunOptions {
  name: string;
  namespace: string;
  holder: string;
  fence: number;
  attempt: number;
  leaseDurationSeconds: number;
  renewIntervalSeconds: number;
  transport: Transport;
  payload?: JsonObject;
  /** The checkpoint cursor this attempt resumes from. */
  checkpoint?: string | null;
  /** Default `<namespace>/<name>`. */
  idempotencyKey?: string;
  runUid?: string | null;
  /** Why a person denied the previous attempt's result (spec.review.result). */
  reviewFeedback?: string | null;
  /** The attempt's W3C trace context (TRACEPARENT, the claim reply's traceparent): the SDK's spans
   * join that trace. Tracing only: it grants nothing. */
  traceparent?: string | null;
  clock?: Clock;
  logger?: Logger;
}

/** A person's decision on a `requestApproval`. */
export interface ApprovalDecision {
  readonly decision: GateDecision["decision"];
  readonly reason: string | null;
  readonly approver: string | null;
  /** decision is Approve (Deny and TimedOut are not). */
  readonly approved: boolean;
}

export interface ApprovalOptions {
  /** How often to renew while waiting, so the decision arrives promptly (default 2000 ms). */
  pollMs?: number;
}

/** What `fromEnv` and `claim` accept besides their required arguments. */
export interface StartOptions {
  clock?: Clock;
  logger?: Logger;
}

export interface FromEnvOptions extends StartOptions {
  /** Default `process.env`. */
  env?: NodeJS.ProcessEnv;
  /** Default: in-cluster config, else $KUBECONFIG (see loadKubeConfig). */
  kubeConfig?: KubeConfig;
}

export interface ClaimOptions extends StartOptions {
  /** Distinguishes processes that share one identity; every later call names it. */
  workerId?: string | null;
  /** Seconds the claim request may take (default 30). */
  claimTimeoutSeconds?: number;
}

export interface EffectOptions {
  /** Names the effect in its Idempotency-Key: `<idempotencyKey>:<operation>`, stable across attempts. */
  operation: string;
  method?: string;
  /** A string or bytes are sent as they are; anything else as JSON. */
  body?: unknown;
  headers?: Record<string, string>;
  /** Default 30 000 ms; past it the call is a ToolTimeout. */
  timeoutMs?: number;
}

/** The child-run calls of a transport that spawns. */
type Spawning = Required<Pick<Transport, "parent" | "spawn" | "child">>;

function canSpawn(transport: Transport): transport is Transport & Spawning {
  return transport.parent !== undefined && transport.spawn !== undefined && transport.child !== undefined;
}

function required(env: NodeJS.ProcessEnv, key: string): string {
  const value = env[key];
  if (value === undefined || value === "") throw new Error(`${key} is not set: is this a Tether worker pod?`);
  return value;
}

function number(env: NodeJS.ProcessEnv, key: string, integer: boolean): number {
  const raw = required(env, key);
  const value = Number(raw);
  if (!Number.isFinite(value) || (integer && !Number.isSafeInteger(value))) {
    throw new Error(`${key}=${JSON.stringify(raw)} is not ${integer ? "an integer" : "a number"}`);
  }
  return value;
}

/** One attempt of a run, as seen by the worker that holds it. */
export class WorkerRun {
  readonly name: string;
  readonly namespace: string;
  readonly holder: string;
  readonly fence: number;
  readonly attempt: number;
  readonly runUid: string | null;
  readonly leaseDurationSeconds: number;
  readonly renewIntervalSeconds: number;
  readonly margin: number;
  readonly payload: JsonObject;
  readonly idempotencyKey: string;
  /** Why a person denied the previous attempt's result (spec.review.result), for this one to act
   * on; null when none was. */
  readonly reviewFeedback: string | null;
  /** The attempt's W3C trace context as the operator handed it (null: none). */
  readonly traceparent: string | null;
  /** The attempt's trace as an OpenTelemetry context: parent your own spans on it (the SDK's are). */
  readonly traceContext: Context;
  /** The last checkpoint: the one resumed from, then each one recorded. */
  checkpointCursor: string | null;
  /** Monotonic time the current signals arrived (null: none yet). */
  signalsSeenAt: number | null = null;

  private readonly transport: Transport;
  private readonly clock: Clock;
  private readonly logger: Logger;
  /** Start of the last confirmed renewal; nothing is confirmed before the first one. */
  private confirmedAt = -Infinity;
  private isLost = false;
  private isFinished = false;
  private stopping = false;
  private closed = false;
  private pendingCheckpoint: string | null = null;
  private usage: Usage | null = null;
  private rawSignals: Signals = { ...NO_SIGNALS };
  /** Every approval this attempt asked for, by name: each renewal carries them all. */
  private readonly requests = new Map<string, ApprovalRequest>();
  /** Aborted (and replaced) when something a waiting requestApproval acts on changes: new signals,
   * lost ownership, close. */
  private signalled = new AbortController();
  /** Renewals run one at a time (a flush and the heartbeat must not race on the resourceVersion). */
  private renewals: Promise<unknown> = Promise.resolve();
  /** Which renewals are spans. */
  private readonly renewalSpans = new Renewals();
  private wake: AbortController | null = null;
  /** A renewal is owed now (a report used up the cap): the heartbeat does not wait for it. */
  private wakePending = false;
  private loop: Promise<void> | null = null;

  constructor(options: WorkerRunOptions) {
    this.name = options.name;
    this.namespace = options.namespace;
    this.holder = options.holder;
    this.fence = options.fence;
    this.attempt = options.attempt;
    this.runUid = options.runUid ?? null;
    this.leaseDurationSeconds = options.leaseDurationSeconds;
    this.renewIntervalSeconds = options.renewIntervalSeconds;
    this.margin = safetyMargin(options.leaseDurationSeconds);
    this.payload = options.payload ?? {};
    this.checkpointCursor = options.checkpoint ?? null;
    this.reviewFeedback = options.reviewFeedback ?? null;
    this.traceparent = options.traceparent ?? null;
    this.traceContext = attemptContext(this.traceparent);
    this.idempotencyKey = options.idempotencyKey || `${options.namespace}/${options.name}`;
    this.transport = options.transport;
    this.clock = options.clock ?? systemClock;
    this.logger = options.logger ?? jsonLogger("warn");
  }

  // --- construction ------------------------------------------------------------------------------

  /**
   * A pod worker: reads what the operator put into the environment, renews once (so ownership is
   * confirmed before any work), and starts the heartbeat.
   */
  static async fromEnv(options: FromEnvOptions = {}): Promise<WorkerRun> {
    const env = options.env ?? process.env;
    const name = required(env, ENV.run);
    const namespace = required(env, ENV.namespace);
    const holder = required(env, ENV.holder);
    const fence = number(env, ENV.fence, true);
    const renewIntervalSeconds = number(env, ENV.renewInterval, false);
    const runUid = env[ENV.runUid] || null;
    const logger = options.logger ?? jsonLogger("warn");
    const transport = new KubeTransport(namespace, name, holder, fence, runUid,
      options.kubeConfig ?? loadKubeConfig({ env }), requestTimeout(renewIntervalSeconds),
      (message, fields) => logger("warn", message, { run: `${namespace}/${name}`, ...fields }));
    let payload: JsonObject = {};
    if (env[ENV.payload] !== undefined) {
      payload = JSON.parse(env[ENV.payload] || "{}") as JsonObject;
    } else if (env[ENV.payloadFrom] !== undefined) {
      if (env[ENV.payloadFrom] !== PAYLOAD_FROM_RUN) {
        throw new Error(`${ENV.payloadFrom}=${JSON.stringify(env[ENV.payloadFrom])}: this SDK reads only "${PAYLOAD_FROM_RUN}"`);
      }
      payload = await transport.readPayload();
    }
    const run = new WorkerRun({
      name, namespace, holder, fence, runUid, payload, transport, renewIntervalSeconds,
      attempt: number(env, ENV.attempt, true),
      leaseDurationSeconds: number(env, ENV.leaseDuration, false),
      checkpoint: env[ENV.checkpoint] ?? null,
      idempotencyKey: env[ENV.idempotencyKey] ?? "",
      reviewFeedback: env[ENV.reviewFeedback] || null,
      traceparent: env[ENV_TRACEPARENT] || null,
      ...(options.clock ? { clock: options.clock } : {}),
      logger,
    });
    await run.start();
    return run;
  }

  /**
   * An external worker: claims the run's open attempt through the Tether gateway, renews once and
   * starts the heartbeat. Throws ClaimRefused (402 budget, 409 held or nothing open, 403, ...).
   */
  static async claim(gatewayUrl: string, namespace: string, name: string, token: string,
    options: ClaimOptions = {}): Promise<WorkerRun> {
    const workerId = options.workerId ?? null;
    const reply = await claimRun(gatewayUrl, namespace, name, token, workerId, options.claimTimeoutSeconds);
    const transport = new GatewayTransport(gatewayUrl, namespace, name, token, reply.holder, reply.fence,
      requestTimeout(reply.renewIntervalSeconds), workerId, reply.runUid, reply.toolClaim);
    const run = new WorkerRun({
      name, namespace, transport,
      holder: reply.holder,
      fence: reply.fence,
      attempt: reply.attempt,
      runUid: reply.runUid,
      leaseDurationSeconds: reply.leaseDurationSeconds,
      renewIntervalSeconds: reply.renewIntervalSeconds,
      payload: reply.payload,
      checkpoint: reply.checkpoint,
      idempotencyKey: reply.idempotencyKey,
      reviewFeedback: reply.reviewFeedback,
      traceparent: reply.traceparent,
      ...(options.clock ? { clock: options.clock } : {}),
      ...(options.logger ? { logger: options.logger } : {}),
    });
    await run.start();
    return run;
  }

  /** Renews once, then heartbeats every renewIntervalSeconds. fromEnv and claim call it. */
  async start(): Promise<this> {
    if (this.loop === null) {
      exitOnSigterm(this);
      // The first renewal and the heartbeat's belong to the attempt, not to the caller's span.
      await context.with(this.traceContext, () => this.renew());
      this.loop = context.with(this.traceContext, () => this.heartbeat());
    }
    return this;
  }

  // --- ownership ---------------------------------------------------------------------------------

  /** owned | unknown | lost, now. */
  get ownership(): Ownership {
    return ownership(this.isLost, this.clock.now(), this.confirmedAt, this.leaseDurationSeconds, this.margin);
  }

  /** The API server confirmed that this worker no longer owns the run. */
  get lost(): boolean {
    return this.isLost;
  }

  /** A result or an error of this attempt was published: nothing more is reported. */
  get finished(): boolean {
    return this.isFinished;
  }

  /** No renewal confirmed recently enough to be sure of ownership. */
  get ownershipUnknown(): boolean {
    return this.ownership === "unknown";
  }

  get owned(): boolean {
    return this.ownership === "owned";
  }

  /** stop, paused, reason, endsAt and what is left of the run's caps, as of the last renewal. */
  get signals(): ControlSignals {
    return controlSignals(this.rawSignals, this.usage);
  }

  /** External workers: the run's short-lived ServiceAccount token, refreshed on every heartbeat. */
  get toolClaim(): ToolClaim | null {
    return this.transport instanceof GatewayTransport ? this.transport.toolClaim : null;
  }

  /** Whether the heartbeat is running. */
  get heartbeating(): boolean {
    return this.loop !== null && this.active();
  }

  /** Call before every side effect: throws StopRequested, LeaseLost or OwnershipUnknown. */
  ensureOwner(): void {
    if (this.rawSignals.stop) {
      throw new StopRequested(this.rawSignals.reason ?? "the control plane asked this worker to stop",
        this.rawSignals.yield);
    }
    if (this.isLost) throw new LeaseLost(`${this.holder} lost run ${this.namespace}/${this.name} (fence ${this.fence})`);
    if (this.ownership === "unknown") {
      const since = this.clock.now() - this.confirmedAt;
      throw new OwnershipUnknown(Number.isFinite(since)
        ? `no renewal confirmed for ${since.toFixed(1)}s` : "no renewal confirmed yet");
    }
  }

  private log(level: LogLevel, message: string, event: string, extra: Record<string, unknown> = {}): void {
    const left = this.confirmedAt + this.leaseDurationSeconds - this.clock.now();
    this.logger(level, message, {
      event, run: `${this.namespace}/${this.name}`, attempt: this.attempt, fence: this.fence, holder: this.holder,
      leaseDeadlineIn: Number.isFinite(left) ? Math.round(left * 1000) / 1000 : null, ...extra,
    });
  }

  private markLost(why: string): void {
    if (!this.isLost) {
      this.isLost = true;
      this.log("warn", `lease lost: ${why}`, "heartbeat_lost", { reason: why });
      this.wake?.abort();
      this.notify();
    }
  }

  // --- heartbeat ---------------------------------------------------------------------------------

  private active(): boolean {
    return !this.stopping && !this.isLost && !this.isFinished;
  }

  private async heartbeat(): Promise<void> {
    while (this.active()) {
      this.wake = new AbortController();
      if (!this.wakePending) {
        await this.clock.sleep(this.renewIntervalSeconds, { signal: this.wake.signal, keepAlive: false });
      }
      if (!this.active()) break;
      await this.renewLogged();
    }
  }

  /**
   * One renewal now (after any renewal in flight): a conditional update of the lease carrying the
   * pending checkpoint and the usage. Resolves true when confirmed. No answer resolves false; an
   * unexpected failure (a malformed answer) rejects.
   */
  renew(): Promise<boolean> {
    const next = this.renewals.then(() => this.renewNow());
    this.renewals = next.catch(() => undefined);
    return next;
  }

  /** The heartbeat must outlive any one failure: an unexpected one is logged and confirms nothing,
   * so ownership turns unknown on schedule until a renewal succeeds again. */
  private async renewLogged(): Promise<boolean> {
    try {
      return await this.renew();
    } catch (err) {
      this.log("error", "heartbeat failed unexpectedly", "heartbeat_error",
        { error: String((err as Error)?.stack ?? err).slice(0, 2000) });
      return false;
    }
  }

  /** Attributes of every span of this attempt. */
  spanAttributes(): Attributes {
    return {
      "k8s.namespace.name": this.namespace, "tether.run.name": this.name, "tether.attempt": this.attempt,
      "tether.fence": this.fence, "tether.holder": this.holder, ...(this.runUid ? { "tether.run.uid": this.runUid } : {}),
    };
  }

  /** One renewal, a `tether.renew` span only when it is news (Renewals), made afterwards with the
   * renewal's start time. */
  private async renewNow(): Promise<boolean> {
    const parent = parentFor(this.traceContext);
    const startTime = Date.now();
    const carried = JSON.stringify([this.pendingCheckpoint, this.usage, [...this.requests.values()]]);
    const signals = this.rawSignals;
    const span = (attributes: Record<string, string>) => trace.getTracer(TRACER_NAME).startSpan("tether.renew",
      { kind: SpanKind.CLIENT, startTime, attributes: { ...this.spanAttributes(), ...this.renewalSpans.skipped(), ...attributes } },
      parent);
    let ok: boolean;
    try {
      ok = await this.renewOnce();
    } catch (err) {
      const failed = span({});
      failed.recordException(err as Error);
      failed.setStatus({ code: SpanStatusCode.ERROR, message: String((err as Error)?.name ?? err) });
      failed.end();
      throw err;
    }
    const outcome = ok ? "confirmed" : this.isLost ? "lost" : "unconfirmed";
    if (this.renewalSpans.news(outcome, carried, this.rawSignals !== signals)) span({ "tether.renewal": outcome }).end();
    return ok;
  }

  private async renewOnce(): Promise<boolean> {
    if (this.isLost) return false;
    this.wakePending = false; // this renewal carries every report made so far
    const started = this.clock.now();
    let result: Renewal;
    try {
      result = await this.transport.renew(this.pendingCheckpoint, this.usage, [...this.requests.values()]);
    } catch (err) {
      if (!(err instanceof Unanswered)) throw err;
      this.log("warn", "heartbeat got no answer", "heartbeat_unanswered", { error: err.message });
      return false;
    }
    if (result.lost) {
      this.markLost(result.why);
    } else if (!result.ok) {
      this.log("warn", "heartbeat refused", "heartbeat_refused", { reason: result.why });
    }
    if (!result.ok) return false;
    this.confirmedAt = Math.max(this.confirmedAt, started);
    if (result.signals !== null) this.takeSignals(result.signals);
    this.log("debug", "heartbeat ok", "heartbeat_ok");
    return true;
  }

  private takeSignals(signals: Signals): void {
    if (jsonEqual(signals, this.rawSignals)) return;
    this.rawSignals = signals;
    this.signalsSeenAt = this.clock.now();
    this.notify();
    this.log("info", "control signals changed", "signals_changed",
      { stop: signals.stop, paused: signals.paused, reason: signals.reason });
  }

  // --- progress ----------------------------------------------------------------------------------

  /**
   * Records progress; it rides on the next renewal. With `flush`, renews now and resolves once that
   * renewal was answered (check `owned` to know whether it was confirmed). Rejects with RangeError
   * a cursor over 1024 characters (the gateway and the operator refuse it).
   */
  async checkpoint(cursor: string, options: { flush?: boolean } = {}): Promise<void> {
    const why = validCursor(cursor);
    if (why !== null) throw new RangeError(why);
    this.pendingCheckpoint = cursor;
    this.checkpointCursor = cursor;
    if (options.flush) {
      await inSpan("tether.checkpoint", parentFor(this.traceContext), this.spanAttributes(), SpanKind.INTERNAL,
        () => this.renewLogged());
    }
  }

  /**
   * The attempt's cumulative usage; rides on the next renewal. Throws RangeError for a report the
   * operator would refuse (not integers, negative, decreasing, implausibly large), here where the
   * caller can still fix it. A report that uses up what is left of the run's cap
   * (`signals.capRemainingCents` / `capRemainingTokens` reaching 0) wakes the heartbeat: the
   * control plane hears of it at once.
   */
  reportUsage(usage: { cents: number; tokens?: number }): void {
    const report: Usage = { cents: usage.cents, tokens: usage.tokens ?? 0 };
    const why = validReport(report, this.usage);
    if (why !== null) throw new RangeError(`usage report refused: ${why}`);
    const before = controlSignals(this.rawSignals, this.usage);
    this.usage = report;
    const after = controlSignals(this.rawSignals, report);
    const usedUp = capUsedUp(after.capRemainingCents, after.capRemainingTokens);
    if (usedUp !== null && capUsedUp(before.capRemainingCents, before.capRemainingTokens) === null) {
      // This report used up what the control plane said was left of a cap: tell it now, not at the
      // end of the renew interval (the meter refuses further requests already).
      this.log("info", "usage report reached the cap; renewing now", "cap_used_up", { reason: usedUp });
      this.wakePending = true;
      this.wake?.abort();
    }
  }

  // --- approvals ---------------------------------------------------------------------------------

  /** Wakes a waiting requestApproval. */
  private notify(): void {
    this.signalled.abort();
    this.signalled = new AbortController();
  }

  /**
   * Asks a person to approve a step (a WorkerRunApproval with gate `name`) and resolves when the
   * control plane says Approve, Deny or TimedOut (after `timeoutSeconds`, counted by the operator
   * from when it saw the request; null: no timeout). The request rides on this attempt's renewals,
   * which only its holder can write; the decision comes back on them, and only for this attempt.
   * While waiting it renews every `pollMs` so the decision arrives promptly. Asking again for a
   * decided name resolves with that decision.
   *
   * Throws RangeError for a request the control plane would refuse (before sending anything): a
   * malformed one, a 21st, or one that would make the attempt's requests exceed 64 KiB.
   * Rejects with LeaseLost, OwnershipUnknown or StopRequested when the attempt cannot act on any
   * decision: ownership lost or unknown, told to stop, or the run closed meanwhile.
   */
  async requestApproval(name: string, details = "", timeoutSeconds: number | null = null,
    options: ApprovalOptions = {}): Promise<ApprovalDecision> {
    const why = requestRefusal(name, details, timeoutSeconds);
    if (why !== null) throw new RangeError(`approval request refused: ${why}`);
    if (!this.requests.has(name)) {
      if (this.requests.size >= MAX_REQUESTS_PER_ATTEMPT) {
        throw new RangeError(`approval request refused: an attempt may make at most ${MAX_REQUESTS_PER_ATTEMPT} requests`);
      }
      const asked = [...this.requests.values(), { name, details, timeoutSeconds }];
      if (Buffer.byteLength(requestsAnnotation(asked)) > MAX_REQUESTS_BYTES) {
        throw new RangeError(`approval request refused: this attempt's requests would exceed ${MAX_REQUESTS_BYTES} bytes`);
      }
      this.requests.set(name, { name, details, timeoutSeconds });
    }
    const pollSeconds = (options.pollMs ?? 2000) / 1000;
    this.log("info", "approval requested", "approval_requested", { request: name });
    await this.renewLogged();
    for (;;) {
      const decided = this.rawSignals.decisions[name];
      if (decided !== undefined) {
        this.log("info", "approval decided", "approval_decided", { request: name, decision: decided.decision });
        return { ...decided, approved: decided.decision === "Approve" };
      }
      // A closed run renews no more: no decision could arrive.
      if (this.closed) throw new StopRequested("the run was closed while waiting for an approval");
      this.ensureOwner(); // lost, unknown or told to stop: no decision can be acted on
      const woken = this.signalled.signal;
      await this.clock.sleep(pollSeconds, { signal: woken });
      if (!woken.aborted) await this.renewLogged();
    }
  }

  // --- child runs (docs/children.md) -------------------------------------------------------------

  /** The transport's child-run calls; an answer that says the run is not this attempt's any more
   * marks it lost, as a refused renewal does. */
  private childRuns(): Spawning {
    const transport = this.transport;
    if (!canSpawn(transport)) throw new TetherWorkerError("this run's transport cannot spawn child runs");
    const lost = <T>(call: Promise<T>): Promise<T> => call.catch((err: unknown) => {
      if (err instanceof LeaseLost) this.markLost(err.message);
      throw err;
    });
    return {
      parent: () => lost(transport.parent()),
      spawn: (key, generation, spec) => lost(transport.spawn(key, generation, spec)),
      child: (name) => lost(transport.child(name)),
    };
  }

  /**
   * Spawns one tool call as a child run of this one: a WorkerRun of class `className` with `payload`,
   * its share of this run's caps (`capCents`, `maxTokens`: required when this run has such a cap) and
   * any other spec fields in `spec`. `key` names the call stably (1 to 128 letters, digits and
   * `. _ : / -`): spawning it again, from this attempt or a later one that resumed from a checkpoint,
   * finds the same child instead of creating another. `child.result()` waits for it.
   *
   * Throws RangeError for a malformed key or a missing share (before creating anything),
   * SpawnConflict when the key was spawned with another spec (or its name is taken by a run that is
   * not this one's child), SpawnRefused when the API server refuses the child, and LeaseLost,
   * OwnershipUnknown or StopRequested when this attempt may not act.
   */
  async spawn(key: string, options: SpawnOptions = {}): Promise<Child> {
    const runs = this.childRuns();
    this.ensureOwner(); // a stale or stopping attempt spawns nothing
    const parent = await runs.parent();
    const spec = childSpec(parent, options);
    // Through the gateway the run is not read: its children name it by its name and the claim's UID.
    const owner = parent ?? { name: this.name, uid: this.runUid ?? "" };
    const body = await spawnRun(runs, owner, this.holder, this.fence, key, spec, this.clock);
    const child = new Child(key, String(body.metadata?.name), body, (c, o) => this.childResult(runs, c, o));
    this.log("info", "child spawned", "child_spawned", { child: child.name, key });
    return child;
  }

  /** `spawn`, then the child's result (ChildFailed if it ends without one). */
  async call(key: string, options: CallOptions = {}): Promise<JsonObject> {
    const { timeoutSeconds, pollSeconds, ...spawn } = options;
    const child = await this.spawn(key, spawn);
    return child.result({ timeoutSeconds, pollSeconds });
  }

  private async childResult(runs: ChildRuns, child: Child, options: ChildResultOptions): Promise<JsonObject> {
    await waitEnded(runs, child, options, this.clock);
    this.ensureOwner(); // a child's result reaches the parent only through the attempt that holds it
    return outcome(child);
  }

  // --- results -----------------------------------------------------------------------------------

  /**
   * Publishes the result with one fenced write. Throws LeaseLost if the run moved on, ResultInvalid
   * if the value itself was refused (still the owner: publish a corrected one), OwnershipUnknown if
   * no answer came before the lease deadline.
   */
  async complete(result: JsonObject | Record<string, unknown>): Promise<void> {
    await this.publish("result", result);
  }

  /** Publishes a failure with one fenced write; the run's retry rules decide what follows. */
  async fail(code: string, message = ""): Promise<void> {
    await this.publish("error", { code, message });
  }

  private publish(field: PublishField, value: unknown): Promise<void> {
    return inSpan("tether.publish", parentFor(this.traceContext),
      { ...this.spanAttributes(), "tether.publication": field }, SpanKind.CLIENT, () => this.publishOnce(field, value));
  }

  private async publishOnce(field: PublishField, value: unknown): Promise<void> {
    const rejected = (): LeaseLost => {
      this.log("error", `${field} rejected: lease lost`, "result_rejected", { field });
      return new LeaseLost(`the ${field} was not published: fence ${this.fence} is no longer current`);
    };
    // The usage and the last checkpoint go out with a final renewal, so nothing is left behind; a
    // confirmed one also moves the deadline below.
    await this.renewLogged();
    let delay = 0.5;
    // A try with no answer, or a 5xx (which does not say whether the write was applied), may have
    // landed; a 4xx was refused before any write.
    let unanswered = false;
    for (;;) {
      // Lost (the final renewal, or the heartbeat meanwhile): publish nothing more, unless an
      // earlier try may have landed; then the retry and the look-up below tell.
      if (this.isLost && !unanswered) throw rejected();
      let accepted: boolean;
      try {
        accepted = await this.transport.publish(field, value);
        if (!accepted && unanswered) accepted = await this.transport.recorded(field, value);
      } catch (err) {
        if (err instanceof ResultInvalid) {
          this.log("error", `${field} refused as invalid`, "result_invalid", { field, causes: err.causes });
          throw err;
        }
        if (!(err instanceof Unanswered)) throw err;
        if (err.status === null || err.status >= 500) unanswered = true;
        const wait = Math.max(delay, err.retryAfterSeconds); // a server that says when to come back is believed
        // Read after the try, which may have taken TP: the heartbeat went on confirming meanwhile.
        const deadline = this.confirmedAt + this.leaseDurationSeconds;
        if (this.clock.now() + wait > deadline) {
          throw new OwnershipUnknown(`could not publish the ${field} before the lease deadline: ${err.message}`);
        }
        this.log("warn", `${field} not published yet, retrying`, "publish_retry", { error: err.message, waitSeconds: wait });
        await this.clock.sleep(wait);
        delay = nextDelay(delay);
        continue;
      }
      if (accepted) {
        this.isFinished = true;
        this.wake?.abort();
        this.log("info", `${field} published`, "result_published", { field });
        return;
      }
      this.markLost("the run's fence or holder moved on");
      throw rejected();
    }
  }

  // --- side effects ------------------------------------------------------------------------------

  /** Headers for a side effect: the key is stable across attempts, the fence names this attempt. */
  effectHeaders(operation: string): Record<string, string> {
    return { "Idempotency-Key": `${this.idempotencyKey}:${operation}`, "X-Execution-Fence": String(this.fence) };
  }

  /**
   * Sends one side effect with fetch, only while ownership is confirmed (ensureOwner first), carrying
   * the effect headers. Throws ToolTimeout when no answer comes within timeoutMs.
   */
  async effect(url: string | URL, options: EffectOptions): Promise<Response> {
    this.ensureOwner();
    const { operation, method = "POST" } = options;
    return inSpan("tether.effect", parentFor(this.traceContext),
      { ...this.spanAttributes(), "tether.operation": operation, "http.request.method": method, "url.full": redactUrl(url) },
      SpanKind.CLIENT, async (span) => {
        const headers = new Headers(options.headers);
        injectTraceHeaders(span, headers); // the receiver may join the trace; it must trust the fence, not this
        const answer = await this.send(url, options, headers);
        span.setAttribute("http.response.status_code", answer.status);
        return answer;
      });
  }

  private async send(url: string | URL, options: EffectOptions, headers: Headers): Promise<Response> {
    const { operation, method = "POST", body, timeoutMs = 30_000 } = options;
    let payload: string | Uint8Array | undefined;
    if (typeof body === "string" || body instanceof Uint8Array) {
      payload = body;
    } else if (body !== undefined) {
      payload = JSON.stringify(body);
      if (!headers.has("content-type")) headers.set("content-type", "application/json");
    }
    for (const [key, value] of Object.entries(this.effectHeaders(operation))) headers.set(key, value);
    try {
      return await fetch(url, { method, headers, body: payload ?? null, signal: AbortSignal.timeout(timeoutMs) });
    } catch (err) {
      if ((err as Error)?.name === "TimeoutError") {
        throw new ToolTimeout(`${method} ${String(url)} did not answer within ${timeoutMs} ms`, { cause: err });
      }
      throw err;
    }
  }

  // --- the end -----------------------------------------------------------------------------------

  /** Stops the heartbeat (it does not publish anything). Safe to call more than once. A worker that
   * leaves without publishing (stopped, gave up) still reports what it spent and how far it got:
   * one last renewal carries its usage and checkpoint, or the run would be charged less than it used. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    running.delete(this);
    this.stopping = true;
    this.wake?.abort();
    this.notify();
    await this.loop;
    if (!this.isLost && !this.isFinished) await this.renewLogged();
    await this.transport.close();
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}
