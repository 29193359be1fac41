"""An example asyncio worker: N steps, each a fenced side effect, checkpointed after each one.

Payload (spec.payload):
  steps        how many steps (default 5)
  stepSeconds  how long each step's own work takes (default 1)
  effectUrl    where each step's side effect goes (a POST, fenced and idempotent; none: no effect)

Resumes from the last checkpoint when a previous attempt was lost. Everything awaits: the heartbeat
is a task on the same event loop, so a step must never block it (blocking work goes through
asyncio.to_thread, as the simulated work below does).
"""

from __future__ import annotations

import asyncio
import logging
import time

from tether import logs
from tether.worker import AsyncWorkerRun, StopRequested

log = logging.getLogger("example-async-worker")


async def main() -> int:
    logs.setup()
    async with AsyncWorkerRun.from_env() as run, run.http_client(timeout=10) as http:
        steps = int(run.payload.get("steps", 5))
        start = int(run.checkpoint_cursor or 0)
        log.info("starting", extra={"event": "worker_started", "attempt": run.attempt, "resumeFrom": start})
        for step in range(start, steps):
            while run.signals.paused and not run.signals.stop:
                await asyncio.sleep(0.2)  # suspended: the heartbeat goes on until resumed
            try:
                run.ensure_owner()  # self-fencing: no work without confirmed ownership
            except StopRequested as stop:
                # Told to stop (or, with stop.yielding, evicted by Kueue): the checkpoint so far
                # rides on the last renewal as the run is closed, and the next attempt resumes.
                log.info("stopping as told", extra={"event": "worker_stopped", "reason": str(stop)})
                return 0
            # Blocking work (a library without asyncio) runs on a thread, never on the loop.
            await asyncio.to_thread(time.sleep, float(run.payload.get("stepSeconds", 1)))
            if run.payload.get("effectUrl"):
                # Idempotency-Key "<idempotencyKey>:step-N" is the same in every attempt, so a
                # repeated step is replayed by the receiver, never done twice; the fence header lets
                # it refuse a superseded attempt. The call refuses to start unless ownership is confirmed.
                resp = await http.effect("POST", run.payload["effectUrl"], operation=f"step-{step}",
                                         json={"step": step})
                resp.raise_for_status()
            run.checkpoint(str(step + 1), flush=True)  # plain call: it rides on the next renewal
            run.report_usage(cents=step + 1 - start, tokens=100 * (step + 1 - start))
        await run.complete({"steps": steps, "attempt": run.attempt})
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
