"""The operator's view of Kueue (kueue.book) against the unit tests' fake API: the answers to its
own reads and writes are facts of the moment they were answered (a Workload the watch saw deleted
meanwhile stays deleted), and Tether's AdmissionChecks are marked Active, a refusal tried again in
seconds, not after a backoff of minutes."""

from __future__ import annotations

import asyncio
import datetime as dt
import types
from typing import Any

from tether.api.models import WorkerRun
from tether.kube.paths import object_path
from tether.kueue import api as k
from tether.kueue.book import QueueBook, workload_path
from tether.kueue.capability import RETRY_SECONDS, _CheckMarker
from tether.kueue.decide import workload_name
from testkit.fakeapi import FakeApi, Request

T0 = dt.datetime(2026, 12, 7, tzinfo=dt.timezone.utc)
RUN = WorkerRun.model_validate({"metadata": {"name": "job", "namespace": "ns", "uid": "run-1"},
                                "spec": {"executor": "External"}})


def _workload(api: FakeApi) -> dict[str, Any]:
    return api.put(workload_path("ns", workload_name(RUN)), {
        "apiVersion": k.KUEUE_API_VERSION, "kind": "Workload",
        "metadata": {"name": workload_name(RUN), "namespace": "ns",
                     "ownerReferences": [{"kind": "WorkerRun", "name": "job", "uid": "run-1", "controller": True}]},
        "spec": {"queueName": "q"}, "status": {}})


def test_a_late_answer_never_revives_a_workload_the_watch_saw_deleted() -> None:
    api = FakeApi(now=lambda: T0)
    held = _workload(api)
    book = QueueBook(api.client(), lambda: T0)
    book.on_workload("ADDED", held)
    key = ("ns", workload_name(RUN))

    def deleted_meanwhile(req: Request) -> None:
        if req.method == "GET" and req.path == workload_path(*key):
            book.on_workload("DELETED", held)  # the watch's event, handled before our answer
        return None

    api.before(deleted_meanwhile)
    snap = types.SimpleNamespace(run=RUN, uid="run-1")
    assert asyncio.run(book.confirm_admitted(snap, 0)) is False  # type: ignore[arg-type]
    assert key not in book.workloads and key in book.deleted


def test_a_404_of_our_own_read_says_the_workload_is_gone() -> None:
    api = FakeApi(now=lambda: T0)
    book = QueueBook(api.client(), lambda: T0)
    book.on_workload("ADDED", _workload(api))
    del api.objects[workload_path("ns", workload_name(RUN))]  # deleted; the watch has not said so yet
    snap = types.SimpleNamespace(run=RUN, uid="run-1")
    assert asyncio.run(book.confirm_admitted(snap, 0)) is False  # type: ignore[arg-type]
    assert ("ns", workload_name(RUN)) in book.deleted


def test_a_refused_admission_check_mark_is_tried_again_in_seconds() -> None:
    api = FakeApi(now=lambda: T0)
    path = object_path(k.KUEUE_API_VERSION, "admissionchecks", None, "tether-budget")
    api.put(path, {"apiVersion": k.KUEUE_API_VERSION, "kind": "AdmissionCheck",
                   "metadata": {"name": "tether-budget"}, "spec": {"controllerName": k.BUDGET_CHECK_CONTROLLER}})
    refusing = [True]
    api.before(lambda req: (403, {"kind": "Status", "code": 403, "message": "forbidden"})
               if refusing[0] and req.method == "PATCH" else None)
    book = QueueBook(api.client(), lambda: T0)
    book.on_admission_check("ADDED", api.get(path))  # type: ignore[arg-type]
    marker = _CheckMarker(book, lambda: True)
    for _ in range(20):  # however often it is refused
        assert asyncio.run(marker.reconcile("tether-budget")).requeue_after == RETRY_SECONDS
    refusing[0] = False
    assert asyncio.run(marker.reconcile("tether-budget")).requeue_after is None
    marked = api.get(path)
    assert marked is not None and marked["status"]["conditions"][0]["type"] == k.AC_ACTIVE
    assert not marker.exists("tether-budget")
    assert asyncio.run(_CheckMarker(book, lambda: False).reconcile("x")).requeue_after == RETRY_SECONDS
