/** Child runs (docs/children.md): sdk/vectors/children.json, and spawning through both transports. */

import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { afterEach, beforeEach, describe, it } from "node:test";

import {
  ANN_SPAWN_DIGEST, canonicalJson, childBody, childName, childSpec, parentOf, spawnDigest, type Parent, type SpawnOptions,
} from "../src/children.js";
import { ChildFailed, LeaseLost, SpawnConflict, SpawnRefused, TetherWorkerError } from "../src/errors.js";
import { KubeTransport, loadKubeConfig } from "../src/kube.js";
import type { JsonObject, LeaseObject, RunObject } from "../src/protocol.js";
import { WorkerRun } from "../src/run.js";
import { Unanswered } from "../src/transport.js";
import { FakeClock, FakeTransport, serve, type FakeServer, type Reply, type Seen } from "./fakes.js";

interface Ask {
  className: string | null;
  payload: JsonObject | null;
  capCents: number | null;
  maxTokens: number | null;
  spec: JsonObject | null;
}

const VECTORS = JSON.parse(fs.readFileSync(new URL("../../../vectors/children.json", import.meta.url), "utf8")) as {
  names: { parent: string; uid: string; key: string; generation: number; name: string }[];
  digests: { spec: JsonObject; digest: string }[];
  parents: { run: RunObject; parent: Parent }[];
  bodies: { parent: number; ask: Ask; holder: string; fence: number; key: string; generation: number;
    spec?: JsonObject; body?: JsonObject; refused?: string }[];
};

/** A vector's ask (null: not asked) as spawn options. */
function options(ask: Ask): SpawnOptions {
  const out: SpawnOptions = {};
  if (ask.className !== null) out.className = ask.className;
  if (ask.payload !== null) out.payload = ask.payload;
  if (ask.capCents !== null) out.capCents = ask.capCents;
  if (ask.maxTokens !== null) out.maxTokens = ask.maxTokens;
  if (ask.spec !== null) out.spec = ask.spec;
  return out;
}

describe("sdk/vectors/children.json", () => {
  for (const v of VECTORS.names) {
    it(`names: ${v.parent} ${v.key} #${v.generation}`, () => {
      assert.equal(childName(v.parent, v.uid, v.key, v.generation), v.name);
    });
  }

  for (const v of VECTORS.digests) {
    it(`digests: ${v.digest.slice(0, 12)}`, () => {
      assert.equal(spawnDigest(v.spec), v.digest);
    });
  }

  for (const v of VECTORS.parents) {
    it(`parents: ${v.parent.name}`, () => {
      assert.deepEqual(parentOf(v.run), v.parent);
    });
  }

  for (const v of VECTORS.bodies) {
    it(`bodies: ${v.holder} ${v.key} #${v.generation}${v.refused ? " (refused)" : ""}`, () => {
      const parent = VECTORS.parents[v.parent]?.parent as Parent;
      if (v.refused !== undefined) {
        // The same words; the option is named as this SDK names it.
        const words = v.refused.replace(/ \([a-z_]+\)$/, "");
        assert.throws(() => childSpec(parent, options(v.ask)), (err: Error) => err instanceof RangeError
          && err.message.startsWith(words));
        return;
      }
      const spec = childSpec(parent, options(v.ask));
      assert.deepEqual(spec, v.spec);
      assert.deepEqual(childBody(parent, "team-a", v.holder, v.fence, v.key, v.generation, spec), v.body);
    });
  }
});

describe("names and digests", () => {
  it("refuses a malformed key", () => {
    for (const key of ["", "-a", "a-", "a b", "a#1", "a\n", "x".repeat(129)]) {
      assert.throws(() => childName("p", "u", key), RangeError, JSON.stringify(key));
    }
    assert.equal(childName("p", "u", "x".repeat(128)).length, 12);
  });

  it("digests what the Python gateway digests of the JSON it was sent (its float repr, code point order)", () => {
    // Python: json.dumps(json.loads(JSON.stringify(spec)), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    const spec: JsonObject = { executor: "Pod", payload: { a: 1e-7, b: 0.00001, c: 0.5, d: 1e21, e: 123.456, f: 0.0001,
      g: -2.5e-9, h: 12345678901234567890, i: 1.5e300, "\uffff": 1, "\u{1F600}": 2, k: [0.000001], l: "\u2028\u007f\u0001" } };
    assert.equal(canonicalJson(spec), '{"executor":"Pod","payload":{"a":1e-07,"b":1e-05,"c":0.5,"d":1e+21,"e":123.456,'
      + '"f":0.0001,"g":-2.5e-09,"h":12345678901234567000,"i":1.5e+300,"k":[1e-06],"l":"\u2028\u007f\\u0001","\uffff":1,'
      + '"\u{1F600}":2}}');
    assert.equal(spawnDigest(spec), "9877f987b56f9a6da075d89ad4622f306eeba90aeb41d6a6ed48f841f27a430e");
  });
});

const runs: WorkerRun[] = [];

afterEach(async () => {
  for (const run of runs.splice(0)) await run.close();
});

// --- pods -----------------------------------------------------------------------------------------

const RUNS = "/apis/tether.dev/v1alpha1/namespaces/ns/workerruns";
const LEASE = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/job";
const PARENT: Parent = { name: "job", uid: "uid-job", className: "planners", depth: 0, budgetRef: null, cappedCents: true,
  cappedTokens: false };
const ASK: SpawnOptions = { className: "tools", payload: { q: "tether" }, capCents: 20 };
const KEY = "search:1";

/** Just enough of an API server for a spawning pod: its Lease, its run, and the runs it creates. */
class FakeApi {
  rv = 1;
  lease: LeaseObject = {
    metadata: { name: "job", namespace: "ns", resourceVersion: "1",
      ownerReferences: [{ kind: "WorkerRun", uid: "uid-job", controller: true }] },
    spec: { holderIdentity: "job-a2", leaseTransitions: 2 },
  };
  readonly runs = new Map<string, RunObject>([["job", {
    metadata: { name: "job", uid: "uid-job", namespace: "ns" },
    spec: { executor: "Pod", className: "planners", budget: { capCents: 500 } },
    status: { phase: "Running", class: { name: "planners" } },
  }]]);
  /** Answers to give before the normal behaviour, per "METHOD name" (POST: "POST"). */
  readonly forced = new Map<string, Reply[]>();
  /** Called on every read of a run before it is answered (the operator acting meanwhile). */
  onRead: (name: string) => void = () => {};

  handle(req: Seen): Reply {
    const url = req.url.split("?")[0] ?? "";
    if (url === LEASE) return this.renew(req);
    const name = url.startsWith(`${RUNS}/`) ? url.slice(RUNS.length + 1) : "";
    const forced = this.forced.get(req.method === "POST" ? "POST" : `${req.method} ${name}`)?.shift();
    if (forced !== undefined) return forced;
    if (req.method === "POST" && url === RUNS) {
      const body = JSON.parse(req.body) as RunObject & { metadata: { name: string } };
      if (this.runs.has(body.metadata.name)) return { status: 409, body: { kind: "Status", code: 409, reason: "AlreadyExists" } };
      this.runs.set(body.metadata.name, { ...body, metadata: { ...body.metadata, uid: `uid-${body.metadata.name}` } });
      return { status: 201, body: this.runs.get(body.metadata.name) };
    }
    if (req.method === "GET") {
      this.onRead(name);
      const run = this.runs.get(name);
      return run ? { status: 200, body: run } : { status: 404, body: { kind: "Status", code: 404, reason: "NotFound" } };
    }
    return { status: 405, body: {} };
  }

  private renew(req: Seen): Reply {
    if (req.method === "PUT") {
      const body = JSON.parse(req.body) as LeaseObject;
      if (body.metadata?.resourceVersion !== String(this.rv)) return { status: 409, body: { kind: "Status", code: 409 } };
      this.rv += 1;
      this.lease = { ...body, metadata: { ...body.metadata, resourceVersion: String(this.rv) } };
    }
    return { status: 200, body: this.lease };
  }

  /** A child of this run made by attempt `holder`/`fence` (an earlier one), with `status`. */
  made(key: string, generation: number, holder: string, fence: number, status: JsonObject, ask = ASK): string {
    const body = childBody(PARENT, "ns", holder, fence, key, generation, childSpec(PARENT, ask));
    this.runs.set(body.metadata.name, { ...body, status });
    return body.metadata.name;
  }

  end(name: string, status: JsonObject): void {
    const run = this.runs.get(name) as RunObject;
    this.runs.set(name, { ...run, status });
  }
}

describe("spawning from a pod", () => {
  let dir: string;
  let api: FakeApi;
  let server: FakeServer;
  let clock: FakeClock;

  beforeEach(async () => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), "tether-children-"));
    api = new FakeApi();
    server = await serve((req) => api.handle(req));
    fs.writeFileSync(path.join(dir, "kubeconfig"), JSON.stringify({
      apiVersion: "v1", kind: "Config", "current-context": "pod",
      clusters: [{ name: "pod", cluster: { server: server.url, "insecure-skip-tls-verify": true } }],
      users: [{ name: "pod", user: { token: "t" } }],
      contexts: [{ name: "pod", context: { cluster: "pod", user: "pod", namespace: "ns" } }],
    }));
    clock = new FakeClock();
  });

  afterEach(async () => {
    await server.close();
    fs.rmSync(dir, { recursive: true, force: true });
  });

  /** Attempt 2 (holder job-a2, fence 2) of run job, started. */
  async function started(): Promise<WorkerRun> {
    const kc = loadKubeConfig({ env: { KUBECONFIG: path.join(dir, "kubeconfig") } });
    const transport = new KubeTransport("ns", "job", "job-a2", 2, "uid-job", kc, 2, () => {});
    const run = new WorkerRun({ name: "job", namespace: "ns", holder: "job-a2", fence: 2, attempt: 2, runUid: "uid-job",
      leaseDurationSeconds: 30, renewIntervalSeconds: 10, transport, clock, logger: () => {} });
    runs.push(run);
    await run.start();
    return run;
  }

  const posts = (): Seen[] => server.seen.filter((s) => s.method === "POST");
  const reads = (name: string): Seen[] => server.seen.filter((s) => s.method === "GET" && s.url === `${RUNS}/${name}`);

  it("creates the child the vectors describe, reading the parent once", async () => {
    const run = await started();
    const child = await run.spawn(KEY, ASK);
    const name = childName("job", "uid-job", KEY);
    assert.deepEqual([child.key, child.name, child.phase], [KEY, name, null]);
    assert.deepEqual(JSON.parse(posts()[0]?.body ?? "{}"),
      childBody(PARENT, "ns", "job-a2", 2, KEY, 0, childSpec(PARENT, ASK)));
    await run.spawn("search:2", ASK);
    assert.equal(reads("job").length, 1);
  });

  it("spawning the key again finds the same child: one run, the second create answered 409 and read", async () => {
    const run = await started();
    const first = await run.spawn(KEY, ASK);
    const again = await run.spawn(KEY, ASK);
    assert.equal(again.name, first.name);
    assert.equal(api.runs.size, 2, "the parent and one child");
    assert.equal(posts().length, 2);
    assert.equal(reads(first.name).length, 1);
  });

  it("the same key asked for another payload is SpawnConflict", async () => {
    const run = await started();
    await run.spawn(KEY, ASK);
    await assert.rejects(run.spawn(KEY, { ...ASK, payload: { q: "other" } }), SpawnConflict);
    assert.equal(api.runs.size, 2);
  });

  it("a run of that name that is not this parent's child is SpawnConflict", async () => {
    const name = childName("job", "uid-job", KEY);
    api.runs.set(name, { metadata: { name, uid: "uid-x", labels: { "tether.dev/parent": "other" },
      annotations: { [ANN_SPAWN_DIGEST]: spawnDigest(childSpec(PARENT, ASK)) } }, spec: {} });
    const run = await started();
    await assert.rejects(run.spawn(KEY, ASK), (err: Error) => err instanceof SpawnConflict && /not a child of job/.test(err.message));
  });

  it("a child rejected as a stale attempt's, never run, moves the key to its next generation", async () => {
    api.made(KEY, 0, "job-a1", 1, { phase: "Rejected", conditions: [{ type: "Ready", status: "False", reason: "StaleParent" }] });
    const run = await started();
    const child = await run.spawn(KEY, ASK);
    assert.equal(child.name, childName("job", "uid-job", KEY, 1));
    assert.deepEqual(JSON.parse(posts()[1]?.body ?? "{}").metadata.annotations["tether.dev/child-key"], KEY);
  });

  it("a child rejected for another reason is the call's: its result is ChildFailed", async () => {
    const name = api.made(KEY, 0, "job-a1", 1, { phase: "Rejected",
      conditions: [{ type: "Ready", status: "False", reason: "TreeBudgetExhausted", message: "the tree has 3 cents left" }] });
    const run = await started();
    const child = await run.spawn(KEY, ASK);
    assert.equal(child.name, name);
    await assert.rejects(child.result(), (err: Error) => err instanceof ChildFailed && err.phase === "Rejected"
      && err.reason === "TreeBudgetExhausted" && /the tree has 3 cents left/.test(err.message));
  });

  it("an earlier attempt's child not judged yet is waited for (every 0.5 s), then it is the call's", async () => {
    const name = api.made(KEY, 0, "job-a1", 1, {});
    api.onRead = (read) => {
      if (read === name && reads(name).length === 4) api.end(name, { phase: "Running", attempt: 1 });
    };
    const run = await started();
    const child = await run.spawn(KEY, ASK);
    assert.deepEqual([child.name, child.phase], [name, "Running"]);
    assert.equal(reads(name).length, 1 + 3, "the read after the 409, then three while waiting");
    assert.deepEqual(clock.sleeps, [0.5, 0.5, 0.5]);
  });

  it("an earlier attempt's child deleted while waited for is made again, under the same generation", async () => {
    const name = api.made(KEY, 0, "job-a1", 1, {});
    api.onRead = (read) => {
      if (read === name && reads(name).length === 2) api.runs.delete(name);
    };
    const run = await started();
    const child = await run.spawn(KEY, ASK);
    assert.equal(child.name, name);
    assert.equal(((child.body.spec as JsonObject).parentRef as JsonObject).holder, "job-a2", "this attempt's");
    assert.equal(posts().length, 2);
  });

  it("a child deleted after each create's 409, three times, is SpawnRefused", async () => {
    api.forced.set("POST", [409, 409, 409].map((status) => ({ status, body: { kind: "Status", code: status } })));
    const run = await started();
    await assert.rejects(run.spawn(KEY, ASK), (err: Error) => err instanceof SpawnRefused && /kept being deleted/.test(err.message));
    assert.equal(posts().length, 3);
  });

  it("an earlier attempt's child never judged within 60 s is SpawnConflict", async () => {
    api.made(KEY, 0, "job-a1", 1, {});
    const run = await started();
    await assert.rejects(run.spawn(KEY, ASK), (err: Error) => err instanceof SpawnConflict && /not judged within 60 s/.test(err.message));
    assert.equal(clock.sleeps.length, 120);
  });

  it("a refusal of the API server (403) is SpawnRefused with its message", async () => {
    api.forced.set("POST", [{ status: 403, body: { kind: "Status", code: 403, reason: "Forbidden",
      message: "ValidatingAdmissionPolicy 'tether-child-classes' denied request: class tools is not one planners may spawn" } }]);
    const run = await started();
    await assert.rejects(run.spawn(KEY, ASK), (err: Error) => err instanceof SpawnRefused
      && /class tools is not one planners may spawn/.test(err.message));
    assert.equal(run.lost, false);
  });

  it("another answer is Unanswered: the spawn may be tried again", async () => {
    api.forced.set("POST", [{ status: 503, body: { kind: "Status", code: 503 }, headers: { "Retry-After": "2" } }]);
    const run = await started();
    await assert.rejects(run.spawn(KEY, ASK), (err: Error) => err instanceof Unanswered && err.status === 503
      && err.retryAfterSeconds === 2);
    assert.equal((await run.spawn(KEY, ASK)).name, childName("job", "uid-job", KEY));
  });

  it("a capped parent's child must name its share: RangeError, nothing created", async () => {
    const run = await started();
    await assert.rejects(run.spawn(KEY, { className: "tools" }), RangeError);
    await assert.rejects(run.spawn("bad key", ASK), RangeError);
    assert.equal(posts().length, 0);
  });

  it("a run that is gone spawns nothing: LeaseLost", async () => {
    api.runs.delete("job");
    const run = await started();
    await assert.rejects(run.spawn(KEY, ASK), LeaseLost);
    assert.equal(posts().length, 0);
  });

  it("result: a Succeeded child's result", async () => {
    const run = await started();
    const child = await run.spawn(KEY, ASK);
    api.onRead = (read) => {
      if (read === child.name && reads(child.name).length === 2) api.end(child.name, { phase: "Succeeded", result: { hits: 3 } });
    };
    assert.deepEqual(await child.result({ pollSeconds: 1 }), { hits: 3 });
    assert.deepEqual(clock.sleeps, [1]);
    assert.equal(child.phase, "Succeeded");
  });

  it("call: spawn, then the result", async () => {
    api.made(KEY, 0, "job-a2", 2, { phase: "Succeeded", attempt: 1, result: { hits: 1 } });
    const run = await started();
    assert.deepEqual(await run.call(KEY, { ...ASK, timeoutSeconds: 5 }), { hits: 1 });
  });

  it("result: a Failed child is ChildFailed with its phase, reason and error", async () => {
    const run = await started();
    const child = await run.spawn(KEY, ASK);
    api.end(child.name, { phase: "Failed", attempt: 3, error: { code: "Boom", message: "it broke" },
      conditions: [{ type: "Ready", status: "False", reason: "RetriesExhausted", message: "3 attempts failed" }] });
    await assert.rejects(child.result(), (err: Error) => err instanceof ChildFailed && err.childName === child.name
      && err.phase === "Failed" && err.reason === "RetriesExhausted" && err.error?.code === "Boom");
  });

  it("result: a deleted child is ChildFailed Deleted", async () => {
    const run = await started();
    const child = await run.spawn(KEY, ASK);
    api.runs.delete(child.name);
    await assert.rejects(child.result(), (err: Error) => err instanceof ChildFailed && err.phase === "Deleted"
      && err.reason === "Deleted");
  });

  it("result: not ended within the timeout is an Error that says so", async () => {
    const run = await started();
    const child = await run.spawn(KEY, ASK);
    await assert.rejects(child.result({ timeoutSeconds: 3, pollSeconds: 1 }), (err: Error) => !(err instanceof ChildFailed)
      && /has not ended within 3 s/.test(err.message));
  });

  it("result: reaches only an attempt that still holds the parent", async () => {
    const run = await started();
    const child = await run.spawn(KEY, ASK);
    api.end(child.name, { phase: "Succeeded", result: { hits: 3 } });
    api.rv += 1; // the operator granted attempt 3
    api.lease = { metadata: { ...api.lease.metadata, resourceVersion: String(api.rv) },
      spec: { holderIdentity: "job-a3", leaseTransitions: 3 } };
    await run.renew();
    assert.equal(run.lost, true);
    await assert.rejects(child.result(), LeaseLost);
  });
});

describe("spawning without a transport that can", () => {
  it("is a TetherWorkerError", async () => {
    const run = new WorkerRun({ name: "job", namespace: "ns", holder: "job-a1", fence: 1, attempt: 1,
      leaseDurationSeconds: 10, renewIntervalSeconds: 2, transport: new FakeTransport(), clock: new FakeClock(),
      logger: () => {} });
    runs.push(run);
    await run.start();
    await assert.rejects(run.spawn(KEY, ASK), (err: Error) => err instanceof TetherWorkerError && /cannot spawn/.test(err.message));
  });
});

// --- the gateway ------------------------------------------------------------------------------------

const GW = "/api/v1/namespaces/agents/workerruns/planner/";
const RENEWED = { holder: "planner-a1", fence: 1, runUid: "uid-planner", leaseExpiresAt: "2026-11-30T12:00:10Z",
  stop: false, paused: false, status: "Running" };
const CLAIMED = { ...RENEWED, attempt: 1, leaseDurationSeconds: 30, renewIntervalSeconds: 10, payload: {}, checkpoint: null,
  idempotencyKey: "planner" };

/** The child the gateway makes for this attempt (its name, owner, label and digest of `spec`). */
function gatewayChild(spec: JsonObject, generation = 0, status: JsonObject = {}): JsonObject {
  const parent: Parent = { name: "planner", uid: "uid-planner", className: "planners", depth: 0, budgetRef: null,
    cappedCents: false, cappedTokens: false };
  return { ...childBody(parent, "agents", "planner-a1", 1, KEY, generation, spec), status };
}

describe("spawning through the gateway", () => {
  let gw: FakeServer;
  let replies: Map<string, Reply[]>;

  beforeEach(async () => {
    replies = new Map();
    gw = await serve((req) => {
      const op = req.url.slice(GW.length);
      const forced = replies.get(op)?.shift();
      if (forced !== undefined) return forced;
      if (op === "claim") return { status: 200, body: CLAIMED };
      if (op === "heartbeat") return { status: 200, body: RENEWED };
      return { status: 500, body: { error: { code: "Unexpected", message: op } } };
    });
  });

  afterEach(async () => {
    await gw.close();
  });

  async function claimed(): Promise<WorkerRun> {
    const run = await WorkerRun.claim(gw.url, "agents", "planner", "tok", { workerId: "w-1", clock: new FakeClock(),
      logger: () => {} });
    runs.push(run);
    return run;
  }

  const calls = (op: string): JsonObject[] => gw.seen.filter((s) => s.url === GW + op).map((s) => JSON.parse(s.body) as JsonObject);
  const spec = childSpec(null, { className: "tools", payload: { q: "tether" }, capCents: 20 });

  it("sends the fenced body, the key, the generation and the spec as asked; the gateway's child is the call's", async () => {
    replies.set("spawn", [{ status: 200, body: { child: gatewayChild(spec) } }]);
    replies.set("child", [{ status: 200, body: { child: gatewayChild(spec, 0, { phase: "Succeeded", result: { hits: 2 } }) } }]);
    const run = await claimed();
    const child = await run.spawn(KEY, { className: "tools", payload: { q: "tether" }, capCents: 20 });
    assert.equal(child.name, childName("planner", "uid-planner", KEY));
    assert.deepEqual(calls("spawn"), [{ holder: "planner-a1", fence: 1, runUid: "uid-planner", workerId: "w-1", key: KEY,
      generation: 0, spec: { executor: "Pod", className: "tools", payload: { q: "tether" }, budget: { capCents: 20 } } }]);
    assert.deepEqual(await child.result(), { hits: 2 });
    assert.deepEqual(calls("child"), [{ holder: "planner-a1", fence: 1, runUid: "uid-planner", workerId: "w-1",
      name: child.name }]);
  });

  it("a child of another spec is SpawnConflict", async () => {
    replies.set("spawn", [{ status: 200, body: { child: gatewayChild({ ...spec, payload: { conflict: true } }) } }]);
    const run = await claimed();
    await assert.rejects(run.spawn(KEY, { className: "tools", payload: { q: "tether" }, capCents: 20 }), SpawnConflict);
  });

  it("a stale attempt's rejected child: the next generation is asked for", async () => {
    const stale = { ...gatewayChild(spec, 0, { phase: "Rejected", conditions: [{ type: "Ready", reason: "StaleParent" }] }) };
    (stale.spec as JsonObject).parentRef = { ...((stale.spec as JsonObject).parentRef as JsonObject), holder: "planner-a0" };
    replies.set("spawn", [{ status: 200, body: { child: stale } }, { status: 200, body: { child: gatewayChild(spec, 1) } }]);
    const run = await claimed();
    const child = await run.spawn(KEY, { className: "tools", payload: { q: "tether" }, capCents: 20 });
    assert.equal(child.name, childName("planner", "uid-planner", KEY, 1));
    assert.deepEqual(calls("spawn").map((c) => c.generation), [0, 1]);
  });

  const notReplies: [string, unknown][] = [["{}", {}], ["a child without a name", { child: { metadata: {} } }],
    ["a page", "<html>sign in</html>"], ["a child that is not an object", { child: "planner-x" }]];
  for (const [what, body] of notReplies) {
    it(`a 200 that is not the gateway's reply (${what}) is Unanswered, not lost`, async () => {
      replies.set("spawn", [{ status: 200, body }]);
      const run = await claimed();
      await assert.rejects(run.spawn(KEY, { className: "tools" }), (err: Error) => err instanceof Unanswered && err.status === 200);
      assert.equal(run.lost, false);
    });
  }

  it("422 SpawnRefused is SpawnRefused with the API server's words, not lost", async () => {
    replies.set("spawn", [{ status: 422, body: { error: { code: "SpawnRefused", message: "class tools may not be spawned" } } }]);
    const run = await claimed();
    await assert.rejects(run.spawn(KEY, { className: "tools" }), (err: Error) => err instanceof SpawnRefused
      && /class tools may not be spawned/.test(err.message));
    assert.equal(run.lost, false);
  });

  it("RBAC's 403 (no spawn verb) is SpawnRefused, not lost", async () => {
    replies.set("spawn", [{ status: 403, body: { error: { code: "Forbidden", message: "ext may not spawn workerruns/job" } } }]);
    const run = await claimed();
    await assert.rejects(run.spawn(KEY, { className: "tools" }), (err: Error) => err instanceof SpawnRefused
      && /may not spawn/.test(err.message));
    assert.equal(run.lost, false);
  });

  it("409 SpawnConflict (a run of that name is not this run's child) is SpawnConflict", async () => {
    replies.set("spawn", [{ status: 409, body: { error: { code: "SpawnConflict", message: "job-1 is not a child of job" } } }]);
    const run = await claimed();
    await assert.rejects(run.spawn(KEY, { className: "tools" }), (err: Error) => err instanceof SpawnConflict
      && /not a child/.test(err.message));
    assert.equal(run.lost, false);
  });

  const lostAnswers: [string, Reply][] = [
    ["410 StaleFence", { status: 410, body: { error: { code: "StaleFence", message: "fence 1 < 2" } } }],
    ["403 NotClaimant", { status: 403, body: { error: { code: "NotClaimant", message: "another identity" } } }],
    ["404 NotFound", { status: 404, body: { error: { code: "NotFound", message: "no such run" } } }],
    ["409 HeldByAnother", { status: 409, body: { error: { code: "HeldByAnother", message: "w-2 claimed it" } } }],
  ];
  for (const [what, reply] of lostAnswers) {
    it(`spawn answered ${what} is LeaseLost, and the run is lost`, async () => {
      replies.set("spawn", [reply]);
      const run = await claimed();
      await assert.rejects(run.spawn(KEY, { className: "tools" }), LeaseLost);
      assert.equal(run.lost, true);
    });

    it(`child answered ${what} is LeaseLost, and the run is lost`, async () => {
      replies.set("spawn", [{ status: 200, body: { child: gatewayChild(childSpec(null, { className: "tools" })) } }]);
      replies.set("child", [reply]);
      const run = await claimed();
      const child = await run.spawn(KEY, { className: "tools" });
      await assert.rejects(child.result(), LeaseLost);
      assert.equal(run.lost, true);
    });
  }

  it("child answered 404 ChildNotFound: the child was deleted (ChildFailed), the run not lost", async () => {
    replies.set("spawn", [{ status: 200, body: { child: gatewayChild(childSpec(null, { className: "tools" })) } }]);
    replies.set("child", [{ status: 404, body: { error: { code: "ChildNotFound", message: "no such child" } } }]);
    const run = await claimed();
    const child = await run.spawn(KEY, { className: "tools" });
    await assert.rejects(child.result(), (err: Error) => err instanceof ChildFailed && err.phase === "Deleted");
    assert.equal(run.lost, false);
  });

  it("busy (503) is Unanswered with its Retry-After", async () => {
    replies.set("spawn", [{ status: 503, body: { error: { code: "Busy", message: "" } }, headers: { "Retry-After": "1" } }]);
    const run = await claimed();
    await assert.rejects(run.spawn(KEY, { className: "tools" }), (err: Error) => err instanceof Unanswered
      && err.status === 503 && err.retryAfterSeconds === 1);
    assert.equal(run.lost, false);
  });
});
