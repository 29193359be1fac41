/**
 * Tether worker SDK: hold a WorkerRun's lease, fence yourself and your side effects, publish the
 * result with a fenced write.
 *
 *     await using run = await WorkerRun.fromEnv();
 *     for (let step = Number(run.checkpointCursor ?? 0); step < 10; step++) {
 *       run.ensureOwner();
 *       await doStep(step);
 *       await run.checkpoint(String(step + 1));
 *     }
 *     await run.complete({ steps: 10 });
 */

export { WorkerRun } from "./run.js";
export type {
  ApprovalDecision, ApprovalOptions, ClaimOptions, EffectOptions, FromEnvOptions, StartOptions, WorkerRunOptions,
} from "./run.js";
export { Child } from "./children.js";
export type { CallOptions, ChildResultOptions, Parent, SpawnOptions } from "./children.js";
export * as children from "./children.js";
export {
  ChildFailed,
  ClaimRefused,
  LeaseLost,
  OwnershipUnknown,
  ResultInvalid,
  SpawnConflict,
  SpawnRefused,
  StopRequested,
  TetherWorkerError,
  ToolTimeout,
} from "./errors.js";
export type { InvalidCause } from "./errors.js";
export { systemClock } from "./clock.js";
export type { Clock, SleepOptions } from "./clock.js";
export { jsonLogger } from "./log.js";
export type { LogLevel, Logger } from "./log.js";
export { Unanswered, confirmed, unconfirmed } from "./transport.js";
export type { Renewal, Transport } from "./transport.js";
export { KubeTransport, TokenFileAuth, loadKubeConfig } from "./kube.js";
export type { KubeConfigSource } from "./kube.js";
export { GatewayTransport } from "./gateway.js";
export type { ClaimReply, ToolClaim } from "./gateway.js";
export * as protocol from "./protocol.js";
export { attemptContext, formatTraceparent, parseTraceparent } from "./tracing.js";
export type { ApprovalRequest, ControlSignals, GateDecision, Json, JsonObject, Ownership, Usage } from "./protocol.js";
export { MalformedUsage, Meter, MeteringError, PriceTable, RunStopped, UnpricedModel, meteredFetch } from "./metering.js";
export type { MeterOptions, ModelPrice, UsageReporter } from "./metering.js";
