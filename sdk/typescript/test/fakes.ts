/** A fake monotonic clock, a scripted transport and a fake HTTP server: WorkerRun without a cluster or real time. */

import http from "node:http";
import type { AddressInfo } from "node:net";

import type { Clock, SleepOptions } from "../src/clock.js";
import type { ApprovalRequest, PublishField, Usage } from "../src/protocol.js";
import { confirmed, type Renewal, type Transport } from "../src/transport.js";

/** Lets every pending promise callback run. */
export async function settle(): Promise<void> {
  for (let i = 0; i < 20; i++) await new Promise((resolve) => setImmediate(resolve));
}

interface Waiter {
  at: number;
  resolve: () => void;
}

/**
 * Time moves only when told to. Sleeps that keep the process alive (a caller awaiting a backoff)
 * pass at once and move the time on; the heartbeat's wait passes when `advance` reaches its end.
 */
export class FakeClock implements Clock {
  t = 1000;
  /** Every sleep asked for by a caller (not the heartbeat's waits), in seconds. */
  readonly sleeps: number[] = [];
  private waiters: Waiter[] = [];

  now(): number {
    return this.t;
  }

  sleep(seconds: number, options: SleepOptions = {}): Promise<void> {
    if (options.keepAlive !== false) {
      this.sleeps.push(seconds);
      this.t += seconds;
      this.release();
      return Promise.resolve();
    }
    return new Promise((resolve) => {
      if (options.signal?.aborted) {
        resolve();
        return;
      }
      const waiter: Waiter = { at: this.t + seconds, resolve };
      this.waiters.push(waiter);
      options.signal?.addEventListener("abort", () => {
        this.waiters = this.waiters.filter((w) => w !== waiter);
        resolve();
      }, { once: true });
    });
  }

  private release(): void {
    const due = this.waiters.filter((w) => w.at <= this.t);
    this.waiters = this.waiters.filter((w) => w.at > this.t);
    for (const w of due) w.resolve();
  }

  /** Moves the time on and lets what became due run. */
  async advance(seconds: number): Promise<void> {
    this.t += seconds;
    this.release();
    await settle();
  }
}

type Step<T> = T | Error | (() => Promise<T>);

async function play<T>(script: Step<T>[], fallback: T): Promise<T> {
  const next = script.length > 0 ? script.shift() as Step<T> : fallback;
  if (next instanceof Error) throw next;
  if (typeof next === "function") return (next as () => Promise<T>)();
  return next;
}

/** Answers from scripts, in order; when a script runs out: renewals confirm, publications land. */
export class FakeTransport implements Transport {
  readonly renewals: { checkpoint: string | null; usage: Usage | null }[] = [];
  /** The approval requests each renewal carried, in order. */
  readonly asked: ApprovalRequest[][] = [];
  readonly publications: { field: PublishField; value: unknown }[] = [];
  recordedCalls = 0;
  closed = false;
  renewScript: Step<Renewal>[] = [];
  publishScript: Step<boolean>[] = [];
  recordedScript: Step<boolean>[] = [];

  async renew(checkpoint: string | null, usage: Usage | null, requests: readonly ApprovalRequest[]): Promise<Renewal> {
    this.renewals.push({ checkpoint, usage: usage === null ? null : { ...usage } });
    this.asked.push(requests.map((r) => ({ ...r })));
    return play(this.renewScript, confirmed(null));
  }

  async publish(field: PublishField, value: unknown): Promise<boolean> {
    this.publications.push({ field, value });
    return play(this.publishScript, true);
  }

  async recorded(): Promise<boolean> {
    this.recordedCalls += 1;
    return play(this.recordedScript, false);
  }

  async close(): Promise<void> {
    this.closed = true;
  }
}

/** One request a fake server saw. */
export interface Seen {
  method: string;
  url: string;
  headers: Record<string, string | string[] | undefined>;
  body: string;
}

/** What a fake server answers; "hang" never answers. */
export type Reply = { status: number; body?: unknown; headers?: Record<string, string> } | "hang";

export interface FakeServer {
  url: string;
  seen: Seen[];
  close(): Promise<void>;
}

/** A local HTTP server answering with `handler`, recording every request. */
export async function serve(handler: (req: Seen) => Reply | Promise<Reply>): Promise<FakeServer> {
  const seen: Seen[] = [];
  const server = http.createServer((req, res) => {
    let body = "";
    req.on("data", (chunk: Buffer) => { body += chunk.toString(); });
    req.on("end", () => {
      const entry: Seen = { method: req.method ?? "", url: req.url ?? "", headers: req.headers, body };
      seen.push(entry);
      void Promise.resolve(handler(entry)).then((reply) => {
        if (reply === "hang") return;
        const text = reply.body === undefined ? "" : typeof reply.body === "string" ? reply.body : JSON.stringify(reply.body);
        res.writeHead(reply.status, { "Content-Type": "application/json", ...(reply.headers ?? {}) });
        res.end(text);
      });
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  return {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    seen,
    close: () => new Promise<void>((resolve) => {
      server.closeAllConnections();
      server.close(() => resolve());
    }),
  };
}
