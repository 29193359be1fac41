"""The fault trials' oracle on synthetic audit logs: each invariant passes a correct history and
catches the violation it exists for.

The records are built as kube-apiserver writes them (audit.k8s.io/v1 Event JSON) and parsed by
the same reader the trials use, so a change of the log's shape breaks these tests too.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any

import pytest

from testkit.audit import AuditRecord
from testkit.oracle import ANY_POD, TrialFacts, Verdict, judge

NS = "trial"
T0 = dt.datetime(2026, 11, 30, 12, tzinfo=dt.timezone.utc)
OPERATOR = {"username": "tether-admin", "groups": ["system:masters"]}


class Log:
    """A synthetic audit log of one namespace; every accepted write gets the next resourceVersion."""

    def __init__(self) -> None:
        self.rv = 100
        self.clock = T0
        self.records: list[AuditRecord] = []

    def _event(self, verb: str, resource: str, name: str, user: dict[str, Any], code: int,
               response: dict[str, Any] | None = None, subresource: str = "", group: str = "",
               request: dict[str, Any] | None = None) -> None:
        self.clock += dt.timedelta(milliseconds=10)
        stamp = self.clock.isoformat().replace("+00:00", "Z")
        ref = {"resource": resource, "namespace": NS, "name": name, "apiGroup": group}
        if subresource:
            ref["subresource"] = subresource
        doc = {"kind": "Event", "apiVersion": "audit.k8s.io/v1", "stage": "ResponseComplete",
               "auditID": str(uuid.uuid4()), "verb": verb,
               "requestURI": f"/apis/{group}/v1/namespaces/{NS}/{resource}/{name}", "user": user,
               "objectRef": ref, "responseStatus": {"code": code},
               "requestReceivedTimestamp": stamp, "stageTimestamp": stamp}
        if response is not None and 200 <= code < 300:
            doc["responseObject"] = response
        if request is not None:
            doc["requestObject"] = request
        self.records.append(AuditRecord.parse(json.loads(json.dumps(doc))))

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    @staticmethod
    def worker(pod: str, pod_uid: str | None = None) -> dict[str, Any]:
        extra = {"authentication.kubernetes.io/pod-name": [pod]}
        if pod_uid:
            extra["authentication.kubernetes.io/pod-uid"] = [pod_uid]
        return {"username": f"system:serviceaccount:{NS}:w", "groups": ["system:serviceaccounts"], "extra": extra}

    def run_status(self, run: "Run", status: dict[str, Any], pod: str | None = None, code: int = 200,
                   pod_uid: str | None = None) -> None:
        body = {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRun",
                "metadata": {"name": run.name, "namespace": NS, "uid": run.uid,
                             "resourceVersion": self._next_rv() if code < 300 else "0"},
                "spec": run.spec, "status": status}
        user = self.worker(pod, pod_uid) if pod else OPERATOR
        self._event("patch" if pod else "update", "workerruns", run.name, user, code, body, "status", "tether.dev")
        if code < 300:
            run.status = status

    def lease(self, run: "Run", holder: str | None, fence: int, usage: int | None = None, pod: str | None = None,
              code: int = 200, pod_uid: str | None = None) -> None:
        ann = {"tether.dev/fence": str(fence)}
        if usage is not None:
            ann["tether.dev/usage"] = json.dumps({"cents": usage, "tokens": 0})
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": run.name, "namespace": NS, "resourceVersion": self._next_rv() if code < 300 else "0",
                             "labels": {"tether.dev/run": run.name}, "annotations": ann,
                             "ownerReferences": [{"kind": "WorkerRun", "name": run.name, "uid": run.uid}]},
                "spec": {"holderIdentity": holder, "leaseTransitions": fence, "leaseDurationSeconds": 8}}
        self._event("update", "leases", run.name, self.worker(pod, pod_uid) if pod else OPERATOR, code, body,
                    group="coordination.k8s.io")
        if code < 300:
            run.lease = body

    def budget(self, name: str, spent: int, charges: dict[str, tuple[str, int]]) -> dict[str, Any]:
        body = {"apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget",
                "metadata": {"name": name, "namespace": NS, "uid": "b-" + name, "resourceVersion": self._next_rv()},
                "spec": {"limitCents": 10_000},
                "status": {"spent": {"cents": spent, "tokens": 0},
                           "charges": {uid: {"run": run, "cents": cents, "tokens": 0}
                                       for uid, (run, cents) in charges.items()}}}
        self._event("update", "workerbudgets", name, OPERATOR, 200, body, "status", "tether.dev")
        return body

    def create(self, resource: str, name: str, response: dict[str, Any] | None = None) -> None:
        self._event("create", resource, name, OPERATOR, 201, response,
                    group="tether.dev" if resource == "workerruns" else "")


class Run:
    """A WorkerRun driven through the ownership protocol, writing what Tether writes."""

    def __init__(self, log: Log, name: str = "r", budget: str | None = None) -> None:
        self.log, self.name, self.uid = log, name, str(uuid.uuid4())
        self.spec: dict[str, Any] = {"lease": {"durationSeconds": 8, "renewIntervalSeconds": 1}}
        if budget:
            self.spec["budget"] = {"budgetRef": {"name": budget}}
        self.status: dict[str, Any] = {}
        self.lease: dict[str, Any] | None = None
        self.pod_uids: dict[str, str] = {}
        log.create("workerruns", name)

    def pod(self, attempt: int) -> str:
        return f"{self.name}-a{attempt}"

    def grant(self) -> str:
        s = json.loads(json.dumps(self.status))
        attempt, fence = s.get("attempt", 0) + 1, s.get("fence", 0) + 1
        pod = self.pod(attempt)
        s.update(attempt=attempt, fence=fence, holder=pod, phase="Starting", error=None)
        s.setdefault("attempts", []).append({"attempt": attempt, "fence": fence, "holder": pod, "pod": pod})
        self.log.run_status(self, s)
        self.log.lease(self, pod, fence)
        self.create_pod(pod)
        return pod

    def create_pod(self, pod: str) -> None:
        """The operator's creation of the attempt's pod, audited with its body (uid, owner)."""
        self.pod_uids[pod] = str(uuid.uuid4())
        self.log.create("pods", pod, {"metadata": {"name": pod, "namespace": NS, "uid": self.pod_uids[pod],
                                                   "ownerReferences": [{"kind": "WorkerRun", "name": self.name,
                                                                        "uid": self.uid, "controller": True}]}})

    def renew(self, pod: str, usage: int | None = None, code: int = 200, pod_uid: str | None = None) -> None:
        """A renewal by `pod` (by default this run's pod of that name; `pod_uid` says which one)."""
        assert self.lease is not None
        self.log.lease(self, self.lease["spec"]["holderIdentity"], self.lease["spec"]["leaseTransitions"],
                       usage=usage, pod=pod, code=code, pod_uid=pod_uid or self.pod_uids.get(pod))

    def publish(self, pod: str, field: str = "result", value: Any = None, code: int = 200,
                pod_uid: str | None = None) -> None:
        s = json.loads(json.dumps(self.status))
        s[field] = value if value is not None else {"attempt": s.get("attempt")}
        self.log.run_status(self, s, pod=pod, code=code, pod_uid=pod_uid or self.pod_uids.get(pod))

    def end(self, outcome: str, phase: str, usage: int = 0, clear_lease: bool = True, **changes: Any) -> None:
        """The operator's revocation: status first (fence +1, holder none), then the Lease."""
        s = json.loads(json.dumps(self.status))
        s["attempts"][-1].update(outcome=outcome, usage={"cents": usage, "tokens": 0},
                                 message=changes.pop("message", f"{outcome}"))
        if "attempt_error" in changes:
            s["attempts"][-1]["error"] = changes.pop("attempt_error")
        s.update(fence=s["fence"] + 1, holder=None, phase=phase, **changes)
        s["usage"] = {"cents": sum(a.get("usage", {}).get("cents", 0) for a in s["attempts"]), "tokens": 0}
        self.log.run_status(self, s)
        if clear_lease:
            self.clear_lease()

    def clear_lease(self) -> None:
        self.log.lease(self, None, self.status["fence"])

    def write(self, **changes: Any) -> None:
        s = json.loads(json.dumps(self.status))
        s.update(changes)
        self.log.run_status(self, s)

    def final(self) -> dict[str, Any]:
        return {"metadata": {"name": self.name, "namespace": NS, "uid": self.uid, "resourceVersion": str(self.log.rv)},
                "spec": self.spec, "status": self.status}


def facts(*runs: Run, budgets: list[dict[str, Any]] | None = None, faulted: set[tuple[str, str]] | None = None,
          **kw: Any) -> TrialFacts:
    return TrialFacts(namespace=NS, runs=[r.final() for r in runs], budgets=budgets or [],
                      faulted=faulted or set(), **kw)


def invariants(verdict: Verdict) -> list[int]:
    return sorted({v.invariant for v in verdict.violations})


def lost_and_retried(log: Log) -> tuple[Run, str, str]:
    """r-a1 stops renewing, is revoked (LeaseLost) and r-a2 finishes: the correct history."""
    run = Run(log)
    a1 = run.grant()
    run.renew(a1, usage=3)
    run.end("LeaseLost", "Backoff", usage=3)
    a2 = run.grant()
    run.renew(a2, usage=2)
    run.publish(a2)
    run.end("Succeeded", "Succeeded", usage=2)
    return run, a1, a2


# --- a correct history passes ---------------------------------------------------------


def test_a_correct_history_passes_every_invariant() -> None:
    log = Log()
    run, a1, _ = lost_and_retried(log)
    run.renew(a1, code=403)  # the late worker is refused: that is the system working
    verdict = judge(log.records, facts(run, faulted={(run.uid, a1)}))
    assert verdict.ok, verdict.violations
    assert verdict.stats["worker writes refused (lease 403)"] == 1
    assert verdict.stats["attempts ended LeaseLost"] == 1
    assert verdict.stats["results accepted from workers"] == 1


def test_records_of_other_namespaces_are_ignored() -> None:
    log = Log()
    run, a1, _ = lost_and_retried(log)
    other = judge(log.records, TrialFacts(namespace="elsewhere"))
    assert other.ok and other.stats["worker writes accepted"] == 0


# --- 1. fences ----------------------------------------------------------------------------


def test_1_a_result_accepted_after_the_fence_moved_is_caught() -> None:
    log = Log()
    run = Run(log)
    a1 = run.grant()
    run.end("LeaseLost", "Backoff", clear_lease=False)
    run.publish(a1)  # the API server should have refused it (test on /status/fence)
    verdict = judge(log.records, facts(run, faulted={(run.uid, a1)}))
    assert 1 in invariants(verdict)
    assert "accepted status write" in str(verdict.violations[0]) and "superseded" in str(verdict.violations[0])


def test_1_a_renewal_accepted_after_the_lease_was_cleared_is_caught() -> None:
    log = Log()
    run = Run(log)
    a1 = run.grant()
    run.end("LeaseLost", "Lost")
    # As if the admission policy let a stale worker rewrite the cleared Lease.
    run.log.lease(run, a1, 1, pod=a1)
    verdict = judge(log.records, facts(run, faulted={(run.uid, a1)}))
    assert invariants(verdict) == [1]
    assert "the Lease was cleared" in str(verdict.violations[0])


def test_1_a_renewal_inside_the_revocation_window_is_counted_and_strict_mode_fails_it() -> None:
    log = Log()
    run = Run(log)
    a1 = run.grant()
    run.end("LeaseLost", "Lost", clear_lease=False)
    run.renew(a1)  # after the fence bump, before the Lease clear: the documented window
    run.clear_lease()
    f = facts(run, faulted={(run.uid, a1)})
    lenient = judge(log.records, f)
    assert lenient.ok and len(lenient.window_renewals) == 1
    assert invariants(judge(log.records, f, strict_window=True)) == [1]


def test_1_a_write_from_a_pod_that_never_held_the_run_is_caught() -> None:
    log = Log()
    run = Run(log)
    run.grant()
    run.log.lease(run, "r-a1", 1, pod="r-a7")
    assert invariants(judge(log.records, facts(run))) == [1, 5]  # and the run is not renewed by its holder


def test_1_a_deleted_namesakes_worker_writing_to_the_new_run_is_caught() -> None:
    """Seed 378: the re-created run reuses holder r-a1 and fence 1; only the pod UID in the
    token tells the old run's still-terminating worker from the new one."""
    log = Log()
    first = Run(log)
    a1 = first.grant()
    first.end("Cancelled", "Cancelled")
    second = Run(log)  # same name, new UID
    assert second.grant() == a1
    second.renew(a1, usage=2)  # the new run's own worker: fine
    assert 1 not in invariants(judge(log.records, facts(second)))
    second.renew(a1, usage=4, pod_uid=first.pod_uids[a1])
    second.publish(a1, pod_uid=first.pod_uids[a1])
    verdict = judge(log.records, facts(second))
    assert {v.invariant for v in verdict.violations} >= {1}
    assert sum("from the pod of another run" in v.evidence for v in verdict.violations) == 2


# --- 2. results ----------------------------------------------------------------------------


def test_2_an_erased_result_is_caught() -> None:
    log = Log()
    run = Run(log)
    a1 = run.grant()
    run.publish(a1)
    # The operator's write computed from a snapshot older than the result (the review's critical defect).
    run.end("LeaseLost", "Backoff", result=None)
    run.grant()
    verdict = judge(log.records, facts(run, faulted={(run.uid, a1)}))
    assert 2 in invariants(verdict)
    assert "erased" in next(str(v) for v in verdict.violations if v.invariant == 2)


def test_2_a_replaced_result_is_caught_and_a_kept_one_passes() -> None:
    log = Log()
    run = Run(log)
    a1 = run.grant()
    run.publish(a1, value={"answer": 1})
    run.end("Succeeded", "Succeeded")
    assert judge(log.records, facts(run)).ok
    run.write(result={"answer": 2})
    assert invariants(judge(log.records, facts(run))) == [2]


def test_2_a_workers_error_may_move_into_its_attempt_record_but_not_vanish() -> None:
    log = Log()
    run = Run(log)
    a1 = run.grant()
    run.publish(a1, "error", {"code": "Injected", "message": "boom"})
    # Retry: the run's error is cleared, the attempt keeps it (what decide() documents).
    run.end("WorkerFailed", "Backoff", error=None, message="Injected: boom",
            attempt_error={"code": "Injected", "message": "boom"})
    a2 = run.grant()
    run.publish(a2)
    run.end("Succeeded", "Succeeded")
    assert judge(log.records, facts(run)).ok

    log = Log()
    run = Run(log)
    a1 = run.grant()
    run.publish(a1, "error", {"code": "Injected", "message": "boom"})
    run.end("Cancelled", "Cancelled", error={"code": "Cancelled", "message": "spec.stop is set"},
            message="spec.stop is set")
    verdict = judge(log.records, facts(run))
    assert invariants(verdict) == [2] and "replaced by" in str(verdict.violations[0])


@pytest.mark.parametrize("kept", [True, False])
def test_2_an_error_published_during_a_yield_is_kept_in_its_attempt(kept: bool) -> None:
    """Kueue evicted the run; its worker, told to yield, published an error first. The eviction
    ends the attempt (Preempted, queued again): the error must move into the attempt's record."""
    log = Log()
    run = Run(log)
    a1 = run.grant()
    error = {"code": "Yielded", "message": "attempt 1 yields with an error"}
    run.publish(a1, "error", error)
    run.end("Preempted", "Queued", error=None, message="evicted by Kueue (Preempted)",
            **({"attempt_error": error} if kept else {}))
    verdict = judge(log.records, facts(run))
    assert invariants(verdict) == ([] if kept else [2])


def _pod_event(log: Log, verb: str, name: str, cpu: str | None = None, phase: str | None = None,
               kubelet: bool = False) -> None:
    user = {"username": "system:node:local"} if kubelet else OPERATOR
    if verb == "create":
        log._event("create", "pods", name, user, 201, response={"metadata": {"name": name}, "spec": {"containers": [
            {"name": "w", "resources": {"requests": {"cpu": cpu}} if cpu else {}}]}})
    elif verb == "status":
        log._event("patch", "pods", name, user, 200, subresource="status", request={"status": {"phase": phase}})
    else:
        log._event("delete", "pods", name, user, 200)


@pytest.mark.parametrize("victim_ends", ["status", "final-delete", "never"])
def test_11_a_preemptors_pod_while_a_victims_pod_lives_is_caught(victim_ends: str) -> None:
    """The trial's ClusterQueue holds 200m; two queued runs' pods use it; a preemptor asking for
    all of it may get a pod only once both are gone (the operator's graceful delete is not an end)."""
    log = Log()
    _pod_event(log, "create", "a-a1", "100m")
    _pod_event(log, "create", "b-a1", "100m")
    _pod_event(log, "create", "plain-a1")  # asks for nothing: not queued
    _pod_event(log, "delete", "a-a1")  # the operator's delete: the grace period begins
    _pod_event(log, "status", "a-a1", phase="Failed", kubelet=True)
    _pod_event(log, "status", "b-a1", phase="Running", kubelet=True)
    if victim_ends == "status":
        _pod_event(log, "status", "b-a1", phase="Succeeded", kubelet=True)
    elif victim_ends == "final-delete":
        _pod_event(log, "delete", "b-a1", kubelet=True)
    _pod_event(log, "create", "hi-a1", "200m")
    verdict = judge(log.records, TrialFacts(namespace=NS, queue_quota_milli=200))
    assert invariants(verdict) == ([11] if victim_ends == "never" else [])
    if victim_ends == "never":
        assert "live pods ask for 300m of the ClusterQueue's 200m" in str(verdict.violations[0])
        assert "b-a1" in str(verdict.violations[0]) and "a-a1" not in str(verdict.violations[0])


def test_2_a_run_granted_again_after_its_result_is_caught() -> None:
    log = Log()
    run = Run(log)
    a1 = run.grant()
    run.publish(a1)
    run.end("LeaseLost", "Backoff")  # the result is kept, but the run goes on as if it had none
    a2 = run.grant()
    run.publish(a2, code=403)
    verdict = judge(log.records, facts(run, faulted={(run.uid, a1)}))
    assert 2 in invariants(verdict)
    assert "yet r-a2 was granted" in next(str(v) for v in verdict.violations if v.invariant == 2)


def test_2_a_terminal_phase_that_changes_is_caught() -> None:
    log = Log()
    run = Run(log)
    run.grant()
    run.end("Cancelled", "Cancelled")
    run.write(phase="Running")
    assert 2 in invariants(judge(log.records, facts(run)))


# --- 3. pods -------------------------------------------------------------------------------


def test_3_a_second_pod_for_the_same_attempt_is_caught() -> None:
    log = Log()
    run, _, _ = lost_and_retried(log)
    run.create_pod("r-a2")
    verdict = judge(log.records, facts(run, faulted={(run.uid, ANY_POD)}))
    assert invariants(verdict) == [3] and "2 accepted creations" in str(verdict.violations[0])


def test_3_a_late_pod_of_a_deleted_run_is_not_counted_against_its_namesake() -> None:
    """A pod POST of the old run held up (operator killed mid-grant) lands after the namesake was
    created: it belongs to the old run (its owner), not to the new one."""
    log = Log()
    first = Run(log)
    first.grant()
    second = Run(log)  # same name, created now
    late = {"metadata": {"name": "r-a1", "namespace": NS, "uid": "late",
                         "ownerReferences": [{"kind": "WorkerRun", "name": "r", "uid": first.uid, "controller": True}]}}
    log.create("pods", "r-a1", late)  # a second r-a1 for the old run: a violation, but the old run's
    second.grant()
    second.end("Cancelled", "Cancelled")
    verdict = judge(log.records, facts(second))
    assert [v.subject for v in verdict.violations if v.invariant == 3] == [f"run r (incarnation {first.uid}) pod r-a1"]


def test_3_a_recreated_run_may_reuse_its_pod_names() -> None:
    log = Log()
    first = Run(log)
    first.grant()
    first.end("Cancelled", "Cancelled")
    second = Run(log)  # same name, new UID
    second.grant()
    second.end("Cancelled", "Cancelled")
    assert judge(log.records, facts(second)).ok  # first is gone: only the second exists at the end


# --- 4. budgets ----------------------------------------------------------------------------


def _charged_runs(log: Log, lost_usage: int = 3) -> tuple[Run, Run, dict[str, Any]]:
    one = Run(log, "one", budget="team")
    pod = one.grant()
    one.renew(pod, usage=5)
    one.end("Succeeded", "Succeeded", usage=5)
    two = Run(log, "two", budget="team")
    pod = two.grant()
    two.renew(pod, usage=lost_usage)
    two.end("Cancelled", "Cancelled", usage=lost_usage)
    log.budget("team", 0, {})
    log.budget("team", 5, {one.uid: ("one", 5)})
    final = log.budget("team", 5 + lost_usage, {one.uid: ("one", 5), two.uid: ("two", lost_usage)})
    return one, two, final


def test_4_exact_charges_pass_even_for_a_deleted_run() -> None:
    log = Log()
    one, _two, budget = _charged_runs(log)
    # `two` was deleted: only its audit history knows its usage.
    assert judge(log.records, facts(one, budgets=[budget])).ok


def test_4_spent_beyond_the_marks_is_a_double_charge() -> None:
    log = Log()
    one, two, _ = _charged_runs(log)
    final = log.budget("team", 13, {one.uid: ("one", 5), two.uid: ("two", 3)})  # charged `one` again
    verdict = judge(log.records, facts(one, two, budgets=[final]))
    assert invariants(verdict) == [4]
    assert any("spent moved by (5, 0) while the marks grew by (0, 0)" in str(v) for v in verdict.violations)


def test_4_a_mark_that_shrinks_is_caught() -> None:
    log = Log()
    one, two, _ = _charged_runs(log)
    final = log.budget("team", 8, {two.uid: ("two", 3)})  # `one`'s mark dropped: it could be charged again
    assert 4 in invariants(judge(log.records, facts(one, two, budgets=[final])))


def test_4_a_mark_released_after_the_run_recorded_its_full_charge_passes() -> None:
    """The ledger keeps live runs only: once `one` records budgetCharged, its mark may go; what
    it was charged still counts in `spent`."""
    log = Log()
    one, two, _ = _charged_runs(log)
    one.write(budgetCharged=True)
    final = log.budget("team", 8, {two.uid: ("two", 3)})
    assert judge(log.records, facts(one, two, budgets=[final])).ok


def test_4_a_released_run_charged_again_is_caught() -> None:
    log = Log()
    one, two, _ = _charged_runs(log)
    one.write(budgetCharged=True)
    log.budget("team", 8, {two.uid: ("two", 3)})
    final = log.budget("team", 13, {one.uid: ("one", 5), two.uid: ("two", 3)})  # from a stale snapshot
    verdict = judge(log.records, facts(one, two, budgets=[final]))
    assert invariants(verdict) == [4]
    assert "spent moved by (5, 0) while the marks grew by (0, 0)" in str(verdict.violations[0])


def test_4_late_usage_after_a_release_is_charged_from_the_released_mark() -> None:
    """The worker's last report (7 cents) is settled after the run left the ledger at 5 (the
    settle resets budgetCharged): the run is charged the 2 cents it adds, its mark back at 7."""
    log = Log()
    one = Run(log, "one", budget="team")
    pod = one.grant()
    one.renew(pod, usage=7)
    one.end("Succeeded", "Succeeded", usage=5)  # the revocation's view, before the last report
    log.budget("team", 0, {})
    log.budget("team", 5, {one.uid: ("one", 5)})
    one.write(budgetCharged=True, charged={"cents": 5, "tokens": 0})
    log.budget("team", 5, {})  # released
    attempts = [{**one.status["attempts"][-1], "usage": {"cents": 7, "tokens": 0}}]
    one.write(budgetCharged=False, attempts=attempts, usage={"cents": 7, "tokens": 0})
    final = log.budget("team", 7, {one.uid: ("one", 7)})
    assert judge(log.records, facts(one, budgets=[final])).ok
    # Charged from zero instead (the whole 7 again) is caught.
    log.budget("team", 14, {one.uid: ("one", 7)})
    assert 4 in invariants(judge(log.records, facts(one, budgets=[log.budget("team", 14, {one.uid: ("one", 7)})])))


def test_4_a_finished_run_charged_less_than_its_usage_is_caught() -> None:
    log = Log()
    one = Run(log, "one", budget="team")
    pod = one.grant()
    one.renew(pod, usage=9)
    one.end("Succeeded", "Succeeded", usage=9)
    budget = log.budget("team", 4, {one.uid: ("one", 4)})
    verdict = judge(log.records, facts(one, budgets=[budget]))
    assert invariants(verdict) == [4] and "charged 4" in str(verdict.violations[0])


def test_4_usage_reported_but_not_recorded_is_caught() -> None:
    log = Log()
    run = Run(log)
    pod = run.grant()
    run.end("LeaseLost", "Lost", usage=2, clear_lease=False)
    run.renew(pod, usage=6)  # in the revocation window: the operator must still settle it
    run.clear_lease()
    verdict = judge(log.records, facts(run, faulted={(run.uid, pod)}))
    assert invariants(verdict) == [4]
    assert "last reported 6 cents" in str(verdict.violations[0]) and "records 2" in str(verdict.violations[0])


# --- 5. nothing stuck -------------------------------------------------------------------------


def test_5_a_live_run_whose_lease_is_renewed_passes_and_a_silent_one_is_caught() -> None:
    log = Log()
    run = Run(log)
    pod = run.grant()
    run.renew(pod)
    before = run.lease
    run.renew(pod)
    assert judge(log.records, facts(run, leases_before={"r": before}, leases_after={"r": run.lease})).ok
    verdict = judge(log.records, facts(run, leases_before={"r": run.lease}, leases_after={"r": run.lease}))
    assert invariants(verdict) == [5] and "not renewed" in str(verdict.violations[0])


def test_5_a_run_nobody_holds_and_a_deleted_run_that_lingers_are_caught() -> None:
    log = Log()
    run = Run(log)
    run.write(phase="Backoff")
    verdict = judge(log.records, facts(run))
    assert invariants(verdict) == [5] and "no holder" in str(verdict.violations[0])
    final = run.final()
    final["metadata"]["deletionTimestamp"] = "2026-11-30T12:00:00Z"
    final["metadata"]["finalizers"] = ["tether.dev/run-cleanup"]
    stuck = judge(log.records, TrialFacts(namespace=NS, runs=[final]))
    assert "still there" in str(stuck.violations[0])


def test_5_suspended_on_request_is_not_stuck() -> None:
    log = Log()
    run = Run(log)
    run.spec["suspend"] = True
    run.write(phase="Suspended")
    assert judge(log.records, facts(run)).ok


def test_5_pending_is_not_stuck_only_when_the_runs_own_cap_is_used_up() -> None:
    """Seed 381: the worker spent past capCents while the operator was down; its attempt ended
    LeaseLost and the run waits, as documented, for someone to raise the cap."""
    log = Log()
    run = Run(log)
    run.spec["budget"] = {"capCents": 25}
    run.write(phase="Pending", fence=2, usage={"cents": 175, "tokens": 0})
    assert judge(log.records, facts(run)).ok
    run.write(usage={"cents": 24, "tokens": 0})
    assert invariants(judge(log.records, facts(run))) == [5]


def test_5_pending_behind_a_namesakes_pod_is_not_stuck_only_while_that_pod_can_still_act() -> None:
    """Seed 59: the run was re-created while the old run's pod was terminating; the operator waits
    (grace period plus 85 s) before it grants the pod's name again, and says so on the run. The
    oracle excuses that wait only when the audit log and the final objects show such a pod."""
    log = Log()
    old = Run(log)
    old.grant()
    run = Run(log)  # same name, new uid
    waiting = {"type": "LeaseHeld", "status": "False", "reason": "NamesakePodTerminating",
               "message": "pod r-a1 of a deleted WorkerRun of this name is terminating"}
    run.write(phase="Pending", conditions=[waiting])
    log._event("delete", "pods", "r-a1", OPERATOR, 200)
    deleted = log.clock

    def judged(after: float, pods: list[dict[str, Any]] | None = None) -> Verdict:
        return judge(log.records, facts(run, pods_final=pods or [],
                                        judged_at=deleted + dt.timedelta(seconds=after)))

    assert judged(60).ok and judged(60).stats["runs still waiting for a deleted namesake's pod"] == 1
    assert invariants(judged(200)) == [5]  # long past any token the pod could hold
    lingering = {"metadata": {"name": "r-a1", "ownerReferences": [{"kind": "WorkerRun", "uid": old.uid,
                                                                  "controller": True}]}}
    assert judged(200, [lingering]).ok  # still there (a dead node): still in the way
    # The same condition with no namesake's pod in the audit log is a run nobody starts.
    alone = Log()
    lone = Run(alone)
    lone.write(phase="Pending", conditions=[waiting])
    assert invariants(judge(alone.records, facts(lone, judged_at=alone.clock))) == [5]


# --- 6. no false loss -----------------------------------------------------------------------


@pytest.mark.parametrize("faulted, ok", [(set(), False), ({"a1"}, True), ({ANY_POD}, True), ({"a2"}, False)])
def test_6_lost_only_if_faulted(faulted: set[str], ok: bool) -> None:
    log = Log()
    run, _a1, _a2 = lost_and_retried(log)
    pods = {(run.uid, p if p == ANY_POD else f"r-{p}") for p in faulted}
    verdict = judge(log.records, facts(run, faulted=pods))
    assert verdict.ok is ok
    if not ok:
        assert invariants(verdict) == [6] and "r-a1" in verdict.violations[0].subject


def test_6_a_fault_on_a_namesake_does_not_excuse_a_new_run() -> None:
    log = Log()
    run, a1, _ = lost_and_retried(log)
    verdict = judge(log.records, facts(run, faulted={("some-other-uid", a1)}))
    assert invariants(verdict) == [6]


def test_6_an_attempt_whose_pod_was_never_created_had_no_worker_to_declare_lost() -> None:
    """Seed 178: the operator's requests were dropped (30-50%) until the startup grace ran out;
    attempt 1's pod was never created, and it ended LeaseLost. Nobody was declared lost."""
    log = Log()
    run = Run(log)
    s = {"attempt": 1, "fence": 1, "holder": "r-a1", "phase": "Starting",
         "attempts": [{"attempt": 1, "fence": 1, "holder": "r-a1", "pod": "r-a1"}]}
    log.run_status(run, s)
    log.lease(run, "r-a1", 1)  # no pod creation
    run.end("LeaseLost", "Backoff")
    verdict = judge(log.records, facts(run))
    assert 6 not in invariants(verdict)
    assert verdict.stats["attempts ended LeaseLost before their pod existed"] == 1


def test_2_a_run_that_ends_otherwise_after_accepting_a_result_is_caught() -> None:
    log = Log()
    run = Run(log)
    a1 = run.grant()
    run.publish(a1)
    run.end("LeaseLost", "Lost")  # as if a lapse were judged over the accepted result
    verdict = judge(log.records, facts(run, faulted={(run.uid, a1)}))
    assert any(v.invariant == 2 and "yet the run ended Lost" in v.evidence for v in verdict.violations)


def test_4_a_live_run_is_charged_its_folded_usage_without_a_false_alarm() -> None:
    log = Log()
    run = Run(log, budget="team")
    a1 = run.grant()
    run.renew(a1, usage=7)
    run.write(usage={"cents": 7, "tokens": 0})  # the fold
    budget = log.budget("team", 7, {run.uid: ("r", 7)})
    run.renew(a1)
    f = facts(run, budgets=[budget], leases_before={"r": run.lease}, leases_after={"r": run.lease})
    assert 4 not in invariants(judge(log.records, f))


def test_5_a_terminal_run_whose_lease_was_never_cleared_is_caught() -> None:
    """A revocation that stopped after its status write: the old worker keeps renewing."""
    log = Log()
    run = Run(log)
    a1 = run.grant()
    run.end("LeaseLost", "Lost", clear_lease=False)
    verdict = judge(log.records, facts(run, faulted={(run.uid, a1)}, leases_final={"r": run.lease}))
    assert any(v.invariant == 5 and "Lease still names" in v.evidence for v in verdict.violations)
    run.clear_lease()
    assert judge(log.records, facts(run, faulted={(run.uid, a1)}, leases_final={"r": run.lease})).ok


def _shown(suspend: bool, phase: str, suspended: str | None, holder: str | None = None, reason: str = "Suspended",
           observed: int = 2) -> dict[str, Any]:
    conds = [] if suspended is None else [{"type": "Suspended", "status": suspended, "reason": reason}]
    return {"metadata": {"name": "r", "namespace": NS, "uid": "u1", "generation": 2},
            "spec": {"suspend": suspend}, "status": {"phase": phase, "holder": holder, "conditions": conds,
                                                     "observedGeneration": observed}}


@pytest.mark.parametrize(("final", "caught"), [
    (_shown(True, "Suspended", "True"), False),
    (_shown(True, "Running", "True", holder="r-a1", reason="WorkerPaused"), False),
    (_shown(False, "Running", "False", holder="r-a1", reason="Resumed"), False),
    (_shown(False, "Running", None, holder="r-a1"), False),
    (_shown(True, "Running", None, holder="r-a1", observed=1), False),  # the operator has not seen it yet
    (_shown(True, "Running", None, holder="r-a1"), True),  # paused, shown Running and nothing else
    (_shown(True, "Suspended", "False", reason="Resumed"), True),
    (_shown(False, "Pending", "True"), True),  # resumed, still says suspended
    (_shown(True, "Running", "True", holder="r-a1", reason="Suspended"), True),
    (_shown(True, "Cancelled", "True"), True),
    (_shown(True, "Cancelled", "False", reason="Cancelled"), False),
    (_shown(False, "Suspended", "False", reason="Resumed"), True),  # resumed, still shows phase Suspended
], ids=["suspended", "worker-paused", "resumed", "never", "not-caught-up", "paused-unsaid", "suspended-unsaid",
        "resumed-unsaid", "held-without-worker-paused", "finished-suspended", "finished",
        "resumed-phase-suspended"])
def test_10_what_a_run_says_of_its_suspension_is_judged_against_its_spec(final: dict[str, Any], caught: bool) -> None:
    verdict = judge([], TrialFacts(namespace=NS, runs=[final]))
    assert (10 in invariants(verdict)) == caught, verdict.violations
