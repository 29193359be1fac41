"""Tether's alerts and dashboard as files: promtool checks and unit-tests every rule (each fires on series
that should fire it and stays silent on others), the copies in deploy/ are the chart's, every alert has
a runbook, and every query parses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tests.support import promql


def test_promtool_checks_the_rules() -> None:
    result = promql.promtool("check", "rules", str(promql.RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(promql.alerts())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = promql.promtool("test", "rules", str(promql.RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_silent() -> None:
    tests = yaml.safe_load(promql.RULE_TESTS.read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    for alert in promql.alerts():
        name = alert["alert"]
        assert any(c["alertname"] == name and c.get("exp_alerts") for c in cases), f"{name} never fires"
        assert any(c["alertname"] == name and not c.get("exp_alerts") for c in cases), f"{name} never silent"


def _mutated_run(tmp_path: Path, name: str, expr: str) -> bool:
    """Whether the unit tests still pass with alert `name`'s expression replaced by `expr`."""
    rules = yaml.safe_load(promql.RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == name:
                rule["expr"] = expr
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    tests = yaml.safe_load(promql.RULE_TESTS.read_text())
    tests["rule_files"] = ["rules.yaml"]
    # Only the tests that judge this alert: the others cannot catch its mutant, and running every
    # test for each of the alerts' two mutants made this the slowest unit test (60 s in make test).
    tests["tests"] = [t for t in tests["tests"] if any(c["alertname"] == name for c in t.get("alert_rule_test", []))]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    return promql.promtool("test", "rules", "tests.yaml", cwd=tmp_path).returncode == 0


def test_the_unit_tests_catch_an_alert_that_always_or_never_fires(tmp_path: Path) -> None:
    for alert in promql.alerts():
        assert not _mutated_run(tmp_path, alert["alert"], "vector(1)"), f"{alert['alert']} firing always passes"
        assert not _mutated_run(tmp_path, alert["alert"], "vector(1) > 2"), f"{alert['alert']} never firing passes"


def test_the_deploy_copies_are_the_charts() -> None:
    assert promql.RULES_DEPLOY.read_bytes() == promql.RULES.read_bytes()
    assert promql.DASHBOARD_DEPLOY.read_bytes() == promql.DASHBOARD.read_bytes()


def test_every_alert_has_a_runbook_and_a_severity() -> None:
    docs = (promql.ROOT / "docs" / "operations.md").read_text()
    for alert in promql.alerts():
        name = alert["alert"]
        assert re.search(rf"^#### {name}$", docs, re.M), f"no runbook heading for {name} in docs/operations.md"
        assert alert["annotations"]["runbook_url"].endswith(f"docs/operations.md#{name.lower()}")
        assert alert["labels"]["severity"] in ("critical", "warning")
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]


def test_every_query_parses_and_names_its_metrics() -> None:
    queries = {**promql.dashboard_queries(), **promql.alert_queries()}
    names = promql.metric_names(queries)
    assert all(names.values()), [k for k, v in names.items() if not v]
    assert "tether_workerruns" in names["variable namespace"]


def test_the_dashboard_is_well_formed_and_breaks_the_fleet_down_by_namespace() -> None:
    board = promql.dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert set(variables) == {"datasource", "job", "namespace"}
    assert variables["namespace"]["includeAll"] and variables["namespace"]["allValue"] == ".*"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    targets = [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    assert targets and all('job=~"$job"' in expr for _, expr in targets)  # never another exporter's series
    names = promql.metric_names(promql.dashboard_queries())
    by_namespace = {"tether_workerruns", "tether_attempts_started_total", "tether_attempts_ended_total",
                    "tether_lease_lapses_total", "tether_heartbeat_age_seconds", "tether_budget_spent_cents",
                    "tether_approvals_pending", "tether_lease_lapse_detection_seconds_bucket"}
    for (title, expr), used in zip(targets, (v for k, v in names.items() if k.startswith("panel"))):
        if by_namespace & set(used):
            assert 'namespace=~"$namespace"' in expr, (title, expr)
    json.dumps(board)  # serialisable as it is loaded
