/** Run by sigterm.test.ts as a child process: a started WorkerRun, then SIGTERM from the parent. */

import { WorkerRun } from "../src/run.js";
import { FakeClock, FakeTransport } from "./fakes.js";

const transport = new FakeTransport();
const run = new WorkerRun({
  name: "job", namespace: "ns", holder: "job-a1", fence: 1, attempt: 1,
  leaseDurationSeconds: 10, renewIntervalSeconds: 2, transport, clock: new FakeClock(),
  logger: () => {},
});
process.on("exit", (code) => {
  process.stdout.write(`${JSON.stringify({ code, renewals: transport.renewals, closed: transport.closed })}\n`);
});
await run.start();
run.reportUsage({ cents: 7 });
process.stdout.write("ready\n");
setInterval(() => {}, 1000); // a worker busy with its job
