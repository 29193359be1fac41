"""The fault trials' oracle: Tether's safety promise judged from the API server's audit log and
the final objects, never from Tether's logs or the status it claims.

Fourteen invariants (`INVARIANTS`), checked by `judge()` over one namespace:

1. No write by a worker is accepted after its fence was superseded. Who held which fence, and
   when that ended, is rebuilt from the accepted WorkerRun status writes (the operator's
   compare-and-swaps and the workers' fenced patches, in commit order); every accepted Lease
   update or status patch made with a pod-bound token is then checked against the tenure of
   the pod it names.
2. No accepted result or error is later erased or replaced: once a worker's fenced patch
   published one, every later version of the run keeps it (an error may move into its
   attempt's record when a retry follows, as the operator documents; a result under review that a
   person denied is cleared, and one nobody reviewed in time ends the run Rejected), a run with a
   result is never granted to another worker (the work would run twice), and a terminal phase
   stays what it was.
3. At most one pod per attempt, ever: accepted pod creations, per run incarnation and name.
4. Every budget's charges equal the final usage of every attempt that named it, to the cent,
   no run charged twice: the budget's marks never shrink, its `spent` moves by exactly the
   marks' growth, a finished run's mark equals its recorded usage, and each attempt's
   recorded usage equals the last usage its worker reported in an accepted renewal. Every cent
   once however long the history: a run's attempts are every attempt record any accepted write
   showed (the operator keeps only the last few in status.attempts: --attempt-history), and an
   ended run's status.usage is what they recorded in all.
5. Nothing is stuck: every run that still exists is terminal, suspended on request, waiting
   `Queued` for a Kueue Workload that is not admitted, or held by a holder whose Lease was
   renewed while the harness watched; no deleted run lingers. (An attempt Kueue evicted ends
   `Preempted`; invariant 6 counts it as no loss: only `LeaseLost` is one.)
6. No worker the harness never faulted is declared lost (an attempt ending `LeaseLost`).
7. A result under review (spec.review.result) is accepted or denied only as a person decided:
   every operator write that ends such a run Succeeded follows (in commit order) an accepted
   WorkerRunApproval approving that attempt's Result gate, with no accepted denial of it before;
   every write that marks an attempt ResultRejected follows an accepted denial of its gate; and
   every accepted approval names the user who created it. An approval decides an attempt's gate
   when it names that attempt (never by time); and it is the run's when it names the run's UID,
   or its name and was created after the run.
8. No attempt ends `Stalled` while its run is suspended or a request of that attempt waits for
   a person (the progress clock stops then): the operator's write that ends an attempt Stalled
   is a compare-and-swap on the whole object, so the spec it stored is the spec the operator
   decided on; it must not say `suspend`, the run's status before it must show no pending
   request of that attempt, and the write itself must withdraw none.
9. With leader election, no operator replica writes outside its leadership. The replicas share
   one identity, so the audit log tells them apart by the User-Agent the harness's API proxy
   stamps (audit.ProxyStamp: which process, and when the proxy received the request, so a
   request a fault held up is judged by when it was sent). A replica leads from its accepted
   acquisition of the leader Lease until its last accepted renewal plus the renew deadline (the
   elector counts from before its renewal's GET, so this end is never earlier than its own) or
   until it released the Lease; every audited write it sent outside that, but for
   `LEADERSHIP_SLACK` (the step from the elector's check to the request reaching the proxy),
   accepted or refused, is a violation. Audited: run statuses and finalizers (the run's own
   patches), run Leases, pods created and deleted, budgets. Not audited by the local control
   plane's policy, so not judged: Secret deletes and pod patches (a pod finalizer's removal).
10. What a run shows is what was asked of it, in the final objects: once the operator has caught
   up with the run's spec (status.observedGeneration equals metadata.generation), its condition
   Suspended is True exactly when spec.suspend is set, and never on a terminal run; phase Suspended
   only while spec.suspend is set; a suspended run
   that a worker still holds says WorkerPaused (its phase stays Running, so only this says it). The
   one other pause: a held run whose budget says onExhausted: Pause may say BudgetPaused (and only
   such a run).
11. Kueue's quota is released only once the run's pods are gone: at no pod's creation do the live
   pods that ask for cpu (the trial's queued runs; nothing else asks) ask for more than the trial's
   ClusterQueue holds. A pod lives from its accepted creation until its kubelet reported it ended
   (a pods/status write with phase Succeeded or Failed) or deleted it for good.
12. No model answer is spent unmetered (runs drawn `metered` spend through the SDK's meter on the
   trial's model API, which cuts some answers before their usage: mid-body, or in a stream's first
   event or later, before its final usage). Judged from the model's own log: after an answer to a
   worker was cut before its final usage, the model receives no further request from that worker
   (its meter refuses to spend on blind); an ended attempt's recorded tokens are never more than
   the model billed it (invariant 4 holds them to the worker's last accepted report).
13. What a run took from its WorkerClass is fixed from its first grant: the first grant of a run that
   names a class records that class, every accepted status write
   from the first one that granted an attempt on carries the same status.class, and every Lease the
   operator wrote for the run from then on has the lease duration the run had at that grant (its
   own, else its class's, else 90 s), however the class was edited meanwhile.
14. A WorkerRunSchedule starts at most one run per slot, ever, never handles a slot twice, and
   accounts for every slot (started, or recorded as skipped): testkit/oracle_schedules.py.
15. Child runs: a child that ran was admitted while its spawner held the parent, no child name is
   created twice, a child joins its parent's ledger once and leaves it once, and the ledger adds
   up: testkit/oracle_children.py.
16. A run whose budget says onExhausted: Pause is paused, never ended, for its cap or its
   WorkerBudget: no status write that stored Pause ends an attempt or the run BudgetExceeded.

Order. Writes are ordered by the resourceVersion in their response. kube-apiserver's etcd3
storage assigns every write the store's global revision, so these integers order writes to
different objects too (a run's status and its Lease). Tether itself treats resourceVersions
as opaque; the oracle may rely on the storage it runs against. Pod creations are logged
without a body (level Metadata), so they are placed in time by their audit timestamps.

The revocation window. Revocation writes the run's status first (the fence moves) and clears
the Lease second. A renewal accepted between the two is after the fence moved, yet the API
server accepts it, because the Lease still names the worker: README documents this window.
`judge()` counts such renewals in `Verdict.window_renewals` and reports them as violations
only with `strict_window=True`. A renewal accepted after the Lease was cleared, and any
status write after the fence moved, are always violations.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from testkit.audit import AuditRecord
from testkit.oracle_children import judge_children
from testkit.oracle_schedules import judge_schedules

INVARIANTS: dict[int, str] = {
    1: "no worker write accepted after its fence was superseded",
    2: "no accepted result or error erased or replaced",
    3: "at most one pod per attempt",
    4: "budget charges equal the final usage of every attempt, each run charged once",
    5: "every run terminal or live with a renewing holder (nothing stuck)",
    6: "no unfaulted worker declared lost",
    7: "a result under review accepted or denied only as a person decided",
    8: "no attempt Stalled while its run is suspended or its request is pending",
    9: "no replica writes past its leadership (last renewal + renew deadline)",
    10: "a run says it is suspended exactly when spec.suspend is set (or paused for its budget), a finished one never",
    11: "Kueue's quota never held by more live pods than it admits",
    12: "no model answer spent unmetered: a cut one stops the worker's spending, none counted beyond its bill",
    13: "what a run took from its class is fixed from its first grant",
    14: "a schedule starts at most one run per slot and accounts for every slot",
    15: "child runs: no stale attempt's child runs, one per key, admitted and settled once, the ledger adds up",
    16: "a run whose budget says Pause is paused, never ended BudgetExceeded",
}

TERMINAL = frozenset({"Succeeded", "Failed", "Lost", "Cancelled", "BudgetExceeded", "DeadlineExceeded", "Rejected"})
USAGE_ANNOTATION = "tether.dev/usage"
LEASE_LOST = "LeaseLost"
STALLED = "Stalled"
WITHDRAWN = "Withdrawn"
GATES_OF_THE_RUN = frozenset({"Start", "Result"})  # every other gate is a worker's request
# From the elector's last check to its request reaching the API proxy (the event loop, the rate
# limiter, the proxy's own thread on a loaded 2-core machine): writes sent this much past the
# end of a leadership are not counted.
LEADERSHIP_SLACK = dt.timedelta(seconds=1.0)
# A fault aimed at every attempt of a run (rather than at one pod) is recorded with this pod name.
ANY_POD = "*"
_POD_NAME = re.compile(r"^(?P<run>.+)-a(?P<attempt>\d+)$")


@dataclass(frozen=True)
class Violation:
    invariant: int
    subject: str  # the run, budget or pod it is about
    evidence: str

    @property
    def title(self) -> str:
        return INVARIANTS[self.invariant]

    def __str__(self) -> str:
        return f"invariant {self.invariant} ({self.title}): {self.subject}: {self.evidence}"


@dataclass
class TrialFacts:
    """What the harness knows besides the audit log: whom it faulted, and the final objects."""

    namespace: str
    # (run uid, pod name) of every worker a fault was aimed at; pod ANY_POD: every attempt of that run.
    faulted: set[tuple[str, str]] = field(default_factory=set)
    runs: list[dict[str, Any]] = field(default_factory=list)  # the WorkerRuns that exist at the end
    budgets: list[dict[str, Any]] = field(default_factory=list)  # the WorkerBudgets at the end
    # Per run name, the run's Lease at the start and at the end of a watch of a few renew intervals
    # (None: no Lease). Only runs that are not terminal need them.
    leases_before: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    leases_after: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    # Every run's Lease at the end, by run name (None: no Lease).
    leases_final: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    pods_final: list[dict[str, Any]] = field(default_factory=list)  # the pods that exist at the end
    workloads_final: list[dict[str, Any]] = field(default_factory=list)  # the Kueue Workloads at the end
    judged_at: dt.datetime | None = None  # when the final objects were read
    # With leader election: the leader Lease's name and the replicas' renew deadline (invariant 9).
    leader_lease: str | None = None
    renew_deadline: float = 0.0
    # The trial's ClusterQueue's cpu quota, in millicores, when it queued runs (invariant 11).
    queue_quota_milli: int | None = None
    # Every answer the trial's model API gave metered workers, in arrival order (invariant 12).
    model_answers: list[ModelAnswer] = field(default_factory=list)
    # Each WorkerRunSchedule of the trial: its @every period (seconds) and its final object (invariant 14).
    schedules: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelAnswer:
    run_uid: str
    holder: str  # the attempt's holder, named in the request
    tokens: int  # what the answer's usage block billed
    cut: bool  # cut before its usage was sent (mid-body, or in its first stream event)


@dataclass
class Verdict:
    violations: list[Violation] = field(default_factory=list)
    # Accepted renewals inside the documented revocation window (see the module docstring).
    window_renewals: list[str] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_invariant(self) -> Counter[int]:
        return Counter(v.invariant for v in self.violations)


# --- what the audit log says, typed ------------------------------------------------------


@dataclass(frozen=True)
class _Write:
    """One accepted write with a body: a WorkerRun status, a Lease or a WorkerBudget status."""

    rv: int
    body: dict[str, Any]  # the object as stored (the response)
    pod: str | None  # the pod of a pod-bound token, None for every other identity
    pod_uid: str | None
    user: str
    verb: str
    when: dt.datetime
    audit_id: str

    @property
    def status(self) -> dict[str, Any]:
        return self.body.get("status") or {}

    @property
    def spec(self) -> dict[str, Any]:
        return self.body.get("spec") or {}

    def describe(self) -> str:
        who = f"pod {self.pod}" if self.pod else self.user
        return f"{self.verb} by {who} at {self.when.time().isoformat()} (rv {self.rv}, audit {self.audit_id[:8]})"


def _rv(obj: Mapping[str, Any]) -> int | None:
    raw = (obj.get("metadata") or {}).get("resourceVersion")
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


def _owner_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "WorkerRun":
            return str(ref.get("uid"))
    return None


def _usage_of(lease: Mapping[str, Any]) -> tuple[int, int] | None:
    raw = ((lease.get("metadata") or {}).get("annotations") or {}).get(USAGE_ANNOTATION)
    if not raw:
        return None
    try:
        doc = json.loads(raw)
        return int(doc.get("cents", 0)), int(doc.get("tokens", 0))
    except (ValueError, TypeError, AttributeError):
        return None


def _usage(doc: Mapping[str, Any] | None) -> tuple[int, int]:
    doc = doc or {}
    return int(doc.get("cents") or 0), int(doc.get("tokens") or 0)


def _write(rec: AuditRecord) -> _Write | None:
    body = rec.response_object
    if not rec.accepted or rec.dry_run or not isinstance(body, dict):
        return None
    rv = _rv(body)
    if rv is None:
        return None
    return _Write(rv=rv, body=body, pod=rec.user.pod, pod_uid=rec.user.pod_uid, user=rec.user.username, verb=rec.verb,
                  when=rec.completed, audit_id=rec.audit_id)


@dataclass(frozen=True)
class _Approval:
    """An accepted WorkerRunApproval creation."""

    rv: int
    run_name: str
    run_uid: str | None
    gate: str
    attempt: int | None
    decision: str
    approver: str
    user: str
    created: dt.datetime

    def decides(self, uid: str, name: str, created: dt.datetime | None, gate: str, attempt: int) -> bool:
        """Whether this approval decides `gate` of `attempt` of that run (the rule README documents)."""
        if self.gate != gate or self.run_name != name:
            return False
        if (self.run_uid != uid) if self.run_uid else (created is not None and self.created <= created):
            return False
        return self.attempt == attempt


def _approval(rec: AuditRecord) -> _Approval | None:
    body = rec.response_object
    if not rec.accepted or rec.dry_run or not isinstance(body, dict) or _rv(body) is None:
        return None
    spec, meta = body.get("spec") or {}, body.get("metadata") or {}
    ref = spec.get("runRef") or {}
    created = _time(meta.get("creationTimestamp"))
    if created is None:
        return None
    return _Approval(rv=_rv(body) or 0, run_name=str(ref.get("name")), run_uid=ref.get("uid") or None,
                     gate=str(spec.get("gate")), attempt=spec.get("attempt"), decision=str(spec.get("decision")),
                     approver=str(spec.get("approver")), user=rec.user.username, created=created)


def _time(text: Any) -> dt.datetime | None:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")) if isinstance(text, str) and text else None


@dataclass
class _Tenure:
    """One grant: `holder` held the run with `fence` from `granted` until `superseded` (rvs)."""

    uid: str
    holder: str
    fence: int
    granted: _Write
    superseded: _Write | None = None
    lease_cleared: _Write | None = None  # the first Lease write that named someone else, after the grant


class _History:
    """The namespace's accepted writes, grouped and ordered."""

    def __init__(self, records: Iterable[AuditRecord], namespace: str) -> None:
        self.run_writes: dict[str, list[_Write]] = defaultdict(list)  # by run uid
        self.run_names: dict[str, str] = {}
        self.lease_writes: dict[str, list[_Write]] = defaultdict(list)  # by owning run uid
        # By budget name and uid: a budget deleted and re-created under its name is another ledger.
        self.budget_writes: dict[tuple[str, str], list[_Write]] = defaultdict(list)
        self.worker_writes: list[tuple[str, _Write]] = []  # ("lease" | "status", write)
        self.refused_worker_writes: Counter[str] = Counter()
        self.pod_creates: list[AuditRecord] = []
        self.pod_owners: dict[str, str] = {}  # pod uid -> uid of the run that controls the pod
        self.pods_created: set[tuple[str, str]] = set()  # (run uid, pod name)
        self.pod_deletes: dict[str, dt.datetime] = {}  # pod name -> its last accepted delete request
        self.run_creates: dict[str, list[AuditRecord]] = defaultdict(list)  # by run name
        self.approvals: list[_Approval] = []  # accepted WorkerRunApproval creations, in commit order
        for rec in records:
            ref = rec.object_ref
            if ref is None or ref.namespace != namespace:
                continue
            if ref.resource == "workerrunapprovals" and rec.verb == "create":
                approval = _approval(rec)
                if approval is not None:
                    self.approvals.append(approval)
                continue
            if ref.resource == "pods" and ref.subresource == "" and rec.verb == "create":
                if rec.accepted and not rec.dry_run:
                    self.pod_creates.append(rec)
                    pod, owner = rec.response_object or {}, _owner_uid(rec.response_object or {})
                    if owner is not None and (pod.get("metadata") or {}).get("uid"):
                        self.pod_owners[str(pod["metadata"]["uid"])] = owner
                        self.pods_created.add((owner, ref.name))
                continue
            if ref.resource == "pods" and ref.subresource == "" and rec.verb == "delete":
                if rec.accepted and not rec.dry_run:
                    self.pod_deletes[ref.name] = rec.received
                continue
            if ref.resource == "workerruns" and ref.subresource == "" and rec.verb == "create":
                if rec.accepted and not rec.dry_run:
                    self.run_creates[ref.name].append(rec)
                continue
            is_status = ref.subresource == "status" and rec.verb in ("update", "patch")
            is_lease = ref.resource == "leases" and ref.subresource == "" and rec.verb in ("create", "update", "patch")
            if not (is_status or is_lease):
                continue
            kind = "lease" if is_lease else "status"
            if rec.user.pod is not None and not rec.accepted:
                self.refused_worker_writes[f"{kind} {rec.code}"] += 1
            w = _write(rec)
            if w is None:
                continue
            if is_lease:
                uid = _owner_uid(w.body)
                if uid is None:
                    continue  # not a run's Lease (the operators' leader election)
                self.lease_writes[uid].append(w)
            elif ref.resource == "workerruns":
                uid = str(w.body["metadata"].get("uid"))
                self.run_writes[uid].append(w)
                self.run_names[uid] = ref.name
            elif ref.resource == "workerbudgets":
                self.budget_writes[(ref.name, str((w.body.get("metadata") or {}).get("uid")))].append(w)
                continue
            if w.pod is not None:
                self.worker_writes.append((kind, w))
        for group in (self.run_writes, self.lease_writes, self.budget_writes):
            for writes in group.values():
                writes.sort(key=lambda w: w.rv)
        self.approvals.sort(key=lambda a: a.rv)
        self.worker_writes.sort(key=lambda kw: kw[1].rv)

    def name(self, uid: str) -> str:
        return f"{self.run_names.get(uid, '?')} (uid {uid[:8]})"

    def tenures(self) -> dict[tuple[str, str], _Tenure]:
        """Every grant, by (run uid, holder), with when it was superseded and its Lease cleared."""
        out: dict[tuple[str, str], _Tenure] = {}
        for uid, writes in self.run_writes.items():
            current: _Tenure | None = None
            for w in writes:
                holder, fence = w.status.get("holder"), int(w.status.get("fence") or 0)
                if current is not None and (holder, fence) != (current.holder, current.fence):
                    current.superseded = w
                    current = None
                if holder and current is None and (uid, holder) not in out:
                    current = _Tenure(uid=uid, holder=holder, fence=fence, granted=w)
                    out[(uid, holder)] = current
            for t in out.values():
                if t.uid != uid or t.superseded is None:
                    continue
                t.lease_cleared = next(
                    (lw for lw in self.lease_writes.get(uid, ()) if lw.pod is None and lw.rv > t.granted.rv and
                     ((lw.spec.get("holderIdentity"), lw.spec.get("leaseTransitions")) != (t.holder, t.fence))),
                    None)
        return out


# --- the invariants ----------------------------------------------------------------------


def judge(records: Iterable[AuditRecord], facts: TrialFacts, strict_window: bool = False) -> Verdict:
    """Checks the invariants over `facts.namespace`; see the module docstring."""
    records = list(records)
    history = _History(records, facts.namespace)
    verdict = Verdict()
    final = {str(r["metadata"]["uid"]): r for r in facts.runs}
    tenures = history.tenures()
    _fences(history, tenures, verdict, strict_window)
    _results(history, final, verdict)
    _pods(history, verdict)
    _budgets(history, final, tenures, facts, verdict)
    _nothing_stuck(facts, history, verdict)
    _unfaulted_lost(history, facts, verdict)
    _reviews(history, verdict)
    _stalls(history, verdict)
    _suspension_shown(facts, verdict)
    _paused_not_stopped(history, verdict)
    _classes_pinned(history, verdict)
    if facts.leader_lease is not None:
        _leadership(records, facts, verdict)
    if facts.queue_quota_milli is not None:
        _quota(records, facts, verdict)
    if facts.model_answers:
        _model_answers(history, final, facts, verdict)
    found: list[tuple[int, str, str]] = []
    if facts.schedules:
        judge_schedules(records, facts.namespace, facts.schedules, found, verdict.stats)
    if any("parentRef" in (r.get("spec") or {}) for r in facts.runs):
        judge_children(records, facts.namespace, facts.runs, found, verdict.stats)
    verdict.violations += [Violation(*v) for v in found]
    verdict.stats["worker writes accepted"] += len(history.worker_writes)
    for what, n in history.refused_worker_writes.items():
        verdict.stats[f"worker writes refused ({what})"] += n
    verdict.stats["pods created"] += len(history.pod_creates)
    return verdict


def _classes_pinned(history: _History, verdict: Verdict) -> None:
    """Invariant 13."""
    for uid, writes in history.run_writes.items():
        first = next((w for w in writes if int(w.status.get("attempt") or 0) > 0 and w.pod is None), None)
        if first is None:
            continue
        taken = first.status.get("class")
        named = first.spec.get("className")
        if named and (taken or {}).get("name") != named:
            verdict.violations.append(Violation(13, history.name(uid), f"granted by {first.describe()} with status.class "
                                                f"{_short(taken)}, though it names class {named}"))
        for w in writes:
            if w.rv > first.rv and w.status.get("class") != taken:
                verdict.violations.append(Violation(13, history.name(uid), f"status.class {_short(taken)} at the first "
                                                    f"grant ({first.describe()}), {_short(w.status.get('class'))} "
                                                    f"after {w.describe()}"))
                break
        lease = first.spec.get("lease") or ((taken or {}).get("defaults") or {}).get("lease") or {}
        duration = int(lease.get("durationSeconds") or 90)
        if (taken or {}).get("name"):
            verdict.stats["runs granted with a class"] += 1
        for lw in history.lease_writes.get(uid, ()):
            seconds = lw.spec.get("leaseDurationSeconds")
            if lw.pod is None and lw.rv > first.rv and seconds is not None and int(seconds) != duration:
                verdict.violations.append(Violation(13, history.name(uid), f"Lease written with leaseDurationSeconds "
                                                    f"{seconds} by {lw.describe()}; the run was granted with {duration}"))
                break


def _reviews(history: _History, verdict: Verdict) -> None:
    """Invariant 7."""
    for a in history.approvals:
        verdict.stats["approvals accepted"] += 1
        if a.approver != a.user:
            verdict.violations.append(Violation(7, f"approval of {a.run_name}", f"approver {a.approver!r} accepted "
                                                                                f"from user {a.user!r}"))
    for uid, writes in history.run_writes.items():
        if not any((w.spec.get("review") or {}).get("result") for w in writes):
            continue
        subject, name = history.name(uid), history.run_names.get(uid, "")
        created = _time(writes[0].body.get("metadata", {}).get("creationTimestamp"))
        opened: dict[int, int] = {}  # attempt -> rv of the write that put its result under review
        before: dict[str, Any] = {}
        for w in writes:
            s = w.status
            attempts = s.get("attempts") or []
            last = int(attempts[-1].get("attempt") or 0) if attempts else 0
            if w.pod is None and s.get("phase") == "AwaitingReview":
                opened.setdefault(last, w.rv)

            def decided(decision: str, attempt: int, at: _Write = w) -> list[_Approval]:
                return [a for a in history.approvals if a.rv < at.rv and a.decision == decision
                        and a.decides(uid, name, created, "Result", attempt)]
            if w.pod is None and s.get("phase") == "Succeeded" and before.get("phase") != "Succeeded":
                verdict.stats["results accepted on review"] += 1
                if last not in opened or not decided("Approve", last) or decided("Deny", last):
                    verdict.violations.append(Violation(
                        7, subject, f"attempt {last}'s result accepted in {w.describe()} without an approval of it "
                                    f"(approved: {bool(decided('Approve', last))}, denied: {bool(decided('Deny', last))})"))
            was = {int(x.get("attempt") or 0): x.get("outcome") for x in before.get("attempts") or []}
            for x in attempts:
                n = int(x.get("attempt") or 0)
                if w.pod is None and x.get("outcome") == "ResultRejected" and was.get(n) != "ResultRejected":
                    verdict.stats["results denied on review"] += 1
                    if not decided("Deny", n):
                        verdict.violations.append(Violation(
                            7, subject, f"attempt {n}'s result rejected in {w.describe()} without a denial of it"))
            before = s


def _stalls(history: _History, verdict: Verdict) -> None:
    """Invariant 8."""
    for uid, writes in history.run_writes.items():
        before: dict[str, Any] = {}
        for w in writes:
            s = w.status
            was = {int(x.get("attempt") or 0): x.get("outcome") for x in before.get("attempts") or []}
            ends = (s.get("attempts") or []) if w.pod is None else []  # only the operator ends attempts
            for x in ends:
                n = int(x.get("attempt") or 0)
                if x.get("outcome") != STALLED or was.get(n) == STALLED:
                    continue
                verdict.stats["attempts ended Stalled, judged against suspension and requests"] += 1
                why = []
                if w.spec.get("suspend"):
                    why.append("the run it stored is suspended (spec.suspend)")
                if pending := _requests(before, n, None):
                    why.append(f"request {', '.join(pending)} of that attempt was pending before it")
                if withdrawn := sorted(set(_requests(s, n, WITHDRAWN)) - set(_requests(before, n, WITHDRAWN))):
                    why.append(f"it withdrew request {', '.join(withdrawn)}, still pending")
                if why:
                    verdict.violations.append(Violation(8, f"{history.name(uid)} attempt {n}",
                                                        f"ended Stalled in {w.describe()}, but " + "; ".join(why)))
            before = s


def _requests(status: Mapping[str, Any], attempt: int, decision: str | None) -> list[str]:
    """The workers' own requests (gates other than Start and Result) of `attempt` with that decision
    (None: pending)."""
    return sorted(str(r.get("gate")) for r in (status.get("review") or {}).get("requests") or []
                  if r.get("gate") not in GATES_OF_THE_RUN and r.get("attempt") == attempt
                  and r.get("decision") == decision)


def _leaderships(records: list[AuditRecord], facts: TrialFacts) -> dict[str, list[tuple[dt.datetime, dt.datetime]]]:
    """Per replica (its proxy stamp's client), when it led: from sending its accepted acquisition of the
    leader Lease to sending its last accepted renewal plus the renew deadline, or to its release."""
    writes = sorted(((rv, r) for r in records if r.accepted and r.stamp is not None and r.verb in ("create", "update")
                     and r.about("leases", facts.namespace, facts.leader_lease)
                     and (rv := _rv(r.response_object or {})) is not None), key=lambda x: x[0])
    deadline = dt.timedelta(seconds=facts.renew_deadline)
    spans: dict[str, list[list[dt.datetime]]] = defaultdict(list)
    leading: str | None = None
    for _, rec in writes:
        assert rec.stamp is not None
        client, sent = rec.stamp.client, rec.stamp.sent
        if not ((rec.response_object or {}).get("spec") or {}).get("holderIdentity"):
            if leading == client:  # released: it stopped acting before it gave the Lease up
                spans[client][-1][1] = min(spans[client][-1][1], sent)
            leading = None
        elif leading != client:
            spans[client].append([sent, sent + deadline])
            leading = client
        else:
            spans[client][-1][1] = sent + deadline
    return {client: [(a, b) for a, b in led] for client, led in spans.items()}


def _leadership(records: list[AuditRecord], facts: TrialFacts, verdict: Verdict) -> None:
    """Invariant 9."""
    led = _leaderships(records, facts)
    verdict.stats["operator leaderships"] += sum(len(spans) for spans in led.values())
    outside: dict[str, list[AuditRecord]] = defaultdict(list)
    for rec in records:
        ref, stamp = rec.object_ref, rec.stamp
        if stamp is None or ref is None or not rec.is_write or ref.namespace != facts.namespace \
                or rec.about("leases", facts.namespace, facts.leader_lease):
            continue
        verdict.stats["operator writes judged against leadership"] += 1
        spans = led.get(stamp.client, [])
        if not any(start <= stamp.sent <= end + LEADERSHIP_SLACK for start, end in spans):
            outside[stamp.client].append(rec)
        elif not any(rec.received <= end + LEADERSHIP_SLACK for _, end in spans):
            verdict.stats["operator writes sent while leading, landed after (held up on the way)"] += 1
    for client, recs in sorted(outside.items()):
        spans = ", ".join(f"{a.time().isoformat()}-{b.time().isoformat()}" for a, b in led.get(client, [])) or "never"
        first = recs[0]
        assert first.stamp is not None and first.object_ref is not None
        what = f"{first.object_ref.resource}{'/' + first.object_ref.subresource if first.object_ref.subresource else ''}"
        answer = "accepted" if first.accepted else f"refused {first.code}"
        verdict.violations.append(Violation(
            9, f"operator replica {client}",
            f"{len(recs)} write(s) sent outside its leadership (led {spans}, renew deadline "
            f"{facts.renew_deadline:g}s); the first: {first.verb} {what} {first.object_ref.name} sent at "
            f"{first.stamp.sent.time().isoformat()}, {answer} (audit {first.audit_id[:8]})"))


def _final_is_newest(history: _History, final: Mapping[str, dict[str, Any]], uid: str) -> bool:
    """Whether the object read at the end is at least as new as every write the audit log holds
    (the log may already hold a write made after the harness read the object)."""
    writes = history.run_writes.get(uid)
    return uid in final and (not writes or (_rv(final[uid]) or 0) >= writes[-1].rv)


def _attempt_records(history: _History, final: Mapping[str, dict[str, Any]], uid: str) -> dict[int, dict[str, Any]]:
    """Every attempt of the run by number, each as its last accepted version recorded it: those the
    operator's bounded history (--attempt-history) has since dropped included, so that totals are
    judged however much of the history the run still shows."""
    out: dict[int, dict[str, Any]] = {}
    for status in [w.status for w in history.run_writes.get(uid, ())] + [_last_state(history, final, uid).get("status") or {}]:
        out.update({int(a.get("attempt") or 0): a for a in status.get("attempts") or []})
    return out


def _trimmed(status: Mapping[str, Any], attempt: int | None) -> bool:
    """`attempt`'s record has left the run's bounded history (only the oldest records leave it)."""
    kept = [int(a.get("attempt") or 0) for a in status.get("attempts") or []]
    return attempt is not None and bool(kept) and attempt < min(kept)


def _last_state(history: _History, final: Mapping[str, dict[str, Any]], uid: str) -> dict[str, Any]:
    """The run as it ended: the newer of the object read at the end and its last accepted status write."""
    if _final_is_newest(history, final, uid):
        return final[uid]
    writes = history.run_writes.get(uid)
    return writes[-1].body if writes else final.get(uid, {})


def _fences(history: _History, tenures: Mapping[tuple[str, str], _Tenure], verdict: Verdict,
            strict_window: bool) -> None:
    """Invariant 1."""
    for kind, w in history.worker_writes:
        uid = str(w.body["metadata"].get("uid")) if kind == "status" else _owner_uid(w.body)
        assert w.pod is not None and uid is not None
        subject = f"{history.name(uid)} pod {w.pod}"
        owner = history.pod_owners.get(w.pod_uid or "")
        if owner is not None and owner != uid:
            # Same pod name, another run: a deleted namesake's worker (holder and fence repeat).
            verdict.violations.append(Violation(1, subject, f"accepted {kind} {w.describe()} from the pod of "
                                                            f"another run, {history.name(owner)}"))
            continue
        tenure = tenures.get((uid, w.pod))
        if tenure is None:
            verdict.violations.append(Violation(1, subject, f"accepted {kind} {w.describe()} from a pod that "
                                                            "never held the run"))
            continue
        if tenure.superseded is None or w.rv < tenure.superseded.rv:
            continue
        moved = (f"fence {tenure.fence} was superseded by {tenure.superseded.describe()} "
                 f"(fence {tenure.superseded.status.get('fence')}, holder {tenure.superseded.status.get('holder')})")
        if kind == "lease" and (tenure.lease_cleared is None or w.rv < tenure.lease_cleared.rv):
            note = f"{subject}: renewal {w.describe()} after {moved}, before the Lease was cleared"
            verdict.window_renewals.append(note)
            verdict.stats["renewals in the revocation window"] += 1
            if strict_window:
                verdict.violations.append(Violation(1, subject, f"accepted renewal {w.describe()} after {moved}"))
            continue
        after_clear = f"; the Lease was cleared by {tenure.lease_cleared.describe()}" if kind == "lease" and \
            tenure.lease_cleared is not None else ""
        verdict.violations.append(Violation(1, subject, f"accepted {kind} write {w.describe()} after {moved}"
                                                        f"{after_clear}"))


def _results(history: _History, final: Mapping[str, dict[str, Any]], verdict: Verdict) -> None:
    """Invariant 2."""
    for uid, writes in history.run_writes.items():
        subject = history.name(uid)
        states: list[tuple[str, dict[str, Any]]] = [(w.describe(), w.status) for w in writes]
        if _final_is_newest(history, final, uid):
            states.append(("the final object", final[uid].get("status") or {}))
        published: dict[str, tuple[Any, str, str]] = {}  # field -> (value, pod, where)
        attempt_of = {a.get("holder"): n for n, a in _attempt_records(history, final, uid).items()}
        terminal: tuple[str, str] | None = None  # (phase, where)
        reported: set[str] = set()
        for i, (where, status) in enumerate(states):
            w = writes[i] if i < len(writes) else None
            for fld, (value, pod, first) in list(published.items()):
                if fld in reported or status.get(fld) == value:
                    continue
                if fld == "result" and status.get(fld) is None and \
                        _review_decided(status, attempt_of.get(pod), ("Deny",)):
                    del published[fld]  # a person denied it: cleared, and the retry rules go on
                    continue
                if fld == "error" and _error_recorded(status, attempt_of.get(pod), value):
                    continue
                verdict.violations.append(Violation(
                    2, subject, f"{fld} {_short(value)} published by pod {pod} ({first}) is "
                                f"{'erased' if status.get(fld) is None else 'replaced by ' + _short(status.get(fld))} "
                                f"in {where}"))
                reported.add(fld)
            if terminal is not None and status.get("phase") != terminal[0] and "phase" not in reported:
                verdict.violations.append(Violation(
                    2, subject, f"terminal phase {terminal[0]} ({terminal[1]}) replaced by {status.get('phase')} "
                                f"in {where}"))
                reported.add("phase")
            if "result" in published and status.get("holder") not in (None, published["result"][1]) \
                    and "regrant" not in reported:
                # The result stands, yet the work is handed out again: it would run twice.
                verdict.violations.append(Violation(
                    2, subject, f"result published by pod {published['result'][1]} ({published['result'][2]}), "
                                f"yet {status.get('holder')} was granted the run in {where}"))
                reported.add("regrant")
            if w is not None and w.pod is not None:
                for fld in ("result", "error"):
                    if status.get(fld) is not None and fld not in published:
                        published[fld] = (status[fld], w.pod, where)
                        verdict.stats[f"{fld}s accepted from workers"] += 1
            if terminal is None and status.get("phase") in TERMINAL:
                terminal = (status["phase"], where)
        if "result" in published and terminal is not None and terminal[0] != "Succeeded" \
                and "phase" not in reported and not (
                    terminal[0] in ("Rejected", "Cancelled") and final.get(uid) is not None and _review_decided(
                        final[uid].get("status") or {}, attempt_of.get(published["result"][1]),
                        ("TimedOut", "Withdrawn"))):
            # The worker was told its result stands: the run must not end as if it never came.
            verdict.violations.append(Violation(
                2, subject, f"result published by pod {published['result'][1]} ({published['result'][2]}), "
                            f"yet the run ended {terminal[0]} ({terminal[1]})"))


def _review_decided(status: Mapping[str, Any], attempt: int | None, decisions: tuple[str, ...]) -> bool:
    """The result of `attempt` was under review (spec.review.result) and so decided: denied
    (the attempt ends ResultRejected, its result cleared), or never reviewed in time or withdrawn
    by a stop (the run ends Rejected or Cancelled), as the operator documents."""
    return any(r.get("gate") == "Result" and r.get("attempt") == attempt and r.get("decision") in decisions
               for r in (status.get("review") or {}).get("requests") or [])


def _error_recorded(status: Mapping[str, Any], attempt: int | None, error: Mapping[str, Any]) -> bool:
    """A worker's error lives on in its attempt's record (attempts[].error) when the run goes on,
    whatever ended the attempt (its error, or a yield, a stop or a cap that came first), until that
    record leaves the bounded history."""
    return _trimmed(status, attempt) or any(int(a.get("attempt") or 0) == attempt and a.get("error") == error
                                            for a in status.get("attempts") or [])


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def _pods(history: _History, verdict: Verdict) -> None:
    """Invariant 3: per run incarnation — the run that controls the pod (its creation is audited
    with its body), else the latest creation of a run of that name before the pod's."""
    seen: dict[tuple[str, int | str, str], list[AuditRecord]] = defaultdict(list)
    for rec in history.pod_creates:
        assert rec.object_ref is not None
        pod = rec.object_ref.name
        m = _POD_NAME.match(pod)
        if m is None:
            continue  # not an attempt's pod
        owner = _owner_uid(rec.response_object or {})
        creates = history.run_creates.get(m["run"], [])
        incarnation = owner if owner is not None else sum(1 for c in creates if c.completed <= rec.received)
        seen[(m["run"], incarnation, pod)].append(rec)
    for (run, incarnation, pod), recs in seen.items():
        if len(recs) > 1:
            when = ", ".join(f"{r.user.username} at {r.completed.time().isoformat()} (audit {r.audit_id[:8]})"
                             for r in recs)
            verdict.violations.append(Violation(3, f"run {run} (incarnation {incarnation}) pod {pod}",
                                                f"{len(recs)} accepted creations: {when}"))


def _cpu_milli(pod: Mapping[str, Any]) -> int:
    """What a pod asks for, in millicores (the trials write "100m" or whole cores)."""
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        cpu = str(((container.get("resources") or {}).get("requests") or {}).get("cpu") or "0")
        total += int(cpu[:-1]) if cpu.endswith("m") else int(float(cpu) * 1000)
    return total


def _quota(records: list[AuditRecord], facts: TrialFacts, verdict: Verdict) -> None:
    """Invariant 11: pod lives, from the audit log alone, against the trial's ClusterQueue."""
    events: list[tuple[dt.datetime, int, str, int]] = []  # (time, 1 created / 0 ended, pod, milli)
    for rec in records:
        ref = rec.object_ref
        if ref is None or ref.namespace != facts.namespace or ref.resource != "pods" or not rec.accepted or rec.dry_run:
            continue
        if ref.subresource == "" and rec.verb == "create":
            milli = _cpu_milli(rec.response_object or {})
            if milli:
                events.append((rec.completed, 1, ref.name, milli))
        elif ref.subresource == "status" and rec.verb in ("update", "patch") and \
                ((rec.request_object or {}).get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            events.append((rec.completed, 0, ref.name, 0))
        elif ref.subresource == "" and rec.verb == "delete" and rec.user.username.startswith("system:node:"):
            events.append((rec.completed, 0, ref.name, 0))
    live: dict[str, tuple[int, dt.datetime]] = {}
    quota = facts.queue_quota_milli or 0
    for at, created, pod, milli in sorted(events, key=lambda e: (e[0], e[1])):
        if not created:
            live.pop(pod, None)
            continue
        live[pod] = (milli, at)
        asked = sum(m for m, _ in live.values())
        if asked > quota:
            verdict.violations.append(Violation(11, f"pod {pod} created at {at.time().isoformat()}", (
                f"live pods ask for {asked}m of the ClusterQueue's {quota}m: " + ", ".join(
                    f"{name} ({m}m, created {t.time().isoformat()})" for name, (m, t) in sorted(live.items())))))
    verdict.stats["queued pods judged against the quota"] += sum(1 for e in events if e[1])


def _model_answers(history: _History, final: Mapping[str, dict[str, Any]], facts: TrialFacts,
                   verdict: Verdict) -> None:
    """Invariant 12. A model answer cut before its final usage arrived cannot be metered: the
    worker's meter must refuse every later request (the model sees none), never spend on blind. An
    ended attempt records at most what the model billed it (a cut answer is charged what of its
    usage arrived, e.g. a stream's opening count; a report the control plane never
    accepted -- a renewal refused after a revocation, or lost to a fault before a publication, which
    the protocol lets go on -- may leave it less; invariant 4 holds it to its last accepted report)."""
    by_attempt: dict[tuple[str, str], list[ModelAnswer]] = defaultdict(list)
    for answer in facts.model_answers:
        by_attempt[(answer.run_uid, answer.holder)].append(answer)
    for (uid, holder), answers in by_attempt.items():
        subject = f"{history.name(uid)} worker {holder}"
        verdict.stats["model answers"] += len(answers)
        cuts = [i for i, a in enumerate(answers) if a.cut]
        verdict.stats["model answers cut before their usage"] += len(cuts)
        if cuts and cuts[0] < len(answers) - 1:
            verdict.violations.append(Violation(12, subject, (
                f"answer {cuts[0] + 1} of {len(answers)} was cut before its usage, and the worker spent "
                f"{len(answers) - cuts[0] - 1} more request(s) after it")))
        billed = sum(a.tokens for a in answers)
        record = next((a for a in _attempt_records(history, final, uid).values() if a.get("holder") == holder), None)
        if record is None or record.get("outcome") is None:
            continue  # never granted as far as the audit log shows, or still running: its usage is folded later
        recorded = _usage(record.get("usage"))[1]
        if recorded > billed:
            verdict.violations.append(Violation(12, subject, (
                f"attempt {record.get('attempt')} ended {record.get('outcome')} recording {recorded} tokens; the "
                f"model billed it {billed} ({len(answers)} answers, {len(cuts)} cut)")))


def _budgets(history: _History, final: Mapping[str, dict[str, Any]], tenures: Mapping[tuple[str, str], _Tenure],
             facts: TrialFacts, verdict: Verdict) -> None:
    """Invariant 4."""
    # Each attempt's recorded usage against the last usage its worker reported in an accepted renewal.
    totals: dict[str, tuple[int, int]] = {}  # by run uid: what all its attempts recorded
    for uid in history.run_writes:
        records = _attempt_records(history, final, uid)
        run_status = _last_state(history, final, uid).get("status") or {}
        total = totals[uid] = (sum(_usage(a.get("usage"))[0] for a in records.values()),
                               sum(_usage(a.get("usage"))[1] for a in records.values()))
        if len(records) > len(run_status.get("attempts") or []):
            verdict.stats["runs past their kept attempt history (their attempts judged from the audit log)"] += 1
        if run_status.get("phase") in TERMINAL and _usage(run_status.get("usage")) != total:
            # Every cent once, however much of the history the run still lists.
            verdict.violations.append(Violation(
                4, history.name(uid), f"ended {run_status.get('phase')} with usage {_usage(run_status.get('usage'))}, "
                                      f"but its {len(records)} attempts recorded {total} in all"))
        for attempt in records.values():
            holder = attempt.get("holder")
            if not holder or attempt.get("outcome") is None:
                continue  # still running: its usage is folded at a bounded rate
            # A pod reports with its own token; an External worker's reports come through the gateway
            # (the operator's identity) and are known by the holder they renewed. The operator's other
            # Lease writes (signals) carry the holder's last report unchanged.
            reports = [w for w in history.lease_writes.get(uid, ()) if _usage_of(w.body) and (
                w.pod == holder or (w.pod is None and ((w.body.get("spec") or {}).get("holderIdentity") == holder)))]
            reported = _usage_of(reports[-1].body) if reports else (0, 0)
            recorded = _usage(attempt.get("usage"))
            if reported != recorded:
                last = f"{reports[-1].describe()}" if reports else "no accepted report"
                verdict.violations.append(Violation(
                    4, f"{history.name(uid)} attempt {attempt.get('attempt')}",
                    f"worker {holder} last reported {reported[0]} cents / {reported[1]} tokens ({last}); "
                    f"the attempt records {recorded[0]} / {recorded[1]}"))
    budgets = {(b["metadata"]["name"], str(b["metadata"].get("uid"))): b for b in facts.budgets}
    for key in sorted(set(budgets) | set(history.budget_writes)):
        name = key[0]
        known, new_period = _budget_walk(name, history.budget_writes.get(key, []), history, verdict)
        body = budgets.get(key)
        if body is None:
            continue
        status = body.get("status") or {}
        # Every run's last mark, released ones included (what the budget was charged for it).
        charges = {**{uid: {"cents": c, "tokens": t} for uid, (c, t) in known.items()},
                   **(status.get("charges") or {})}
        spent = _usage(status.get("spent"))
        marks = (sum(int(c.get("cents") or 0) for c in charges.values()),
                 sum(int(c.get("tokens") or 0) for c in charges.values()))
        if spent != marks and not new_period:
            verdict.violations.append(Violation(4, f"budget {name}", f"spent {spent} but the runs' charges (released "
                                                                     f"ones included) add up to {marks}: "
                                                                     f"{_short(charges)}"))
        charged_runs = {uid for uid in history.run_writes
                        if ((_last_state(history, final, uid).get("spec") or {}).get("budget") or {})
                        .get("budgetRef", {}).get("name") == name}
        for uid in sorted(charged_runs | set(charges)):
            state = _last_state(history, final, uid)
            run_status = state.get("status") or {}
            usage = totals.get(uid, (0, 0))
            mark = _usage(charges.get(uid))
            finished = run_status.get("phase") in TERMINAL or uid not in final
            subject = f"budget {name}, run {history.name(uid)}"
            if uid not in charged_runs:
                verdict.violations.append(Violation(4, subject, f"charged {mark} by a run that never named it"))
            elif finished and mark != usage:
                ended = "deleted" if uid not in final else run_status.get("phase")
                verdict.violations.append(Violation(
                    4, subject, f"run {ended} with {usage[0]} cents / {usage[1]} tokens over its attempts, "
                                f"charged {mark[0]} / {mark[1]}"))
            elif not finished:
                # A live run is charged what its status has folded (status.usage), which includes the
                # running attempt; the attempt records get that usage only when it ends.
                folded = _usage(run_status.get("usage"))
                most = (max(usage[0], folded[0]), max(usage[1], folded[1]))
                if mark[0] > most[0] or mark[1] > most[1]:
                    verdict.violations.append(Violation(4, subject, f"charged {mark} beyond the run's usage {most}"))
            if finished:
                verdict.stats["cents charged to budgets"] += mark[0]


def _budget_walk(name: str, writes: list[_Write], history: _History,
                 verdict: Verdict) -> tuple[dict[str, tuple[int, int]], bool]:
    """Between two versions of a budget, marks never shrink, and vanish only once their run's own
    status has recorded (budgetCharged) that it is charged in full. A released run charged again
    (late usage settled) starts from its released mark. `spent` moves by the marks' growth (a new
    period may reset `spent`; the marks stay, so nothing is charged again). Returns every run's
    last mark, released ones included, and whether a period rolled over."""
    known: dict[str, tuple[int, int]] = {}
    rolled = False
    for prev, cur in zip(writes, writes[1:]):
        new_period = prev.status.get("periodStart") != cur.status.get("periodStart")
        rolled |= new_period
        p_marks = (prev.status.get("charges") or {})
        c_marks = (cur.status.get("charges") or {})
        known.update({uid: _usage(m) for uid, m in p_marks.items()})
        growth = [0, 0]
        for uid, p in p_marks.items():
            c = c_marks.get(uid)
            if c is None and _charged_in_full_before(history, uid, cur.rv):
                continue  # released: its mark is remembered in `known`
            if c is None or _usage(c)[0] < _usage(p)[0] or _usage(c)[1] < _usage(p)[1]:
                verdict.violations.append(Violation(
                    4, f"budget {name}", f"run {p.get('run')} (uid {uid[:8]}) mark {_usage(p)} became "
                                         f"{_usage(c) if c else 'absent'} in {cur.describe()}: its usage can be "
                                         "charged again"))
        for uid, c in c_marks.items():
            base = known.get(uid, (0, 0))
            if uid not in p_marks and (_usage(c)[0] < base[0] or _usage(c)[1] < base[1]):
                verdict.violations.append(Violation(
                    4, f"budget {name}", f"run {c.get('run')} (uid {uid[:8]}) back in the ledger at {_usage(c)}, "
                                         f"below the {base} it was charged before its release ({cur.describe()})"))
            growth[0] += max(0, _usage(c)[0] - base[0])
            growth[1] += max(0, _usage(c)[1] - base[1])
        known.update({uid: _usage(m) for uid, m in c_marks.items()})
        moved = (_usage(cur.status.get("spent"))[0] - _usage(prev.status.get("spent"))[0],
                 _usage(cur.status.get("spent"))[1] - _usage(prev.status.get("spent"))[1])
        if moved != tuple(growth) and not new_period:
            verdict.violations.append(Violation(
                4, f"budget {name}", f"spent moved by {moved} while the marks grew by {tuple(growth)} "
                                     f"({prev.describe()} -> {cur.describe()})"))
    if writes:
        known.update({uid: _usage(m) for uid, m in (writes[-1].status.get("charges") or {}).items()})
    return known, rolled


def _charged_in_full_before(history: _History, uid: str, rv: int) -> bool:
    """The run's last accepted status write before `rv` records budgetCharged."""
    before = [w for w in history.run_writes.get(uid, ()) if w.rv < rv]
    return bool(before) and bool((before[-1].body.get("status") or {}).get("budgetCharged"))


def _nothing_stuck(facts: TrialFacts, history: _History, verdict: Verdict) -> None:
    """Invariant 5."""
    for run in facts.runs:
        meta, status, spec = run["metadata"], run.get("status") or {}, run.get("spec") or {}
        subject = f"{meta['name']} (uid {str(meta.get('uid'))[:8]})"
        phase, holder = status.get("phase"), status.get("holder")
        if meta.get("deletionTimestamp"):
            verdict.violations.append(Violation(5, subject, f"deleted at {meta['deletionTimestamp']} but still there "
                                                            f"(finalizers {meta.get('finalizers')}, phase {phase})"))
            continue
        if phase in TERMINAL:
            if holder is not None:
                verdict.violations.append(Violation(5, subject, f"terminal ({phase}) with holder {holder}"))
            lease = facts.leases_final.get(meta["name"])
            if lease is not None and _owner_uid(lease) == str(meta.get("uid")) and \
                    (lease.get("spec") or {}).get("holderIdentity") is not None:
                # The revocation never finished: the old worker may still renew (and report) forever.
                verdict.violations.append(Violation(5, subject, f"terminal ({phase}) but its Lease still names "
                                                                f"{_lease_brief(lease)}"))
            continue
        if spec.get("suspend") and phase == "Suspended":
            continue
        if holder is None and phase == "Pending" and _cap_used_up(spec, status):
            continue  # held back by admission until a person raises the cap (README, Budgets)
        if holder is None and phase == "Queued" and not _admitted_workload(facts, str(meta.get("uid"))):
            verdict.stats["runs still waiting for Kueue"] += 1
            continue  # Kueue has not admitted it (yet): nothing may run it
        if holder is None and phase == "Pending" and _namesake_in_the_way(run, facts, history):
            verdict.stats["runs still waiting for a deleted namesake's pod"] += 1
            continue  # the documented wait (README, "A re-created run")
        before, after = facts.leases_before.get(meta["name"]), facts.leases_after.get(meta["name"])
        fence = status.get("fence")

        def held(lease: Mapping[str, Any] | None) -> bool:
            s = (lease or {}).get("spec") or {}
            return holder is not None and s.get("holderIdentity") == holder and s.get("leaseTransitions") == fence

        if holder is None:
            verdict.violations.append(Violation(5, subject, f"phase {phase} with no holder: nothing runs it"))
        elif not (held(before) and held(after)):
            verdict.violations.append(Violation(5, subject, f"phase {phase}, holder {holder} fence {fence}, but the "
                                                            f"Lease says {_lease_brief(after)}"))
        elif _rv(before or {}) == _rv(after or {}):
            verdict.violations.append(Violation(5, subject, f"phase {phase}, holder {holder}: its Lease was not "
                                                            f"renewed while watched ({_lease_brief(after)})"))


def _admitted_workload(facts: TrialFacts, uid: str) -> bool:
    """The run's Workload (the one it controls), as Kueue left it, is admitted and not evicted."""
    for wl in facts.workloads_final:
        if any(r.get("uid") == uid and r.get("controller") for r in wl["metadata"].get("ownerReferences") or []):
            conds = {c.get("type"): c.get("status") for c in (wl.get("status") or {}).get("conditions") or []}
            return conds.get("Admitted") == "True" and conds.get("Evicted") != "True"
    return False


def _suspension_shown(facts: TrialFacts, verdict: Verdict) -> None:
    """Invariant 10."""
    for run in facts.runs:
        meta, status, spec = run["metadata"], run.get("status") or {}, run.get("spec") or {}
        if meta.get("deletionTimestamp"):
            continue
        if meta.get("generation") is None or status.get("observedGeneration") != meta["generation"]:
            verdict.stats["runs whose status had not caught up with their spec (invariant 10 not judged)"] += 1
            continue
        subject = f"{meta['name']} (uid {str(meta.get('uid'))[:8]})"
        cond = next((c for c in status.get("conditions") or [] if c.get("type") == "Suspended"), None)
        shown = cond is not None and cond.get("status") == "True"
        phase = status.get("phase")
        # A run that pauses for its budget (onExhausted: Pause) shows it while a worker holds it.
        budget_paused = shown and cond.get("reason") == "BudgetPaused"
        if budget_paused and not (_pauses(spec) and status.get("holder") and not spec.get("suspend")):
            verdict.violations.append(Violation(10, subject, f"says BudgetPaused, but spec.budget.onExhausted is "
                                                             f"{(spec.get('budget') or {}).get('onExhausted')}, "
                                                             f"holder {status.get('holder')}, suspend {spec.get('suspend')}"))
        elif phase in TERMINAL:
            if shown:
                verdict.violations.append(Violation(10, subject, f"terminal ({phase}) but says Suspended ({cond})"))
        elif budget_paused:
            verdict.stats["runs paused for their budget at the end"] += 1
        elif bool(spec.get("suspend")) != shown:
            verdict.violations.append(Violation(10, subject, f"spec.suspend {bool(spec.get('suspend'))}, phase {phase}, "
                                                             f"but condition Suspended is {cond}"))
        elif phase == "Suspended" and not spec.get("suspend"):
            verdict.violations.append(Violation(10, subject, f"resumed (spec.suspend unset), but phase {phase}"))
        elif shown and status.get("holder") is not None and cond.get("reason") != "WorkerPaused":
            verdict.violations.append(Violation(10, subject, f"held by {status['holder']} and paused, but Suspended "
                                                             f"says {cond.get('reason')}"))


def _pauses(spec: Mapping[str, Any]) -> bool:
    return (spec.get("budget") or {}).get("onExhausted") == "Pause"


def _paused_not_stopped(history: _History, verdict: Verdict) -> None:
    """Invariant 16: a run whose budget says Pause is paused, never ended, for a cap or an exhausted
    WorkerBudget: no status write that stored onExhausted: Pause ends an attempt or the run
    BudgetExceeded. Counts the pauses (Suspended turning BudgetPaused) and the resumptions."""
    for uid, writes in history.run_writes.items():
        was: dict[str, Any] = {}
        for w in writes:
            s = w.status
            paused = next((c for c in s.get("conditions") or [] if c.get("type") == "Suspended"), {})
            before = next((c for c in was.get("conditions") or [] if c.get("type") == "Suspended"), {})
            if paused.get("reason") == "BudgetPaused" and paused.get("status") == "True" and \
                    before.get("reason") != "BudgetPaused":
                verdict.stats["runs paused for their budget"] += 1
            if before.get("reason") == "BudgetPaused" and paused.get("status") == "False":
                verdict.stats["budget pauses resumed"] += 1
            if _pauses(w.spec):
                ended = {x.get("attempt") for x in s.get("attempts") or [] if x.get("outcome") == "BudgetExceeded"}
                ended -= {x.get("attempt") for x in was.get("attempts") or [] if x.get("outcome") == "BudgetExceeded"}
                if ended or (s.get("phase") == "BudgetExceeded" and was.get("phase") != "BudgetExceeded"):
                    verdict.violations.append(Violation(16, history.name(uid), (
                        f"its budget says Pause, but {w.describe()} ended it BudgetExceeded "
                        f"(attempts {sorted(ended)}, phase {s.get('phase')})")))
            was = s


# The longest a re-created run may wait for its namesake's pod: the pod's grace period (30 s by
# default) plus the 85 s the operator allows a bound token past the pod's deletionTimestamp.
NAMESAKE_WAIT = dt.timedelta(seconds=30 + 85 + 5)


def _namesake_in_the_way(run: Mapping[str, Any], facts: TrialFacts, history: _History) -> bool:
    """The run says it waits for a deleted namesake's pod (LeaseHeld=False, NamesakePodTerminating),
    and the audit log and the final objects agree: a pod of its next holder's name, created for
    another run, still exists or was deleted less than NAMESAKE_WAIT ago."""
    meta, status = run["metadata"], run.get("status") or {}
    held = next((x for x in status.get("conditions") or [] if x.get("type") == "LeaseHeld"), {})
    if held.get("reason") != "NamesakePodTerminating":
        return False
    name = f"{meta['name']}-a{int(status.get('attempt') or 0) + 1}"
    uid = str(meta.get("uid"))
    if not any(pod == name and owner != uid for owner, pod in history.pods_created):
        return False
    if any(p["metadata"]["name"] == name and _owner_uid(p) != uid for p in facts.pods_final):
        return True
    deleted = history.pod_deletes.get(name)
    return deleted is not None and facts.judged_at is not None and facts.judged_at - deleted < NAMESAKE_WAIT


def _cap_used_up(spec: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """The run's own cap is reached by the usage its attempts recorded: it may not start another."""
    budget = spec.get("budget") or {}
    cents, tokens = _usage(status.get("usage"))
    return ((budget.get("capCents") is not None and cents >= int(budget["capCents"]))
            or (budget.get("maxTokens") is not None and tokens >= int(budget["maxTokens"])))


def _lease_brief(lease: Mapping[str, Any] | None) -> str:
    if lease is None:
        return "no Lease"
    s = lease.get("spec") or {}
    return f"holder {s.get('holderIdentity')} fence {s.get('leaseTransitions')} rv {_rv(lease)}"


def _unfaulted_lost(history: _History, facts: TrialFacts, verdict: Verdict) -> None:
    """Invariant 6."""
    for uid, writes in history.run_writes.items():
        seen: set[str] = set()
        for w in writes:
            for attempt in w.status.get("attempts") or []:
                holder, outcome = attempt.get("holder"), attempt.get("outcome")
                if outcome is None or not holder or holder in seen:
                    continue
                seen.add(holder)
                verdict.stats[f"attempts ended {outcome}"] += 1
                if outcome != LEASE_LOST:
                    continue
                if (uid, holder) in facts.faulted or (uid, ANY_POD) in facts.faulted:
                    continue
                pod = attempt.get("pod")
                if pod and (uid, pod) not in history.pods_created:
                    # No worker ever ran (the operator's pod creations failed): nobody was declared lost.
                    verdict.stats["attempts ended LeaseLost before their pod existed"] += 1
                    continue
                verdict.violations.append(Violation(
                    6, f"{history.name(uid)} pod {holder}",
                    f"declared LeaseLost ({attempt.get('message')}) by {w.describe()}, but no fault was aimed at it"))
