"""Prometheus metrics of the operator (kopf has none built in).

Names follow controller-runtime where one exists (controller_runtime_reconcile_*),
and use the `tether_` prefix otherwise. Gauges about runs are computed at
scrape time from the controller's in-memory state, so they cost nothing
between scrapes.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Iterable, Iterator, Protocol

from prometheus_client import (GCCollector, CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector,
                               ProcessCollector, start_http_server)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry()
# What every Prometheus exporter has: process_* (RSS is the first limit the benchmarks reach),
# python_info and python_gc_*.
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)


def _version() -> str:
    try:
        return version("tether-operator")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


BUILD_INFO = Gauge("tether_build_info", "Always 1; the labels say which Tether this is.", ["version"], registry=REGISTRY)
BUILD_INFO.labels(version=_version()).set(1)

RECONCILE_TOTAL = Counter("controller_runtime_reconcile_total", "Reconciliations per controller and result.",
                          ["controller", "result"], registry=REGISTRY)
RECONCILE_ERRORS = Counter("controller_runtime_reconcile_errors_total", "Reconciliations that failed.",
                           ["controller"], registry=REGISTRY)
RECONCILE_TIME = Histogram("controller_runtime_reconcile_time_seconds", "Time per reconciliation.",
                           ["controller"], registry=REGISTRY,
                           buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
# `class`: the run's WorkerClass ("" for none); tether_workerclass_info{class} says what each class is.
ATTEMPTS_STARTED = Counter("tether_attempts_started_total", "Attempts granted, by the run's namespace and class.",
                           ["namespace", "class"], registry=REGISTRY)
ATTEMPTS_ENDED = Counter("tether_attempts_ended_total", "Attempts ended, by the run's namespace, class and outcome.",
                         ["namespace", "class", "outcome"], registry=REGISTRY)
LEASE_LAPSES = Counter("tether_lease_lapses_total", "Leases declared lapsed (attempts lost), by the run's namespace "
                       "and class.", ["namespace", "class"], registry=REGISTRY)
REGRANTS = Counter("tether_lease_regrants_total", "Grants that follow an ended attempt of the same run, by the run's "
                   "namespace and class.", ["namespace", "class"], registry=REGISTRY)
LAPSE_DETECTION = Histogram("tether_lease_lapse_detection_seconds",
                            "Time from the last observed renewal to the attempt being marked lost, by the run's "
                            "namespace and class.", ["namespace", "class"], registry=REGISTRY,
                            buckets=(5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600))
GC_PAUSE = Histogram("tether_gc_full_collection_seconds", "Pauses of the operator's full (generation 2) "
                     "garbage collections: the event loop stands still meanwhile.", registry=REGISTRY,
                     buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
REST_REQUESTS = Counter("rest_client_requests_total", "Requests the operator sent the API server (watches "
                        "aside), by method and status code (client-go's name).", ["method", "code"],
                        registry=REGISTRY)
BUDGET_CONFLICTS = Counter("tether_budget_charge_conflicts_total",
                           "Budget status writes (charges, releases) that lost a compare-and-swap and were retried.",
                           registry=REGISTRY)
EVENTS_DROPPED = Counter("tether_events_dropped_total",
                         "Events not posted because the Event budget (--event-qps) was spent.", registry=REGISTRY)
WATCH_LAG = Histogram("tether_lease_watch_lag_seconds",
                      "Time from a Lease renewal (its renewTime) to the operator receiving its watch event.",
                      registry=REGISTRY, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
APPROVAL_DECISION = Histogram("tether_approval_decision_seconds",
                              "Time from a gate starting to wait (the run's creation, for Start) to its decision, "
                              "by the run's namespace, gate (Start, Result, Request) and decision (Approve, Deny, "
                              "TimedOut).", ["namespace", "gate", "decision"],
                              registry=REGISTRY, buckets=(10, 30, 60, 300, 900, 1800, 3600, 14400, 86400))
REQUESTS_REJECTED = Counter("tether_approval_requests_rejected_total",
                            "Malformed approval requests (tether.dev/requests on a run's Lease) refused.",
                            registry=REGISTRY)
USAGE_REJECTED = Counter("tether_usage_reports_rejected_total", "Malformed usage reports refused.",
                         registry=REGISTRY)
BUDGET_CHARGED_CENTS = Counter("tether_budget_charged_cents_total", "Cents charged to WorkerBudgets.",
                               ["namespace", "budget"], registry=REGISTRY)
BUDGET_CHARGED_TOKENS = Counter("tether_budget_charged_tokens_total", "Tokens charged to WorkerBudgets.",
                                ["namespace", "budget"], registry=REGISTRY)


# client-go's workqueue metrics (controller-runtime exports them under these names).
WORKQUEUE_ADDS = Counter("workqueue_adds_total", "Adds handled by the work queue.", ["name"], registry=REGISTRY)
WORKQUEUE_RETRIES = Counter("workqueue_retries_total", "Retries (rate-limited adds) handled by the work queue.",
                            ["name"], registry=REGISTRY)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
WORKQUEUE_QUEUE_DURATION = Histogram("workqueue_queue_duration_seconds",
                                     "How long a key waits in the work queue before it is processed.", ["name"],
                                     registry=REGISTRY, buckets=_QUEUE_BUCKETS)
WORKQUEUE_WORK_DURATION = Histogram("workqueue_work_duration_seconds", "How long processing a key takes.",
                                    ["name"], registry=REGISTRY, buckets=_QUEUE_BUCKETS)


# tether_leader: 1 while this replica is the active leader (the operator sets it as leadership changes).
LEADER = Gauge("tether_leader", "1 while this replica is the active leader.", registry=REGISTRY)

# client-go's workqueue gauges, computed at scrape time from each queue (workqueue.py binds them).
WORKQUEUE_DEPTH = Gauge("workqueue_depth", "Keys waiting in the work queue.", ["name"], registry=REGISTRY)
WORKQUEUE_UNFINISHED = Gauge("workqueue_unfinished_work_seconds", "Seconds of work in progress not yet done, "
                             "summed over the keys being processed.", ["name"], registry=REGISTRY)
WORKQUEUE_LONGEST = Gauge("workqueue_longest_running_processor_seconds", "Seconds the longest-running key has "
                          "been in process.", ["name"], registry=REGISTRY)


class Fleet(Protocol):
    """What the fleet gauges read from a running controller, at scrape time."""

    def phase_counts(self) -> dict[tuple[str, str, str], int]:
        """Runs by (namespace, phase, class)."""
        ...

    def class_labels(self) -> dict[str, dict[str, str]]:
        """Each known WorkerClass's spec.labels, by class name."""
        ...

    def pending_approvals(self) -> dict[tuple[str, str], tuple[int, float | None]]: ...

    def heartbeat_ages(self) -> list[tuple[str, str, float]]: ...

    def api_available(self) -> bool: ...

    def budget_bodies(self) -> dict[tuple[str, str], dict[str, Any]]:
        """A snapshot of the cached WorkerBudgets, taken in one step."""
        ...


Samples = Iterable[tuple[list[str], float]]


class _Computed(Collector):
    """One gauge family computed from the fleet at scrape time. It is described, so a scrape that
    asks for other names (`/metrics?name[]=...`) does not compute it: the per-run family is 5,000
    series at 5,000 runs."""

    def __init__(self, name: str, doc: str, labels: list[str], samples: Callable[[], Samples],
                 live: Callable[[], bool]) -> None:
        self.name, self.doc, self.labels, self.samples, self.live = name, doc, labels, samples, live

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.name, self.doc, labels=self.labels)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.doc, labels=self.labels)
        samples = list(self.samples())
        if not self.live():
            return  # the controller stopped while this scrape read it: nothing read since is exported
        for labels, value in samples:
            family.add_metric(labels, value)
        yield family


def _runs_by_phase(fleet: Fleet) -> Samples:
    counts = sorted(fleet.phase_counts().items())
    # A namespace's (and class's) counters are exported at 0 from the first scrape that sees runs there:
    # increase() and rate() need a sample before the first lapse (after a restart too, when no lapse is
    # judged for a full lease duration), or a wave of first lapses in many namespaces would count as none.
    for ns, cls in {(ns, cls) for (ns, _, cls), _ in counts}:
        for family in (ATTEMPTS_STARTED, REGRANTS, LEASE_LAPSES, LAPSE_DETECTION):
            family.labels(ns, cls)
    return [([ns, phase, cls], float(n)) for (ns, phase, cls), n in counts]


class _ClassInfo(Collector):
    """tether_workerclass_info{class, <the class's spec.labels>} 1: each class's own label names, as
    kube-state-metrics' *_labels families have (joined in queries with `* on (class) group_left`)."""

    NAME = "tether_workerclass_info"

    def __init__(self, fleet: Fleet, live: Callable[[], bool]) -> None:
        self.fleet, self.live = fleet, live

    def describe(self) -> Iterator[Metric]:
        yield Metric(self.NAME, "Always 1 for each WorkerClass; its labels say what the class is (tool, model, "
                                "provider...).", "gauge")

    def collect(self) -> Iterator[Metric]:
        family = next(self.describe())
        classes = self.fleet.class_labels()
        if not self.live():
            return
        for name, labels in sorted(classes.items()):
            family.add_sample(self.NAME, {**labels, "class": name}, 1.0)
        yield family


def _budget_limits(fleet: Fleet, field: str) -> Samples:
    out = []
    for (ns, name), body in fleet.budget_bodies().items():
        limit = (body.get("spec") or {}).get(field)
        if isinstance(limit, (int, float)) and not isinstance(limit, bool):
            out.append(([ns, name], float(limit)))
    return out


def _budget_spent(fleet: Fleet, field: str) -> Samples:
    return [([ns, name], float(((body.get("status") or {}).get("spent") or {}).get(field, 0)))
            for (ns, name), body in fleet.budget_bodies().items()]


def export(fleet: Fleet) -> Callable[[], None]:
    """Exports the fleet gauges of `fleet` (the controller, while it runs); returns what stops
    exporting them. A standby replica exports none: only the active one holds the fleet."""
    live = [True]

    def gauge(name: str, doc: str, labels: list[str], samples: Callable[[], Samples]) -> _Computed:
        return _Computed(name, doc, labels, samples, lambda: live[0])

    collectors: list[Collector] = [
        gauge("tether_workerruns", "WorkerRuns by namespace, phase and WorkerClass.", ["namespace", "phase", "class"],
                  lambda: _runs_by_phase(fleet)),
        gauge("tether_approvals_pending", "Gates waiting for a person's decision, by the run's namespace and "
                  "gate (Start, Result, Request: a worker's).", ["namespace", "gate"],
                  lambda: [([ns, gate], float(n)) for (ns, gate), (n, _) in sorted(fleet.pending_approvals().items())]),
        gauge("tether_approval_oldest_pending_timestamp_seconds", "When the longest-waiting gate of the "
                  "namespace started waiting (its request's requestedAt, Unix seconds); only for gates with one "
                  "waiting.", ["namespace", "gate"],
                  lambda: [([ns, gate], oldest) for (ns, gate), (n, oldest) in sorted(fleet.pending_approvals().items())
                           if n and oldest is not None]),
        gauge("tether_heartbeat_age_seconds", "Seconds since the operator last observed a renewal of the run's "
                  "lease.", ["namespace", "workerrun"],
                  lambda: [([ns, name], age) for ns, name, age in fleet.heartbeat_ages()]),
        gauge("tether_budget_spent_cents", "Cents spent in the budget's current period.", ["namespace", "budget"],
                  lambda: _budget_spent(fleet, "cents")),
        gauge("tether_budget_spent_tokens", "Tokens spent in the budget's current period.",
                  ["namespace", "budget"], lambda: _budget_spent(fleet, "tokens")),
        gauge("tether_budget_limit_cents", "The budget's limitCents; only for budgets that set one.",
                  ["namespace", "budget"], lambda: _budget_limits(fleet, "limitCents")),
        gauge("tether_budget_limit_tokens", "The budget's limitTokens; only for budgets that set one.",
                  ["namespace", "budget"], lambda: _budget_limits(fleet, "limitTokens")),
        gauge("tether_apiserver_available", "1 while the API server answers the active replica's readiness "
                  "probe in time (every second), 0 from the first failed or slow answer until it answers again.",
                  [], lambda: [([], 1.0 if fleet.api_available() else 0.0)]),
    ]
    collectors.append(_ClassInfo(fleet, lambda: live[0]))
    for collector in collectors:
        REGISTRY.register(collector)

    def stop() -> None:
        live[0] = False  # first: a scrape already under way yields nothing more of this fleet
        for collector in collectors:
            REGISTRY.unregister(collector)

    return stop


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serves /metrics on its own thread: scrapes never touch the event loop."""
    start_http_server(port, addr=addr, registry=REGISTRY)
