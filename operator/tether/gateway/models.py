"""Request and response bodies of the gateway (the OpenAPI document is generated from them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from tether.children.api import KEY_PATTERN
from tether.children.bodies import MAX_GENERATIONS
from tether.protocol import MAX_CENTS, MAX_REQUEST_DETAILS, MAX_REQUEST_TIMEOUT, MAX_REQUESTS_PER_ATTEMPT, MAX_TOKENS


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UsageReport(_Body):
    cents: int = Field(ge=0, le=MAX_CENTS, description="Cumulative cents of this attempt.")
    tokens: int = Field(default=0, ge=0, le=MAX_TOKENS, description="Cumulative tokens of this attempt.")


def _worker_id() -> Any:
    return Field(default=None, max_length=253,
                 description="Distinguishes processes that share one identity; a later call that names a "
                             "worker must name the one that claimed.")


class ClaimRequest(_Body):
    workerId: str | None = _worker_id()


class Fenced(_Body):
    holder: str = Field(min_length=1, max_length=253, description="The holder returned by claim.")
    fence: int = Field(ge=1, description="The fence returned by claim.")
    workerId: str | None = _worker_id()
    runUid: str | None = Field(default=None, max_length=128,
                               description="The runUid returned by claim: the call then acts only on that run, "
                                           "never on one re-created under the same name since.")


class ApprovalAsk(_Body):
    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                      description="What a WorkerRunApproval's spec.gate names to decide it (not start or result).")
    details: str = Field(default="", max_length=MAX_REQUEST_DETAILS, description="What the worker wants to do.")
    timeoutSeconds: int | None = Field(default=None, ge=1, le=MAX_REQUEST_TIMEOUT,
                                       description="Decided TimedOut when nobody decides within it.")


class HeartbeatRequest(Fenced):
    usage: UsageReport | None = None
    checkpoint: str | None = Field(default=None, max_length=1024)
    requests: list[ApprovalAsk] | None = Field(default=None, max_length=MAX_REQUESTS_PER_ATTEMPT,
                                               description="Approvals this attempt asks for (sent again each time).")


class ApprovalRequest(Fenced, ApprovalAsk):
    """Asks for one approval; the decision comes back in this and every later heartbeat reply."""


class CheckpointRequest(Fenced):
    cursor: str = Field(min_length=1, max_length=1024)
    usage: UsageReport | None = None


class CompleteRequest(Fenced):
    result: dict[str, Any]


class ErrorDetail(_Body):
    code: str = Field(min_length=1, max_length=128)
    message: str = Field(default="", max_length=4096)


class FailRequest(Fenced):
    error: ErrorDetail


class CancelRequest(Fenced):
    reason: str = Field(default="", max_length=1024)


class _Acting(Fenced):
    runUid: str = Field(min_length=1, max_length=128,  # type: ignore[assignment]
                        description="The runUid returned by claim (required: a child is of that very run).")


class SpawnRequest(_Acting):
    """Spawns a child run in the name of this attempt (docs/children.md); the gateway names and builds it."""

    key: str = Field(min_length=1, max_length=128, pattern=KEY_PATTERN.pattern,
                     description="The call's stable name: the same key is the same child, across attempts.")
    generation: StrictInt = Field(default=0, ge=0, lt=MAX_GENERATIONS,
                            description="How many children of this key were rejected as a stale attempt's.")
    spec: dict[str, Any] = Field(description="The child's WorkerRun spec as asked (className included; no parentRef).")


class ChildRequest(_Acting):
    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                      description="A child's name, as spawn returned it.")


class ChildReply(BaseModel):
    child: dict[str, Any] = Field(description="The child WorkerRun as the API server holds it.")


class GateDecision(BaseModel):
    decision: str = Field(description="Approve, Deny or TimedOut.")
    reason: str | None = None
    approver: str | None = None


class ToolClaim(BaseModel):
    token: str
    expiresAt: str
    serviceAccount: str


class Signals(BaseModel):
    """The reply to every call that renews (claim, heartbeat, checkpoint, approval). It names the
    attempt it renewed, so a worker tells it from any other 200 (a proxy's `{}`): docs/protocol.md §6.4."""

    holder: str = Field(description="The holder whose lease this call renewed.")
    fence: int = Field(description="The fence of the attempt this call renewed.")
    runUid: str = Field(description="The UID of the run renewed. Send it back with every call: the run may be "
                                    "re-created under its name.")
    leaseExpiresAt: str
    stop: bool
    paused: bool
    yield_: bool = Field(default=False, alias="yield",
                         description="With stop: Kueue evicted the run; checkpoint and exit (it resumes from there).")
    stopBy: str | None = Field(default=None, description="With yield: when the attempt is revoked regardless.")
    endsAt: str | None = None
    capRemainingCents: int | None = None
    capRemainingTokens: int | None = None
    status: str
    toolClaim: ToolClaim | None = None
    decisions: dict[str, GateDecision] = Field(default_factory=dict,
                                               description="Decisions on this attempt's requests, by name.")


class ApprovalResponse(Signals):
    decision: GateDecision | None = Field(default=None, description="This request's decision; null while pending.")


class ClaimResponse(Signals):
    attempt: int
    leaseDurationSeconds: int
    renewIntervalSeconds: int
    payload: dict[str, Any] = {}
    checkpoint: str | None = None
    idempotencyKey: str
    reviewFeedback: str | None = Field(default=None, description="Why the previous attempt's result was denied.")
    traceparent: str = Field(description="The attempt's W3C trace context (a pod worker's TRACEPARENT): parent the "
                                         "worker's spans on it. A correlation id, not a credential.")


class Done(BaseModel):
    status: str = Field(description="The run's phase as the gateway read or wrote it when answering: Running "
                                    "until the operator concludes the attempt (moments later), then its outcome "
                                    "(Succeeded, Failed, ...). Informational: the 200 itself says the "
                                    "publication is accepted.")
    fence: int


class ErrorBody(BaseModel):
    code: str
    message: str
    field: str | None = None


class ErrorEnvelope(BaseModel):
    error: ErrorBody
