import assert from "node:assert/strict";
import { before, describe, it } from "node:test";

import { context, trace } from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor } from "@opentelemetry/sdk-trace-base";

import { claimReply } from "../src/gateway.js";
import { WorkerRun } from "../src/run.js";
import { NO_SIGNALS } from "../src/protocol.js";
import { formatTraceparent, parseTraceparent, redactUrl } from "../src/tracing.js";
import { confirmed } from "../src/transport.js";
import { FakeClock, FakeTransport, serve, type Seen } from "./fakes.js";

const TRACE = "4bf92f3577b34da6a3ce929d0e0e4736";
const ATTEMPT_SPAN = "00f067aa0ba902b7";
const TRACEPARENT = `00-${TRACE}-${ATTEMPT_SPAN}-01`;

function make(traceparent: string | null): WorkerRun {
  return new WorkerRun({
    name: "job", namespace: "ns", holder: "job-a2", fence: 3, attempt: 2, runUid: "uid-9",
    leaseDurationSeconds: 10, renewIntervalSeconds: 2, transport: new FakeTransport(), clock: new FakeClock(),
    traceparent, logger: () => {},
  });
}

describe("traceparent", () => {
  const vectors: [string | null, string | null][] = [
    [TRACEPARENT, TRACEPARENT],
    [`00-${TRACE}-${ATTEMPT_SPAN}-00`, `00-${TRACE}-${ATTEMPT_SPAN}-00`],
    [` ${TRACEPARENT} `, TRACEPARENT],
    [`01-${TRACE}-${ATTEMPT_SPAN}-03-extra`, TRACEPARENT], // a later version's first four fields
    ["", null], [null, null], ["garbage", null],
    [`00-${"0".repeat(32)}-${ATTEMPT_SPAN}-01`, null],
    [`00-${TRACE}-${"0".repeat(16)}-01`, null],
    [`ff-${TRACE}-${ATTEMPT_SPAN}-01`, null],
    [`${TRACEPARENT}-x`, null],
    [TRACEPARENT.toUpperCase(), null],
  ];
  for (const [value, parsed] of vectors) {
    it(`reads ${JSON.stringify(value)} as W3C does`, () => {
      const sc = parseTraceparent(value);
      assert.equal(sc === null ? null : formatTraceparent(sc), parsed);
    });
  }

  it("comes in the gateway's claim reply, and is optional there", () => {
    const doc = {
      holder: "job-a1", fence: 1, runUid: "uid-1", leaseExpiresAt: "2026-01-01T00:00:00Z", stop: false, paused: false,
      status: "Running", attempt: 1, leaseDurationSeconds: 10, renewIntervalSeconds: 2, payload: {},
      idempotencyKey: "ns/job", decisions: {},
    };
    assert.equal(claimReply({ ...doc, traceparent: TRACEPARENT })?.traceparent, TRACEPARENT);
    assert.equal(claimReply(doc)?.traceparent, null);
  });
});

// The order matters: no SDK first (each test file is a process of its own), then one registered.
describe("without an OpenTelemetry SDK", () => {
  it("still hands the attempt's context to a side effect's receiver", async () => {
    const server = await serve(() => ({ status: 200, body: {} }));
    const run = make(TRACEPARENT);
    try {
      await run.start();
      await run.effect(`${server.url}/effects`, { operation: "charge", body: {} });
      assert.equal(server.seen[0]?.headers.traceparent, TRACEPARENT);
      assert.equal(server.seen[0]?.headers["x-execution-fence"], "3");
    } finally {
      await run.close();
      await server.close();
    }
  });
});

describe("with an OpenTelemetry SDK", () => {
  const exporter = new InMemorySpanExporter();
  before(() => {
    trace.setGlobalTracerProvider(new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] }));
    context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
  });

  it("parents renewals, a checkpoint flush, a side effect and the publication on the attempt", async () => {
    exporter.reset();
    const seen: Seen[] = [];
    const server = await serve((req) => { seen.push(req); return { status: 200, body: {} }; });
    const run = make(TRACEPARENT);
    try {
      await run.start();
      await run.checkpoint("row-1", { flush: true });
      // Under the application's own span, itself parented on the attempt.
      const tracer = trace.getTracer("app");
      await tracer.startActiveSpan("app work", {}, run.traceContext, async (mine) => {
        await run.effect(`${server.url}/effects`, { operation: "charge", body: {} });
        mine.end();
      });
      await run.complete({ ok: true });
    } finally {
      await run.close();
      await server.close();
    }
    const spans = exporter.getFinishedSpans();
    const byName = (name: string) => spans.filter((s) => s.name === name);
    assert.ok(spans.length >= 6, spans.map((s) => s.name).join(","));
    for (const s of spans) assert.equal(s.spanContext().traceId, TRACE, s.name);
    const [first] = byName("tether.renew");
    assert.equal(first?.parentSpanContext?.spanId, ATTEMPT_SPAN);
    assert.equal(first?.attributes["tether.renewal"], "confirmed");
    const [checkpoint] = byName("tether.checkpoint");
    assert.ok(byName("tether.renew").some((s) => s.parentSpanContext?.spanId === checkpoint?.spanContext().spanId));
    const [effect] = byName("tether.effect");
    const [app] = byName("app work");
    assert.equal(effect?.parentSpanContext?.spanId, app?.spanContext().spanId);
    assert.equal(effect?.attributes["tether.fence"], 3);
    assert.equal(effect?.attributes["tether.attempt"], 2);
    assert.equal(effect?.attributes["http.response.status_code"], 200);
    // The receiver got the effect span's own context.
    assert.equal(seen[0]?.headers.traceparent, `00-${TRACE}-${effect?.spanContext().spanId}-01`);
    const [publish] = byName("tether.publish");
    assert.equal(publish?.parentSpanContext?.spanId, ATTEMPT_SPAN);
    assert.equal(publish?.attributes["tether.publication"], "result");
    assert.equal(publish?.attributes["tether.run.uid"], "uid-9");
  });

  it("starts its spans as roots without a context, and ends a failed one as an error", async () => {
    exporter.reset();
    const run = make(null);
    try {
      await run.start();
      await assert.rejects(run.effect("http://127.0.0.1:1/nothing", { operation: "x", timeoutMs: 2000 }));
    } finally {
      await run.close();
    }
    const [renew] = exporter.getFinishedSpans().filter((s) => s.name === "tether.renew");
    assert.equal(renew?.parentSpanContext, undefined);
    const [effect] = exporter.getFinishedSpans().filter((s) => s.name === "tether.effect");
    assert.equal(effect?.status.code, 2); // ERROR
  });

  it("redacts an effect's url.full", async () => {
    exporter.reset();
    const server = await serve(() => ({ status: 200, body: {} }));
    const run = make(TRACEPARENT);
    try {
      await run.start();
      const url = SECRET_URL.replace("receiver:8443", new URL(server.url).host);
      // fetch refuses a URL with credentials, after the span began
      await assert.rejects(run.effect(url, { operation: "charge", body: {} }), TypeError);
      const [effect] = exporter.getFinishedSpans().filter((s) => s.name === "tether.effect");
      assert.equal(effect?.attributes["url.full"], REDACTED_URL.replace("receiver:8443", new URL(server.url).host));
    } finally {
      await run.close();
      await server.close();
    }
  });

  it("makes spans only of renewals that are news", async () => {
    exporter.reset();
    const transport = new FakeTransport();
    const run = new WorkerRun({
      name: "job", namespace: "ns", holder: "job-a2", fence: 3, attempt: 2, leaseDurationSeconds: 10,
      renewIntervalSeconds: 2, transport, clock: new FakeClock(), traceparent: TRACEPARENT, logger: () => {},
    });
    try {
      await run.start(); // the first renewal: news
      for (let i = 0; i < 5; i++) assert.equal(await run.renew(), true); // quiet
      run.reportUsage({ cents: 3, tokens: 10 });
      await run.checkpoint("row-1");
      assert.equal(await run.renew(), true); // carries usage and a checkpoint
      assert.equal(await run.renew(), true);
      transport.renewScript.push(confirmed({ ...NO_SIGNALS, paused: true }));
      assert.equal(await run.renew(), true); // new signals
      assert.equal(await run.renew(), true);
      transport.renewScript.push({ ok: false, lost: true, why: "another holder", signals: null });
      assert.equal(await run.renew(), false); // lost
    } finally {
      await run.close();
    }
    const renew = exporter.getFinishedSpans().filter((s) => s.name === "tether.renew");
    assert.deepEqual(renew.map((s) => s.attributes["tether.renewal"]), ["confirmed", "confirmed", "confirmed", "lost"]);
    assert.ok(Number(renew[1]?.attributes["tether.renewals.unrecorded"]) >= 5);
    for (const s of renew) assert.equal(s.parentSpanContext?.spanId, ATTEMPT_SPAN);
  });
});

const SECRET_URL = "http://user:password@receiver:8443/effects?api_key=s3cr3t&mode=live&flag#token=t0k";
const REDACTED_URL = "http://REDACTED:REDACTED@receiver:8443/effects?api_key=REDACTED&mode=REDACTED&flag";

describe("url.full", () => {
  const vectors: [string, string][] = [
    [SECRET_URL, REDACTED_URL], // the same vector as the Python and Go SDKs' tests
    ["https://api.example.com/v1/charge", "https://api.example.com/v1/charge"],
    ["https://api.example.com/v1?a=1&a=2&=x", "https://api.example.com/v1?a=REDACTED&a=REDACTED&=REDACTED"],
    ["https://token@api.example.com/", "https://REDACTED:REDACTED@api.example.com/"],
    ["not a url", "REDACTED"],
  ];
  for (const [url, redacted] of vectors) {
    it(`carries no credentials or query values of ${url}`, () => assert.equal(redactUrl(url), redacted));
  }
});
