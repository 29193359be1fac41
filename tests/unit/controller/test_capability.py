"""The capability seam (controller.capability): a capability's package plus one registration line
is all of it. Kueue's, attached, brings its observers, its reconciler, the run reconciler's
watches, its executors and its confirmation; the controller without it knows no Workload, and a
run labelled for a queue is decided as any other."""

from __future__ import annotations

import dataclasses
import datetime as dt
import types
from typing import Any

import pytest

from tether.capabilities import CAPABILITIES
from tether.controller.capability import Attached, Context
from tether.controller.controller import RUNS, Clock, RunController
from tether.core.decide import decide, gates
from tether.kueue import api as k
from tether.kueue.actions import EnsureWorkload, KueueConfirm, SetPriorityBoost
from tether.kueue.capability import CAPABILITY as KUEUE, CHECKS
from tether.kueue.decide import RULES, QueueSlice
from tests.unit.core.test_decide import kinds, observe, run

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
QUEUE = {k.LABEL_QUEUE_NAME: "team-a"}


def _controller(*capabilities: Any) -> RunController:
    return RunController(types.SimpleNamespace(), clock=Clock(now=lambda: T0, mono=lambda: 0.0),  # type: ignore[arg-type]
                         capabilities=capabilities)


def _keys(ctl: RunController, name: str) -> list[Any]:
    return list(ctl.manager.queues()[name]._queue)


def _drain(ctl: RunController, name: str) -> None:
    queue = ctl.manager.queues()[name]
    queue._queue.clear()
    queue._dirty.clear()


def _run_body(name: str, phase: str = "Queued") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "resourceVersion": "1",
                         "labels": QUEUE}, "spec": {}, "status": {"phase": phase}}


def test_the_operator_registers_each_capability_by_one_line() -> None:
    assert [c.name for c in CAPABILITIES] == ["kueue", "schedules", "children"]
    assert {s.plural for s in KUEUE.sources} == {"workloads", "localqueues", "admissionchecks"}


def test_without_the_line_the_controller_knows_no_workload_and_a_queue_label_queues_nothing() -> None:
    ctl = _controller()
    assert CHECKS not in ctl.manager.queues()
    with pytest.raises(KeyError):
        ctl.feed("workload", "ADDED", {"metadata": {"name": "w", "namespace": "ns"}})
    # The pure decision without Kueue's rules: a labelled run is granted at once (no Workload made).
    d = decide(observe(run(labels=QUEUE)))
    assert kinds(d.actions) == ["WriteStatus", "EnsureLease", "EnsurePod"]
    assert len(gates(())) + 2 == len(gates((RULES,)))


def test_kueue_attached_observes_its_kinds_and_wakes_the_runs_they_concern() -> None:
    ctl = _controller(KUEUE)
    assert CHECKS in ctl.manager.queues()
    ctl.feed("run", "ADDED", _run_body("r"))
    _drain(ctl, RUNS)
    workload = {"metadata": {"name": "workerrun-r-abcde", "namespace": "ns", "uid": "w", "resourceVersion": "2",
                             "ownerReferences": [{"kind": "WorkerRun", "name": "r", "uid": "u-r", "controller": True}]},
                "spec": {}, "status": {}}
    ctl.feed("workload", "ADDED", workload)
    assert _keys(ctl, RUNS) == [("ns", "r")]
    _drain(ctl, RUNS)
    # A budget check of Tether's appears: its reconciler marks it Active; the queued runs look again.
    check = {"metadata": {"name": "tether-budget", "generation": 1},
             "spec": {"controllerName": k.BUDGET_CHECK_CONTROLLER}, "status": {}}
    ctl.feed("admissioncheck", "ADDED", check)
    assert _keys(ctl, CHECKS) == ["tether-budget"]
    assert _keys(ctl, RUNS) == [("ns", "r")]
    _drain(ctl, RUNS)
    ctl.feed("admissioncheck", "MODIFIED", check)  # the same set of checks: no run is woken again
    assert _keys(ctl, RUNS) == []


def test_kueue_brings_its_executors_confirmation_and_slice() -> None:
    ctl = _controller(KUEUE)
    (capability, attached), = ctl.capabilities
    assert capability is KUEUE and EnsureWorkload in attached.steps and SetPriorityBoost in attached.steps
    assert KueueConfirm.ADMITTED in attached.checks
    assert ctl.reconciler.rules == (RULES,)
    slice_ = QueueSlice(cluster_queue="shared")
    o = dataclasses.replace(observe(run(labels=QUEUE)), parts={QueueSlice: slice_})
    assert o.part(QueueSlice) is slice_


def test_a_capability_may_not_take_over_an_action_or_a_confirmation_already_handled() -> None:
    class Twice:
        name, rules, sources = KUEUE.name + "-again", RULES, ()

        def attach(self, ctx: Context) -> Attached:
            return KUEUE.attach(dataclasses.replace(ctx, manager=types.SimpleNamespace(  # type: ignore[arg-type]
                observe=lambda *a, **kw: None, register=lambda *a, **kw: None)))

    with pytest.raises(ValueError, match="executed twice"):
        _controller(KUEUE, Twice())


def test_a_grant_under_an_admission_without_a_fresh_read_is_refused_as_a_bug() -> None:
    """Whatever gate sets the admission the next attempt runs under must rest the grant on a fresh
    read of it: a grant that would not is an error, never a write."""
    from tether.api.models import AttemptAdmission
    from tether.core.lifecycle import StatusBuilder

    b = StatusBuilder(observe(run()))
    b.admission = AttemptAdmission(cluster_queue="shared", flavors={}, evictions=0)
    b.grant()
    with pytest.raises(AssertionError, match="rests_on"):
        b.write()
    b.rests_on = (KueueConfirm.ADMITTED,)
    assert KueueConfirm.ADMITTED in b.write().requires


def test_the_kinds_a_capability_watches_are_registered_with_kopf_once_per_process() -> None:
    """Operators started one after another in one process (the tests do) share kopf's registry: a
    second registration would feed every event twice."""
    import kopf

    from tether.controller import handlers

    def registered() -> int:
        return sum(1 for h in kopf.get_default_registry()._watching.get_all_handlers()
                   if str(h.id).startswith("kueue/"))

    handlers.watch([KUEUE])
    once = registered()
    handlers.watch([KUEUE])
    handlers.memo(handlers.Settings(capabilities=[KUEUE]))
    assert once == len(KUEUE.sources) and registered() == once
