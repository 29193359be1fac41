import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { afterEach, describe, it } from "node:test";

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

/** A gateway that hands out attempt 1 with `payload`; heartbeats answer `heartbeats` in order, then 200. */
async function gateway(payload: Record<string, unknown>, heartbeats: Reply[] = []): Promise<FakeServer> {
  return server((req) => {
    const op = req.url.slice(PREFIX.length);
    if (op === "claim") {
      return { status: 200, body: { holder: "job-a1", fence: 1, attempt: 1, runUid: "uid-1", leaseDurationSeconds: 10,
        renewIntervalSeconds: 3600, payload, checkpoint: null, idempotencyKey: "key" } };
    }
    if (op === "heartbeat") return heartbeats.shift() ?? { status: 200, body: { stop: false, paused: false } };
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

  it("a receiver's 409 StaleFence: exit 1, nothing published", async () => {
    const receiver = await server(() => ({ status: 409, body: { error: "StaleFence", message: "fence 1 < 2", highestFence: 2 } }));
    const gw = await gateway({ steps: 1, stepSeconds: 0, effectUrl: `${receiver.url}/effect` });
    assert.equal(await runWorker(gw.url), 1);
    assert.equal(receiver.seen.length, 1);
    assert.equal(ops(gw, "complete").length, 0);
  });

  it("a crash renews until a renewal carrying the checkpoint is confirmed, then exits 3", async () => {
    const busy: Reply = { status: 503, body: { error: { code: "Busy", message: "" } } };
    const gw = await gateway({ steps: 3, stepSeconds: 0, crashAttempts: [1], crashAfterStep: 1 }, [
      { status: 200, body: { stop: false, paused: false } }, busy, busy]);
    assert.equal(await runWorker(gw.url), 3);
    const beats = ops(gw, "heartbeat").map((r) => JSON.parse(r.body) as { checkpoint?: string });
    assert.deepEqual(beats.map((b) => b.checkpoint), [undefined, "1", "1", "1"]);
    assert.equal(ops(gw, "complete").length + ops(gw, "fail").length, 0);
  });

  it("a crash stops renewing once the run is lost", async () => {
    const gw = await gateway({ steps: 3, stepSeconds: 0, crashAttempts: [1], crashAfterStep: 1 }, [
      { status: 200, body: { stop: false, paused: false } }, { status: 410, body: { error: { code: "StaleFence", message: "" } } }]);
    assert.equal(await runWorker(gw.url), 3);
    assert.equal(ops(gw, "heartbeat").length, 2);
  });
});
