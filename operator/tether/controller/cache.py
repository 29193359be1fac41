"""Everything the operator keeps in memory of the cluster, in one object with one forget().

Runs and pods in stores (store.py: the newer-than rules and the indexes, runs by budget and
pods by run); tombstones by run key; Lease observations, tool-claim bookkeeping and progress
holds by run UID (a namesake re-created under the same key starts afresh); namespaces being
deleted. Watch events and the answers to the operator's own reads and writes update it; the
reconciler reads one Snapshot of it per pass. It decides nothing and wakes nothing (wakes.py).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Callable

from tether import protocol
from tether.api import constants as c
from tether.api.models import Phase, WorkerRun
from tether.controller.classes import ClassBook
from tether.controller.decision_state import DecisionState
from tether.controller.leases import LeaseTracker
from tether.controller.stamps import Stamps
from tether.controller.store import Store
from tether.controller.snapshot import Snapshot, foreign_pod, lean_pod, lean_run, pod_observation
from tether.controller.views import BudgetKey, PodView, RunKey, RunView
from tether.core.classes import ClassResolution
from tether.core.observe import ForeignPod, PodRefusal


# The stores' indexes: runs by the budget they draw on, pods by the run name they are labelled for.
BUDGET, RUN = "budget", "run"


@dataclass(frozen=True)
class RunStored:
    """What storing a run's body changed."""

    stored: bool  # the body was newer than the cached one
    new_spec: bool = False  # its generation moved (an error backoff of the old spec no longer applies)
    # The UID of a run it replaced under the same key without a DELETED event (a relist after a
    # watch gap): that run was deleted, and what is kept of it must go, its pods released.
    replaced: str | None = None


@dataclass(frozen=True)
class _Parsed:
    held: dict[str, Any]  # the body the store holds (the same object: nothing replaced it since)
    classes: int  # ClassBook.generation when it was parsed
    run: WorkerRun
    run_class: ClassResolution | None


@dataclass(frozen=True)
class Tombstone:
    """A deleted pod, kept while its bound token may still be accepted."""

    pod_uid: str
    owner_uid: str | None  # its controlling run's UID
    foreign: ForeignPod


class RunCache:
    def __init__(self, now: Callable[[], dt.datetime], mono: Callable[[], float]) -> None:
        self.now, self.mono = now, mono
        self.stamps = Stamps(mono)  # runs by key, pods by (key, name): one order for both (stamps.py)
        self.runs: Store[RunKey] = Store(mono, keep=lean_run, stamps=self.stamps,
                                         indexes={BUDGET: lambda body: RunView(body).budget})
        self.pods: Store[tuple[RunKey, str]] = Store(mono, keep=lean_pod, stamps=self.stamps,
                                                     indexes={RUN: lambda body: PodView(body).run_key})
        self.leases = LeaseTracker()  # keyed by the owning run's UID
        self.classes = ClassBook()  # the WorkerClasses, by name
        # Pods that were deleted, by (run key, name). A namesake's pod can still act for a few
        # seconds after it is gone (see foreign_pod), and a late answer about it must not revive it.
        self.tombstones: dict[tuple[RunKey, str], Tombstone] = {}
        self.decisions = DecisionState()  # the controller's own, apart from the stores; forgotten with the run
        # Run UID -> the run's fence when this operator last deleted its ended attempts' tool claims.
        self.tool_claims_cleared: dict[str, int] = {}
        # Run UID -> the API server's last refusal of one of its attempts' pods (decide ends that attempt).
        self.pod_refusals: dict[str, PodRefusal] = {}
        self.terminating: dict[str, float] = {}  # namespace -> monotonic time it was seen being deleted
        self._overdue_counted: tuple[float | None, tuple[int, int]] = (None, (0, 0))
        # Our last write's answer of each run, parsed, until the next pass takes it (_parse).
        self._parsed: dict[RunKey, _Parsed] = {}

    def budget_runs(self, budget: BudgetKey) -> frozenset[RunKey]:
        """The runs that draw on a budget."""
        return self.runs.by(BUDGET, budget)

    def pods_of(self, key: RunKey) -> dict[str, dict[str, Any]]:
        """The pods labelled for a run's name (its own and a deleted namesake's), by name."""
        return {name: self.pods[(k, name)] for k, name in self.pods.by(RUN, key)}

    def run(self, key: RunKey) -> RunView | None:
        body = self.runs.get(key)
        return RunView(body) if body is not None else None

    # --- runs ------------------------------------------------------------------

    def put_run(self, body: dict[str, Any]) -> RunStored:
        """A run as a watch event brought it: kept unless it is older than what is cached."""
        return self._put_run(body, read=False)

    def read_run(self, body: dict[str, Any]) -> RunStored:
        """A GET's answer: the newest view, even if its fence looks lower than the cached one's."""
        return self._put_run(body, read=True)

    def _put_run(self, body: dict[str, Any], read: bool) -> RunStored:
        new = RunView(body)
        # The watch's echo of our write (or anything newer) ends the parse kept for the pass right
        # after that write: kept longer, it is a second copy of every quiet run (75 MB at 5,000).
        self._parsed.pop(new.key, None)
        cached = self.run(new.key)
        new_spec, replaced = False, None
        if cached is not None:
            if new.resource_version == cached.resource_version:
                return RunStored(False)
            if new.uid == cached.uid and new.fence < cached.fence and not read:
                return RunStored(False)  # older than what our own write returned (the fence never decreases)
            new_spec = new.generation != cached.generation
            if new.uid != cached.uid:
                replaced = cached.uid
                self.decisions.forget_key(new.key)
                self.forget(cached.uid)
            elif cached.suspended and not new.suspended:
                self.decisions.progress_held_at[new.uid] = self.mono()  # resumed: the progress clock starts now
        self.runs.store(new.key, body)
        return RunStored(True, new_spec, replaced)

    def written_run(self, snap: Snapshot, written: dict[str, Any]) -> Snapshot:
        """Our write succeeded against the snapshot, so nothing came between the two: cache the
        answer unless the watch already brought it (or something newer), and decide on from it."""
        run, run_class = self.classes.run_of(written)
        if self.runs.written(snap.key, written, snap.resource_version):
            # The pass that follows a write decides from this resourceVersion: parsed once.
            self._parsed[snap.key] = _Parsed(self.runs[snap.key], self.classes.generation, run, run_class)
        return Snapshot(key=snap.key, body=written, run=run, lease=snap.lease,
                        pods=snap.pods, foreign_pods=snap.foreign_pods, lease_read=snap.lease_read, run_class=run_class)

    def drop_run(self, body: dict[str, Any]) -> None:
        """The run was deleted: forget it and what is kept of it by UID (its pods stay until they go)."""
        gone = RunView(body)
        cached = self.run(gone.key)
        if cached is not None and cached.uid == gone.uid:
            self.runs.remove(gone.key)
            self.decisions.forget_key(gone.key)
            self._parsed.pop(gone.key, None)
        self.forget(gone.uid)

    # --- pods ------------------------------------------------------------------

    def put_pod(self, body: dict[str, Any]) -> bool:
        """A pod labelled for a run; True when it changed what a decision sees of it."""
        pod = PodView(body)
        key = pod.run_key
        assert key is not None
        before = self.pods.store((key, pod.name), body)
        return before is None or pod_observation(before) != pod_observation(body)

    def drop_pod(self, body: dict[str, Any]) -> None:
        """The pod is gone; its name stays taken while its token may still be accepted."""
        pod = PodView(body)
        key = pod.run_key
        assert key is not None
        self.pods.remove((key, pod.name))
        self._bury(key, body)

    def _bury(self, key: RunKey, body: dict[str, Any]) -> None:
        pod, now = PodView(body), self.now()
        for k in [k for k, tomb in self.tombstones.items() if (tomb.foreign.token_dead_at or now) <= now]:
            del self.tombstones[k]
        self.tombstones[(key, pod.name)] = Tombstone(pod.uid, pod.controller_uid, foreign_pod(body, now))

    def pod_written(self, key: RunKey, name: str, body: dict[str, Any] | None) -> None:
        """Our own write's answer updates the cache at once: the next pass must not act on the
        pod as it was (and in a namespace being deleted, no watch event will follow). A late
        answer about a pod the watch already saw deleted never revives it."""
        tomb = self.tombstones.get((key, name))
        if body is not None:
            if tomb is None or tomb.pod_uid != PodView(body).uid:
                self.put_pod(body)
            return
        cached = self.pods.remove((key, name))
        if cached is not None and tomb is None:
            self._bury(key, cached)  # gone: its name stays taken while its token may be accepted

    def pod_read_current(self, body: dict[str, Any], mark: int) -> bool:
        """Whether a pod our own read returned (`mark` taken before it was sent) is still news: the
        watch has neither changed nor removed it since, and it is not a pod already buried."""
        pod = PodView(body)
        key = pod.run_key
        if key is None:
            return False
        tomb = self.tombstones.get((key, pod.name))
        return self.stamps.before((key, pod.name), mark) and (tomb is None or tomb.pod_uid != pod.uid)

    def run_cached_before(self, key: RunKey, mark: int) -> dict[str, Any] | None:
        """The cached run, if it was stored before `mark` (Stamps.mark) was taken."""
        body = self.runs.get(key)
        return body if body is not None and self.stamps.before(key, mark) else None

    def pods_cached_before(self, key: RunKey, mark: int) -> list[dict[str, Any]]:
        return [b for name, b in self.pods_of(key).items() if self.stamps.before((key, name), mark)]

    def pod_uid(self, key: RunKey, name: str) -> str | None:
        cached = self.pods.get((key, name))
        return PodView(cached).uid if cached is not None else None

    def strays(self, key: RunKey) -> list[PodView]:
        """Pods labelled for this run name that another (deleted) run controls and that still need
        Tether: a pod already deleting without Tether's finalizer is the kubelet's business."""
        run = self.run(key)
        uid = run.uid if run is not None else None
        return [p for p in map(PodView, self.pods_of(key).values())
                if p.controller_uid not in (None, uid) and (not p.deleting or p.held_by_tether)]

    # --- by UID ------------------------------------------------------------------

    def forget(self, uid: str) -> None:
        """Everything kept of a run by its UID (the run itself is dropped by drop_run)."""
        self.leases.forget(uid)
        self.tool_claims_cleared.pop(uid, None)
        self.pod_refusals.pop(uid, None)
        self.decisions.forget_uid(uid)

    def forget_key(self, key: RunKey) -> None:
        """Nothing is left under the key (no run, no pods): drop its per-key bookkeeping."""
        if not self.holds(key):
            self.decisions.forget_key(key)

    def holds(self, key: RunKey) -> bool:
        """A run or a pod labelled for it is held under the key."""
        return key in self.runs or bool(self.pods.by(RUN, key))

    # --- reads ---------------------------------------------------------------------

    def snapshot(self, key: RunKey) -> Snapshot | None:
        body = self.runs.get(key)
        if body is None:
            return None
        run, run_class = self._parse(key, body)
        uid = run.metadata.uid
        live = self.pods_of(key)
        mine = {n: b for n, b in live.items() if protocol.controller_uid(b) == uid}
        pods = tuple(p for p in map(pod_observation, mine.values()) if p is not None)
        foreign = tuple(foreign_pod(b) for n, b in live.items() if n not in mine) + tuple(
            tomb.foreign for (k, n), tomb in self.tombstones.items() if k == key and n not in live and tomb.owner_uid != uid)
        return Snapshot(key=key, body=body, run=run, lease=self.leases.get(uid), pods=pods, foreign_pods=foreign,
                        run_class=run_class)

    def _parse(self, key: RunKey, body: dict[str, Any]) -> tuple[WorkerRun, ClassResolution | None]:
        """The run as its decisions read it: the parse of our own write's answer when that is what
        is held (and the classes have not moved since, for a run they still shape), else parsed now."""
        parsed = self._parsed.pop(key, None)
        if parsed is not None and parsed.held is body and (
                parsed.run_class is None or parsed.classes == self.classes.generation):
            return parsed.run, parsed.run_class
        return self.classes.run_of(body)

    def overdue(self, mono: float) -> tuple[int, int]:
        """(overdue, active) leases, counted at most once a second: a scan of every run per lapse
        cost 5% of the operator's CPU at 5,000 runs."""
        at, counts = self._overdue_counted
        if at is not None and 0 <= mono - at < 1.0:
            return counts
        active = overdue = 0
        for run in map(RunView, self.runs.values()):
            holder = run.holder
            if holder is None:
                continue
            active += 1
            lease = self.leases.get(run.uid)
            if lease is not None and lease.holder == holder and mono - lease.last_change >= run.lease_seconds:
                overdue += 1
        self._overdue_counted = (mono, (overdue, active))
        return overdue, active

    # The three below are read by the metrics thread. dict.copy() takes the snapshot in one step;
    # list(d.items()) iterates, and a garbage collection inside it runs Python code (gc callbacks)
    # during which the event loop's thread can change the dict: "changed size during iteration".
    def phase_counts(self) -> dict[tuple[str, str, str], int]:
        """Runs by (namespace, phase, class)."""
        counts: dict[tuple[str, str, str], int] = {}
        for run in map(RunView, self.runs.copy().values()):
            key = (run.namespace, run.phase or Phase.PENDING.value, run.class_name)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def pending_approvals(self) -> dict[tuple[str, str], tuple[int, float | None]]:
        """Gates waiting for a person, by namespace and kind (Start, Result, or Request: a worker's): how many,
        and the earliest requestedAt among them (Unix seconds; None if none parses)."""
        out: dict[tuple[str, str], tuple[int, float | None]] = {}
        for run in map(RunView, self.runs.copy().values()):
            for gate, requested_at in run.pending_gates_since:
                key = (run.namespace, gate if gate in (c.GATE_START, c.GATE_RESULT) else "Request")
                n, oldest = out.get(key, (0, None))
                since = _epoch(requested_at)
                out[key] = (n + 1, since if oldest is None or (since is not None and since < oldest) else oldest)
        return out

    def heartbeat_ages(self) -> list[tuple[str, str, float]]:
        now = self.mono()
        out = []
        for run in map(RunView, self.runs.copy().values()):
            holder = run.holder
            lease = self.leases.get(run.uid)
            if holder and lease is not None and lease.holder == holder:
                out.append((run.namespace, run.name, max(0.0, now - lease.last_change)))
        return out


def _epoch(text: str | None) -> float | None:
    """An API timestamp as Unix seconds; None for none or one that does not parse."""
    try:
        when = protocol.parse_time(text)
    except ValueError:
        return None
    return when.timestamp() if when is not None else None
