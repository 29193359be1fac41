"""The operator's registry: what a Prometheus user expects from any exporter (process and Python
collectors, a build_info) and runs counted per namespace."""

from __future__ import annotations

import datetime as dt
import types
from typing import Any

import pytest
from importlib.metadata import version

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tether import metrics
from tether.controller.controller import RunController
from tether.kube.health import ApiHealth


def _scrape() -> str:
    return generate_latest(metrics.REGISTRY).decode()


def test_the_registry_has_the_standard_process_and_python_collectors() -> None:
    text = _scrape()
    for family in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
                   "python_info", "python_gc_collections_total"):
        assert f"\n{family}" in text or text.startswith(family), family


def test_build_info_says_which_tether_runs() -> None:
    assert f'tether_build_info{{version="{version("tether-operator")}"}} 1.0' in _scrape()


def test_runs_are_counted_by_namespace_phase_and_class() -> None:
    ctl = RunController(types.SimpleNamespace(health=ApiHealth()))  # type: ignore[arg-type]  # no I/O here
    _hold(ctl, {
        ("a", "r1"): {"metadata": {"name": "r1", "namespace": "a", "uid": "1"}, "status": {"phase": "Running"}},
        ("a", "r2"): {"metadata": {"name": "r2", "namespace": "a", "uid": "2"}, "status": {"phase": "Running"}},
        ("b", "r1"): {"metadata": {"name": "r1", "namespace": "b", "uid": "3"}, "status": {}},
        # The class it took; one it only names (maybe made up) makes no series.
        ("b", "r2"): {"metadata": {"name": "r2", "namespace": "b", "uid": "4"},
                      "status": {"phase": "Running", "class": {"name": "tool-call", "defaults": {}}}},
        ("b", "r3"): {"metadata": {"name": "r3", "namespace": "b", "uid": "5"}, "spec": {"className": "made-up"}},
    })
    text = _scrape_with(ctl)
    assert 'tether_workerruns{class="",namespace="a",phase="Running"} 2.0' in text
    assert 'tether_workerruns{class="",namespace="b",phase="Pending"} 2.0' in text
    assert 'tether_workerruns{class="tool-call",namespace="b",phase="Running"} 1.0' in text
    assert 'class="made-up"' not in text
    # Its namespaces' (and classes') counters are there at 0 by the next scrape: increase() counts their
    # first lapse.
    again = _scrape_with(ctl)
    for ns, cls in (("a", ""), ("b", ""), ("b", "tool-call")):
        assert f'tether_lease_lapses_total{{class="{cls}",namespace="{ns}"}} 0.0' in again
        assert f'tether_attempts_started_total{{class="{cls}",namespace="{ns}"}} 0.0' in again
        assert f'tether_lease_lapse_detection_seconds_count{{class="{cls}",namespace="{ns}"}} 0.0' in again


def test_each_class_is_described_by_its_own_labels() -> None:
    ctl = RunController(types.SimpleNamespace(health=ApiHealth()))  # type: ignore[arg-type]
    for name, labels in (("tool-call", {"tool": "search", "provider": "acme"}), ("agent-session", {})):
        ctl.cache.classes.on_event("ADDED", {"metadata": {"name": name}, "spec": {"labels": labels}})
    text = _scrape_with(ctl)
    assert 'tether_workerclass_info{class="tool-call",provider="acme",tool="search"} 1.0' in text
    assert 'tether_workerclass_info{class="agent-session"} 1.0' in text
    parsed = {f.name for f in text_string_to_metric_families(text)}
    assert "tether_workerclass_info" in parsed
    ctl.cache.classes.on_event("DELETED", {"metadata": {"name": "tool-call"}})
    assert 'tether_workerclass_info{class="tool-call"' not in _scrape_with(ctl)


def _scrape_with(ctl: RunController) -> str:
    stop = metrics.export(ctl)
    try:
        return _scrape()
    finally:
        stop()


def test_budgets_export_spent_and_limit_of_what_they_limit() -> None:
    ctl = RunController(types.SimpleNamespace(health=ApiHealth()))  # type: ignore[arg-type]
    _hold_budgets(ctl, {
        ("a", "capped"): {"spec": {"limitCents": 500, "limitTokens": 10000},
                          "status": {"spent": {"cents": 450, "tokens": 20}}},
        ("b", "tokens-only"): {"spec": {"limitTokens": 7}, "status": {}},
    })
    text = _scrape_with(ctl)
    assert 'tether_budget_spent_cents{budget="capped",namespace="a"} 450.0' in text
    assert 'tether_budget_limit_cents{budget="capped",namespace="a"} 500.0' in text
    assert 'tether_budget_spent_tokens{budget="capped",namespace="a"} 20.0' in text
    assert 'tether_budget_limit_tokens{budget="tokens-only",namespace="b"} 7.0' in text
    assert 'tether_budget_spent_tokens{budget="tokens-only",namespace="b"} 0.0' in text
    assert 'tether_budget_limit_cents{budget="tokens-only"' not in text  # no cents limit: no series


def test_pending_approvals_by_namespace_and_gate_with_the_oldest_wait() -> None:
    def run(ns: str, name: str, *requests: dict) -> dict:
        return {"metadata": {"name": name, "namespace": ns, "uid": name},
                "status": {"review": {"requests": list(requests)}}}
    ctl = RunController(types.SimpleNamespace(health=ApiHealth()))  # type: ignore[arg-type]
    _hold(ctl, {
        ("a", "r1"): run("a", "r1", {"gate": "Start", "requestedAt": "2030-01-01T00:00:10Z"}),
        ("a", "r2"): run("a", "r2", {"gate": "Start", "requestedAt": "2030-01-01T00:00:00Z"},
                         {"gate": "deploy", "attempt": 1, "requestedAt": "2030-01-01T00:01:00Z"}),
        ("b", "r3"): run("b", "r3", {"gate": "Result", "attempt": 1, "requestedAt": "2030-01-01T00:00:00Z",
                                     "decision": "Approve"}),
    })
    text = _scrape_with(ctl)
    assert 'tether_approvals_pending{gate="Start",namespace="a"} 2.0' in text
    assert 'tether_approvals_pending{gate="Request",namespace="a"} 1.0' in text
    assert not [line for line in text.splitlines() if line.startswith("tether_approval") and 'namespace="b"' in line]
    oldest = {s.labels["gate"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "tether_approval_oldest_pending_timestamp_seconds"}
    start = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc).timestamp()
    assert oldest == {"Start": start, "Request": start + 60}


def test_api_server_availability_follows_the_probe() -> None:
    health = ApiHealth()
    ctl = RunController(types.SimpleNamespace(health=health))  # type: ignore[arg-type]
    assert "tether_apiserver_available 1.0" in _scrape_with(ctl)
    health.failure("probe: ConnectError")
    assert "tether_apiserver_available 0.0" in _scrape_with(ctl)
    health.answered(0.01)
    assert "tether_apiserver_available 1.0" in _scrape_with(ctl)
    # A standby (no controller yet) exports no sample: only the active replica probes.
    assert not [line for line in _scrape().splitlines() if line.startswith("tether_apiserver_available")]


def _leader_gauge() -> float:
    from tether import metrics as now  # the module the operator imports (a test may have reloaded it)

    text = generate_latest(now.REGISTRY).decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "tether_leader"]
    return family.samples[0].value


def _run_operator(monkeypatch: pytest.MonkeyPatch, leader_elect: bool) -> dict[str, float]:
    """The operator's start and stop (cli._run_operator) with the election, kopf and the API server faked:
    what tether_leader said while metrics started, while waiting for the Lease, while leading, after."""
    import argparse
    import asyncio
    import signal

    import kopf

    from tether import cli, gcpause
    from tether import metrics  # the module the operator imports (a test may have reloaded it)
    from tether.controller import leader
    from tether.kube import client as kube_client
    from tether.kube import config as kubeconfig

    seen: dict[str, float] = {}

    class Elector:
        def __init__(self, *_: object, **__: object) -> None:
            self.is_leader = False

        async def acquire(self) -> None:
            seen["standby"] = _leader_gauge()
            self.is_leader = True

        async def hold(self) -> None:
            await asyncio.Event().wait()

        async def release(self) -> None:
            self.is_leader = False

    async def operator(**kw: object) -> None:
        seen["leading"] = _leader_gauge()
        # As handlers' startup: the controller's fleet gauges, until the operator stops.
        kw["memo"].unexport = metrics.export(RunController(types.SimpleNamespace(health=ApiHealth())))  # type: ignore[attr-defined, arg-type]

    monkeypatch.setattr(kopf, "operator", operator)
    monkeypatch.setattr(leader, "LeaderElector", Elector)
    monkeypatch.setattr(kube_client, "KubeClient", lambda *a, **kw: object())
    monkeypatch.setattr(kubeconfig, "load", lambda: types.SimpleNamespace(namespace="tether-system"))
    monkeypatch.setattr(gcpause, "install", lambda: None)
    monkeypatch.setattr(metrics, "serve", lambda port: seen.setdefault("serving", _leader_gauge()))
    args = argparse.Namespace(metrics_port=8080, gateway_port=0, leader_elect=leader_elect,
                              leader_election_namespace="ns", leader_election_id="tether-operator-leader",
                              leader_lease_seconds=15.0, kube_qps=1.0, kube_burst=1, max_concurrent_reconciles=1,
                              event_qps=1.0, worker_identity="namespace", attempt_history=100, namespace=[], liveness=None)
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        assert asyncio.run(cli._run_operator(args)) == 0
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
    seen["stopped"] = _leader_gauge()
    assert "tether_workerruns" not in _scrape(), "a stopped operator's controller still feeds the fleet gauges"
    return seen


def test_tether_leader_is_1_only_while_leading(monkeypatch: pytest.MonkeyPatch) -> None:
    """It said 1 from a standby: the gauge started at 1 and metrics were served before the
    election set it False; and a replica that released the Lease still said 1."""
    assert _run_operator(monkeypatch, leader_elect=True) == {"serving": 0.0, "standby": 0.0, "leading": 1.0,
                                                             "stopped": 0.0}
    # Without an election the one replica leads from the start.
    assert _run_operator(monkeypatch, leader_elect=False) == {"serving": 1.0, "leading": 1.0, "stopped": 0.0}


def _hold(ctl: RunController, runs: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Runs held in the controller's store, as if the watch had brought them."""
    for key, body in runs.items():
        ctl.cache.runs.store(key, body)


def _hold_budgets(ctl: RunController, budgets: dict[tuple[str, str], dict[str, Any]]) -> None:
    for key, body in budgets.items():
        ctl.budgets.cache.store(key, body)
