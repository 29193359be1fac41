"""A worker that spends on a model API through the metering transport until told to stop (it runs
inside process-kubelet pods; the model is tether.devcluster.fake_model in the test's process).

Payload:
  modelUrl   the fake model API's base URL
  prices     the price table (tether.worker.metering)
  calls      the requests it cycles through: [{"path": "/v1/messages", "model": "...", "stream": bool}]
  pauseSeconds  between two calls (default 0.2)
  maxCalls   a worker never told to stop ends after this many calls with a result (default 500)
  outFile    JSON lines of what happened, read by the test
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx

from tether import logs
from tether.worker import StopRequested, WorkerRun
from tether.worker.metering import Meter, RunStopped


def main() -> int:
    logs.setup()
    with WorkerRun.from_env() as run:
        p = run.payload
        out = Path(p["outFile"])

        def record(**kw: object) -> None:
            with out.open("a") as f:
                f.write(json.dumps({"attempt": run.attempt, "pid": os.getpid(), "at": time.time(), **kw}) + "\n")

        meter = Meter(run, p["prices"])
        record(event="started")
        with httpx.Client(transport=meter.transport(), timeout=30) as http:
            for i in range(int(p.get("maxCalls", 500))):
                try:
                    run.ensure_owner()  # StopRequested once a cap is crossed
                except StopRequested as exc:
                    record(event="stopped", reason=str(exc), cents=meter.cents, tokens=meter.tokens, calls=i)
                    return 0  # leaving the with block sends the last renewal with the final usage
                call = p["calls"][i % len(p["calls"])]
                body = {"model": call["model"], "stream": bool(call.get("stream")),
                        "messages": [{"role": "user", "content": f"step {i}"}], "max_tokens": 64}
                try:
                    with http.stream("POST", p["modelUrl"] + call["path"], json=body) as answer:
                        answer.raise_for_status()
                        for _ in answer.iter_bytes():
                            pass
                except RunStopped as exc:  # the meter's own reports used up the cap: refused unsent
                    record(event="stopped", reason=str(exc), cents=meter.cents, tokens=meter.tokens, calls=i)
                    return 0
                record(event="call", n=i, path=call["path"], cents=meter.cents, tokens=meter.tokens)
                time.sleep(float(p.get("pauseSeconds", 0.2)))
        run.complete({"calls": int(p.get("maxCalls", 500))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
