#!/usr/bin/env node
/**
 * The conformance worker (conformance/WORKER.md): one small program written with this SDK's public
 * API only. The kit runs it as a pod's command or, with TETHER_GATEWAY_URL, as an external worker,
 * and judges it from the API server's objects and what its side-effect receiver received.
 *
 * Exit codes: 0 published (or stopped / cannot afford a step, publishing nothing), 1 lost ownership
 * or a stale fence at the receiver, 2 ownership unknown until the lease deadline, 3 a planned crash,
 * 4 claim refused (or any failure to start), 5 an invalid result was accepted, 70 the program itself
 * failed (an unexpected error, or a receiver answer it has no rule for). Every exit but 3 closes the
 * run first, so its last renewal reports the usage and checkpoint.
 */

import fs from "node:fs";

import {
  ChildFailed,
  ClaimRefused,
  LeaseLost,
  OwnershipUnknown,
  ResultInvalid,
  SpawnConflict,
  SpawnRefused,
  StopRequested,
  ToolTimeout,
  Unanswered,
  WorkerRun,
  jsonLogger,
  protocol,
  type JsonObject,
  type SpawnOptions,
} from "./index.js";

const log = jsonLogger("info");

const EXIT_CRASH = 3;
const EXIT_BROKEN = 70;

/** The child to spawn: its key and what it asks for. */
interface SpawnScript {
  key: string;
  options: SpawnOptions;
}

interface Script {
  steps: number;
  stepSeconds: number;
  effectUrl: string | null;
  centsPerStep: number;
  tokensPerStep: number;
  crashAttempts: number[];
  crashAfterStep: number;
  failAttempts: number[];
  badResultFirst: boolean;
  oversizeResultFirst: number;
  approval: { name: string; details: string; timeoutSeconds: number | null } | null;
  spawn: SpawnScript | null;
}

function readScript(payload: JsonObject): Script {
  const num = (key: string, fallback: number): number => {
    const v = payload[key];
    return typeof v === "number" ? v : fallback;
  };
  const ints = (key: string): number[] => {
    const v = payload[key];
    return Array.isArray(v) ? v.filter((x): x is number => typeof x === "number") : [];
  };
  return {
    steps: num("steps", 3),
    stepSeconds: num("stepSeconds", 0.5),
    effectUrl: typeof payload.effectUrl === "string" && payload.effectUrl ? payload.effectUrl : null,
    centsPerStep: num("centsPerStep", 0),
    tokensPerStep: num("tokensPerStep", 0),
    crashAttempts: ints("crashAttempts"),
    crashAfterStep: num("crashAfterStep", 1),
    failAttempts: ints("failAttempts"),
    badResultFirst: payload.badResultFirst === true,
    oversizeResultFirst: num("oversizeResultFirst", 0),
    approval: readApproval(payload.approval),
    spawn: readSpawn(payload.spawn),
  };
}

function readApproval(v: unknown): Script["approval"] {
  if (typeof v !== "object" || v === null || Array.isArray(v)) return null;
  const { name, details, timeoutSeconds } = v as Record<string, unknown>;
  return {
    name: String(name),
    details: typeof details === "string" ? details : "",
    timeoutSeconds: typeof timeoutSeconds === "number" ? timeoutSeconds : null,
  };
}

function readSpawn(v: unknown): SpawnScript | null {
  if (!protocol.isObject(v)) return null;
  const { key, className, payload, capCents, maxTokens, spec } = v;
  const options: SpawnOptions = {};
  if (typeof className === "string") options.className = className;
  if (protocol.isObject(payload)) options.payload = payload as JsonObject;
  if (typeof capCents === "number") options.capCents = capCents;
  if (typeof maxTokens === "number") options.maxTokens = maxTokens;
  if (protocol.isObject(spec)) options.spec = spec as JsonObject;
  return { key: String(key), options };
}

const sleep = (seconds: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, seconds * 1000));

function say(message: string, fields: Record<string, unknown> = {}): void {
  log("info", message, { event: "conformance", ...fields });
}

/** Pod mode reads the environment; external mode claims through the gateway. */
async function startAttempt(): Promise<WorkerRun> {
  const gateway = process.env.TETHER_GATEWAY_URL;
  if (!gateway) return WorkerRun.fromEnv({ logger: log });
  const tokenFile = process.env.TETHER_GATEWAY_TOKEN_FILE;
  if (!tokenFile) throw new Error("TETHER_GATEWAY_TOKEN_FILE is not set");
  const token = fs.readFileSync(tokenFile, "utf8").trim();
  return WorkerRun.claim(gateway, process.env.TETHER_NAMESPACE ?? "", process.env.TETHER_RUN ?? "", token,
    { workerId: process.env.TETHER_WORKER_ID || null, logger: log });
}

type Gate = "go" | "stop" | "lost";

/** Waits until the step may start: not stopped, affordable, owned and not paused. */
async function gate(run: WorkerRun, script: Script): Promise<Gate> {
  for (;;) {
    const signals = run.signals;
    if (signals.stop) return "stop";
    if ((signals.capRemainingCents !== null && signals.capRemainingCents < script.centsPerStep)
      || (signals.capRemainingTokens !== null && signals.capRemainingTokens < script.tokensPerStep)) {
      return "stop";
    }
    if (run.lost) return "lost";
    if (!signals.paused && !run.ownershipUnknown) return "go";
    await sleep(0.1);
  }
}

type Effect = "done" | "again" | "stale";

/** The receiver's 409 body `{"error": "InProgress" | "StaleFence"}`: its `error`, or null. */
function receiverError(text: string): string | null {
  try {
    const doc: unknown = JSON.parse(text);
    if (typeof doc === "object" && doc !== null && "error" in doc && typeof doc.error === "string") return doc.error;
  } catch {
    // not JSON: not a receiver's answer
  }
  return null;
}

/** The step's fenced side effect. "again": do the step over, from the gate (same key). Throws on an
 * answer WORKER.md has no rule for (exit 70). */
async function sideEffect(run: WorkerRun, url: string, step: number): Promise<Effect> {
  let resp: Response;
  let text: string;
  try {
    resp = await run.effect(url, {
      operation: `step-${step}`,
      method: "POST",
      body: { run: run.name, attempt: run.attempt, fence: run.fence, step },
    });
    text = await resp.text(); // a body cut short is no answer either
  } catch (err) {
    if (err instanceof LeaseLost || err instanceof OwnershipUnknown || err instanceof StopRequested) {
      say("side effect refused by the SDK: back to the gate", { step, reason: err.name });
      return "again";
    }
    // No answer (fetch's TypeError: refused, reset, cut short; a body read past the timeout): the
    // same key may be retried.
    if (err instanceof ToolTimeout || err instanceof TypeError || (err as Error)?.name === "TimeoutError") {
      say("side effect got no answer: back to the gate", { step, error: String(err) });
      await sleep(0.5);
      return "again";
    }
    throw err;
  }
  if (resp.ok) return "done";
  const refusal = resp.status === 409 ? receiverError(text) : null;
  if (refusal === "InProgress") {
    // An earlier try of this very key is still running at the receiver: not a stale fence.
    await sleep(Math.max(0.1, Number(resp.headers.get("retry-after")) || 1));
    return "again";
  }
  if (refusal === "StaleFence") {
    say("the receiver refused a stale fence", { step, body: text.slice(0, 200) });
    return "stale";
  }
  if (resp.status >= 500) { // a receiver stores no 5xx: the effect did not happen
    await sleep(0.5);
    return "again";
  }
  throw new Error(`the receiver answered ${resp.status}: ${text.slice(0, 200)}`);
}

/** Renews until a renewal carrying the checkpoint is confirmed or the run is lost, for at most L:
 * the checkpoint must land before the crash. At most one renewal per R, like the heartbeat. */
async function flush(run: WorkerRun): Promise<void> {
  const deadline = performance.now() + run.leaseDurationSeconds * 1000;
  // renew() rejects only on an answer nobody expected: that renewal is unconfirmed, like no answer.
  while (!(await run.renew().catch(() => false)) && !run.lost && performance.now() < deadline) {
    await sleep(run.renewIntervalSeconds);
  }
}

/** What the script's child gives the result: its name and result, and whether the SDK refused the
 * conflicting spawn. */
interface Spawned {
  child: JsonObject;
  conflictRefused: boolean;
}

/** The child's end without a result, as the error to publish: its code and message. */
type SpawnFailure = { failure: [code: string, message: string] };

/** Spawns `key` again for another payload: true when the SDK refuses it as a conflict. */
async function conflictRefused(run: WorkerRun, key: string, options: SpawnOptions): Promise<boolean> {
  try {
    await run.spawn(key, { ...options, payload: { conflict: true } });
    return false;
  } catch (err) {
    if (err instanceof SpawnConflict) return true;
    throw err;
  }
}

/**
 * With `spawn`, before the first step: spawns the child (a resumed attempt finds the one spawned
 * before), crashes right after when the script says so, waits for the child's result, then spawns
 * the same key for another payload. A number: exit with it. Spawning again is safe (one key is one
 * child), so no answer, or ownership unknown, spawns again once the gate lets it.
 */
async function spawnChild(run: WorkerRun, script: Script, ask: SpawnScript): Promise<Spawned | SpawnFailure | number> {
  for (;;) {
    try {
      const child = await run.spawn(ask.key, ask.options);
      if (script.crashAttempts.includes(run.attempt) && script.crashAfterStep === 0) {
        say("crashing right after spawning, as the script says", { child: child.name });
        return EXIT_CRASH;
      }
      const result = await child.result({ pollSeconds: 1 });
      return { child: { name: child.name, result }, conflictRefused: await conflictRefused(run, ask.key, ask.options) };
    } catch (err) {
      if (err instanceof ChildFailed) return { failure: ["ConformanceChildFailed", err.message] }; // its phase and reason
      if (err instanceof SpawnRefused) return { failure: ["ConformanceSpawnRefused", err.message] };
      if (err instanceof Unanswered) {
        say("spawning got no answer: again", { error: err.message });
        await sleep(Math.max(0.5, err.retryAfterSeconds));
        continue;
      }
      if (!(err instanceof LeaseLost || err instanceof OwnershipUnknown || err instanceof StopRequested)) throw err;
      const verdict = await gate(run, script);
      if (verdict !== "go") return verdict === "stop" ? 0 : 1;
    }
  }
}

/** A publication that threw, as the exit code: 1 lost ownership, 2 ownership unknown until the lease
 * deadline; anything else is rethrown. */
function publicationExit(err: unknown): number {
  if (err instanceof LeaseLost) {
    say("lost ownership: nothing published", { error: err.message });
    return 1;
  }
  if (err instanceof OwnershipUnknown) {
    say("ownership unknown until the lease deadline", { error: err.message });
    return 2;
  }
  throw err;
}

async function publishFailure(run: WorkerRun, [code, message]: SpawnFailure["failure"]): Promise<number> {
  try {
    await run.fail(code, message.slice(0, 500));
    say("published", { code });
    return 0;
  } catch (err) {
    return publicationExit(err);
  }
}

async function publish(run: WorkerRun, script: Script, spawned: Spawned | null): Promise<number> {
  try {
    if (script.failAttempts.includes(run.attempt)) {
      await run.fail("ConformanceFailure", `attempt ${run.attempt} fails as the script says`);
    } else {
      const result: JsonObject = { steps: script.steps, attempt: run.attempt, sdk: "typescript", ...spawned };
      if (script.approval !== null) {
        const { name, details, timeoutSeconds } = script.approval;
        try {
          const d = await run.requestApproval(name, details, timeoutSeconds);
          result.approval = { decision: d.decision, reason: d.reason, approver: d.approver };
        } catch (err) {
          if (!(err instanceof StopRequested)) throw err;
          say("stopped while waiting for an approval: nothing published", { error: err.message });
          return 0;
        }
      }
      if (script.badResultFirst) {
        try {
          // Deliberately not an object: the CRD refuses it, and that says nothing about ownership.
          await run.complete([1] as unknown as JsonObject);
          say("the invalid result was accepted");
          return 5;
        } catch (err) {
          if (!(err instanceof ResultInvalid)) throw err;
          say("the invalid result was refused as invalid", { causes: err.causes });
        }
      }
      if (script.oversizeResultFirst > 0) {
        try {
          // Larger than the API server or the gateway accepts: a bad result, still ours.
          await run.complete({ pad: "x".repeat(script.oversizeResultFirst) });
          say("the oversize result was accepted");
          return 5;
        } catch (err) {
          if (!(err instanceof ResultInvalid)) throw err;
          say("the oversize result was refused as too large", { error: err.message });
        }
      }
      try {
        await run.complete(result);
      } catch (err) {
        // WORKER.md: a real result refused as a bad one is followed by a failure, so a refusal
        // mistaken for a bad result shows as a second publication.
        if (!(err instanceof ResultInvalid)) throw err;
        await run.fail("ConformanceBadResult", err.message.slice(0, 500));
      }
    }
    say("published");
    return 0;
  } catch (err) {
    return publicationExit(err);
  }
}

/** The started attempt: its steps, then its publication; resolves the exit code. Never closes the run. */
async function attempt(run: WorkerRun): Promise<number> {
  const script = readScript(run.payload);
  let step = Number.parseInt(run.checkpointCursor ?? "0", 10) || 0;
  let done = 0;
  say("attempt started", { attempt: run.attempt, fence: run.fence, from: step });
  let spawned: Spawned | null = null;
  if (script.spawn !== null) {
    const outcome = await spawnChild(run, script, script.spawn);
    if (typeof outcome === "number") return outcome;
    if ("failure" in outcome) return publishFailure(run, outcome.failure);
    spawned = outcome;
  }
  while (step < script.steps) {
    const verdict = await gate(run, script);
    if (verdict === "stop") {
      say("stopping without publishing", { step, signals: run.signals });
      return 0;
    }
    if (verdict === "lost") return 1;
    await sleep(script.stepSeconds);
    if (script.effectUrl !== null) {
      const effect = await sideEffect(run, script.effectUrl, step);
      if (effect === "stale") return 1;
      if (effect === "again") continue;
    }
    done += 1;
    // Both ride on the next renewal (the crash's flush, below).
    run.reportUsage({ cents: done * script.centsPerStep, tokens: done * script.tokensPerStep });
    await run.checkpoint(String(step + 1));
    if (script.crashAttempts.includes(run.attempt) && step + 1 === script.crashAfterStep) {
      await flush(run);
      say("crashing as the script says", { step });
      return EXIT_CRASH;
    }
    step += 1;
  }
  return publish(run, script, spawned);
}

async function main(): Promise<number> {
  let run: WorkerRun;
  try {
    run = await startAttempt();
  } catch (err) {
    // A refused claim, like any other failure to start, ends the program with its own code.
    say("start failed", err instanceof ClaimRefused ? { status: err.status, code: err.code } : { error: String(err) });
    return 4;
  }
  let code: number;
  try {
    code = await attempt(run);
  } catch (err) {
    log("error", "unexpected error", { event: "conformance_error", error: String((err as Error)?.stack ?? err) });
    code = EXIT_BROKEN;
  }
  // Every exit but the crash closes the run first: its last renewal reports the usage and
  // checkpoint of the steps done since the previous one. The crash leaves as a crash does.
  if (code !== EXIT_CRASH) await run.close();
  return code;
}

// A partitioned node's worker never hears that its pod was deleted: only the protocol may stop it.
process.on("SIGTERM", () => say("SIGTERM ignored"));

main().then(
  (code) => process.exit(code),
  (err: unknown) => {
    log("error", "unexpected error", { event: "conformance_error", error: String((err as Error)?.stack ?? err) });
    process.exit(EXIT_BROKEN);
  },
);
