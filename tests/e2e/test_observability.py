"""Every metric the dashboard and the alerts read is one a live operator exports, under the name a query
must use: a counter as NAME_total, a histogram as NAME_bucket/_sum/_count, a gauge as NAME. Names come
from Prometheus's own PromQL parser (hack/promql-names), the exports from the operator's /metrics after
it reconciled runs, so renaming a metric (or a label the fleet is broken down by) fails here."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit import runs
from tests.support import promql
from testkit.kube import Kube, eventually
from testkit.operator_process import OperatorProcess

# Series Prometheus makes itself for every target.
SYNTHETIC = {"up"}
# The sample names a family of each type exposes (prometheus_client's parser strips counters' _total).
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "info": ("_info",), "unknown": ("",)}


def _exported(text: str) -> dict[str, str]:
    """Every sample name a query may select, with its family's type, from the declared families (a
    labelled family with no child yet is declared but has no sample)."""
    return {f.name + suffix: f.type for f in text_string_to_metric_families(text) for suffix in SUFFIXES[f.type]}


def test_exported_names_follow_each_type() -> None:
    text = ("# HELP a_total x\n# TYPE a_total counter\na_total 1\n"
            "# HELP h x\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n# HELP g x\n# TYPE g gauge\n")
    names = _exported(text)
    assert {"a_total", "h_bucket", "h_sum", "h_count", "g"} <= set(names)
    assert not {"a", "h", "g_total"} & set(names)


@pytest.mark.local_cluster
def test_dashboard_and_alert_queries_read_only_metrics_a_live_operator_exports(kube: Kube, namespace: str,
                                                                             tmp_path: Path) -> None:
    from tether.devcluster.processes import free_port

    port = free_port()
    op = OperatorProcess(namespace, str(kube.kubeconfig_path), tmp_path / "op.log",
                         extra_args=[f"--metrics-port={port}"], extra_env={"TETHER_FOLD_INTERVAL_SECONDS": "1"}).start()
    try:
        kube.ok(kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{namespace}/workerbudgets",
                          {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget", "metadata": {"name": "team"},
                           "spec": {"limitCents": 1000, "limitTokens": 5000}}))
        runs.create(kube, namespace, runs.example("crashing-job.yaml", payload={"steps": 2, "stepSeconds": 0.1,
                                                                                "crashAttempts": [1]}))
        runs.create(kube, namespace, runs.example("short-job.yaml", payload={"steps": 1, "stepSeconds": 0.1}))
        runs.wait_phase(kube, namespace, "crashing-job", "Succeeded", timeout=90)
        runs.wait_phase(kube, namespace, "short-job", "Succeeded", timeout=90)

        def scrape() -> str:
            return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text

        def reconciled() -> str | None:
            text = scrape()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            started = families.get("tether_attempts_started")
            done = started is not None and sum(s.value for s in started.samples if s.name.endswith("_total")
                                               and s.labels.get("namespace") == namespace) == 3
            return text if done and "tether_budget_limit_cents" in families else None

        text = eventually(reconciled, timeout=30, what="three attempts counted in the run's namespace")
    finally:
        op.stop()

    exported = _exported(text)
    samples = {(s.name, tuple(sorted(s.labels.items())), s.value)
               for f in text_string_to_metric_families(text) for s in f.samples}
    # The new series, live: the fleet by namespace, the budget's limit, the API server reachable.
    assert ("tether_attempts_ended_total", (("class", ""), ("namespace", namespace), ("outcome", "PodFailed")),
            1.0) in samples
    assert ("tether_lease_regrants_total", (("class", ""), ("namespace", namespace)), 1.0) in samples
    assert ("tether_budget_limit_cents", (("budget", "team"), ("namespace", namespace)), 1000.0) in samples
    assert ("tether_budget_limit_tokens", (("budget", "team"), ("namespace", namespace)), 5000.0) in samples
    assert ("tether_apiserver_available", (), 1.0) in samples
    assert ("controller_runtime_reconcile_errors_total", (("controller", "workerrun"),), 0.0) in samples

    used = promql.metric_names({**promql.dashboard_queries(), **promql.alert_queries()})
    missing = {where: sorted(set(names) - set(exported) - SYNTHETIC) for where, names in used.items()}
    assert {k: v for k, v in missing.items() if v} == {}
    # Every family the queries rely on is there; and the checks above are not vacuous.
    assert len({n for names in used.values() for n in names}) >= 30
