"""The operator's registry: what a Prometheus user expects from any exporter (process and Python
collectors, a build_info) and runs counted per namespace."""

from __future__ import annotations

import types
from importlib.metadata import version

from prometheus_client import generate_latest

from tether import metrics
from tether.controller.controller import RunController


def _scrape() -> str:
    return generate_latest(metrics.REGISTRY).decode()


def test_the_registry_has_the_standard_process_and_python_collectors() -> None:
    text = _scrape()
    for family in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
                   "python_info", "python_gc_collections_total"):
        assert f"\n{family}" in text or text.startswith(family), family


def test_build_info_says_which_tether_runs() -> None:
    assert f'tether_build_info{{version="{version("tether-operator")}"}} 1.0' in _scrape()


def test_runs_are_counted_by_namespace_and_phase() -> None:
    ctl = RunController(types.SimpleNamespace())  # type: ignore[arg-type]  # no I/O here
    ctl.cache.runs.update({
        ("a", "r1"): {"metadata": {"name": "r1", "namespace": "a", "uid": "1"}, "status": {"phase": "Running"}},
        ("a", "r2"): {"metadata": {"name": "r2", "namespace": "a", "uid": "2"}, "status": {"phase": "Running"}},
        ("b", "r1"): {"metadata": {"name": "r1", "namespace": "b", "uid": "3"}, "status": {}},
    })
    before = metrics.STATE.controller
    metrics.STATE.controller = ctl
    try:
        text = _scrape()
    finally:
        metrics.STATE.controller = before
    assert 'tether_workerruns{namespace="a",phase="Running"} 2.0' in text
    assert 'tether_workerruns{namespace="b",phase="Pending"} 1.0' in text
