import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { afterEach, beforeEach, describe, it } from "node:test";

import { ResultInvalid } from "../src/errors.js";
import { KubeTransport, kubeconfigTokenFile, loadKubeConfig } from "../src/kube.js";
import { ANN_CHECKPOINT, ANN_REQUESTS, ANN_SIGNALS, ANN_USAGE, fencedPatch, type LeaseObject, type RunObject } from "../src/protocol.js";
import { WorkerRun } from "../src/run.js";
import { Unanswered } from "../src/transport.js";
import { serve, type FakeServer, type Reply, type Seen } from "./fakes.js";

const LEASE_PATH = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/job";
const RUN_PATH = "/apis/tether.dev/v1alpha1/namespaces/ns/workerruns/job";
const POLICY_403 = { kind: "Status", code: 403, reason: "Forbidden",
  message: "leases \"job\" is forbidden: ValidatingAdmissionPolicy 'tether-worker-lease-fencing' with binding "
    + "'tether-worker-lease-fencing' denied request: pod job-a1 does not hold the lease" };
const RBAC_403 = { kind: "Status", code: 403, reason: "Forbidden",
  message: "leases \"job\" is forbidden: User \"system:serviceaccount:ns:w\" cannot update resource \"leases\"" };

/** Just enough of an API server: one Lease (resourceVersion-checked updates) and one WorkerRun. */
class FakeApi {
  rv = 1;
  lease: LeaseObject = {
    apiVersion: "coordination.k8s.io/v1", kind: "Lease",
    metadata: { name: "job", namespace: "ns", resourceVersion: "1", annotations: {},
      ownerReferences: [{ kind: "WorkerRun", uid: "uid-1", controller: true }] },
    spec: { holderIdentity: "job-a1", leaseTransitions: 1, leaseDurationSeconds: 10 },
  };
  run: RunObject & { spec?: { payload?: unknown } } = {
    metadata: { uid: "uid-1" }, spec: { payload: { big: "x".repeat(10) } }, status: { holder: "job-a1", fence: 1 },
  };
  /** Answers to give before the normal behaviour, per "METHOD what". */
  readonly forced = new Map<string, Reply[]>();

  force(key: string, ...replies: Reply[]): void {
    this.forced.set(key, [...(this.forced.get(key) ?? []), ...replies]);
  }

  handle(req: Seen): Reply {
    const what = req.url.split("?")[0] === LEASE_PATH ? "lease" : req.url.split("?")[0] === RUN_PATH ? "run"
      : req.url.split("?")[0] === `${RUN_PATH}/status` ? "status" : "other";
    const forced = this.forced.get(`${req.method} ${what}`)?.shift();
    if (forced !== undefined) return forced;
    if (what === "lease" && req.method === "GET") return { status: 200, body: this.lease };
    if (what === "lease" && req.method === "PUT") {
      const body = JSON.parse(req.body) as LeaseObject;
      if (body.metadata?.resourceVersion !== String(this.rv)) return { status: 409, body: { kind: "Status", code: 409 } };
      this.rv += 1;
      this.lease = { ...body, metadata: { ...body.metadata, resourceVersion: String(this.rv) } };
      return { status: 200, body: this.lease };
    }
    if (what === "run" && req.method === "GET") return { status: 200, body: this.run };
    if (what === "status" && req.method === "PATCH") return { status: 200, body: this.run };
    return { status: 404, body: { kind: "Status", code: 404 } };
  }

  /** The operator writing the signals: a harmless change that makes the worker's next PUT conflict. */
  touch(signals: string): void {
    this.rv += 1;
    this.lease = { ...this.lease, metadata: { ...this.lease.metadata, resourceVersion: String(this.rv),
      annotations: { ...this.lease.metadata?.annotations, [ANN_SIGNALS]: signals } } };
  }
}

let dir: string;
let api: FakeApi;
let server: FakeServer;

function writeKubeconfig(url: string): string {
  const file = path.join(dir, "kubeconfig");
  fs.writeFileSync(file, JSON.stringify({
    apiVersion: "v1", kind: "Config", "current-context": "pod",
    clusters: [{ name: "pod", cluster: { server: url, "insecure-skip-tls-verify": true } }],
    users: [{ name: "pod", user: { tokenFile: "serviceaccount/token" } }],
    contexts: [{ name: "pod", context: { cluster: "pod", user: "pod", namespace: "ns" } }],
  }));
  return file;
}

function writeToken(token: string): void {
  // As the kubelet does: a new file renamed over the old one.
  fs.writeFileSync(path.join(dir, "serviceaccount", "token.tmp"), `${token}\n`);
  fs.renameSync(path.join(dir, "serviceaccount", "token.tmp"), path.join(dir, "serviceaccount", "token"));
}

function transport(timeoutSeconds = 2): KubeTransport {
  const kc = loadKubeConfig({ env: { KUBECONFIG: path.join(dir, "kubeconfig") } });
  // The publication's own timeout (TP, 30 s) shortened alike: "no answer" waits it out.
  return new KubeTransport("ns", "job", "job-a1", 1, "uid-1", kc, timeoutSeconds, () => {}, timeoutSeconds);
}

const puts = (): Seen[] => server.seen.filter((s) => s.method === "PUT");
const gets = (): Seen[] => server.seen.filter((s) => s.method === "GET");

beforeEach(async () => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), "tether-kube-"));
  fs.mkdirSync(path.join(dir, "serviceaccount"));
  writeToken("token-1");
  api = new FakeApi();
  server = await serve((req) => api.handle(req));
  writeKubeconfig(server.url);
});

afterEach(async () => {
  await server.close();
  fs.rmSync(dir, { recursive: true, force: true });
});

describe("credentials", () => {
  it("reads the kubeconfig user's tokenFile (relative to the kubeconfig) for every request", async () => {
    const t = transport();
    await t.renew(null, null);
    writeToken("token-2"); // the kubelet rotated it
    await t.renew(null, null);
    assert.deepEqual(server.seen.map((s) => s.headers.authorization),
      ["Bearer token-1", "Bearer token-1", "Bearer token-2"]);
  });

  it("after a 401 the next request carries the token file's new content", async () => {
    const t = transport();
    api.force("GET lease", { status: 401, body: { kind: "Status", code: 401 } });
    const refused = await t.renew(null, null);
    assert.deepEqual([refused.ok, refused.lost], [false, false]);
    writeToken("token-2");
    assert.equal((await t.renew(null, null)).ok, true);
    assert.equal(server.seen.at(-1)?.headers.authorization, "Bearer token-2");
  });

  it("finds the token file of the current user in the first kubeconfig that defines it", () => {
    const other = path.join(dir, "other");
    fs.writeFileSync(other, "users:\n- name: pod\n  user: {tokenFile: /elsewhere/token}\n- name: admin\n  user: {token: abc}\n");
    assert.equal(kubeconfigTokenFile([path.join(dir, "kubeconfig"), other], "pod"), path.join(dir, "serviceaccount", "token"));
    assert.equal(kubeconfigTokenFile([other, path.join(dir, "kubeconfig")], "pod"), "/elsewhere/token");
    assert.equal(kubeconfigTokenFile([other], "admin"), null);
  });

  it("prefers the in-cluster service account when KUBECONFIG is not set", async () => {
    const sa = path.join(dir, "serviceaccount");
    fs.writeFileSync(path.join(sa, "ca.crt"), "not a real CA");
    const kc = loadKubeConfig({ env: { KUBERNETES_SERVICE_HOST: "fd00::1", KUBERNETES_SERVICE_PORT: "6443" },
      serviceAccountDir: sa });
    assert.equal(kc.getCurrentCluster()?.server, "https://[fd00::1]:6443");
    assert.equal(kc.getCurrentCluster()?.caFile, path.join(sa, "ca.crt"));
    const opts = await kc.applyToFetchOptions({});
    assert.equal((opts.headers as unknown as Headers).get("authorization"), "Bearer token-1");
    writeToken("token-2");
    const again = await kc.applyToFetchOptions({});
    assert.equal((again.headers as unknown as Headers).get("authorization"), "Bearer token-2");
  });

  it("uses KUBECONFIG when it is set, even with a service account mounted", () => {
    const kc = loadKubeConfig({ env: { KUBECONFIG: path.join(dir, "kubeconfig"), KUBERNETES_SERVICE_HOST: "10.0.0.1" },
      serviceAccountDir: path.join(dir, "serviceaccount") });
    assert.equal(kc.getCurrentCluster()?.server, server.url);
  });
});

describe("renewal", () => {
  it("reads the Lease once, then PUTs what it got back, with renewTime, checkpoint and usage", async () => {
    const t = transport();
    const first = await t.renew("row-1", { cents: 3, tokens: 9 });
    assert.deepEqual([first.ok, first.lost], [true, false]);
    const second = await t.renew("row-2", { cents: 4, tokens: 9 });
    assert.equal(second.ok, true);
    assert.equal(gets().length, 1);
    const [put1, put2] = puts().map((s) => JSON.parse(s.body) as LeaseObject);
    assert.equal(put1?.metadata?.resourceVersion, "1");
    assert.equal(put2?.metadata?.resourceVersion, "2");
    assert.match(put2?.spec?.renewTime ?? "", /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$/);
    assert.equal(put2?.metadata?.annotations?.[ANN_CHECKPOINT], "row-2");
    assert.equal(put2?.metadata?.annotations?.[ANN_USAGE], '{"cents":4,"tokens":9}');
    assert.equal(put2?.spec?.holderIdentity, "job-a1");
    assert.equal(put2?.spec?.leaseTransitions, 1);
  });

  it("sends the Lease back exactly as it came, fields client-node does not model included", async () => {
    api.lease.metadata = { ...api.lease.metadata, creationTimestamp: "2026-11-30T12:00:00Z", futureMeta: { a: 1 } };
    api.lease.spec = { ...api.lease.spec, acquireTime: "2026-11-30T12:00:00.123456Z", futureField: "kept" };
    const t = transport();
    await t.renew(null, null);
    await t.renew(null, null);
    for (const put of puts().map((s) => JSON.parse(s.body) as LeaseObject)) {
      assert.equal(put.spec?.futureField, "kept");
      assert.equal(put.spec?.acquireTime, "2026-11-30T12:00:00.123456Z");
      assert.equal(put.metadata?.creationTimestamp, "2026-11-30T12:00:00Z");
      assert.deepEqual(put.metadata?.futureMeta, { a: 1 });
    }
  });

  it("writes the approval requests as one annotation, and none when there are none", async () => {
    const t = transport();
    await t.renew(null, null);
    await t.renew(null, null, [{ name: "ship", details: "", timeoutSeconds: null },
      { name: "refund", details: "42 €", timeoutSeconds: 600 }]);
    const [put1, put2] = puts().map((s) => JSON.parse(s.body) as LeaseObject);
    assert.equal(put1?.metadata?.annotations?.[ANN_REQUESTS], undefined);
    assert.equal(put2?.metadata?.annotations?.[ANN_REQUESTS],
      '{"refund":{"details":"42 €","timeoutSeconds":600},"ship":{"details":""}}');
  });

  it("reads the decisions from the renewal's answer", async () => {
    api.lease.metadata!.annotations![ANN_SIGNALS] = '{"decisions":{"ship":{"decision":"TimedOut"}}}';
    const r = await transport().renew(null, null);
    assert.deepEqual(r.signals?.decisions, { ship: { decision: "TimedOut", reason: null, approver: null } });
  });

  it("reads the signals from the renewal's answer", async () => {
    api.lease.metadata!.annotations![ANN_SIGNALS] = '{"stop":true,"reason":"budget"}';
    const r = await transport().renew(null, null);
    assert.deepEqual([r.signals?.stop, r.signals?.reason], [true, "budget"]);
  });

  it("409: re-reads, still ours, retries once and succeeds", async () => {
    const t = transport();
    await t.renew(null, null);
    api.touch('{"paused":true}');
    const r = await t.renew(null, null);
    assert.equal(r.ok, true);
    assert.equal(r.signals?.paused, true);
    assert.deepEqual(server.seen.map((s) => s.method), ["GET", "PUT", "PUT", "GET", "PUT"]);
  });

  it("409 twice: unconfirmed, not lost; the next renewal tries again", async () => {
    const t = transport();
    api.force("PUT lease", { status: 409, body: {} }, { status: 409, body: {} });
    const r = await t.renew(null, null);
    assert.deepEqual([r.ok, r.lost], [false, false]);
    assert.equal((await t.renew(null, null)).ok, true);
  });

  it("409, still ours, and the retry's 409: re-reads; another holder now means lost", async () => {
    const t = transport();
    await t.renew(null, null);
    const ours = structuredClone(api.lease);
    const theirs: LeaseObject = { ...structuredClone(api.lease), spec: { ...api.lease.spec, holderIdentity: "job-a2", leaseTransitions: 2 } };
    api.force("PUT lease", { status: 409, body: {} }, { status: 409, body: {} });
    api.force("GET lease", { status: 200, body: ours }, { status: 200, body: theirs });
    const r = await t.renew(null, null);
    assert.deepEqual([r.ok, r.lost], [false, true]);
    assert.deepEqual(server.seen.map((s) => s.method), ["GET", "PUT", "PUT", "GET", "PUT", "GET"]);
  });

  it("409, still ours, and the retry's 409: re-reads; still ours means unconfirmed, not lost", async () => {
    const t = transport();
    await t.renew(null, null);
    api.force("PUT lease", { status: 409, body: {} }, { status: 409, body: {} });
    const r = await t.renew(null, null);
    assert.deepEqual([r.ok, r.lost], [false, false]);
    assert.deepEqual(server.seen.map((s) => s.method), ["GET", "PUT", "PUT", "GET", "PUT", "GET"]);
  });

  it("409 and the Lease now names another holder: lost", async () => {
    const t = transport();
    await t.renew(null, null);
    api.touch("");
    api.lease.spec = { ...api.lease.spec, holderIdentity: "job-a2", leaseTransitions: 2 };
    const r = await t.renew(null, null);
    assert.deepEqual([r.ok, r.lost], [false, true]);
  });

  it("a namesake's Lease (another run uid) is not ours", async () => {
    api.lease.metadata!.ownerReferences = [{ kind: "WorkerRun", uid: "uid-2", controller: true }];
    const r = await transport().renew(null, null);
    assert.deepEqual([r.ok, r.lost], [false, true]);
    assert.equal(puts().length, 0);
  });

  const answers: [string, string, Reply, boolean][] = [
    ["Lease gone (GET 404)", "GET lease", { status: 404, body: {} }, true],
    ["Lease gone (PUT 404)", "PUT lease", { status: 404, body: {} }, true],
    ["fencing policy 403", "PUT lease", { status: 403, body: POLICY_403 }, true],
    ["RBAC 403", "PUT lease", { status: 403, body: RBAC_403 }, false],
    ["429", "PUT lease", { status: 429, body: {}, headers: { "Retry-After": "1" } }, false],
    ["500", "PUT lease", { status: 500, body: {} }, false],
    ["GET 503", "GET lease", { status: 503, body: {} }, false],
  ];
  for (const [what, key, reply, lost] of answers) {
    it(`${what}: ${lost ? "lost" : "unconfirmed, not lost"}`, async () => {
      api.force(key, reply);
      const r = await transport().renew(null, null);
      assert.deepEqual([r.ok, r.lost], [false, lost]);
    });
  }

  it("no answer within the request timeout is Unanswered", async () => {
    api.force("GET lease", "hang");
    await assert.rejects(transport(0.3).renew(null, null), Unanswered);
  });
});

/** sdk/vectors/leases.json: what an answer to a Lease request means, alike in the three SDKs. */
interface VectorAnswer {
  method: string;
  status?: number;
  contentType?: string;
  text?: string;
  json?: unknown;
  landed?: boolean;
}

const LEASE_VECTORS = JSON.parse(fs.readFileSync(new URL("../../../vectors/leases.json", import.meta.url), "utf8")) as {
  lease: LeaseObject;
  renewals: { name: string; answers: VectorAnswer[]; outcome: string; then?: string }[];
};

/** The vectors' API server: their Lease, compare-and-swapped by resourceVersion; the script's answers first. */
class VectorApi extends FakeApi {
  readonly methods: string[] = [];

  constructor(private readonly script: VectorAnswer[]) {
    super();
    this.lease = structuredClone(LEASE_VECTORS.lease);
    this.rv = Number(this.lease.metadata?.resourceVersion);
  }

  override handle(req: Seen): Reply {
    this.methods.push(req.method);
    const answer = this.script.shift() ?? { method: req.method };
    assert.equal(req.method, answer.method);
    if (answer.status === undefined || answer.landed) {
      const own = super.handle(req);
      if (answer.status === undefined) return own;
    }
    return { status: answer.status, body: answer.text ?? JSON.stringify(answer.json),
      headers: { "Content-Type": answer.contentType ?? "application/json" } };
  }
}

const outcome = (r: { ok: boolean; lost: boolean }): string => r.ok ? "confirmed" : r.lost ? "lost" : "unconfirmed";

describe("answers that are not a Lease (issue 21, defect 7): unconfirmed, never lost", () => {
  for (const v of LEASE_VECTORS.renewals) {
    it(v.name, async () => {
      const vapi = new VectorApi([...v.answers]);
      api = vapi;
      const t = transport();
      assert.equal(outcome(await t.renew(null, null)), v.outcome);
      assert.deepEqual(vapi.methods, v.answers.map((a) => a.method));
      if (v.then !== undefined) assert.equal(outcome(await t.renew(null, null)), v.then);
    });
  }

  it("a proxy's HTML 200 does not break the start: ownership is unknown until a renewal confirms it", async () => {
    const page = { status: 200, body: "<html><body>Please sign in</body></html>", headers: { "Content-Type": "text/html" } };
    api.force("GET lease", page);
    const run = await WorkerRun.fromEnv({ env: { KUBECONFIG: path.join(dir, "kubeconfig"), TETHER_RUN: "job",
      TETHER_NAMESPACE: "ns", TETHER_RUN_UID: "uid-1", TETHER_HOLDER: "job-a1", TETHER_FENCE: "1", TETHER_ATTEMPT: "1",
      TETHER_LEASE_DURATION_SECONDS: "10", TETHER_RENEW_INTERVAL_SECONDS: "2" }, logger: () => {} });
    try {
      assert.deepEqual([run.ownership, run.lost], ["unknown", false]);
      assert.equal(await run.renew(), true);
      assert.equal(run.owned, true);
    } finally {
      await run.close();
    }
  });
});

describe("publication", () => {
  it("one JSON patch, as application/json-patch+json, testing uid, fence and holder", async () => {
    assert.equal(await transport().publish("result", { steps: 3 }), true);
    const patch = server.seen.find((s) => s.method === "PATCH");
    assert.equal(patch?.url, `${RUN_PATH}/status`);
    assert.equal(patch?.headers["content-type"], "application/json-patch+json");
    assert.deepEqual(JSON.parse(patch?.body ?? ""), fencedPatch("job-a1", 1, "result", { steps: 3 }, "uid-1"));
  });

  it("422 with causes: ResultInvalid, with the causes", async () => {
    api.force("PATCH status", { status: 422, body: { kind: "Status", code: 422, reason: "Invalid",
      message: "WorkerRun.tether.dev \"job\" is invalid: status.result: Invalid value: \"array\"",
      details: { causes: [{ field: "status.result", reason: "FieldValueTypeInvalid", message: "must be object" }] } } });
    await assert.rejects(transport().publish("result", [1]), (err: Error) =>
      err instanceof ResultInvalid && err.causes[0]?.field === "status.result" && /is invalid/.test(err.message));
  });

  it("413: ResultInvalid (too large), not retried", async () => {
    api.force("PATCH status", { status: 413, body: { kind: "Status", code: 413, reason: "RequestEntityTooLarge",
      message: "Request entity too large: limit is 3145728" } });
    await assert.rejects(transport().publish("result", { big: "x" }), (err: Error) =>
      err instanceof ResultInvalid && /too large/.test(err.message));
  });

  const refused: [string, Reply][] = [
    ["422 without causes (a test failed)", { status: 422, body: { kind: "Status", code: 422, reason: "Invalid" } }],
    ["422 whose causes name another field", { status: 422, body: { kind: "Status", code: 422, reason: "Invalid",
      details: { causes: [{ field: "metadata.annotations", reason: "FieldValueInvalid", message: "x" }] } } }],
    ["409", { status: 409, body: {} }],
    ["404", { status: 404, body: {} }],
    ["fencing policy 403", { status: 403, body: POLICY_403 }],
  ];
  for (const [what, reply] of refused) {
    it(`${what}: refused`, async () => {
      api.force("PATCH status", reply);
      assert.equal(await transport().publish("error", { code: "X", message: "" }), false);
    });
  }

  const retried: [string, Reply, number | null, number][] = [
    ["503 with Retry-After", { status: 503, body: {}, headers: { "Retry-After": "2" } }, 503, 2],
    ["429", { status: 429, body: {} }, 429, 0],
    ["400", { status: 400, body: { kind: "Status", code: 400, reason: "BadRequest" } }, 400, 0],
    ["401", { status: 401, body: {} }, 401, 0],
    ["RBAC 403", { status: 403, body: RBAC_403 }, 403, 0],
    ["no answer", "hang", null, 0],
  ];
  for (const [what, reply, status, retryAfter] of retried) {
    it(`${what}: retried (Unanswered)`, async () => {
      api.force("PATCH status", reply);
      await assert.rejects(transport(0.3).publish("result", {}), (err: Error) =>
        err instanceof Unanswered && err.status === status && err.retryAfterSeconds === retryAfter);
    });
  }

  it("looks a publication up on the run", async () => {
    api.run.status = { holder: null, fence: 2, result: { steps: 3 },
      attempts: [{ holder: "job-a1", fence: 1, outcome: "Succeeded" }] };
    assert.equal(await transport().recorded("result", { steps: 3 }), true);
    assert.equal(await transport().recorded("result", { steps: 4 }), false);
    api.run.metadata = { uid: "uid-2" };
    assert.equal(await transport().recorded("result", { steps: 3 }), false, "a namesake's record is not ours");
    api.force("GET run", { status: 404, body: {} });
    assert.equal(await transport().recorded("result", { steps: 3 }), false);
  });
});

describe("WorkerRun.fromEnv", () => {
  function env(extra: Record<string, string> = {}): NodeJS.ProcessEnv {
    return {
      KUBECONFIG: path.join(dir, "kubeconfig"),
      TETHER_RUN: "job", TETHER_NAMESPACE: "ns", TETHER_RUN_UID: "uid-1", TETHER_HOLDER: "job-a1", TETHER_FENCE: "1",
      TETHER_ATTEMPT: "2", TETHER_LEASE_DURATION_SECONDS: "10", TETHER_RENEW_INTERVAL_SECONDS: "2",
      TETHER_CHECKPOINT: "row-7", TETHER_IDEMPOTENCY_KEY: "invoice:8f1b", ...extra,
    };
  }

  it("reads the environment, renews once and publishes through the API server", async () => {
    const run = await WorkerRun.fromEnv({ env: env({ TETHER_PAYLOAD: '{"steps":3}' }), logger: () => {} });
    try {
      assert.equal(run.owned, true);
      assert.deepEqual([run.attempt, run.fence, run.holder, run.runUid], [2, 1, "job-a1", "uid-1"]);
      assert.deepEqual(run.payload, { steps: 3 });
      assert.equal(run.checkpointCursor, "row-7");
      assert.equal(run.reviewFeedback, null);
      assert.equal(run.effectHeaders("capture")["Idempotency-Key"], "invoice:8f1b:capture");
      assert.equal(puts().length, 1);
      run.reportUsage({ cents: 5 });
      await run.complete({ steps: 3 });
      assert.equal(JSON.parse(puts().at(-1)?.body ?? "{}").metadata.annotations[ANN_USAGE], '{"cents":5,"tokens":0}');
      assert.equal(server.seen.at(-1)?.method, "PATCH");
    } finally {
      await run.close();
    }
  });

  it("reads why the previous attempt's result was denied", async () => {
    const run = await WorkerRun.fromEnv({ env: env({ TETHER_PAYLOAD: "{}", TETHER_REVIEW_FEEDBACK: "round the totals" }),
      logger: () => {} });
    await run.close();
    assert.equal(run.reviewFeedback, "round the totals");
  });

  it("reads a payload too large for the environment from its own WorkerRun", async () => {
    const run = await WorkerRun.fromEnv({ env: env({ TETHER_PAYLOAD_FROM: "spec.payload" }), logger: () => {} });
    await run.close();
    assert.deepEqual(run.payload, { big: "xxxxxxxxxx" });
  });

  it("reads the payload with its own 30 s timeout, not the request timeout T", async () => {
    // A large run answered slower than T (here 0.1 s; 1 s when R = 1 s) is still read.
    const slow = await serve(async (req) => {
      await new Promise((resolve) => setTimeout(resolve, 400));
      return api.handle(req);
    });
    try {
      writeKubeconfig(slow.url);
      assert.deepEqual(await transport(0.1).readPayload(1), { big: "xxxxxxxxxx" });
    } finally {
      await slow.close();
    }
  });

  it("says which variable is missing", async () => {
    await assert.rejects(WorkerRun.fromEnv({ env: { ...env(), TETHER_HOLDER: undefined } }), /TETHER_HOLDER is not set/);
    await assert.rejects(WorkerRun.fromEnv({ env: env({ TETHER_FENCE: "one" }) }), /TETHER_FENCE="one" is not an integer/);
  });
});
