"""Prometheus metrics of the operator (kopf has none built in).

Names follow controller-runtime where one exists (controller_runtime_reconcile_*),
and use the `tether_` prefix otherwise. Gauges about runs are computed at
scrape time from the controller's in-memory state, so they cost nothing
between scrapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tether.controller.runs import RunController

REGISTRY = CollectorRegistry()

RECONCILE_TOTAL = Counter("controller_runtime_reconcile_total", "Reconciliations per controller and result.",
                          ["controller", "result"], registry=REGISTRY)
RECONCILE_ERRORS = Counter("controller_runtime_reconcile_errors_total", "Reconciliations that failed.",
                           ["controller"], registry=REGISTRY)
RECONCILE_TIME = Histogram("controller_runtime_reconcile_time_seconds", "Time per reconciliation.",
                           ["controller"], registry=REGISTRY,
                           buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
ATTEMPTS_STARTED = Counter("tether_attempts_started_total", "Attempts granted.", registry=REGISTRY)
ATTEMPTS_ENDED = Counter("tether_attempts_ended_total", "Attempts ended, by outcome.", ["outcome"],
                         registry=REGISTRY)
LEASE_LAPSES = Counter("tether_lease_lapses_total", "Leases declared lapsed (attempts lost).", registry=REGISTRY)
REGRANTS = Counter("tether_lease_regrants_total", "Grants that follow an ended attempt of the same run.",
                   registry=REGISTRY)
LAPSE_DETECTION = Histogram("tether_lease_lapse_detection_seconds",
                            "Time from the last observed renewal to the attempt being marked lost.",
                            registry=REGISTRY, buckets=(5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600))
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
USAGE_REJECTED = Counter("tether_usage_reports_rejected_total", "Malformed usage reports refused.",
                         registry=REGISTRY)
BUDGET_CHARGED_CENTS = Counter("tether_budget_charged_cents_total", "Cents charged to WorkerBudgets.",
                               ["namespace", "budget"], registry=REGISTRY)
BUDGET_CHARGED_TOKENS = Counter("tether_budget_charged_tokens_total", "Tokens charged to WorkerBudgets.",
                                ["namespace", "budget"], registry=REGISTRY)


class _StateCollector(Collector):
    """Runs by phase, heartbeat ages, budget spend and leadership, read at scrape time."""

    def __init__(self) -> None:
        self.controller: RunController | None = None
        self.is_leader: bool = True

    def collect(self) -> Iterator[GaugeMetricFamily]:
        leader = GaugeMetricFamily("tether_leader", "1 while this replica is the active leader.")
        leader.add_metric([], 1.0 if self.is_leader else 0.0)
        yield leader
        ctl = self.controller
        if ctl is None:
            return
        phases = GaugeMetricFamily("tether_workerruns", "WorkerRuns by phase.", labels=["phase"])
        ages = GaugeMetricFamily("tether_heartbeat_age_seconds",
                                 "Seconds since the operator last observed a renewal of the run's lease.",
                                 labels=["namespace", "workerrun"])
        for phase, n in sorted(ctl.phase_counts().items()):
            phases.add_metric([phase], float(n))
        for ns, name, age in ctl.heartbeat_ages():
            ages.add_metric([ns, name], age)
        yield phases
        yield ages
        spent = GaugeMetricFamily("tether_budget_spent_cents", "Cents spent in the budget's current period.",
                                  labels=["namespace", "budget"])
        for (ns, name), body in ctl.budgets.cache.copy().items():  # a snapshot in one step
            spent.add_metric([ns, name], float(((body.get("status") or {}).get("spent") or {}).get("cents", 0)))
        yield spent


STATE = _StateCollector()
REGISTRY.register(STATE)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serves /metrics on its own thread: scrapes never touch the event loop."""
    start_http_server(port, addr=addr, registry=REGISTRY)
