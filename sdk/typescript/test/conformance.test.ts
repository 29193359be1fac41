import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import fs from "node:fs";
import http from "node:http";
import type { AddressInfo } from "node:net";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { afterEach, describe, it } from "node:test";

import { childBody, type Parent } from "../src/children.js";
import type { JsonObject } from "../src/protocol.js";
import { serve, type FakeServer, type Reply, type Seen } from "./fakes.js";

const WORKER = fileURLToPath(new URL("../src/conformance-worker.js", import.meta.url));
const PREFIX = "/api/v1/namespaces/ns/workerruns/job/";

const servers: FakeServer[] = [];
let dir: string | null = null;

afterEach(async () => {
  for (const s of servers.splice(0)) await s.close();
  if (dir !== null) fs.rmSync(dir, { recursive: true, force: true });
  dir = null;
});

async function server(handler: (req: Seen) => Reply): Promise<FakeServer> {
  const s = await serve(handler);
  servers.push(s);
  return s;
}

interface Lease {
  leaseDurationSeconds: number;
  renewIntervalSeconds: number;
  /** Filled with the time (ms) each heartbeat arrived. */
  beatAt: number[];
}

/** The gateway's reply to a renewal of attempt 1 (docs/protocol.md §6.4). */
const RENEWED = { holder: "job-a1", fence: 1, runUid: "uid-1", leaseExpiresAt: "2026-11-30T12:00:10Z", stop: false,
  paused: false, status: "Running" };

/** A gateway that hands out attempt 1 with `payload`; heartbeats answer `heartbeats` in order, then 200.
 * By default L = 10 s and R = 1 h: the heartbeat never renews on its own during a test. */
async function gateway(payload: Record<string, unknown>, heartbeats: Reply[] = [],
  lease: Lease = { leaseDurationSeconds: 10, renewIntervalSeconds: 3600, beatAt: [] }): Promise<FakeServer> {
  return server((req) => {
    const op = req.url.slice(PREFIX.length);
    if (op === "claim") {
      return { status: 200, body: { ...RENEWED, attempt: 1,
        leaseDurationSeconds: lease.leaseDurationSeconds, renewIntervalSeconds: lease.renewIntervalSeconds, payload,
        checkpoint: null, idempotencyKey: "key" } };
    }
    if (op === "heartbeat") {
      lease.beatAt.push(performance.now());
      return heartbeats.shift() ?? { status: 200, body: RENEWED };
    }
    return { status: 200, body: { status: "Succeeded", fence: 2 } };
  });
}

/** Run job as its children name it (the gateway's view). */
const JOB: Parent = { name: "job", uid: "uid-1", className: "planners", depth: 0, budgetRef: null, cappedCents: false,
  cappedTokens: false };

/** A gateway that hands out attempt 1 with `payload` and spawns as the gateway does: the first spawn of
 * a key makes its child, later ones answer with that child (whatever they ask for); the child reads
 * with `status`. `spawnReply` answers every spawn instead, when given. */
async function spawningGateway(payload: Record<string, unknown>, status: JsonObject, spawnReply?: Reply): Promise<FakeServer> {
  const made = new Map<string, JsonObject>();
  return server((req) => {
    const op = req.url.slice(PREFIX.length);
    const body = JSON.parse(req.body || "{}") as { key: string; generation: number; spec: JsonObject; name: string };
    if (op === "claim") {
      return { status: 200, body: { ...RENEWED, attempt: 1, leaseDurationSeconds: 10, renewIntervalSeconds: 3600, payload,
        checkpoint: null, idempotencyKey: "key" } };
    }
    if (op === "heartbeat") return { status: 200, body: RENEWED };
    if (op === "spawn" && spawnReply !== undefined) return spawnReply;
    if (op === "spawn") {
      const child = made.get(body.key) ?? childBody(JOB, "ns", "job-a1", 1, body.key, body.generation, body.spec);
      made.set(body.key, child);
      return { status: 200, body: { child } };
    }
    if (op === "child") {
      const child = [...made.values()].find((c) => (c.metadata as JsonObject).name === body.name);
      return { status: 200, body: { child: { ...child, status } } };
    }
    return { status: 200, body: { status: "Succeeded", fence: 2 } };
  });
}

/** Runs the conformance worker as the kit does for an External run; resolves its exit code. */
async function runWorker(gatewayUrl: string): Promise<number | null> {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), "tether-conformance-"));
  const tokenFile = path.join(dir, "token");
  fs.writeFileSync(tokenFile, "tok\n");
  const child = spawn(process.execPath, [WORKER], {
    env: { ...process.env, TETHER_GATEWAY_URL: gatewayUrl, TETHER_GATEWAY_TOKEN_FILE: tokenFile,
      TETHER_NAMESPACE: "ns", TETHER_RUN: "job" },
    stdio: ["ignore", "ignore", "ignore"],
  });
  return new Promise((resolve) => child.on("exit", (code) => resolve(code)));
}

const ops = (s: FakeServer, op: string): Seen[] => s.seen.filter((r) => r.url === PREFIX + op);

describe("conformance worker", () => {
  it("a receiver's 409 InProgress: the same step again, from the gate", async () => {
    const answers: Reply[] = [{ status: 409, body: { error: "InProgress", message: "in progress" },
      headers: { "Retry-After": "0.1" } }];
    const receiver = await server(() => answers.shift() ?? { status: 200, body: { ok: true } });
    const gw = await gateway({ steps: 1, stepSeconds: 0, effectUrl: `${receiver.url}/effect` });
    assert.equal(await runWorker(gw.url), 0);
    assert.deepEqual(receiver.seen.map((r) => r.headers["idempotency-key"]), ["key:step-0", "key:step-0"]);
    assert.equal(ops(gw, "complete").length, 1);
  });

  it("a receiver's 409 StaleFence: exit 1, nothing published, the run closed first", async () => {
    const receiver = await server(() => ({ status: 409, body: { error: "StaleFence", message: "fence 1 < 2", highestFence: 2 } }));
    const gw = await gateway({ steps: 1, stepSeconds: 0, effectUrl: `${receiver.url}/effect` });
    assert.equal(await runWorker(gw.url), 1);
    assert.equal(receiver.seen.length, 1);
    assert.equal(ops(gw, "complete").length, 0);
    assert.equal(ops(gw, "heartbeat").length, 2, "the start's renewal, then the closing one");
  });

  it("a receiver's 5xx: the same step again, with the same key", async () => {
    const answers: Reply[] = [{ status: 503, body: { error: "Unavailable" } }];
    const receiver = await server(() => answers.shift() ?? { status: 200, body: { ok: true } });
    const gw = await gateway({ steps: 1, stepSeconds: 0, effectUrl: `${receiver.url}/effect` });
    assert.equal(await runWorker(gw.url), 0);
    assert.deepEqual(receiver.seen.map((r) => r.headers["idempotency-key"]), ["key:step-0", "key:step-0"]);
  });

  it("a side effect without an answer (connection dropped): the same step again, with the same key", async () => {
    const keys: (string | string[] | undefined)[] = [];
    const receiver = http.createServer((req, res) => {
      keys.push(req.headers["idempotency-key"]);
      if (keys.length === 1) req.socket.destroy();
      else res.writeHead(200, { "Content-Type": "application/json" }).end("{}");
    });
    await new Promise<void>((resolve) => receiver.listen(0, "127.0.0.1", resolve));
    try {
      const url = `http://127.0.0.1:${(receiver.address() as AddressInfo).port}/effect`;
      const gw = await gateway({ steps: 1, stepSeconds: 0, effectUrl: url });
      assert.equal(await runWorker(gw.url), 0);
      assert.deepEqual(keys, ["key:step-0", "key:step-0"]);
    } finally {
      receiver.closeAllConnections();
      await new Promise((resolve) => receiver.close(resolve));
    }
  });

  const unexpected: [string, Reply][] = [
    ["400", { status: 400, body: { error: "BadRequest" } }],
    ["409 without a known error", { status: 409, body: { error: "Duplicate" } }],
  ];
  for (const [what, reply] of unexpected) {
    it(`a receiver's ${what}: exit 70, the run closed first`, async () => {
      const receiver = await server(() => reply);
      const gw = await gateway({ steps: 1, stepSeconds: 0, effectUrl: `${receiver.url}/effect` });
      assert.equal(await runWorker(gw.url), 70);
      assert.equal(ops(gw, "complete").length + ops(gw, "fail").length, 0);
      assert.equal(ops(gw, "heartbeat").length, 2, "the start's renewal, then the closing one");
    });
  }

  it("badResultFirst is not tried in an attempt that fails on purpose", async () => {
    const gw = await gateway({ steps: 1, stepSeconds: 0, failAttempts: [1], badResultFirst: true });
    assert.equal(await runWorker(gw.url), 0);
    assert.equal(ops(gw, "complete").length, 0);
    assert.equal(ops(gw, "fail").length, 1);
  });

  it("a crash renews until a renewal carrying the checkpoint is confirmed, then exits 3", async () => {
    const busy: Reply = { status: 503, body: { error: { code: "Busy", message: "" } } };
    const gw = await gateway({ steps: 3, stepSeconds: 0, crashAttempts: [1], crashAfterStep: 1 }, [
      { status: 200, body: RENEWED }, busy, busy],
    { leaseDurationSeconds: 10, renewIntervalSeconds: 0.2, beatAt: [] });
    assert.equal(await runWorker(gw.url), 3);
    const beats = ops(gw, "heartbeat").map((r) => JSON.parse(r.body) as { checkpoint?: string });
    // The start, the two busy answers, then confirmed ones (the heartbeat renews too, and may be
    // confirmed before the flush's own renewal).
    assert.deepEqual(beats.slice(0, 4).map((b) => b.checkpoint), [undefined, "1", "1", "1"]);
    assert.ok(beats.slice(1).every((b) => b.checkpoint === "1"), JSON.stringify(beats));
    assert.equal(ops(gw, "complete").length + ops(gw, "fail").length, 0);
  });

  it("a crash's renewals come at most once per R, and the crash closes nothing", async () => {
    const busy: Reply = { status: 503, body: { error: { code: "Busy", message: "" } } };
    const lease: Lease = { leaseDurationSeconds: 10, renewIntervalSeconds: 0.4, beatAt: [] };
    const gw = await gateway({ steps: 3, stepSeconds: 0, crashAttempts: [1], crashAfterStep: 1 },
      [{ status: 200, body: RENEWED }, busy, busy, busy, busy], lease);
    assert.equal(await runWorker(gw.url), 3);
    // Two sources renew, the heartbeat and the crash's flush, each at most once per R: of any three
    // renewals in a row, two come from one source, so they span at least R.
    for (let i = 2; i < lease.beatAt.length; i++) {
      const span = (lease.beatAt[i] as number) - (lease.beatAt[i - 2] as number);
      assert.ok(span >= 0.9 * 400, `renewals ${i - 2}..${i} within ${span.toFixed(0)} ms: ${lease.beatAt.join(", ")}`);
    }
    const last = ops(gw, "heartbeat").at(-1);
    assert.equal((JSON.parse(last?.body ?? "{}") as { checkpoint?: string }).checkpoint, "1");
    assert.equal(ops(gw, "heartbeat").length, 6, "the start, four busy answers, the confirmed one; none after");
  });

  it("a crash stops renewing once the run is lost", async () => {
    const gw = await gateway({ steps: 3, stepSeconds: 0, crashAttempts: [1], crashAfterStep: 1 }, [
      { status: 200, body: RENEWED }, { status: 410, body: { error: { code: "StaleFence", message: "" } } }]);
    assert.equal(await runWorker(gw.url), 3);
    assert.equal(ops(gw, "heartbeat").length, 2);
  });

  const SPAWN = { key: "search:1", className: "tools", payload: { q: "tether" }, spec: { executor: "External" } };

  it("spawn: the child first, its result, then the conflicting spawn refused: all in the result", async () => {
    const gw = await spawningGateway({ steps: 1, stepSeconds: 0, spawn: SPAWN },
      { phase: "Succeeded", attempt: 1, result: { hits: 2 } });
    assert.equal(await runWorker(gw.url), 0);
    const spawns = ops(gw, "spawn").map((r) => JSON.parse(r.body) as { key: string; spec: JsonObject });
    assert.deepEqual(spawns.map((b) => [b.key, b.spec.payload]), [["search:1", { q: "tether" }], ["search:1", { conflict: true }]]);
    assert.deepEqual(spawns[0]?.spec, { executor: "External", className: "tools", payload: { q: "tether" } });
    const name = (JSON.parse(ops(gw, "child")[0]?.body ?? "{}") as { name: string }).name;
    const published = JSON.parse(ops(gw, "complete")[0]?.body ?? "{}") as { result: JsonObject };
    assert.deepEqual(published.result, { steps: 1, attempt: 1, sdk: "typescript", child: { name, result: { hits: 2 } },
      conflictRefused: true });
  });

  it("spawn: a child that ends without a result publishes ConformanceChildFailed", async () => {
    const gw = await spawningGateway({ steps: 1, stepSeconds: 0, spawn: SPAWN }, { phase: "Failed", attempt: 3,
      conditions: [{ type: "Ready", status: "False", reason: "RetriesExhausted" }] });
    assert.equal(await runWorker(gw.url), 0);
    assert.equal(ops(gw, "complete").length, 0);
    const error = (JSON.parse(ops(gw, "fail")[0]?.body ?? "{}") as { error: { code: string; message: string } }).error;
    assert.equal(error.code, "ConformanceChildFailed");
    assert.match(error.message, /ended Failed \(RetriesExhausted\)/);
  });

  it("spawn: a refused child publishes ConformanceSpawnRefused with the refusal", async () => {
    const gw = await spawningGateway({ steps: 1, stepSeconds: 0, spawn: SPAWN }, {},
      { status: 422, body: { error: { code: "SpawnRefused", message: "class tools may not be spawned" } } });
    assert.equal(await runWorker(gw.url), 0);
    const error = (JSON.parse(ops(gw, "fail")[0]?.body ?? "{}") as { error: { code: string; message: string } }).error;
    assert.equal(error.code, "ConformanceSpawnRefused");
    assert.match(error.message, /class tools may not be spawned/);
  });

  it("spawn: crashAfterStep 0 crashes right after spawning, before waiting, renewing or publishing", async () => {
    const gw = await spawningGateway({ steps: 1, stepSeconds: 0, spawn: SPAWN, crashAttempts: [1], crashAfterStep: 0 }, {});
    assert.equal(await runWorker(gw.url), 3);
    assert.equal(ops(gw, "spawn").length, 1);
    assert.equal(ops(gw, "child").length + ops(gw, "complete").length + ops(gw, "fail").length, 0);
    assert.equal(ops(gw, "heartbeat").length, 1, "the start's renewal only");
  });
});
