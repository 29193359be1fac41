"""Table tests of queueing through Kueue (kueue.decide): a queued run waits for its Workload's
admission, starts under it with the flavor's placement, and tells Kueue PodsReady and Finished."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any

import pytest

from tether.kueue.api import ANN_ADMISSION_GATED_BY, ANN_DEACTIVATED, ANN_EXECUTION_DIGEST, ANN_PRIORITY_BOOST, Workload
from tether.core.execution import execution_digest
from tether.api.models import Checkpoint, Phase
from tether.api.models import Outcome
from tether.core.actions import Confirm, Decision, EnsureSignals, Revoke, WriteStatus
from tether.core.decide import decide as decide_with
from tether.core.observe import ApprovalObservation, BudgetObservation, Observed
from tether.kueue.actions import (AnswerBudgetCheck, DeleteWorkload, EnsureWorkload, FinishWorkload, KueueConfirm,
                                  MarkPodsReady, ReleaseQuota, SetPriorityBoost, SetWorkloadActive, UngateWorkload)
from tether.kueue.decide import (MAX_BOOST, RULES, FlavorPlacement, QueueSlice, admission_of, priority_boost,
                                 waiting_message, workload_name)
from tether.kube.resources import build_pod
from tests.unit.core.test_decide import T0, held, kinds, lease, observe, pod, run

QUEUE = {"kueue.x-k8s.io/queue-name": "team-a"}
SLICE = {f.name for f in dataclasses.fields(QueueSlice)}


def decide(o: Observed) -> Decision:
    """The decision with Kueue's capability, as the operator registers it."""
    return decide_with(o, (RULES,))


def replace(obj: Any, **changes: Any) -> Any:
    """dataclasses.replace, where an Observed takes Kueue's slice fields (workload, flavors, ...) as
    if they were its own: they go to its QueueSlice part."""
    if not isinstance(obj, Observed):
        return dataclasses.replace(obj, **changes)
    queued = {k: changes.pop(k) for k in list(changes) if k in SLICE}
    if queued:
        part = dataclasses.replace(obj.part(QueueSlice) or QueueSlice(), **queued)
        changes["parts"] = {**obj.parts, QueueSlice: part}
    return dataclasses.replace(obj, **changes)
DIGEST = execution_digest(run().spec)
OWNER = [{"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun", "name": "job", "uid": "u-1", "controller": True}]


def cond(type_: str, status: str, reason: str = "R", message: str = "") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": T0.isoformat()}


def workload(*conds: dict[str, Any], admission: dict[str, Any] | None = None, evictions: int = 0,
             checks: list[dict[str, Any]] | None = None, owner: list[dict[str, Any]] | None = None,
             digest: str | None = None) -> Workload:
    status: dict[str, Any] = {"conditions": list(conds)}
    if admission is not None:
        status["admission"] = admission
    if evictions:
        status["schedulingStats"] = {"evictions": [{"reason": "Preempted", "underlyingCause": "", "count": evictions}]}
    if checks is not None:
        status["admissionChecks"] = checks
    return Workload.model_validate({"metadata": {"name": "workerrun-job-x", "namespace": "ns", "uid": "w-1",
                                                 "resourceVersion": "5", "ownerReferences": owner or OWNER,
                                                 "annotations": {ANN_EXECUTION_DIGEST: digest or DIGEST}},
                                    "spec": {"queueName": "team-a"}, "status": status})


ADMISSION = {"clusterQueue": "shared", "podSetAssignments": [{"name": "main", "flavors": {"cpu": "spot"}, "count": 1}]}
ADMITTED = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"), admission=ADMISSION, evictions=2)
SPOT = {"spot": FlavorPlacement(node_labels={"pool": "spot"}, tolerations=({"key": "spot", "operator": "Exists"},))}


def queued_observe(wl: Workload | None, flavors: dict[str, FlavorPlacement] | None = None, status: Any = None,
                   **kw: Any):  # type: ignore[no-untyped-def]
    o = observe(run(status=status, labels=QUEUE), **kw)
    return replace(o, workload=wl, flavors=flavors if flavors is not None else SPOT, cluster_queue="shared")


def _status(d: Any):  # type: ignore[no-untyped-def]
    return next(a.status for a in d.actions if isinstance(a, WriteStatus))


def _cond(status: Any, type_: str) -> tuple[str, str, str]:
    c = next(x for x in status.conditions if x.type == type_)
    return c.status, c.reason, c.message or ""


def test_a_run_without_the_queue_label_is_not_queued() -> None:
    d = decide(observe(run()))
    assert kinds(d.actions) == ["WriteStatus", "EnsureLease", "EnsurePod"]


def test_a_queued_run_creates_its_workload_and_waits_queued() -> None:
    d = decide(queued_observe(None))
    assert kinds(d.actions) == ["EnsureWorkload", "WriteStatus"]
    assert d.actions[0] == EnsureWorkload(name=workload_name(run(labels=QUEUE)))
    s = _status(d)
    assert s.phase == Phase.QUEUED and s.holder is None and s.fence == 0
    assert _cond(s, "Admitted") == ("False", "Queued", "queued in LocalQueue team-a (ClusterQueue shared); "
                                                       "its Workload is being created")
    assert _cond(s, "Ready")[1] == "Queued" and _cond(s, "Reconciling")[0] == "True"  # kstatus: InProgress
    assert s.queue is not None and (s.queue.name, s.queue.cluster_queue) == ("team-a", "shared")


@pytest.mark.parametrize("wl, why", [
    (workload(cond("QuotaReserved", "False", "Pending", "insufficient unused quota for cpu in flavor default")),
     "queued in LocalQueue team-a (ClusterQueue shared): insufficient unused quota for cpu in flavor default"),
    (workload(cond("QuotaReserved", "True"), cond("Admitted", "False"), admission=ADMISSION,
              checks=[{"name": "budget", "state": "Retry", "message": "no money"}]),
     "queued in LocalQueue team-a (ClusterQueue shared): quota reserved, waiting for admission checks: "
     "budget is Retry (no money)"),
    (workload(cond("QuotaReserved", "True"), cond("Admitted", "True"), cond("Finished", "True"), admission=ADMISSION),
     "queued in LocalQueue team-a (ClusterQueue shared)"),
])
def test_no_attempt_starts_until_kueue_admits(wl: Workload, why: str) -> None:
    d = decide(queued_observe(wl))
    assert kinds(d.actions) == ["WriteStatus"]
    s = _status(d)
    assert s.phase == Phase.QUEUED and s.holder is None
    assert _cond(s, "Admitted") == ("False", "Queued", why)


def test_a_queued_run_unchanged_writes_nothing_again() -> None:
    o = queued_observe(workload(cond("QuotaReserved", "False", "Pending", "no quota")))
    written = _status(decide(o))
    # A later pass (the clock moved) with nothing new writes nothing: no write loop.
    later = replace(o, run=o.run.model_copy(update={"status": written}), now=T0 + dt.timedelta(seconds=7))
    assert decide(later).actions == []


def test_an_admitted_run_is_granted_under_its_admission_with_the_flavors_placement() -> None:
    d = decide(queued_observe(ADMITTED))
    assert kinds(d.actions) == ["WriteStatus", "EnsureLease", "EnsurePod"]
    write = d.actions[0]
    assert isinstance(write, WriteStatus) and write.grants and KueueConfirm.ADMITTED in write.requires
    s = write.status
    assert s.phase == Phase.STARTING and s.holder == "job-a1"
    adm = s.current().admission  # type: ignore[union-attr]
    assert adm is not None and (adm.cluster_queue, adm.flavors, adm.evictions) == ("shared", {"cpu": "spot"}, 2)
    assert _cond(s, "Admitted") == ("True", "Admitted", "admitted by ClusterQueue shared")
    granted = run(status=s.dump(), labels=QUEUE)
    p = build_pod(granted, "job-a1", 1, s.fence, "job-a1")
    assert p["spec"]["nodeSelector"] == {"pool": "spot"}
    assert {"key": "spot", "operator": "Exists"} in p["spec"]["tolerations"]


def test_an_unqueued_grant_asks_no_admission_read() -> None:
    write = decide(observe(run())).actions[0]
    assert isinstance(write, WriteStatus) and KueueConfirm.ADMITTED not in write.requires


def test_an_admission_whose_flavor_is_unknown_waits() -> None:
    d = decide(queued_observe(ADMITTED, flavors={}))
    s = _status(d)
    assert s.phase == Phase.QUEUED and s.holder is None
    assert "waiting to read its ResourceFlavors" in _cond(s, "Admitted")[2]


def test_admission_checks_pod_set_updates_reach_the_pod() -> None:
    wl = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"), admission=ADMISSION,
                  checks=[{"name": "prov", "state": "Ready", "message": "",
                           "podSetUpdates": [{"name": "main", "labels": {"a": "1"}, "annotations": {"b": "2"},
                                              "nodeSelector": {"zone": "z1"},
                                              "tolerations": [{"key": "z", "operator": "Exists"}]},
                                             {"name": "other", "labels": {"no": "no"}}]}])
    adm = admission_of(wl, SPOT)
    assert adm is not None
    assert adm.node_selector == {"pool": "spot", "zone": "z1"} and adm.labels == {"a": "1"}
    assert adm.annotations == {"b": "2"} and len(adm.tolerations) == 2


def test_a_namesakes_workload_is_not_this_runs() -> None:
    wl = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"), admission=ADMISSION,
                  owner=[{**OWNER[0], "uid": "someone-else"}])
    assert not wl.owned_by("u-1") and ADMITTED.owned_by("u-1")


def _held_queued(phase: str = "Running") -> dict[str, Any]:
    s = held(phase=phase)
    s["attempts"][-1]["admission"] = {"clusterQueue": "shared", "evictions": 2}
    return s


def test_the_first_renewal_tells_kueue_pods_ready_once() -> None:
    o = queued_observe(ADMITTED, status=_held_queued("Running"), lease_obs=lease(), pods=(pod(),))
    d = decide(o)
    assert [a for a in d.actions if isinstance(a, MarkPodsReady)] == [
        MarkPodsReady(name="workerrun-job-x", message="job-a1 renewed its lease", resource_version="5")]
    ready = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"), cond("PodsReady", "True"),
                     admission=ADMISSION, evictions=2)
    assert not [a for a in decide(replace(o, workload=ready)).actions if isinstance(a, MarkPodsReady)]


def test_pods_ready_waits_for_the_worker_not_the_container() -> None:
    o = queued_observe(ADMITTED, status=_held_queued("Starting"), lease_obs=lease(renewed=False), pods=(pod(),))
    assert not [a for a in decide(o).actions if isinstance(a, MarkPodsReady)]


@pytest.mark.parametrize("phase, succeeded", [("Succeeded", True), ("Failed", False), ("Cancelled", False)])
def test_a_finished_run_finishes_its_workload(phase: str, succeeded: bool) -> None:
    s = {**_held_queued(), "phase": phase, "holder": None, "fence": 2, "finishedAt": T0.isoformat()}
    d = decide(queued_observe(ADMITTED, status=s))
    assert FinishWorkload(name="workerrun-job-x", succeeded=succeeded, message=f"the run ended {phase}",
                          resource_version="5") in d.actions
    done = workload(cond("QuotaReserved", "True"), cond("Finished", "True"), admission=ADMISSION)
    assert not [a for a in decide(queued_observe(done, status=s)).actions if isinstance(a, FinishWorkload)]


def test_waiting_message_names_the_local_queue_without_a_known_cluster_queue() -> None:
    o = replace(queued_observe(None), cluster_queue=None)
    assert waiting_message(o, None) == "queued in LocalQueue team-a; its Workload is being created"


def test_workload_names_differ_for_namesakes_and_fit_the_api() -> None:
    a = run(labels=QUEUE)
    b = a.model_copy(update={"metadata": a.metadata.model_copy(update={"uid": "u-2"})})
    assert workload_name(a) != workload_name(b)
    long = a.model_copy(update={"metadata": a.metadata.model_copy(update={"name": "x" * 253})})
    assert len(workload_name(long)) <= 253


# --- eviction: told to yield, fenced, queued again, no retry used --------------------------------

EVICTED = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"),
                   cond("Evicted", "True", "Preempted", "Preempted to accommodate a higher priority Workload"),
                   admission=ADMISSION, evictions=3)


def test_an_eviction_tells_the_worker_to_yield_first() -> None:
    o = queued_observe(EVICTED, status=_held_queued(), lease_obs=lease(), pods=(pod(),))
    d = decide(o)
    s = _status(d)
    assert s.holder == "job-a1" and s.stop_requested_at == T0  # still held: told, not yet revoked
    (signals,) = [a for a in d.actions if isinstance(a, EnsureSignals)]
    told_signals = json.loads(signals.signals)
    assert told_signals["stop"] is True and told_signals["yield"] is True
    assert told_signals["reason"].startswith("evicted by Kueue (Preempted)")
    assert told_signals["stopBy"] == "2026-11-29T12:00:30Z"  # stopGraceSeconds (30) after it was told
    (told,) = [e for w in d.actions if isinstance(w, WriteStatus) for e in w.events]
    assert (told.type, told.reason) == ("Warning", "Preempted") and "told to yield" in told.message


@pytest.mark.parametrize("pods, now", [
    ((pod(phase="Succeeded", exit_code=0),), T0),  # it checkpointed and exited
    ((pod(),), T0 + dt.timedelta(seconds=31)),     # it ignored the yield: stopGraceSeconds (30) passed
])
def test_a_yielded_or_overdue_attempt_ends_preempted_and_the_run_is_queued_again(pods: Any, now: dt.datetime) -> None:
    status = {**_held_queued(), "stopRequestedAt": T0.isoformat(), "checkpoint": {"cursor": "step-3"}}
    r = run(spec={"retry": {"maxAttempts": 1}}, status=status, labels=QUEUE)
    o = replace(observe(r, lease(), pods=pods, now=now), workload=EVICTED, flavors=SPOT, cluster_queue="shared")
    d = decide(o)
    (revoke,) = [a for a in d.actions if isinstance(a, Revoke)]
    s = revoke.status_write.status
    assert s.holder is None and s.fence == 2  # fenced: nothing the evicted worker sends counts
    assert s.current().outcome == Outcome.PREEMPTED  # type: ignore[union-attr]
    assert s.phase == Phase.QUEUED and s.next_attempt_at is None  # maxAttempts 1, and not used up
    assert _cond(s, "Admitted")[:2] == ("False", "Preempted") and _cond(s, "Ready")[1] == "Preempted"
    assert revoke.pods_to_delete == (() if pods[0].terminated else ("job-a1",))
    assert revoke.status_write.details.eviction_reason == "Preempted"  # tether_kueue_evictions_total


def test_a_retry_rule_can_fail_the_run_on_preemption() -> None:
    status = {**_held_queued(), "stopRequestedAt": T0.isoformat()}
    r = run(spec={"retry": {"maxAttempts": 3, "rules": [{"action": "FailRun", "onReasons": ["Preempted"]}]}},
            status=status, labels=QUEUE)
    o = replace(observe(r, lease(), pods=(pod(phase="Failed", exit_code=143),)), workload=EVICTED, flavors=SPOT)
    (revoke,) = [a for a in decide(o).actions if isinstance(a, Revoke)]
    assert revoke.status_write.status.phase == Phase.FAILED


def _after_preemption() -> dict[str, Any]:
    s = _held_queued()
    s["attempts"][-1].update(outcome="Preempted", endedAt=T0.isoformat())
    return {**s, "holder": None, "fence": 2, "phase": "Queued", "checkpoint": {"cursor": "step-3"}}


def test_the_quota_is_released_once_the_evicted_pod_is_gone() -> None:
    gone = decide(queued_observe(EVICTED, status=_after_preemption()))
    assert ReleaseQuota(name="workerrun-job-x", resource_version="5") in gone.actions
    assert not any(isinstance(a, WriteStatus) and a.grants for a in gone.actions)
    busy = decide(queued_observe(EVICTED, status=_after_preemption(), pods=(pod(),)))
    assert not [a for a in busy.actions if isinstance(a, ReleaseQuota)]


def test_readmitted_it_resumes_from_its_checkpoint_under_the_new_admission() -> None:
    again = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"), cond("Evicted", "False"),
                     admission=ADMISSION, evictions=3)
    d = decide(queued_observe(again, status=_after_preemption()))
    write = d.actions[0]
    assert isinstance(write, WriteStatus) and write.grants
    s = write.status
    assert (s.attempt, s.fence, s.holder) == (2, 3, "job-a2")
    assert s.current().admission.evictions == 3  # type: ignore[union-attr]
    assert write.details.queued_seconds == 0.0  # since the eviction ended attempt 1 (at T0)
    env = {e["name"]: e["value"] for e in build_pod(run(status=s.dump(), labels=QUEUE), "job-a2", 2, 3, "job-a2")
           ["spec"]["containers"][0]["env"]}
    assert env["TETHER_CHECKPOINT"] == "step-3"


def test_an_eviction_since_the_grant_counts_even_if_kueue_admitted_it_again() -> None:
    readmitted = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"), cond("Evicted", "False"),
                          admission=ADMISSION, evictions=3)  # the attempt started at 2
    d = decide(queued_observe(readmitted, status=_held_queued(), lease_obs=lease(), pods=(pod(),)))
    assert _status(d).stop_requested_at == T0


def test_a_workload_not_seen_stops_nothing() -> None:
    d = decide(queued_observe(None, status=_held_queued(), lease_obs=lease(), pods=(pod(),)))
    assert not any(isinstance(a, (Revoke, EnsureSignals)) for a in d.actions)
    assert all(a.status.stop_requested_at is None for a in d.actions if isinstance(a, WriteStatus))


def test_preempted_attempts_use_up_no_retry_even_beyond_the_kept_history() -> None:
    from tether.core.lifecycle import attempts_used
    s = run(status={**_after_preemption(), "preemptions": 1}).status
    assert (s.attempt, attempts_used(s)) == (1, 0)
    # 150 preemptions, then a failure: one attempt used, though the history keeps only 100.
    many = run(status={**held(attempt=151), "preemptions": 150}).status
    assert attempts_used(many) == 1


def test_the_preemption_counter_grows_with_each_preemption() -> None:
    status = {**_held_queued(), "stopRequestedAt": T0.isoformat(), "preemptions": 4}
    o = replace(observe(run(status=status, labels=QUEUE), lease(), pods=(pod(phase="Succeeded", exit_code=0),)),
                workload=EVICTED, flavors=SPOT)
    (revoke,) = [a for a in decide(o).actions if isinstance(a, Revoke)]
    assert revoke.status_write.status.preemptions == 5


def test_an_exit_code_rule_does_not_fail_a_preempted_attempt() -> None:
    """A yielding worker may exit non-zero (an uncaught StopRequested): only onReasons rules match."""
    status = {**_held_queued(), "stopRequestedAt": T0.isoformat()}
    r = run(spec={"retry": {"maxAttempts": 3, "rules": [
        {"action": "FailRun", "onExitCodes": {"operator": "NotIn", "values": [0]}}]}}, status=status, labels=QUEUE)
    o = replace(observe(r, lease(), pods=(pod(phase="Failed", exit_code=1),)), workload=EVICTED, flavors=SPOT)
    (revoke,) = [a for a in decide(o).actions if isinstance(a, Revoke)]
    assert revoke.status_write.status.phase == Phase.QUEUED


@pytest.mark.parametrize("status", [
    {"phase": "Backoff", "attempt": 1, "fence": 2, "nextAttemptAt": "2026-11-30T12:00:00+00:00"},
    {"phase": "Suspended", "attempt": 1, "fence": 2},
])
def test_an_evicted_workloads_quota_is_released_whatever_holds_the_run_back(status: dict[str, Any]) -> None:
    """The preemptor waits for this release: a backoff (up to a week) or a suspension must not hold it."""
    spec = {"suspend": True} if status["phase"] == "Suspended" else None
    o = replace(observe(run(spec=spec, status={**status, "queue": {"name": "team-a", "workload": "workerrun-job-x"}},
                            labels=QUEUE)), workload=EVICTED, flavors=SPOT)
    assert ReleaseQuota(name="workerrun-job-x", resource_version="5") in decide(o).actions


def test_a_spec_edited_while_queued_remakes_the_workload_before_any_grant() -> None:
    """Kueue admitted the pod set the Workload was made from; a grant must not run another."""
    stale = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"), admission=ADMISSION, digest="sha256:old")
    d = decide(queued_observe(stale))
    assert DeleteWorkload(name="workerrun-job-x", uid="w-1") in d.actions
    assert not any(isinstance(a, WriteStatus) and a.grants for a in d.actions)


@pytest.mark.parametrize(("on_workload", "label"), [(None, "60"), (60, None), (60, "120")])
def test_a_maximum_execution_time_changed_while_queued_remakes_the_workload(on_workload: int | None,
                                                                             label: str | None) -> None:
    """As Kueue's job framework remakes a Job's Workload whose time limit no longer matches: the new
    limit counts afresh (also the way out of a Workload Kueue deactivated for its time)."""
    wl = workload(cond("QuotaReserved", "False"))
    wl = wl.model_copy(update={"spec": wl.spec.model_copy(update={"maximum_execution_time_seconds": on_workload})})
    labels = {**QUEUE, **({"kueue.x-k8s.io/max-exec-time-seconds": label} if label else {})}
    o = replace(observe(run(labels=labels)), workload=wl, flavors=SPOT, cluster_queue="shared")
    d = decide(o)
    assert DeleteWorkload(name="workerrun-job-x", uid="w-1") in d.actions
    assert "label kueue.x-k8s.io/max-exec-time-seconds changed" in _cond(_status(d), "Admitted")[2]
    same = replace(o, run=run(labels={**QUEUE, **({"kueue.x-k8s.io/max-exec-time-seconds": str(on_workload)}
                                                  if on_workload else {})}))
    assert not any(isinstance(a, DeleteWorkload) for a in decide(same).actions)


def test_the_queue_is_the_recorded_one_once_the_workload_exists() -> None:
    """A label removed (or changed) mid-run moves nothing: evictions still reach the attempt."""
    status = {**_held_queued(), "queue": {"name": "team-a", "workload": "workerrun-job-x"}}
    o = replace(observe(run(status=status), lease(), pods=(pod(),)), workload=EVICTED, flavors=SPOT)  # no label
    assert _status(decide(o)).stop_requested_at == T0


def test_a_workload_seen_deleted_ends_the_admission_of_the_held_attempt() -> None:
    o = replace(queued_observe(None, status=_held_queued(), lease_obs=lease(), pods=(pod(),)), workload_gone=True)
    s = _status(decide(o))
    assert s.stop_requested_at == T0 and s.holder == "job-a1"


def test_an_admitted_run_waiting_for_a_flavor_looks_again() -> None:
    d = decide(queued_observe(ADMITTED, flavors={}))
    assert d.requeue_after == 5.0


@pytest.mark.parametrize("at_risk, unit, boost", [(0, 60, 0), (59.9, 60, 0), (60, 60, 1), (179, 60, 1), (180, 60, 2),
                                                  (420, 60, 3), (10 ** 9, 60, MAX_BOOST), (5, 0, 0)])
def test_the_boost_rises_by_one_each_time_the_work_at_risk_doubles(at_risk: float, unit: float, boost: int) -> None:
    assert priority_boost(at_risk, unit) == boost


READY = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"), cond("PodsReady", "True"),
                 admission=ADMISSION, evictions=2)


def _running(wl: Workload, checkpoint_age: float, started_ago: float = 3600.0) -> Any:
    """A running queued attempt, `checkpoint_age` seconds after its last checkpoint was seen."""
    status = _held_queued("Running")
    status["attempts"][-1]["startedAt"] = (T0 - dt.timedelta(seconds=started_ago)).isoformat()
    return queued_observe(wl, status=status, now=T0, mono=1000.0, pods=(pod(),),
                          lease_obs=lease(checkpoint="c1", checkpoint_changed=1000.0 - checkpoint_age))


def _boosts(d: Any) -> list[SetPriorityBoost]:
    return [a for a in d.actions if isinstance(a, SetPriorityBoost)]


def _annotated(wl: Workload, boost: str) -> Workload:
    return wl.model_copy(update={"metadata": wl.metadata.model_copy(
        update={"annotations": {**wl.metadata.annotations, ANN_PRIORITY_BOOST: boost}})})


def test_a_running_run_is_boosted_by_the_work_since_its_checkpoint_and_woken_at_the_next_step() -> None:
    d = decide(_running(READY, checkpoint_age=200.0))
    assert _boosts(d) == [SetPriorityBoost(name="workerrun-job-x", boost=2, resource_version="5")]
    assert d.requeue_after is not None and d.requeue_after <= 220.01 + 1e-6
    assert not _boosts(decide(_running(_annotated(READY, "2"), checkpoint_age=200.0)))


def test_a_checkpoint_takes_the_boost_away() -> None:
    assert _boosts(decide(_running(_annotated(READY, "3"), checkpoint_age=0.5))) == [
        SetPriorityBoost(name="workerrun-job-x", boost=None, resource_version="5")]


def test_an_attempt_resuming_from_an_old_checkpoint_counts_from_its_start() -> None:
    assert not _boosts(decide(_running(READY, checkpoint_age=5000.0, started_ago=30.0)))


def test_the_boost_waits_for_pods_ready_whose_write_is_conditional_on_the_same_version() -> None:
    d = decide(_running(ADMITTED, checkpoint_age=500.0))
    assert [type(a) for a in d.actions if isinstance(a, (MarkPodsReady, SetPriorityBoost))] == [MarkPodsReady]


def test_a_run_no_longer_running_under_its_admission_loses_its_boost() -> None:
    evicted = workload(cond("QuotaReserved", "True"), cond("Admitted", "False"), cond("Evicted", "True", "Preempted"),
                       cond("PodsReady", "True"), admission=ADMISSION, evictions=3)
    d = decide(_running(_annotated(evicted, "4"), checkpoint_age=500.0))
    assert _boosts(d) == [SetPriorityBoost(name="workerrun-job-x", boost=None, resource_version="5")]


# --- No quota held while a person or money holds the run back ----------------------------------

CREATED = T0 - dt.timedelta(minutes=5)
START_GATED = {"review": {"start": True}}


def _gated_observe(wl: Workload | None, spec: dict[str, Any] | None = None, **kw: Any) -> Any:
    o = observe(run(spec=spec, labels=QUEUE, creationTimestamp=CREATED.isoformat()), **kw)
    return replace(o, workload=wl, flavors=SPOT, cluster_queue="shared", budget_checks=frozenset({"tether-budget"}))


def _with(wl: Workload, **annotations: str) -> Workload:
    return wl.model_copy(update={"metadata": wl.metadata.model_copy(
        update={"annotations": {**wl.metadata.annotations, **annotations}})})


def _start_approval() -> ApprovalObservation:
    return ApprovalObservation(name="ok", gate="Start", decision="Approve", approver="alice", reason="fine",
                               created=T0 - dt.timedelta(minutes=1), run_uid="u-1")


EXHAUSTED = BudgetObservation(name="team", exhausted=True, next_reset_seconds=3.2)


@pytest.mark.parametrize("spec, budget, gates", [
    (START_GATED, None, ("tether.dev/start-review",)),
    (None, EXHAUSTED, ("tether.dev/budget",)),
    (START_GATED, EXHAUSTED, ("tether.dev/start-review", "tether.dev/budget")),
    (None, None, ()),
])
def test_the_workload_is_made_first_gated_by_what_holds_the_run_back(spec: Any, budget: Any, gates: Any) -> None:
    d = decide(_gated_observe(None, spec=spec, budget=budget))
    assert [a for a in d.actions if isinstance(a, EnsureWorkload)] == [
        EnsureWorkload(name=workload_name(run(labels=QUEUE)), gates=gates)]


PENDING_WL = workload(cond("QuotaReserved", "False", "Pending"))


def test_an_approved_start_removes_tethers_gate_and_keeps_others() -> None:
    gated = _with(PENDING_WL, **{ANN_ADMISSION_GATED_BY: "example.com/other,tether.dev/start-review"})
    o = replace(_gated_observe(gated, spec=START_GATED), approvals=(_start_approval(),))
    assert [a for a in decide(o).actions if isinstance(a, UngateWorkload)] == [
        UngateWorkload(name="workerrun-job-x", keep=("example.com/other",), resource_version="5")]
    # Not approved yet: the gate stays, and the run waits for its person.
    waiting = decide(_gated_observe(gated, spec=START_GATED))
    assert not [a for a in waiting.actions if isinstance(a, UngateWorkload)]
    assert _status(waiting).phase == Phase.AWAITING_APPROVAL


def test_the_budget_gate_goes_once_the_budget_can_pay() -> None:
    gated = _with(PENDING_WL, **{ANN_ADMISSION_GATED_BY: "tether.dev/budget"})
    assert not [a for a in decide(_gated_observe(gated, budget=EXHAUSTED)).actions if isinstance(a, UngateWorkload)]
    assert [a for a in decide(_gated_observe(gated)).actions if isinstance(a, UngateWorkload)] == [
        UngateWorkload(name="workerrun-job-x", keep=(), resource_version="5")]


RESERVED_CHECKED = workload(cond("QuotaReserved", "True"), cond("Admitted", "False"), admission=ADMISSION,
                            checks=[{"name": "tether-budget", "state": "Pending", "message": "",
                                     "lastTransitionTime": T0.isoformat()},
                                    {"name": "someone-elses", "state": "Pending", "message": "",
                                     "lastTransitionTime": T0.isoformat()}])


def test_the_budget_check_says_retry_while_the_budget_cannot_pay_and_ready_once_it_can() -> None:
    (retry,) = [a for a in decide(_gated_observe(RESERVED_CHECKED, budget=EXHAUSTED)).actions
                if isinstance(a, AnswerBudgetCheck)]
    assert (retry.check, retry.state, retry.requeue_after_seconds) == ("tether-budget", "Retry", 4)
    assert "WorkerBudget team is exhausted" in retry.message
    (ready,) = [a for a in decide(_gated_observe(RESERVED_CHECKED)).actions if isinstance(a, AnswerBudgetCheck)]
    assert (ready.check, ready.state, ready.requeue_after_seconds) == ("tether-budget", "Ready", None)


def test_a_budget_check_already_answered_or_not_tethers_is_left_alone() -> None:
    answered = workload(cond("QuotaReserved", "True"), admission=ADMISSION,
                        checks=[{"name": "tether-budget", "state": "Ready", "message": "",
                                 "lastTransitionTime": T0.isoformat()}])
    assert not [a for a in decide(_gated_observe(answered)).actions if isinstance(a, AnswerBudgetCheck)]
    theirs = replace(_gated_observe(RESERVED_CHECKED, budget=EXHAUSTED), budget_checks=frozenset())
    assert not [a for a in decide(theirs).actions if isinstance(a, AnswerBudgetCheck)]


def _active(d: Any) -> list[SetWorkloadActive]:
    return [a for a in d.actions if isinstance(a, SetWorkloadActive)]


def test_a_workload_whose_run_would_not_start_is_deactivated_and_activated_again_once_it_would() -> None:
    # Its budget ran out while it was queued (no gate: gates are set only at creation).
    (off,) = _active(decide(_gated_observe(PENDING_WL, budget=EXHAUSTED)))
    assert (off.active, off.resource_version) == (False, "5") and "WorkerBudget team is exhausted" in (off.reason or "")
    inactive = PENDING_WL.model_copy(update={"spec": PENDING_WL.spec.model_copy(update={"active": False})})
    assert not _active(decide(_gated_observe(inactive, budget=EXHAUSTED)))  # already so
    ours = _with(inactive, **{ANN_DEACTIVATED: "not launched"})
    (on,) = _active(decide(_gated_observe(ours)))
    assert (on.active, on.reason) == (True, None)
    # One a person deactivated stays so.
    assert not _active(decide(_gated_observe(inactive)))


def test_a_suspended_queued_run_holds_no_quota() -> None:
    o = _gated_observe(ADMITTED, spec={"suspend": True})
    (off,) = _active(decide(o))
    assert off.active is False and off.reason == "the run is suspended"


def test_a_gated_workload_or_unknown_approvals_change_no_activation() -> None:
    gated = _with(PENDING_WL, **{ANN_ADMISSION_GATED_BY: "tether.dev/start-review"})
    assert not _active(decide(_gated_observe(gated, spec=START_GATED)))
    approved_before = _with(PENDING_WL, **{ANN_DEACTIVATED: "x"})
    unknown = replace(_gated_observe(approved_before, spec=START_GATED), approvals=None)
    assert not _active(decide(unknown))


def test_a_held_run_is_told_ready_by_a_check_added_while_it_runs() -> None:
    held_checked = workload(cond("QuotaReserved", "True"), cond("Admitted", "False"), cond("PodsReady", "True"),
                            admission=ADMISSION, evictions=2,
                            checks=[{"name": "tether-budget", "state": "Pending", "message": "",
                                     "lastTransitionTime": T0.isoformat()}])
    o = replace(queued_observe(held_checked, status=_held_queued("Running"), lease_obs=lease(), pods=(pod(),),
                               budget=EXHAUSTED), budget_checks=frozenset({"tether-budget"}))
    assert [a.state for a in decide(o).actions if isinstance(a, AnswerBudgetCheck)] == ["Ready"]


def test_after_an_operator_restart_the_boost_counts_from_the_checkpoint_the_status_recorded() -> None:
    o = _running(_annotated(READY, "3"), checkpoint_age=0.0)  # first sight: the monotonic clock says "just now"
    status = o.run.status.model_copy(update={"checkpoint": Checkpoint(cursor="c1", time=T0 - dt.timedelta(seconds=500))})
    restarted = replace(o, run=o.run.model_copy(update={"status": status}))
    assert not _boosts(decide(restarted))  # 500 s at risk: boost 3, as annotated
    stale = Checkpoint(cursor="c0", time=T0 - dt.timedelta(seconds=500))  # another checkpoint since: not a bound
    moved = replace(o, run=o.run.model_copy(update={"status": status.model_copy(update={"checkpoint": stale})}))
    assert [b.boost for b in _boosts(decide(moved))] == [None]


def _inactive(wl: Workload, **annotations: str) -> Workload:
    wl = _with(wl, **annotations) if annotations else wl
    return wl.model_copy(update={"spec": wl.spec.model_copy(update={"active": False})})


def test_a_workload_kueue_deactivated_is_not_tethers_to_activate_and_the_run_says_so() -> None:
    by_kueue = _inactive(workload(cond("QuotaReserved", "False", "Pending"),
                                  cond("Evicted", "False", "DeactivatedDueToRequeuingLimitExceeded",
                                       "exceeded the maximum number of re-queuing retries")),
                         **{ANN_DEACTIVATED: "the run is suspended"})  # an old note of Tether's
    d = decide(_gated_observe(by_kueue))
    assert not _active(d)
    status, reason, message = _cond(_status(d), "Admitted")
    assert (status, reason) == ("False", "Queued") and "deactivated by Kueue (DeactivatedDueToRequeuingLimitExceeded" \
        in message and "spec.active is true" in message
    by_person = decide(_gated_observe(_inactive(PENDING_WL)))
    assert "(spec.active is false)" in _cond(_status(by_person), "Admitted")[2]


def test_an_annotation_left_on_an_active_workload_is_removed() -> None:
    (fix,) = _active(decide(_gated_observe(_with(PENDING_WL, **{ANN_DEACTIVATED: "x"}))))
    assert (fix.active, fix.reason) == (True, None)


def test_an_inactive_admitted_workload_grants_nothing() -> None:
    d = decide(_gated_observe(_inactive(ADMITTED)))
    assert "EnsureLease" not in kinds(d.actions)


def test_a_result_under_review_holds_no_quota() -> None:
    status = {"phase": "AwaitingReview", "attempt": 1, "fence": 2, "observedGeneration": 1,
              "attempts": [{"attempt": 1, "fence": 1, "holder": "job-a1", "startedAt": T0.isoformat(),
                            "endedAt": T0.isoformat(), "outcome": "Succeeded"}]}
    o = replace(queued_observe(ADMITTED, status=status), budget_checks=frozenset())
    (off,) = _active(decide(o))
    assert off.active is False and "review" in (off.reason or "")


def test_the_budget_check_says_retry_for_whatever_holds_the_run_back() -> None:
    o = _gated_observe(RESERVED_CHECKED, spec={"suspend": True})
    (answer,) = [a for a in decide(o).actions if isinstance(a, AnswerBudgetCheck)]
    assert (answer.state, answer.message) == ("Retry", "the run is suspended")


def test_a_workload_made_for_a_run_held_back_otherwise_is_made_inactive() -> None:
    status = {"phase": "Pending", "attempt": 0, "fence": 0, "observedGeneration": 1,
              "review": {"requests": [{"gate": "Start", "attempt": 0, "requestedAt": CREATED.isoformat(),
                                       "executionDigest": "sha256:other", "decision": "Approve",
                                       "decidedAt": T0.isoformat()}]}}
    o = replace(queued_observe(None, status=status), approvals=())
    (made,) = [a for a in decide(o).actions if isinstance(a, EnsureWorkload)]
    assert made.gates == () and made.inactive_reason is not None and "execution fields" in made.inactive_reason


@pytest.mark.parametrize("history", [100, 3])
def test_spend_counts_every_attempt_however_long_the_history(history: int) -> None:
    """104 attempts preempted by Kueue, 40 cents each: the run's usage, what its cap and budget see,
    is 4,160 cents although status.attempts keeps only the last 100 (or what --attempt-history says)."""
    from tether.api.models import Remaining, Usage
    from tether.core.accounting import earlier_usage
    from tether.core.actions import ChargeBudget
    status = run(labels=QUEUE).status

    def queued_observe(*args: Any, **kw: Any):  # type: ignore[no-untyped-def]
        return replace(globals()["queued_observe"](*args, **kw), attempt_history=history)
    budget = BudgetObservation(name="team", remaining=Remaining(cents=10**9, tokens=10**9))
    for i in range(1, 105):
        readmitted = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"), admission=ADMISSION,
                              evictions=i)
        grant = next(a for a in decide(queued_observe(readmitted, status=status.dump())).actions
                     if isinstance(a, WriteStatus) and a.grants)
        status = grant.status
        assert (status.attempt, status.holder) == (i, f"job-a{i}")
        evicted = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"),
                           cond("Evicted", "True", "Preempted", "preempted"), admission=ADMISSION, evictions=i + 1)
        spent = lease(attempt=i, fence=status.fence, usage=Usage(cents=40, tokens=1))
        told = _status(decide(queued_observe(evicted, status=status.dump(), lease_obs=spent, pods=(pod(i),))))
        assert told.stop_requested_at is not None
        o = queued_observe(evicted, status=told.dump(), lease_obs=spent, pods=(pod(i, phase="Succeeded", exit_code=0),),
                           budget=budget)
        (revoke,) = [a for a in decide(o).actions if isinstance(a, Revoke)]
        status = revoke.status_write.status
        assert status.current().outcome == Outcome.PREEMPTED  # type: ignore[union-attr]
    assert len(status.attempts) == history and status.attempts[0].attempt == 105 - history
    assert status.usage == Usage(cents=4160, tokens=104) and earlier_usage(status) == Usage(cents=4160, tokens=104)
    # Admitted again: the budget is charged the whole of it, and the next attempt starts from it.
    readmitted = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"), admission=ADMISSION, evictions=105)
    status = next(a for a in decide(queued_observe(readmitted, status=status.dump())).actions
                  if isinstance(a, WriteStatus) and a.grants).status
    o = queued_observe(readmitted, status=status.dump(), lease_obs=lease(attempt=105, fence=status.fence),
                       pods=(pod(105),), budget=budget)
    charges = [a for a in decide(o).actions if isinstance(a, ChargeBudget)]
    assert [c.total for c in charges] == [Usage(cents=4160, tokens=104)]


def test_an_error_published_while_yielding_is_kept_in_its_attempts_record() -> None:
    """The worker told to yield publishes an error: the preemption ends the attempt (not a failure,
    the run is queued again), and the error stays on record in the attempt it belongs to."""
    from tether.api.models import ErrorInfo
    published = {"code": "ToolTimeout", "message": "the CRM did not answer in 60s"}
    status = {**_held_queued(), "stopRequestedAt": T0.isoformat(), "error": published}
    o = queued_observe(EVICTED, status=status, lease_obs=lease(), pods=(pod(),))
    (revoke,) = [a for a in decide(o).actions if isinstance(a, Revoke)]
    s = revoke.status_write.status
    assert s.phase == Phase.QUEUED and s.error is None  # status.error describes the run, which goes on
    ended = s.current()
    assert ended is not None and ended.outcome == Outcome.PREEMPTED
    assert ended.error == ErrorInfo.model_validate(published)
    assert ended.message is not None and "evicted by Kueue" in ended.message


@pytest.mark.parametrize("phase", ["Succeeded", "Cancelled"])
def test_the_quota_of_an_ended_run_goes_only_once_no_pod_of_it_runs(phase: str) -> None:
    """Kueue frees quota when the job has nothing active: a succeeded pod still exiting, or a revoked
    one inside its grace period, keeps it; a deleted pod whose node never reports is given up on
    UNREPORTED_EXIT_SECONDS after its grace period (a node that is gone)."""
    from tether.core.observe import UNREPORTED_EXIT_SECONDS
    s = {**_held_queued(), "phase": phase, "holder": None, "fence": 2, "finishedAt": T0.isoformat()}
    s["attempts"][-1].update(outcome="Succeeded" if phase == "Succeeded" else "Cancelled", endedAt=T0.isoformat(),
                             exitCode=143)
    finish = lambda d: [a for a in d.actions if isinstance(a, FinishWorkload)]  # noqa: E731
    assert not finish(decide(queued_observe(ADMITTED, status=s, pods=(pod(),))))  # exiting
    due = T0 + dt.timedelta(seconds=30)
    deleting = pod(deleting=True, deletion_due=due)
    held = decide(queued_observe(ADMITTED, status=s, pods=(deleting,)))
    assert not finish(held) and held.requeue_after == 30 + UNREPORTED_EXIT_SECONDS
    lost_node = decide(queued_observe(ADMITTED, status=s, pods=(deleting,),
                                      now=due + dt.timedelta(seconds=UNREPORTED_EXIT_SECONDS)))
    assert finish(lost_node)
    (done,) = finish(decide(queued_observe(ADMITTED, status=s, pods=(pod(phase="Failed", exit_code=143),))))
    assert done.succeeded is (phase == "Succeeded") and Confirm.PODS_GONE in done.requires


def test_an_evicted_runs_quota_waits_for_its_deleted_pod_to_end() -> None:
    deleting = pod(deleting=True, deletion_due=T0 + dt.timedelta(seconds=30))
    busy = decide(queued_observe(EVICTED, status=_after_preemption(), pods=(deleting,)))
    assert not [a for a in busy.actions if isinstance(a, ReleaseQuota)]


def test_a_deleted_queued_run_lets_go_only_once_no_pod_of_it_runs() -> None:
    """The Workload is the run's (garbage-collected with it): its quota must outlive the pods."""
    s = {**_held_queued(), "phase": "Cancelled", "holder": None, "fence": 2, "finishedAt": T0.isoformat()}
    s["attempts"][-1].update(outcome="Cancelled", endedAt=T0.isoformat())
    r = run(status=s, labels=QUEUE, deletionTimestamp=T0.isoformat(), finalizers=["tether.dev/cleanup"])
    deleting = pod(deleting=True, deletion_due=T0 + dt.timedelta(seconds=30), has_finalizer=False)

    def deciding(*pods: Any, wl: Workload = ADMITTED) -> list[str]:
        return kinds(decide(replace(observe(r, pods=pods), workload=wl, flavors=SPOT)).actions)

    assert deciding(deleting) == []
    # Finished first (its confirmation lists the pods afresh), the finalizer once Kueue has it.
    assert deciding(pod(phase="Failed", exit_code=143, has_finalizer=False)) == ["FinishWorkload"]
    assert deciding() == ["FinishWorkload"]
    finished = workload(cond("QuotaReserved", "True"), cond("Finished", "True"), admission=ADMISSION)
    assert deciding(wl=finished) == ["RemoveFinalizer"] and deciding(wl=None) == ["RemoveFinalizer"]  # type: ignore[arg-type]


def test_pods_ready_is_withdrawn_between_attempts_so_kueue_bounds_a_failing_run() -> None:
    """Attempt 1 crashed and the run waits in Backoff under its quota: PodsReady goes False
    (WaitForRecovery, Kueue's recoveryTimeout applies), and True again (Recovered) once attempt 2's
    worker renews."""
    ready = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"), cond("PodsReady", "True", "Started"),
                     admission=ADMISSION, evictions=2)
    s = _held_queued()
    s["attempts"][-1].update(outcome="PodFailed", endedAt=T0.isoformat(), exitCode=1)
    backoff = {**s, "holder": None, "fence": 2, "phase": "Backoff",
               "nextAttemptAt": (T0 + dt.timedelta(seconds=10)).isoformat()}
    (withdrawn,) = [a for a in decide(queued_observe(ready, status=backoff)).actions if isinstance(a, MarkPodsReady)]
    assert (withdrawn.ready, withdrawn.reason) == (False, "WaitForRecovery")
    assert "attempt 1 ended (PodFailed)" in withdrawn.message
    waiting = workload(cond("QuotaReserved", "True"), cond("Admitted", "True"),
                       cond("PodsReady", "False", "WaitForRecovery"), admission=ADMISSION, evictions=2)
    assert not [a for a in decide(queued_observe(waiting, status=backoff)).actions if isinstance(a, MarkPodsReady)]
    second = held(attempt=2, phase="Running")
    second["attempts"][-1]["admission"] = {"clusterQueue": "shared", "evictions": 2}
    o = queued_observe(waiting, status=second, lease_obs=lease(attempt=2), pods=(pod(2),))
    (again,) = [a for a in decide(o).actions if isinstance(a, MarkPodsReady)]
    assert (again.ready, again.reason) == (True, "Recovered")


def _retry_due() -> dict[str, Any]:
    """Attempt 1 lapsed (Stalled) under the Workload's admission, which Kueue keeps; its backoff is over."""
    s = _held_queued()
    s["attempts"][-1].update(outcome="Stalled", endedAt=(T0 - dt.timedelta(seconds=10)).isoformat())
    return {**s, "holder": None, "fence": 2, "phase": "Backoff", "nextAttemptAt": T0.isoformat()}


def test_a_retry_under_the_same_admission_waits_for_the_last_attempts_pod_to_exit() -> None:
    # Seed 43404: a lapsed attempt's pod was still terminating when the retry's pod was created, so
    # the run's one admitted pod was two live pods and the ClusterQueue's quota was exceeded.
    exiting = pod(phase="Running", deleting=True, deletion_due=T0 + dt.timedelta(seconds=20))
    d = decide(queued_observe(ADMITTED, status=_retry_due(), pods=(exiting,)))
    assert not any(isinstance(a, WriteStatus) and a.grants for a in d.actions)
    status = _status(d)
    assert status.phase == Phase.QUEUED and status.holder is None
    assert "job-a1" in _cond(status, "Admitted")[2]
    assert d.requeue_after is not None and d.requeue_after <= 20.0 + 60.0
    # Gone (or given up on: deleted, silent a minute past its grace), the retry starts.
    for after in ((), (replace(exiting, deletion_due=T0 - dt.timedelta(seconds=61)),),
                  (pod(phase="Failed"),)):
        (write,) = [a for a in decide(queued_observe(ADMITTED, status=_retry_due(), pods=after)).actions
                    if isinstance(a, WriteStatus)]
        assert write.grants and write.status.holder == "job-a2"


def test_an_unqueued_retry_does_not_wait_for_the_last_attempts_pod() -> None:
    exiting = pod(phase="Running", deleting=True, deletion_due=T0 + dt.timedelta(seconds=20))
    s = _retry_due()
    s.pop("queue", None)
    write = decide(observe(run(status=s), pods=(exiting,))).actions[0]
    assert isinstance(write, WriteStatus) and write.grants


def test_a_retry_granted_under_a_kept_admission_reads_the_pods_fresh_first() -> None:
    """The pod cache may not list the earlier attempt's pod yet (after a restart, the runs are
    listed before the pods): the grant of a retry under the admission Kueue kept confirms with a
    fresh list that none may still run, as releasing the quota does. A first attempt need not."""
    (retry,) = [a for a in decide(queued_observe(ADMITTED, status=_retry_due())).actions
                if isinstance(a, WriteStatus) and a.grants]
    assert Confirm.PODS_GONE in retry.requires and KueueConfirm.ADMITTED in retry.requires
    (first,) = [a for a in decide(queued_observe(ADMITTED)).actions if isinstance(a, WriteStatus) and a.grants]
    assert KueueConfirm.ADMITTED in first.requires and Confirm.PODS_GONE not in first.requires


def test_a_workload_remade_for_a_changed_time_limit_waits_for_the_earlier_attempts_pod() -> None:
    """Deleting the Workload gives its quota back: not while a lapsed attempt's pod may still run
    (another run would be admitted beside it), and the delete itself reads the pods fresh."""
    labels = {**QUEUE, "kueue.x-k8s.io/max-exec-time-seconds": "120"}
    exiting = pod(phase="Running", deleting=True, deletion_due=T0 + dt.timedelta(seconds=20))
    o = replace(observe(run(labels=labels, status=_retry_due()), pods=(exiting,)), workload=ADMITTED, flavors=SPOT,
                cluster_queue="shared")
    d = decide(o)
    assert not any(isinstance(a, DeleteWorkload) for a in d.actions)
    assert not any(isinstance(a, WriteStatus) and a.grants for a in d.actions)
    assert "once pod job-a1 of an earlier attempt has exited" in _cond(_status(d), "Admitted")[2]
    assert d.requeue_after is not None and d.requeue_after <= 20.0 + 60.0
    (delete,) = [a for a in decide(replace(o, pods=())).actions if isinstance(a, DeleteWorkload)]
    assert Confirm.PODS_GONE in delete.requires


@pytest.mark.parametrize("wl", [EVICTED, ADMITTED], ids=["evicted", "admitted"])
def test_a_suspended_runs_workload_is_deactivated_only_once_no_pod_of_it_may_run(wl: Any) -> None:
    """Seed 61033: a preempted run suspended while its pod was still exiting; deactivating its
    Workload made Kueue give its quota back at once, and the preemptor's pod started beside the
    exiting one (invariant 11). Deactivating, like telling the budget check Retry, waits for the pod
    and reads the pods fresh first."""
    exiting = pod(phase="Running", deleting=True, deletion_due=T0 + dt.timedelta(seconds=20))
    status = {**_retry_due(), "phase": "Queued", "nextAttemptAt": None}
    o = replace(observe(run(spec={"suspend": True}, status=status, labels=QUEUE), pods=(exiting,)), workload=wl,
                flavors=SPOT, cluster_queue="shared", budget_checks=frozenset({"tether-budget"}))
    d = decide(o)
    assert not _active(d) and not any(isinstance(a, ReleaseQuota) for a in d.actions)
    assert d.requeue_after is not None and d.requeue_after <= 20.0 + 60.0
    gone = decide(replace(o, pods=()))
    if wl is EVICTED:  # the eviction's quota goes first, by ReleaseQuota (which reads the pods fresh)
        assert any(isinstance(a, ReleaseQuota) for a in gone.actions)
    else:
        (off,) = _active(gone)
        assert off.active is False and Confirm.PODS_GONE in off.requires
    assert SetWorkloadActive(name="w", active=True, reason=None, resource_version="1").requires == ()
    assert Confirm.PODS_GONE in AnswerBudgetCheck(name="w", check="c", state="Retry", message="m",
                                                  requeue_after_seconds=1, resource_version="1").requires
