"""The fault trials' oracle against issue 21's defects, on synthetic audit logs: invariant 4 catches
an interrupted grant that books the previous attempt's usage again (defect 1), invariant 8 an
attempt stalled while its worker did what it was told (defect 3), invariant 9 a deposed leader
that goes on writing (defect 6). Each passes the correct history and catches the violation."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any

import pytest

from testkit.audit import AuditRecord, ProxyStamp
from testkit.oracle import LEADERSHIP_SLACK, judge
from tests.unit.oracle.test_oracle import NS, OPERATOR, Log, Run, facts, invariants

pytestmark = pytest.mark.unit


# --- 4. an interrupted grant charges nothing twice (defect 1) ------------------------------------


def interrupted_grant(log: Log, settled_into_attempt_2: int, outcome: str, budgets: list[dict[str, Any]]) -> Run:
    """Attempt 1 reports 100 cents and ends; its cleared Lease keeps the report. The grant of attempt
    2 writes the status and the operator dies before the Lease write; the run is then deleted (or
    its deadline passes) and the revocation clears the old Lease at the new fence, settling what it
    finds into attempt 2. The budget's final state goes into `budgets`."""
    run = Run(log, budget="team")
    a1 = run.grant()
    run.renew(a1, usage=100)
    run.end("PodFailed", "Backoff", usage=100, clear_lease=False)
    log.lease(run, None, run.status["fence"], usage=100)  # cleared; the report stays, as designed
    s = json.loads(json.dumps(run.status))
    s.update(attempt=2, fence=s["fence"] + 1, holder="r-a2", phase="Starting")
    s["attempts"].append({"attempt": 2, "fence": s["fence"], "holder": "r-a2", "pod": "r-a2"})
    log.run_status(run, s)  # ... and no Lease write: the operator is gone
    run.end(outcome, outcome, usage=settled_into_attempt_2, clear_lease=False)
    log.lease(run, None, run.status["fence"], usage=100 if settled_into_attempt_2 else None)
    total = 100 + settled_into_attempt_2
    log.budget("team", 0, {})
    budgets.append(log.budget("team", total, {run.uid: ("r", total)}))
    return run


@pytest.mark.parametrize("outcome", ["Cancelled", "DeadlineExceeded"])
def test_4_an_interrupted_grant_charged_the_previous_attempts_usage_again_is_caught(outcome: str) -> None:
    log, budgets = Log(), []
    run = interrupted_grant(log, 100, outcome, budgets)
    # The budget's own books balance (200 spent, 200 marked, the attempts say 100 + 100): only the
    # attempt's record against its worker's reports shows the double booking.
    verdict = judge(log.records, facts(run, budgets=budgets, faulted={(run.uid, "r-a1"), (run.uid, "r-a2")}))
    assert invariants(verdict) == [4]
    (v,) = verdict.violations
    assert v.subject.endswith("attempt 2") and "worker r-a2 last reported 0 cents" in v.evidence
    assert "records 100" in v.evidence


def test_4_an_interrupted_grant_that_drops_the_old_report_passes() -> None:
    log, budgets = Log(), []
    run = interrupted_grant(log, 0, "Cancelled", budgets)
    # Deleted: only the audit log knows the run; it was charged the 100 cents once.
    verdict = judge(log.records, facts(budgets=budgets, faulted={(run.uid, "r-a1"), (run.uid, "r-a2")}))
    assert verdict.ok, verdict.violations
    assert verdict.stats["cents charged to budgets"] == 100


# --- 8. no stall while told to wait (defect 3) ------------------------------------------------------


def request(gate: str, attempt: int, decision: str | None = None) -> dict[str, Any]:
    return {"gate": gate, "attempt": attempt, "requestedAt": "2026-11-30T12:00:00Z", "decision": decision}


def held_run(log: Log) -> tuple[Run, str]:
    run = Run(log)
    run.spec["progressDeadlineSeconds"] = 5
    pod = run.grant()
    run.renew(pod)
    run.write(phase="Running")
    return run, pod


def stall(run: Run, **changes: Any) -> None:
    """The operator ends the attempt Stalled (its last: the run fails)."""
    run.end("Stalled", "Failed", message="alive, but no new checkpoint for 5s (progressDeadlineSeconds)", **changes)


def test_8_an_attempt_stalled_while_its_run_is_suspended_is_caught() -> None:
    log = Log()
    run, pod = held_run(log)
    run.spec["suspend"] = True
    run.write(phase="Suspended")
    stall(run)
    verdict = judge(log.records, facts(run))
    assert invariants(verdict) == [8]
    assert "suspended (spec.suspend)" in verdict.violations[0].evidence
    assert verdict.violations[0].subject.endswith("attempt 1")


def test_8_an_attempt_stalled_after_its_run_was_resumed_passes() -> None:
    log = Log()
    run, pod = held_run(log)
    run.spec["suspend"] = True
    run.write(phase="Suspended")
    run.spec["suspend"] = False
    run.write(phase="Running")
    stall(run)
    verdict = judge(log.records, facts(run))
    assert verdict.ok, verdict.violations
    assert verdict.stats["attempts ended Stalled, judged against suspension and requests"] == 1


def test_8_an_attempt_stalled_while_its_request_waits_for_a_person_is_caught() -> None:
    log = Log()
    run, pod = held_run(log)
    run.write(review={"requests": [request("deploy", 1)]})
    stall(run, review={"requests": [request("deploy", 1, "Withdrawn")]})
    verdict = judge(log.records, facts(run))
    assert invariants(verdict) == [8]
    evidence = verdict.violations[0].evidence
    assert "request deploy of that attempt was pending" in evidence and "withdrew request deploy" in evidence


def test_8_a_stall_that_withdraws_a_request_the_status_had_not_shown_yet_is_caught() -> None:
    log = Log()
    run, pod = held_run(log)
    stall(run, review={"requests": [request("deploy", 1, "Withdrawn")]})
    verdict = judge(log.records, facts(run))
    assert invariants(verdict) == [8] and "withdrew request deploy" in verdict.violations[0].evidence


def test_8_decided_requests_and_requests_of_other_attempts_do_not_hold_the_clock() -> None:
    log = Log()
    run, pod = held_run(log)
    run.write(review={"requests": [request("deploy", 1, "Approve"), request("Result", 1)]})
    stall(run)
    assert judge(log.records, facts(run)).ok
    log = Log()
    run, pod = held_run(log)
    run.end("PodFailed", "Backoff")
    a2 = run.grant()
    run.renew(a2)
    run.write(review={"requests": [request("deploy", 1, "Withdrawn")]})  # attempt 1's, long decided
    stall(run)
    assert judge(log.records, facts(run)).ok


# --- 9. no writes outside a leadership (defect 6) -----------------------------------------------


LEADER = "tether-operator-leader"
DEADLINE = 8 / 3  # the trials' renew deadline: two thirds of a 4 s leader lease


class Replicas:
    """Two operator replicas behind the harness's proxy: one identity, told apart by their stamps."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.t0 = log.clock

    def at(self, seconds: float) -> dt.datetime:
        return self.t0 + dt.timedelta(seconds=seconds)

    def write(self, client: str, sent: float, verb: str, resource: str, name: str, *, code: int = 200,
              received: float | None = None, subresource: str = "", body: dict[str, Any] | None = None,
              group: str = "") -> None:
        """A request `client` sent (reached the proxy) at `sent`, received by the API server at `received`."""
        self.log.rv += 1
        stamp = self.at(sent if received is None else received).isoformat().replace("+00:00", "Z")
        ref = {"resource": resource, "namespace": NS, "name": name, "apiGroup": group}
        if subresource:
            ref["subresource"] = subresource
        doc = {"kind": "Event", "apiVersion": "audit.k8s.io/v1", "stage": "ResponseComplete",
               "auditID": str(uuid.uuid4()), "verb": verb, "requestURI": f"/{resource}/{name}", "user": OPERATOR,
               "userAgent": ProxyStamp(client, self.at(sent)).user_agent("python-httpx/0.28.1"),
               "objectRef": ref, "responseStatus": {"code": code},
               "requestReceivedTimestamp": stamp, "stageTimestamp": stamp}
        if body is not None and code < 300:
            doc["responseObject"] = {**body, "metadata": {**body.get("metadata", {}),
                                                          "resourceVersion": str(self.log.rv)}}
        self.log.records.append(AuditRecord.parse(json.loads(json.dumps(doc))))

    def elect(self, client: str, sent: float, holder: str | None = None, code: int = 200) -> None:
        """An acquisition or renewal of the leader Lease (a release with holder "")."""
        name = client.split(".")[0] + "_ab12cd34" if holder is None else holder
        self.write(client, sent, "update", "leases", LEADER, code=code, group="coordination.k8s.io",
                   body={"metadata": {"name": LEADER, "namespace": NS}, "spec": {"holderIdentity": name}})

    def status(self, client: str, sent: float, **kw: Any) -> None:
        self.write(client, sent, "update", "workerruns", "r", subresource="status", group="tether.dev", **kw)


def led(log: Log) -> Any:
    return facts(leader_lease=LEADER, renew_deadline=DEADLINE)


def failover(log: Log) -> Replicas:
    """replica-0 leads and writes, stops renewing at 3 s; replica-1 acquires at 8 s and writes."""
    r = Replicas(log)
    r.elect("replica-0.1", 0.0)
    r.status("replica-0.1", 0.5)
    for t in (1.0, 2.0, 3.0):
        r.elect("replica-0.1", t)
        r.status("replica-0.1", t + 0.3)
    r.write("replica-0.1", 3.0 + DEADLINE - 0.1, "create", "pods", "r-a2")  # just before its deadline
    r.elect("replica-1.1", 8.0)
    r.status("replica-1.1", 8.2)
    return r


def test_9_writes_inside_each_leadership_pass() -> None:
    log = Log()
    failover(log)
    verdict = judge(log.records, led(log))
    assert verdict.ok, verdict.violations
    assert verdict.stats["operator leaderships"] == 2
    assert verdict.stats["operator writes judged against leadership"] == 6


@pytest.mark.parametrize("code", [200, 409])
def test_9_a_deposed_leaders_write_after_its_renew_deadline_is_caught(code: int) -> None:
    log = Log()
    r = failover(log)
    r.write("replica-0.1", 3.0 + DEADLINE + LEADERSHIP_SLACK.total_seconds() + 0.2, "delete", "pods", "r-a1", code=code)
    r.write("replica-0.1", 9.0, "patch", "workerruns", "r", group="tether.dev")  # a finalizer's removal
    verdict = judge(log.records, led(log))
    assert invariants(verdict) == [9]
    (v,) = verdict.violations
    assert v.subject == "operator replica replica-0.1" and v.evidence.startswith("2 write(s) sent outside")
    assert "the first: delete pods r-a1" in v.evidence and ("accepted" if code == 200 else "refused 409") in v.evidence


def test_9_a_write_sent_while_leading_but_held_up_on_the_way_passes() -> None:
    log = Log()
    r = failover(log)
    r.write("replica-0.1", 3.5, "create", "pods", "r-a3", received=12.0)  # held at the proxy, landed late
    verdict = judge(log.records, led(log))
    assert verdict.ok, verdict.violations
    assert verdict.stats["operator writes sent while leading, landed after (held up on the way)"] == 1


def test_9_a_renewal_that_was_refused_does_not_extend_the_leadership() -> None:
    log = Log()
    r = failover(log)
    r.elect("replica-0.1", 5.0, code=409)  # the successor's Lease moved under it
    r.status("replica-0.1", 7.0)
    assert invariants(judge(log.records, led(log))) == [9]


def test_9_a_standby_that_writes_and_a_replica_that_writes_after_its_release_are_caught() -> None:
    log = Log()
    r = failover(log)
    r.status("replica-1.1", 4.0)  # before it acquired
    r.elect("replica-1.1", 9.0, holder="")  # gives the Lease up at shutdown ...
    r.status("replica-1.1", 9.0 + LEADERSHIP_SLACK.total_seconds() + 0.5)  # ... and writes on
    verdict = judge(log.records, led(log))
    assert invariants(verdict) == [9]
    assert verdict.violations[0].evidence.startswith("2 write(s)")


def test_9_is_judged_only_with_leader_election_and_only_on_stamped_writes() -> None:
    log = Log()
    r = failover(log)
    r.status("replica-0.1", 30.0)
    assert judge(log.records, facts()).ok  # one replica: nothing to judge
    log = Log()
    failover(log)
    run = Run(log)  # the harness's and the workers' writes carry no stamp
    run.grant()
    assert 9 not in invariants(judge(log.records, led(log)))
