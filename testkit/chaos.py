"""Randomized, seeded fault trials on a real control plane, judged by testkit/oracle.py.

One trial, in its own namespace:

1. a plan is drawn from the trial's seed (`draw_plan`): 2-4 WorkerRuns of
   tests/support/worker_app.py with short leases (renew 1 s, duration 8 s), some charging a
   WorkerBudget, some failing their first attempt or carrying a small cap, some with a short
   deadlineSeconds or progressDeadlineSeconds (suspended, or asking a person, for longer), and
   3-6 faults at random times in an 18 s window (plus, where allowed, an API server pause);
2. the operator (one replica, or two with leader election) talks to the API server through
   one fault-injecting proxy (testkit/apiproxy.py), every worker pod through another,
   so faults can be aimed at the operator or at one worker (by the pod its token names); each
   operator process has a token of its own there, so its requests (and, through the User-Agent,
   the audit log) name the process;
3. the faults run, each on its own thread, then everything heals: proxies cleared, frozen
   workers continued, operators running, suspended runs resumed, every worker's gate open;
4. the system gets a bounded time to settle (every run terminal and charged); runs that are
   still live have their Lease watched for a few renew intervals;
5. the oracle judges the namespace's audit records and the final objects.

The plan is a pure function of the seed (and whether the API pause may be drawn), so
`replay_command(seed)` re-runs the same faults against the same runs. The interleaving is the
machine's: a replay brings the same pressure, not the same nanoseconds. Each fault thread waits
for its scheduled moment with a timed wait: that delay is the fault, not a stand-in for a
condition; every condition (a holder, a revocation, a settled run) is polled with a deadline.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import yaml

from tether.devcluster import pki
from testkit import chaos_models, chaos_queues
from testkit.apiproxy import ApiProxy, Gate
from testkit.audit import AuditRecord, parse_lines
from testkit.kube import Kube
from testkit.operator_process import OperatorProcess
from testkit.oracle import LEADERSHIP_SLACK, TERMINAL, TrialFacts, Verdict, judge
from testkit.scenario import app_run

LEASE_SECONDS = 8  # the CRD wants durationSeconds > 2 * renewIntervalSeconds + 5
RENEW_SECONDS = 1
# What an exec plugin's credential says it lives (runs drawn with credentials "exec").
EXEC_CREDENTIAL_SECONDS = 3
STARTUP_GRACE_SECONDS = 15  # a Python worker on a busy 2-core machine needs a few seconds to start
FAULT_WINDOW = 18.0
SETTLE_SECONDS = 60.0
LEADER_LEASE_SECONDS = 4
API_SERVER_ANNOTATION = "dev.tether.dev/api-server"
BUDGET = "team"

# Every kind a plan may draw, with its weight. Worker faults weigh most: they are what ends
# attempts, and revocations are where the promise is at stake.
FAULT_WEIGHTS: dict[str, int] = {
    "operator-delay": 3, "operator-error": 3, "operator-watch-expired": 2, "operator-drop": 2,
    "operator-watch-hold": 2, "operator-watch-reset": 1, "operator-cut": 2, "operator-kill": 3,
    "operator-kill-mid-grant": 2, "operator-kill-mid-revocation": 2,
    "worker-delay": 2, "worker-error": 2, "worker-drop": 2, "worker-freeze": 4, "worker-partition": 4,
    "worker-kill": 2, "worker-complete-while-revoked": 4,
    "run-delete": 2, "run-stop": 2, "run-suspend": 2, "run-recreate": 2,
}
# The trial's WorkerClass's defaults edited while its runs run (skipped when no run is classed).
CLASS_EDIT = "class-edit"
CLASSES = "/apis/tether.dev/v1alpha1/workerclasses"
# Kinds drawn apart, each from a generator of its own so that the plans of seeds drawn before them
# stay as they were: the chance a plan draws it, and whether only plans with HA operators do.
APART: dict[str, tuple[float, bool]] = {"operator-kill-mid-grant-lease": (0.3, False),
                                        "operator-leader-lost": (0.6, True),
                                        "operator-standby-slow-get": (0.5, True),
                                        CLASS_EDIT: (0.6, False)}
API_PAUSE = "api-pause"
# A WorkerRunSchedule beside the runs (drawn apart for half the plans): @every SCHEDULE_EVERY seconds,
# its runs suspended External ones (nothing to execute: what is judged is one run per slot,
# invariant 14). Its fault: the acting operator killed with a slot's run creation in flight.
SCHEDULE = "sched"
SCHEDULE_EVERY = 5
SCHEDULE_KILL = "operator-kill-mid-schedule"
# A planner beside the runs (drawn apart for four plans in ten): a run of a planners class whose
# worker (tests/support/planner_app.py) spawns 2 or 3 tool calls as child runs of a tools class,
# each with its share of the planner's cap, and may crash after its first results (its next attempt
# re-attaches by key). Judged by invariant 15 (testkit/oracle_children.py) and all the others.
PLANNER = "planner"
PLANNER_CAP_CENTS = 100
# A person raising the small cap of a run that pauses at it (drawn apart for a third of the plans:
# _draw_pauses); invariant 16: such a run is paused, never stopped, for its cap.
RUN_RAISE_CAP = "run-raise-cap"
RAISED_CAP_CENTS = 10**6
# A higher-priority run asking for the whole quota of a trial's ClusterQueue: Kueue evicts every
# admitted queued run (drawn only for plans with queued runs, from a generator of its own).
RUN_PREEMPT = "run-preempt"
# The same, again and again through the window (drawn apart for half the plans with queued runs):
# with the operators' short attempt history, queued runs pass its end (invariant 4 counts every cent).
RUN_PREEMPT_AGAIN = "run-preempt-again"
FAULT_KINDS: tuple[str, ...] = (*FAULT_WEIGHTS, *APART, API_PAUSE, RUN_PREEMPT, RUN_PREEMPT_AGAIN, SCHEDULE_KILL,
                                RUN_RAISE_CAP)
# What the harness's reviewer did to results under review and to workers' requests (not faults: a
# person's decisions).
REVIEW_DECISIONS = ("review-approve", "review-deny")
REQUEST_DECISIONS = ("request-approve", "request-deny")
# Kinds that hit one run's current worker: it is found, and recorded as faulted, first.
AIMED_AT_WORKER = frozenset(k for k in FAULT_KINDS if k.startswith("worker-")) | {"operator-kill-mid-revocation"}
# Kinds aimed at a run's worker that, if that run has none running, take the next run's that has one.
AIMED_AT_ANY_WORKER = frozenset({"operator-kill-mid-grant-lease", "operator-leader-lost"})
LEADER_LEASE = "tether-operator-leader"
# The operators keep this few attempt records (--attempt-history), so that runs retried, revoked or
# preempted a few times already pass the history's end, as a long run passes the default 100.
ATTEMPT_HISTORY = 2
RENEW_DEADLINE = LEADER_LEASE_SECONDS * 2 / 3  # what the operator derives from its lease (tether/cli.py)
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


# --- the plan ------------------------------------------------------------------------------


@dataclass
class RunPlan:
    name: str
    budget: bool  # names the trial's WorkerBudget
    usage_per_second: int  # cents reported while holding, cumulative per attempt
    usage_cents: int  # reported once at start
    fail_first: bool  # attempt 1 publishes an error
    cap_cents: int | None  # spec.budget.capCents: ends BudgetExceeded once crossed
    gate_at: float | None  # seconds into the trial when its workers may finish (None: after the faults)
    # spec.review.result: each published result waits for the harness's decision (oracle invariant 7).
    review: bool = False
    # Per attempt under review: (seconds the reviewer waits, decision, bound to the attempt?).
    reviews: list[tuple[float, str, bool]] = field(default_factory=list)
    deadline_seconds: int | None = None  # spec.deadlineSeconds
    # spec.progressDeadlineSeconds; its workers checkpoint every second while they hold, unless paused.
    progress_deadline_seconds: int | None = None
    # A request its workers make after the hold (request_approval), and how long the harness's person
    # takes to decide it (longer than the progress deadline), with what decision.
    request: str | None = None
    request_wait: float = 0.0
    request_decision: str = "Approve"
    queued: bool = False  # queued through the trial's Kueue ClusterQueue (when the cluster has Kueue)
    sdk: str = "blocking"  # the worker's Python SDK flavour: "blocking" (WorkerRun) or "asyncio" (AsyncWorkerRun)
    # How its workers authenticate: "kubelet" (the pod's token file) or "exec" (a kubeconfig whose exec
    # credential plugin mints pod-bound tokens that say they expire within seconds: refreshed throughout).
    credentials: str = "kubelet"
    # Queued: told to yield, its worker publishes an error (a publication during a yield, invariant 2).
    fail_on_yield: bool = False
    # "stream" | "whole": its workers spend through the SDK's meter on the trial's model API, which cuts
    # some answers before their usage (testkit/chaos_models.py, invariant 12), not usagePerSecond.
    metered: str | None = None
    # Its lease, retry policy and stop grace come from the trial's WorkerClass, which a class-edit fault
    # changes while it runs (invariant 13: what a run took is fixed from its first grant).
    classed: bool = False
    # spec.budget.onExhausted: Pause with a small cap: reaching it pauses the run (invariant 16: never
    # stopped for it); a run-raise-cap fault (or the heal) raises the cap and the same attempt goes on.
    pause: bool = False


@dataclass
class FaultPlan:
    kind: str
    at: float  # seconds into the trial
    run: int | None  # index into Plan.runs of the run it is aimed at
    seconds: float = 0.0  # how long it lasts (0: instant)
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    seed: int
    allow_api_pause: bool
    runs: list[RunPlan]
    ha: bool  # two operator replicas with leader election
    faults: list[FaultPlan]
    schedule: bool = False  # a WorkerRunSchedule beside the runs (SCHEDULE)
    # A planner beside the runs (PLANNER): the usage of each of its tool calls (cents per second,
    # each a child run), and after how many results its first attempt crashes (None: it does not).
    children: list[int] = field(default_factory=list)
    crash_after: int | None = None

    @property
    def api_pause(self) -> bool:
        return any(f.kind == API_PAUSE for f in self.faults)


def draw_plan(seed: int, allow_api_pause: bool = True, window: float = FAULT_WINDOW) -> Plan:
    """The trial for `seed`: runs, operator topology and faults, from this seed alone."""
    rng = random.Random(seed)
    runs = [RunPlan(name=f"run{i}", budget=rng.random() < 0.6, usage_per_second=rng.choice([0, 1, 2, 3, 5]),
                    usage_cents=rng.choice([0, 0, 7, 13]), fail_first=rng.random() < 0.15,
                    cap_cents=25 if rng.random() < 0.15 else None,
                    gate_at=round(rng.uniform(4, window), 1) if rng.random() < 0.35 else None)
            for i in range(rng.randint(2, 4))]
    for i, rp in enumerate(runs):
        # Generators of their own, so the plans of seeds drawn before stay as they were.
        rp.sdk = "asyncio" if random.Random(f"{seed}/sdk/{i}").random() < 0.5 else "blocking"
        rp.credentials = "exec" if random.Random(f"{seed}/credentials/{i}").random() < 0.3 else "kubelet"
        metered = random.Random(f"{seed}/metered/{i}")
        rp.metered = metered.choice(["stream", "whole"]) if metered.random() < 0.25 else None
        review = random.Random(f"{seed}/review/{i}")
        rp.review = review.random() < 0.3
        if rp.review:
            rp.reviews = [(round(review.uniform(0, 3), 1), "Deny" if review.random() < 0.35 else "Approve",
                           review.random() < 0.7) for _ in range(4)]
            if rp.gate_at is None:  # results published while the faults go on, so they are decided then too
                rp.gate_at = round(review.uniform(4, window), 1)
    ha = rng.random() < 0.2
    kinds, weights = list(FAULT_WEIGHTS), list(FAULT_WEIGHTS.values())
    faults = [_draw_fault(rng, rng.choices(kinds, weights)[0], len(runs), window) for _ in range(rng.randint(3, 6))]
    if allow_api_pause and rng.random() < 0.15:
        faults.append(_draw_fault(rng, API_PAUSE, len(runs), window))
    for i, rp in enumerate(runs):
        faults += _draw_deadlines(random.Random(f"{seed}/deadlines/{i}"), rp, i, window)
    for kind, (chance, ha_only) in APART.items():
        apart = random.Random(f"{seed}/fault/{kind}")
        if apart.random() < chance and (ha or not ha_only):
            faults.append(_draw_fault(apart, kind, len(runs), window))
    faults += _draw_queues(random.Random(f"{seed}/queue"), runs, window)
    faults += _draw_preemptions_again(random.Random(f"{seed}/preempt-again"), runs, window)
    for i, rp in enumerate(runs):
        rp.fail_on_yield = rp.queued and random.Random(f"{seed}/yield-error/{i}").random() < 0.5
        rp.classed = random.Random(f"{seed}/class/{i}").random() < 0.4
    faults += _draw_pauses(random.Random(f"{seed}/pause"), runs, window)
    scheduled = random.Random(f"{seed}/schedule")
    schedule = scheduled.random() < 0.5
    if schedule and scheduled.random() < 0.6:
        faults.append(_draw_fault(scheduled, SCHEDULE_KILL, len(runs), window))
    # The API server (or etcd) paused across slots: a pause outlasts SCHEDULE_EVERY, so every one
    # does; drawn here too, so that a campaign has schedules paused on purpose, not by chance.
    if schedule and allow_api_pause and scheduled.random() < 0.3 and not any(f.kind == API_PAUSE for f in faults):
        faults.append(_draw_fault(scheduled, API_PAUSE, len(runs), window))
    faults.sort(key=lambda f: f.at)
    planned = random.Random(f"{seed}/children")
    children = [planned.choice([0, 1, 2]) for _ in range(planned.randint(2, 3))] if planned.random() < 0.4 else []
    crash_after = planned.choice([None, 1, 2]) if children else None
    return Plan(seed=seed, allow_api_pause=allow_api_pause, runs=runs, ha=ha, faults=faults, schedule=schedule,
                children=children, crash_after=crash_after)


def _draw_queues(gen: random.Random, runs: list[RunPlan], window: float) -> list[FaultPlan]:
    """Whether the plan queues runs through Kueue, which, and the preemptions it draws (0 to 2)."""
    if gen.random() >= 0.35:
        return []
    for rp in runs:
        rp.queued = gen.random() < 0.7
    if not any(rp.queued for rp in runs):
        runs[0].queued = True
    queued = [i for i, rp in enumerate(runs) if rp.queued]
    return [FaultPlan(kind=RUN_PREEMPT, at=round(gen.uniform(3, window - 3), 1), run=gen.choice(queued))
            for _ in range(gen.choice([0, 1, 1, 2]))]


def _draw_pauses(gen: random.Random, runs: list[RunPlan], window: float) -> list[FaultPlan]:
    """For a third of the plans: each spending run, with a chance in two, pauses at a small cap of
    its own (onExhausted: Pause) that a run-raise-cap fault raises later in the window."""
    if gen.random() >= 0.35:
        return []
    faults = []
    for i, rp in enumerate(runs):
        if (rp.usage_per_second or rp.usage_cents) and gen.random() < 0.5:
            rp.pause, rp.cap_cents = True, gen.choice([4, 8, 12])
            faults.append(FaultPlan(kind=RUN_RAISE_CAP, at=round(gen.uniform(window / 2, window), 1), run=i))
    return faults


def _draw_preemptions_again(gen: random.Random, runs: list[RunPlan], window: float) -> list[FaultPlan]:
    """For half the plans with queued runs: 3 to 5 preemptions spread through the window."""
    queued = [i for i, rp in enumerate(runs) if rp.queued]
    if not queued or gen.random() >= 0.5:
        return []
    n = gen.randint(3, 5)
    step = (window - 4) / n
    return [FaultPlan(kind=RUN_PREEMPT_AGAIN, at=round(2 + k * step + gen.uniform(0, step / 2), 1),
                      run=gen.choice(queued)) for k in range(n)]


def _draw_deadlines(gen: random.Random, rp: RunPlan, index: int, window: float) -> list[FaultPlan]:
    """One run's deadlines, from its own generator: a deadlineSeconds (counted from the first grant)
    that passes during or soon after the faults; a progressDeadlineSeconds shorter than a suspension
    of the run (drawn with it) or than the wait for a person's decision on a request of its
    workers. Returns the suspension, if drawn."""
    if gen.random() < 0.25:
        rp.deadline_seconds = gen.randint(8, 30)
    if gen.random() >= 0.3:
        return []
    pd = rp.progress_deadline_seconds = gen.randint(5, 8)
    if gen.random() < 0.5:
        rp.request = "deploy"
        rp.request_wait = round(pd + gen.uniform(2, 5), 1)
        rp.request_decision = "Deny" if gen.random() < 0.25 else "Approve"
        if rp.gate_at is None:  # the request is made while the faults go on
            rp.gate_at = round(gen.uniform(4, window), 1)
    if gen.random() >= 0.6:
        return []
    # From 4 s on: the run's first worker holds by then, so it is paused, not kept from starting.
    return [FaultPlan(kind="run-suspend", at=round(gen.uniform(4, window - 3), 1), run=index,
                      seconds=round(pd + gen.uniform(2, 5), 1))]


def _draw_fault(rng: random.Random, kind: str, n_runs: int, window: float) -> FaultPlan:
    past_lease = lambda: round(LEASE_SECONDS + rng.uniform(1, 6), 1)  # noqa: E731
    some = lambda lo, hi: round(rng.uniform(lo, hi), 1)  # noqa: E731
    aimed = kind in AIMED_AT_WORKER | AIMED_AT_ANY_WORKER or kind.startswith("run-")
    target = rng.randrange(n_runs) if aimed else None
    seconds, params = 0.0, {}
    if kind in ("operator-delay", "worker-delay"):
        seconds = some(3, 10)
        params = {"delay": some(0.2, 3.5), "phase": rng.choice(["request", "response"]),
                  "probability": some(0.3, 1.0), "method": rng.choice([None, "GET", "PUT|PATCH|POST"])}
    elif kind in ("operator-error", "worker-error"):
        seconds = some(3, 10)
        params = {"code": rng.choice([429, 500, 503]), "phase": rng.choice(["request", "response"]),
                  "probability": some(0.2, 0.9), "method": rng.choice([None, "GET", "PUT|PATCH|POST"])}
    elif kind in ("operator-drop", "worker-drop"):
        seconds = some(3, 8)
        params = {"phase": rng.choice(["request", "response"]), "probability": some(0.2, 0.7),
                  "method": rng.choice([None, "PUT|PATCH|POST"])}
    elif kind == "operator-watch-expired":
        seconds, params = 5.0, {"times": rng.randint(1, 3)}
    elif kind == "operator-watch-hold":
        seconds = some(2, 10)
    elif kind == "operator-cut":
        seconds = some(2, 12)
    elif kind == "operator-kill":
        params = {"down": some(0, 4)}
    elif kind in ("operator-kill-mid-grant", SCHEDULE_KILL):
        params = {"down": some(0, 3), "late": some(0, 3)}
    elif kind == "operator-kill-mid-revocation":
        params = {"down": some(0, 3), "thaw": some(0, 4), "late": some(0, 3)}
    elif kind == "operator-kill-mid-grant-lease":
        # What happens before the successor repairs the grant; late None: the held write is dropped.
        params = {"variant": rng.choice(["repair", "delete", "deadline"]), "down": some(0, 3),
                  "late": None if rng.random() < 0.4 else some(0, 3)}
    elif kind == "operator-leader-lost":
        seconds = round(RENEW_DEADLINE + rng.uniform(3, 6), 1)  # outlasts the held pass (_f_operator_leader_lost)
        params = {"mode": rng.choice(["fail", "drop", "hold"]), "slow": some(0.3, 2.0)}
    elif kind == "operator-standby-slow-get":
        # Answers to the standby's reads of the leader Lease come this late (up to past the lease).
        seconds, params = some(4, 10), {"delay": some(1.0, LEADER_LEASE_SECONDS)}
    elif kind in ("worker-freeze", "worker-partition"):
        seconds = past_lease()
    elif kind == "worker-complete-while-revoked":
        params = {"variant": rng.choice(["after-revocation", "during-confirmation"])}
    elif kind == API_PAUSE:
        seconds = round(LEASE_SECONDS + rng.uniform(2, 8), 1)
        params = {"component": rng.choice(["kube-apiserver", "kube-apiserver", "etcd"])}
    elif kind == "run-suspend":
        seconds = some(2, 8)
    at = round(rng.uniform(1.0, max(1.5, window - min(seconds, window - 3))), 1)
    return FaultPlan(kind=kind, at=at, run=target, seconds=seconds, params=params)


def replay_command(seed: int, allow_api_pause: bool = True, source: str | None = None) -> str:
    """The one line that re-runs a trial; `source`: the commit whose operator it ran (benchmarks/chaos.py --source)."""
    flags = ("" if allow_api_pause else " --no-api-pause") + (f" --source {source}" if source else "")
    return f"flock /tmp/tether-cluster.lock .venv/bin/python benchmarks/chaos.py --replay {seed}{flags}"


# --- where a trial runs ----------------------------------------------------------------------


@dataclass
class ClusterHandle:
    """A control plane with an audit log. `pause_pids` only for a private one (never pause a shared one)."""

    kubeconfig: Path
    audit_log: Path
    ca: pki.CertPair | None = None  # signs the proxies' certificates; worker pods trust only this CA
    pause_pids: dict[str, int] = field(default_factory=dict)
    label: str = "shared"
    kueue: bool = False  # Kueue's manager runs on it: queued runs are queued

    @classmethod
    def from_env(cls) -> "ClusterHandle":
        """The test session's shared control plane (tests/conftest.py); it must not be paused."""
        state = Path(os.environ["TETHER_TEST_STATE_DIR"])
        return cls(Path(os.environ["TETHER_TEST_KUBECONFIG"]), Path(os.environ["TETHER_TEST_AUDIT_LOG"]),
                   pki.CertPair(state / "pki" / "ca.crt", state / "pki" / "ca.key"),
                   kueue=bool(os.environ.get("TETHER_TEST_KUEUE")))

    @classmethod
    def from_local(cls, cluster: Any, label: str, pausable: bool = False) -> "ClusterHandle":
        """From a started tether.devcluster.controlplane.LocalCluster(audit=True)."""
        ca = pki.CertPair(cluster.state_dir / "pki" / "ca.crt", cluster.state_dir / "pki" / "ca.key")
        pids = {name: proc.pid for name, proc in cluster._procs} if pausable else {}
        return cls(Path(cluster.kubeconfig), Path(cluster.audit_log), ca, pids, label,
                   kueue=getattr(cluster, "kueue", None) is not None)


def read_audit(path: Path, offset: int, namespace: str) -> tuple[list[AuditRecord], list[str]]:
    """Completed requests about `namespace` logged after byte `offset`: parsed, and raw lines (kept as evidence)."""
    records, raw, _ = read_audit_to_end(path, offset, namespace)
    return records, raw


def read_audit_to_end(path: Path, offset: int, namespace: str) -> tuple[list[AuditRecord], list[str], int]:
    """read_audit, and the offset just past the last whole line read (where the next read starts)."""
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    data = data[: data.rfind(b"\n") + 1]  # the API server may be writing the last line
    # (cut: a line cut by the offset was written before the trial's namespace existed)
    parsed = list(parse_lines(data, namespace, cut=True))
    records, raw = [r for r, _ in parsed], [line.decode() for _, line in parsed]
    return records, raw, offset + len(data)


# --- one trial -----------------------------------------------------------------------------


@dataclass
class TrialResult:
    plan: Plan
    verdict: Verdict
    namespace: str
    seconds: float
    faults: Counter[str]  # executed, by kind
    skipped: Counter[str]  # drawn but found no target (e.g. the run had already ended)
    notes: list[str]  # what the harness saw that is not an invariant (operator exits, fault errors)
    artifacts: Path | None  # kept only when the trial failed
    error: str | None = None  # the harness itself broke: the trial proves nothing and counts as failed
    source: str | None = None  # the commit the operator and workers ran from (None: the working tree)
    sdks: dict[str, set[str]] = field(default_factory=dict)  # per run, the SDK flavours its workers said they ran

    @property
    def ok(self) -> bool:
        return self.verdict.ok and self.error is None

    def summary(self) -> str:
        kinds = ",".join(f.kind for f in self.plan.faults)
        verdict = "ok" if self.ok else "HARNESS ERROR" if self.error else \
            "VIOLATED " + ",".join(str(i) for i in sorted(self.verdict.by_invariant()))
        return (f"seed {self.plan.seed}: {len(self.plan.runs)} runs{' ha' if self.plan.ha else ''}, "
                f"faults [{kinds}] -> {verdict} ({self.seconds:.0f}s)")

    def record(self) -> dict[str, Any]:
        """The trial as one JSON line of a campaign's results file."""
        return {"seed": self.plan.seed, "ok": self.ok, "error": self.error, "seconds": round(self.seconds, 1),
                "source": self.source, "namespace": self.namespace, "faults": dict(self.faults),
                "skipped": dict(self.skipped), "by_invariant": dict(self.verdict.by_invariant()),
                "violations": [str(v) for v in self.verdict.violations],
                "stats": {**self.verdict.stats, **Counter(f"runs whose workers ran the {sdk} Python SDK"
                                                          for flavours in self.sdks.values() for sdk in flavours)},
                "replay": replay_command(self.plan.seed, self.plan.allow_api_pause, self.source)}

    def report(self) -> str:
        """What a failing trial prints: seed, each violation with its evidence, and how to replay it."""
        lines = [f"TRIAL FAILED  seed {self.plan.seed}  namespace {self.namespace}"]
        for v in self.verdict.violations:
            lines.append(f"  - {v}")
        if self.error:
            lines.append(f"  harness error: {self.error}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        if self.artifacts is not None:
            lines.append(f"  evidence kept in {self.artifacts} (plan, audit records, operator and worker logs)")
        lines.append(f"  replay: {replay_command(self.plan.seed, self.plan.allow_api_pause, self.source)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    """The worker a fault is aimed at: its run's UID, its pod (the holder), fence and process id."""

    uid: str
    pod: str
    fence: int
    pid: int


def _signal(pid: int, sig: int) -> bool:
    """Signals a worker's process group (the process kubelet starts each pod in a session of its own)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


class _Operators:
    """The operator replicas, restarted like a Deployment would when one exits on its own. Each
    process talks through the operator proxy with a token of its own, labelled
    "replica-<index>.<start>": its requests, and the audit log, say which process sent them.

    Every process is started from one thread that lives as long as this object: a child gets
    SIGKILL when the thread that spawned it ends (PR_SET_PDEATHSIG, tether/devcluster/processes.py),
    so an operator restarted from a fault's thread would die with that thread."""

    def __init__(self, namespace: str, proxy: ApiProxy, workdir: Path, ha: bool) -> None:
        args = ["--leader-elect", "--leader-election-namespace", namespace,
                "--leader-lease-seconds", str(LEADER_LEASE_SECONDS)] if ha else []
        self.replicas = [
            OperatorProcess(namespace, "", workdir / f"operator-{i}.log",
                            extra_env={"TETHER_FOLD_INTERVAL_SECONDS": "1", "POD_NAME": f"replica-{i}",
                                       "TETHER_ATTEMPT_HISTORY": str(ATTEMPT_HISTORY)},
                            extra_args=args)
            for i in range(2 if ha else 1)]
        self.proxy = proxy
        self.labels = [""] * len(self.replicas)  # the running (or last) process of each replica
        self.ha = ha
        self.lock = threading.Lock()
        self.down: set[int] = set()  # killed on purpose, not yet restarted
        self.exits: list[str] = []
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="operator-spawner")

    def _start(self, index: int) -> None:
        op = self.replicas[index]
        label = f"replica-{index}.{op.starts + 1}"
        op.kubeconfig = str(self.proxy.write_kubeconfig(self.proxy.workdir / f"kubeconfig-{label}",
                                                        token=self.proxy.client_token(label)))
        self._spawner.submit(op.start).result()
        self.labels[index] = label

    def index_of(self, label: str) -> int | None:
        """The replica whose process (now or before) sent requests as `label`."""
        m = re.fullmatch(r"replica-(\d+)\.\d+", label)
        return int(m.group(1)) if m else None

    def start(self) -> None:
        for i in range(len(self.replicas)):
            self._start(i)

    def kill(self, index: int) -> None:
        with self.lock:
            self.down.add(index)
            self.replicas[index].kill()

    def restart(self, index: int) -> None:
        """Starts the replica again unless it runs: with overlapping kills, the later kill's restart may
        come first, and a second process of one replica would be two operators without an election."""
        with self.lock:
            self.down.discard(index)
            op = self.replicas[index]
            if op.proc is None or op.proc.poll() is not None:
                self._start(index)

    def supervise(self) -> None:
        """Restarts replicas that exited by themselves (an HA leader that lost its lease exits on purpose)."""
        with self.lock:
            for i, op in enumerate(self.replicas):
                if i in self.down or op.proc is None or op.proc.poll() is None:
                    continue
                last = [e.get("event") for e in op.logs()[-5:]]
                self.exits.append(f"operator replica {i} ({self.labels[i]}) exited with {op.proc.returncode} "
                                  f"(last events {last})")
                self._start(i)

    def ensure_running(self) -> None:
        for i in sorted(self.down):
            self.restart(i)
        self.supervise()

    def stop(self) -> None:
        for op in self.replicas:
            op.stop()
        self._spawner.shutdown()

    def leader(self, kube: Kube, namespace: str) -> int:
        """Which replica leads now (HA), by the leader Lease's holder; replica 0 without HA."""
        if not self.ha:
            return 0
        resp = kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/tether-operator-leader")
        holder = ((resp.json().get("spec") or {}).get("holderIdentity") or "") if resp.status_code == 200 else ""
        m = re.match(r"replica-(\d+)_", holder)
        return int(m.group(1)) if m else 0


class Trial:
    """Runs one plan on one cluster and judges it. `run()` cleans up whatever happens."""

    def __init__(self, plan: Plan, cluster: ClusterHandle, workdir: Path, *, settle_seconds: float = SETTLE_SECONDS,
                 strict_window: bool = False, keep: str = "failed", source: str | None = None) -> None:
        self.plan, self.cluster = plan, cluster
        self.workdir = workdir
        self.settle_seconds = settle_seconds
        self.strict_window = strict_window
        self.keep = keep  # "failed" | "always" | "never"
        self.source = source
        self.ns = f"chaos-{plan.seed % 100000}-{uuid.uuid4().hex[:5]}"
        self.kube = Kube(str(cluster.kubeconfig))
        self.faults: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self.notes: list[str] = []
        self.faulted: set[tuple[str, str]] = set()
        self.deleted: set[str] = set()  # run names deleted for good
        self.queue: chaos_queues.TrialQueue | None = None
        self.preemptors: list[str] = []  # runs the preemption faults made
        self.model: chaos_models.TrialModel | None = None  # the model API of runs drawn metered
        # The trial's WorkerClass (cluster-scoped: named after the namespace) and its defaults, once a run is classed.
        self.class_name = f"{self.ns}-class"
        self.class_defaults: dict[str, Any] = {}
        self.suspended: set[str] = set()
        self.frozen: dict[int, str] = {}  # pid -> pod, continued when the faults end
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.t0 = 0.0
        self._settle_view: list[str] | None = None  # what the previous settle poll saw
        self.healed = threading.Event()  # the faults are over: the reviewer only approves
        self.reviewed = threading.Event()  # the trial settled: the reviewer stops

    # --- setup -------------------------------------------------------------------------------

    def _exec_kubeconfig(self, rp: RunPlan) -> Path:
        """The worker proxy as its server (the faults still apply), and as its user an exec plugin
        (testkit/exec_credential.py) minting the pod's own bound tokens, each said to expire
        in EXEC_CREDENTIAL_SECONDS: the SDK fetches credentials again and again through the faults."""
        path = self.worker_proxy.write_kubeconfig(self.workdir / f"{rp.name}.kubeconfig", namespace=self.ns)
        doc = yaml.safe_load(path.read_text())
        env = {"EXEC_ADMIN_KUBECONFIG": str(self.cluster.kubeconfig), "EXEC_NAMESPACE": self.ns,
               "EXEC_SERVICE_ACCOUNT": "default", "EXEC_BIND": "pod", "EXEC_EXPIRES_IN": str(EXEC_CREDENTIAL_SECONDS),
               "EXEC_LOG": str(self.workdir / f"{rp.name}.credentials.jsonl")}
        doc["users"][0]["user"] = {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable, "interactiveMode": "Never",
            "args": [str(Path(__file__).resolve().parent / "exec_credential.py")],
            "env": [{"name": k, "value": v} for k, v in env.items()]}}
        path.write_text(yaml.safe_dump(doc))
        return path

    def _body(self, rp: RunPlan) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "holdAttempts": list(range(1, 101)), "holdSeconds": 600, "holdWhileUnknown": True,
            "stopOnSignal": True, "gateFile": str(self.workdir / f"{rp.name}.gate"),
            "outFile": str(self.workdir / f"{rp.name}.jsonl"),
        }
        if rp.metered and self.model is not None:
            payload["model"] = self.model.payload(stream=rp.metered == "stream")
        elif rp.usage_per_second:
            payload["usagePerSecond"] = rp.usage_per_second
        if rp.usage_cents:
            payload["usageCents"] = rp.usage_cents
        if rp.fail_first:
            payload["failAttempts"] = [1]
        if rp.fail_on_yield:
            payload["failOnYield"] = True
        if rp.progress_deadline_seconds is not None:
            payload["checkpointEverySeconds"] = 1
        if rp.request is not None:
            payload["approval"] = rp.request
        env = [{"name": "TETHER_TEST_SDK", "value": rp.sdk}]
        if rp.credentials == "exec":
            env.append({"name": "KUBECONFIG", "value": str(self._exec_kubeconfig(rp))})
        body = app_run(rp.name, payload, duration=LEASE_SECONDS, renew=RENEW_SECONDS,
                       annotations={API_SERVER_ANNOTATION: self.worker_proxy.url}, max_attempts=4, env=env)
        spec = body["spec"]
        spec["lease"]["startupGraceSeconds"] = STARTUP_GRACE_SECONDS
        spec["stopGraceSeconds"] = 3
        if rp.classed:
            # The same values, from the class: a class-edit fault then changes what a run not started yet takes.
            self.class_defaults = {name: spec.pop(name) for name in ("lease", "retry", "stopGraceSeconds")}
            spec["className"] = self.class_name
        spec["template"]["spec"]["terminationGracePeriodSeconds"] = 2
        budget: dict[str, Any] = {}
        if rp.budget:
            budget["budgetRef"] = {"name": BUDGET}
        if rp.cap_cents is not None:
            budget["capCents"] = rp.cap_cents
        if rp.pause:
            budget["onExhausted"] = "Pause"
        if budget:
            spec["budget"] = budget
        if rp.review:
            spec["review"] = {"result": True}
        if rp.deadline_seconds is not None:
            spec["deadlineSeconds"] = rp.deadline_seconds
        if rp.progress_deadline_seconds is not None:
            spec["progressDeadlineSeconds"] = rp.progress_deadline_seconds
        if rp.queued and self.queue is not None:
            chaos_queues.queue(body, "tether-chaos-low", chaos_queues.CPU_PER_RUN_MILLI)
        return body

    def _setup(self) -> None:
        kube, ns = self.kube, self.ns
        kube.ok(kube.post("/api/v1/namespaces", {"metadata": {"name": ns, "labels": {"tether.dev/test": "true"}}}))
        self._poll(lambda: kube.get(f"/api/v1/namespaces/{ns}/serviceaccounts/default").status_code == 200, 60,
                   "the namespace's default service account")
        if any(rp.budget for rp in self.plan.runs):
            kube.ok(kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{ns}/workerbudgets",
                              {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget",
                               "metadata": {"name": BUDGET}, "spec": {"limitCents": 10**9}}))
        seed = self.plan.seed
        self.op_proxy = ApiProxy(self.cluster.kubeconfig, seed=seed, ca=self.cluster.ca,
                                 workdir=self.workdir / "operator-proxy")
        self.worker_proxy = ApiProxy(self.cluster.kubeconfig, seed=seed + 1, ca=self.cluster.ca,
                                     workdir=self.workdir / "worker-proxy")
        self.operators = _Operators(ns, self.op_proxy, self.workdir, self.plan.ha)
        self.operators.start()
        queued = sum(rp.queued for rp in self.plan.runs)
        if queued and self.cluster.kueue:
            self.queue = chaos_queues.set_up(kube, ns, queued, self._poll)
        elif queued:
            self.notes.append(f"no Kueue on this cluster: {queued} queued run(s) run unqueued, no preemption")
        if any(rp.metered for rp in self.plan.runs):
            self.model = chaos_models.TrialModel(seed)
        self.bodies = {rp.name: self._body(rp) for rp in self.plan.runs}
        if self.class_defaults:
            kube.ok(kube.post(CLASSES, {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerClass",
                                        "metadata": {"name": self.class_name}, "spec": {"defaults": self.class_defaults}}))
        for body in self.bodies.values():
            kube.ok(kube.post(Kube.wr_path(ns), body))
        if self.plan.children:
            self._planner()
        if self.plan.schedule:
            kube.ok(kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{ns}/workerrunschedules", {
                "apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunSchedule", "metadata": {"name": SCHEDULE},
                "spec": {"schedule": f"@every {SCHEDULE_EVERY}s", "concurrencyPolicy": "Allow",
                         "runTemplate": {"spec": {"executor": "External", "suspend": True}}}}))

    def _planner(self) -> None:
        """The planner and its classes: its tool calls' pods reach the API server through the
        workers' proxy, as every worker of the trial does."""
        planners, tools = f"{self.ns}-planners", f"{self.ns}-tools"
        for name, bounds in ((planners, {"childClasses": [tools]}), (tools, {})):
            self.kube.ok(self.kube.post(CLASSES, {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerClass",
                                                  "metadata": {"name": name}, "spec": {"bounds": bounds}}))
        tool = app_run("tool", {}, duration=LEASE_SECONDS, renew=RENEW_SECONDS,
                       annotations={API_SERVER_ANNOTATION: self.worker_proxy.url})["spec"]["template"]
        tool["spec"]["terminationGracePeriodSeconds"] = 2
        share = PLANNER_CAP_CENTS // (len(self.plan.children) + 1)
        calls = [{"key": f"tool:{i}", "className": tools, "capCents": share,
                  "payload": {"workSeconds": 1 + i, "usagePerSecond": cents,
                              "outFile": str(self.workdir / f"{PLANNER}-tool-{i}.jsonl")}}
                 for i, cents in enumerate(self.plan.children)]
        body = app_run(PLANNER, {"calls": calls, "childTemplate": tool, "outFile": str(self.workdir / f"{PLANNER}.jsonl"),
                                 **({"crashAfter": self.plan.crash_after} if self.plan.crash_after else {})},
                       duration=LEASE_SECONDS, renew=RENEW_SECONDS,
                       annotations={API_SERVER_ANNOTATION: self.worker_proxy.url}, max_attempts=4)
        spec = body["spec"]
        spec["template"]["spec"]["containers"][0]["command"] = ["python", "tests/support/planner_app.py"]
        spec["template"]["spec"]["terminationGracePeriodSeconds"] = 2
        spec["lease"]["startupGraceSeconds"] = STARTUP_GRACE_SECONDS
        spec["className"] = planners
        spec["budget"] = {"capCents": PLANNER_CAP_CENTS}
        self.kube.ok(self.kube.post(Kube.wr_path(self.ns), body))

    def _tree(self) -> list[str]:
        """The planner and its children, by name (none when the plan draws no planner)."""
        if not self.plan.children:
            return []
        listed = self.kube.get(Kube.wr_path(self.ns), params={"labelSelector": f"tether.dev/parent={PLANNER}"})
        return [PLANNER] + ([c["metadata"]["name"] for c in listed.json()["items"]] if listed.status_code == 200 else [])

    # --- helpers ------------------------------------------------------------------------------

    def _poll(self, predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = predicate()
            except httpx.HTTPError:
                value = None  # the API server may be paused by the trial itself
            if value:
                return value
            if time.monotonic() > deadline or self.stop.is_set():
                raise TimeoutError(f"no {what} within {timeout:.0f}s")
            time.sleep(interval)

    def _run(self, name: str) -> dict[str, Any] | None:
        resp = self.kube.get(Kube.wr_path(self.ns, name))
        return resp.json() if resp.status_code == 200 else None

    def _holder(self, name: str, timeout: float = 12.0) -> Target | None:
        """The run's worker once the run is Running with its pod's process up; None if it is not within `timeout`."""
        def find() -> Target | None:
            run = self._run(name)
            s = (run or {}).get("status") or {}
            if run is None or s.get("phase") != "Running" or not s.get("holder"):
                return None
            pod = self.kube.get(f"/api/v1/namespaces/{self.ns}/pods/{s['holder']}")
            if pod.status_code != 200:
                return None
            statuses = (pod.json().get("status") or {}).get("containerStatuses") or []
            m = re.match(r"process://(\d+)$", statuses[0].get("containerID", "")) if statuses else None
            if m is None or int(m.group(1)) == 0 or "running" not in (statuses[0].get("state") or {}):
                return None
            return Target(run["metadata"]["uid"], s["holder"], int(s["fence"]), int(m.group(1)))
        try:
            return self._poll(find, timeout, f"holder of {name}", interval=0.3)
        except TimeoutError:
            return None

    def _any_worker(self, first: int | None) -> tuple[str, Target] | None:
        """The worker of run `first`, or else of the next run (in the plan's order) that has one running;
        recorded as faulted."""
        assert first is not None
        for i in range(len(self.plan.runs)):
            name = self.plan.runs[(first + i) % len(self.plan.runs)].name
            if (target := self._holder(name, timeout=1.5)) is not None:
                self._mark(target.uid, target.pod)
                return name, target
        return None

    def _mark(self, uid: str, pod: str) -> None:
        with self.lock:
            self.faulted.add((uid, pod))

    def _wait(self, seconds: float) -> None:
        """The fault's own duration (the delay is the fault); ends early only when the trial aborts."""
        self.stop.wait(max(0.0, seconds))

    def _patch_spec(self, name: str, spec: dict[str, Any]) -> bool:
        return self.kube.patch(Kube.wr_path(self.ns, name), {"spec": spec}).status_code == 200

    def _resume(self, name: str) -> bool:
        """spec.suspend back to false; a run that was deleted meanwhile needs no resuming."""
        code = self.kube.patch(Kube.wr_path(self.ns, name), {"spec": {"suspend": False}}).status_code
        if code in (200, 404):
            with self.lock:
                self.suspended.discard(name)
        return code in (200, 404)

    def _client(self, pod: str) -> str:
        return rf"^{re.escape(self.ns)}/{re.escape(pod)}$"

    # --- faults -------------------------------------------------------------------------------

    def _fault(self, f: FaultPlan) -> None:
        self._wait(self.t0 + f.at - time.monotonic())
        if self.stop.is_set():
            return
        name = self.plan.runs[f.run].name if f.run is not None else ""
        act = getattr(self, "_f_" + f.kind.replace("-", "_"))
        try:
            if f.kind in AIMED_AT_WORKER:
                # Aimed at the run's current worker: found (and recorded as faulted) before it is hit.
                target = self._holder(name)
                if target is not None:
                    self._mark(target.uid, target.pod)
                done = False if target is None else act(f, name, target)
            else:
                done = act(f, name)
        except Exception as exc:  # noqa: BLE001 - counted as not injected, never as injected
            with self.lock:
                self.skipped[f.kind] += 1
                self.notes.append(f"{f.kind} at {f.at}s on {name or 'the cluster'}: not injected, "
                                  f"the harness failed: {exc!r}")
            return
        with self.lock:
            (self.faults if done is not False else self.skipped)[f.kind] += 1
            if done is False:
                self.notes.append(f"{f.kind} at {f.at}s on {name or 'the cluster'}: skipped, no live target")

    def _proxy_rule(self, proxy: ApiProxy, f: FaultPlan, client: str | None) -> None:
        p = f.params
        crit: dict[str, Any] = {"probability": p.get("probability", 1.0)}
        if p.get("method"):
            crit["method"] = p["method"]
        if client:
            crit["client"] = client
        kind = f.kind.split("-", 1)[1]
        if kind == "delay":
            rule = proxy.delay(p["delay"], phase=p["phase"], **crit)
        elif kind == "error":
            rule = proxy.status(p["code"], phase=p["phase"], **crit)
        else:
            rule = proxy.drop(phase=p["phase"], **crit)
        self._lasting(f.seconds, rule.remove)

    def _lasting(self, seconds: float, undo: Callable[[], Any]) -> None:
        """Keeps a fault in place for its duration, then undoes it (also when the trial aborts)."""
        try:
            self._wait(seconds)
        finally:
            undo()

    def _f_operator_delay(self, f: FaultPlan, _: str) -> None:
        self._proxy_rule(self.op_proxy, f, None)

    _f_operator_error = _f_operator_delay
    _f_operator_drop = _f_operator_delay

    def _f_operator_watch_expired(self, f: FaultPlan, _: str) -> None:
        self._lasting(f.seconds, self.op_proxy.status(410, watch=True, times=f.params["times"]).remove)

    def _f_operator_watch_hold(self, f: FaultPlan, _: str) -> None:
        self.op_proxy.hold_watches()
        self._lasting(f.seconds, self.op_proxy.release_watches)

    def _f_operator_watch_reset(self, f: FaultPlan, _: str) -> None:
        self.op_proxy.reset_watches()

    def _f_operator_cut(self, f: FaultPlan, _: str) -> None:
        self.op_proxy.cut()
        self._lasting(f.seconds, self.op_proxy.heal)

    def _f_operator_kill(self, f: FaultPlan, _: str) -> None:
        self._kill_leader(f.params["down"])

    def _kill_leader(self, down: float) -> None:
        """kill -9 of the acting operator; a new process starts `down` seconds later."""
        index = self.operators.leader(self.kube, self.ns)
        self.operators.kill(index)
        self._lasting(down, lambda: self.operators.restart(index))

    def _f_operator_kill_mid_grant(self, f: FaultPlan, _: str) -> bool:
        """The operator dies with a pod creation in flight (the grant's status and Lease are written);
        the request still reaches the API server, late, after its successor started: one pod, adopted."""
        return self._kill_with_creation_in_flight(f, "pods", 15)

    def _f_operator_kill_mid_schedule(self, f: FaultPlan, _: str) -> bool:
        """The operator dies with a slot's run creation in flight; the request still reaches the API
        server, late, after its successor started (and may have created that slot's run itself)."""
        return self._kill_with_creation_in_flight(f, "workerruns", SCHEDULE_EVERY * 3)

    def _kill_with_creation_in_flight(self, f: FaultPlan, plural: str, wait: float) -> bool:
        """Holds the operator's next creation of `plural`, kills the leader, and lets the creation
        land `late` seconds later; False when none came along within `wait` seconds."""
        gate = self.op_proxy.gate(method="POST", path=rf"/namespaces/{re.escape(self.ns)}/{plural}$")
        try:
            gate.wait_arrived(timeout=wait)
        except TimeoutError:
            gate.release()
            return False
        try:
            self._kill_leader(f.params["down"])
            self._wait(f.params["late"])
        finally:
            gate.release()
        return True

    def _f_operator_kill_mid_revocation(self, f: FaultPlan, name: str, target: Target) -> bool:
        """The worker freezes past its lease; the operator bumps the fence and dies with its Lease clear in
        flight. The worker wakes while the Lease still names it (its renewals land in the revocation
        window, with usage to settle); the old clear arrives late, after the successor started."""
        gate = self.op_proxy.gate(method="PUT", path=rf"/namespaces/{re.escape(self.ns)}/leases/{re.escape(name)}$")
        try:
            if not _signal(target.pid, signal.SIGSTOP):
                return False
            with self.lock:
                self.frozen[target.pid] = target.pod
            gate.wait_arrived(timeout=2 * LEASE_SECONDS + 10)
            self._kill_leader(f.params["down"])
            self._lasting(f.params["thaw"], lambda: self._thaw(target.pid))
            self._wait(f.params["late"])
        except TimeoutError as exc:
            self.notes.append(f"{f.kind} on {target.pod}: {exc}")
        finally:
            gate.release()
            self._thaw(target.pid)
        return True

    def _f_operator_kill_mid_grant_lease(self, f: FaultPlan, _: str) -> bool:
        """The operator dies between a grant's two writes (issue 21, defect 1): the status is in (fence
        bumped, the next holder named), the Lease write waits at the proxy. The run's worker is killed
        first, so that a grant comes, of attempt 2 or later, whose cleared Lease still carries the
        last attempt's usage. With the operator down the run is deleted, or its deadline made to
        pass, or it is left to the successor's repair; the held write lands late, or never."""
        aimed = self._any_worker(f.run)
        if aimed is None:
            return False
        name, target = aimed
        lease = rf"/namespaces/{re.escape(self.ns)}/leases/{re.escape(name)}$"
        gate = self.op_proxy.gate(method="PUT", path=lease)
        drop = False
        try:
            if not _signal(target.pid, signal.SIGKILL):
                return False
            deadline = time.monotonic() + 2 * LEASE_SECONDS + STARTUP_GRACE_SECONDS
            while True:
                (held,) = gate.wait_arrived(timeout=max(0.1, deadline - time.monotonic()))
                holder = ((self._run(name) or {}).get("status") or {}).get("holder")
                if holder not in (None, target.pod):
                    break  # the grant's Lease write: the status names the next holder
                # Another Lease write (the revocation's clear): it goes on, the next one waits.
                following, gate = gate, self.op_proxy.gate(method="PUT", path=lease)
                following.release()
            self._mark(target.uid, holder)
            index = self.operators.index_of(held.client)
            if index is None:
                self.notes.append(f"{f.kind} on {name}: the held Lease write came from {held.client}")
                return False
            self.operators.kill(index)
            drop = f.params["late"] is None
            if f.params["variant"] == "delete":
                self._f_run_delete(f, name)
            elif f.params["variant"] == "deadline":
                self._patch_spec(name, {"deadlineSeconds": 1})  # status.endsAt is in the past now
            self._lasting(f.params["down"], lambda: self.operators.restart(index))
            if not drop:
                self._wait(f.params["late"])
            return True
        except TimeoutError as exc:
            self.notes.append(f"{f.kind} on {name}: no grant after killing {target.pod}: {exc}")
            return False
        finally:
            gate.drop() if drop else gate.release()

    def _f_operator_standby_slow_get(self, f: FaultPlan, _: str) -> bool:
        """HA: the standby's reads of the leader Lease are answered `delay` seconds late, so what it
        reads of the leader's renewals is old when it arrives: it must not take over while the
        leader still leads (oracle invariant 9)."""
        if not self.plan.ha:
            return False
        label = self.operators.labels[self.operators.leader(self.kube, self.ns)]
        rule = self.op_proxy.delay(f.params["delay"], phase="response", method="GET",
                                   path=rf"/leases/{LEADER_LEASE}$", client=rf"^(?!{re.escape(label)}$)replica-")
        self._lasting(f.seconds, rule.remove)
        return True

    def _f_operator_leader_lost(self, f: FaultPlan, _: str) -> bool:
        """HA: the leader loses its leadership in the middle of a pass (issue 21, defect 6).

        Its requests for the leader Lease fail (503), vanish (dropped) or hang (held until the fault
        ends). The worker of the aimed-at run (or of the next run that has one) is killed, so a
        revocation follows: status, Lease, pod. The answer to the leader's next status write is
        held until its renew deadline and the oracle's slack have passed, so its pass can go on
        only after its leadership ended; its other writes are answered `slow` seconds late. The
        standby's bid for the Lease waits a moment longer, else it might finish the pass's work
        first and leave the deposed leader nothing to write. The deposed leader must write nothing
        more (oracle invariant 9) and exit; the standby takes over and finishes what was left."""
        if not self.plan.ha:
            return False
        label = self.operators.labels[self.operators.leader(self.kube, self.ns)]
        aimed = self._any_worker(f.run)
        client = rf"^{re.escape(label)}$"
        elections: dict[str, Any] = {"method": "GET|PUT", "path": rf"/leases/{LEADER_LEASE}$", "client": client}
        mode, t0 = f.params["mode"], time.monotonic()
        # From now on no renewal succeeds: the leadership ends within the renew deadline.
        rule = self.op_proxy.status(503, **elections) if mode == "fail" else \
            self.op_proxy.drop(**elections) if mode == "drop" else self.op_proxy.gate(times=None, **elections)
        pass_ = self.op_proxy.gate(phase="response", method="PUT", path=r"/workerruns/[^/]+/status$", client=client)
        slow = self.op_proxy.delay(f.params["slow"], phase="response", method="|".join(sorted(WRITES)),
                                   path=rf"^(?!.*/leases/{LEADER_LEASE}$)", client=client)
        standby = self.op_proxy.gate(times=None, method="PUT|POST", path=rf"/leases(/{LEADER_LEASE})?$",
                                     client=rf"^(?!{re.escape(label)}$)replica-")
        try:
            if aimed is not None:
                _signal(aimed[1].pid, signal.SIGKILL)
            self._wait(RENEW_DEADLINE + LEADERSHIP_SLACK.total_seconds() + 0.5)
            pass_.release()  # the held pass goes on, past the end of the leadership
            self._wait(1.5)
            standby.release()
            self._wait(t0 + f.seconds - time.monotonic())
        finally:
            for gate in (pass_, standby):
                gate.release()
            slow.remove()
            rule.release() if isinstance(rule, Gate) else rule.remove()
        return True

    def _f_worker_delay(self, f: FaultPlan, name: str, target: Target) -> None:
        self._proxy_rule(self.worker_proxy, f, self._client(target.pod))

    _f_worker_error = _f_worker_delay
    _f_worker_drop = _f_worker_delay

    def _f_worker_freeze(self, f: FaultPlan, name: str, target: Target) -> bool:
        if not _signal(target.pid, signal.SIGSTOP):
            return False
        with self.lock:
            self.frozen[target.pid] = target.pod
        self._lasting(f.seconds, lambda: self._thaw(target.pid))
        return True

    def _thaw(self, pid: int) -> None:
        with self.lock:
            self.frozen.pop(pid, None)
        _signal(pid, signal.SIGCONT)

    def _f_worker_partition(self, f: FaultPlan, name: str, target: Target) -> None:
        # Everything it sends waits at the proxy, and arrives late when the partition heals.
        self._lasting(f.seconds, self.worker_proxy.gate(client=self._client(target.pod), times=None).release)

    def _f_worker_kill(self, f: FaultPlan, name: str, target: Target) -> bool:
        return _signal(target.pid, signal.SIGKILL)

    def _f_worker_complete_while_revoked(self, f: FaultPlan, name: str, target: Target) -> None:
        """The worker publishes its result just as the operator revokes it.

        Its renewals are held at the proxy, so its lease lapses; its result PATCH is held too.
        after-revocation: the PATCH goes on once the operator's fence bump is in (it must be refused).
        during-confirmation: the PATCH goes on while the operator's confirming Lease GET is held, and
        lands before the revocation (it must be kept, and the run succeed)."""
        pod, fence = target.pod, target.fence
        client = self._client(pod)
        renewals = self.worker_proxy.gate(client=client, method="PUT", path=rf"/leases/{re.escape(name)}$", times=None)
        results = self.worker_proxy.gate(client=client, method="PATCH",
                                         path=rf"/workerruns/{re.escape(name)}/status$", times=None)
        confirm = None
        if f.params["variant"] == "during-confirmation":
            confirm = self.op_proxy.gate(method="GET", path=rf"/namespaces/{self.ns}/leases/{re.escape(name)}$")
        try:
            (self.workdir / f"{name}.gate").touch()  # the worker stops holding and publishes
            deadline = 2 * LEASE_SECONDS + STARTUP_GRACE_SECONDS
            results.wait_arrived(timeout=deadline)
            if confirm is None:
                self._poll(lambda: int(((self._run(name) or {}).get("status") or {}).get("fence", 0)) > fence,
                           deadline, f"revocation of {pod}")
                results.release()
            else:
                confirm.wait_arrived(timeout=deadline)
                results.release()
                self.worker_proxy.wait_for_request(
                    lambda r: r.method == "PATCH" and r.client == f"{self.ns}/{pod}" and r.status is not None,
                    timeout=15)
        except TimeoutError as exc:
            self.notes.append(f"{f.kind} on {pod}: {exc}")
        finally:
            results.release()
            renewals.release()
            if confirm is not None:
                confirm.release()

    def _f_api_pause(self, f: FaultPlan, _: str) -> bool:
        pid = self.cluster.pause_pids.get(f.params["component"])
        if pid is None:
            return False  # never on a shared control plane
        os.kill(pid, signal.SIGSTOP)
        self._lasting(f.seconds, lambda: os.kill(pid, signal.SIGCONT))
        return True

    def _f_run_preempt(self, f: FaultPlan, _: str) -> bool:
        """A run of the highest priority asking for the whole quota: Kueue evicts every admitted
        queued run, each is told to yield (or revoked at its grace) and resumes after it."""
        if self.queue is None:
            return False
        name = f"preemptor{len(self.preemptors)}"
        rp = RunPlan(name=name, budget=False, usage_per_second=0, usage_cents=0, fail_first=False, cap_cents=None,
                     gate_at=None)
        (self.workdir / f"{name}.gate").touch()  # it finishes as soon as it starts
        body = chaos_queues.queue(self._body(rp), "tether-chaos-high", self.queue.quota_milli)
        if self.kube.post(Kube.wr_path(self.ns), body).status_code != 201:
            return False
        with self.lock:
            self.preemptors.append(name)
        return True

    _f_run_preempt_again = _f_run_preempt

    def _f_class_edit(self, f: FaultPlan, _: str) -> bool:
        """A longer lease and stop grace for the runs of the trial's class that have not started yet (one
        second longer: a worker-freeze or -partition, drawn past LEASE_SECONDS, still outlasts it)."""
        if not self.class_defaults:
            return False
        path = f"{CLASSES}/{self.class_name}"
        edited = self.kube.ok(self.kube.get(path))
        edited["spec"]["defaults"]["lease"] = {**self.class_defaults["lease"], "durationSeconds": LEASE_SECONDS + 1}
        edited["spec"]["defaults"]["stopGraceSeconds"] = 5
        self.kube.ok(self.kube.put(path, edited))
        return True

    def _f_run_delete(self, f: FaultPlan, name: str) -> bool:
        if self.kube.delete(Kube.wr_path(self.ns, name)).status_code != 200:
            return False
        with self.lock:
            self.deleted.add(name)
        return True

    def _f_run_stop(self, f: FaultPlan, name: str) -> bool:
        return self._patch_spec(name, {"stop": True})

    def _f_run_raise_cap(self, f: FaultPlan, name: str) -> bool:
        """A person raises a paused run's cap: the same attempt goes on."""
        return self._patch_spec(name, {"budget": {"capCents": RAISED_CAP_CENTS}})

    def _f_run_suspend(self, f: FaultPlan, name: str) -> bool:
        if not self._patch_spec(name, {"suspend": True}):
            return False
        with self.lock:
            self.suspended.add(name)
        self._wait(f.seconds)
        self._resume(name)
        return True

    def _f_run_recreate(self, f: FaultPlan, name: str) -> bool:
        if not self._f_run_delete(f, name):
            return False
        try:
            self._poll(lambda: self.kube.get(Kube.wr_path(self.ns, name)).status_code == 404, 30,
                       f"deletion of {name}")
        except TimeoutError as exc:
            self.notes.append(f"run-recreate: {exc}")
            return True
        if self.kube.post(Kube.wr_path(self.ns), self.bodies[name]).status_code == 201:
            with self.lock:
                self.deleted.discard(name)
        return True

    # --- the trial ------------------------------------------------------------------------------

    def _heal(self) -> None:
        self.op_proxy.clear()
        self.worker_proxy.clear()
        for pid in list(self.frozen):
            self._thaw(pid)
        for pid_name in ("kube-apiserver", "etcd"):
            pid = self.cluster.pause_pids.get(pid_name)
            if pid is not None:
                os.kill(pid, signal.SIGCONT)
        self.operators.ensure_running()
        for name in list(self.suspended):
            self._poll(lambda: self._resume(name), 30, f"resume of {name}")
        for rp in self.plan.runs:
            if rp.pause:  # raised by now unless its fault missed it (the run deleted and re-created)
                self._patch_spec(rp.name, {"budget": {"capCents": RAISED_CAP_CENTS}})
            (self.workdir / f"{rp.name}.gate").touch()
        if self.plan.schedule:  # its slots are recorded as skipped (Suspended) from now on
            self.kube.ok(self.kube.patch(f"/apis/tether.dev/v1alpha1/namespaces/{self.ns}/workerrunschedules/{SCHEDULE}",
                                         {"spec": {"suspend": True}}))

    def _settled(self) -> bool:
        """Every run ended (or deleted as planned), its revocation finished (the Lease cleared), its
        budget charged, and nothing moved since the previous poll: the books are closed."""
        self.operators.supervise()
        view: list[str] = []
        for name in [rp.name for rp in self.plan.runs] + list(self.preemptors) + self._tree():
            resp = self.kube.get(Kube.wr_path(self.ns, name))
            if name in self.deleted:
                if resp.status_code != 404:
                    return False
                continue
            if resp.status_code != 200:
                return False
            run = resp.json()
            s = run.get("status") or {}
            if s.get("phase") not in TERMINAL or s.get("holder") is not None:
                return False
            if (run["spec"].get("budget") or {}).get("budgetRef") and not s.get("budgetCharged"):
                return False
            lease = self.kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{self.ns}/leases/{name}")
            if lease.status_code == 200 and (lease.json().get("spec") or {}).get("holderIdentity") is not None:
                return False
            view += [run["metadata"]["resourceVersion"],
                     lease.json()["metadata"]["resourceVersion"] if lease.status_code == 200 else "-"]
        quiet, self._settle_view = view == self._settle_view, view
        return quiet

    def _watch_leases(self, names: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Each live run's Lease now, and once it changed (or after a few renew intervals)."""
        path = f"/apis/coordination.k8s.io/v1/namespaces/{self.ns}/leases/"
        get = lambda n: (r := self.kube.get(path + n)).status_code == 200 and r.json() or None  # noqa: E731
        before = {n: get(n) for n in names}
        after: dict[str, Any] = {}
        deadline = time.monotonic() + 4 * RENEW_SECONDS + 4
        while time.monotonic() < deadline and len(after) < len(names):
            for n in names:
                if n in after:
                    continue
                now = get(n)
                if now is not None and before[n] is not None and \
                        now["metadata"]["resourceVersion"] != before[n]["metadata"]["resourceVersion"]:
                    after[n] = now
            time.sleep(0.2)
        for n in names:
            after.setdefault(n, get(n))
        return before, after

    def run(self) -> TrialResult:
        started = time.monotonic()
        shutil.rmtree(self.workdir, ignore_errors=True)  # a replay must not find the last one's open gates
        self.workdir.mkdir(parents=True)
        (self.workdir / "plan.json").write_text(json.dumps(asdict(self.plan), indent=1))
        offset = self.cluster.audit_log.stat().st_size
        verdict = Verdict()
        sdks: dict[str, set[str]] = {}
        raw: list[str] = []
        facts: TrialFacts | None = None
        error: str | None = None
        self.op_proxy = self.worker_proxy = None  # type: ignore[assignment]
        self.operators = None  # type: ignore[assignment]
        try:
            self._setup()
            self.t0 = time.monotonic()
            threads = [threading.Thread(target=self._guard, args=(self._fault, f), daemon=True,
                                        name=f"fault-{f.kind}") for f in self.plan.faults]
            threads += [threading.Thread(target=self._guard, args=(self._open_gate, rp), daemon=True)
                        for rp in self.plan.runs if rp.gate_at is not None]
            reviewer = threading.Thread(target=self._guard, args=(self._review,), daemon=True, name="reviewer")
            if any(rp.review or rp.request for rp in self.plan.runs):
                reviewer.start()
            for t in threads:
                t.start()
            end = self.t0 + FAULT_WINDOW + 4 * LEASE_SECONDS  # the longest fault ends well before this
            for t in threads:
                while t.is_alive() and time.monotonic() < end:
                    self.operators.supervise()
                    t.join(timeout=0.5)
            if any(t.is_alive() for t in threads):
                self.notes.append("harness: a fault thread outlived its bound")
            self._heal()
            self.healed.set()  # the reviewer approves from now on, so every run can finish
            try:
                self._poll(self._settled, self.settle_seconds, "settled trial", interval=0.5)
            except TimeoutError:
                pass  # the oracle says what did not settle
            self.reviewed.set()
            if reviewer.is_alive():
                reviewer.join(timeout=10)
            runs = self.kube.ok(self.kube.get(Kube.wr_path(self.ns)))["items"]
            live = [r["metadata"]["name"] for r in runs if (r.get("status") or {}).get("phase") not in TERMINAL]
            before, after = self._watch_leases(live) if live else ({}, {})
            runs = self.kube.ok(self.kube.get(Kube.wr_path(self.ns)))["items"]
            budgets = self.kube.ok(self.kube.get(f"/apis/tether.dev/v1alpha1/namespaces/{self.ns}/workerbudgets"))
            leases = self.kube.ok(self.kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{self.ns}/leases"))["items"]
            pods = self.kube.ok(self.kube.get(f"/api/v1/namespaces/{self.ns}/pods"))["items"]
            judged_at = dt.datetime.now(dt.timezone.utc)
            records, raw = read_audit(self.cluster.audit_log, offset, self.ns)
            workloads = self.kube.ok(self.kube.get(f"{chaos_queues.KUEUE}/namespaces/{self.ns}/workloads"))["items"] \
                if self.queue is not None else []
            facts = TrialFacts(namespace=self.ns, faulted=set(self.faulted), runs=runs, budgets=budgets["items"],
                               leases_before=before, leases_after=after, workloads_final=workloads,
                               leases_final={x["metadata"]["name"]: x for x in leases},
                               pods_final=pods, judged_at=judged_at,
                               leader_lease=LEADER_LEASE if self.plan.ha else None, renew_deadline=RENEW_DEADLINE,
                               queue_quota_milli=self.queue.quota_milli if self.queue is not None else None,
                               model_answers=self.model.answers() if self.model is not None else [],
                               schedules=self._schedules())
            verdict = judge(records, facts, strict_window=self.strict_window)
            self._misinformed(records, verdict)
            sdks = {rp.name: {str(e.get("sdk")) for e in self._worker_records(rp)} for rp in self.plan.runs}
            verdict.stats["exec credentials minted for workers"] += sum(
                len((self.workdir / f"{rp.name}.credentials.jsonl").read_text().splitlines())
                for rp in self.plan.runs if (self.workdir / f"{rp.name}.credentials.jsonl").exists())
        except Exception as exc:  # noqa: BLE001 - a broken trial is reported and counted, never passed
            error = f"{exc!r}"
            self.notes.append(traceback.format_exc())
        finally:
            self.notes.extend(self.operators.exits if self.operators else [])
            self.stop.set()
            self._teardown()
            # Kept too: trials where a worker was misinformed about its own result (worth a look).
            notable = bool(verdict.stats["workers told their accepted result was refused"])
            keep = self.keep == "always" or (self.keep == "failed" and (not verdict.ok or error is not None or notable))
            if keep:
                (self.workdir / "audit.jsonl").write_text("\n".join(raw) + "\n")
                if facts is not None:  # the final objects as judged: a run's last conditions say why it waits
                    (self.workdir / "final.json").write_text(json.dumps({
                        "runs": facts.runs, "workloads": facts.workloads_final, "pods": facts.pods_final,
                        "leases": list(facts.leases_final.values()), "budgets": facts.budgets}, indent=1, default=str))
                (self.workdir / "verdict.txt").write_text(
                    "\n".join([str(v) for v in verdict.violations] + verdict.window_renewals + self.notes) + "\n")
            else:
                shutil.rmtree(self.workdir, ignore_errors=True)
        return TrialResult(self.plan, verdict, self.ns, time.monotonic() - started, self.faults, self.skipped,
                           self.notes, self.workdir if keep else None, error, self.source, sdks)

    def _schedules(self) -> dict[str, tuple[int, dict[str, Any]]]:
        """The trial's schedule as it ended, with its period (invariant 14)."""
        if not self.plan.schedule:
            return {}
        body = self.kube.ok(self.kube.get(f"/apis/tether.dev/v1alpha1/namespaces/{self.ns}/workerrunschedules/{SCHEDULE}"))
        return {SCHEDULE: (SCHEDULE_EVERY, body)}

    def _worker_records(self, rp: RunPlan) -> list[dict[str, Any]]:
        """What the run's workers recorded (tests/support/worker_app.py's outFile)."""
        out = self.workdir / f"{rp.name}.jsonl"
        return [json.loads(x) for x in out.read_text().splitlines() if x.strip()] if out.exists() else []

    def _misinformed(self, records: list[AuditRecord], verdict: Verdict) -> None:
        """Workers whose result the API server accepted but who were told otherwise: LeaseLost (an answer
        lost on the way, then a retry refused because the result was already there: the worker draws
        the wrong conclusion) or OwnershipUnknown (the request was held up and landed after the worker
        gave up: honest). Not a breach of the six invariants (the result stands): noted and counted."""
        # By run UID too: a run re-created under its name reuses the pod names.
        published = {(r.object_ref.name, r.user.pod, str(((r.response_object or {}).get("metadata") or {}).get("uid")))
                     for r in records if r.accepted and r.user.pod and r.object_ref is not None
                     and r.object_ref.subresource == "status"}
        for rp in self.plan.runs:
            for entry in self._worker_records(rp):
                pod = f"{rp.name}-a{entry.get('attempt')}"
                if entry.get("event") == "complete" and not entry.get("accepted") and \
                        (rp.name, pod, str(entry.get("runUid"))) in published:
                    # OwnershipUnknown is honest (its request was still on its way); LeaseLost is wrong.
                    told = "refused" if entry.get("error") == "LeaseLost" else "unknown"
                    verdict.stats[f"workers told their accepted result was {told}"] += 1
                    self.notes.append(f"{pod} was told {entry.get('error')} though its result was accepted")

    def _guard(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - one fault's failure must not end the trial
            with self.lock:
                self.notes.append(f"harness: {fn.__name__}{args!r} failed: {exc!r}")

    def _review(self) -> None:
        """A person deciding, as the plan says. Results under review: each attempt's result once,
        after a delay, Approve or Deny, naming the attempt; a plan's "unbound" decision first tries
        without naming it, which the API server must refuse; after the faults, Approve only. A
        worker's request: each attempt's once it shows pending, after the plan's wait (longer than
        the run's progress deadline, also after the faults), with the plan's decision."""
        me = self.kube.ok(self.kube.post("/apis/authentication.k8s.io/v1/selfsubjectreviews", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}))["status"]["userInfo"]["username"]
        plans = {rp.name: rp for rp in self.plan.runs if rp.review or rp.request}
        due: dict[tuple[str, str, str, int], float] = {}  # (run, uid, gate, attempt) -> when to decide
        decided: set[tuple[str, str, str, int]] = set()
        while not self.reviewed.is_set():
            for name, rp in plans.items():
                run = self._run(name)
                s = (run or {}).get("status") or {}
                if run is None or not s.get("attempts"):
                    continue
                uid, attempt = run["metadata"]["uid"], int(s["attempts"][-1]["attempt"])
                gates: list[tuple[str, float, str, bool, str]] = []  # (gate, wait, decision, bound, counted as)
                if rp.review and s.get("phase") == "AwaitingReview":
                    wait, decision, bound = rp.reviews[min(attempt, len(rp.reviews)) - 1]
                    decision = "Approve" if self.healed.is_set() else decision
                    gates.append(("Result", wait, decision, bound, REVIEW_DECISIONS[decision == "Deny"]))
                if rp.request and any(r.get("gate") == rp.request and r.get("attempt") == attempt
                                      and r.get("decision") is None
                                      for r in (s.get("review") or {}).get("requests") or []):
                    gates.append((rp.request, rp.request_wait, rp.request_decision, True,
                                  REQUEST_DECISIONS[rp.request_decision == "Deny"]))
                for gate, wait, decision, bound, counted in gates:
                    key = (name, uid, gate, attempt)
                    due.setdefault(key, time.monotonic() + wait)
                    if key not in decided and time.monotonic() >= due[key] and \
                            self._decide(me, name, uid, gate, attempt, decision, bound):
                        decided.add(key)
                        with self.lock:
                            self.faults[counted] += 1
            self.reviewed.wait(0.3)

    def _decide(self, me: str, name: str, uid: str, gate: str, attempt: int, decision: str, bound: bool) -> bool:
        """One WorkerRunApproval of `gate` of that attempt; `bound` False: first one naming no attempt
        (the API server must refuse it). Whether the decision was recorded."""
        spec: dict[str, Any] = {"runRef": {"name": name, "uid": uid}, "gate": gate,
                                "decision": decision, "reason": "chaos reviewer", "approver": me}
        path = f"/apis/tether.dev/v1alpha1/namespaces/{self.ns}/workerrunapprovals"
        body = {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunApproval",
                "metadata": {"generateName": f"{name}-"}, "spec": spec}
        if not bound and self.kube.post(path, body).status_code != 422:
            with self.lock:
                self.notes.append(f"harness: an approval of {name}'s {gate} naming no attempt was not refused")
        spec["attempt"] = attempt
        return self.kube.post(path, body).status_code == 201

    def _open_gate(self, rp: RunPlan) -> None:
        assert rp.gate_at is not None
        self._wait(self.t0 + rp.gate_at - time.monotonic())
        (self.workdir / f"{rp.name}.gate").touch()

    def _teardown(self) -> None:
        """Deletes the runs while the operator still runs (their finalizers need it), then everything else."""
        for pid in list(self.frozen):
            self._thaw(pid)
        try:
            if self.operators is not None and self.op_proxy is not None:
                self.op_proxy.clear()
                self.worker_proxy.clear()
                self.operators.ensure_running()
                self.kube.delete(Kube.wr_path(self.ns))
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and self.kube.get(Kube.wr_path(self.ns)).json().get("items"):
                    time.sleep(0.5)
        except Exception as exc:  # noqa: BLE001 - teardown is best effort; the namespace goes anyway
            self.notes.append(f"teardown: {exc!r}")
        finally:
            if self.operators is not None:
                self.operators.stop()
            for proxy in (self.op_proxy, self.worker_proxy):
                if proxy is not None:
                    proxy.close()
            self.kube.delete(f"/api/v1/namespaces/{self.ns}")
            if self.class_defaults:
                self.kube.delete(f"{CLASSES}/{self.class_name}")
            if self.plan.children:
                for name in (f"{self.ns}-planners", f"{self.ns}-tools"):
                    self.kube.delete(f"{CLASSES}/{name}")
            if self.queue is not None:
                chaos_queues.tear_down(self.kube, self.queue)
            if self.model is not None:
                self.model.close()


# --- many trials ---------------------------------------------------------------------------


@dataclass
class Tally:
    """Totals over trials, from their records (so several batches' results files add up too)."""

    trials: int = 0
    failed: list[int] = field(default_factory=list)  # seeds
    harness_errors: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    violations: Counter[int] = field(default_factory=Counter)
    stats: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def add(self, record: dict[str, Any]) -> None:
        """One trial's `TrialResult.record()`."""
        self.trials += 1
        self.faults.update(record["faults"])
        self.skipped.update(record["skipped"])
        self.violations.update({int(k): n for k, n in record["by_invariant"].items()})
        self.stats.update(record["stats"])
        self.seconds += record["seconds"]
        self.harness_errors += record["error"] is not None
        if not record["ok"]:
            self.failed.append(record["seed"])

    def report(self) -> str:
        from testkit.oracle import INVARIANTS

        lines = [f"{self.trials} trials in {self.seconds / 60:.1f} min, {len(self.failed)} failed "
                 f"({self.harness_errors} of them by a harness error)"]
        lines.append("faults injected, by kind (skipped: drawn but not injected: no live target, or the "
                     "harness failed; see the trial's notes):")
        for kind in (*FAULT_KINDS, *REVIEW_DECISIONS, *REQUEST_DECISIONS):
            if self.faults[kind] or self.skipped[kind]:
                lines.append(f"  {kind:32} {self.faults[kind]:5}" +
                             (f"   (skipped {self.skipped[kind]})" if self.skipped[kind] else ""))
        lines.append("violations, by invariant:")
        for i, title in INVARIANTS.items():
            lines.append(f"  {i}. {title:75} {self.violations[i]}")
        lines.append("what the oracle saw:")
        for key, n in sorted(self.stats.items()):
            lines.append(f"  {key:60} {n}")
        if self.failed:
            lines.append("failed seeds: " + " ".join(str(seed) for seed in self.failed))
        return "\n".join(lines)


# --- diagnosis -----------------------------------------------------------------------------


def timeline(evidence: Path, run: str | None = None) -> str:
    """One time-ordered account of a kept trial: the audit log's writes (who, what, answer, the run's
    fence/holder/phase or the Lease's holder/fence) merged with the operators' log events.
    `run`: only what concerns that run (its status, Lease, pods, and its log lines)."""
    rows: list[tuple[str, str]] = []
    for line in (evidence / "audit.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        rec = AuditRecord.parse(json.loads(line))
        ref = rec.object_ref
        if ref is None or rec.verb in ("get", "list", "watch"):
            continue
        if run is not None and ref.name != run and not ref.name.startswith(f"{run}-a"):
            continue
        body, what = (rec.response_object or {}) if rec.accepted else {}, ""  # a refusal's body is a Status
        if ref.resource == "workerruns" and ref.subresource == "status" and body:
            s = body.get("status") or {}
            last = (s.get("attempts") or [{}])[-1]
            what = (f"phase={s.get('phase')} fence={s.get('fence')} holder={s.get('holder')} "
                    f"last={last.get('attempt')}:{last.get('outcome')} result={'yes' if s.get('result') else 'no'}")
        elif ref.resource == "leases" and body:
            spec = body.get("spec") or {}
            what = f"holder={spec.get('holderIdentity')} fence={spec.get('leaseTransitions')}"
        who = f"pod {rec.user.pod}" if rec.user.pod else rec.user.username.rsplit(":", 1)[-1]
        rv = (body.get("metadata") or {}).get("resourceVersion", "")
        rows.append((rec.completed.isoformat(timespec="milliseconds"),
                     f"API  {rec.verb:6} {ref.resource}{'/' + ref.subresource if ref.subresource else ''} "
                     f"{ref.name} by {who} -> {rec.code} rv={rv} {what} {rec.message[:120] if not rec.accepted else ''}"))
    for log in sorted(evidence.glob("operator-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if run is not None and not str(doc.get("run", "")).endswith(f"/{run}"):
                continue
            extra = {k: v for k, v in doc.items() if k not in ("ts", "level", "logger", "msg", "error")}
            rows.append((doc.get("ts", ""), f"{log.stem[-1]}OP {doc.get('msg', '')} {json.dumps(extra)[:300]}"))
    rows.sort(key=lambda r: r[0].replace("+00:00", ""))
    return "\n".join(f"{ts[11:23]} {text}" for ts, text in rows)
