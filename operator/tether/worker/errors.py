"""The ways a worker can lose confidence (lost, unknown, tool timeout, stop), kept apart on purpose,
and the refusals that say nothing about ownership (a bad result, a refused claim)."""

from __future__ import annotations


class TetherWorkerError(Exception):
    """Base class of the SDK's errors."""


class LeaseLost(TetherWorkerError):
    """The API server says someone else owns the run now, or no lease is left.

    Stop: start no side effect and publish nothing; the result would be rejected.
    """


class OwnershipUnknown(TetherWorkerError):
    """No renewal was confirmed within the lease duration minus a margin.

    The worker may still own the run, but it cannot know: start no new side
    effect until a renewal succeeds again.
    """


class ToolTimeout(TetherWorkerError):
    """An external call did not answer in time. Ownership is not in question;
    retrying the call with the same Idempotency-Key is safe."""


class StopRequested(TetherWorkerError):
    """The control plane told this worker to stop (spec.stop, or a cap or budget crossed).

    Finish or abandon the current step and exit; start no new side effect. `yielding`: Kueue
    evicted the run, which resumes later from the last checkpoint: checkpoint first, then exit.
    """

    def __init__(self, message: str, yielding: bool = False) -> None:
        super().__init__(message)
        self.yielding = yielding


class AlreadyPublished(TetherWorkerError):
    """This attempt already published, is publishing, or may have published (a try whose answer
    never came: cancelled, timed out) its result or error: an attempt publishes once, and nothing
    replaces what a caller was told is published. Nothing was sent. Ownership is not in question.

    After a publication cut short (in doubt), complete()/fail() with the same value may be called
    again: it reads back whether the first one landed, and publishes it again only if not."""


class ResultInvalid(TetherWorkerError, ValueError):
    """The API server (or the gateway) refused the value itself: it breaks the WorkerRun schema
    (for example a result that is not a JSON object). Ownership is not in question: the worker
    still holds the run and may publish a corrected value. `causes` are the refused fields."""

    def __init__(self, message: str, causes: list[dict[str, object]] | None = None) -> None:
        super().__init__(message)
        self.causes = causes or []


class ClaimRefused(TetherWorkerError):
    """The gateway did not hand out the run (402 budget, 409 held or nothing open, 403, ...)."""

    def __init__(self, status: int, error: dict[str, object]) -> None:
        super().__init__(f"claim refused: {status} {error.get('code', '')}: {error.get('message', '')}")
        self.status = status
        self.code = str(error.get("code", ""))


class SpawnRefused(TetherWorkerError, ValueError):
    """The API server refused the child run (an admission policy: its class is not one the parent's
    class lets it spawn, or this pod does not hold the parent; the schema: an invalid spec). The
    message says what to fix. Nothing was created."""


class SpawnConflict(TetherWorkerError):
    """The key names a child that exists and was asked for something else (another class, payload
    or cap), or that is not this parent's: one key is one tool call, never two."""


class ChildFailed(TetherWorkerError):
    """The child run ended without a result: Rejected before it started (`reason` says why:
    StaleParent, TreeBudgetExhausted, ...), or Failed, Lost, Cancelled, BudgetExceeded,
    DeadlineExceeded. `error` is what its worker published, if anything."""

    def __init__(self, name: str, phase: str, reason: str, message: str, error: dict[str, object] | None) -> None:
        super().__init__(f"child run {name} ended {phase} ({reason}): {message}")
        self.name, self.phase, self.reason, self.error = name, phase, reason, error
