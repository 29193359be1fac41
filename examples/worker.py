"""An example Tether worker: a job of N steps that checkpoints after each one.

Payload (spec.payload):
  steps         how many steps (default 5)
  stepSeconds   how long each step takes (default 1)
  crashAttempts attempts on which the worker crashes halfway (exit code 3), e.g. [1]
  effectUrl     if set, one side effect (POST) is sent after the last step, fenced and idempotent
  centsPerStep  usage reported per step (default 1)
  approval      if set, e.g. {"name": "send-report", "details": "POST the report", "timeoutSeconds": 600},
                the worker asks a person (a WorkerRunApproval with that gate) before its side effect,
                and sends it only if approved

A result denied by a reviewer (spec.review.result) comes back as the next attempt's
run.review_feedback, which this worker puts into its result.

Resumes from the last checkpoint when a previous attempt was lost.
"""

from __future__ import annotations

import logging
import sys
import time

from tether import logs
from tether.worker import StopRequested, WorkerRun

log = logging.getLogger("example-worker")


def main() -> int:
    logs.setup()
    with WorkerRun.from_env() as run:
        steps = int(run.payload.get("steps", 5))
        step_seconds = float(run.payload.get("stepSeconds", 1))
        start = int(run.checkpoint_cursor or 0)
        log.info("starting", extra={"event": "worker_started", "attempt": run.attempt, "fence": run.fence,
                                    "resumeFrom": start})
        for step in range(start, steps):
            if run.signals.paused:
                log.info("paused", extra={"event": "worker_paused", "step": step})
            while run.signals.paused and not run.signals.stop:
                time.sleep(0.2)  # suspended: hold on (the heartbeat goes on) until resumed
            try:
                run.ensure_owner()  # self-fencing: no work without confirmed ownership
            except StopRequested as stop:
                log.info("stopping as told", extra={"event": "worker_stopped", "reason": str(stop), "step": step})
                return 0
            time.sleep(step_seconds)
            if run.attempt in run.payload.get("crashAttempts", []) and step >= steps // 2:
                log.error("crashing on purpose", extra={"event": "worker_crash", "step": step})
                return 3
            run.checkpoint(str(step + 1), flush=True)
            cents = int(run.payload.get("centsPerStep", 1))
            run.report_usage(cents=cents * (step + 1 - start), tokens=100 * (step + 1 - start))
        asked = run.payload.get("approval")
        decision = None
        if asked:
            decision = run.request_approval(asked["name"], asked.get("details", ""), asked.get("timeoutSeconds"))
            log.info("approval decided", extra={"event": "worker_approval", "request": asked["name"],
                                                "decision": decision.decision, "reason": decision.reason})
        if run.payload.get("effectUrl") and (decision is None or decision.approved):
            with run.http_client() as http:
                resp = http.effect("POST", run.payload["effectUrl"], operation="deliver",
                                   json={"steps": steps})
                log.info("side effect sent", extra={"event": "effect_sent", "status": resp.status_code})
        result: dict[str, object] = {"steps": steps, "resumedFrom": start}
        if decision is not None:
            result["approval"] = {"decision": decision.decision, "reason": decision.reason,
                                  "approver": decision.approver}
        if run.review_feedback:
            result["feedback"] = run.review_feedback  # what the reviewer asked of this attempt
        run.complete(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
