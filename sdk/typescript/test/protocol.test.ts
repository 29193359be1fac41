import assert from "node:assert/strict";
import fs from "node:fs";
import { describe, it } from "node:test";

import {
  ANN_CHECKPOINT,
  ANN_REQUESTS,
  ANN_SIGNALS,
  ANN_USAGE,
  NO_SIGNALS,
  capRemaining,
  controlSignals,
  fencedByPolicy,
  fencedPatch,
  holds,
  invalidCauses,
  jsonEqual,
  leaseSignals,
  microTime,
  nextDelay,
  ownership,
  parseLease,
  parseSignals,
  publicationRecorded,
  refusesValue,
  renewal,
  requestRefusal,
  requestTimeout,
  requestsAnnotation,
  retryAfterSeconds,
  safetyMargin,
  signalsFromRemaining,
  usageAnnotation,
  validCursor,
  validReport,
  type ApprovalRequest,
  type LeaseObject,
  type RunObject,
} from "../src/protocol.js";

function lease(holder: string | null, fence: number | null, uid: string | null = "uid-1"): LeaseObject {
  return {
    metadata: {
      resourceVersion: "7",
      annotations: { "tether.dev/fence": String(fence) },
      ownerReferences: uid === null ? [] : [{ kind: "WorkerRun", uid, controller: true }],
    },
    spec: { holderIdentity: holder, leaseTransitions: fence },
  };
}

describe("timing", () => {
  const cases: [number, number][] = [[5, 1], [10, 1], [30, 3], [90, 9]];
  for (const [duration, margin] of cases) {
    it(`margin of a ${duration}s lease is ${margin}s`, () => assert.equal(safetyMargin(duration), margin));
  }
  const timeouts: [number, number][] = [[0.2, 1], [1, 1], [2, 2], [30, 10]];
  for (const [interval, timeout] of timeouts) {
    it(`request timeout for R=${interval}s is ${timeout}s`, () => assert.equal(requestTimeout(interval), timeout));
  }
  const states: [boolean, number, number, string][] = [
    [false, 0, -Infinity, "unknown"], // nothing confirmed yet
    [false, 5, 0, "owned"],
    [false, 9, 0, "owned"], // at L − margin exactly: still owned
    [false, 9.01, 0, "unknown"],
    [true, 1, 0, "lost"],
  ];
  for (const [lost, now, confirmedAt, expected] of states) {
    it(`ownership lost=${lost} now=${now} confirmedAt=${confirmedAt} is ${expected}`, () =>
      assert.equal(ownership(lost, now, confirmedAt, 10, 1), expected));
  }
  it("publish delays double up to 5 s", () => {
    const seen: number[] = [];
    for (let d = 0.5, i = 0; i < 6; i++, d = nextDelay(d)) seen.push(d);
    assert.deepEqual(seen, [0.5, 1, 2, 4, 5, 5]);
  });
  const retryAfter: [string | null, number][] = [[null, 0], ["", 0], ["3", 3], [" 2.5 ", 2.5], ["-1", 0],
    ["Wed, 21 Oct 2015 07:28:00 GMT", 0]];
  for (const [header, seconds] of retryAfter) {
    it(`Retry-After ${JSON.stringify(header)} is ${seconds}s`, () => assert.equal(retryAfterSeconds(header), seconds));
  }
  it("MicroTime has microseconds, UTC, Z", () =>
    assert.equal(microTime(new Date(Date.UTC(2026, 0, 2, 3, 4, 5, 678))), "2026-01-02T03:04:05.678000Z"));
});

describe("holds", () => {
  const cases: [string, LeaseObject | null, string | null, boolean][] = [
    ["same holder, fence and run", lease("r-a1", 1), "uid-1", true],
    ["no uid asked", lease("r-a1", 1, null), null, true],
    ["another holder", lease("r-a2", 1), "uid-1", false],
    ["another fence", lease("r-a1", 2), "uid-1", false],
    ["a namesake's lease", lease("r-a1", 1, "uid-2"), "uid-1", false],
    ["no owner reference", lease("r-a1", 1, null), "uid-1", false],
    ["cleared lease", lease(null, null), "uid-1", false],
    ["no lease", null, "uid-1", false],
  ];
  for (const [what, l, uid, expected] of cases) {
    it(what, () => assert.equal(holds(l, "r-a1", 1, uid), expected));
  }
  it("ignores owner references that are not the WorkerRun controller", () => {
    const l = lease("r-a1", 1, null);
    l.metadata!.ownerReferences = [{ kind: "WorkerRun", uid: "uid-1", controller: false }, { kind: "Pod", uid: "uid-1", controller: true }];
    assert.equal(holds(l, "r-a1", 1, "uid-1"), false);
  });
});

describe("renewal body", () => {
  const now = new Date(Date.UTC(2026, 10, 30, 12, 0, 0, 1));
  it("sets renewTime and keeps everything else, the resourceVersion included", () => {
    const before = lease("r-a1", 1);
    const body = renewal(before, now);
    assert.equal(body.spec?.renewTime, "2026-11-30T12:00:00.001000Z");
    assert.equal(body.metadata?.resourceVersion, "7");
    assert.deepEqual(body.metadata?.annotations, { "tether.dev/fence": "1" });
    assert.equal(before.spec?.renewTime, undefined, "the Lease last seen is not changed");
  });
  it("carries the checkpoint and the usage as annotations", () => {
    const body = renewal(lease("r-a1", 1), now, "row-40", { cents: 12, tokens: 900 });
    assert.equal(body.metadata?.annotations?.[ANN_CHECKPOINT], "row-40");
    assert.equal(body.metadata?.annotations?.[ANN_USAGE], '{"cents":12,"tokens":900}');
  });
  it("carries extra annotations (the approval requests)", () => {
    const body = renewal(lease("r-a1", 1), now, null, null, { [ANN_REQUESTS]: "{}" });
    assert.deepEqual(body.metadata?.annotations, { "tether.dev/fence": "1", [ANN_REQUESTS]: "{}" });
  });
  it("usage annotation is compact JSON", () => assert.equal(usageAnnotation({ cents: 0, tokens: 5 }), '{"cents":0,"tokens":5}'));
});

describe("fenced patch", () => {
  it("tests uid, fence and holder before adding the value", () => {
    assert.deepEqual(fencedPatch("r-a2", 3, "result", { ok: true }, "uid-1"), [
      { op: "test", path: "/metadata/uid", value: "uid-1" },
      { op: "test", path: "/status/fence", value: 3 },
      { op: "test", path: "/status/holder", value: "r-a2" },
      { op: "add", path: "/status/result", value: { ok: true } },
    ]);
  });
  it("without a uid, tests fence and holder only", () => {
    assert.deepEqual(fencedPatch("r-a1", 1, "error", { code: "X", message: "" }).map((op) => op.path),
      ["/status/fence", "/status/holder", "/status/error"]);
  });
});

describe("usage reports", () => {
  const cases: [string, { cents: number; tokens: number }, { cents: number; tokens: number } | null, string | null][] = [
    ["first report", { cents: 5, tokens: 10 }, null, null],
    ["same again", { cents: 5, tokens: 10 }, { cents: 5, tokens: 10 }, null],
    ["growing", { cents: 6, tokens: 10 }, { cents: 5, tokens: 10 }, null],
    ["zero", { cents: 0, tokens: 0 }, null, null],
    ["at the bounds", { cents: 1e11, tokens: 1e14 }, null, null],
    ["negative cents", { cents: -1, tokens: 0 }, null, "negative usage"],
    ["negative tokens", { cents: 0, tokens: -1 }, null, "negative usage"],
    ["too many cents", { cents: 1e11 + 1, tokens: 0 }, null, "implausibly large usage"],
    ["too many tokens", { cents: 0, tokens: 1e14 + 1 }, null, "implausibly large usage"],
    ["cents decreased", { cents: 4, tokens: 10 }, { cents: 5, tokens: 10 }, "usage decreased; reports are cumulative"],
    ["tokens decreased", { cents: 5, tokens: 9 }, { cents: 5, tokens: 10 }, "usage decreased; reports are cumulative"],
    ["fractional", { cents: 1.5, tokens: 0 }, null, "cents and tokens must be integers"],
    ["NaN", { cents: Number.NaN, tokens: 0 }, null, "cents and tokens must be integers"],
    ["infinite", { cents: 0, tokens: Infinity }, null, "cents and tokens must be integers"],
  ];
  for (const [what, report, previous, why] of cases) {
    it(what, () => assert.equal(validReport(report, previous), why));
  }
});

describe("checkpoint cursors", () => {
  const cases: [string, string, boolean][] = [
    ["empty", "", true],
    ["1024 characters", "x".repeat(1024), true],
    ["1024 characters of two UTF-16 units each", "😀".repeat(1024), true],
    ["1025 characters", "x".repeat(1025), false],
  ];
  for (const [what, cursor, ok] of cases) {
    it(`${what}: ${ok ? "accepted" : "refused"}`, () => assert.equal(validCursor(cursor) === null, ok));
  }
});

describe("signals", () => {
  const parsed: [string, string | undefined, object | null][] = [
    ["absent: defaults", undefined, NO_SIGNALS],
    ["empty: defaults", "", NO_SIGNALS],
    ["stop with reason", '{"stop":true,"reason":"budget"}', { ...NO_SIGNALS, stop: true, reason: "budget" }],
    ["caps and bases", '{"capCents":500,"baseCents":120,"capTokens":9,"paused":true}',
      { ...NO_SIGNALS, paused: true, capCents: 500, baseCents: 120, capTokens: 9 }],
    ["endsAt", '{"endsAt":"2026-12-01T00:00:00Z"}', { ...NO_SIGNALS, endsAt: "2026-12-01T00:00:00Z" }],
    ["unknown keys ignored", '{"stop":false,"later":1}', NO_SIGNALS],
    ["not JSON", "{stop", null],
    ["not an object", "[1]", null],
    ["stop not a boolean", '{"stop":"yes"}', null],
    ["cap not an integer", '{"capCents":1.5}', null],
    ["endsAt not a time", '{"endsAt":"soon"}', null],
    ["a Kueue eviction: yield with stopBy", '{"stop":true,"yield":true,"stopBy":"2026-12-03T12:00:30Z","reason":"evicted"}',
      { ...NO_SIGNALS, stop: true, yield: true, stopBy: "2026-12-03T12:00:30Z", reason: "evicted" }],
    ["yield not a boolean", '{"stop":true,"yield":"yes"}', null],
    ["stopBy not a time", '{"stop":true,"yield":true,"stopBy":"soon"}', null],
    ["decisions", '{"decisions":{"refund":{"decision":"Approve","approver":"alice"},"ship":{"decision":"TimedOut","reason":null}}}',
      { ...NO_SIGNALS, decisions: { refund: { decision: "Approve", reason: null, approver: "alice" },
        ship: { decision: "TimedOut", reason: null, approver: null } } }],
    ["a decision's unknown keys ignored", '{"decisions":{"a":{"decision":"Deny","reason":"no","at":1}}}',
      { ...NO_SIGNALS, decisions: { a: { decision: "Deny", reason: "no", approver: null } } }],
    ["decisions null", '{"stop":true,"decisions":null}', null],
    ["decisions not an object", '{"decisions":[]}', null],
    ["a decision not an object", '{"decisions":{"a":"Approve"}}', null],
    ["an unknown decision", '{"decisions":{"a":{"decision":"Maybe"}},"stop":true}', null],
    ["a decision's reason not a string", '{"decisions":{"a":{"decision":"Deny","reason":3}}}', null],
    ["a decision's approver not a string", '{"decisions":{"a":{"decision":"Deny","approver":true}}}', null],
  ];
  for (const [what, raw, expected] of parsed) {
    it(`parses ${what}`, () => assert.deepEqual(parseSignals(raw), expected));
  }
  it("reads them from the Lease annotation", () => {
    const l = lease("r-a1", 1);
    l.metadata!.annotations![ANN_SIGNALS] = '{"stop":true}';
    assert.equal(leaseSignals(l)?.stop, true);
    assert.deepEqual(leaseSignals(lease("r-a1", 1)), NO_SIGNALS);
  });
  const caps: [number | null, number, number, number | null][] = [[null, 0, 0, null], [500, 0, 0, 500], [500, 120, 30, 350],
    [100, 80, 30, -10]];
  for (const [cap, base, own, left] of caps) {
    it(`cap ${cap} − base ${base} − own ${own} = ${left}`, () => assert.equal(capRemaining(cap, base, own), left));
  }
  it("counts the attempt's own usage against the caps", () => {
    const s = controlSignals({ ...NO_SIGNALS, capCents: 500, baseCents: 100, capTokens: 50, endsAt: "2026-12-01T00:00:00Z" },
      { cents: 40, tokens: 20 });
    assert.deepEqual(s, { stop: false, yielding: false, stopBy: null, paused: false, reason: null,
      endsAt: new Date("2026-12-01T00:00:00Z"), capRemainingCents: 360, capRemainingTokens: 30 });
  });
  it("the gateway's remaining amounts keep counting later usage", () => {
    const s = signalsFromRemaining(false, true, null, 380, null, { cents: 120, tokens: 9 });
    assert.equal(controlSignals(s, { cents: 120, tokens: 9 }).capRemainingCents, 380);
    assert.equal(controlSignals(s, { cents: 200, tokens: 9 }).capRemainingCents, 300);
    assert.equal(controlSignals(s, null).capRemainingTokens, null);
    assert.equal(s.paused, true);
  });
});

describe("what counts as a Lease", () => {
  // Shared with the Python and Go SDKs' tests (sdk/vectors/leases.json).
  const vectors = JSON.parse(fs.readFileSync(new URL("../../../vectors/leases.json", import.meta.url), "utf8")) as {
    parseLease: { name: string; text?: string; json?: unknown; lease: boolean }[];
  };
  for (const v of vectors.parseLease) {
    it(`${v.lease ? "a Lease" : "not a Lease"}: ${v.name}`, () =>
      assert.equal(parseLease(v.text ?? JSON.stringify(v.json)) !== null, v.lease));
  }
});

describe("approval requests", () => {
  // Shared with the Go SDK's tests; generated with operator/tether/protocol.py's requests_annotation.
  const vectors = JSON.parse(fs.readFileSync(new URL("../../../vectors/approvals.json", import.meta.url), "utf8")) as {
    requestsAnnotation: { name: string; requests: ApprovalRequest[]; annotation: string }[];
  };
  for (const v of vectors.requestsAnnotation) {
    it(`the annotation is Python's, byte for byte: ${v.name}`, () => assert.equal(requestsAnnotation(v.requests), v.annotation));
  }
  const refused = /refused|name|details|timeoutSeconds|gate/;
  const cases: [string, string, string, number | null, boolean][] = [
    ["a plain request", "send-report", "POST it", 600, true],
    ["no timeout", "a", "", null, true],
    ["63 characters", "a".repeat(63), "", null, true],
    ["4096 astral characters (8192 UTF-16 units)", "a", "😀".repeat(4096), null, true],
    ["the longest timeout", "a", "", 31_536_000, true],
    ["64 characters", "a".repeat(64), "", null, false],
    ["upper case", "Refund", "", null, false],
    ["a trailing dash", "refund-", "", null, false],
    ["a trailing newline", "refund\n", "", null, false],
    ["empty", "", "", null, false],
    ["the run's start gate", "start", "", null, false],
    ["the run's result gate", "result", "", null, false],
    ["4097 characters of details", "a", "x".repeat(4097), null, false],
    ["a zero timeout", "a", "", 0, false],
    ["a fractional timeout", "a", "", 1.5, false],
    ["a timeout over a year", "a", "", 31_536_001, false],
  ];
  for (const [what, name, details, timeout, ok] of cases) {
    it(`${what}: ${ok ? "accepted" : "refused"}`, () => {
      const why = requestRefusal(name, details, timeout);
      if (ok) assert.equal(why, null);
      else assert.match(why ?? "", refused);
    });
  }
  it("says why a reserved name is refused", () =>
    assert.equal(requestRefusal("start", "", null), "'start' names a gate of the run itself (Start, Result), not a request"));
});

describe("answers", () => {
  const invalid = JSON.stringify({ kind: "Status", code: 422, reason: "Invalid",
    details: { causes: [{ field: "status.result", message: "must be of type object", reason: "FieldValueTypeInvalid" }] } });
  const testFailed = JSON.stringify({ kind: "Status", code: 422, reason: "Invalid", message: "the server rejected our request" });
  const causes: [string, unknown, number][] = [
    ["schema refusal (text)", invalid, 1],
    ["schema refusal (object)", JSON.parse(invalid), 1],
    ["failed test", testFailed, 0],
    ["empty causes", JSON.stringify({ details: { causes: [] } }), 0],
    ["not JSON", "<html>", 0],
    ["nothing", undefined, 0],
  ];
  for (const [what, body, n] of causes) {
    it(`422 ${what}: ${n} cause(s)`, () => assert.equal(invalidCauses(body).length, n));
  }
  it("keeps a cause's field, message and reason", () =>
    assert.deepEqual(invalidCauses(invalid), [{ field: "status.result", message: "must be of type object", reason: "FieldValueTypeInvalid" }]));
  const named: [string, "result" | "error", string[], boolean][] = [
    ["the field", "result", ["status.result"], true],
    ["a part of it", "result", ["status.result.steps"], true],
    ["an element of it", "result", ["status.result[0]"], true],
    ["the error's code", "error", ["status.error.code"], true],
    ["another field too", "result", ["metadata.annotations", "status.result"], true],
    ["the other published field", "result", ["status.error"], false],
    ["a field with the same prefix", "result", ["status.resultx"], false],
    ["another field", "result", ["metadata.annotations"], false],
    ["the status", "result", ["status"], false],
    ["no field", "result", [""], false],
    ["no causes", "result", [], false],
  ];
  for (const [what, field, fields, expected] of named) {
    it(`a 422 naming ${what} ${expected ? "refuses" : "does not refuse"} the ${field}`, () =>
      assert.equal(refusesValue(fields.map((f) => (f ? { field: f } : {})), field), expected));
  }
  const policy = "ValidatingAdmissionPolicy 'tether-worker-status-fencing' with binding 'tether-worker-status-fencing' denied request";
  const fenced: [number, string, boolean][] = [
    [403, policy, true],
    [403, 'workerruns.tether.dev "x" is forbidden: User "system:serviceaccount:ns:sa" cannot patch', false],
    [403, "ValidatingAdmissionPolicy 'someone-else' denied request", false],
    [422, policy, false],
  ];
  for (const [status, body, expected] of fenced) {
    it(`${status} ${body.slice(0, 40)}… is ${expected ? "" : "not "}the fencing policy`, () =>
      assert.equal(fencedByPolicy(status, body), expected));
  }
});

describe("publication recorded", () => {
  const value = { steps: 3, nested: { a: 1, b: [1, 2] } };
  const reordered = { nested: { b: [1, 2], a: 1 }, steps: 3 };
  const cases: [string, RunObject, "result" | "error", unknown, boolean][] = [
    ["still holder, same value (any key order)", { status: { holder: "r-a1", fence: 1, result: reordered } }, "result", value, true],
    ["still holder, another value", { status: { holder: "r-a1", fence: 1, result: { steps: 4 } } }, "result", value, false],
    ["still holder, nothing yet", { status: { holder: "r-a1", fence: 1 } }, "result", value, false],
    ["moved on, attempt Succeeded with the value", { status: { holder: null, fence: 2, result: value,
      attempts: [{ holder: "r-a1", fence: 1, outcome: "Succeeded" }] } }, "result", value, true],
    ["moved on, attempt Succeeded with another value", { status: { holder: null, fence: 2, result: { x: 1 },
      attempts: [{ holder: "r-a1", fence: 1, outcome: "Succeeded" }] } }, "result", value, false],
    ["moved on, attempt WorkerFailed (error)", { status: { holder: "r-a2", fence: 3,
      attempts: [{ holder: "r-a1", fence: 1, outcome: "WorkerFailed" }] } }, "error", { code: "X" }, true],
    ["moved on, attempt lost", { status: { holder: "r-a2", fence: 3,
      attempts: [{ holder: "r-a1", fence: 1, outcome: "LeaseLost" }] } }, "result", value, false],
    ["moved on, another attempt's record", { status: { holder: "r-a2", fence: 3, result: value,
      attempts: [{ holder: "r-a2", fence: 3, outcome: "Succeeded" }] } }, "result", value, false],
    ["no status", {}, "result", value, false],
  ];
  for (const [what, run, field, v, expected] of cases) {
    it(what, () => assert.equal(publicationRecorded(run, "r-a1", 1, field, v), expected));
  }
  const equal: [unknown, unknown, boolean][] = [[1, 1, true], [[1, 2], [2, 1], false], [{ a: 1 }, { a: 1, b: 2 }, false],
    [null, {}, false], [{ a: [{ b: 1 }] }, { a: [{ b: 1 }] }, true], ["1", 1, false]];
  for (const [a, b, expected] of equal) {
    it(`jsonEqual(${JSON.stringify(a)}, ${JSON.stringify(b)}) is ${expected}`, () => assert.equal(jsonEqual(a, b), expected));
  }
});

describe("what the control signals say", () => {
  // Shared with the Python and Go SDKs' tests (sdk/vectors/signals.json).
  type Expected = { stop: boolean; paused: boolean; baseCents: number; capCents: number | null } | null;
  const vectors = JSON.parse(fs.readFileSync(new URL("../../../vectors/signals.json", import.meta.url), "utf8")) as {
    cases: { name: string; raw: string; signals: Expected }[];
  };
  for (const v of vectors.cases) {
    it(`${v.signals === null ? "malformed" : "read"}: ${v.name}`, () => {
      const got = parseSignals(v.raw);
      assert.deepEqual(got === null ? null : { stop: got.stop, paused: got.paused, baseCents: got.baseCents,
                                               capCents: got.capCents }, v.signals);
    });
  }
});
