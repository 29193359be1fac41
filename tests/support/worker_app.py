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
  model         while holding, spend on a model API through the SDK's meter instead of usagePerSecond:
                {"url", "prices", "model", "stream": bool}, one call a second (its message names the
                holder), each recorded with how it ended; a call refused (the meter faulted on a cut
                answer, or the run may not spend) ends the calls, the hold goes on
  checkpoint    a checkpoint written once at start (then no progress)
  checkpointEverySeconds  while holding, a new checkpoint this often, except while paused (spec.suspend)
  holdSeconds   longest hold (default 120)
  holdWhileUnknown  keep holding while ownership is unknown (an outage); stop only when lost
  failAttempts  attempts that publish an error (code "Injected") instead of a result
  stopOnSignal  leave the hold when the control plane says stop, and exit without a result
  failOnYield   told to yield (Kueue evicted the run), publish an error (code "Yielded") before
                leaving: a publication racing the eviction's end of the attempt
  approval      after the hold, ask for this approval (request_approval) and record what came back
                (told to stop meanwhile, with stopOnSignal: leave without a result, as in the hold)
While holding, every change of the control signals is recorded with the wall time it was seen.
Attempts not in holdAttempts work `workSeconds`, send the side effect, and complete.
SIGTERM is recorded and otherwise ignored, so a worker cut off from the cluster stays alive.

Environment TETHER_TEST_SDK=asyncio runs the same script on AsyncWorkerRun instead of WorkerRun
(the fault trials hand runs to either flavour; outFile records say which): one script, two
adapters that make every SDK call awaitable.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tether import logs
from tether.worker import (AsyncWorkerRun, LeaseLost, OwnershipUnknown, StopRequested, ToolTimeout,
                           WorkerRun)
from tether.worker.metering import Meter, MeteringError, RunStopped
from tether.worker.run import ApprovalDecision


class _Blocking:
    """WorkerRun behind awaitable calls: each one blocks, as the program would without asyncio
    (its heartbeat is a thread, so nothing else on this loop needs to run)."""

    sdk = "blocking"

    def __init__(self, run: WorkerRun) -> None:
        self.run = run

    async def start(self) -> None:
        self.run.start()

    async def stop(self) -> None:
        self.run.stop()

    async def renew(self) -> bool:
        return self.run.renew()

    async def request_approval(self, name: str, details: str) -> ApprovalDecision:
        return self.run.request_approval(name, details)

    async def complete(self, result: dict[str, Any]) -> None:
        self.run.complete(result)

    async def fail(self, code: str, message: str) -> None:
        self.run.fail(code, message)

    async def effect(self, url: str, **kw: Any) -> httpx.Response:
        with self.run.http_client(timeout=180) as http:
            return http.effect("POST", url, **kw)

    async def ask(self, meter: Meter, url: str, body: dict[str, Any]) -> None:
        """One model call through the meter, its answer read to the end."""
        with httpx.Client(transport=meter.transport(), timeout=30) as http:
            with http.stream("POST", url, json=body) as answer:
                answer.raise_for_status()
                for _ in answer.iter_bytes():
                    pass


class _Asyncio(_Blocking):
    sdk = "asyncio"
    run: AsyncWorkerRun  # type: ignore[assignment]

    def __init__(self, run: AsyncWorkerRun) -> None:
        self.run = run  # type: ignore[assignment]

    async def start(self) -> None:
        await self.run.start()

    async def stop(self) -> None:
        await self.run.stop()

    async def renew(self) -> bool:
        return await self.run.renew()

    async def request_approval(self, name: str, details: str) -> ApprovalDecision:
        return await self.run.request_approval(name, details)

    async def ask(self, meter: Meter, url: str, body: dict[str, Any]) -> None:
        async with httpx.AsyncClient(transport=meter.async_transport(), timeout=30) as http:
            async with http.stream("POST", url, json=body) as answer:
                answer.raise_for_status()
                async for _ in answer.aiter_bytes():
                    pass

    async def complete(self, result: dict[str, Any]) -> None:
        await self.run.complete(result)

    async def fail(self, code: str, message: str) -> None:
        await self.run.fail(code, message)

    async def effect(self, url: str, **kw: Any) -> httpx.Response:
        async with self.run.http_client(timeout=180) as http:
            return await http.effect("POST", url, **kw)


async def script(sdk: _Blocking) -> int:
    run = sdk.run
    out: list[Path | None] = [None]

    def record(**kw: object) -> None:
        if out[0] is not None:
            with out[0].open("a") as f:
                f.write(json.dumps({"attempt": run.attempt, "fence": run.fence, "pid": os.getpid(),
                                    "runUid": os.environ.get("TETHER_RUN_UID"), "sdk": sdk.sdk, **kw}) + "\n")

    # Set before start(): the SDKs keep a SIGTERM handler the program set.
    signal.signal(signal.SIGTERM, lambda *_: record(event="sigterm"))
    await sdk.start()  # (the asyncio flavour reads a payload too large for the environment here)
    p = run.payload
    out[0] = Path(p["outFile"]) if p.get("outFile") else None
    record(event="started", owned=run.owned, resumeFrom=run.checkpoint_cursor)
    if p.get("checkpoint"):
        run.checkpoint(p["checkpoint"], flush=True)
    if p.get("usageCents"):
        run.report_usage(cents=int(p["usageCents"]))
        await sdk.renew()
        record(event="usage_reported", cents=int(p["usageCents"]))
    if run.attempt in p.get("holdAttempts", []):
        gate = Path(p["gateFile"]) if p.get("gateFile") else None
        began, seen = time.monotonic(), None
        every = p.get("checkpointEverySeconds")
        progress = int(run.checkpoint_cursor) if (run.checkpoint_cursor or "").isdigit() else 0  # resumed from
        next_checkpoint = began
        model = p.get("model")
        meter = Meter(run, model["prices"], base_cents=int(p.get("usageCents", 0))) if model else None
        calls, next_call = 0, began
        # holdWhileUnknown: a healthy worker that waits out an outage (only a confirmed loss ends it).
        holding = (lambda: not run.lost) if p.get("holdWhileUnknown") else (lambda: run.owned)
        while not (gate is not None and gate.exists()) and holding() \
                and time.monotonic() - began < float(p.get("holdSeconds", 120)):
            if p.get("failOnYield") and run.signals.stop and run.signals.yielding:
                try:
                    await sdk.fail("Yielded", f"attempt {run.attempt} yields with an error")
                    record(event="yield_error", accepted=True)
                except (LeaseLost, OwnershipUnknown) as exc:
                    record(event="yield_error", accepted=False, error=type(exc).__name__)
                await sdk.stop()
                return 0
            if p.get("stopOnSignal") and run.signals.stop:
                # A worker that honours the kill switch: it ends without publishing anything.
                record(event="stopped", reason=run.signals.reason)
                await sdk.stop()
                return 0
            if meter is not None and model is not None and time.monotonic() >= next_call:
                calls, next_call = calls + 1, time.monotonic() + 1.0
                body = {"model": model["model"], "stream": bool(model.get("stream")), "max_tokens": 64,
                        "messages": [{"role": "user",
                                      "content": f"{os.environ.get('TETHER_RUN_UID')} {run.holder} {calls}"}]}
                try:
                    await sdk.ask(meter, model["url"], body)
                    outcome = "ok"
                except RunStopped:
                    outcome = "stopped"
                except MeteringError:
                    outcome = "refused"
                except httpx.HTTPError as exc:  # the answer was cut: the meter faults, later calls are refused
                    outcome = f"cut ({type(exc).__name__})"
                record(event="model_call", n=calls, outcome=outcome, cents=meter.cents, tokens=meter.tokens,
                       fault=meter.fault)
                if outcome in ("stopped", "refused"):
                    next_call = float("inf")
            elif p.get("usagePerSecond"):
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
            await asyncio.sleep(0.02)  # (the asyncio flavour's heartbeat is a task: it runs meanwhile)
        record(event="gate", owned=run.owned, lost=run.lost, unknown=run.ownership_unknown)
    else:
        await asyncio.sleep(float(p.get("workSeconds", 0.5)))
    if p.get("approval"):
        try:
            decided = await sdk.request_approval(p["approval"], f"attempt {run.attempt} asks")
            record(event="approval", decision=decided.decision, reason=decided.reason)
        except (LeaseLost, OwnershipUnknown) as exc:
            record(event="approval_refused", error=type(exc).__name__)
        except StopRequested:
            if not p.get("stopOnSignal"):
                raise
            record(event="stopped", reason=run.signals.reason)
            await sdk.stop()
            return 0
    if p.get("effectUrl"):
        try:
            resp = await sdk.effect(p["effectUrl"], operation="deliver", json={"attempt": run.attempt})
            record(event="effect", status=resp.status_code, body=resp.text)
        except (LeaseLost, OwnershipUnknown) as exc:
            record(event="effect_not_sent", error=type(exc).__name__)
        except (ToolTimeout, httpx.HTTPError) as exc:
            record(event="effect_error", error=repr(exc))
    renewed = await sdk.renew()
    record(event="renew", renewed=renewed, lost=run.lost, unknown=run.ownership_unknown)
    try:
        if run.attempt in p.get("failAttempts", []):
            await sdk.fail("Injected", f"attempt {run.attempt} fails on purpose")
        else:
            await sdk.complete({"attempt": run.attempt})
        record(event="complete", accepted=True)
    except (LeaseLost, OwnershipUnknown) as exc:
        record(event="complete", accepted=False, error=type(exc).__name__)
    await sdk.stop()
    return 0


def main() -> int:
    logs.setup()
    if os.environ.get("TETHER_TEST_SDK") == "asyncio":
        return asyncio.run(script(_Asyncio(AsyncWorkerRun.from_env())))
    return asyncio.run(script(_Blocking(WorkerRun.from_env())))


if __name__ == "__main__":
    sys.exit(main())
