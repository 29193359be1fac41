"""The chart's alerts (PrometheusRule) and Grafana dashboard (ConfigMap): off by default, rendered from the
same files as deploy/ when on, and their values typed by values.schema.json."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.cluster.test_chart import CHART, helm, render
from tests.support import promql

# The alerts need the operator scraped: the chart refuses them without the ServiceMonitor (or scrapedElsewhere).
BOTH_ON = ("metrics.prometheusRule.enabled=true", "metrics.serviceMonitor.enabled=true",
           "metrics.grafanaDashboard.enabled=true")


def _kinds(docs: list[dict]) -> list[str]:
    return [d["kind"] for d in docs]


def test_alerts_and_dashboard_are_off_by_default(tools_dir: Path) -> None:
    kinds = _kinds(render(tools_dir))
    assert "PrometheusRule" not in kinds and "ConfigMap" not in kinds
    # Without metrics there is nothing to alert on or draw.
    assert not {"PrometheusRule", "ConfigMap"} & set(_kinds(render(tools_dir, "metrics.enabled=false", *BOTH_ON)))


def test_the_prometheus_rule_is_the_rules_file(tools_dir: Path) -> None:
    docs = render(tools_dir, *BOTH_ON, "metrics.prometheusRule.labels.release=kube-prometheus-stack")
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "tether-system"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load(promql.RULES.read_text())
    # Prometheus' own templates in the annotations reach the PrometheusRule untouched by Helm's.
    assert "{{ $labels.namespace }}" in json.dumps(rule["spec"])


def test_the_dashboard_config_map_is_the_dashboard_for_grafanas_sidecar(tools_dir: Path) -> None:
    cm = next(d for d in render(tools_dir, *BOTH_ON) if d["kind"] == "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "tether-system"
    assert json.loads(cm["data"]["tether.json"]) == promql.dashboard()
    moved = next(d for d in render(tools_dir, *BOTH_ON, "metrics.grafanaDashboard.namespace=monitoring",
                                   "metrics.grafanaDashboard.annotations.grafana_folder=Tether")
                 if d["kind"] == "ConfigMap")
    assert moved["metadata"]["namespace"] == "monitoring"
    assert moved["metadata"]["annotations"] == {"grafana_folder": "Tether"}


def test_the_service_monitor_keeps_the_runs_namespace_label(tools_dir: Path) -> None:
    monitor = next(d for d in render(tools_dir, "metrics.serviceMonitor.enabled=true") if d["kind"] == "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True


def test_lint_strict_with_everything_on(tools_dir: Path) -> None:
    result = helm(tools_dir, "lint", "--strict", str(CHART), "--set", ",".join(
        (*BOTH_ON, "metrics.serviceMonitor.enabled=true")))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schema_refuses_wrong_types(tools_dir: Path) -> None:
    for value, complaint in (("metrics.prometheusRule.enabled=yes", "want boolean"),
                             ("metrics.grafanaDashboard.enabled=1", "want boolean"),
                             ("metrics.grafanaDashboard.labels=x", "want object"),
                             ("metrics.grafanaDashboard.namespace=Not_A_Namespace", "does not match pattern"),
                             ("metrics.prometheusRule.interval=1m", "additional properties")):
        result = helm(tools_dir, "template", "rel", str(CHART), "--kube-version", "1.36.3", "--set", value)
        assert result.returncode != 0, value
        assert complaint in result.stderr, (value, result.stderr)
