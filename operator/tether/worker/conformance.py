"""The conformance worker for the Python SDK (conformance/WORKER.md): the kit runs it as a pod's
command or as an external process, and judges the SDK by what it does through the protocol.

    python -m tether.worker.conformance

It uses only the SDK's public API: a step it cannot express would be a missing SDK feature. What
the script says and how each answer is judged is shared with the asyncio worker
(tether.worker.aio_conformance), which only drives it with awaits."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Generator

from tether import logs
import httpx

from tether.worker import (ChildFailed, LeaseLost, OwnershipUnknown, ResultInvalid, SpawnConflict, SpawnRefused,
                           StopRequested, ToolTimeout, WorkerRun)
from tether.worker.core import RunCore
from tether.worker.steps import drive

POLL = 0.05
CHILD_POLL = 0.5  # how often a child's end is looked for (WORKER.md: every second or less)


# Not sent (refused by self-fencing, or told to stop) or no answer: back to the gate, same key.
NOT_SENT = (LeaseLost, OwnershipUnknown, StopRequested, ToolTimeout, httpx.TransportError)
EXIT_BROKEN = 70  # the program itself failed (WORKER.md): never mistaken for lost (1) or unknown (2)
WAIT = "wait"


class Script:
    """The run's payload (conformance/WORKER.md, "The script") as this attempt reads it."""

    def __init__(self, run: RunCore, sdk: str) -> None:
        p: dict[str, Any] = run.payload
        self.run, self.sdk, self.p = run, sdk, p
        self.steps, self.step_seconds = int(p.get("steps", 3)), float(p.get("stepSeconds", 0.5))
        self.cents, self.tokens = int(p.get("centsPerStep", 0)), int(p.get("tokensPerStep", 0))
        self.effect_url: str | None = p.get("effectUrl")
        self.crash, self.crash_after = run.attempt in p.get("crashAttempts", []), int(p.get("crashAfterStep", 1))
        self.fails = run.attempt in p.get("failAttempts", [])
        self.approval: dict[str, Any] | None = p.get("approval")
        self.spawn: dict[str, Any] | None = p.get("spawn")
        self.child: dict[str, Any] | None = None  # what the result says of the child (WORKER.md 4)
        self.done = 0

    def gate(self) -> str | None:
        """Why the program must end ("stop", "cap", "lost"), None when the next step may start, WAIT."""
        run, sig = self.run, self.run.signals
        if sig.stop:
            return "stop"
        if (sig.cap_remaining_cents is not None and sig.cap_remaining_cents < self.cents) or \
                (sig.cap_remaining_tokens is not None and sig.cap_remaining_tokens < self.tokens):
            return "cap"
        if run.lost:
            return "lost"
        return None if not sig.paused and run.owned else WAIT

    def effect(self, step: int) -> dict[str, Any]:
        return {"json": {"run": self.run.name, "attempt": self.run.attempt, "fence": self.run.fence, "step": step}}

    def stepped(self, step: int) -> bool:
        """Records a step done (checkpoint, cumulative usage); True when the attempt crashes now."""
        self.done += 1
        self.run.checkpoint(str(step + 1))
        self.run.report_usage(cents=self.done * self.cents, tokens=self.done * self.tokens)
        return self.crash and step + 1 == self.crash_after

    def result(self, decided: Any = None) -> dict[str, Any]:
        result: dict[str, Any] = {"steps": self.steps, "attempt": self.run.attempt, "sdk": self.sdk}
        if self.child is not None:
            result.update(self.child)
        if decided is not None:
            result["approval"] = {"decision": decided.decision, "reason": decided.reason,
                                  "approver": decided.approver}
        return result

    def bad_results(self) -> list[Any]:
        """The results the SDK must report as bad (not lost ownership) before the real one."""
        bad: list[Any] = [[1]] if self.p.get("badResultFirst") else []
        if self.p.get("oversizeResultFirst"):
            bad.append({"pad": "x" * int(self.p["oversizeResultFirst"])})  # too large: a bad result, still ours
        return bad

    # The program as ops, so the blocking and the asyncio worker run the same script: ("sleep", s),
    # ("effect", step), or a call of the run's own (renew, request_approval, complete, fail). Each
    # worker performs them with its SDK, sends each answer in and throws each error in.

    def program_ops(self) -> Generator[tuple[Any, ...], Any, int]:
        """The whole program (WORKER.md 3 and 4): the exit code."""
        code = yield from self.spawn_ops()
        if code is None:
            code = yield from self.steps_ops()
        return code if code is not None else (yield from self.publish_ops())

    def spawn_ops(self) -> Generator[tuple[Any, ...], Any, int | None]:
        """With `spawn`: the child, spawned by every attempt (a resumed one finds it by key), its
        result awaited, and the same key asked for another payload refused as a conflict."""
        if self.spawn is None:
            return None
        sp = self.spawn
        ask = {"class_name": sp["className"], "payload": sp.get("payload"), "cap_cents": sp.get("capCents"),
               "max_tokens": sp.get("maxTokens"), "spec": sp.get("spec")}
        try:
            child = yield ("spawn", sp["key"], ask)
            result = yield ("child_result", child)
            try:
                yield ("spawn", sp["key"], {**ask, "payload": {"conflict": True}})
                refused = False
            except SpawnConflict:
                refused = True
        except StopRequested:
            return 0  # told to stop while spawning or waiting: close the run, publish nothing
        except ChildFailed as exc:
            yield ("fail", "ConformanceChildFailed", f"{exc.name} ended {exc.phase} ({exc.reason})"[:500])
            return 0
        except SpawnRefused as exc:
            yield ("fail", "ConformanceSpawnRefused", str(exc)[:500])
            return 0
        self.child = {"child": {"name": child.name, "result": result}, "conflictRefused": refused}
        return None

    def steps_ops(self) -> Generator[tuple[Any, ...], Any, int | None]:
        """The steps (WORKER.md 3); an exit code when the program must end before publishing."""
        run, step = self.run, int(self.run.checkpoint_cursor or 0)
        while step < self.steps:
            why = self.gate()
            if why == WAIT:
                yield ("sleep", POLL)
                continue
            if why is not None:
                return exit_code(why)
            yield ("sleep", self.step_seconds)
            if self.effect_url:
                try:
                    resp = yield ("effect", step)
                except NOT_SENT:
                    continue
                why = effect_verdict(resp)
                if why == WAIT:
                    continue
                if why is not None:
                    return exit_code(why)
            if self.stepped(step):
                # The checkpoint lands before the crash: renew until one is confirmed (or lost).
                deadline = time.monotonic() + run.lease_duration
                while not (yield ("renew",)) and not run.lost and time.monotonic() < deadline:
                    yield ("sleep", run.renew_interval)  # at most one renewal per interval
                os._exit(3)
            step += 1
        return None

    def publish_ops(self) -> Generator[tuple[Any, ...], Any, int]:
        """Publishing (WORKER.md 4): the exit code."""
        if self.fails:
            yield ("fail", "ConformanceFailure", f"attempt {self.run.attempt} fails on purpose")
            return 0
        decided = None
        if self.approval:
            try:
                decided = yield ("request_approval", self.approval["name"], self.approval.get("details", ""),
                                 self.approval.get("timeoutSeconds"))
            except StopRequested:
                return 0  # told to stop while waiting: publish nothing (the run is closed by the caller)
        for bad in self.bad_results():
            try:
                yield ("complete", bad)
                print("a bad result was accepted", file=sys.stderr)
                return 5
            except ResultInvalid:
                pass
        try:
            yield ("complete", self.result(decided))
        except ResultInvalid as exc:
            yield ("fail", "ConformanceBadResult", str(exc)[:500])
        return 0


def effect_verdict(resp: httpx.Response) -> str | None:
    """What the receiver's answer means: None (done), WAIT (again, same key), or an exit code's reason."""
    if resp.status_code == 409 and _error_code(resp) == "InProgress":
        return WAIT  # the same key is still running: try this step again
    if resp.status_code == 409 and _error_code(resp) == "StaleFence":
        return "lost"
    if resp.status_code >= 500:
        return WAIT  # not done (a receiver stores no 5xx): again, with the same key
    if resp.status_code >= 300:
        print(f"the receiver refused the step: {resp.status_code}", file=sys.stderr)
        return "broken"
    return None


def exit_code(why: str) -> int:
    return {"lost": 1, "broken": EXIT_BROKEN}.get(why, 0)


def gateway_token() -> str | None:
    """External mode: the token (read for every claim); None in pod mode."""
    if not os.environ.get("TETHER_GATEWAY_URL"):
        return None
    return Path(os.environ["TETHER_GATEWAY_TOKEN_FILE"]).read_text().strip()


def claim_args(token: str) -> tuple[tuple[str, str, str, str], dict[str, Any]]:
    return ((os.environ["TETHER_GATEWAY_URL"], os.environ["TETHER_NAMESPACE"], os.environ["TETHER_RUN"], token),
            {"worker_id": os.environ.get("TETHER_WORKER_ID") or None})


def guarded(main: Callable[[], int]) -> int:
    """Any bug ends with its own code and its traceback."""
    try:
        logs.setup()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a partitioned node: only the protocol may stop us
        return main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return EXIT_BROKEN


def _start() -> WorkerRun:
    token = gateway_token()
    if token is None:
        return WorkerRun.from_env().start()
    args, kw = claim_args(token)
    return WorkerRun.claim(*args, **kw).start()


def main() -> int:
    return guarded(_main)


def _main() -> int:
    try:
        run = _start()
    except Exception as exc:  # noqa: BLE001 - any refused claim ends the program with its own code
        print(f"start failed: {exc}", file=sys.stderr)
        return 4
    s = Script(run, "python")
    try:
        with run.http_client(timeout=10) as http:
            def perform(op: tuple[Any, ...]) -> Any:
                kind, *args = op
                if kind == "sleep":
                    return time.sleep(args[0])
                if kind == "effect":
                    return http.effect("POST", s.effect_url, operation=f"step-{args[0]}", **s.effect(args[0]))
                if kind == "spawn":
                    return run.spawn(args[0], **args[1])
                if kind == "child_result":
                    return args[0].result(poll=CHILD_POLL)
                return getattr(run, kind)(*args)
            return drive(s.program_ops(), perform)
    except LeaseLost:
        return 1
    except OwnershipUnknown:
        return 2
    finally:
        run.stop()  # the last renewal reports what was spent when nothing was published


def _error_code(resp: httpx.Response) -> str | None:
    try:
        doc = resp.json()
    except ValueError:
        return None
    return doc.get("error") if isinstance(doc, dict) else None


if __name__ == "__main__":
    sys.exit(main())
