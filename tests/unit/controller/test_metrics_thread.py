"""/metrics is served from its own thread and reads the controller's dicts while the event loop
changes them. A garbage collection during the read runs Python code (gc callbacks), so the loop's
thread can run in the middle of it: seen as a scrape failing with "dictionary changed size during
iteration" (a 500) at 5,000 runs. The reads must take their snapshot in one step."""

from __future__ import annotations

import types

import gc
from typing import Any

import pytest

from tether.controller.controller import RunController


def _run(i: int) -> dict[str, Any]:
    return {"metadata": {"name": f"r{i}", "namespace": "ns", "uid": f"u{i}"},
            "status": {"phase": "Running", "holder": f"r{i}-a1"}}


@pytest.fixture
def meddling_collector() -> Any:
    """Every collection adds a run: what the loop's thread may do while the scrape is inside one."""
    ctl = RunController(types.SimpleNamespace())  # type: ignore[arg-type]  # no I/O here
    _hold(ctl, {("ns", f"r{i}"): _run(i) for i in range(200)})
    added = iter(range(200, 10**6))

    def meddle(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            i = next(added)
            ctl.cache.runs.store(("ns", f"r{i}"), _run(i))

    thresholds = gc.get_threshold()
    gc.callbacks.append(meddle)
    gc.set_threshold(1)  # a collection at (nearly) every allocation
    try:
        yield ctl
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(meddle)


def test_the_scrape_reads_survive_a_dict_changing_under_them(meddling_collector: RunController) -> None:
    ctl = meddling_collector
    before = len(ctl.cache.runs)
    counts = ctl.phase_counts()
    ages = ctl.heartbeat_ages()
    assert len(ctl.cache.runs) > before  # the collections did run, and changed the dict meanwhile
    assert counts["ns", "Running", ""] >= before
    assert ages == []  # no Lease observed for any of them


def _hold(ctl: RunController, runs: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Runs held in the controller's store, as if the watch had brought them."""
    for key, body in runs.items():
        ctl.cache.runs.store(key, body)
