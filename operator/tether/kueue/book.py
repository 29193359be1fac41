"""The operator's view of Kueue: the Workloads of queued runs (by the run that controls them), the
ResourceFlavors their admissions name (read at each grant), and the LocalQueues' ClusterQueues; and the writes a job
controller makes on its Workloads (create, PodsReady, quota release, Finished; delete to remake), each conditional.

Fed by watches (kopf handlers); a grant rests on a fresh read of the Workload (`confirm_admitted`),
for a cached admission may be one Kueue has taken back since.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any, Awaitable, Callable

from pydantic import ValidationError

from tether.api.models import WorkerRun
from tether.controller.errors import Again, NotLeader, SpecError
from tether.controller.snapshot import Snapshot
from tether.controller.store import Store
from tether.controller.views import RunKey
from tether.core.execution import execution_digest
from tether.kube.client import ApiError, Conflict, KubeClient, NotFound
from tether.kube.paths import object_path
from tether.kueue import api as k
from tether.kueue import workloads
from tether.kueue.actions import (AnswerBudgetCheck, DeleteWorkload, EnsureWorkload, FinishWorkload, MarkPodsReady,
                                  ReleaseQuota, SetPriorityBoost, SetWorkloadActive, UngateWorkload)
from tether.kueue.api import ResourceFlavor, Workload
from tether.kueue.decide import BOOST_SECONDS, FlavorPlacement, QueueSlice, admitted, queue_name, workload_name

log = logging.getLogger("tether.queues")



def workload_path(ns: str, name: str = "") -> str:
    return object_path(k.KUEUE_API_VERSION, k.WORKLOAD_PLURAL, ns, name)


class QueueBook:
    def __init__(self, kube: KubeClient, now: Callable[[], dt.datetime], boost_seconds: float = BOOST_SECONDS) -> None:
        self.kube, self.now, self.boost_seconds = kube, now, boost_seconds
        self.workloads: Store[tuple[str, str]] = Store(time.monotonic)  # by (namespace, Workload name)
        self.deleted: set[tuple[str, str]] = set()  # Workloads seen deleted (and not made again since)
        self.local_queues: dict[tuple[str, str], str] = {}  # (namespace, LocalQueue) -> ClusterQueue
        self.budget_checks: frozenset[str] = frozenset()  # AdmissionChecks of Tether's budget controller
        self.unmarked: dict[str, int] = {}  # those not seen Active yet, by name -> generation

    # --- watch events ----------------------------------------------------------------

    def on_workload(self, event_type: str | None, body: dict[str, Any]) -> RunKey | None:
        """Caches a run's Workload by its name (which names the run's UID: a namesake's never takes
        its place); returns the run it concerns (None: not a run's)."""
        meta = body.get("metadata") or {}
        owner = next((r for r in meta.get("ownerReferences") or []
                      if r.get("kind") == "WorkerRun" and r.get("controller")), None)
        if owner is None:
            return None
        key = (meta["namespace"], meta["name"])
        current = self.workloads.get(key)
        if event_type == "DELETED":
            if current is None or current["metadata"].get("uid") == meta.get("uid"):
                self.workloads.remove(key)
                self.deleted.add(key)
        elif self.workloads.put(key, body):
            self.deleted.discard(key)
        return (meta["namespace"], owner["name"])

    def on_local_queue(self, event_type: str | None, body: dict[str, Any]) -> None:
        meta, spec = body.get("metadata") or {}, body.get("spec") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if event_type == "DELETED":
            self.local_queues.pop(key, None)
        elif spec.get("clusterQueue"):
            self.local_queues[key] = str(spec["clusterQueue"])

    def on_admission_check(self, event_type: str | None, body: dict[str, Any]) -> tuple[str, bool]:
        """Tracks the AdmissionChecks Tether answers (controllerName tether.dev/budget) and those
        not Active yet (a ClusterQueue listing an inactive check admits nothing: `mark_active`).
        Returns the check's name, and whether the set of Tether's checks changed (queued runs may
        have a check to answer)."""
        meta, spec = body.get("metadata") or {}, body.get("spec") or {}
        name = str(meta.get("name", ""))
        ours = event_type != "DELETED" and spec.get("controllerName") == k.BUDGET_CHECK_CONTROLLER
        before = self.budget_checks
        self.budget_checks = before | {name} if ours else before - {name}
        conditions = (body.get("status") or {}).get("conditions") or []
        if ours and not any(c.get("type") == k.AC_ACTIVE and c.get("status") == "True" for c in conditions):
            self.unmarked[name] = int(meta.get("generation") or 1)
        else:
            self.unmarked.pop(name, None)
        return name, self.budget_checks != before

    async def mark_active(self, name: str) -> None:
        """Marks one of Tether's checks Active (if it still is not); a refusal is raised (the
        check's reconciler tries again)."""
        generation = self.unmarked.get(name)
        if generation is None:
            return
        try:
            await self.kube.apply_status(object_path(k.KUEUE_API_VERSION, "admissionchecks", None, name),
                                         k.KUEUE_API_VERSION, "AdmissionCheck", {"name": name},
                                         workloads.check_active_status(generation, self.now()),
                                         k.BUDGET_CHECK_CONTROLLER)
        except (ApiError, NotLeader) as exc:
            log.warning("admission check not marked active", extra={"event": "admission_check_unmarked",
                                                                    "check": name, "error": repr(exc)})
            raise
        if self.unmarked.get(name) == generation:
            self.unmarked.pop(name, None)

    # --- what a decision sees ------------------------------------------------------------

    async def observe(self, run: WorkerRun) -> QueueSlice | None:
        """The run's own Workload (by UID: a namesake's is not its), its LocalQueue's ClusterQueue,
        and, when it is admitted and nobody holds the run, the ResourceFlavors the admission names,
        read fresh: they place the pod the grant makes (they are cluster-scoped and rarely read, so
        they are not watched)."""
        queue = queue_name(run)
        if queue is None:
            return None
        ns = run.metadata.namespace
        key = (ns, workload_name(run))
        body = self.workloads.get(key)
        wl = _parse(body) if body is not None else None
        if wl is not None and not wl.owned_by(run.metadata.uid):
            wl = None
        if (ns, queue) not in self.local_queues:
            lq = await self._read(object_path(k.KUEUE_API_VERSION, "localqueues", ns, queue))
            if lq is not None:
                self.on_local_queue("MODIFIED", lq)
        flavors: dict[str, FlavorPlacement] = {}
        if wl is not None and run.status.holder is None and admitted(wl) and wl.status.admission is not None:
            for a in wl.status.admission.pod_set_assignments:
                for name in set(a.flavors.values()):
                    read = await self._read(object_path(k.KUEUE_API_VERSION, "resourceflavors", None, name))
                    flavor = _flavor(read) if read is not None else None
                    if flavor is not None:
                        flavors[name] = flavor
        return QueueSlice(workload=wl, workload_gone=body is None and key in self.deleted, flavors=flavors,
                          cluster_queue=self.local_queues.get((ns, queue)), boost_seconds=self.boost_seconds,
                          budget_checks=self.budget_checks)

    async def _read(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.kube.get_object(path)
        except ApiError as exc:
            log.warning("kueue object not read", extra={"event": "kueue_read_failed", "path": path,
                                                        "status": exc.status})
            return None

    # --- writes --------------------------------------------------------------------------

    async def ensure_workload(self, snap: Snapshot, action: EnsureWorkload) -> dict[str, Any]:
        run = snap.run
        priority = await self._priority(run)
        body = workloads.workload_body(run, action.name, queue_name(run) or "", priority, execution_digest(run.spec),
                                       action.gates, action.inactive_reason)
        key = (run.metadata.namespace, action.name)
        mark = self.workloads.stamps.mark()
        try:
            created = await self.kube.create(workload_path(run.metadata.namespace), body)
        except Conflict:
            mark = self.workloads.stamps.mark()
            created = await self.kube.get_object(workload_path(run.metadata.namespace, action.name)) or {}
        if created:
            self._answered(key, created, mark)
            log.info("workload created", extra={"run": run.key, "event": "workload_created", "workload": action.name})
        return created

    async def _priority(self, run: WorkerRun) -> tuple[str, int] | None:
        """The WorkloadPriorityClass the run names and its value, as the job framework sets both."""
        name = run.metadata.labels.get(k.LABEL_PRIORITY_CLASS)
        if not name:
            return None
        wpc = await self.kube.get_object(object_path(k.KUEUE_API_VERSION, "workloadpriorityclasses", None, name))
        if wpc is None:
            raise SpecError("WorkloadPriorityClassNotFound",
                            NotFound(404, f"WorkloadPriorityClass {name} not found", "get workloadpriorityclass"))
        return name, int(wpc.get("value") or 0)

    async def mark_pods_ready(self, snap: Snapshot, action: MarkPodsReady) -> None:
        await self._status(snap, action.name, action.resource_version, f"{k.JOB_CONTROLLER_MANAGER}-{k.WL_PODS_READY}",
                           lambda wl: workloads.pods_ready_status(wl, action.ready, action.reason, action.message,
                                                                  self.now()))

    async def release_quota(self, snap: Snapshot, action: ReleaseQuota) -> None:
        written = await self._status(snap, action.name, action.resource_version, k.ADMISSION_MANAGER,
                                     lambda wl: workloads.released_status(wl, self.now()))
        if written is not None:
            # As the job framework says while a Workload is not admitted: the next attempt's
            # worker is awaited afresh (waitForPodsReady applies to it too).
            await self._status(snap, action.name, written["metadata"]["resourceVersion"],
                               f"{k.JOB_CONTROLLER_MANAGER}-{k.WL_PODS_READY}",
                               lambda wl: workloads.pods_ready_status(wl, False, k.PODS_WAIT_FOR_START,
                                                                      "waiting for the next attempt's worker",
                                                                      self.now()))
        log.info("workload quota released", extra={"run": snap.run.key, "event": "workload_released",
                                                   "workload": action.name})

    async def finish_workload(self, snap: Snapshot, action: FinishWorkload) -> None:
        await self._status(snap, action.name, action.resource_version, k.ADMISSION_MANAGER,
                           lambda wl: workloads.finished_status(wl, action.succeeded, action.message, self.now()))

    async def set_priority_boost(self, snap: Snapshot, action: SetPriorityBoost) -> None:
        ns = snap.run.metadata.namespace
        value = str(action.boost) if action.boost is not None else None
        await self._conditional(snap, action.name, action.resource_version, lambda _: self._annotate(
            ns, action.name, k.ANN_PRIORITY_BOOST, value, action.resource_version))

    async def ungate(self, snap: Snapshot, action: UngateWorkload) -> None:
        ns = snap.run.metadata.namespace
        value = ",".join(action.keep) or None
        await self._conditional(snap, action.name, action.resource_version, lambda _: self._annotate(
            ns, action.name, k.ANN_ADMISSION_GATED_BY, value, action.resource_version))
        log.info("workload ungated", extra={"run": snap.run.key, "event": "workload_ungated", "workload": action.name})

    async def set_active(self, snap: Snapshot, action: SetWorkloadActive) -> None:
        ns = snap.run.metadata.namespace
        await self._conditional(snap, action.name, action.resource_version, lambda _: self.kube.merge_patch(
            workload_path(ns, action.name), workloads.activation_patch(action.active, action.reason,
                                                                       action.resource_version),
            f"patch workload {ns}/{action.name}"))
        log.info("workload activated" if action.active else "workload deactivated",
                 extra={"run": snap.run.key, "event": "workload_active" if action.active else "workload_inactive",
                        "workload": action.name, "reason": action.reason})

    async def answer_budget_check(self, snap: Snapshot, action: AnswerBudgetCheck) -> None:
        await self._status(snap, action.name, action.resource_version, k.BUDGET_CHECK_CONTROLLER,
                           lambda _: workloads.budget_check_status(action.check, action.state, action.message,
                                                                   action.requeue_after_seconds, self.now()))
        log.info("budget check answered", extra={"run": snap.run.key, "event": "budget_check", "state": action.state,
                                                 "workload": action.name, "check": action.check})

    async def delete_workload(self, snap: Snapshot, action: DeleteWorkload) -> None:
        await self.kube.delete_object(workload_path(snap.run.metadata.namespace, action.name), action.uid)
        log.info("workload deleted to be made again", extra={"run": snap.run.key, "event": "workload_remade",
                                                             "workload": action.name})

    async def _status(self, snap: Snapshot, name: str, resource_version: str, manager: str,
                      status: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any] | None:
        """A status apply built from the Workload as decided on."""
        ns = snap.run.metadata.namespace
        return await self._conditional(snap, name, resource_version, lambda current: self.kube.apply_status(
            workload_path(ns, name), k.KUEUE_API_VERSION, "Workload",
            {"name": name, "namespace": ns, "resourceVersion": resource_version}, status(current), manager))

    async def _annotate(self, ns: str, name: str, key: str, value: str | None,
                        resource_version: str) -> dict[str, Any]:
        """Sets (None: removes) one annotation of a Workload, conditional on `resource_version`."""
        return await self.kube.merge_patch(workload_path(ns, name), {"metadata": {
            "resourceVersion": resource_version, "annotations": {key: value}}}, f"annotate workload {ns}/{name}")

    async def _conditional(self, snap: Snapshot, name: str, resource_version: str,
                           write: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> dict[str, Any] | None:
        """A write to the Workload as decided on, conditional on it (its resourceVersion): one the
        cache has moved past since is decided again, never applied to what Kueue wrote meanwhile
        (a new admission)."""
        ns = snap.run.metadata.namespace
        current = self.workloads.get((ns, name))
        if current is None:
            return None
        if current["metadata"]["resourceVersion"] != resource_version:
            raise Again(f"workload {ns}/{name} moved since the decision")
        try:
            written = await write(current)
        except Conflict:
            mark = self.workloads.stamps.mark()
            self._answered((ns, name), await self.kube.get_object(workload_path(ns, name)), mark)
            raise Again(f"workload {ns}/{name} moved") from None
        except NotFound:
            return None
        self.workloads.written((ns, name), written, resource_version)
        return written

    def _answered(self, key: tuple[str, str], body: dict[str, Any] | None, mark: int) -> None:
        """The answer to our own read (`mark` taken before it was sent; None: 404): a fact of that
        moment, which neither overwrites nor revives what the watch brought or removed since."""
        if self.workloads.read(key, body, mark):
            if body is None:
                self.deleted.add(key)
            else:
                self.deleted.discard(key)

    async def confirm_admitted(self, snap: Snapshot, evictions: int) -> bool:
        """A fresh read: the run's Workload is admitted now, with no eviction since the one the
        grant records (the count only grows)."""
        name = workload_name(snap.run)
        mark = self.workloads.stamps.mark()
        try:
            fresh = await self.kube.get_object(workload_path(snap.run.metadata.namespace, name))
        except ApiError:
            return False
        self._answered((snap.run.metadata.namespace, name), fresh, mark)
        if fresh is None:
            return False
        wl = _parse(fresh)
        return wl is not None and wl.owned_by(snap.uid) and admitted(wl) and wl.evictions == evictions


def _parse(body: dict[str, Any]) -> Workload | None:
    try:
        return Workload.model_validate(body)
    except ValidationError:
        log.warning("unreadable Workload ignored", extra={"event": "workload_unreadable",
                                                          "workload": (body.get("metadata") or {}).get("name")})
        return None


def _flavor(body: dict[str, Any]) -> FlavorPlacement | None:
    try:
        flavor = ResourceFlavor.model_validate(body)
    except ValidationError:
        log.warning("unreadable ResourceFlavor ignored", extra={"event": "flavor_unreadable"})
        return None
    return FlavorPlacement(node_labels=dict(flavor.spec.node_labels), tolerations=tuple(flavor.spec.tolerations))
