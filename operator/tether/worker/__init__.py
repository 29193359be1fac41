"""Worker SDK: hold a run's lease, fence yourself, publish results with fenced writes.

    from tether.worker import WorkerRun

    with WorkerRun.from_env() as run:
        for step in range(int(run.checkpoint_cursor or 0), 10):
            run.ensure_owner()
            do_step(step)
            run.checkpoint(str(step + 1))
        run.complete({"steps": 10})
"""

from tether.worker.errors import (ClaimRefused, LeaseLost, OwnershipUnknown, ResultInvalid, StopRequested,
                                  TetherWorkerError, ToolTimeout)
from tether.worker.run import ApprovalDecision, ControlSignals, FencedClient, WorkerRun

__all__ = ["ApprovalDecision", "ClaimRefused", "WorkerRun", "FencedClient", "ControlSignals", "LeaseLost", "OwnershipUnknown", "ResultInvalid",
           "StopRequested",
           "ToolTimeout", "TetherWorkerError"]
