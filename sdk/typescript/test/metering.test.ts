/** meteredFetch against a fake model API (node:http): sdk/vectors/metering.json, whole and streamed
 * answers, gzip, cut and abandoned streams, hostile usage, error answers, concurrency. */

import assert from "node:assert/strict";
import fs from "node:fs";
import http from "node:http";
import type { AddressInfo } from "node:net";
import { after, before, describe, it } from "node:test";
import zlib from "node:zlib";

import {
  MalformedUsage, Meter, MeteringError, PriceTable, RunStopped, UnpricedModel, cost, meteredFetch, readUsage,
  type ModelPrice, type UsageReporter,
} from "../src/metering.js";
import { signalsFromRemaining, validReport } from "../src/protocol.js";
import { WorkerRun } from "../src/run.js";
import { confirmed } from "../src/transport.js";
import { FakeClock, FakeTransport, settle } from "./fakes.js";

// WorkerRun is a reporter whose lost / finished / signals the meter reads (checked at compile time).
const asReporter = (run: WorkerRun): UsageReporter => run;

const VECTORS = JSON.parse(fs.readFileSync(new URL("../../../vectors/metering.json", import.meta.url), "utf8")) as {
  prices: Record<string, ModelPrice>;
  lookups: { model: string; key: string | null }[];
  usages: { name: string; model: string; usage: unknown; units?: number; tokens?: number; cents?: number; malformed?: boolean }[];
  caps: { name: string; capRemainingCents: number | null; capRemainingTokens: number | null; reported: [number, number];
    refusedAtStart?: boolean; steps: { add: [number, number]; refused: boolean; wakes: boolean }[] }[];
  cuts: { name: string; path: string; request: Record<string, unknown>; status: number; contentType: string; body: string;
    cutAt: number; faults: boolean; charged: [number, number] }[];
};
const PRICES: Record<string, ModelPrice> = {
  "gpt-x": { input: 2.5, output: 10, cachedInput: 1.25 },
  "claude-x": { input: 3, output: 15, cachedInput: 0.3, cacheWrite: 3.75 },
};

/** Takes reports as WorkerRun does: a decrease is refused (RangeError). */
class Reporter {
  reports: [number, number][] = [];
  reportUsage(u: { cents: number; tokens?: number }): void {
    const last = this.reports.at(-1);
    const why = validReport({ cents: u.cents, tokens: u.tokens ?? 0 }, last ? { cents: last[0], tokens: last[1] } : null);
    if (why !== null) throw new RangeError(why);
    this.reports.push([u.cents, u.tokens ?? 0]);
  }
  get last(): [number, number] { return this.reports.at(-1) ?? [0, 0]; }
}

interface Knobs { usage?: unknown; status?: number; gzip?: boolean; cutAfter?: number; model?: string; body?: string; contentType?: string; hold?: Promise<void>;
  /** A whole answer cut after this many bytes of its body: its content-length promises them all. */
  cutBody?: number }

/** A model API: chat completions, responses and Anthropic messages, 1000 input and 500 output tokens. */
class FakeModel {
  requests: { path: string; body: Record<string, unknown> }[] = [];
  private queue: Knobs[] = [];
  private server = http.createServer((req, res) => {
    let raw = "";
    req.on("data", (c: Buffer) => { raw += c.toString(); });
    req.on("end", () => {
      const body = raw ? (JSON.parse(raw) as Record<string, unknown>) : {};
      this.requests.push({ path: req.url ?? "", body });
      void this.serve(req.url ?? "", body, this.queue.shift() ?? {}, res);
    });
  });
  url = "";

  async start(): Promise<void> {
    await new Promise<void>((resolve) => this.server.listen(0, "127.0.0.1", resolve));
    this.url = `http://127.0.0.1:${(this.server.address() as AddressInfo).port}`;
  }
  next(k: Knobs): void { this.queue.push(k); }
  close(): void { this.server.closeAllConnections(); this.server.close(); }

  private async serve(path: string, body: Record<string, unknown>, k: Knobs, res: http.ServerResponse): Promise<void> {
    const model = k.model ?? (body.model as string);
    const anthropic = path.endsWith("/messages"), responses = path.endsWith("/responses");
    let usage: unknown = anthropic
      ? { input_tokens: 1000, output_tokens: 500, cache_read_input_tokens: 0, cache_creation_input_tokens: 0 }
      : responses ? { input_tokens: 1000, input_tokens_details: { cached_tokens: 0 }, output_tokens: 500, total_tokens: 1500 }
        : { prompt_tokens: 1000, completion_tokens: 500, total_tokens: 1500 };
    if ("usage" in k) usage = k.usage;
    const send = (status: number, data: string, ctype: string): void => {
      let out: Buffer = Buffer.from(data);
      const headers: Record<string, string> = { "content-type": ctype };
      if (k.gzip) { out = zlib.gzipSync(out); headers["content-encoding"] = "gzip"; }
      if (k.cutBody !== undefined) {
        res.writeHead(status, { ...headers, "content-length": String(out.length) });
        res.write(out.subarray(0, k.cutBody));
        setTimeout(() => res.socket?.destroy(), 20); // the connection drops, the body short of its length
        return;
      }
      res.writeHead(status, headers).end(out);
    };
    if (k.body !== undefined) return send(k.status ?? 200, k.body, k.contentType ?? "text/html");
    if ((k.status ?? 200) >= 400) {
      return send(k.status ?? 500, JSON.stringify({ error: { message: "injected" }, ...("usage" in k ? { usage } : {}) }), "application/json");
    }
    if (body.stream !== true) return send(200, JSON.stringify({ id: "x", model, usage }), "application/json");
    const events: [string | null, unknown][] = [];
    if (anthropic) {
      events.push(["message_start", { type: "message_start", message: { model, usage: "usage" in k ? usage : { ...(usage as object), output_tokens: 1 } } }]);
      for (const w of ["Hel", "lo"]) events.push(["content_block_delta", { type: "content_block_delta", delta: { text: w } }]);
      events.push(["message_delta", { type: "message_delta", usage: "usage" in k ? usage : { output_tokens: 500 } }]);
      events.push(["message_stop", { type: "message_stop" }]);
    } else if (responses) {
      events.push(["response.created", { type: "response.created", response: { model, usage: null } }]);
      events.push(["response.output_text.delta", { type: "response.output_text.delta", delta: "Hi" }]);
      events.push(["response.completed", { type: "response.completed", response: { model, usage } }]);
    } else {
      const withUsage = (body.stream_options as { include_usage?: boolean } | undefined)?.include_usage === true;
      for (const w of ["Hel", "lo"]) events.push([null, { model, choices: [{ delta: { content: w } }], ...(withUsage ? { usage: null } : {}) }]);
      if (withUsage) events.push([null, { model, choices: [], usage }]);
      events.push([null, "[DONE]"]);
    }
    const headers: Record<string, string> = { "content-type": "text/event-stream" };
    const gz = k.gzip ? zlib.createGzip() : null;
    if (gz) headers["content-encoding"] = "gzip";
    res.writeHead(200, headers);
    if (gz) gz.pipe(res);
    const write = (s: string): void => {
      if (gz) { gz.write(s); gz.flush(zlib.constants.Z_SYNC_FLUSH); } else res.write(s);
    };
    for (const [i, [name, data]] of events.entries()) {
      const event = `${name ? `event: ${name}\n` : ""}data: ${typeof data === "string" ? data : JSON.stringify(data)}\n\n`;
      if (k.cutAfter === i) {
        write(event.slice(0, event.length >> 1));
        await new Promise((r) => setTimeout(r, 20)); // let the half event reach the client
        res.socket?.destroy();
        return;
      }
      write(event);
      if (i === 0 && k.hold) await k.hold;
    }
    if (gz) gz.end(); else res.end();
  }
}

let fake: FakeModel;
before(async () => { fake = new FakeModel(); await fake.start(); });
after(() => fake.close());

const post = (f: typeof fetch, path: string, body: unknown): Promise<Response> =>
  f(fake.url + path, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) });

describe("pricing and parsing (sdk/vectors/metering.json)", () => {
  const table = new PriceTable(VECTORS.prices);
  for (const c of VECTORS.lookups) {
    it(`prices ${JSON.stringify(c.model)} by ${c.key}`, () => assert.equal(table.key(c.model), c.key));
  }
  for (const c of VECTORS.usages) {
    it(c.name, () => {
      const price = table.lookup(c.model);
      assert.ok(price);
      if (c.malformed) {
        assert.throws(() => cost(readUsage(c.usage), price), MalformedUsage);
        return;
      }
      const got = cost(readUsage(c.usage), price);
      assert.deepEqual([got.units, got.tokens], [BigInt(c.units ?? 0), BigInt(c.tokens ?? 0)]);
    });
  }
  it("refuses bad price tables", () => {
    for (const bad of [{}, { m: { input: 1 } }, { m: { input: -1, output: 1 } }, { m: { input: "x", output: 1 } },
      { m: { input: NaN, output: 1 } }, { m: { input: 1, output: 1, typo: 2 } }, { m: { input: 2e6, output: 1 } }]) {
      assert.throws(() => new Meter(new Reporter(), bad as Record<string, ModelPrice>), RangeError, JSON.stringify(bad));
    }
  });
  it("rounds up the total, not each answer; add() and a base count too", async () => {
    const r = new Reporter();
    r.reportUsage({ cents: 7, tokens: 0 });
    const meter = new Meter(r, { "gpt-x": { input: 1, output: 1 } }, { baseCents: 7 });
    for (let i = 0; i < 3; i++) fake.next({ usage: { prompt_tokens: 4000, completion_tokens: 0 } });
    for (let i = 0; i < 3; i++) await (await post(meter.fetch(), "/v1/chat/completions", { model: "gpt-x" })).json();
    assert.deepEqual(r.reports, [[7, 0], [8, 4000], [8, 8000], [9, 12000]]);
    meter.add({ cents: 2, tokens: 1 });
    assert.deepEqual(r.last, [11, 12001]);
  });
});

describe("meteredFetch", () => {
  for (const [path, model, cents] of [["/v1/chat/completions", "gpt-x", 1], ["/v1/responses", "gpt-x", 1], ["/v1/messages", "claude-x", 2]] as const) {
    it(`meters whole and streamed ${path}`, async () => {
      const r = new Reporter();
      const f = meteredFetch(r, PRICES);
      const whole = await post(f, path, { model });
      assert.equal(((await whole.json()) as { usage: unknown }).usage !== undefined, true);
      assert.deepEqual(r.last, [cents, 1500]);
      const text = await (await post(f, path, { model, stream: true })).text();
      assert.match(text, /DONE|message_stop|response\.completed/);
      assert.equal(r.last[1], 3000);
      assert.equal(f.meter.fault, null);
    });
  }

  it("asks a streamed chat completion for its usage and passes the bytes on unchanged", async () => {
    const r = new Reporter();
    const body = { model: "gpt-x", stream: true, stream_options: { include_usage: false, other: 1 } };
    const metered = await (await post(meteredFetch(r, PRICES), "/v1/chat/completions", body)).text();
    const sent = fake.requests.at(-1)!.body;
    assert.deepEqual(sent.stream_options, { include_usage: true, other: 1 });
    assert.equal(await (await post(fetch, "/v1/chat/completions", sent)).text(), metered);
    assert.deepEqual(r.last, [1, 1500]);
  });

  it("passes a stream through unbuffered, and an abandoned one charges what message_start said", async () => {
    let release!: () => void;
    fake.next({ hold: new Promise<void>((resolve) => { release = resolve; }) });
    const r = new Reporter();
    const answer = await post(meteredFetch(r, PRICES), "/v1/messages", { model: "claude-x", stream: true });
    const reader = answer.body!.getReader();
    const first = new TextDecoder().decode((await reader.read()).value);
    assert.match(first, /message_start/); // arrived while the server holds the rest
    await reader.cancel();
    release();
    assert.deepEqual(r.reports, [[1, 1001]]);
  });

  it("meters gzip answers, whole and streamed", async () => {
    const r = new Reporter();
    const f = meteredFetch(r, PRICES);
    fake.next({ gzip: true });
    assert.equal(((await (await post(f, "/v1/messages", { model: "claude-x" })).json()) as { model: string }).model, "claude-x");
    fake.next({ gzip: true });
    assert.match(await (await post(f, "/v1/messages", { model: "claude-x", stream: true })).text(), /message_stop/);
    assert.deepEqual(r.last, [3, 3000]);
  });

  // message_start's opening count only (cut 3, 1): charged, and the meter faults (the output went uncounted).
  for (const [path, model, cut, expect, faults] of [["/v1/messages", "claude-x", 4, [2, 1500], false],
    ["/v1/messages", "claude-x", 3, [1, 1001], true], ["/v1/messages", "claude-x", 1, [1, 1001], true],
    ["/v1/chat/completions", "gpt-x", 2, [0, 0], true], ["/v1/responses", "gpt-x", 2, [0, 0], true]] as const) {
    it(`a ${path} stream cut inside event ${cut} charges what it saw`, async () => {
      const r = new Reporter();
      const f = meteredFetch(r, PRICES);
      fake.next({ cutAfter: cut });
      const answer = await post(f, path, { model, stream: true });
      await answer.text().catch(() => undefined);
      assert.deepEqual(r.last, expect);
      // Cut by the server, not abandoned by the caller: a stream that ended without its final usage faults.
      assert.equal(f.meter.fault !== null, faults, String(f.meter.fault));
    });
  }

  it("charges usage in an error answer; nothing for one without", async () => {
    const r = new Reporter();
    const f = meteredFetch(r, PRICES);
    fake.next({ status: 429, usage: { prompt_tokens: 4000, completion_tokens: 0 } });
    assert.equal((await post(f, "/v1/chat/completions", { model: "gpt-x" })).status, 429);
    fake.next({ status: 502, body: "<html>bad gateway</html>" });
    const page = await post(f, "/v1/chat/completions", { model: "gpt-x" });
    assert.equal(await page.text(), "<html>bad gateway</html>");
    assert.deepEqual(r.reports, [[1, 4000]]);
    assert.equal(f.meter.fault, null);
  });

  for (const usage of [{ prompt_tokens: -1 }, { prompt_tokens: 1e12 }, { prompt_tokens: "9" }, "junk",
    { prompt_tokens: 1, prompt_tokens_details: { cached_tokens: 2 } }]) {
    it(`a malformed usage ${JSON.stringify(usage)} is not charged and stops later requests`, async () => {
      const r = new Reporter();
      const f = meteredFetch(r, PRICES, fetch);
      fake.next({ usage });
      assert.equal((await post(f, "/v1/chat/completions", { model: "gpt-x" })).status, 200);
      assert.deepEqual(r.reports, []);
      assert.ok(f.meter.fault);
      const sent = fake.requests.length;
      await assert.rejects(post(f, "/v1/chat/completions", { model: "gpt-x" }), MeteringError);
      assert.equal(fake.requests.length, sent);
    });
  }

  it("faults on a JSON answer that is not JSON, and on an answer priced by neither model", async () => {
    const f = meteredFetch(new Reporter(), PRICES);
    fake.next({ body: '{"usage": {"prompt_tokens": 3', contentType: "application/json" });
    await post(f, "/v1/chat/completions", { model: "gpt-x" });
    assert.match(f.meter.fault ?? "", /not JSON/);
    const g = meteredFetch(new Reporter(), PRICES);
    fake.next({ model: "mystery" });
    await post(g, "/v1/chat/completions", { messages: [] });
    assert.match(g.meter.fault ?? "", /mystery/);
  });

  it("prices an answer by the model it names: unpriced there faults, even if the request is priced", async () => {
    const r = new Reporter();
    const f = meteredFetch(r, { ...PRICES, "gpt-x-cheap": { input: 0, output: 0 } });
    fake.next({ model: "mystery" });
    assert.equal((await post(f, "/v1/chat/completions", { model: "gpt-x-cheap" })).status, 200);
    assert.deepEqual(r.reports, []);
    assert.match(f.meter.fault ?? "", /mystery/);
  });

  for (const [path, model] of [["/v1/chat/completions", "gpt-x"], ["/v1/responses", "gpt-x"], ["/v1/messages", "claude-x"]] as const) {
    it(`faults on a 2xx ${path} answer without usage, whole or streamed to its end`, async () => {
      for (const stream of [false, true]) {
        const r = new Reporter();
        const f = meteredFetch(r, PRICES);
        fake.next({ usage: null });
        assert.equal((await (await post(f, path, { model, stream })).text()).length > 0, true);
        assert.deepEqual(r.reports, []);
        assert.match(f.meter.fault ?? "", /no usage/, `stream ${stream}`);
        const sent = fake.requests.length;
        await assert.rejects(post(f, path, { model }), MeteringError);
        assert.equal(fake.requests.length, sent);
      }
    });
  }

  it("faults on a 2xx non-JSON answer to a generation request; not on speech or embeddings", async () => {
    const f = meteredFetch(new Reporter(), PRICES);
    fake.next({ body: "\u0089PNG" });
    await (await post(f, "/v1/audio/speech", { model: "gpt-x" })).text();
    fake.next({ body: '{"data": []}', contentType: "application/json" });
    await (await post(f, "/v1/embeddings", { model: "gpt-x" })).text();
    assert.equal(f.meter.fault, null);
    fake.next({ body: "\u0089PNG" });
    await (await post(f, "/v1/completions", { model: "gpt-x" })).text();
    assert.match(f.meter.fault ?? "", /no usage/);
  });

  it("a stream the caller abandons charges what it saw and does not fault", async () => {
    let release!: () => void;
    fake.next({ hold: new Promise<void>((resolve) => { release = resolve; }) });
    const r = new Reporter();
    const f = meteredFetch(r, PRICES);
    const answer = await post(f, "/v1/chat/completions", { model: "gpt-x", stream: true });
    const reader = answer.body!.getReader();
    await reader.read();
    await reader.cancel();
    release();
    assert.deepEqual(r.reports, []);
    assert.equal(f.meter.fault, null);
  });

  const sseFetch = (chunks: string[], headers: Record<string, string>, gate?: Promise<void>): typeof fetch =>
    (async () => new Response(new ReadableStream<Uint8Array>({
      async start(ctrl) {
        for (const [i, c] of chunks.entries()) {
          if (i === 1 && gate) await gate;
          ctrl.enqueue(new TextEncoder().encode(c));
        }
        ctrl.close();
      },
    }), { status: 200, headers })) as typeof fetch;
  const chunkHi = 'data: {"model": "gpt-x", "choices": [{"delta": {"content": "hi"}}]}\n\n';

  for (const ctype of ["text/plain", null]) {
    it(`reads a stream asked for as SSE, unbuffered, served as ${ctype}`, async () => {
      let release!: () => void;
      const gate = new Promise<void>((resolve) => { release = resolve; });
      const r = new Reporter();
      const f = meteredFetch(r, PRICES, sseFetch([chunkHi,
        'data: {"model": "gpt-x", "choices": [], "usage": {"prompt_tokens": 1000, "completion_tokens": 500}}\n\ndata: [DONE]\n\n'],
      ctype ? { "content-type": ctype } : {}, gate));
      const answer = await post(f, "/v1/chat/completions", { model: "gpt-x", stream: true });
      const reader = answer.body!.getReader();
      assert.match(new TextDecoder().decode((await reader.read()).value), /hi/); // before the rest was sent
      release();
      while (!(await reader.read()).done) { /* drain */ }
      assert.deepEqual(r.reports, [[1, 1500]]);
      assert.equal(f.meter.fault, null);
    });
  }

  it("faults at [DONE] with no usage chunk before it; reads Groq's x_groq usage", async () => {
    const f = meteredFetch(new Reporter(), PRICES, sseFetch([chunkHi, "data: [DONE]\n\n", ": more\n\n"],
      { "content-type": "text/event-stream" }));
    const reader = (await post(f, "/v1/chat/completions", { model: "gpt-x", stream: true })).body!.getReader();
    await reader.read();
    await reader.read(); // [DONE]: the caller stops here
    await reader.cancel();
    assert.match(f.meter.fault ?? "", /no usage/);
    const r = new Reporter();
    const g = meteredFetch(r, PRICES, sseFetch([chunkHi,
      'data: {"model": "gpt-x", "choices": [], "x_groq": {"usage": {"prompt_tokens": 1000, "completion_tokens": 500}}}\n\ndata: [DONE]\n\n'],
    { "content-type": "text/event-stream" }));
    await (await post(g, "/v1/chat/completions", { model: "gpt-x", stream: true })).text();
    assert.deepEqual(r.reports, [[1, 1500]]);
    assert.equal(g.meter.fault, null);
  });

  for (const end of ["lost", "finished", "stop"] as const) {
    it(`refuses requests once the run is ${end} (RunStopped), not while ownership is unknown`, async () => {
      const state = { lost: false, finished: false, stop: false };
      const reporter: UsageReporter = new (class extends Reporter {
        get lost(): boolean { return state.lost; }
        get finished(): boolean { return state.finished; }
        get signals(): { stop: boolean; reason: string | null } { return { stop: state.stop, reason: state.stop ? "BudgetExceeded" : null }; }
      })();
      const f = meteredFetch(reporter, PRICES);
      await (await post(f, "/v1/chat/completions", { model: "gpt-x" })).text();
      state[end] = true;
      const sent = fake.requests.length;
      await assert.rejects(post(f, "/v1/chat/completions", { model: "gpt-x" }),
        (err: Error) => err instanceof RunStopped && err instanceof MeteringError && (end !== "stop" || /BudgetExceeded/.test(err.message)));
      assert.equal(fake.requests.length, sent);
      assert.equal(f.meter.fault, null);
    });
  }

  it("lets requests through a WorkerRun whose ownership is unknown; a throwing report faults", async () => {
    const run = new WorkerRun({ name: "job", namespace: "ns", holder: "job-a1", fence: 1, attempt: 1,
      leaseDurationSeconds: 10, renewIntervalSeconds: 2, transport: new FakeTransport(), logger: () => {} });
    assert.equal(run.ownership, "unknown");
    const f = meteredFetch(asReporter(run), PRICES);
    await (await post(f, "/v1/chat/completions", { model: "gpt-x" })).text();
    assert.equal(f.meter.fault, null);
    assert.equal(run.finished, false);
    const g = meteredFetch({ reportUsage() { throw new Error("run finished"); } }, PRICES);
    await (await post(g, "/v1/chat/completions", { model: "gpt-x" })).text();
    assert.match(g.meter.fault ?? "", /run finished/);
  });

  it("refuses an unpriced model before sending it", async () => {
    const sent = fake.requests.length;
    await assert.rejects(post(meteredFetch(new Reporter(), PRICES), "/v1/messages", { model: "nope" }), UnpricedModel);
    assert.equal(fake.requests.length, sent);
  });

  it("loses nothing with many requests at once", async () => {
    const r = new Reporter();
    const f = meteredFetch(r, PRICES);
    await Promise.all(Array.from({ length: 40 }, async (_, i) => {
      const answer = await post(f, i % 2 ? "/v1/messages" : "/v1/chat/completions", { model: i % 2 ? "claude-x" : "gpt-x", stream: i % 4 < 2 });
      await answer.arrayBuffer();
    }));
    assert.deepEqual(r.last, [Math.ceil((20 * 75 + 20 * 105) / 100), 40 * 1500]);
  });
});

/** A started WorkerRun whose control plane said `cents` / `tokens` were left of the run's caps when
 * `reported` was reported (the gateway's form; a pod's Lease carries cap and base, the same arithmetic). */
async function cappedRun(cents: number | null, tokens: number | null, reported: [number, number] = [0, 0]):
  Promise<{ run: WorkerRun; transport: FakeTransport }> {
  const transport = new FakeTransport();
  const usage = { cents: reported[0], tokens: reported[1] };
  transport.renewScript = [confirmed(signalsFromRemaining(false, false, null, cents, tokens, usage))];
  const run = new WorkerRun({ name: "job", namespace: "ns", holder: "job-a1", fence: 1, attempt: 1,
    leaseDurationSeconds: 10, renewIntervalSeconds: 2, transport, clock: new FakeClock(), logger: () => {} });
  run.reportUsage(usage);
  await run.start(); // renews once; the heartbeat then waits on the fake clock, which never moves
  return { run, transport };
}

function refused(meter: Meter): boolean {
  try {
    meter.check("gpt-x");
    return false;
  } catch (err) {
    assert.ok(err instanceof RunStopped, String(err));
    assert.match(err.message, /cap is used up/);
    return true;
  }
}

describe("a cap the attempt's own reports used up (sdk/vectors/metering.json caps)", () => {
  for (const c of VECTORS.caps) {
    it(c.name, async () => {
      const { run, transport } = await cappedRun(c.capRemainingCents, c.capRemainingTokens, c.reported);
      try {
        const meter = new Meter(asReporter(run), PRICES, { baseCents: c.reported[0], baseTokens: c.reported[1] });
        assert.equal(refused(meter), c.refusedAtStart ?? false, "at start");
        for (const [i, step] of c.steps.entries()) {
          const renewals = transport.renewals.length;
          meter.add({ cents: step.add[0], tokens: step.add[1] });
          await settle();
          assert.deepEqual([refused(meter), transport.renewals.length - renewals], [step.refused, step.wakes ? 1 : 0], `step ${i}`);
          if (step.wakes) assert.deepEqual(transport.renewals.at(-1)?.usage, { cents: meter.cents, tokens: meter.tokens });
        }
        assert.equal(meter.fault, null);
      } finally {
        await run.close();
      }
    });
  }

  it("an answer that uses up the cap refuses the next request at once, and the heartbeat reports it", async () => {
    const { run, transport } = await cappedRun(1, null);
    try {
      const f = meteredFetch(asReporter(run), PRICES);
      // 1000 prompt at 2.5 + 500 completion at 10 = 0.75 cent, reported as 1: all that was left.
      assert.equal((await post(f, "/v1/chat/completions", { model: "gpt-x" })).status, 200);
      const sent = fake.requests.length;
      await assert.rejects(post(f, "/v1/chat/completions", { model: "gpt-x" }),
        (err: Error) => err instanceof RunStopped && /cap is used up/.test(err.message));
      assert.equal(fake.requests.length, sent);
      assert.equal(run.signals.capRemainingCents, 0);
      await settle();
      assert.deepEqual(transport.renewals.map((r) => r.usage), [{ cents: 0, tokens: 0 }, { cents: 1, tokens: 1500 }]);
      assert.equal(f.meter.fault, null);
    } finally {
      await run.close();
    }
  });
});

describe("an answer cut by the network (sdk/vectors/metering.json cuts)", () => {
  /** The first bytes of the case's body, then the read fails as undici's does on a dropped connection. */
  const cutFetch = (c: (typeof VECTORS.cuts)[number], sent: { n: number }): typeof fetch => (async () => {
    sent.n += 1;
    const head = new TextEncoder().encode(c.body).subarray(0, c.cutAt);
    let given = head.length === 0;
    return new Response(new ReadableStream<Uint8Array>({
      pull(ctrl) { // (erroring the controller would drop what is queued: the head is read first)
        if (!given) { given = true; ctrl.enqueue(head); return; }
        ctrl.error(new TypeError("terminated", { cause: new Error("other side closed") }));
      },
    }), { status: c.status, headers: { "content-type": c.contentType } });
  }) as typeof fetch;

  for (const c of VECTORS.cuts) {
    it(c.name, async () => {
      const r = new Reporter();
      const sent = { n: 0 };
      const f = meteredFetch(r, VECTORS.prices, cutFetch(c, sent));
      const call = (): Promise<Response> => f(`http://model.test${c.path}`,
        { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(c.request) });
      await assert.rejects(async () => { await (await call()).text(); }, TypeError);
      assert.equal(f.meter.fault !== null, c.faults, f.meter.fault ?? "no fault");
      if (c.faults) {
        assert.match(f.meter.fault ?? "", /cut/);
        await assert.rejects(call(), MeteringError);
        assert.equal(sent.n, 1);
      }
      assert.deepEqual(r.last, c.charged);
    });
  }

  it("a whole answer cut by the network faults the meter: the client's retry is refused", async () => {
    const f = meteredFetch(new Reporter(), PRICES);
    fake.next({ cutBody: 40 });
    const sent = fake.requests.length;
    await assert.rejects(async () => { await (await post(f, "/v1/chat/completions", { model: "gpt-x" })).text(); },
      (err: Error) => !(err instanceof MeteringError));
    assert.match(f.meter.fault ?? "", /cut/);
    await assert.rejects(post(f, "/v1/chat/completions", { model: "gpt-x" }),
      (err: Error) => err instanceof MeteringError && !(err instanceof RunStopped));
    assert.equal(fake.requests.length, sent + 1);
  });
});
