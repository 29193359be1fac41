"""Worker SDK: hold a run's lease, fence yourself, publish results with fenced writes.

    from tether.worker import WorkerRun

    with WorkerRun.from_env() as run:
        for step in range(int(run.checkpoint_cursor or 0), 10):
            run.ensure_owner()
            do_step(step)
            run.checkpoint(str(step + 1))
        run.complete({"steps": 10})

asyncio programs: `async with AsyncWorkerRun.from_env() as run:` (tether.worker.aio), the same
protocol with awaits.
"""

from tether.worker.errors import (AlreadyPublished, ChildFailed, ClaimRefused, LeaseLost, OwnershipUnknown, ResultInvalid,
                                  SpawnConflict, SpawnRefused, StopRequested, TetherWorkerError, ToolTimeout)
from tether.worker.spawning import Child
from tether.worker.run import ApprovalDecision, ControlSignals, FencedClient, WorkerRun
from tether.worker.aio import AsyncFencedClient, AsyncWorkerRun

__all__ = ["AlreadyPublished", "ApprovalDecision", "AsyncFencedClient", "AsyncWorkerRun", "Child", "ChildFailed",
           "ClaimRefused", "SpawnConflict", "SpawnRefused", "WorkerRun", "FencedClient", "ControlSignals", "LeaseLost", "OwnershipUnknown", "ResultInvalid",
           "StopRequested",
           "ToolTimeout", "TetherWorkerError"]
