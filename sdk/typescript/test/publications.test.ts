/** sdk/vectors/publications.json: what the answer to a publication means, alike in the three SDKs. */

import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { describe, it } from "node:test";

import { ResultInvalid } from "../src/errors.js";
import { GatewayTransport } from "../src/gateway.js";
import { KubeTransport, loadKubeConfig } from "../src/kube.js";
import { Unanswered } from "../src/transport.js";
import { serve, type Reply, type Seen } from "./fakes.js";

interface PublicationVector {
  name: string;
  status: number;
  contentType?: string;
  text?: string;
  json?: unknown;
  outcome: string;
}

const VECTORS = JSON.parse(fs.readFileSync(new URL("../../../vectors/publications.json", import.meta.url), "utf8")) as {
  worker: { namespace: string; name: string; holder: string; fence: number; runUid: string; workerId: string };
  result: unknown;
  pod: PublicationVector[];
  gateway: PublicationVector[];
};
const w = VECTORS.worker;

const reply = (v: PublicationVector): Reply => ({ status: v.status, body: v.text ?? JSON.stringify(v.json),
  headers: { "Content-Type": v.contentType ?? "application/json" } });

/** The vectors' name for what one publication did: published, lost, bad result or retry. */
async function outcome(publish: () => Promise<boolean>): Promise<string> {
  try {
    return (await publish()) ? "published" : "lost";
  } catch (err) {
    if (err instanceof ResultInvalid) return "bad result";
    if (err instanceof Unanswered) return "retry"; // what WorkerRun retries until its lease deadline
    throw err;
  }
}

function kubeconfig(url: string): string {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "tether-publications-"));
  const file = path.join(dir, "kubeconfig");
  fs.writeFileSync(file, JSON.stringify({
    apiVersion: "v1", kind: "Config", "current-context": "pod",
    clusters: [{ name: "pod", cluster: { server: url, "insecure-skip-tls-verify": true } }],
    users: [{ name: "pod", user: { token: "tok" } }],
    contexts: [{ name: "pod", context: { cluster: "pod", user: "pod", namespace: w.namespace } }],
  }));
  return file;
}

describe("a pod publication's answer (docs/protocol.md §5.4)", () => {
  for (const v of VECTORS.pod) {
    it(`${v.name}: ${v.outcome}`, async () => {
      const seen: Seen[] = [];
      const api = await serve((req) => {
        seen.push(req);
        return reply(v);
      });
      try {
        const kc = loadKubeConfig({ env: { KUBECONFIG: kubeconfig(api.url) } });
        const t = new KubeTransport(w.namespace, w.name, w.holder, w.fence, w.runUid, kc, 2);
        assert.equal(await outcome(() => t.publish("result", VECTORS.result)), v.outcome);
        assert.deepEqual(seen.map((s) => s.method), ["PATCH"]);
      } finally {
        await api.close();
      }
    });
  }
});

describe("a gateway publication's answer (docs/protocol.md §6.3)", () => {
  for (const v of VECTORS.gateway) {
    it(`${v.name}: ${v.outcome}`, async () => {
      const gw = await serve(() => reply(v));
      try {
        const t = new GatewayTransport(gw.url, w.namespace, w.name, "tok", w.holder, w.fence, 2, w.workerId, w.runUid);
        assert.equal(await outcome(() => t.publish("result", VECTORS.result)), v.outcome);
      } finally {
        await gw.close();
      }
    });
  }
});
