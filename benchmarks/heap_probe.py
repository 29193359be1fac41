"""The heap the run controller keeps per run, in process, against the one fake API (testkit/fakeapi.py):
N External runs are granted, their writes fed back as the watch would, then each holder renews five
times and the run is decided again (the watch echoing what was written); the heap still held and its
peak (tracemalloc) are printed, by file. Run it
with another checkout's operator first on the path to compare two codes:

    PYTHONPATH=<checkout>/operator .venv/bin/python benchmarks/heap_probe.py 400
"""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import sys
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit

from tether.controller.controller import Clock, RunController  # noqa: E402
from tether.kube.paths import lease_path, run_path  # noqa: E402
from testkit.fakeapi import FakeApi  # noqa: E402

T0 = dt.datetime(2026, 12, 7, tzinfo=dt.timezone.utc)


def _run(i: int) -> dict[str, Any]:
    return {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
            "metadata": {"name": f"r{i}", "namespace": "ns", "generation": 1, "finalizers": ["tether.dev/run-cleanup"]},
            "spec": {"executor": "External", "lease": {"durationSeconds": 90, "renewIntervalSeconds": 30,
                                                       "startupGraceSeconds": 90},
                     "retry": {"maxAttempts": 3}, "stopGraceSeconds": 30}}


async def _decide(ctl: RunController, i: int) -> None:
    try:
        await ctl.reconciler.reconcile(("ns", f"r{i}"))
    except Exception:  # noqa: BLE001 - a pass sent back (Again) is decided again later, as by the loop
        pass


async def main(n: int) -> None:
    api = FakeApi(now=lambda: T0)
    ctl = RunController(api.client(), clock=Clock(now=lambda: T0, mono=lambda: 100.0))
    bodies = [api.put(run_path("ns", f"r{i}"), _run(i)) for i in range(n)]
    tracemalloc.start(10)
    for body in bodies:
        ctl.on_run("ADDED", body)
    for i in range(n):
        for _ in range(3):
            await _decide(ctl, i)
    for obj in list(api.objects.values()):  # the watch brings what was written
        if obj.get("kind") == "WorkerRun":
            ctl.on_run("MODIFIED", obj)
        elif obj.get("kind") == "Lease":
            ctl.on_lease("MODIFIED", obj)
    for beat in range(5):
        for i in range(n):
            lease = api.get(lease_path("ns", f"r{i}"))
            if lease is None:
                continue
            lease["spec"]["renewTime"] = f"2026-12-07T00:00:{10 + beat:02d}.000000Z"
            lease["metadata"].setdefault("annotations", {})["tether.dev/checkpoint"] = f"c{beat}"
            ctl.on_lease("MODIFIED", api.put(lease_path("ns", f"r{i}"), lease))
            await _decide(ctl, i)
            ctl.on_run("MODIFIED", api.get(run_path("ns", f"r{i}")))  # the watch's echo of what it wrote
    del bodies
    gc.collect()
    peak = tracemalloc.get_traced_memory()[1]
    stats = tracemalloc.take_snapshot().statistics("filename")
    total = sum(s.size for s in stats)
    print(f"heap held: {total / 1e6:.1f} MB for {n} runs ({total / n / 1e3:.1f} KB per run, the fake API's own included); "
          f"peak {peak / 1e6:.1f} MB")
    for s in stats[:12]:
        print(f"{s.size / 1e6:8.2f} MB {s.count:8d} {s.traceback[0].filename}")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 400))
