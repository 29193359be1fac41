"""The conformance worker for the Python SDK (conformance/WORKER.md): the kit runs it as a pod's
command or as an external process, and judges the SDK by what it does through the protocol.

    python -m tether.worker.conformance

It uses only the SDK's public API: a step it cannot express would be a missing SDK feature."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tether import logs
import httpx

from tether.worker import LeaseLost, OwnershipUnknown, ResultInvalid, StopRequested, ToolTimeout, WorkerRun

POLL = 0.05


def _start() -> WorkerRun:
    gateway = os.environ.get("TETHER_GATEWAY_URL")
    if not gateway:
        return WorkerRun.from_env().start()
    token = Path(os.environ["TETHER_GATEWAY_TOKEN_FILE"]).read_text().strip()
    run = WorkerRun.claim(gateway, os.environ["TETHER_NAMESPACE"], os.environ["TETHER_RUN"], token,
                          worker_id=os.environ.get("TETHER_WORKER_ID") or None)
    return run.start()


def _gate(run: WorkerRun, cents: int, tokens: int) -> str | None:
    """Waits until the next step may start; returns why the program must end instead."""
    while True:
        sig = run.signals
        if sig.stop:
            return "stop"
        if (sig.cap_remaining_cents is not None and sig.cap_remaining_cents < cents) or \
                (sig.cap_remaining_tokens is not None and sig.cap_remaining_tokens < tokens):
            return "cap"
        if run.lost:
            return "lost"
        if not sig.paused and run.owned:
            return None
        time.sleep(POLL)


EXIT_BROKEN = 70  # the program itself failed (WORKER.md): never mistaken for lost (1) or unknown (2)


def main() -> int:
    try:
        return _main()
    except Exception:  # noqa: BLE001 - any bug ends with its own code and its traceback
        traceback.print_exc()
        return EXIT_BROKEN


def _main() -> int:
    logs.setup()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a partitioned node: only the protocol may stop us
    try:
        run = _start()
    except Exception as exc:  # noqa: BLE001 - any refused claim ends the program with its own code
        print(f"start failed: {exc}", file=sys.stderr)
        return 4
    p: dict[str, Any] = run.payload
    steps, step_seconds = int(p.get("steps", 3)), float(p.get("stepSeconds", 0.5))
    cents, tokens = int(p.get("centsPerStep", 0)), int(p.get("tokensPerStep", 0))
    effect_url = p.get("effectUrl")
    crash = run.attempt in p.get("crashAttempts", [])
    crash_after = int(p.get("crashAfterStep", 1))
    done = 0
    with run.http_client(timeout=10) as http:
        step = int(run.checkpoint_cursor or 0)
        while step < steps:
            why = _gate(run, cents, tokens)
            if why is not None:
                run.stop()
                return 1 if why == "lost" else 0
            time.sleep(step_seconds)
            if effect_url:
                try:
                    resp = http.effect("POST", effect_url, operation=f"step-{step}",
                                       json={"run": run.name, "attempt": run.attempt, "fence": run.fence, "step": step})
                except (LeaseLost, OwnershipUnknown, StopRequested, ToolTimeout, httpx.TransportError):
                    continue  # not sent, or no answer: back to the gate for this same step (same key)
                if resp.status_code == 409 and _error_code(resp) == "InProgress":
                    continue  # the same key is still running: try this step again
                if resp.status_code == 409 and _error_code(resp) == "StaleFence":
                    run.stop()
                    return 1
                if resp.status_code >= 500:
                    continue  # not done (a receiver stores no 5xx): again, with the same key
                if resp.status_code >= 300:
                    print(f"the receiver refused the step: {resp.status_code}", file=sys.stderr)
                    run.stop()
                    return EXIT_BROKEN
            done += 1
            run.checkpoint(str(step + 1))
            run.report_usage(cents=done * cents, tokens=done * tokens)
            step += 1
            if crash and step == crash_after:
                # The checkpoint lands before the crash: renew until one is confirmed (or lost).
                deadline = time.monotonic() + run.lease_duration
                while not run.renew() and not run.lost and time.monotonic() < deadline:
                    time.sleep(run.renew_interval)  # at most one renewal per interval
                os._exit(3)
    try:
        if run.attempt in p.get("failAttempts", []):
            run.fail("ConformanceFailure", f"attempt {run.attempt} fails on purpose")
        else:
            result: dict[str, Any] = {"steps": steps, "attempt": run.attempt, "sdk": "python"}
            asked = p.get("approval")
            if asked:
                try:
                    decided = run.request_approval(asked["name"], asked.get("details", ""), asked.get("timeoutSeconds"))
                except StopRequested:
                    return 0  # told to stop while waiting: publish nothing (the run is closed below)
                result["approval"] = {"decision": decided.decision, "reason": decided.reason,
                                      "approver": decided.approver}
            if p.get("badResultFirst"):
                try:
                    run.complete([1])  # type: ignore[arg-type]
                    print("the invalid result was accepted", file=sys.stderr)
                    return 5
                except ResultInvalid:
                    pass
            if p.get("oversizeResultFirst"):
                try:
                    run.complete({"pad": "x" * int(p["oversizeResultFirst"])})
                    print("the oversize result was accepted", file=sys.stderr)
                    return 5
                except ResultInvalid:
                    pass  # too large: a bad result, and still ours (docs/protocol.md §5.4)
            try:
                run.complete(result)
            except ResultInvalid as exc:
                run.fail("ConformanceBadResult", str(exc)[:500])
    except LeaseLost:
        return 1
    except OwnershipUnknown:
        return 2
    finally:
        run.stop()
    return 0


def _error_code(resp: httpx.Response) -> str | None:
    try:
        doc = resp.json()
    except ValueError:
        return None
    return doc.get("error") if isinstance(doc, dict) else None


if __name__ == "__main__":
    sys.exit(main())
