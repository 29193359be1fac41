"""The three ways a worker can lose confidence, kept apart on purpose."""

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

    Finish or abandon the current step and exit; start no new side effect.
    """


class ClaimRefused(TetherWorkerError):
    """The gateway did not hand out the run (402 budget, 409 held or nothing open, 403, ...)."""

    def __init__(self, status: int, error: dict[str, object]) -> None:
        super().__init__(f"claim refused: {status} {error.get('code', '')}: {error.get('message', '')}")
        self.status = status
        self.code = str(error.get("code", ""))
