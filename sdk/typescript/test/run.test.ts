import assert from "node:assert/strict";
import { afterEach, describe, it } from "node:test";

import { LeaseLost, OwnershipUnknown, ResultInvalid, StopRequested, ToolTimeout } from "../src/errors.js";
import type { LogLevel } from "../src/log.js";
import { NO_SIGNALS } from "../src/protocol.js";
import { WorkerRun } from "../src/run.js";
import { Unanswered, confirmed, unconfirmed } from "../src/transport.js";
import { FakeClock, FakeTransport, serve, settle, type FakeServer, type Reply } from "./fakes.js";

const runs: WorkerRun[] = [];

afterEach(async () => {
  for (const run of runs.splice(0)) await run.close();
});

interface Made {
  run: WorkerRun;
  clock: FakeClock;
  transport: FakeTransport;
  logs: { level: LogLevel; event: unknown }[];
}

/** A run with L = 10 s (margin 1 s) and R = 2 s, not started. */
function make(prepare: (t: FakeTransport) => void = () => {}): Made {
  const clock = new FakeClock();
  const transport = new FakeTransport();
  prepare(transport);
  const logs: { level: LogLevel; event: unknown }[] = [];
  const run = new WorkerRun({
    name: "job", namespace: "ns", holder: "job-a1", fence: 1, attempt: 1,
    leaseDurationSeconds: 10, renewIntervalSeconds: 2, transport, clock,
    logger: (level, _message, fields) => logs.push({ level, event: fields.event }),
  });
  runs.push(run);
  return { run, clock, transport, logs };
}

async function started(prepare?: (t: FakeTransport) => void): Promise<Made> {
  const made = make(prepare);
  await made.run.start();
  return made;
}

const noAnswer = (): Unanswered => new Unanswered("no answer");

describe("ownership", () => {
  it("is unknown before the first renewal, owned after it", async () => {
    const { run } = make();
    assert.equal(run.ownership, "unknown");
    await run.start();
    assert.equal(run.ownership, "owned");
  });

  it("start renews exactly once before returning", async () => {
    const { transport } = await started();
    assert.equal(transport.renewals.length, 1);
  });

  it("stays unknown when the first renewal gets no answer", async () => {
    const { run } = await started((t) => t.renewScript.push(noAnswer()));
    assert.equal(run.ownershipUnknown, true);
    assert.throws(() => run.ensureOwner(), OwnershipUnknown);
  });

  it("goes owned → unknown → lost", async () => {
    const { run, clock, transport } = await started((t) => t.renewScript.push(confirmed(null), noAnswer(), noAnswer(),
      noAnswer(), noAnswer(), unconfirmed("another holder", true)));
    assert.equal(run.ownership, "owned");
    await clock.advance(2); // renewal 2: no answer
    await clock.advance(2); // 3
    await clock.advance(2); // 4
    await clock.advance(2); // 5: 8 s since the last confirmed start; L − margin is 9 s
    assert.equal(transport.renewals.length, 5);
    assert.equal(run.ownership, "owned");
    await clock.advance(1.5);
    assert.equal(run.ownership, "unknown");
    await clock.advance(0.5); // renewal 6: the API server says the lease is another's
    assert.equal(run.ownership, "lost");
    assert.equal(run.lost, true);
    assert.equal(run.heartbeating, false);
    await clock.advance(10);
    assert.equal(transport.renewals.length, 6, "a lost run renews no more");
  });

  it("confirmedAt is the start of the renewal, not its answer", async () => {
    const made = make();
    let answer: (r: ReturnType<typeof confirmed>) => void = () => {};
    made.transport.renewScript.push(() => new Promise((resolve) => { answer = resolve; }));
    const starting = made.run.start();
    await settle();
    await made.clock.advance(5); // the answer takes 5 s
    answer(confirmed(null));
    await starting;
    made.transport.renewScript.push(noAnswer(), noAnswer());
    await made.clock.advance(3.5); // 8.5 s after the request started: still owned (9 s)
    assert.equal(made.run.owned, true);
    await made.clock.advance(0.6);
    assert.equal(made.run.ownershipUnknown, true);
  });

  it("refused renewals (RBAC 403, 5xx) are unconfirmed, not lost", async () => {
    const { run, clock, logs } = await started((t) => t.renewScript.push(confirmed(null), unconfirmed("renewal refused: 403"),
      unconfirmed("renewal refused: 503")));
    await clock.advance(2);
    await clock.advance(2);
    assert.equal(run.lost, false);
    assert.ok(logs.filter((l) => l.event === "heartbeat_refused").length === 2);
  });

  it("an unexpected failure does not stop the heartbeat", async () => {
    const { run, clock, transport, logs } = await started((t) => t.renewScript.push(confirmed(null), new SyntaxError("<html>")));
    await clock.advance(2);
    assert.ok(logs.some((l) => l.event === "heartbeat_error" && l.level === "error"));
    await clock.advance(2);
    assert.equal(transport.renewals.length, 3);
    assert.equal(run.owned, true);
  });

  it("ensureOwner puts stop first, then lost, then unknown", async () => {
    const stopSignal = { ...NO_SIGNALS, stop: true, reason: "budget exceeded" };
    const { run, clock } = await started((t) => t.renewScript.push(confirmed(stopSignal), unconfirmed("gone", true)));
    assert.throws(() => run.ensureOwner(), (err: Error) => err instanceof StopRequested && err.message === "budget exceeded");
    assert.equal(run.signals.stop, true);
    await clock.advance(2);
    assert.equal(run.lost, true);
    assert.throws(() => run.ensureOwner(), StopRequested);
    const plain = await started((t) => t.renewScript.push(unconfirmed("gone", true)));
    assert.throws(() => plain.run.ensureOwner(), LeaseLost);
  });

  it("keeps the last good signals when a renewal carries malformed ones", async () => {
    const paused = { ...NO_SIGNALS, paused: true };
    const { run, clock } = await started((t) => t.renewScript.push(confirmed(paused), confirmed(null)));
    await clock.advance(2);
    assert.equal(run.signals.paused, true);
  });

  it("close stops the heartbeat at once, after one last renewal that reports usage", async () => {
    const { run, clock, transport } = await started();
    run.reportUsage({ cents: 7, tokens: 3 });
    await run.close();
    await clock.advance(10);
    assert.equal(transport.renewals.length, 2);
    assert.deepEqual(transport.renewals[1]?.usage, { cents: 7, tokens: 3 });
    assert.equal(transport.closed, true);
    await run.close();
    assert.equal(transport.renewals.length, 2);
  });

  it("close sends no last renewal once the run is lost", async () => {
    const { run, transport } = await started((t) => t.renewScript.push(unconfirmed("gone", true)));
    run.reportUsage({ cents: 7 });
    await run.close();
    assert.equal(transport.renewals.length, 1);
  });

  it("close sends no last renewal once published", async () => {
    const { run, transport } = await started();
    await run.complete({ x: 1 });
    const before = transport.renewals.length;
    await run.close();
    assert.equal(transport.renewals.length, before);
  });

  it("works with await using", async () => {
    const made = make();
    {
      await using run = await made.run.start();
      assert.equal(run.owned, true);
    }
    assert.equal(made.transport.closed, true);
  });
});

describe("checkpoints and usage", () => {
  it("ride on the next renewal", async () => {
    const { run, clock, transport } = await started();
    run.reportUsage({ cents: 3, tokens: 900 });
    await run.checkpoint("row-1");
    assert.equal(transport.renewals.length, 1);
    await clock.advance(2);
    assert.deepEqual(transport.renewals[1], { checkpoint: "row-1", usage: { cents: 3, tokens: 900 } });
    assert.equal(run.checkpointCursor, "row-1");
  });

  it("refuses a cursor over 1024 characters and keeps the previous one", async () => {
    const { run, clock, transport } = await started();
    await run.checkpoint("row-1");
    await assert.rejects(run.checkpoint("x".repeat(1025)), RangeError);
    await clock.advance(2);
    assert.equal(transport.renewals[1]?.checkpoint, "row-1");
    assert.equal(run.checkpointCursor, "row-1");
  });

  it("a flush renews now", async () => {
    const { run, transport } = await started();
    await run.checkpoint("row-2", { flush: true });
    assert.deepEqual(transport.renewals[1], { checkpoint: "row-2", usage: null });
  });

  it("renewals never overlap", async () => {
    const made = await started();
    let inFlight = 0;
    let most = 0;
    const slow = async (): Promise<ReturnType<typeof confirmed>> => {
      inFlight += 1;
      most = Math.max(most, inFlight);
      await settle();
      inFlight -= 1;
      return confirmed(null);
    };
    made.transport.renewScript.push(slow, slow, slow);
    await Promise.all([made.run.checkpoint("a", { flush: true }), made.run.renew(), made.run.checkpoint("b", { flush: true })]);
    assert.equal(most, 1);
  });

  const refused: [string, { cents: number; tokens?: number }][] = [
    ["negative", { cents: -1 }],
    ["decreasing", { cents: 4 }],
    ["too large", { cents: 1e11 + 1 }],
    ["too many tokens", { cents: 10, tokens: 1e14 + 1 }],
    ["fractional", { cents: 5.5 }],
  ];
  for (const [what, report] of refused) {
    it(`refuses a ${what} report and keeps the previous one`, async () => {
      const { run } = await started();
      run.reportUsage({ cents: 5, tokens: 0 });
      assert.throws(() => run.reportUsage(report), RangeError);
      run.reportUsage({ cents: 5 });
    });
  }

  it("counts its own usage against the caps", async () => {
    const caps = { ...NO_SIGNALS, capCents: 100, baseCents: 30, capTokens: 1000 };
    const { run } = await started((t) => t.renewScript.push(confirmed(caps)));
    assert.equal(run.signals.capRemainingCents, 70);
    run.reportUsage({ cents: 20, tokens: 400 });
    assert.equal(run.signals.capRemainingCents, 50);
    assert.equal(run.signals.capRemainingTokens, 600);
  });
});

describe("approvals", () => {
  const decided = (decisions: Record<string, { decision: "Approve" | "Deny" | "TimedOut"; reason?: string; approver?: string }>) =>
    confirmed({ ...NO_SIGNALS, decisions: Object.fromEntries(Object.entries(decisions).map(([name, d]) =>
      [name, { decision: d.decision, reason: d.reason ?? null, approver: d.approver ?? null }])) });

  const malformed: [string, string, string, number | null][] = [
    ["an upper-case name", "Refund", "", null],
    ["a reserved name", "result", "", null],
    ["details over 4096 characters", "refund", "x".repeat(4097), null],
    ["a zero timeout", "refund", "", 0],
  ];
  for (const [what, name, details, timeout] of malformed) {
    it(`refuses ${what} before sending anything`, async () => {
      const { run, transport } = await started();
      await assert.rejects(run.requestApproval(name, details, timeout), (err: Error) =>
        err instanceof RangeError && err.message.startsWith("approval request refused: "));
      await run.renew();
      assert.deepEqual(transport.asked.at(-1), []);
    });
  }

  it("rides on every renewal until decided, renewing every 2 s while waiting", async () => {
    const { run, clock, transport, logs } = await started((t) => t.renewScript.push(confirmed(null), confirmed(null),
      confirmed(null), decided({ refund: { decision: "Deny", reason: "too much", approver: "alice" } })));
    const decision = await run.requestApproval("refund", "42 EUR", 600);
    assert.deepEqual(decision, { decision: "Deny", reason: "too much", approver: "alice", approved: false });
    assert.equal(transport.renewals.length, 4);
    for (const asked of transport.asked.slice(1)) {
      assert.deepEqual(asked, [{ name: "refund", details: "42 EUR", timeoutSeconds: 600 }]);
    }
    assert.ok(clock.sleeps.length >= 1 && clock.sleeps.every((s) => s === 2));
    assert.deepEqual(logs.map((l) => l.event).filter((e) => String(e).startsWith("approval")),
      ["approval_requested", "approval_decided"]);
    await clock.advance(2);
    assert.deepEqual(transport.asked.at(-1), [{ name: "refund", details: "42 EUR", timeoutSeconds: 600 }],
      "a decided request is still the attempt's, and still sent");
  });

  it("asking again for a decided name resolves with that decision and asks nothing new", async () => {
    const { run, transport } = await started((t) => t.renewScript.push(decided({ refund: { decision: "Approve" } })));
    assert.equal((await run.requestApproval("refund")).approved, true);
    assert.equal((await run.requestApproval("refund", "other details", 5)).approved, true);
    assert.deepEqual(transport.asked.at(-1), [{ name: "refund", details: "", timeoutSeconds: null }]);
  });

  it("an attempt makes at most 20 requests", async () => {
    const names = Array.from({ length: 20 }, (_, i) => `step-${i}`);
    const { run, transport } = await started((t) =>
      t.renewScript.push(decided(Object.fromEntries(names.map((n) => [n, { decision: "Approve" as const }])))));
    for (const name of names) await run.requestApproval(name);
    await assert.rejects(run.requestApproval("step-20"), /at most 20 requests/);
    assert.equal((await run.requestApproval("step-3")).decision, "Approve");
    assert.equal(transport.asked.at(-1)?.length, 20);
  });

  it("the attempt's requests stay within 64 KiB (UTF-8)", async () => {
    const names = ["a", "b", "c", "d", "e", "f", "g", "h", "i"];
    const { run, transport } = await started((t) =>
      t.renewScript.push(decided(Object.fromEntries(names.map((n) => [n, { decision: "Approve" as const }])))));
    // 4096 three-byte characters: 12 KiB each; the sixth would pass 64 KiB.
    for (const name of names.slice(0, 5)) await run.requestApproval(name, "€".repeat(4096));
    await assert.rejects(run.requestApproval("f", "€".repeat(4096)), /would exceed 65536 bytes/);
    assert.equal(transport.asked.at(-1)?.length, 5);
  });

  it("rejects with LeaseLost when the run is lost while waiting", async () => {
    const { run } = await started((t) => t.renewScript.push(confirmed(null), confirmed(null), unconfirmed("gone", true)));
    await assert.rejects(run.requestApproval("refund"), LeaseLost);
  });

  it("rejects with StopRequested when told to stop while waiting", async () => {
    const { run } = await started((t) => t.renewScript.push(confirmed(null), confirmed({ ...NO_SIGNALS, stop: true, reason: "budget" })));
    await assert.rejects(run.requestApproval("refund"), (err: Error) => err instanceof StopRequested && err.message === "budget");
  });

  it("rejects with OwnershipUnknown when no renewal is confirmed for too long", async () => {
    const { run } = await started((t) => t.renewScript.push(confirmed(null), ...Array.from({ length: 20 }, noAnswer)));
    await assert.rejects(run.requestApproval("refund"), OwnershipUnknown);
  });

  it("a decision the heartbeat brings ends the wait at once, not at the next poll", async () => {
    const transport = new FakeTransport();
    transport.renewScript.push(confirmed(null), confirmed(null), decided({ refund: { decision: "Approve" } }));
    const run = new WorkerRun({ name: "job", namespace: "ns", holder: "job-a1", fence: 1, attempt: 1,
      leaseDurationSeconds: 10, renewIntervalSeconds: 0.02, transport, logger: () => {} });
    runs.push(run);
    await run.start();
    const began = performance.now();
    assert.equal((await run.requestApproval("refund", "", null, { pollMs: 60_000 })).approved, true);
    assert.ok(performance.now() - began < 5_000);
  });

  it("closing the run ends the wait with StopRequested", async () => {
    const run = new WorkerRun({ name: "job", namespace: "ns", holder: "job-a1", fence: 1, attempt: 1,
      leaseDurationSeconds: 10, renewIntervalSeconds: 2, transport: new FakeTransport(), logger: () => {} });
    await run.start();
    const outcome = assert.rejects(run.requestApproval("refund", "", null, { pollMs: 10 }), StopRequested);
    await new Promise((resolve) => setTimeout(resolve, 50));
    await run.close();
    await outcome;
  });
});

describe("publishing", () => {
  it("renews first (flushing usage), then publishes once, then stops heartbeating", async () => {
    const { run, clock, transport } = await started();
    run.reportUsage({ cents: 7 });
    await run.complete({ steps: 3 });
    assert.deepEqual(transport.renewals[1], { checkpoint: null, usage: { cents: 7, tokens: 0 } });
    assert.deepEqual(transport.publications, [{ field: "result", value: { steps: 3 } }]);
    await clock.advance(10);
    assert.equal(transport.renewals.length, 2);
  });

  it("fail publishes an error with code and message", async () => {
    const { run, transport } = await started();
    await run.fail("Boom", "it broke");
    assert.deepEqual(transport.publications, [{ field: "error", value: { code: "Boom", message: "it broke" } }]);
  });

  it("a lost run publishes nothing", async () => {
    const { run, transport } = await started((t) => t.renewScript.push(unconfirmed("gone", true)));
    await assert.rejects(run.complete({ x: 1 }), LeaseLost);
    assert.equal(transport.publications.length, 0);
  });

  it("the final renewal showing the run lost publishes nothing", async () => {
    const { run, transport } = await started((t) => t.renewScript.push(confirmed(null), unconfirmed("gone", true)));
    await assert.rejects(run.complete({ x: 1 }), LeaseLost);
    assert.equal(transport.publications.length, 0);
  });

  it("a refused publication (422 without causes, 409, 404) is lost ownership", async () => {
    const { run, transport } = await started((t) => t.publishScript.push(false));
    await assert.rejects(run.complete({ x: 1 }), LeaseLost);
    assert.equal(run.lost, true);
    assert.equal(transport.recordedCalls, 0, "no earlier try went unanswered: nothing to look up");
  });

  it("a refused value (422 with causes) is ResultInvalid: still the owner, may publish again", async () => {
    const { run, transport } = await started((t) => t.publishScript.push(new ResultInvalid("not an object",
      [{ field: "status.result" }])));
    await assert.rejects(run.complete({ x: 1 }), (err: Error) => err instanceof ResultInvalid && err.causes.length === 1);
    assert.equal(run.lost, false);
    assert.equal(run.owned, true);
    assert.equal(run.heartbeating, true);
    await run.complete({ x: 2 });
    assert.deepEqual(transport.publications.map((p) => p.value), [{ x: 1 }, { x: 2 }]);
  });

  it("retries an unanswered publication with doubling delays", async () => {
    const { run, clock, transport } = await started((t) => t.publishScript.push(noAnswer(), noAnswer(), noAnswer(), true));
    await run.complete({ x: 1 });
    assert.deepEqual(clock.sleeps, [0.5, 1, 2]);
    assert.equal(transport.publications.length, 4);
  });

  it("waits at least what Retry-After asks", async () => {
    const { run, clock } = await started((t) => t.publishScript.push(new Unanswered("503", 503, 3),
      new Unanswered("429", 429, 0.2), true));
    await run.complete({ x: 1 });
    assert.deepEqual(clock.sleeps, [3, 1]);
  });

  it("gives up with OwnershipUnknown at the lease deadline", async () => {
    const { run, clock } = await started((t) => {
      t.renewScript.push(confirmed(null), noAnswer(), noAnswer(), noAnswer(), noAnswer(), noAnswer(), noAnswer());
      for (let i = 0; i < 20; i++) t.publishScript.push(noAnswer());
    });
    await assert.rejects(run.complete({ x: 1 }), OwnershipUnknown);
    // confirmed at t0, deadline t0 + 10: 0.5 + 1 + 2 + 4 = 7.5 s slept; the next 5 s would pass it.
    assert.deepEqual(clock.sleeps, [0.5, 1, 2, 4]);
    assert.equal(run.lost, false);
  });

  it("the renewal right before publishing confirms: the deadline counts from it", async () => {
    const { run, clock } = await started((t) => {
      // start; the heartbeat gets no answer, except the renewal before publishing (the third)
      t.renewScript.push(confirmed(null), noAnswer(), confirmed(null));
      for (let i = 0; i < 20; i++) t.renewScript.push(noAnswer());
      for (let i = 0; i < 20; i++) t.publishScript.push(noAnswer());
    });
    await clock.advance(5);
    await assert.rejects(run.complete({ x: 1 }), OwnershipUnknown);
    // confirmed again at t0 + 5 (the renewal before publishing), deadline t0 + 15: 0.5 + 1 + 2 + 4 s
    // slept; from the first confirmation (t0 + 10) it would have been 0.5 + 1 + 2.
    assert.deepEqual(clock.sleeps, [0.5, 1, 2, 4]);
  });

  it("a try that waited TP while the heartbeat confirmed is retried: the deadline is read after it", async () => {
    const made = await started();
    const slowNoAnswer = async (): Promise<boolean> => {
      for (let i = 0; i < 30; i++) { // TP without an answer; the heartbeat confirmed every second
        await made.clock.advance(1);
        assert.equal(await made.run.renew(), true);
      }
      throw noAnswer();
    };
    made.transport.publishScript.push(slowNoAnswer, true);
    await made.run.complete({ x: 1 });
    assert.equal(made.transport.publications.length, 2);
    assert.deepEqual(made.clock.sleeps, [0.5]);
  });

  it("the deadline follows the heartbeat: retries go on while it confirms ownership", async () => {
    const made = await started();
    // The heartbeat renews (confirmed) while each try goes unanswered.
    const renewedNoAnswer = async (): Promise<boolean> => {
      assert.equal(await made.run.renew(), true);
      throw noAnswer();
    };
    for (let i = 0; i < 8; i++) made.transport.publishScript.push(renewedNoAnswer);
    await made.run.complete({ x: 1 });
    // 27.5 s of backoff: far past the first deadline (t0 + 10 s).
    assert.deepEqual(made.clock.sleeps, [0.5, 1, 2, 4, 5, 5, 5, 5]);
    assert.equal(made.transport.publications.length, 9);
    assert.equal(made.run.lost, false);
  });

  /** A try that lets the heartbeat renew (and hear the run is lost) before it is answered with `answer`;
   * the renewal right before publishing is confirmed. */
  function heartbeatLosesThenAnswers(made: Made, answer: Unanswered): () => Promise<boolean> {
    made.transport.renewScript.push(confirmed(null), unconfirmed("another holder", true));
    return async () => {
      await made.clock.advance(2);
      assert.equal(made.run.lost, true);
      throw answer;
    };
  }

  const refusedBeforeAnyWrite: [string, Unanswered][] = [
    ["401", new Unanswered("401", 401)],
    ["RBAC 403", new Unanswered("403", 403)],
    ["429", new Unanswered("429", 429, 1)],
    ["400", new Unanswered("400", 400)],
  ];
  for (const [what, answer] of refusedBeforeAnyWrite) {
    it(`stops retrying once the heartbeat hears the run is lost (after a ${what})`, async () => {
      const made = await started();
      made.transport.publishScript.push(heartbeatLosesThenAnswers(made, answer));
      await assert.rejects(made.run.complete({ x: 1 }), LeaseLost);
      assert.equal(made.transport.publications.length, 1, "no try after the loss");
      assert.equal(made.transport.recordedCalls, 0, "nothing was written: nothing to look up");
    });
  }

  const mayHaveLanded: [string, Unanswered][] = [["no answer", noAnswer()], ["a 503", new Unanswered("503", 503)]];
  for (const [what, answer] of mayHaveLanded) {
    for (const landed of [true, false]) {
      it(`lost after a try with ${what}: retries once and looks it up (${landed ? "landed" : "did not land"})`, async () => {
        const made = await started();
        made.transport.publishScript.push(heartbeatLosesThenAnswers(made, answer), false);
        made.transport.recordedScript.push(landed);
        const publishing = made.run.complete({ x: 1 });
        if (landed) await publishing;
        else await assert.rejects(publishing, LeaseLost);
        assert.equal(made.transport.publications.length, 2);
        assert.equal(made.transport.recordedCalls, 1);
      });
    }
  }

  it("a retry refused after a try with no answer looks the publication up: recorded means published", async () => {
    const { run, transport, logs } = await started((t) => {
      t.publishScript.push(noAnswer(), false);
      t.recordedScript.push(true);
    });
    await run.complete({ x: 1 });
    assert.equal(transport.recordedCalls, 1);
    assert.equal(run.lost, false);
    assert.ok(logs.some((l) => l.event === "result_published"));
  });

  it("a retry refused after a try with no answer, not recorded, is lost", async () => {
    const { run, transport } = await started((t) => {
      t.publishScript.push(noAnswer(), false);
      t.recordedScript.push(false);
    });
    await assert.rejects(run.complete({ x: 1 }), LeaseLost);
    assert.equal(transport.recordedCalls, 1);
  });

  it("keeps heartbeating while the publication is unanswered", async () => {
    const made = await started();
    let answer: (ok: boolean) => void = () => {};
    made.transport.publishScript.push(() => new Promise((resolve) => { answer = resolve; }));
    const publishing = made.run.complete({ x: 1 });
    await settle();
    const before = made.transport.renewals.length;
    await made.clock.advance(2);
    await made.clock.advance(2);
    assert.equal(made.transport.renewals.length, before + 2);
    answer(true);
    await publishing;
    await made.clock.advance(4);
    assert.equal(made.transport.renewals.length, before + 2);
  });
});

describe("side effects", () => {
  let server: FakeServer | null = null;

  afterEach(async () => {
    await server?.close();
    server = null;
  });

  async function receiver(reply: Reply): Promise<string> {
    server = await serve(() => reply);
    return `${server.url}/effect`;
  }

  it("headers name the operation (stable across attempts) and the fence", async () => {
    const { run } = await started();
    assert.deepEqual(run.effectHeaders("capture"), { "Idempotency-Key": "ns/job:capture", "X-Execution-Fence": "1" });
  });

  it("sends JSON with the fenced headers", async () => {
    const url = await receiver({ status: 200, body: {} });
    const { run } = await started();
    const resp = await run.effect(url, { operation: "step-0", body: { step: 0 }, headers: { "Idempotency-Key": "mine" } });
    assert.equal(resp.status, 200);
    const seen = server?.seen[0];
    assert.equal(seen?.method, "POST");
    assert.equal(seen?.headers["idempotency-key"], "ns/job:step-0");
    assert.equal(seen?.headers["x-execution-fence"], "1");
    assert.equal(seen?.headers["content-type"], "application/json");
    assert.equal(seen?.body, '{"step":0}');
  });

  it("refuses to send unless ownership is confirmed", async () => {
    const url = await receiver({ status: 200 });
    const { run } = await started((t) => t.renewScript.push(noAnswer()));
    await assert.rejects(run.effect(url, { operation: "x" }), OwnershipUnknown);
    assert.equal(server?.seen.length, 0);
  });

  it("a call that does not answer in time is ToolTimeout", async () => {
    const url = await receiver("hang");
    const { run } = await started();
    await assert.rejects(run.effect(url, { operation: "x", timeoutMs: 200 }), ToolTimeout);
  });
});
