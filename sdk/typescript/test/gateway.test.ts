import assert from "node:assert/strict";
import fs from "node:fs";
import { afterEach, beforeEach, describe, it } from "node:test";

import { ClaimRefused, LeaseLost, ResultInvalid, TetherWorkerError } from "../src/errors.js";
import { GatewayTransport, claimRun } from "../src/gateway.js";
import { WorkerRun } from "../src/run.js";
import { Unanswered } from "../src/transport.js";
import { serve, type FakeServer, type Reply, type Seen } from "./fakes.js";

const PREFIX = "/api/v1/namespaces/agents/workerruns/invoice-8f1b";

const CLAIM = {
  holder: "invoice-8f1b-a1", fence: 1, attempt: 1, runUid: "uid-1", leaseDurationSeconds: 8, renewIntervalSeconds: 1,
  leaseExpiresAt: "2026-11-30T12:00:08Z", stop: false, paused: false, capRemainingCents: 500, capRemainingTokens: null,
  status: "Starting", payload: { invoice: "8f1b" }, checkpoint: "row-7", idempotencyKey: "invoice:8f1b",
  toolClaim: { token: "tool-1", expiresAt: "2026-11-30T12:10:00Z", serviceAccount: "invoice-8f1b-worker" },
};

function heartbeatReply(extra: Record<string, unknown> = {}): Reply {
  return { status: 200, body: { holder: "invoice-8f1b-a1", fence: 1, runUid: "uid-1",
    leaseExpiresAt: "2026-11-30T12:00:08Z", stop: false, paused: false, endsAt: null,
    capRemainingCents: 380, capRemainingTokens: null, status: "Running", toolClaim: null, ...extra } };
}

let server: FakeServer;
let replies: Map<string, Reply[]>;

function force(op: string, ...r: Reply[]): void {
  replies.set(op, [...(replies.get(op) ?? []), ...r]);
}

beforeEach(async () => {
  replies = new Map();
  server = await serve((req: Seen) => {
    const op = req.url.slice(PREFIX.length + 1);
    const forced = replies.get(op)?.shift();
    if (forced !== undefined) return forced;
    if (op === "claim") return { status: 200, body: CLAIM };
    if (op === "heartbeat") return heartbeatReply();
    return { status: 200, body: { status: "Succeeded", fence: 1 } };
  });
});

afterEach(async () => {
  await server.close();
});

const body = (s: Seen | undefined): Record<string, unknown> => JSON.parse(s?.body ?? "{}") as Record<string, unknown>;
const calls = (op: string): Seen[] => server.seen.filter((s) => s.url === `${PREFIX}/${op}`);

describe("claim", () => {
  it("claims with the bearer token and worker id, then renews once", async () => {
    const run = await WorkerRun.claim(`${server.url}/`, "agents", "invoice-8f1b", "tok", { workerId: "laptop-1", logger: () => {} });
    try {
      assert.equal(calls("claim")[0]?.headers.authorization, "Bearer tok");
      assert.deepEqual(body(calls("claim")[0]), { workerId: "laptop-1" });
      assert.deepEqual([run.holder, run.fence, run.attempt, run.runUid], ["invoice-8f1b-a1", 1, 1, "uid-1"]);
      assert.deepEqual(run.payload, { invoice: "8f1b" });
      assert.equal(run.checkpointCursor, "row-7");
      assert.equal(run.idempotencyKey, "invoice:8f1b");
      assert.equal(run.toolClaim?.token, "tool-1");
      assert.equal(calls("heartbeat").length, 1);
      assert.equal(run.owned, true);
      assert.equal(run.signals.capRemainingCents, 380);
      assert.equal(run.reviewFeedback, null);
    } finally {
      await run.close();
    }
  });

  const refusals: [number, string][] = [[402, "BudgetExceeded"], [409, "HeldByAnother"], [409, "NotClaimable"], [403, "Forbidden"]];
  for (const [status, code] of refusals) {
    it(`${status} ${code} is ClaimRefused`, async () => {
      force("claim", { status, body: { error: { code, message: "no" } } });
      await assert.rejects(WorkerRun.claim(server.url, "agents", "invoice-8f1b", "tok"),
        (err: Error) => err instanceof ClaimRefused && err.status === status && err.code === code);
    });
  }
});

function transport(workerId: string | null = "laptop-1", timeoutSeconds = 2): GatewayTransport {
  return new GatewayTransport(server.url, "agents", "invoice-8f1b", "tok", "invoice-8f1b-a1", 1, timeoutSeconds, workerId, "uid-1");
}

describe("heartbeat", () => {
  it("names the attempt, the run and the worker, and carries checkpoint and usage", async () => {
    const r = await transport().renew("row-8", { cents: 120, tokens: 9 });
    assert.equal(r.ok, true);
    assert.deepEqual(body(calls("heartbeat")[0]), { holder: "invoice-8f1b-a1", fence: 1, workerId: "laptop-1", runUid: "uid-1",
      checkpoint: "row-8", usage: { cents: 120, tokens: 9 } });
  });

  it("without a worker id or anything to report, sends only the fenced fields", async () => {
    await transport(null).renew(null, null);
    assert.deepEqual(body(calls("heartbeat")[0]), { holder: "invoice-8f1b-a1", fence: 1, runUid: "uid-1" });
  });

  it("turns the flat reply into signals counted against later usage", async () => {
    force("heartbeat", heartbeatReply({ stop: true, paused: true, endsAt: "2026-12-01T00:00:00Z", capRemainingTokens: 50 }));
    const r = await transport().renew(null, { cents: 120, tokens: 9 });
    assert.deepEqual({ ...r.signals }, { stop: true, yield: false, stopBy: null, paused: true, reason: null,
      endsAt: "2026-12-01T00:00:00Z", capCents: 500, capTokens: 59, baseCents: 0, baseTokens: 0, decisions: {} });
  });

  it("hears a Kueue eviction as a yield", async () => {
    force("heartbeat", heartbeatReply({ stop: true, yield: true, stopBy: "2026-12-03T12:00:30Z" }));
    const r = await transport().renew(null, null);
    assert.equal(r.signals?.yield, true);
    assert.equal(r.signals?.stopBy, "2026-12-03T12:00:30Z");
  });

  it("carries every approval request, timeoutSeconds only when set", async () => {
    await transport().renew(null, null, [{ name: "refund", details: "42 EUR", timeoutSeconds: 600 },
      { name: "ship", details: "", timeoutSeconds: null }]);
    assert.deepEqual(body(calls("heartbeat")[0]).requests, [{ name: "refund", details: "42 EUR", timeoutSeconds: 600 },
      { name: "ship", details: "" }]);
  });

  it("reads the decisions", async () => {
    force("heartbeat", heartbeatReply({ decisions: { refund: { decision: "Deny", reason: "too much", approver: "alice" } } }));
    const r = await transport().renew(null, null);
    assert.deepEqual(r.signals?.decisions, { refund: { decision: "Deny", reason: "too much", approver: "alice" } });
  });

  it("malformed decisions decide nothing, and the other signals stand", async () => {
    force("heartbeat", heartbeatReply({ stop: true, decisions: { refund: { decision: "Perhaps" } } }));
    const r = await transport().renew(null, null);
    assert.equal(r.ok, true);
    assert.equal(r.signals?.stop, true);
    assert.deepEqual(r.signals?.decisions, {});
  });

  it("keeps the newest tool claim", async () => {
    const t = transport();
    force("heartbeat", heartbeatReply({ toolClaim: { token: "tool-2", expiresAt: "x", serviceAccount: "sa" } }), heartbeatReply());
    await t.renew(null, null);
    await t.renew(null, null);
    assert.equal(t.toolClaim?.token, "tool-2");
  });

  const answers: [string, Reply, boolean][] = [
    ["410 StaleFence", { status: 410, body: { error: { code: "StaleFence", message: "fence 1 is no longer current" } } }, true],
    ["404", { status: 404, body: { error: { code: "NotFound", message: "gone" } } }, true],
    ["503", { status: 503, body: { error: { code: "Unavailable", message: "" } }, headers: { "Retry-After": "1" } }, false],
    ["429", { status: 429, body: {} }, false],
    ["403 NotClaimant", { status: 403, body: { error: { code: "NotClaimant", message: "" } } }, true],
    ["409 HeldByAnother", { status: 409, body: { error: { code: "HeldByAnother", message: "" } } }, true],
    ["403 Forbidden (RBAC)", { status: 403, body: { error: { code: "Forbidden", message: "" } } }, false],
    ["401", { status: 401, body: { error: { code: "Unauthorized", message: "" } } }, false],
    ["503 Busy", { status: 503, body: { error: { code: "Busy", message: "" } }, headers: { "Retry-After": "1" } }, false],
    ["a proxy's HTML page", { status: 502, body: "<html>bad gateway</html>" }, false],
    ["200 with a proxy's HTML page", { status: 200, body: "<html>hello</html>" }, false],
    ["200 with a JSON array", { status: 200, body: [1] }, false],
    ["200 with JSON null", { status: 200, body: "null" }, false],
    ["200 with no body", { status: 200 }, false],
  ];
  for (const [what, reply, lost] of answers) {
    it(`${what}: ${lost ? "lost" : "unconfirmed, not lost"}`, async () => {
      force("heartbeat", reply);
      const r = await transport().renew(null, null);
      assert.deepEqual([r.ok, r.lost], [false, lost]);
    });
  }

  it("no answer is Unanswered", async () => {
    force("heartbeat", "hang");
    await assert.rejects(transport(null, 0.3).renew(null, null), Unanswered);
  });
});

describe("approvals through WorkerRun", () => {
  it("the claim reply's reviewFeedback; the request rides on heartbeats until the decision comes back", async () => {
    force("claim", { status: 200, body: { ...CLAIM, reviewFeedback: "round the totals" } });
    force("heartbeat", heartbeatReply(), heartbeatReply());
    const run = await WorkerRun.claim(server.url, "agents", "invoice-8f1b", "tok", { logger: () => {} });
    try {
      assert.equal(run.reviewFeedback, "round the totals");
      force("heartbeat", heartbeatReply({ decisions: { refund: { decision: "Approve", reason: null, approver: "alice" } } }));
      const decided = await run.requestApproval("refund", "42 EUR", null, { pollMs: 10 });
      assert.deepEqual(decided, { decision: "Approve", reason: null, approver: "alice", approved: true });
      const asked = calls("heartbeat").slice(1).map((s) => body(s).requests);
      assert.ok(asked.length >= 2);
      for (const requests of asked) assert.deepEqual(requests, [{ name: "refund", details: "42 EUR" }]);
    } finally {
      await run.close();
    }
  });
});

describe("publication", () => {
  it("complete sends the result, fail the error, both fenced", async () => {
    const t = transport();
    assert.equal(await t.publish("result", { captured: true }), true);
    assert.equal(await t.publish("error", { code: "X", message: "m" }), true);
    assert.deepEqual(body(calls("complete")[0]), { holder: "invoice-8f1b-a1", fence: 1, workerId: "laptop-1", runUid: "uid-1",
      result: { captured: true } });
    assert.deepEqual(body(calls("fail")[0]).error, { code: "X", message: "m" });
  });

  it("422 is ResultInvalid naming the field", async () => {
    force("complete", { status: 422, body: { error: { code: "MalformedBody", message: "result: Input should be a valid dictionary",
      field: "result" } } });
    await assert.rejects(transport().publish("result", [1]), (err: Error) =>
      err instanceof ResultInvalid && err.causes[0]?.field === "result");
  });

  it("413 is ResultInvalid (too large)", async () => {
    force("complete", { status: 413, body: { error: { code: "TooLarge", message: "body over 1 MiB" } } });
    await assert.rejects(transport().publish("result", {}), (err: Error) =>
      err instanceof ResultInvalid && /too large/.test(err.message));
  });

  const refused: [string, Reply][] = [
    ["410 StaleFence", { status: 410, body: { error: { code: "StaleFence", message: "" } } }],
    ["409 AlreadyPublished", { status: 409, body: { error: { code: "AlreadyPublished", message: "" } } }],
    ["409 HeldByAnother", { status: 409, body: { error: { code: "HeldByAnother", message: "" } } }],
    ["404", { status: 404, body: { error: { code: "NotFound", message: "" } } }],
    ["403 NotClaimant", { status: 403, body: { error: { code: "NotClaimant", message: "" } } }],
  ];
  for (const [what, reply] of refused) {
    it(`${what}: refused`, async () => {
      force("complete", reply);
      assert.equal(await transport().publish("result", {}), false);
    });
  }

  const retried: [string, Exclude<Reply, "hang">, number][] = [
    ["503 Unavailable", { status: 503, body: { error: { code: "Unavailable", message: "" } }, headers: { "Retry-After": "5" } }, 5],
    ["503 Busy", { status: 503, body: { error: { code: "Busy", message: "" } }, headers: { "Retry-After": "1" } }, 1],
    ["502", { status: 502, body: "<html>bad gateway</html>" }, 0],
    ["429", { status: 429, body: {}, headers: { "Retry-After": "2" } }, 2],
    ["400", { status: 400, body: { error: { code: "BadRequest", message: "" } } }, 0],
    ["401", { status: 401, body: { error: { code: "Unauthorized", message: "" } } }, 0],
    ["403 Forbidden (RBAC)", { status: 403, body: { error: { code: "Forbidden", message: "" } } }, 0],
  ];
  for (const [what, reply, retryAfter] of retried) {
    it(`${what} is retried, after at least Retry-After`, async () => {
      force("complete", reply);
      await assert.rejects(transport().publish("result", {}), (err: Error) =>
        err instanceof Unanswered && err.status === reply.status && err.retryAfterSeconds === retryAfter);
    });
  }

  it("through WorkerRun: a refused publication is LeaseLost", async () => {
    const run = await WorkerRun.claim(server.url, "agents", "invoice-8f1b", "tok", { logger: () => {} });
    force("complete", { status: 410, body: { error: { code: "StaleFence", message: "" } } });
    await assert.rejects(run.complete({ captured: true }), LeaseLost);
    await run.close();
  });

  it("through WorkerRun: 409 AlreadyPublished is LeaseLost, not retried", async () => {
    const run = await WorkerRun.claim(server.url, "agents", "invoice-8f1b", "tok", { logger: () => {} });
    force("complete", { status: 409, body: { error: { code: "AlreadyPublished", message: "another result was accepted" } } });
    await assert.rejects(run.complete({ captured: true }), LeaseLost);
    assert.equal(calls("complete").length, 1);
    await run.close();
  });
});

/** sdk/vectors/gateway-replies.json: what a gateway answer means, alike in the three SDKs. */
interface GatewayVector {
  name: string;
  status?: number;
  contentType?: string;
  text?: string;
  json?: unknown;
}

const GATEWAY_VECTORS = JSON.parse(fs.readFileSync(new URL("../../../vectors/gateway-replies.json", import.meta.url), "utf8")) as {
  worker: { namespace: string; name: string; holder: string; fence: number; runUid: string; workerId: string };
  heartbeats: (GatewayVector & { outcome: string })[];
  claims: (GatewayVector & { claim: boolean })[];
};

const vectorReply = (v: GatewayVector): Reply => ({ status: v.status ?? 200, body: v.text ?? JSON.stringify(v.json),
  headers: { "Content-Type": v.contentType ?? "application/json" } });

describe("a 200 confirms only with the gateway's reply for this attempt (docs/protocol.md §6.4)", () => {
  const w = GATEWAY_VECTORS.worker;
  for (const v of GATEWAY_VECTORS.heartbeats) {
    it(`heartbeat: ${v.name}: ${v.outcome}`, async () => {
      const gw = await serve(() => vectorReply(v));
      try {
        const t = new GatewayTransport(gw.url, w.namespace, w.name, "tok", w.holder, w.fence, 2, w.workerId, w.runUid);
        const r = await t.renew(null, null);
        assert.equal(r.ok ? "confirmed" : r.lost ? "lost" : "unconfirmed", v.outcome);
        // An answer that is not the reply hands out no credential either.
        const sent = r.ok ? JSON.parse(v.text ?? JSON.stringify(v.json)) as { toolClaim?: unknown } : {};
        assert.equal(t.toolClaim !== null, Boolean(sent.toolClaim));
      } finally {
        await gw.close();
      }
    });
  }

  for (const v of GATEWAY_VECTORS.claims) {
    it(`claim: ${v.name}: ${v.claim ? "the claim reply" : "not the claim reply (no answer, not refused)"}`, async () => {
      const gw = await serve(() => vectorReply(v));
      try {
        const claimed = claimRun(gw.url, w.namespace, w.name, "tok", null);
        if (v.claim) {
          const doc = v.json as Record<string, unknown>;
          const reply = await claimed;
          assert.deepEqual([reply.holder, reply.fence, reply.attempt, reply.idempotencyKey],
            [doc.holder, doc.fence, doc.attempt, doc.idempotencyKey]);
          assert.deepEqual(reply.payload, doc.payload ?? {});
        } else {
          await assert.rejects(claimed, (err: Error) => err instanceof TetherWorkerError && !(err instanceof ClaimRefused)
            && /not the gateway's claim reply/.test(err.message));
        }
      } finally {
        await gw.close();
      }
    });
  }
});
