import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { describe, it } from "node:test";

describe("SIGTERM", () => {
  it("closes the run (a last renewal reports what was spent) and exits 143, as PID 1 would not", async () => {
    const child = spawn(process.execPath, [fileURLToPath(new URL("./sigterm-child.js", import.meta.url))],
      { stdio: ["ignore", "pipe", "inherit"] });
    let out = "";
    child.stdout.on("data", (chunk: Buffer) => {
      out += chunk.toString();
      if (out.includes("ready\n") && !child.killed) child.kill("SIGTERM");
    });
    const code = await new Promise<number | null>((resolve) => child.on("exit", (c) => resolve(c)));
    assert.equal(code, 143);
    const report = JSON.parse(out.split("\n").filter((line) => line.startsWith("{")).pop() ?? "{}");
    assert.equal(report.code, 143);
    assert.equal(report.renewals.length, 2); // start's renewal, then the last one on close
    assert.deepEqual(report.renewals[1].usage, { cents: 7, tokens: 0 });
    assert.equal(report.closed, true);
  });
});
