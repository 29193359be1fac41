"""A test worker with knobs the scenarios need (it runs inside process-kubelet pods).

Payload:
  holdAttempts  attempts that hold: they wait (checking nothing) until `gateFile` exists or
                until they are no longer sure of ownership, then try a side effect and a result
  gateFile      file whose existence opens the gate
  effectUrl     where the side effect goes
  outFile       JSON lines of what happened, read by the test
  workSeconds   how long a normal attempt works before completing
  usagePerSecond cents reported per second while holding (cumulative, on the heartbeat)
  usageCents    a fixed usage (cents) reported once at start, flushed with a renewal
  checkpoint    a checkpoint written once at start (then no progress)
  checkpointEverySeconds  while holding, a new checkpoint this often, except while paused (spec.suspend)
  holdSeconds   longest hold (default 120)
  holdWhileUnknown  keep holding while ownership is unknown (an outage); stop only when lost
  failAttempts  attempts that publish an error (code "Injected") instead of a result
  stopOnSignal  leave the hold when the control plane says stop, and exit without a result
  approval      after the hold, ask for this approval (request_approval) and record what came back
                (told to stop meanwhile, with stopOnSignal: leave without a result, as in the hold)
While holding, every change of the control signals is recorded with the wall time it was seen.
Attempts not in holdAttempts work `workSeconds`, send the side effect, and complete.
SIGTERM is recorded and otherwise ignored, so a worker cut off from the cluster stays alive.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx

from tether import logs
from tether.worker import LeaseLost, OwnershipUnknown, StopRequested, ToolTimeout, WorkerRun


def main() -> int:
    logs.setup()
    run = WorkerRun.from_env()
    p = run.payload
    out = Path(p["outFile"]) if p.get("outFile") else None

    def record(**kw: object) -> None:
        if out is not None:
            with out.open("a") as f:
                f.write(json.dumps({"attempt": run.attempt, "fence": run.fence, "pid": os.getpid(),
                                    "runUid": os.environ.get("TETHER_RUN_UID"), **kw}) + "\n")

    signal.signal(signal.SIGTERM, lambda *_: record(event="sigterm"))
    run.start()
    record(event="started", owned=run.owned, resumeFrom=run.checkpoint_cursor)
    if p.get("checkpoint"):
        run.checkpoint(p["checkpoint"], flush=True)
    if p.get("usageCents"):
        run.report_usage(cents=int(p["usageCents"]))
        run.renew()
        record(event="usage_reported", cents=int(p["usageCents"]))
    if run.attempt in p.get("holdAttempts", []):
        gate = Path(p["gateFile"]) if p.get("gateFile") else None
        began, seen = time.monotonic(), None
        every = p.get("checkpointEverySeconds")
        progress = int(run.checkpoint_cursor) if (run.checkpoint_cursor or "").isdigit() else 0  # resumed from
        next_checkpoint = began
        # holdWhileUnknown: a healthy worker that waits out an outage (only a confirmed loss ends it).
        holding = (lambda: not run.lost) if p.get("holdWhileUnknown") else (lambda: run.owned)
        while not (gate is not None and gate.exists()) and holding() \
                and time.monotonic() - began < float(p.get("holdSeconds", 120)):
            if p.get("stopOnSignal") and run.signals.stop:
                # A worker that honours the kill switch: it ends without publishing anything.
                record(event="stopped", reason=run.signals.reason)
                run.stop()
                return 0
            if p.get("usagePerSecond"):
                # Cumulative: on top of the usage reported at start (reports never decrease).
                run.report_usage(cents=int(p.get("usageCents", 0)) +
                                 int((time.monotonic() - began) * p["usagePerSecond"]))
            sig = run.signals
            if every and not sig.paused and time.monotonic() >= next_checkpoint:
                progress += 1
                run.checkpoint(str(progress))
                next_checkpoint = time.monotonic() + float(every)
            if sig != seen:
                record(event="signals", at=time.time(), stop=sig.stop, paused=sig.paused, reason=sig.reason,
                       yielding=sig.yielding, stopBy=sig.stop_by.isoformat() if sig.stop_by else None,
                       endsAt=sig.ends_at.isoformat() if sig.ends_at else None,
                       capRemainingCents=sig.cap_remaining_cents)
                seen = sig
            time.sleep(0.02)
        record(event="gate", owned=run.owned, lost=run.lost, unknown=run.ownership_unknown)
    else:
        time.sleep(float(p.get("workSeconds", 0.5)))
    if p.get("approval"):
        try:
            decided = run.request_approval(p["approval"], f"attempt {run.attempt} asks")
            record(event="approval", decision=decided.decision, reason=decided.reason)
        except (LeaseLost, OwnershipUnknown) as exc:
            record(event="approval_refused", error=type(exc).__name__)
        except StopRequested:
            if not p.get("stopOnSignal"):
                raise
            record(event="stopped", reason=run.signals.reason)
            run.stop()
            return 0
    if p.get("effectUrl"):
        try:
            with run.http_client(timeout=180) as http:
                resp = http.effect("POST", p["effectUrl"], operation="deliver", json={"attempt": run.attempt})
            record(event="effect", status=resp.status_code, body=resp.text)
        except (LeaseLost, OwnershipUnknown) as exc:
            record(event="effect_not_sent", error=type(exc).__name__)
        except (ToolTimeout, httpx.HTTPError) as exc:
            record(event="effect_error", error=repr(exc))
    renewed = run.renew()
    record(event="renew", renewed=renewed, lost=run.lost, unknown=run.ownership_unknown)
    try:
        if run.attempt in p.get("failAttempts", []):
            run.fail("Injected", f"attempt {run.attempt} fails on purpose")
        else:
            run.complete({"attempt": run.attempt})
        record(event="complete", accepted=True)
    except (LeaseLost, OwnershipUnknown) as exc:
        record(event="complete", accepted=False, error=type(exc).__name__)
    run.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
