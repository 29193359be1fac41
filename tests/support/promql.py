"""promtool and promql-names (hack/build-promtool.sh, cached), and the PromQL of Tether's dashboard and alerts."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tether"
RULES = CHART / "files" / "tether-alerts.rules.yaml"
RULES_DEPLOY = ROOT / "deploy" / "prometheus" / "tether-alerts.rules.yaml"
RULE_TESTS = ROOT / "tests" / "alerts" / "tether-alerts.test.yaml"
DASHBOARD = CHART / "dashboards" / "tether.json"
DASHBOARD_DEPLOY = ROOT / "deploy" / "grafana" / "tether.json"
# Grafana's variables, as a query reads them: the interval ones become a duration, the others a label value.
_INTERVALS = ("$__rate_interval", "$__interval", "$__range")
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*[A-Za-z_][A-Za-z0-9_]*\)$", re.S)


@functools.cache
def tools() -> Path:
    """The directory with promtool and promql-names, built from Go modules on first use."""
    out = subprocess.run(["bash", str(ROOT / "hack" / "build-promtool.sh")], check=True, stdout=subprocess.PIPE,
                         text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tools() / "promtool"), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def alerts() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _as_promql(query: str) -> str:
    """A Grafana query as plain PromQL: label_values(SELECTOR, label) is its selector; variables are filled in."""
    match = _LABEL_VALUES.match(query.strip())
    if match:
        query = match["selector"]
    for name in _INTERVALS:
        query = query.replace(name, "5m")
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "x", query)


def dashboard_queries() -> dict[str, str]:
    """Every PromQL query of the dashboard (panel targets and template variables), by where it is."""
    out: dict[str, str] = {}
    board = dashboard()
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out[f"variable {var['name']}"] = _as_promql(query)
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out[f"panel {panel['title']!r} {target['refId']}"] = _as_promql(target["expr"])
    return out


def alert_queries() -> dict[str, str]:
    return {f"alert {r['alert']}": r["expr"] for r in alerts()}


def metric_names(queries: dict[str, str]) -> dict[str, list[str]]:
    """The metric names each query reads, from Prometheus's own parser (hack/promql-names); a query that
    does not parse, or selects without a metric name, fails here."""
    keys = list(queries)
    out = subprocess.run([str(tools() / "promql-names")], input=json.dumps([queries[k] for k in keys]),
                         capture_output=True, text=True, check=True, timeout=60)
    results = json.loads(out.stdout)
    errors = {k: r["error"] for k, r in zip(keys, results) if r.get("error")}
    assert errors == {}, errors
    return {k: r["names"] for k, r in zip(keys, results)}
