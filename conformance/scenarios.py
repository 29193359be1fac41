"""The scenarios a worker must pass, each judged from the audit log, the final objects, the
requests its proxies saw and the receiver's record — never from the worker's own account.

Each scenario takes a started Case, raises Fail with the reason when the worker breaks the
protocol, and returns a short note of what it measured. Times: L = 8 s, R = 1 s (harness.LEASE);
the worker's self-fencing margin is max(1 s, L/10) = 1 s (docs/protocol.md).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

from conformance.harness import GATEWAY, LEASE, POD, Case, Fail
from tests.support.kube import Kube

L, R = float(LEASE["durationSeconds"]), float(LEASE["renewIntervalSeconds"])
MARGIN = max(1.0, L / 10)
SLACK = 0.5  # scheduling and loopback latency on a loaded 2-core machine
KNOWN_SDKS = ("python", "typescript", "go")


@dataclass(frozen=True)
class Scenario:
    name: str
    fn: Callable[[Case], str]
    transports: tuple[str, ...] = (POD, GATEWAY)
    operator_behind_proxy: bool = False
    summary: str = ""


def _status(run: dict[str, Any]) -> dict[str, Any]:
    return run.get("status") or {}


def _expect(cond: bool, reason: str) -> None:
    if not cond:
        raise Fail(reason)


def _result_ok(case: Case, run: dict[str, Any], steps: int, attempt: int | None = None) -> None:
    result = _status(run).get("result")
    _expect(isinstance(result, dict) and result.get("steps") == steps,
            f"result {result!r} is not the script's (steps {steps})")
    if attempt is not None:
        _expect(result.get("attempt") == attempt, f"the result came from attempt {result.get('attempt')}, not {attempt}")
    if case.sdk in KNOWN_SDKS:
        _expect(result.get("sdk") == case.sdk, f"result names sdk {result.get('sdk')!r}, not {case.sdk!r}")


def _wait_effects(case: Case, n: int, timeout: float = 60) -> None:
    case.wait(lambda: len(case.effects()) >= n, timeout, f"{n} side effects")


def _fence_of(run: dict[str, Any], attempt: int) -> int:
    for a in _status(run).get("attempts") or []:
        if a.get("attempt") == attempt:
            return int(a["fence"])
    if _status(run).get("attempt") == attempt:
        return int(_status(run)["fence"])
    raise Fail(f"attempt {attempt} has no record in the run's status")


def _exactly_once(case: Case, steps: int) -> None:
    keys = [e.key.rsplit(":", 1)[1] for e in case.effects()]
    _expect(sorted(keys) == sorted(f"step-{i}" for i in range(steps)),
            f"side effects accepted {sorted(keys)}, not each of {steps} steps exactly once")


def _usage_on_lease(case: Case, name: str, holder: str, until: float | None = None) -> tuple[int, int] | None:
    """The last usage the holder's accepted renewals carried (up to wall time `until`)."""
    last = None
    for r in case.lease_writes(name):
        obj = r.response_object or {}
        if not r.accepted or (obj.get("spec") or {}).get("holderIdentity") != holder:
            continue
        if until is not None and r.completed.timestamp() > until:
            break
        raw = ((obj.get("metadata") or {}).get("annotations") or {}).get("tether.dev/usage")
        if raw:
            doc = json.loads(raw)
            last = (int(doc.get("cents", 0)), int(doc.get("tokens", 0)))
    return last


def _renewals(case: Case, name: str, holder: str, after: float, before: float) -> int:
    return sum(1 for r in case.lease_writes(name)
               if r.accepted and after <= r.received.timestamp() <= before
               and ((r.response_object or {}).get("spec") or {}).get("holderIdentity") == holder
               and (r.user.pod == holder or case.transport == GATEWAY))


def _no_effects_after(case: Case, fence: int, deadline: float, why: str) -> None:
    late = [e for e in case.effects(accepted_only=False) if e.fence == fence and e.at > deadline]
    _expect(not late, f"{len(late)} side effect(s) of fence {fence} sent up to {max((e.at for e in late), default=0) - deadline:.1f}s "
                      f"after {why}")


def _budget(case: Case, name: str, limit: int) -> None:
    case.kube.ok(case.kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{case.ns}/workerbudgets", {
        "apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget", "metadata": {"name": name},
        "spec": {"limitCents": limit}}))


# --- scenarios --------------------------------------------------------------------------


def happy(case: Case) -> str:
    """Claim or start, steps with side effects, usage on the heartbeat, a result the CRD refuses
    (reported as a bad result, not as lost ownership), then the real result; charged exactly."""
    _budget(case, "team", 10_000)
    case.create_run("job", {"steps": 3, "stepSeconds": 0.3, "centsPerStep": 2, "tokensPerStep": 10,
                            "badResultFirst": True}, budget={"budgetRef": {"name": "team"}})
    case.launch("job")
    run = case.wait_phase("job", ("Succeeded", "Failed", "Lost", "Cancelled"), timeout=120)
    _expect(_status(run)["phase"] == "Succeeded", f"ended {_status(run)['phase']}: {_status(run).get('error')}")
    _result_ok(case, run, 3, attempt=1)
    _exactly_once(case, 3)
    fence = _fence_of(run, 1)
    _expect({e.fence for e in case.effects()} == {fence}, f"side effects carried fences {[e.fence for e in case.effects()]}, "
                                                          f"not the attempt's {fence}")
    usage = _status(run).get("usage") or {}
    _expect((usage.get("cents"), usage.get("tokens")) == (6, 30), f"status.usage {usage}, reported 6 cents/30 tokens")
    holder = _status(run)["attempts"][0]["holder"]
    _expect(_usage_on_lease(case, "job", holder) == (6, 30),
            f"the last usage on an accepted renewal was {_usage_on_lease(case, 'job', holder)}, not (6, 30)")
    case.wait(lambda: ((case.kube.ok(case.kube.get(
        f"/apis/tether.dev/v1alpha1/namespaces/{case.ns}/workerbudgets/team")).get("status") or {})
        .get("spent") or {}).get("cents") == 6, 30, "the budget charged 6 cents")
    if case.transport == POD:
        refused = [r for r in case.audit() if r.about("workerruns", case.ns, "job", "status") and r.user.pod == holder
                   and r.code == 422]
        _expect(bool(refused), "the worker never tried the invalid result (badResultFirst)")
    else:
        _expect(any(p.endswith("/complete") and s == 422 for _, p, s in case.gateway_proxy.seen()),
                "the worker never tried the invalid result (badResultFirst)")
    case.judge_safety()
    return "result, 3 effects once, 6¢/30 tokens charged, invalid result told apart"


def crash_resume(case: Case) -> str:
    """Attempt 1 crashes after checkpointing step 2; attempt 2 resumes there, redoing nothing."""
    case.create_run("job", {"steps": 4, "stepSeconds": 0.2, "centsPerStep": 2, "crashAttempts": [1],
                            "crashAfterStep": 2})
    case.launch("job")
    run = case.wait_phase("job", ("Succeeded", "Failed", "Lost", "Cancelled"), timeout=150)
    _expect(_status(run)["phase"] == "Succeeded", f"ended {_status(run)['phase']}: {_status(run).get('error')}")
    _result_ok(case, run, 4, attempt=2)
    if case.transport == GATEWAY:  # the crash is the fault: an External attempt ends by its lease lapsing
        case.faulted.add((run["metadata"]["uid"], _status(run)["attempts"][0]["holder"]))
    f1, f2 = _fence_of(run, 1), _fence_of(run, 2)
    _exactly_once(case, 4)
    by_step = {e.step: e.fence for e in case.effects()}
    _expect(by_step == {0: f1, 1: f1, 2: f2, 3: f2}, f"steps by fence {by_step}: attempt 2 did not resume at the checkpoint")
    redone = [e for e in case.effects(accepted_only=False) if e.fence == f2 and e.step in (0, 1)]
    _expect(not redone, f"attempt 2 redid steps {[e.step for e in redone]} before its checkpoint")
    usage = _status(run).get("usage") or {}
    _expect(usage.get("cents") == 8, f"status.usage {usage}: 4 cents per attempt were reported")
    case.judge_safety()
    return f"resumed at step 2 (fences {f1}→{f2}), 8¢ charged"


def _cut(case: Case, holder: str) -> Callable[[], None]:
    """Partitions the holder from the control plane (its requests are held, then arrive late)."""
    if case.transport == POD:
        case.worker_proxy.gate(client=rf"{case.ns}/{holder}$", times=None)
        return case.worker_proxy.clear
    case.gateway_proxy.cut()
    return case.gateway_proxy.heal


def _revoked_at(case: Case, name: str, fence: int) -> float:
    """When the operator's status write that moved the fence past `fence` completed."""
    def find() -> float | None:
        for r in case.audit():
            if r.about("workerruns", case.ns, name, "status") and r.accepted and r.user.pod is None and \
                    int(((r.response_object or {}).get("status") or {}).get("fence") or 0) > fence:
                return r.completed.timestamp()
        return None
    return case.wait(find, 30, "the revocation in the audit log")


def partition(case: Case) -> str:
    """The holder is cut off from the control plane past its lease while its side effects still
    reach the receiver; a new attempt takes over; then the old worker reconnects. It must have
    withheld side effects from its self-fencing deadline on, and nothing it sends after the
    revocation may be accepted: renewal, checkpoint, usage or result."""
    case.create_run("job", {"steps": 30, "stepSeconds": 0.3, "centsPerStep": 1})
    w1 = case.start_external("job", "w1") if case.transport == GATEWAY else None
    run = case.wait_holder("job", 1)
    holder, f1 = _status(run)["holder"], _status(run)["fence"]
    _wait_effects(case, 2)
    case.faulted.add((run["metadata"]["uid"], holder))
    cut_at = time.time()
    heal = _cut(case, holder)
    case.wait(lambda: (_status(case.run("job")).get("attempt") or 0) >= 2, 60, "a second attempt after the lease lapsed")
    revoked = _revoked_at(case, "job", f1)
    if case.transport == GATEWAY:
        case.start_external("job", "w2", direct=True)  # the new worker's path is not cut
    case.wait_holder("job", 2)
    heal()
    healed = time.time()
    run = case.wait_phase("job", ("Succeeded", "Failed", "Lost", "Cancelled"), timeout=120)
    _expect(_status(run)["phase"] == "Succeeded", f"ended {_status(run)['phase']}")
    _result_ok(case, run, 30)
    _expect(_status(run)["result"]["attempt"] >= 2, "the partitioned attempt's result was accepted")
    confirmed = [r.received.timestamp() for r in case.lease_writes("job") if r.accepted and r.received.timestamp() < cut_at
                 and ((r.response_object or {}).get("spec") or {}).get("holderIdentity") == holder]
    _expect(bool(confirmed), "no accepted renewal of attempt 1 before the cut")
    deadline = max(confirmed) + L - MARGIN + SLACK
    _no_effects_after(case, f1, deadline, "its self-fencing deadline (last confirmed renewal + L − margin)")
    late = [r for r in case.audit() if r.accepted and r.is_write and r.user.pod == holder and r.received.timestamp() > revoked]
    _expect(not late, f"{len(late)} write(s) of the revoked pod accepted after the revocation")
    if w1 is not None:
        case.wait(lambda: w1.poll() is not None, 3 * R + 10, "the old worker to notice it lost the run and exit")
        _expect(w1.returncode in (1, 2), f"the old worker exited {w1.returncode} (1 lost or 2 unknown expected)")
    case.judge_safety()
    return f"withheld effects from deadline; nothing accepted after revocation; healed {healed - revoked:.1f}s later"


def revoked_while_reconnecting(case: Case) -> str:
    """The old worker's held renewal reaches the API server exactly between the operator's two
    revocation steps (fence bumped, Lease not yet cleared), so the API server may accept it (the
    documented revocation window). The worker must learn it lost on its very next renewal, stop
    within one renew interval, and never have its result accepted; no step is done twice."""
    case.create_run("job", {"steps": 30, "stepSeconds": 0.3})
    run = case.wait_holder("job", 1)
    holder, f1 = _status(run)["holder"], _status(run)["fence"]
    _wait_effects(case, 2)
    case.faulted.add((run["metadata"]["uid"], holder))
    gate = case.operator_proxy.gate(method="PUT|PATCH|DELETE", path=r"/leases/job$")
    case.worker_proxy.gate(client=rf"{case.ns}/{holder}$", times=None)
    try:
        gate.wait_arrived(timeout=60)  # the fence moved; the Lease still names the old holder
    except AssertionError as exc:
        raise Fail("the operator never reached the Lease step of the revocation") from exc
    released = time.time()
    case.worker_proxy.clear()  # the old worker reconnects now
    case.wait(lambda: any(r.user.pod == holder and r.received.timestamp() > released
                          for r in case.lease_writes("job")), 15, "the old worker's renewal after reconnecting")
    case.operator_proxy.clear()
    cleared = case.wait(lambda: next((r.completed.timestamp() for r in case.lease_writes("job")
                                      if r.accepted and r.user.pod is None and r.received.timestamp() > released
                                      and ((r.response_object or {}).get("spec") or {}).get("holderIdentity") != holder),
                                     None), 30, "the operator clearing the Lease")
    run = case.wait_phase("job", ("Succeeded", "Failed", "Lost", "Cancelled"), timeout=120)
    _expect(_status(run)["phase"] == "Succeeded", f"ended {_status(run)['phase']}")
    _expect(_status(run)["result"].get("attempt", 0) >= 2, "the revoked attempt's result was accepted")
    _exactly_once(case, 30)
    _no_effects_after(case, f1, cleared + R + 0.3 + 1.0 + SLACK, "the Lease was cleared (one renew interval)")
    late = [r for r in case.audit() if r.accepted and r.is_write and r.user.pod == holder and r.received.timestamp() > cleared]
    _expect(not late, f"{len(late)} write(s) of the revoked pod accepted after the Lease was cleared")
    case.judge_safety()
    window = [r for r in case.lease_writes("job") if r.user.pod == holder and r.received.timestamp() > released]
    return f"reconnect in the window: {sum(r.accepted for r in window)} renewal(s) accepted there, then refused"


def _exited(case: Case, proc: Any, since: float, within: float, what: str) -> float:
    case.wait(lambda: proc.poll() is not None, within + 10, what)
    return time.time() - since


def stop(case: Case) -> str:
    """spec.stop: the worker must start no side effect after one renew interval and exit on its
    own, long before stopGraceSeconds would have the operator end it."""
    case.create_run("job", {"steps": 200, "stepSeconds": 0.2}, stopGraceSeconds=60)
    w1 = case.start_external("job", "w1") if case.transport == GATEWAY else None
    run = case.wait_holder("job", 1)
    fence = _status(run)["fence"]
    _wait_effects(case, 2)
    case.kube.ok(case.kube.patch(Kube.wr_path(case.ns, "job"), {"spec": {"stop": True}}))
    told = case.signal_time("job", lambda s: bool(s.get("stop")))
    bound = R + 0.2 + 1.0 + SLACK
    if w1 is not None:
        took = _exited(case, w1, told, bound, "the worker to exit after stop")
        _expect(w1.returncode == 0, f"exit code {w1.returncode} after stop (0 expected)")
    else:
        case.wait_phase("job", ("Cancelled",), timeout=bound + 10)
        took = time.time() - told
    # The pod's end reaches the run through the kubelet and the operator: allow them 2 s more.
    _expect(took <= bound + (2.0 if w1 is None else 0.0), f"exited {took:.1f}s after the stop signal")
    _no_effects_after(case, fence, told + bound, "the stop signal (one renew interval)")
    run = case.wait_phase("job", ("Cancelled", "Succeeded", "Failed", "Lost"), timeout=90)
    _expect(_status(run)["phase"] == "Cancelled" and "result" not in _status(run),
            f"ended {_status(run)['phase']} with result {_status(run).get('result')!r} after stop")
    case.judge_safety()
    return f"stopped effects within {R + 0.2:.1f}s bound; exited {took:.1f}s after the signal"


def pause(case: Case) -> str:
    """spec.suspend: effects and progress stop within one renew interval while the heartbeat goes
    on (the pause outlasts the lease); on resume the same attempt finishes."""
    case.create_run("job", {"steps": 8, "stepSeconds": 0.2})
    case.launch("job")
    run = case.wait_holder("job", 1)
    holder = _status(run)["holder"]
    _wait_effects(case, 2)
    case.kube.ok(case.kube.patch(Kube.wr_path(case.ns, "job"), {"spec": {"suspend": True}}))
    told = case.signal_time("job", lambda s: bool(s.get("paused")))
    time.sleep(L + 2)  # the pause itself: it must outlast a lease to show the heartbeat goes on
    resumed = time.time()
    fence = _status(case.run("job"))["fence"]
    _no_effects_after(case, fence, told + R + 0.2 + 1.0 + SLACK, "the pause signal")
    renewals = _renewals(case, "job", holder, told + R, resumed)
    _expect(renewals >= int(L / R) - 2, f"only {renewals} renewals during a {resumed - told:.0f}s pause")
    case.kube.ok(case.kube.patch(Kube.wr_path(case.ns, "job"), {"spec": {"suspend": False}}))
    run = case.wait_phase("job", ("Succeeded", "Failed", "Lost", "Cancelled"), timeout=60)
    _expect(_status(run)["phase"] == "Succeeded", f"ended {_status(run)['phase']}")
    _result_ok(case, run, 8, attempt=1)
    _exactly_once(case, 8)
    case.judge_safety()
    return f"{renewals} renewals while paused {resumed - told:.0f}s; resumed in attempt 1"


def cap(case: Case) -> str:
    """The run's cap is lowered below what the worker spent: told to stop on its next renewal, it
    must stop spending and exit within one renew interval; it is charged exactly what it reported."""
    case.create_run("job", {"steps": 100, "stepSeconds": 0.2, "centsPerStep": 2}, stopGraceSeconds=60,
                    budget={"capCents": 1000})
    w1 = case.start_external("job", "w1") if case.transport == GATEWAY else None
    run = case.wait_holder("job", 1)
    holder, fence = _status(run)["holder"], _status(run)["fence"]
    _wait_effects(case, 3)
    case.kube.ok(case.kube.patch(Kube.wr_path(case.ns, "job"), {"spec": {"budget": {"capCents": 4}}}))
    told = case.signal_time("job", lambda s: bool(s.get("stop")))
    bound = told + R + 0.2 + 1.0 + SLACK
    if w1 is not None:
        _exited(case, w1, told, bound - told, "the worker to exit at its cap")
    run = case.wait_phase("job", ("BudgetExceeded", "Succeeded", "Failed", "Lost", "Cancelled"), timeout=90)
    _expect(_status(run)["phase"] == "BudgetExceeded", f"ended {_status(run)['phase']}")
    _no_effects_after(case, fence, bound, "the cap's stop signal (one renew interval)")
    at_bound, final = _usage_on_lease(case, "job", holder, until=bound + R), _usage_on_lease(case, "job", holder)
    _expect(at_bound == final, f"usage kept growing after the stop: {at_bound} then {final}")
    # Every step done was paid for: its effect was accepted, so its 2¢ must be reported and charged
    # (a worker that leaves without a last renewal under-reports).
    spent = 2 * sum(1 for e in case.effects() if e.fence == fence)
    usage = _status(run).get("usage") or {}
    _expect(final is not None and final[0] == spent, f"the worker reported {final} but did {spent // 2} steps ({spent}¢)")
    _expect(usage.get("cents") == spent, f"charged {usage} for {spent}¢ of steps")
    case.judge_safety()
    return f"stopped at {spent}¢ ({spent // 2} steps), reported and charged exactly"


def backoff(case: Case) -> str:
    """The control plane answers 429, then 503 with Retry-After for 4 s while the worker renews and
    publishes: it must slow down (no retry storm), keep its lease, and publish once it can."""
    case.create_run("job", {"steps": 6, "stepSeconds": 0.2})
    w1 = case.start_external("job", "w1") if case.transport == GATEWAY else None
    run = case.wait_holder("job", 1)
    holder = _status(run)["holder"]
    _wait_effects(case, 2)
    start, mono = time.time(), time.monotonic()
    if case.transport == POD:
        rule = case.worker_proxy.status(429, retry_after=1, client=rf"{case.ns}/{holder}$")
        time.sleep(2)
        rule.remove()
        case.worker_proxy.status(503, retry_after=1, client=rf"{case.ns}/{holder}$")
        time.sleep(2)
        case.worker_proxy.clear()
        faulted = [r for r in case.worker_proxy.requests(lambda r: r.client.endswith(f"/{holder}"))
                   if mono <= r.started <= mono + 4]
        count = len(faulted)
    else:
        case.gateway_proxy.fail_with(429)
        time.sleep(2)
        case.gateway_proxy.fail_with(503)
        time.sleep(2)
        case.gateway_proxy.heal()
        count = sum(1 for t, _, _ in case.gateway_proxy.seen() if start <= t <= start + 4)
    limit = int(2 * 4 / R) + 4
    _expect(count <= limit, f"{count} requests in 4 s of 429/503 (a storm; at most {limit})")
    run = case.wait_phase("job", ("Succeeded", "Failed", "Lost", "Cancelled"), timeout=60)
    _expect(_status(run)["phase"] == "Succeeded", f"ended {_status(run)['phase']} after the 429/503 window")
    _result_ok(case, run, 6, attempt=1)
    if w1 is not None:
        case.wait(lambda: w1.poll() is not None, 10, "the worker to exit")
    case.judge_safety()
    return f"{count} requests in the 4 s window (limit {limit}); kept the lease"


SCENARIOS = [
    Scenario("happy", happy, summary="result, effects once, usage charged exactly, bad result ≠ lost"),
    Scenario("crash-resume", crash_resume, summary="crash, then resume from the checkpoint"),
    Scenario("partition", partition, summary="cut past the lease, reconnect: all refused or withheld"),
    Scenario("revoked-while-reconnecting", revoked_while_reconnecting, transports=(POD,), operator_behind_proxy=True,
             summary="reconnect between the revocation's two steps"),
    Scenario("stop", stop, summary="spec.stop honoured within one renew interval"),
    Scenario("pause", pause, summary="spec.suspend honoured within one renew interval, heartbeat goes on"),
    Scenario("cap", cap, summary="a lowered cap honoured within one renew interval, charged exactly"),
    Scenario("backoff", backoff, summary="429/503 with Retry-After: backoff, no storm, lease kept"),
]
