"""Pure decision throughput: decide() on typical observations (no I/O).

    .venv/bin/python benchmarks/decide_throughput.py
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.unit.core.test_decide import held, lease, observe, pod, run  # noqa: E402
from tether.core.decide import decide  # noqa: E402

T0 = dt.datetime(2026, 11, 29, 12, tzinfo=dt.timezone.utc)


def bench(label: str, o, n: int = 20000) -> dict[str, float]:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    for _ in range(n):
        decide(o)
    seconds = time.perf_counter() - started
    return {"case": label, "per_second": round(n / seconds), "us_each": round(seconds / n * 1e6, 1)}


def main() -> None:
    cases = [
        bench("steady heartbeat (no action)", observe(run(status=held()), lease(), (pod(),))),
        bench("new run (grant)", observe(run())),
        bench("lapse (revoke + backoff)", observe(run(status=held()), lease(), (pod(),), mono=500.0)),
    ]
    print(json.dumps(cases, indent=2))


if __name__ == "__main__":
    main()
