"""`python -m conformance`: runs the scenarios against each worker and prints scenario × worker.

    python -m conformance                       # the Python (blocking and asyncio), TypeScript and Go SDKs
    python -m conformance --worker go --scenario partition
    python -m conformance --worker 'mine=/usr/local/bin/my-worker --flag'

Starts a local control plane (with its audit log) unless TETHER_TEST_KUBECONFIG and
TETHER_TEST_AUDIT_LOG name a running one. Exit status 0 only when every cell passes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conformance.harness import Cluster
from conformance.run import Cell, run_cell
from conformance.branches import ALL as SCENARIOS
from conformance.sdks import BUILD, parse_worker


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance", description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="append", help="python, typescript, go, or name=command (repeatable)")
    p.add_argument("--scenario", action="append", help="only these scenarios (repeatable)")
    p.add_argument("--transport", choices=("pod", "gateway"), action="append", help="only these transports")
    p.add_argument("--jobs", type=int, default=3, help="cells run at once (each has its own namespace)")
    p.add_argument("--out", type=Path, default=BUILD / "results.json")
    args = p.parse_args(argv)
    workers = [parse_worker(w) for w in (args.worker or ["python", "python-async", "typescript", "go"])]
    for w in workers:
        print(f"# building the {w.name} worker", flush=True)
        w.build()
    cells = [Cell(w, s, t) for s in SCENARIOS if not args.scenario or s.name in args.scenario
             for t in s.transports if not args.transport or t in args.transport for w in workers]
    if os.environ.get("TETHER_TEST_KUBECONFIG"):
        return _report(_run(Cluster.from_env(), cells, args.jobs), workers, args.out)
    from tether.devcluster.controlplane import LocalCluster, resolve_binaries
    from tether.devcluster.crds import install_crds, install_policies

    # With Kueue: the yield scenario queues its run and evicts it.
    with LocalCluster(bin_dir=resolve_binaries(), audit=True, with_kueue=True) as cluster:
        with cluster.client() as client:
            install_crds(client)
            install_policies(client)
        os.environ["TETHER_TEST_STATE_DIR"] = str(cluster.state_dir)  # the worker proxies trust its CA
        return _report(_run(Cluster(Path(cluster.kubeconfig), Path(cluster.audit_log)), cells, args.jobs),
                       workers, args.out)


def _run(cluster: Cluster, cells: list[Cell], jobs: int) -> list[Cell]:
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = list(pool.map(lambda c: run_cell(cluster, c), cells))
    print(f"# {len(done)} cells in {time.monotonic() - started:.0f}s", flush=True)
    return done


def _report(cells: list[Cell], workers: list, out: Path) -> int:
    names = [w.name for w in workers]
    rows = sorted({(c.scenario.name, c.transport) for c in cells}, key=lambda r: ([s.name for s in SCENARIOS].index(r[0]), r[1]))
    width = max(len(f"{s} ({t})") for s, t in rows)
    print(f"\n{'scenario':<{width}}  " + "  ".join(f"{n:<10}" for n in names))
    for s, t in rows:
        marks = []
        for n in names:
            cell = next((c for c in cells if c.scenario.name == s and c.transport == t and c.worker.name == n), None)
            marks.append(f"{'-' if cell is None else 'pass' if cell.passed else 'FAIL':<10}")
        print(f"{s + ' (' + t + ')':<{width}}  " + "  ".join(marks))
    failed = [c for c in cells if not c.passed]
    for c in failed:
        print(f"\nFAIL {c.worker.name} · {c.scenario.name} ({c.transport}): {c.reason}\n  logs: {c.workdir}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([c.record() for c in cells], indent=1))
    print(f"\n# {len(cells) - len(failed)}/{len(cells)} passed; results in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
