"""Queueing through Kueue: a run labelled `kueue.x-k8s.io/queue-name` is a Kueue workload. It starts
no attempt until Kueue admits its Workload, its pod carries what the admission assigned (the
flavor's node labels and tolerations, admission checks' pod-set updates), Kueue hears when its
worker is first alive (PodsReady) and when it ends (Finished, releasing the quota at once).

The attempt records the admission it runs under, named by the Workload's eviction count when it
was granted: the count only grows, so an attempt knows an eviction was its own even when Kueue
has since admitted the Workload again.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Mapping

from tether.api import constants as c
from tether.kueue import api as k
from tether.api.conditions import get_condition, set_condition
from tether.kueue.api import Workload
from tether.api.models import AttemptAdmission, Outcome, Phase, QueueStatus, WorkerRun
from tether.core.classes import class_holds
from tether.core.actions import Confirm, Decision
from tether.core.capability import Rules
from tether.core.cleanup import pods_may_run
from tether.core.enforcement import Stop, admission_refusal
from tether.core.execution import execution_digest, pinned_digest
from tether.core.lifecycle import StatusBuilder
from tether.core.observe import Observed, current_lease
from tether.core.review import start_approved
from tether.kueue.actions import (AnswerBudgetCheck, DeleteWorkload, EnsureWorkload, FinishWorkload, KueueConfirm,
                                  MarkPodsReady, ReleaseQuota, SetPriorityBoost, SetWorkloadActive, UngateWorkload,
                                  WorkloadAction)

# A running queued run's priority boost rises by one each time the work since its last checkpoint
# doubles, starting at this many seconds (priority_boost).
BOOST_SECONDS = 60.0
# The most Tether adds to a Workload's priority: it reorders runs of one priority, never runs whose
# WorkloadPriorityClasses are further apart than this.
MAX_BOOST = 10
# A budget check answered Retry asks Kueue to try again after this long at most (sooner when the
# budget's period rolls over): a raised limit is noticed within it.
BUDGET_RETRY_SECONDS = 15


@dataclass(frozen=True)
class FlavorPlacement:
    """What a Kueue ResourceFlavor asks of the pods admitted to it."""

    node_labels: Mapping[str, str]
    tolerations: tuple[Mapping[str, object], ...] = ()


@dataclass(frozen=True)
class QueueSlice:
    """Kueue's slice of a run's observation (Observed.part): its Workload as last seen (None: none
    seen), whether this operator saw it deleted (not merely not listed yet), the ResourceFlavors
    known by name, and the ClusterQueue its LocalQueue points at (None: unknown)."""

    workload: Workload | None = None
    workload_gone: bool = False
    flavors: Mapping[str, FlavorPlacement] = field(default_factory=dict)
    cluster_queue: str | None = None
    boost_seconds: float = BOOST_SECONDS
    # The AdmissionChecks (by name) whose controller is Tether's budget check.
    budget_checks: frozenset[str] = frozenset()


_NONE = QueueSlice()


def slice_of(o: Observed) -> QueueSlice:
    return o.part(QueueSlice) or _NONE


def queue_name(run: WorkerRun) -> str | None:
    """The run's LocalQueue: the label, until its Workload exists; from then on the one recorded
    (a label edited or removed later moves nothing: the Workload and its quota stay Kueue's)."""
    if run.status.queue is not None:
        return run.status.queue.name
    return run.metadata.labels.get(k.LABEL_QUEUE_NAME) or None


def workload_name(run: WorkerRun) -> str:
    """The run's Workload: named after the run and its UID, so a namesake run gets its own."""
    digest = hashlib.sha256(f"{run.metadata.name}/{run.metadata.uid}".encode()).hexdigest()[:5]
    return f"workerrun-{run.metadata.name}"[:240] + f"-{digest}"


def admitted(wl: Workload) -> bool:
    """Kueue admitted it (quota reserved, every admission check Ready) and has not taken that back."""
    return (wl.is_true(k.WL_QUOTA_RESERVED) and wl.is_true(k.WL_ADMITTED) and wl.status.admission is not None
            and not wl.is_true(k.WL_EVICTED) and not wl.is_true(k.WL_FINISHED) and wl.spec.active is not False)


def kueue_deactivated(wl: Workload) -> str | None:
    """Kueue's own reason when Kueue deactivated the Workload (its requeuing limit, its maximum
    execution time, a rejected admission check: reasons `DeactivatedDueTo...`), else None."""
    for type_ in (k.WL_EVICTED, k.WL_REQUEUED, "DeactivationTarget"):
        cond = wl.condition(type_)
        if cond is not None and (cond.reason.startswith("DeactivatedDueTo") or type_ == "DeactivationTarget"
                                 and cond.status == "True"):
            return f"{cond.reason}: {cond.message or ''}".rstrip(": ")
    return None


def deactivated_by_tether(wl: Workload) -> bool:
    """Inactive because Tether made it so (its annotation), not Kueue nor a person."""
    return wl.spec.active is False and k.ANN_DEACTIVATED in wl.metadata.annotations and kueue_deactivated(wl) is None


def admission_of(wl: Workload, flavors: Mapping[str, FlavorPlacement]) -> AttemptAdmission | None:
    """The admission an attempt starts under: the pod set's flavors, their node labels and
    tolerations, and the admission checks' updates. None while a flavor it names is not known
    yet (its pod would land where Kueue did not account it)."""
    admission = wl.status.admission
    if admission is None:
        return None
    assignment = next((a for a in admission.pod_set_assignments if a.name == k.POD_SET), None)
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, object]] = []
    names = sorted(set(assignment.flavors.values())) if assignment is not None else []
    for name in names:
        flavor = flavors.get(name)
        if flavor is None:
            return None
        node_selector.update(flavor.node_labels)
        tolerations.extend(dict(t) for t in flavor.tolerations)
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    for check in wl.status.admission_checks:
        for update in check.pod_set_updates:
            if update.name == k.POD_SET:
                labels.update(update.labels)
                annotations.update(update.annotations)
                node_selector.update(update.node_selector)
                tolerations.extend(update.tolerations)
    return AttemptAdmission(cluster_queue=admission.cluster_queue,
                            flavors=dict(assignment.flavors) if assignment is not None else {},
                            evictions=wl.evictions, node_selector=node_selector, tolerations=tolerations,
                            labels=labels, annotations=annotations)


def _queued(o: Observed, b: StatusBuilder, d: Decision, message: str) -> None:
    """Phase Queued, Admitted=False (reason Queued) saying where and why it waits; written only
    when that is news (admission, decided before this, may have set Admitted=True meanwhile)."""
    s, gen = b.status, b.generation
    s.queue = QueueStatus(name=queue_name(o.run) or "", workload=workload_name(o.run),
                          cluster_queue=slice_of(o).cluster_queue)
    seen = get_condition(o.run.status.conditions, c.COND_ADMITTED)
    if s.phase == Phase.QUEUED and seen is not None and (seen.status, seen.reason, seen.message) == \
            ("False", c.REASON_QUEUED, message) and s.observed_generation == gen:
        s.conditions = [seen if x.type == c.COND_ADMITTED else x for x in s.conditions]
    else:
        s.conditions = set_condition(s.conditions, c.COND_ADMITTED, "False", c.REASON_QUEUED, message, gen, o.now)
        b.set_phase(Phase.QUEUED, message, reason=c.REASON_QUEUED)
    if b.changed():
        d.actions.append(b.write())


def waiting_message(o: Observed, wl: Workload | None) -> str:
    """Where the run waits (its LocalQueue and the ClusterQueue behind it) and, from Kueue, why."""
    cluster_queue = slice_of(o).cluster_queue
    where = f"LocalQueue {queue_name(o.run)}" + (f" (ClusterQueue {cluster_queue})" if cluster_queue else "")
    if wl is None:
        return f"queued in {where}; its Workload is being created"
    pending = [f"{a.name} is {a.state}" + (f" ({a.message})" if a.message else "")
               for a in wl.status.admission_checks if a.state != "Ready"]
    reserved = wl.condition(k.WL_QUOTA_RESERVED)
    if wl.is_true(k.WL_QUOTA_RESERVED) and pending:
        return f"queued in {where}: quota reserved, waiting for admission checks: {'; '.join(pending)}"
    if reserved is not None and reserved.status == "False" and reserved.message:
        return f"queued in {where}: {reserved.message}"
    return f"queued in {where}"


def holding_gates(o: Observed) -> tuple[str, ...]:
    """Tether's admission gates that hold the run back now: a start review not approved, a budget
    or cap that cannot pay. A Workload made with them reserves no quota until they are removed."""
    return tuple(gate for gate, holds in ((k.GATE_START_REVIEW, not start_approved(o)),
                                          (k.GATE_BUDGET, admission_refusal(o) is not None)) if holds)


def held_back(o: Observed) -> str | None:
    """Why the run, held by nobody, would not start even if Kueue admitted it now (None: it would):
    its Workload must hold no quota meanwhile."""
    run = o.run
    if run.spec.suspend:
        return "the run is suspended"
    if run.status.phase == Phase.AWAITING_REVIEW:
        return "its result waits for a person's review"
    if not start_approved(o):
        return "its start review is not approved"
    held = class_holds(o.run_class)
    if held is not None:
        return held
    pinned = pinned_digest(run.status)
    if pinned is not None and pinned != execution_digest(run.spec):
        return "its execution fields changed since they were approved or ran"
    refusal = admission_refusal(o)
    return refusal[1] if refusal is not None else None


def enter_queue(o: Observed, b: StatusBuilder, d: Decision) -> bool:
    """A queued run takes its place in the queue before anything else may hold it back: its
    Workload is made first, gated by whatever holds the run now (a person, money)."""
    if queue_name(o.run) is None or slice_of(o).workload is not None:
        return True
    gates = holding_gates(o)
    why = held_back(o) if not gates and o.approvals is not None else None
    d.actions.append(EnsureWorkload(name=workload_name(o.run), gates=gates, inactive_reason=why))
    _queued(o, b, d, waiting_message(o, None))
    return False


def _busy(o: Observed) -> list[str]:
    """The run's pods that may still run on its quota (PodObservation.may_still_run)."""
    return [p.name for p in o.pods if p.may_still_run(o.now)]


def queue_allows(o: Observed, b: StatusBuilder, d: Decision) -> bool:
    """Before a grant: a queued run starts only once Kueue admitted its Workload (enter_queue made
    it), and records the admission the attempt will run under."""
    if queue_name(o.run) is None:
        return True
    wl = slice_of(o).workload
    if wl is None:
        return False
    if evicted_and_reserved(wl):
        busy = _busy(o)
        evicted = wl.condition(k.WL_EVICTED)
        _queued(o, b, d, f"evicted by Kueue ({evicted.reason if evicted else 'Evicted'}); "
                         + (f"waiting for pod {', '.join(busy)} to go" if busy else "releasing its quota"))
        return False  # tell_kueue releases it
    changed = ("the spec" if wl.metadata.annotations.get(k.ANN_EXECUTION_DIGEST) != execution_digest(o.run.spec)
               else f"label {k.LABEL_MAX_EXEC_TIME}"
               if wl.spec.maximum_execution_time_seconds != k.max_exec_seconds(o.run.metadata.labels) else None)
    if changed is not None:
        # Edited while queued: Kueue's admission (and quota) would be for another pod than the one
        # the grant makes, or under another time limit (a new one starts counting afresh, as for a
        # Job). Made again from the run (Kueue's job framework does the same), once no pod of an
        # earlier attempt may still run on the quota that deleting it gives back.
        if pods_may_run(o, d):
            _queued(o, b, d, f"queued in LocalQueue {queue_name(o.run)}: {changed} changed; its Workload is made "
                             f"again once pod {', '.join(_busy(o))} of an earlier attempt has exited")
            return False
        d.actions.append(DeleteWorkload(name=wl.metadata.name, uid=wl.metadata.uid))
        _queued(o, b, d, f"queued in LocalQueue {queue_name(o.run)}: {changed} changed; its Workload is made again")
        return False
    if wl.spec.active is False and not deactivated_by_tether(wl):
        why = kueue_deactivated(wl)
        _queued(o, b, d, f"queued in LocalQueue {queue_name(o.run)}: its Workload {wl.metadata.name} is deactivated "
                         + (f"by Kueue ({why})" if why else "(spec.active is false)")
                         + "; Kueue admits it again only once spec.active is true")
        return False
    admission = admission_of(wl, slice_of(o).flavors) if admitted(wl) else None
    if admission is None:
        if admitted(wl):
            d.wake(5.0)  # a flavor read failed or is not made yet: look again
        _queued(o, b, d, waiting_message(o, wl) if not admitted(wl) else
                f"admitted by ClusterQueue {wl.status.admission.cluster_queue if wl.status.admission else ''}; "
                "waiting to read its ResourceFlavors")
        return False
    if pods_may_run(o, d):
        # Kueue admitted one pod, and keeps that admission across a retry: an earlier attempt's pod
        # that may still run (a lapsed or revoked one in its grace period) holds it until it exits.
        # (The grant's confirmation reads the pods fresh too: the cache may not list them yet.)
        _queued(o, b, d, f"admitted by ClusterQueue {admission.cluster_queue}; waiting for pod "
                         f"{', '.join(_busy(o))} of an earlier attempt to exit (the admission is for one pod)")
        return False
    b.admission = admission
    # The grant rests on a fresh read of the Workload; a retry's also on none of the earlier
    # attempts' pods still running (Kueue keeps its admission, for one pod, across retries).
    b.rests_on = (KueueConfirm.ADMITTED, Confirm.PODS_GONE) if o.run.status.attempt >= 1 else (KueueConfirm.ADMITTED,)
    last = o.run.status.current()
    since = last.ended_at if last is not None else o.run.metadata.creation_timestamp
    if since is not None:
        b.note(queued_seconds=round(max(0.0, (o.now - since).total_seconds()), 3))
    b.status.queue = QueueStatus(name=queue_name(o.run) or "", workload=wl.metadata.name,
                                 cluster_queue=admission.cluster_queue)
    b.status.conditions = set_condition(b.status.conditions, c.COND_ADMITTED, "True", c.REASON_ADMITTED,
                                        f"admitted by ClusterQueue {admission.cluster_queue}", b.generation, o.now)
    return True


def evicted_and_reserved(wl: Workload) -> bool:
    return wl.is_true(k.WL_EVICTED) and wl.is_true(k.WL_QUOTA_RESERVED)


def tell_kueue(o: Observed, d: Decision) -> None:
    """What Kueue hears of a queued run, on every pass whatever its phase (backoff, suspended,
    waiting for a person): one write per pass, each conditional on the Workload as seen."""
    wl = slice_of(o).workload
    if wl is None or wl.is_true(k.WL_FINISHED) or any(isinstance(a, DeleteWorkload) for a in d.actions):
        return
    write = _workload_write(o, wl, d)
    if write is not None:
        d.actions.append(write)
    phase = o.run.status.phase
    if not isinstance(write, (FinishWorkload, ReleaseQuota)) and not (phase is not None and phase.terminal):
        _keep_boost(o, wl, d, write is None)


def _workload_write(o: Observed, wl: Workload, d: Decision) -> WorkloadAction | None:
    """The run's end (Finished); that an evicted attempt is over (the quota released: the
    preemptor waits for it); its worker's first renewal (PodsReady); gates that no longer hold;
    Tether's budget check answered."""
    s, rv = o.run.status, wl.metadata.resource_version
    # As Kueue's own integrations do, the quota goes only once the job has nothing active: no pod
    # of the run may still run (a revoked one in its grace period, a succeeded one exiting).
    if s.phase is not None and s.phase.terminal:
        if pods_may_run(o, d):
            return None
        return FinishWorkload(name=wl.metadata.name, succeeded=s.phase == Phase.SUCCEEDED,
                              message=f"the run ended {s.phase.value}", resource_version=rv)
    if evicted_and_reserved(wl) and s.holder is None and not pods_may_run(o, d):
        # The evicted attempt is over: the fence has moved and its pod is gone.
        return ReleaseQuota(name=wl.metadata.name, resource_version=rv)
    ready = pods_ready(o, wl)
    if ready is not None:
        return ready
    ours = (k.GATE_START_REVIEW, k.GATE_BUDGET)
    holding = holding_gates(o)
    if any(g in ours and g not in holding for g in wl.gates):
        return UngateWorkload(name=wl.metadata.name, keep=tuple(g for g in wl.gates if g not in ours or g in holding),
                              resource_version=rv)
    answer = _budget_answer(o, wl) or _activation(o, wl)
    # Deactivating a Workload that holds quota, or telling its budget check Retry, gives the quota
    # back: not while a pod of the run may still run on it (a lapsed or evicted one in its grace
    # period; the action's confirmation reads the pods fresh too).
    if answer is not None and answer.gives_quota_back and wl.is_true(k.WL_QUOTA_RESERVED) and pods_may_run(o, d):
        return None
    return answer


def pods_ready(o: Observed, wl: Workload) -> MarkPodsReady | None:
    """PodsReady as Kueue's job framework keeps it: True once the attempt's worker renewed
    (Recovered if it was lost before), False while an admitted run's next attempt is awaited
    (WaitForRecovery: Kueue's recoveryTimeout bounds a run that keeps failing under its quota)."""
    s, rv, name = o.run.status, wl.metadata.resource_version, wl.metadata.name
    cur = s.current()
    up = s.holder is not None and cur is not None and cur.admission is not None and s.phase == Phase.RUNNING
    cond = wl.condition(k.WL_PODS_READY)
    if up and not wl.is_true(k.WL_PODS_READY):
        recovering = cond is not None and cond.reason in (k.PODS_WAIT_FOR_RECOVERY, k.PODS_RECOVERED)
        return MarkPodsReady(name=name, message=f"{s.holder} renewed its lease", resource_version=rv,
                             reason=k.PODS_RECOVERED if recovering else k.PODS_STARTED)
    if not up and wl.is_true(k.WL_PODS_READY) and admitted(wl) and cur is not None and cur.outcome is not None:
        return MarkPodsReady(name=name, message=f"attempt {cur.attempt} ended ({cur.outcome.value}); waiting for "
                                                "the next attempt's worker", resource_version=rv,
                             ready=False, reason=k.PODS_WAIT_FOR_RECOVERY)
    return None


def _activation(o: Observed, wl: Workload) -> SetWorkloadActive | None:
    """A Workload whose run nobody holds and that would not start if admitted is deactivated, so it
    neither holds quota nor makes Kueue preempt for it (a gate, set only at creation, holds it
    otherwise); activated again once nothing holds the run back, if Tether deactivated it."""
    if o.run.status.holder is not None or o.approvals is None:
        return None  # (approvals not listed: whether a person approved is unknown this pass)
    why, rv = held_back(o), wl.metadata.resource_version
    if why is not None and not wl.gates and wl.spec.active is not False:
        # A budget check not yet told Retry is told first (it says why, on Kueue's side).
        return SetWorkloadActive(name=wl.metadata.name, active=False, reason=why, resource_version=rv)
    if why is None and deactivated_by_tether(wl):
        return SetWorkloadActive(name=wl.metadata.name, active=True, reason=None, resource_version=rv)
    if wl.spec.active is not False and k.ANN_DEACTIVATED in wl.metadata.annotations:
        # Someone activated it meanwhile: the annotation no longer says it is Tether's to activate.
        return SetWorkloadActive(name=wl.metadata.name, active=True, reason=None, resource_version=rv)
    return None


def _budget_answer(o: Observed, wl: Workload) -> AnswerBudgetCheck | None:
    """Tether's budget check on a Workload holding quota: Ready if the run's budget and caps can
    pay, else Retry (Kueue frees the quota; the next pass deactivates the Workload until they can).
    A run already held (a check added to its ClusterQueue while it runs) is told Ready: its
    money was judged at its grant."""
    if not wl.is_true(k.WL_QUOTA_RESERVED) or wl.is_true(k.WL_EVICTED):
        return None
    for check in wl.status.admission_checks:
        if check.name not in slice_of(o).budget_checks:
            continue
        # Whatever holds the run back (money, a person, a suspension) would waste what Kueue reserved.
        why = held_back(o) if o.run.status.holder is None and o.approvals is not None else None
        if why is None:
            state, message, after = "Ready", "the run's budget and caps can pay for it", None
        else:
            reset = o.budget.next_reset_seconds if o.budget is not None else None
            after = max(1, math.ceil(min(BUDGET_RETRY_SECONDS, reset if reset is not None else math.inf)))
            state, message = "Retry", why
        if check.state != state:
            return AnswerBudgetCheck(name=wl.metadata.name, check=check.name, state=state, message=message,
                                     requeue_after_seconds=after, resource_version=wl.metadata.resource_version)
    return None


def priority_boost(at_risk: float, unit: float) -> int:
    """One more each time the work at risk doubles, from `unit` seconds on (0 below it), at most
    MAX_BOOST: ordered by the work a preemption would lose, in few writes, and bounded."""
    if at_risk < unit or unit <= 0:
        return 0
    return min(MAX_BOOST, int(math.log2(1 + at_risk / unit)))


def work_at_risk(o: Observed, wl: Workload) -> float | None:
    """Seconds of work the running attempt would lose if evicted now: since its last checkpoint
    (as this operator saw it change, or as the status recorded it), or since its start if later.
    None when it is not running under an admission (no boost then)."""
    s, lease = o.run.status, current_lease(o)
    cur = s.current()
    if lease is None or cur is None or cur.admission is None or s.phase != Phase.RUNNING or not admitted(wl):
        return None
    at_risk = o.mono - lease.checkpoint_changed
    folded = s.checkpoint
    if folded is not None and folded.time is not None and folded.cursor == lease.checkpoint:
        # Folded into the status after it was made: a bound that outlives an operator restart
        # (whose monotonic clock first saw the checkpoint just now).
        at_risk = max(at_risk, (o.now - folded.time).total_seconds())
    if cur.started_at is not None:
        at_risk = min(at_risk, (o.now - cur.started_at).total_seconds())
    return max(0.0, at_risk)


def _keep_boost(o: Observed, wl: Workload, d: Decision, may_write: bool) -> None:
    """The boost, and a wake when it next steps up; written only when no other write is due this
    pass (they are all conditional on the same resourceVersion)."""
    at_risk = work_at_risk(o, wl)
    boost = priority_boost(at_risk, slice_of(o).boost_seconds) if at_risk is not None else 0
    if at_risk is not None and boost < MAX_BOOST and slice_of(o).boost_seconds > 0:
        d.wake(max(0.05, slice_of(o).boost_seconds * (2 ** (boost + 1) - 1) - at_risk + 0.01))
    want = str(boost) if boost else None
    if may_write and wl.metadata.annotations.get(k.ANN_PRIORITY_BOOST) != want:
        d.actions.append(SetPriorityBoost(name=wl.metadata.name, boost=boost or None,
                                          resource_version=wl.metadata.resource_version))


def eviction(o: Observed) -> Stop | None:
    """Kueue took back the admission the held attempt runs under: evicted now, or evicted since
    the grant (the Workload's eviction count moved past the one the attempt records), or no
    quota reserved any more. A Workload not seen at all says nothing (a cache that has not
    listed it yet, after a restart): the attempt goes on; one seen deleted ends its admission."""
    s, wl = o.run.status, slice_of(o).workload
    cur = s.current()
    if s.holder is None or cur is None or cur.admission is None:
        return None
    if wl is None:
        # Seen deleted (a person, or a namespace's cleanup): its quota is free, so nothing may run.
        return Stop(Outcome.PREEMPTED, "its Kueue Workload was deleted", eviction="WorkloadDeleted") \
            if slice_of(o).workload_gone else None
    evicted = wl.condition(k.WL_EVICTED)
    if evicted is not None and evicted.status == "True":
        return Stop(Outcome.PREEMPTED, f"evicted by Kueue ({evicted.reason}): {evicted.message or ''}".rstrip(": "),
                    eviction=evicted.reason)
    if wl.evictions > cur.admission.evictions or not wl.is_true(k.WL_QUOTA_RESERVED):
        return Stop(Outcome.PREEMPTED, "evicted by Kueue: the admission it started under ended", eviction="Evicted")
    return None


def finish_deleted(o: Observed, d: Decision) -> bool:
    """A deleted run's Workload (the run's own) and its quota would go with the run: it is told
    Finished first, once no pod runs, confirmed by a fresh list (a cache after a restart may not
    hold the pods yet). True while that holds the run's finalizer."""
    wl = slice_of(o).workload
    if wl is None or not wl.is_true(k.WL_QUOTA_RESERVED) or wl.is_true(k.WL_FINISHED):
        return False
    if not pods_may_run(o, d):
        d.actions.append(FinishWorkload(name=wl.metadata.name, succeeded=o.run.status.phase == Phase.SUCCEEDED,
                                        message="the WorkerRun was deleted",
                                        resource_version=wl.metadata.resource_version))
    return True


class KueueRules(Rules):
    """Queueing's say in the decision: a queued run takes its place in line first and starts only
    under Kueue's admission; an eviction stops the held attempt; Kueue hears of every pass; a
    deleted run's Workload is finished before the run goes."""

    name = "kueue"

    def enter(self, o: Observed, b: StatusBuilder, d: Decision) -> bool:
        return enter_queue(o, b, d)

    def admit(self, o: Observed, b: StatusBuilder, d: Decision) -> bool:
        return queue_allows(o, b, d)

    def stop(self, o: Observed) -> Stop | None:
        return eviction(o)

    def after(self, o: Observed, d: Decision) -> None:
        tell_kueue(o, d)

    def deleting(self, o: Observed, d: Decision) -> bool:
        return finish_deleted(o, d)


RULES = KueueRules()
