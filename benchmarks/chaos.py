"""Randomized fault trials against Tether on a real local control plane (`make chaos`).

    .venv/bin/python benchmarks/chaos.py --trials 300 --seed 1
    .venv/bin/python benchmarks/chaos.py --replay 17          # the one trial of seed 17, again

Trial i of a campaign has seed S+i; each draws its runs and faults from its seed alone
(testkit/chaos.py) and is judged by the oracle (testkit/oracle.py) from the API
server's audit log and the final objects. One control plane with an audit log serves every
trial (a namespace each); trials that draw an API server pause run on a second, private one,
started when first needed and reused, because pausing the API server must not disturb the
others. A failing trial prints its seed, the violated invariant with its evidence, where its
evidence was kept, and a one-line replay command; the campaign ends with the faults injected
by kind and the violations by invariant. Exit status 1 when any trial failed.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tether.devcluster.controlplane import LocalCluster, resolve_binaries  # noqa: E402
from tether.devcluster.crds import install_crds, install_policies  # noqa: E402
from tether.devcluster.kubelet import POD_PYTHONPATH  # noqa: E402
from testkit.chaos import ClusterHandle, Tally, Trial, draw_plan, timeline  # noqa: E402


def _start(stack: contextlib.ExitStack, label: str, pausable: bool) -> ClusterHandle:
    began = time.monotonic()
    # With Kueue: plans that queue runs queue them, and preempt them (testkit/chaos_queues.py).
    cluster = stack.enter_context(LocalCluster(bin_dir=resolve_binaries(), audit=True, with_kueue=True, lean=True,
                                               state_dir=Path(tempfile.mkdtemp(prefix=f"tether-chaos-{label}-"))))
    with cluster.client() as client:
        install_crds(client)
        install_policies(client)  # fencing enforced by the API server, as a chart install has it
    print(f"{label} control plane at {cluster.server} in {time.monotonic() - began:.0f}s "
          f"(audit log {cluster.audit_log})", flush=True)
    return ClusterHandle.from_local(cluster, label, pausable=pausable)


def _snapshot(rev: str) -> tuple[str, Path]:
    """The operator package as committed at `rev` (git archive: the work tree and index stay untouched).

    Others edit this checkout while trials run; a trial should judge a build, not a half-saved file."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    dest = Path(tempfile.mkdtemp(prefix=f"tether-src-{sha[:8]}-"))
    archive = subprocess.run(["git", "archive", sha, "operator"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return sha, dest / "operator"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1, help="seed of the first trial; trial i has seed+i")
    parser.add_argument("--replay", type=int, default=None, metavar="SEED", help="run only the trial of this seed")
    parser.add_argument("--no-api-pause", action="store_true",
                        help="never draw the API server pause (the fixed set in make test does not)")
    parser.add_argument("--strict-window", action="store_true",
                        help="count renewals accepted between a revocation's fence bump and its Lease clear "
                             "as violations of invariant 1")
    parser.add_argument("--settle", type=float, default=60.0, help="seconds the system gets to settle after faults")
    parser.add_argument("--keep", choices=["failed", "always", "never"], default="failed",
                        help="which trials' evidence to keep under .tether/chaos/")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failed trial")
    parser.add_argument("--timeline", type=Path, metavar="DIR",
                        help="print a kept trial's audit writes and operator events in time order, and exit")
    parser.add_argument("--run", help="with --timeline: only this run")
    parser.add_argument("--results", type=Path, default=ROOT / ".tether" / "chaos" / "results.jsonl",
                        help="each trial's record is appended here (one JSON line)")
    parser.add_argument("--summarize", action="store_true",
                        help="print the totals of every trial in the results file, and exit")
    parser.add_argument("--source", metavar="REV",
                        help="run the operator and the worker SDK as committed at REV (e.g. HEAD) instead of the "
                             "work tree")
    args = parser.parse_args()
    if args.timeline:
        print(timeline(args.timeline, args.run))
        return 0
    if args.summarize:
        total = Tally()
        for line in args.results.read_text().splitlines():
            if line.strip():
                total.add(json.loads(line))
        print(total.report())
        return 0
    os.chdir(ROOT)  # the process kubelet runs tests/support/worker_app.py relative to its working directory
    # A trial that hangs shows where: `kill -USR1 <pid>` prints every thread's stack.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    source = None
    if args.source:
        source, package = _snapshot(args.source)
        # The operator (testkit/operator_process.py) and every worker pod (the process kubelet puts it
        # on their PYTHONPATH) import tether from there; the harness and the cluster it starts stay this tree's.
        os.environ["TETHER_TEST_OPERATOR_SRC"] = str(package)
        os.environ[POD_PYTHONPATH] = str(package)
        print(f"operator and worker SDK from {source} ({package})", flush=True)

    seeds = [args.replay] if args.replay is not None else [args.seed + i for i in range(args.trials)]
    evidence = ROOT / ".tether" / "chaos"
    tally = Tally()
    with contextlib.ExitStack() as stack:
        shared: ClusterHandle | None = None
        private: ClusterHandle | None = None
        for seed in seeds:
            plan = draw_plan(seed, allow_api_pause=not args.no_api_pause)
            if plan.api_pause:
                private = private or _start(stack, "private", pausable=True)
                cluster = private
            else:
                shared = shared or _start(stack, "shared", pausable=False)
                cluster = shared
            # A trial takes well under 3 minutes; past 5, every thread's stack goes to stderr.
            faulthandler.dump_traceback_later(300, repeat=True)
            result = Trial(plan, cluster, evidence / f"seed-{seed}", settle_seconds=args.settle,
                           strict_window=args.strict_window, keep=args.keep, source=source).run()
            faulthandler.cancel_dump_traceback_later()
            tally.add(result.record())
            args.results.parent.mkdir(parents=True, exist_ok=True)
            with args.results.open("a") as out:
                out.write(json.dumps(result.record()) + "\n")
            print(f"[{tally.trials}/{len(seeds)}] {result.summary()}", flush=True)
            if not result.ok:
                print(result.report(), flush=True)
                if args.fail_fast:
                    break
    print()
    print(tally.report())
    return 1 if tally.failed else 0


if __name__ == "__main__":
    sys.exit(main())
