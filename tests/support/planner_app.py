"""A planner for the child-run scenarios (it runs inside process-kubelet pods): it spawns each call
of its payload as a child run, waits for their results in order, checkpoints after each, and
completes with all of them.

Payload:
  calls          [{key, className, payload, capCents}]: the tool calls, each a child run
  childTemplate  the children's pod template (they run tests/support/worker_app.py)
  crashAfter     attempt 1 exits at once (no result) after this many results, checkpointed
  spendCents     the planner's own spending, reported once its children are spawned (a model call's)
  outFile        JSON lines of what happened, read by the test
A resumed attempt spawns every call again: the SDK finds the children made before by their keys.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from tether import logs
from tether.worker import ChildFailed, WorkerRun


def main() -> int:
    logs.setup()
    with WorkerRun.from_env() as run:
        p = run.payload
        out = p.get("outFile")

        def record(**event: Any) -> None:
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps({"attempt": run.attempt, "at": time.time(), **event}) + "\n")

        spec = {"template": p["childTemplate"], "lease": {"durationSeconds": 10, "renewIntervalSeconds": 2,
                                                           "startupGraceSeconds": 30},
                "retry": {"maxAttempts": 2, "backoff": {"initialSeconds": 0}}}
        children = [run.spawn(c["key"], class_name=c.get("className"), payload=c.get("payload"),
                              cap_cents=c.get("capCents"), spec=spec) for c in p["calls"]]
        for c in children:
            record(event="spawned", key=c.key, child=c.name)
        if p.get("spendCents"):
            run.report_usage(cents=int(p["spendCents"]))
        results: dict[str, Any] = {}
        for i, c in enumerate(children):
            try:
                results[c.key] = c.result(timeout=180, poll=0.5)
            except ChildFailed as exc:
                results[c.key] = {"failed": exc.reason}
            record(event="result", key=c.key, result=results[c.key])
            run.checkpoint(str(i + 1), flush=True)
            if run.attempt == 1 and i + 1 == p.get("crashAfter"):
                record(event="crash")
                os._exit(3)
        run.complete({"results": results})
        record(event="complete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
