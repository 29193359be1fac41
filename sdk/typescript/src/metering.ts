/**
 * Usage metered from the model's own answers: a `fetch` that reads the `usage` of every
 * OpenAI-compatible or Anthropic-style answer (streamed or not), prices it from a table you pass,
 * and reports the attempt's cumulative cents and tokens with `run.reportUsage` on the heartbeat.
 *
 *     const fetch = meteredFetch(run, { "gpt-4o-mini": { input: 0.15, output: 0.6, cachedInput: 0.075 } });
 *     const openai = new OpenAI({ fetch });
 *     const anthropic = new Anthropic({ fetch });
 *
 * Prices are USD per million tokens. The rules (rounding, unknown models, streams without usage,
 * answers that cannot be read) are in docs/budgets.md, "Metering model spend"; the pricing and
 * parsing cases every SDK passes are in sdk/vectors/metering.json.
 */

import { capUsedUp } from "./protocol.js";

/** What the meter reports to: WorkerRun's reportUsage (throws RangeError for a refused report).
 * Optionally (WorkerRun has them all), what says whether the run may still spend: `lost` (the
 * lease is lost), `finished` (a result or an error was published), `signals.stop` (the control
 * plane told the worker to stop) and `signals.capRemainingCents` / `capRemainingTokens` (what the
 * control plane last said was left of the run's caps, less what was reported since). The meter
 * refuses to send a request while any is true or a cap is used up (0 or less left); a reporter
 * without them is taken to be working. */
export interface UsageReporter {
  reportUsage(usage: { cents: number; tokens?: number }): void;
  readonly lost?: boolean;
  readonly finished?: boolean;
  readonly signals?: {
    readonly stop?: boolean;
    readonly reason?: string | null;
    readonly capRemainingCents?: number | null;
    readonly capRemainingTokens?: number | null;
  };
}

/** Why the run behind `reporter` may not spend any more (its lease lost, its result or error
 * published, told to stop, its cap used up by its own reports), or null. Ownership merely unknown
 * (a renewal not answered yet) is not a reason: a brief API blip must not break model calls. */
export function runRefusal(reporter: UsageReporter): string | null {
  try {
    if (reporter.lost === true) return "the run's lease is lost";
    if (reporter.finished === true) return "the run has finished (its result or error is published)";
    const signals = reporter.signals;
    if (signals?.stop === true) {
      return `the control plane asked this worker to stop${signals.reason ? ` (${signals.reason})` : ""}`;
    }
    // The run's own arithmetic (cap - base - own reports), not a copy of it: spending is refused as
    // soon as the meter's own report reaches the cap, not a heartbeat or two later.
    if (signals !== undefined) return capUsedUp(signals.capRemainingCents, signals.capRemainingTokens);
  } catch {
    return null; // a reporter whose state cannot be read is taken to be working
  }
  return null;
}

/** Generation endpoints: a 2xx answer to a request naming a model on one of these carries usage. */
const GENERATION = ["/completions", "/responses", "/messages"];

/** One model's prices, USD per million tokens (a number or a decimal string). `cachedInput`
 * defaults to `input`; `cacheWrite` (Anthropic cache writes) to twice `input`. */
export interface ModelPrice {
  input: number | string;
  output: number | string;
  cachedInput?: number | string;
  cacheWrite?: number | string;
}

/** A request the meter will not send: unpriced, or an earlier answer could not be metered. */
export class MeteringError extends Error {
  override name = "MeteringError";
}

/** A request refused because the run may not spend any more: its lease is lost, its result or
 * error is published, the control plane told the worker to stop, or the attempt's own reports used
 * up what was left of the run's cap. The meter is not faulted. */
export class RunStopped extends MeteringError {
  override name = "RunStopped";
}

/** The request names a model the price table has no price for. */
export class UnpricedModel extends MeteringError {
  override name = "UnpricedModel";
}

/** A usage block that is not the counts the meter can read. */
export class MalformedUsage extends Error {
  override name = "MalformedUsage";
}

/** 1e-12 USD: a price of P USD per million tokens is P * 1e6 units per token; a cent is 1e10. */
export const UNITS_PER_CENT = 10_000_000_000n;
const MAX_PRICE = 1_000_000;
export const MAX_TOKENS_PER_ANSWER = 1_000_000_000;
const MAX_READ_AHEAD = 64 * 2 ** 20;
const MAX_EVENT = 16 * 2 ** 20;
const DATE_SUFFIX = /^(.+)-(\d{4}-\d{2}-\d{2}|\d{8})$/;
const FIELDS = ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details.cached_tokens",
  "input_tokens", "output_tokens", "input_tokens_details.cached_tokens",
  "cache_read_input_tokens", "cache_creation_input_tokens"] as const;

interface Price { input: bigint; output: bigint; cachedInput: bigint; cacheWrite: bigint }

/** USD per million tokens -> micro-USD per million tokens, rounded up past the sixth decimal. */
export function microPrice(value: unknown, what: string): bigint {
  const text = typeof value === "number" ? (Number.isFinite(value) ? String(value) : "") : typeof value === "string" ? value.trim() : "";
  const m = /^(\d+)(?:\.(\d*))?(?:[eE]([+-]?\d+))?$/.exec(text);
  if (!m || Number(text) > MAX_PRICE) {
    throw new RangeError(`price ${what}: a number of 0 to ${MAX_PRICE} USD per million tokens, not ${JSON.stringify(value)}`);
  }
  const frac = m[2] ?? "";
  const digits = BigInt((m[1] ?? "0") + frac);
  const exp = Number(m[3] ?? 0) - frac.length + 6;
  if (exp >= 0) return digits * 10n ** BigInt(exp);
  const div = 10n ** BigInt(-exp);
  return (digits + div - 1n) / div;
}

function price(model: string, spec: unknown): Price {
  if (typeof spec !== "object" || spec === null || Array.isArray(spec)) {
    throw new RangeError(`price of ${model}: an object with input and output`);
  }
  const s = spec as Record<string, unknown>;
  const unknown = Object.keys(s).filter((k) => !["input", "output", "cachedInput", "cacheWrite"].includes(k));
  if (unknown.length > 0 || s.input === undefined || s.output === undefined) {
    throw new RangeError(`price of ${model}: needs input and output (and optionally cachedInput, cacheWrite), got ${Object.keys(s).join(", ")}`);
  }
  const input = microPrice(s.input, `${model}.input`);
  return {
    input,
    output: microPrice(s.output, `${model}.output`),
    cachedInput: s.cachedInput == null ? input : microPrice(s.cachedInput, `${model}.cachedInput`),
    cacheWrite: s.cacheWrite == null ? 2n * input : microPrice(s.cacheWrite, `${model}.cacheWrite`),
  };
}

/** Model name -> price: the exact key; else the key it names with a date suffix removed
 * (`-2024-08-06`, `-20241022`); else the longest key ending in `*` it starts with. */
export class PriceTable {
  private readonly prices = new Map<string, Price>();
  private readonly prefixes: string[];

  constructor(prices: Record<string, ModelPrice>) {
    if (typeof prices !== "object" || prices === null || Object.keys(prices).length === 0) {
      throw new RangeError("price table: a non-empty object of model name to prices");
    }
    for (const [k, v] of Object.entries(prices)) this.prices.set(k, price(k, v));
    this.prefixes = [...this.prices.keys()].filter((k) => k.endsWith("*")).sort((a, b) => b.length - a.length);
  }

  key(model: unknown): string | null {
    if (typeof model !== "string" || model === "") return null;
    if (this.prices.has(model) && !model.endsWith("*")) return model;
    const m = DATE_SUFFIX.exec(model);
    if (m && m[1] !== undefined && this.prices.has(m[1]) && !m[1].endsWith("*")) return m[1];
    return this.prefixes.find((k) => model.startsWith(k.slice(0, -1))) ?? null;
  }

  lookup(model: unknown): Price | null {
    const key = this.key(model);
    return key === null ? null : this.prices.get(key) ?? null;
  }
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

/** The counts the meter prices, from one usage block (nested details flattened with a dot). */
export function readUsage(usage: unknown): Map<string, bigint> {
  if (!isObject(usage)) throw new MalformedUsage(`usage is not an object: ${JSON.stringify(usage)?.slice(0, 80)}`);
  const out = new Map<string, bigint>();
  for (const field of FIELDS) {
    const [head, tail] = field.split(".") as [string, string | undefined];
    let value: unknown = usage[head];
    if (tail !== undefined) {
      if (value == null) continue;
      if (!isObject(value)) throw new MalformedUsage(`usage.${head} is not an object`);
      value = value[tail];
    }
    if (value == null) continue;
    if (typeof value !== "number" || !Number.isInteger(value) || value < 0 || value > MAX_TOKENS_PER_ANSWER) {
      throw new MalformedUsage(`usage.${field} is not a count of 0 to ${MAX_TOKENS_PER_ANSWER}: ${String(value).slice(0, 40)}`);
    }
    out.set(field, BigInt(value));
  }
  return out;
}

/** Units (1e-12 USD) and tokens of one answer's counts. OpenAI's prompt/input tokens include the
 * cached ones; Anthropic's input_tokens exclude cache reads and writes. */
export function cost(counts: Map<string, bigint>, p: Price): { units: bigint; tokens: bigint } {
  const n = (k: string): bigint => counts.get(k) ?? 0n;
  let totalIn: bigint, cached: bigint, written = 0n, out: bigint;
  if (counts.has("prompt_tokens") || counts.has("completion_tokens")) {
    [totalIn, cached, out] = [n("prompt_tokens"), n("prompt_tokens_details.cached_tokens"), n("completion_tokens")];
  } else if (counts.has("input_tokens_details.cached_tokens") || counts.has("total_tokens")) {
    [totalIn, cached, out] = [n("input_tokens"), n("input_tokens_details.cached_tokens"), n("output_tokens")];
  } else {
    [cached, written, out] = [n("cache_read_input_tokens"), n("cache_creation_input_tokens"), n("output_tokens")];
    totalIn = n("input_tokens") + cached + written;
  }
  if (cached + written > totalIn) throw new MalformedUsage(`${cached} cached input tokens of ${totalIn}`);
  const fresh = totalIn - cached - written;
  return { units: fresh * p.input + cached * p.cachedInput + written * p.cacheWrite + out * p.output, tokens: totalIn + out };
}

type FetchInput = Parameters<typeof fetch>[0];

const ceilCents = (units: bigint): bigint => (units + UNITS_PER_CENT - 1n) / UNITS_PER_CENT;

export interface MeterOptions {
  /** Usage reported before the meter was made (the meter reports on top of it). */
  baseCents?: number;
  baseTokens?: number;
  /** Where an answer that cannot be metered is told (default: console.error, one JSON line). */
  onFault?: (reason: string) => void;
}

/**
 * The attempt's metered spend, reported cumulatively through `reporter.reportUsage`. The meter is
 * the single source of the attempt's usage reports: report other spending with `add()`, never with
 * reportUsage directly (a report lower than the meter's would be refused). One meter per run.
 */
export class Meter {
  readonly prices: PriceTable;
  private units: bigint;
  private tokenCount: bigint;
  private reported: [bigint, bigint];
  private faultReason: string | null = null;

  constructor(private readonly reporter: UsageReporter, prices: Record<string, ModelPrice> | PriceTable,
    private readonly options: MeterOptions = {}) {
    this.prices = prices instanceof PriceTable ? prices : new PriceTable(prices);
    for (const v of [options.baseCents ?? 0, options.baseTokens ?? 0]) {
      if (!Number.isSafeInteger(v) || v < 0) throw new RangeError("base usage: non-negative integers");
    }
    this.units = BigInt(options.baseCents ?? 0) * UNITS_PER_CENT;
    this.tokenCount = BigInt(options.baseTokens ?? 0);
    this.reported = [BigInt(options.baseCents ?? 0), this.tokenCount];
  }

  get cents(): number { return Number(ceilCents(this.units)); }
  get tokens(): number { return Number(this.tokenCount); }
  /** Why the meter refuses new requests (an answer it could not meter), or null. */
  get fault(): string | null { return this.faultReason; }

  /** Adds spending the meter does not see (a tool's bill, an unmetered API) to the reports. */
  add(usage: { cents?: number; tokens?: number }): void {
    const cents = usage.cents ?? 0, tokens = usage.tokens ?? 0;
    if (![cents, tokens].every((v) => Number.isSafeInteger(v) && v >= 0)) {
      throw new RangeError("usage added: non-negative integers");
    }
    this.charge(BigInt(cents) * UNITS_PER_CENT, BigInt(tokens));
  }

  /** A fetch that meters every answer; `inner` is the fetch it calls (default globalThis.fetch). */
  fetch(inner: typeof fetch = globalThis.fetch): typeof fetch {
    return ((input: FetchInput, init?: RequestInit) => meteredCall(this, inner, input, init)) as typeof fetch;
  }

  /** @internal */
  charge(units: bigint, tokens: bigint): void {
    if (units <= 0n && tokens <= 0n) return;
    this.units += units;
    this.tokenCount += tokens;
    const report: [bigint, bigint] = [ceilCents(this.units), this.tokenCount];
    if (report[0] === this.reported[0] && report[1] === this.reported[1]) return;
    try {
      // One thread: reports are made in the order the totals grow, never lower.
      this.reporter.reportUsage({ cents: Number(report[0]), tokens: Number(report[1]) });
      this.reported = report;
    } catch (err) {
      this.trip(`usage report refused: ${(err as Error).message}`);
    }
  }

  /** @internal */
  trip(reason: string): void {
    if (this.faultReason === null) this.faultReason = reason;
    const tell = this.options.onFault ?? ((why: string) => console.error(JSON.stringify({
      ts: new Date().toISOString(), level: "error", msg: "model answer not metered; later requests are refused",
      event: "metering_fault", reason: why.slice(0, 300) })));
    tell(reason);
  }

  /** @internal */
  check(model: string | null): void {
    if (this.faultReason !== null) {
      throw new MeteringError(`request refused: an earlier answer could not be metered (${this.faultReason})`);
    }
    const stopped = runRefusal(this.reporter);
    if (stopped !== null) throw new RunStopped(`request refused: ${stopped}`);
    if (model !== null && this.prices.lookup(model) === null) {
      throw new UnpricedModel(`request refused: no price for model ${JSON.stringify(model)} in the price table`);
    }
  }
}

/** A fetch metering every answer: `new OpenAI({ fetch: meteredFetch(run, prices) })`. */
export function meteredFetch(run: UsageReporter | Meter, prices?: Record<string, ModelPrice>,
  inner: typeof fetch = globalThis.fetch): typeof fetch & { meter: Meter } {
  const meter = run instanceof Meter ? run : new Meter(run, prices ?? {});
  return Object.assign(meter.fetch(inner), { meter });
}

/** One answer's usage as seen so far; charges what is new each time usage appears. */
class Answer {
  model: string | null = null;
  counts = new Map<string, bigint>();
  charged = { units: 0n, tokens: 0n };
  /** A usage block with counts was read. */
  seen = false;
  /** ... one that is the answer's final count: not only Anthropic's opening count in message_start
   * (output_tokens 1), which message_delta completes. */
  final = false;
  private closed = false;

  /** expectUsage: a 2xx answer to a generation request naming a model. */
  constructor(readonly meter: Meter, readonly requestModel: string | null, readonly expectUsage = false) {}

  /** The answer ended (read whole, or a stream at its end or its [DONE]), or reading it failed
   * (`cut`: the server or the network cut it, streamed or read ahead whole): one that should have
   * carried usage and carried none faults the meter -- never silently free. */
  checkEnded(cut?: unknown): void {
    if (this.closed) return;
    this.closed = true;
    if (this.expectUsage && !this.final && this.meter.fault === null) {
      const asked = JSON.stringify(this.requestModel);
      if (this.seen) { // a stream that ended after its opening count: the rest of it went uncounted
        this.meter.trip(`a streamed answer to a ${asked} request ${cut === undefined ? "ended" : "was cut"} before `
          + "its final usage (only its opening count was read)" + (cut === undefined ? "" : ` (${describeError(cut)})`));
        return;
      }
      this.meter.trip(cut === undefined ? `a 2xx answer to a ${asked} request carried no usage`
        : `a 2xx answer to a ${asked} request was cut before its usage was read (${describeError(cut)})`);
    }
  }

  see(usage: unknown, model: unknown, final = true): void {
    if (this.model === null && typeof model === "string" && model !== "") this.model = model;
    if (usage == null) return;
    let units: bigint, tokens: bigint, merged: Map<string, bigint>;
    try {
      const counts = readUsage(usage);
      if (counts.size === 0) return;
      this.seen = true;
      this.final = this.final || final;
      // Streams repeat or grow their counts (Anthropic's message_delta): keep the largest.
      merged = new Map(this.counts);
      for (const [k, v] of counts) merged.set(k, v > (merged.get(k) ?? 0n) ? v : merged.get(k) ?? 0n);
      // Priced by the model that answered (a router or alias may answer with another); by the
      // request's only when the answer names none. Unpriced: fail closed.
      const p = this.meter.prices.lookup(this.model ?? this.requestModel);
      if (p === null) {
        throw new MalformedUsage(`no price for the answer's model ${JSON.stringify(this.model)} (asked for ${JSON.stringify(this.requestModel)})`);
      }
      ({ units, tokens } = cost(merged, p));
    } catch (err) {
      if (!(err instanceof MalformedUsage)) throw err;
      this.meter.trip(err.message);
      return;
    }
    this.counts = merged;
    const du = units > this.charged.units ? units - this.charged.units : 0n;
    const dt = tokens > this.charged.tokens ? tokens - this.charged.tokens : 0n;
    this.charged = { units: this.charged.units + du, tokens: this.charged.tokens + dt };
    this.meter.charge(du, dt);
  }

  /** A JSON answer or one streamed event: usage at the top, under `response`, `message` or
   * `x_groq` (Groq's streams). */
  seeObject(obj: unknown): void {
    if (!isObject(obj)) return;
    this.see(obj.usage, obj.model);
    for (const key of ["response", "message", "x_groq"]) {
      const inner = obj[key];
      if (isObject(inner)) this.see(inner.usage, inner.model, key !== "message");
    }
  }
}

/** A read error, with its cause (undici's "terminated" says why only there). */
function describeError(err: unknown): string {
  const e = err as { name?: unknown; message?: unknown; cause?: { message?: unknown } } | null;
  const text = `${String(e?.name ?? "Error")}: ${String(e?.message ?? err)}`;
  return (e?.cause?.message ? `${text} (${String(e.cause.message)})` : text).slice(0, 200);
}

/** An incremental SSE reader: each complete event's data goes to the answer. */
class Events {
  private buf = "";
  private data: string[] = [];
  private size = 0;
  private overflow = false;
  private readonly decoder = new TextDecoder();

  constructor(private readonly answer: Answer) {}

  feed(chunk: Uint8Array): void {
    this.buf += this.decoder.decode(chunk, { stream: true });
    for (;;) {
      const m = /\r\n|\r|\n/.exec(this.buf);
      if (!m) break;
      if (m[0] === "\r" && m.index + 1 === this.buf.length) break; // maybe half of \r\n
      const line = this.buf.slice(0, m.index);
      this.buf = this.buf.slice(m.index + m[0].length);
      this.line(line);
    }
    if (this.buf.length + this.size > MAX_EVENT) {
      [this.overflow, this.buf, this.data, this.size] = [true, "", [], 0];
    }
  }

  private line(line: string): void {
    if (line === "") this.dispatch();
    else if (line.startsWith("data:")) {
      const value = line.slice(line.startsWith("data: ") ? 6 : 5);
      this.data.push(value);
      this.size += value.length;
    }
  }

  private dispatch(): void {
    const data = this.data.join("\n");
    [this.data, this.size] = [[], 0];
    if (this.overflow) {
      this.overflow = false;
      this.answer.meter.trip(`a streamed event over ${MAX_EVENT} bytes`);
      return;
    }
    if (data.trim() === "[DONE]") {
      this.answer.checkEnded(); // OpenAI's usage chunk comes before [DONE]
      return;
    }
    if (data === "") return;
    let obj: unknown;
    try {
      obj = JSON.parse(data);
    } catch {
      return; // not JSON: no usage in it
    }
    this.answer.seeObject(obj);
  }

  /** The stream ended (`completed`: at its end, or `cut` by the server or the network) or the
   * caller abandoned it: a last complete but unterminated event still counts. Only a stream the
   * caller did not abandon must have had usage. */
  end(completed: boolean, cut?: unknown): void {
    this.buf += this.decoder.decode();
    if (this.buf !== "") this.line(this.buf);
    this.buf = "";
    if (this.data.length > 0) this.dispatch();
    if (completed) this.answer.checkEnded(cut);
  }
}

async function bodyText(input: FetchInput, init?: RequestInit): Promise<string | null> {
  const body = init?.body;
  if (typeof body === "string") return body;
  if (body instanceof Uint8Array || body instanceof ArrayBuffer) return new TextDecoder().decode(body);
  if (body == null && input instanceof Request && input.body !== null) return input.clone().text();
  return null;
}

function rebuilt(from: Response, body: ConstructorParameters<typeof Response>[0]): Response {
  const r = new Response(body, { status: from.status, statusText: from.statusText, headers: from.headers });
  Object.defineProperty(r, "url", { value: from.url });
  return r;
}

async function meteredCall(meter: Meter, inner: typeof fetch, input: FetchInput, init?: RequestInit): Promise<Response> {
  const text = await bodyText(input, init);
  let doc: unknown = null;
  if (text !== null && /^\s*\{/.test(text)) {
    try { doc = JSON.parse(text); } catch { doc = null; }
  }
  const model = isObject(doc) && typeof doc.model === "string" ? doc.model : null;
  meter.check(model);
  const url = new URL(input instanceof Request ? input.url : String(input));
  const path = url.pathname.replace(/\/+$/, "");
  const streamed = isObject(doc) && doc.stream === true;
  const generation = model !== null && GENERATION.some((g) => path.endsWith(g));
  if (isObject(doc) && streamed && path.endsWith("/completions")) {
    const opts = isObject(doc.stream_options) ? doc.stream_options : {};
    if (opts.include_usage !== true) {
      // OpenAI sends a streamed answer's usage only when asked: the meter always asks.
      const body = JSON.stringify({ ...doc, stream_options: { ...opts, include_usage: true } });
      if (input instanceof Request && init?.body == null) input = new Request(input, { body });
      else init = { ...init, body };
      if (init?.headers !== undefined) {
        const headers = new Headers(init.headers);
        headers.delete("content-length");
        init = { ...init, headers };
      }
    }
  }
  const response = await inner(input, init);
  const answer = new Answer(meter, model, generation && response.ok);
  const ctype = (response.headers.get("content-type") ?? "").toLowerCase();
  if (response.body === null) {
    answer.checkEnded();
    return response;
  }
  // A stream is what the request asked for: a 2xx non-JSON answer to it is read as SSE, whatever
  // its content type says (text/plain, none), and never buffered.
  if (ctype.includes("text/event-stream") || (streamed && response.ok && !ctype.includes("json"))) {
    const events = new Events(answer);
    const reader = response.body.getReader();
    let ended = false;
    const end = (completed: boolean, cut?: unknown): void => { if (!ended) { ended = true; events.end(completed, cut); } };
    return rebuilt(response, new ReadableStream<Uint8Array>({
      async pull(ctrl) {
        let chunk: Awaited<ReturnType<typeof reader.read>>;
        try {
          chunk = await reader.read();
        } catch (err) {
          end(true, err); // cut: what the stream said so far is charged already; none at all faults
          ctrl.error(err);
          return;
        }
        if (chunk.done) {
          end(true);
          ctrl.close();
          return;
        }
        events.feed(chunk.value);
        ctrl.enqueue(chunk.value); // unchanged, as it came
      },
      async cancel(reason) {
        end(false); // abandoned halfway by the caller: charges what it saw
        await reader.cancel(reason);
      },
    }, { highWaterMark: 0 }));
  }
  if (!ctype.includes("json") && model === null) return response;
  // Read ahead whole (fetch has already undone any Content-Encoding), then hand on the same bytes.
  const reader = response.body.getReader();
  const chunks: Uint8Array[] = [];
  let size = 0;
  for (;;) {
    let next: Awaited<ReturnType<typeof reader.read>>;
    try {
      next = await reader.read();
    } catch (err) {
      answer.checkEnded(err); // cut: the model answered (and billed), and the body never arrived whole
      throw err;
    }
    const { done, value } = next;
    if (done) break;
    chunks.push(value);
    size += value.length;
    if (size > MAX_READ_AHEAD) {
      meter.trip(`an answer over ${MAX_READ_AHEAD} bytes was not read for usage`);
      let i = 0;
      return rebuilt(response, new ReadableStream<Uint8Array>({
        async pull(ctrl) {
          if (i < chunks.length) { ctrl.enqueue(chunks[i++] as Uint8Array); return; }
          const next = await reader.read();
          if (next.done) ctrl.close(); else ctrl.enqueue(next.value);
        },
        async cancel(reason) { await reader.cancel(reason); },
      }));
    }
  }
  const raw = new Uint8Array(size);
  let at = 0;
  for (const c of chunks) { raw.set(c, at); at += c.length; }
  let obj: unknown;
  try {
    obj = JSON.parse(new TextDecoder().decode(raw));
  } catch {
    if (response.ok && ctype.includes("json")) meter.trip(`a ${response.status} JSON answer that is not JSON`);
    answer.checkEnded();
    return rebuilt(response, raw);
  }
  answer.seeObject(obj); // any status: a usage block in an error answer is charged
  answer.checkEnded();
  return rebuilt(response, raw);
}
