"""The agent loop's risky step as a child run of its own (agent.py, with riskyTool): it sends the
step the parent's person approved, once, as a fenced side effect, and returns the receiver's
answer as its result. Its lease, retries and key are its own: a lost tool pod is retried as this
run, not by redoing the agent's cycle, and a retried attempt's step is replayed by the receiver
(the same Idempotency-Key), never done twice.

Payload (set by the parent's spawn): step, proposal, effectUrl.
"""

from __future__ import annotations

import asyncio

from tether import logs
from tether.worker import AsyncWorkerRun


async def main() -> int:
    logs.setup()
    async with AsyncWorkerRun.from_env() as run, run.http_client(timeout=30) as effects:
        p = run.payload
        if not p.get("effectUrl"):
            await run.complete({"sent": False, "why": "no effectUrl"})
            return 0
        await asyncio.sleep(float(p.get("workSeconds", 0)))  # the tool's own work, before its effect
        sent = await effects.effect("POST", p["effectUrl"], operation="risky-step",
                                    json={"step": p["step"], "attempt": run.attempt, "proposal": p["proposal"]})
        sent.raise_for_status()
        await run.complete({"sent": True, "status": sent.status_code})
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
