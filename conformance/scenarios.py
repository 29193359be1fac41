"""The scenarios a worker must pass, each judged from the audit log, the final objects, the
requests its proxies saw and the receiver's record — never from the worker's own account.

Each scenario takes a started Case, raises Fail with the reason when the worker breaks the
protocol, and returns a short note of what it measured. Times: L = 8 s, R = 1 s (harness.LEASE)
unless a scenario says otherwise; the worker's self-fencing margin is M = max(1 s, L/10)
(docs/protocol.md §1).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

from conformance.harness import GATEWAY, LEASE, POD, Case, Fail, Sent
from testkit.kube import Kube

L, R = float(LEASE["durationSeconds"]), float(LEASE["renewIntervalSeconds"])
MARGIN = max(1.0, L / 10)
SLACK = 0.5  # scheduling and loopback latency on a loaded 2-core machine
KNOWN_SDKS = ("python", "python-async", "typescript", "go")
ENDED = ("Succeeded", "Failed", "Lost", "Cancelled", "BudgetExceeded", "DeadlineExceeded", "Rejected")
LOST_ANSWERS = (403, 404, 409, 410, 422)  # what tells a worker it no longer owns the run


@dataclass(frozen=True)
class Scenario:
    name: str
    fn: Callable[[Case], str]
    transports: tuple[str, ...] = (POD, GATEWAY)
    operator_behind_proxy: bool = False
    summary: str = ""


# --- reading the evidence ---------------------------------------------------------------


def _status(run: dict[str, Any]) -> dict[str, Any]:
    return run.get("status") or {}


def _expect(cond: bool, reason: str) -> None:
    if not cond:
        raise Fail(reason)


def _succeeded(case: Case, steps: int, attempt: int | None = None, timeout: float = 120) -> dict[str, Any]:
    run = case.wait_phase("job", ENDED, timeout=timeout)
    st = _status(run)
    _expect(st["phase"] == "Succeeded", f"ended {st['phase']}: {st.get('error')}")
    result = st.get("result")
    _expect(isinstance(result, dict) and result.get("steps") == steps,
            f"result {result!r} is not the script's (steps {steps})")
    if attempt is not None:
        _expect(result.get("attempt") == attempt, f"the result came from attempt {result.get('attempt')}, not {attempt}")
    if case.sdk in KNOWN_SDKS:
        _expect(result.get("sdk") == case.sdk, f"result names sdk {result.get('sdk')!r}, not {case.sdk!r}")
    return run


def _wait_effects(case: Case, n: int, timeout: float = 60) -> None:
    case.wait(lambda: len(case.effects()) >= n, timeout, f"{n} side effects")


def _fence_of(run: dict[str, Any], attempt: int) -> int:
    for a in _status(run).get("attempts") or []:
        if a.get("attempt") == attempt:
            return int(a["fence"])
    if _status(run).get("attempt") == attempt:
        return int(_status(run)["fence"])
    raise Fail(f"attempt {attempt} has no record in the run's status")


def _keys_ok(case: Case, run: dict[str, Any]) -> None:
    """Idempotency-Key is `<idempotencyKey>:<operation>`, the same for every attempt (the run's
    UID here: the spec names no key); a per-attempt key would defeat the receiver."""
    key = run["spec"].get("idempotencyKey") or run["metadata"]["uid"]
    wrong = {e.key for e in case.effects(accepted_only=False) if e.key.rsplit(":", 1)[0] != key}
    _expect(not wrong, f"side effects carried Idempotency-Key {sorted(wrong)[:3]}, not {key}:<operation>")


def _exactly_once(case: Case, steps: int) -> None:
    keys = [e.key.rsplit(":", 1)[-1] for e in case.effects()]
    _expect(sorted(keys) == sorted(f"step-{i}" for i in range(steps)),
            f"side effects accepted {sorted(keys)}, not each of {steps} steps exactly once")


def _lease_annotation(r: Any, key: str) -> str | None:
    return (((r.response_object or {}).get("metadata") or {}).get("annotations") or {}).get(key)


def _holder_of(r: Any) -> str | None:
    return ((r.response_object or {}).get("spec") or {}).get("holderIdentity")


def _usage_on_lease(case: Case, name: str, holder: str) -> tuple[int, int] | None:
    """The last usage the holder's accepted renewals carried."""
    last = None
    for r in case.lease_writes(name):
        if not r.accepted or _holder_of(r) != holder:
            continue
        raw = _lease_annotation(r, "tether.dev/usage")
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            raise Fail(f"an accepted renewal carried a malformed usage annotation {raw!r}") from None
        if isinstance(doc, dict):
            last = (int(doc.get("cents", 0)), int(doc.get("tokens", 0)))
    return last


def _renewals(case: Case, name: str, holder: str, after: float, before: float) -> list[Any]:
    """The holder's accepted renewals between two wall times (External: the gateway's, for it)."""
    return [r for r in case.lease_writes(name)
            if r.accepted and after <= r.received.timestamp() <= before and _holder_of(r) == holder
            and (r.user.pod == holder or (case.transport == GATEWAY and r.user.pod is None))]


def _no_effects_after(case: Case, fence: int, deadline: float, why: str) -> None:
    """No side effect of this fence or older (or without a fence at all) sent after `deadline`."""
    late = [e for e in case.effects(accepted_only=False) if (e.fence is None or e.fence <= fence) and e.at > deadline]
    _expect(not late, f"{len(late)} side effect(s) of fence ≤ {fence} sent up to "
                      f"{max(e.at for e in late) - deadline if late else 0:.1f}s after {why}")


def _no_effects_once_heard(case: Case, fence: int, holder: str, told: float, why: str) -> None:
    """A signal the operator wrote at `told` reaches the worker on its next renewal, which the SDK
    sends within one renew interval (plus the previous renewal's time on a loaded machine); once that
    renewal is answered, at most the step already under way (0.2 s) may still send its effect. Two
    checks, so that a failure says which side was late: the SDK's schedule or its gate."""
    answered = [(r.at, r.answered) for r in case.worker_requests(holder)
                if r.at > told and r.status and r.answered is not None]
    _expect(bool(answered), f"the worker sent no answered request after {why}")
    sent, heard = answered[0]
    _expect(sent - told <= R + 1.0 + SLACK,
            f"the worker's first request after {why} went out {sent - told:.1f}s later (it renews every {R:.0f}s)")
    _no_effects_after(case, fence, heard + 0.2 + SLACK,
                      f"{why} reached the worker (its request at +{sent - told:.1f}s, answered +{heard - told:.1f}s)")


def _quiet_after_lost(case: Case, holder: str, since: float) -> None:
    """Once told it lost the run, a worker sends at most one more request (a read, or the retry of
    a held one): no renewal storm, no second publication."""
    sent = [r for r in case.worker_requests(holder) if r.at >= since]
    first = next((i for i, r in enumerate(sent) if r.status in LOST_ANSWERS), None)
    if first is None:
        return
    after = [r for r in sent[first + 1:] if r.at > sent[first].at + 0.05]
    _expect(len(after) <= 2, f"{len(after)} requests after it was told it lost the run: "
                             f"{[(r.method, r.path.rsplit('/', 1)[-1], r.status) for r in after[:5]]}")


def _budget(case: Case, name: str, limit: int) -> None:
    case.kube.ok(case.kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{case.ns}/workerbudgets", {
        "apiVersion": "tether.dev/v1alpha1", "kind": "WorkerBudget", "metadata": {"name": name},
        "spec": {"limitCents": limit}}))


def _last_confirmed(case: Case, name: str, holder: str, before: float) -> float:
    """When the holder sent its last renewal that was confirmed before `before` (its confirmedAt).
    Pods: the API server received it; External: the worker sent it to the gateway (its proxy saw it)."""
    if case.transport == POD:
        times = [r.received.timestamp() for r in case.lease_writes(name)
                 if r.accepted and r.user.pod == holder and r.received.timestamp() < before]
    else:
        times = [r.at for r in case.worker_requests(holder)
                 if r.status == 200 and r.path.rsplit("/", 1)[-1] in ("heartbeat", "checkpoint", "claim")
                 and r.at < before]
    _expect(bool(times), f"no confirmed renewal of {holder} before the fault")
    return max(times)


def _revoked_at(case: Case, name: str, fence: int) -> float:
    """When the operator's status write that moved the fence past `fence` completed."""
    def find() -> float | None:
        for r in case.audit():
            if r.about("workerruns", case.ns, name, "status") and r.accepted and r.user.pod is None and \
                    int(((r.response_object or {}).get("status") or {}).get("fence") or 0) > fence:
                return r.completed.timestamp()
        return None
    return case.wait(find, 30, "the revocation in the audit log")


def _no_writes_after(case: Case, name: str, holder: str, since: float, what: str) -> None:
    """No accepted write made by or for the holder after `since`: a pod's own writes, or (External)
    a Lease write that still names it, which only the gateway renewing for it makes."""
    late = [r for r in case.audit() if r.accepted and r.is_write and r.received.timestamp() > since and (
        r.user.pod == holder or (case.transport == GATEWAY and r.user.pod is None and r.verb in ("update", "patch")
                                 and r.about("leases", case.ns, name) and _holder_of(r) == holder))]
    _expect(not late, f"{len(late)} write(s) of {holder} accepted after {what}")


def _cut(case: Case, holder: str) -> Callable[[], None]:
    """Partitions the holder from the control plane (its requests are held, then arrive late)."""
    if case.transport == POD:
        case.worker_proxy.gate(client=rf"{case.ns}/{holder}$", times=None)
        return case.worker_proxy.clear
    case.gateway_proxy.cut()
    return case.gateway_proxy.heal


def _is_publication(r: Sent) -> bool:
    return r.method == "PATCH" or r.path.endswith(("/complete", "/fail"))


def _exit_code(case: Case, proc: Any, holder: str, timeout: float) -> int:
    """How the attempt's worker exited: its process (External) or its pod's container."""
    if proc is None:
        return case.exit_code(holder, timeout)
    case.wait(lambda: proc.poll() is not None, timeout, "the worker to exit")
    return int(proc.returncode)


def _start(case: Case) -> Any:
    """External: the worker process (the case watches it); pods start on their own."""
    return case.start_external("job", "w1") if case.transport == GATEWAY else None


# --- scenarios --------------------------------------------------------------------------


def happy(case: Case) -> str:
    """Claim or start, steps with side effects, usage on the heartbeat, a result the CRD refuses
    (reported as a bad result, not as lost ownership), then the real result; charged exactly."""
    _budget(case, "team", 10_000)
    case.create_run("job", {"steps": 3, "stepSeconds": 0.3, "centsPerStep": 2, "tokensPerStep": 10,
                            "badResultFirst": True}, budget={"budgetRef": {"name": "team"}})
    case.launch("job")
    run = _succeeded(case, 3, attempt=1)
    _exactly_once(case, 3)
    _keys_ok(case, run)
    fence, holder = _fence_of(run, 1), _status(run)["attempts"][0]["holder"]
    _expect({e.fence for e in case.effects()} == {fence},
            f"side effects carried fences {[e.fence for e in case.effects()]}, not the attempt's {fence}")
    first = min(e.at for e in case.effects())
    _expect(first >= _last_confirmed(case, "job", holder, first + 1e-3) - 1e-3,
            "a side effect was sent before the first confirmed renewal")
    usage = _status(run).get("usage") or {}
    _expect((usage.get("cents"), usage.get("tokens")) == (6, 30), f"status.usage {usage}, reported 6 cents/30 tokens")
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
        _expect(any(r.path.endswith("/complete") and r.status == 422 for r in case.worker_requests(holder)),
                "the worker never tried the invalid result (badResultFirst)")
    case.judge_safety()
    return "result, 3 effects once, 6¢/30 tokens charged, invalid result told apart"


def crash_resume(case: Case) -> str:
    """Attempt 1 crashes after checkpointing step 2; attempt 2 resumes there, redoing nothing."""
    case.create_run("job", {"steps": 4, "stepSeconds": 0.2, "centsPerStep": 2, "crashAttempts": [1],
                            "crashAfterStep": 2})
    case.launch("job")
    run = _succeeded(case, 4, attempt=2, timeout=150)
    if case.transport == GATEWAY:  # the crash is the fault: an External attempt ends by its lease lapsing
        case.faulted.add((run["metadata"]["uid"], _status(run)["attempts"][0]["holder"]))
    f1, f2 = _fence_of(run, 1), _fence_of(run, 2)
    _exactly_once(case, 4)
    _keys_ok(case, run)
    by_step = {e.step: e.fence for e in case.effects()}
    _expect(by_step == {0: f1, 1: f1, 2: f2, 3: f2}, f"steps by fence {by_step}: attempt 2 did not resume at the checkpoint")
    redone = [e for e in case.effects(accepted_only=False) if e.fence == f2 and e.step in (0, 1)]
    _expect(not redone, f"attempt 2 redid steps {[e.step for e in redone]} before its checkpoint")
    usage = _status(run).get("usage") or {}
    _expect(usage.get("cents") == 8, f"status.usage {usage}: 4 cents per attempt were reported")
    case.judge_safety()
    return f"resumed at step 2 (fences {f1}→{f2}), 8¢ charged"


def partition(case: Case) -> str:
    """The holder is cut off from the control plane past its lease while its side effects still
    reach the receiver; a new attempt takes over; then the old worker reconnects. It must have
    withheld side effects from its self-fencing deadline on, nothing it sends after the
    revocation may be accepted (renewal, checkpoint, usage, result), and once told it lost the
    run it goes quiet."""
    case.create_run("job", {"steps": 30, "stepSeconds": 0.3, "centsPerStep": 1})
    w1 = _start(case)
    run = case.wait_holder("job", 1)
    holder, f1 = _status(run)["holder"], _status(run)["fence"]
    if case.transport == POD:
        case.keep_pod(holder)
    _wait_effects(case, 2)
    case.faulted.add((run["metadata"]["uid"], holder))
    heal = _cut(case, holder)
    case.wait(lambda: (_status(case.run("job")).get("attempt") or 0) >= 2, 60, "a second attempt after the lease lapsed")
    revoked = _revoked_at(case, "job", f1)
    if case.transport == GATEWAY:
        case.start_external("job", "w2", direct=True)  # the new worker's path is not cut
    case.wait_holder("job", 2)
    healed = time.time()
    heal()
    run = _succeeded(case, 30)
    _expect(_status(run)["result"]["attempt"] >= 2, "the partitioned attempt's result was accepted")
    _keys_ok(case, run)
    deadline = _last_confirmed(case, "job", holder, revoked) + L - MARGIN + SLACK
    _no_effects_after(case, f1, deadline, "its self-fencing deadline (last confirmed renewal + L − M)")
    _no_writes_after(case, "job", holder, revoked, "the revocation")
    code = _exit_code(case, w1, holder, 3 * R + 10)
    _expect(code == 1, f"the old worker exited {code} once it reconnected (1: it lost the run)")
    _quiet_after_lost(case, holder, healed)
    case.judge_safety()
    return "withheld effects from its deadline; nothing accepted after revocation; quiet once lost"


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
        gate.wait_arrived(timeout=60)
    except AssertionError as exc:
        raise Fail("harness: the operator never reached the Lease step of the revocation") from exc
    if (_status(case.run("job")).get("fence") or 0) <= f1:
        raise Fail("harness: the operator's held Lease write was not the revocation's (the fence has not moved)")
    released = time.time()
    case.worker_proxy.clear()  # the old worker reconnects now
    case.wait(lambda: any(r.user.pod == holder and r.received.timestamp() > released
                          for r in case.lease_writes("job")), 15, "the old worker's renewal after reconnecting")
    case.operator_proxy.clear()
    cleared = case.wait(lambda: next((r.completed.timestamp() for r in case.lease_writes("job")
                                      if r.accepted and r.user.pod is None and r.received.timestamp() > released
                                      and _holder_of(r) != holder), None), 30, "the operator clearing the Lease")
    run = _succeeded(case, 30)
    _expect(_status(run)["result"].get("attempt", 0) >= 2, "the revoked attempt's result was accepted")
    _exactly_once(case, 30)
    _keys_ok(case, run)
    _no_effects_after(case, f1, cleared + R + 0.3 + 1.0 + SLACK, "the Lease was cleared (one renew interval)")
    _no_writes_after(case, "job", holder, cleared, "the Lease was cleared")
    _quiet_after_lost(case, holder, released)
    case.judge_safety()
    window = [r for r in case.lease_writes("job") if r.user.pod == holder and r.received.timestamp() > released]
    return f"reconnected in the window: {sum(r.accepted for r in window)} renewal(s) accepted there, then refused"


def _exited(case: Case, proc: Any, since: float, within: float, what: str) -> float:
    """Waits for the external worker to exit; returns how long after `since` it had."""
    case.wait(lambda: proc.poll() is not None, within + 10, what)
    return time.time() - since


def _stopped_in_time(case: Case, w1: Any, holder: str, told: float, bound: float, why: str) -> float:
    """The worker ended within `bound` of `told`: its process exited (External), or its last
    request (the final renewal) went out, after which its pod ended the attempt (pods)."""
    if w1 is not None:
        took = _exited(case, w1, told, bound, f"the worker to exit after {why}")
        _expect(w1.returncode == 0, f"exit code {w1.returncode} after {why} (0 expected)")
        _expect(took <= bound, f"the worker exited {took:.1f}s after {why} (at most {bound:.1f}s)")
        return took
    run = case.wait_phase("job", ENDED, timeout=bound + 15)
    attempt = (_status(run).get("attempts") or [{}])[0]
    _expect(attempt.get("exitCode") == 0 or attempt.get("outcome") in ("Cancelled", "BudgetExceeded"),
            f"attempt 1 ended {attempt.get('outcome')} with exit code {attempt.get('exitCode')}")
    last = max((r.at for r in case.worker_requests(holder)), default=told)
    took = last - told
    _expect(took <= bound + 1.0, f"the worker still sent requests {took:.1f}s after {why}")
    return took


def stop(case: Case) -> str:
    """spec.stop: the worker must start no side effect after one renew interval and exit on its
    own, long before stopGraceSeconds would have the operator end it."""
    case.create_run("job", {"steps": 200, "stepSeconds": 0.2, "centsPerStep": 1}, stopGraceSeconds=60)
    w1 = _start(case)
    run = case.wait_holder("job", 1)
    fence, holder = _status(run)["fence"], _status(run)["holder"]
    _wait_effects(case, 2)
    case.kube.ok(case.kube.patch(Kube.wr_path(case.ns, "job"), {"spec": {"stop": True}}))
    told = case.signal_time("job", lambda s: bool(s.get("stop")))
    bound = R + 0.2 + 1.0 + SLACK
    took = _stopped_in_time(case, w1, holder, told, bound, "the stop signal")
    _no_effects_once_heard(case, fence, holder, told, "the stop signal")
    run = case.wait_phase("job", ENDED, timeout=90)
    _expect(_status(run)["phase"] == "Cancelled" and "result" not in _status(run),
            f"ended {_status(run)['phase']} with result {_status(run).get('result')!r} after stop")
    spent = sum(1 for e in case.effects() if e.fence == fence)
    _expect((_status(run).get("usage") or {}).get("cents") == spent,
            f"charged {_status(run).get('usage')} for {spent} steps of 1¢: the last renewal did not report them")
    case.judge_safety()
    return f"no effects after {bound:.1f}s; done {took:.1f}s after the signal; {spent}¢ reported and charged"


def pause(case: Case) -> str:
    """spec.suspend: effects and progress stop within one renew interval while the heartbeat goes
    on (the pause outlasts the lease); on resume the same attempt finishes."""
    case.create_run("job", {"steps": 8, "stepSeconds": 0.2, "centsPerStep": 1})
    case.launch("job")
    run = case.wait_holder("job", 1)
    holder = _status(run)["holder"]
    _wait_effects(case, 2)
    case.kube.ok(case.kube.patch(Kube.wr_path(case.ns, "job"), {"spec": {"suspend": True}}))
    told = case.signal_time("job", lambda s: bool(s.get("paused")))
    time.sleep(L + 2)  # the pause itself: it must outlast a lease to show the heartbeat goes on
    resumed = time.time()
    fence = _status(case.run("job"))["fence"]
    settled = told + R + 0.2 + 1.0 + SLACK
    _no_effects_after(case, fence, settled, "the pause signal")
    renewals = _renewals(case, "job", holder, settled, resumed)
    _expect(len(renewals) >= int((resumed - settled) / R) - 2,
            f"only {len(renewals)} renewals during a {resumed - settled:.0f}s pause")
    progress = {(_lease_annotation(r, "tether.dev/checkpoint"), _lease_annotation(r, "tether.dev/usage"))
                for r in renewals}
    _expect(len(progress) <= 1, f"checkpoint or usage moved while paused: {sorted(map(str, progress))[:3]}")
    case.kube.ok(case.kube.patch(Kube.wr_path(case.ns, "job"), {"spec": {"suspend": False}}))
    run = _succeeded(case, 8, attempt=1, timeout=60)
    _exactly_once(case, 8)
    case.judge_safety()
    return f"{len(renewals)} renewals, no progress while paused {resumed - told:.0f}s; resumed in attempt 1"


def cap(case: Case) -> str:
    """The run's cap is lowered below what the worker spent: told to stop on its next renewal, it
    must stop spending and exit within one renew interval, reporting every step it did."""
    case.create_run("job", {"steps": 100, "stepSeconds": 0.2, "centsPerStep": 2}, stopGraceSeconds=60,
                    budget={"capCents": 1000})
    w1 = _start(case)
    run = case.wait_holder("job", 1)
    holder, fence = _status(run)["holder"], _status(run)["fence"]
    _wait_effects(case, 3)
    case.kube.ok(case.kube.patch(Kube.wr_path(case.ns, "job"), {"spec": {"budget": {"capCents": 4}}}))
    told = case.signal_time("job", lambda s: bool(s.get("stop")))
    bound = R + 0.2 + 1.0 + SLACK
    took = _stopped_in_time(case, w1, holder, told, bound, "the cap's stop signal")
    run = case.wait_phase("job", ENDED, timeout=90)
    _expect(_status(run)["phase"] == "BudgetExceeded", f"ended {_status(run)['phase']}")
    _no_effects_once_heard(case, fence, holder, told, "the cap's stop signal")
    # Every step done was paid for: its effect was accepted, so its 2¢ must be reported and charged
    # (a worker that leaves without a last renewal under-reports).
    spent = 2 * sum(1 for e in case.effects() if e.fence == fence)
    final = _usage_on_lease(case, "job", holder)
    usage = _status(run).get("usage") or {}
    _expect(final is not None and final[0] == spent, f"the worker reported {final} but did {spent // 2} steps ({spent}¢)")
    _expect(usage.get("cents") == spent, f"charged {usage} for {spent}¢ of steps")
    case.judge_safety()
    return f"stopped {took:.1f}s after the signal at {spent}¢ ({spent // 2} steps), reported and charged exactly"


RETRY_AFTER = 3


def backoff(case: Case) -> str:
    """The control plane answers 429, then 503, each with Retry-After: 3, for 4 s while the worker
    renews and publishes: renewals stay at one per interval, publication retries wait as asked,
    the lease is kept, and the result lands once the control plane answers again."""
    case.create_run("job", {"steps": 6, "stepSeconds": 0.2})
    w1 = _start(case)
    run = case.wait_holder("job", 1)
    holder = _status(run)["holder"]
    _wait_effects(case, 2)
    start = time.time()
    if case.transport == POD:
        rule = case.worker_proxy.status(429, retry_after=RETRY_AFTER, client=rf"{case.ns}/{holder}$")
        time.sleep(2)  # the fault's duration, not a wait for a condition
        rule.remove()
        case.worker_proxy.status(503, retry_after=RETRY_AFTER, client=rf"{case.ns}/{holder}$")
        time.sleep(2)
        case.worker_proxy.clear()
    else:
        case.gateway_proxy.fail_with(429, RETRY_AFTER)
        time.sleep(2)
        case.gateway_proxy.fail_with(503, RETRY_AFTER)
        time.sleep(2)
        case.gateway_proxy.heal()
    window = [r for r in case.worker_requests(holder) if start <= r.at <= start + 4]
    _expect({429, 503} <= {r.status for r in window}, f"the worker got {sorted({r.status for r in window})} in the "
                                                        "window: its requests did not go through the proxy")
    publishes = [r for r in window if _is_publication(r)]
    renewals = [r for r in window if r not in publishes and r.method != "GET"]
    _expect(len(renewals) <= int(4 / R) + 2, f"{len(renewals)} renewals in 4 s of 429/503 (one per {R:.0f}s expected)")
    # From the first try on, each answer asked for RETRY_AFTER seconds of quiet.
    limit = 1 + int((start + 4 - publishes[0].at) / RETRY_AFTER) if publishes else 0
    _expect(len(publishes) <= limit, f"{len(publishes)} publication tries in {start + 4 - publishes[0].at:.1f}s of "
                                     f"answers with Retry-After: {RETRY_AFTER} (at most {limit})")
    _succeeded(case, 6, attempt=1, timeout=60)
    if w1 is not None:
        case.wait(lambda: w1.poll() is not None, 10, "the worker to exit")
    case.judge_safety()
    return f"{len(renewals)} renewals and {len(publishes)} publication tries in the 4 s window; kept the lease"


# What a proxy between the worker and the control plane may answer 200 with: its sign-in page, then
# JSON that is not the answer (a Status where the Lease belongs; a list where the gateway's reply does).
SIGN_IN_PAGE = "<!DOCTYPE html><html><body>Please sign in to continue.</body></html>"
NOT_THE_ANSWER = {POD: json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                   "code": 200}),
                  GATEWAY: json.dumps({})}  # an object: what the gateway SDKs once took for the reply (§6.4)
PAGE_SECONDS = 2.0


def proxy_page(case: Case) -> str:
    """Something between the worker and the control plane answers its renewals 200 with what is not
    their answer, a sign-in page and then JSON of another shape, for 4 s (inside L − M): each such
    renewal is unconfirmed, not lost (docs/protocol.md §5.2). The worker goes on renewing, withholds
    side effects should ownership turn unknown, and finishes in the same attempt."""
    case.create_run("job", {"steps": 16, "stepSeconds": 0.5})
    _start(case)
    run = case.wait_holder("job", 1)
    holder = _status(run)["holder"]
    _wait_effects(case, 2)
    start = time.time()
    if case.transport == POD:
        lease: dict[str, Any] = {"method": "GET|PUT", "path": r"/leases/job$", "client": rf"{case.ns}/{holder}$"}
        page = case.worker_proxy.answer(200, SIGN_IN_PAGE.encode(), content_type="text/html", **lease)
        time.sleep(PAGE_SECONDS)  # the fault's duration, not a wait for a condition
        page.remove()
        # This time the API server renewed the Lease; the worker is told something else.
        other = case.worker_proxy.answer(200, NOT_THE_ANSWER[POD].encode(), phase="response", **lease)
        time.sleep(PAGE_SECONDS)
        case.worker_proxy.clear()
        healed = time.time()
        answered = (page.hits, other.hits)
    else:
        case.gateway_proxy.answer_with(r"/heartbeat$", 200, SIGN_IN_PAGE, "text/html")
        time.sleep(PAGE_SECONDS)
        mid = time.time()
        case.gateway_proxy.answer_with(r"/heartbeat$", 200, NOT_THE_ANSWER[GATEWAY])
        time.sleep(PAGE_SECONDS)
        case.gateway_proxy.heal()
        healed = time.time()
        beats = [r.at for r in case.worker_requests(holder) if start <= r.at < healed and r.path.endswith("/heartbeat")]
        answered = (sum(1 for t in beats if t < mid), sum(1 for t in beats if t >= mid))
    _expect(min(answered) >= 1, f"renewals answered with the page, then with JSON of another shape: {answered}; "
                                "the worker stopped renewing")
    confirmed = _last_confirmed(case, "job", holder, start)
    unknown = [e for e in case.effects(accepted_only=False) if confirmed + L - MARGIN + SLACK < e.at < healed]
    _expect(not unknown, f"{len(unknown)} side effect(s) sent while ownership was unknown")
    _succeeded(case, 16, attempt=1, timeout=60)
    case.judge_safety()
    return f"renewals answered 200 with a page: {answered[0]}, with JSON of another shape: {answered[1]}; not lost"


def stale_publish(case: Case) -> str:
    """The holder's publication is held in flight (and everything it sends after it) while the
    run is stopped with no grace, which revokes the attempt (the fence moves); then the
    publication arrives, within the worker's lease deadline. It must be refused (a failed
    ownership test, not a bad result) and the worker must take it as lost: exit 1, no second
    publication, no `fail` instead, quiet."""
    case.create_run("job", {"steps": 2, "stepSeconds": 0.2}, stopGraceSeconds=0)
    w1 = _start(case)
    run = case.wait_holder("job", 1)
    holder, f1 = _status(run)["holder"], _status(run)["fence"]
    case.faulted.add((run["metadata"]["uid"], holder))
    if case.transport == POD:
        case.keep_pod(holder)
        gate = case.worker_proxy.gate(method="PATCH", path=r"/workerruns/job/status$", client=rf"{case.ns}/{holder}$")
        try:
            gate.wait_arrived(timeout=60)
        except AssertionError as exc:
            raise Fail("the worker never published") from exc
        case.worker_proxy.gate(client=rf"{case.ns}/{holder}$", times=None)  # and everything after it
        heal = case.worker_proxy.clear
    else:
        case.gateway_proxy.hold(r"/(complete|fail)$")
        case.wait(lambda: case.gateway_proxy.held > 0, 60, "the worker's publication")
        case.gateway_proxy.cut()  # and everything after it
        heal = case.gateway_proxy.heal
    held_at = time.time()
    # Pods: the revocation is held between its two steps (fence moved, Lease not cleared), so the
    # worker's renewals still succeed while its publication is refused: only its reading of the
    # 422 can tell it the run is lost.
    lease_write = {"method": "PUT|PATCH|DELETE", "path": r"/leases/job$"}
    told = case.operator_proxy.gate(**lease_write) if case.transport == POD else None
    case.kube.ok(case.kube.patch(Kube.wr_path(case.ns, "job"), {"spec": {"stop": True}}))
    window = None
    if told is not None:
        told.wait_arrived(timeout=30)  # the stop signal's Lease write; the clearing one comes next
        window = case.operator_proxy.gate(**lease_write)
        told.release()
    revoked = _revoked_at(case, "job", f1)
    _expect(revoked - held_at < L - MARGIN - 1, "harness: the revocation came too late to test the refusal")
    healed = time.time()
    heal()
    if window is not None:
        time.sleep(2 * R)  # the window stays open two renew intervals: the fault, not a wait for a condition
        case.operator_proxy.clear()
    run = case.wait_phase("job", ENDED, timeout=60)
    _expect(_status(run).get("result") is None, "the stale publication was accepted")
    sent = case.worker_requests(holder)
    def refusal() -> Any:
        return next((r for r in case.worker_requests(holder) if r.at >= held_at - 1 and r.status in LOST_ANSWERS
                     and _is_publication(r)), None)
    try:
        case.wait(refusal, 15, "the held publication's refusal")
    except Fail:
        raise Fail(f"the held publication was not refused: {[(x.method, x.status) for x in sent[-5:]]}") from None
    code = _exit_code(case, w1, holder, 3 * R + 10)
    _expect(code == 1, f"the worker exited {code} after its publication was refused (1: lost)")
    again = [r for r in case.worker_requests(holder) if r.at > healed
             and _is_publication(r)]
    _expect(not again, f"{len(again)} publication tries after the refusal (a retry, or a fail instead)")
    _quiet_after_lost(case, holder, healed)
    if window is None:
        _no_writes_after(case, "job", holder, revoked, "the revocation")
    else:  # renewals inside the held window are the documented exception; none after it closed
        cleared = case.wait(lambda: next((r.completed.timestamp() for r in case.lease_writes("job")
                                          if r.accepted and r.user.pod is None and r.received.timestamp() > revoked
                                          and _holder_of(r) != holder), None), 30, "the operator clearing the Lease")
        _no_writes_after(case, "job", holder, cleared, "the Lease was cleared")
    case.judge_safety()
    after = [(r.method, r.path.rsplit("/", 1)[-1], r.status) for r in case.worker_requests(holder) if r.at > healed]
    return f"the late publication was refused and taken as lost; sent after the heal: {after}"


def lost_answer(case: Case) -> str:
    """The publication lands but its answer is lost: the worker retries, and if the retry is
    refused it must read the run and find its own result there, then exit 0 — not report lost."""
    case.create_run("job", {"steps": 2, "stepSeconds": 0.2})
    w1 = _start(case)
    run = case.wait_holder("job", 1)
    holder = _status(run)["holder"]
    if case.transport == POD:
        case.worker_proxy.drop(phase="response", method="PATCH", path=r"/workerruns/job/status$",
                               client=rf"{case.ns}/{holder}$", times=1)
    else:
        case.gateway_proxy.drop_response(r"/complete$")
    run = _succeeded(case, 2, attempt=1)
    code = _exit_code(case, w1, holder, L + 15)
    _expect(code == 0, f"the worker exited {code} although its result was accepted (its answer was only lost)")
    tries = [r for r in case.worker_requests(holder) if _is_publication(r)]
    _expect(len(tries) >= 2, f"{len(tries)} publication tries: the drop did not happen")
    case.judge_safety()
    return f"{len(tries)} tries; the accepted result was recognised"


def slow_publication(case: Case) -> str:
    """The publication's answer comes 3 s late, more than the request timeout T (1 s here) and
    less than the publication timeout TP (§3): the worker waits for it instead of sending the same
    result again, and exits 0 with its result accepted, in one try."""
    holder = "job-a1"  # (`<run>-a<attempt>`): the delay is in place before the worker starts
    late = case.worker_proxy.delay(3.0, phase="response", method="PATCH", path=r"/workerruns/job/status$",
                                   client=rf"{case.ns}/{holder}$", times=1) if case.transport == POD else None
    if late is None:
        case.gateway_proxy.delay_response(r"/complete$", 3.0)
    case.create_run("job", {"steps": 2, "stepSeconds": 0.2})
    w1 = _start(case)
    _succeeded(case, 2, attempt=1)
    _expect((late.hits if late is not None else case.gateway_proxy.delayed) == 1, "the delay did not happen")
    code = _exit_code(case, w1, holder, L + 15)
    _expect(code == 0, f"the worker exited {code} although its result was accepted (its answer only came late)")
    tries = [r for r in case.worker_requests(holder) if _is_publication(r)]
    _expect(len(tries) == 1, f"{len(tries)} publication tries: the worker sent its result again before the "
                             "answer to the first came (held to T, not TP)")
    case.judge_safety()
    return "one try, answered 3 s late, accepted"


BLIP_LEASE = {"durationSeconds": 20, "renewIntervalSeconds": 2, "startupGraceSeconds": 30}


def blip(case: Case) -> str:
    """Cut off for longer than L − M but healed before the lease lapses: the worker must withhold
    side effects while ownership is unknown, keep trying to renew (not give up, not declare
    itself lost), and carry on in the same attempt once a renewal succeeds."""
    l, r = float(BLIP_LEASE["durationSeconds"]), float(BLIP_LEASE["renewIntervalSeconds"])
    m = max(1.0, l / 10)
    case.create_run("job", {"steps": 90, "stepSeconds": 0.3}, lease=BLIP_LEASE)
    _start(case)
    run = case.wait_holder("job", 1)
    holder = _status(run)["holder"]
    _wait_effects(case, 2)
    seen = len(case.lease_writes("job"))
    case.wait(lambda: any(w.user.pod in (holder, None) and w.accepted and _holder_of(w) == holder
                          for w in case.lease_writes("job")[seen:]), 2 * r + 5, "a fresh renewal")
    heal = _cut(case, holder)
    cut = time.time()
    time.sleep(l - m / 2)  # the fault's duration: past the worker's deadline, short of the lapse
    heal()
    healed = time.time()
    confirmed = _last_confirmed(case, "job", holder, cut)
    unknown = [e for e in case.effects(accepted_only=False) if confirmed + l - m + SLACK < e.at < healed]
    _expect(not unknown, f"{len(unknown)} side effect(s) sent while ownership was unknown")
    tried = [x for x in case.worker_requests(holder) if cut <= x.at <= healed]
    # A renewal that gets no answer takes up to T = min(10 s, max(R, 1 s)) before the next R.
    least = int((healed - cut) / (r + min(10.0, max(r, 1.0)))) - 1
    _expect(len(tried) >= least, f"only {len(tried)} renewal tries in {healed - cut:.0f}s cut off (at least {least})")
    run = _succeeded(case, 90, attempt=1, timeout=90)
    case.judge_safety()
    return f"withheld effects while unknown; {len(tried)} renewal tries while cut; same attempt finished"


def long_step(case: Case) -> str:
    """One step takes longer than the lease: the heartbeat must not wait for the work."""
    case.create_run("job", {"steps": 2, "stepSeconds": L + 4})
    case.launch("job")
    _succeeded(case, 2, attempt=1, timeout=90)
    case.judge_safety()
    return f"two {L + 4:.0f}s steps under an {L:.0f}s lease, one attempt"


def approval(case: Case) -> str:
    """The worker asks a person before publishing (docs/protocol.md §9): the request rides on the
    holder's renewals, the operator records it, a WorkerRunApproval decides it, and the decision
    reaches the same attempt, whose result reports it."""
    case.create_run("job", {"steps": 1, "stepSeconds": 0.2,
                            "approval": {"name": "ship", "details": "conformance: ship it", "timeoutSeconds": 600}})
    case.launch("job")

    def recorded() -> dict[str, Any] | None:
        requests = (_status(case.run("job")).get("review") or {}).get("requests") or []
        return next((r for r in requests if r.get("gate") == "ship"), None)

    request = case.wait(recorded, 60, "the operator to record the worker's request")
    _expect(request.get("attempt") == 1 and not request.get("decision"),
            f"the request was recorded as {request}, not attempt 1's, undecided")
    run = case.run("job")
    _expect(_status(run).get("phase") not in ENDED, f"the run ended ({_status(run).get('phase')}) before any decision")
    holder = _status(run)["holder"]
    if case.transport == POD:
        carried = [r for r in case.lease_writes("job") if r.accepted and r.user.pod == holder
                   and "ship" in json.loads(_lease_annotation(r, "tether.dev/requests") or "{}")]
        _expect(bool(carried), "no accepted renewal of the holder carried the request (tether.dev/requests)")
    # The approver must be the creating user (the API server's policy): the kit's own identity.
    me = case.kube.ok(case.kube.post("/apis/authentication.k8s.io/v1/selfsubjectreviews", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}))["status"]["userInfo"]["username"]
    case.kube.ok(case.kube.post(f"/apis/tether.dev/v1alpha1/namespaces/{case.ns}/workerrunapprovals", {
        "apiVersion": "tether.dev/v1alpha1", "kind": "WorkerRunApproval", "metadata": {"generateName": "job-ship-"},
        "spec": {"runRef": {"name": "job", "uid": run["metadata"]["uid"]}, "gate": "ship", "decision": "Approve",
                 "reason": "conformance", "approver": me, "attempt": 1}}))
    decided = time.time()
    run = _succeeded(case, 1, attempt=1, timeout=60)
    got = _status(run)["result"].get("approval")
    _expect(got == {"decision": "Approve", "reason": "conformance", "approver": me},
            f"the result reports the approval as {got!r}, not Approve by {me} (reason 'conformance')")
    case.judge_safety()
    return f"request recorded, approved by {me}, decision in the result {time.time() - decided:.1f}s later"


def spawn(case: Case) -> str:
    """A parent of a class that may spawn dispatches one tool call as a child run (a pod of the same
    SDK's worker), waits for its result, does a step and crashes; its next attempt spawns the same key
    again and finds the same child (made once, run once) instead of a second, and the same key asked
    for another payload is refused as a conflict. The child's result reaches the parent's result
    through the current attempt; the tree's ledger settles the child's spending once."""
    tools = case.worker_class("tools", {})
    planners = case.worker_class("planners", {"childClasses": [tools], "maxChildren": 3})
    child_script = {"steps": 2, "stepSeconds": 0.1, "centsPerStep": 1, "effectUrl": case.receiver.url}
    ask = {"key": "tool:1", "className": tools, "capCents": 10, "payload": child_script,
           "spec": {"template": case.pod_template(), "lease": LEASE, "retry": {"maxAttempts": 1}}}
    case.create_run("job", {"steps": 2, "stepSeconds": 0.1, "centsPerStep": 1, "crashAttempts": [1],
                            "crashAfterStep": 1, "spawn": ask}, className=planners, budget={"capCents": 50})
    case.launch("job")
    run = _succeeded(case, 2, attempt=2, timeout=180)
    if case.transport == GATEWAY:  # the crash is the fault: an External attempt ends by its lease lapsing
        case.faulted.add((run["metadata"]["uid"], _status(run)["attempts"][0]["holder"]))
    made = case.kube.ok(case.kube.get(Kube.wr_path(case.ns), params={"labelSelector": "tether.dev/parent=job"}))["items"]
    _expect(len(made) == 1, f"{len(made)} children of job ({[c['metadata']['name'] for c in made]}): one key is one child")
    child = made[0]
    cs, first = _status(child), _status(run)["attempts"][0]
    _expect(child["spec"]["parentRef"]["holder"] == first["holder"],
            f"the child names {child['spec']['parentRef']['holder']}, not attempt 1 ({first['holder']}) that spawned it")
    _expect(cs.get("phase") == "Succeeded" and len(cs.get("attempts") or []) == 1,
            f"the child ended {cs.get('phase')} after {len(cs.get('attempts') or [])} attempts (once expected)")
    result = _status(run)["result"]
    _expect(result.get("child") == {"name": child["metadata"]["name"], "result": cs.get("result")},
            f"the parent's result says {result.get('child')!r} of its child, not its name and result")
    _expect(result.get("conflictRefused") is True, "the same key asked for another payload was not refused")
    # Each run's effects carry its own idempotency key (its UID): each step of each run once.
    keys = sorted(e.key for e in case.effects())
    want = sorted(f"{r['metadata']['uid']}:step-{i}" for r in (run, child) for i in range(2))
    _expect(keys == want, f"side effects accepted {keys}, not each step of the parent and the child once")

    def settled() -> dict[str, Any] | None:
        ledger = _status(case.run("job")).get("children") or {}
        return ledger if not ledger.get("live") and ledger.get("admitted") == 1 else None
    ledger = case.wait(settled, 30, "the child settled into the parent's ledger")
    spent = (cs.get("usage") or {}).get("cents")
    _expect(ledger.get("spentCents") == spent == 2, f"the ledger settled {ledger} for a child that spent {spent}¢ (2)")
    case.judge_safety()
    return f"child {child['metadata']['name']} made once by attempt 1, found again by attempt 2; its 2¢ settled once"


KUEUE = "/apis/kueue.x-k8s.io/v1beta2"


def _queue(case: Case) -> str:
    """A ClusterQueue of the case's own (room for one run of either kind) and its LocalQueue."""
    cq = f"conformance-{case.ns}"[:63]
    for path, body in ((f"{KUEUE}/resourceflavors", {"kind": "ResourceFlavor", "metadata": {"name": cq}, "spec": {}}),
                       (f"{KUEUE}/clusterqueues", {"kind": "ClusterQueue", "metadata": {"name": cq}, "spec": {
                           "namespaceSelector": {}, "resourceGroups": [{
                               "coveredResources": ["cpu", "tether.dev/runs"], "flavors": [{"name": cq, "resources": [
                                   {"name": "cpu", "nominalQuota": "4"}, {"name": "tether.dev/runs", "nominalQuota": "1"}]}]}]}}),
                       (f"{KUEUE}/namespaces/{case.ns}/localqueues",
                        {"kind": "LocalQueue", "metadata": {"name": "conformance"}, "spec": {"clusterQueue": cq}})):
        resp = case.kube.post(path, {"apiVersion": "kueue.x-k8s.io/v1beta2", **body})
        _expect(resp.status_code in (201, 409), f"Kueue refused {body['kind']}: {resp.status_code} {resp.text[:200]} "
                                                "(the yield scenario needs Kueue on the cluster)")
    return "conformance"


def _workload(case: Case, run: str) -> dict[str, Any]:
    items = case.kube.ok(case.kube.get(f"{KUEUE}/namespaces/{case.ns}/workloads"))["items"]
    mine = [w for w in items if any(r.get("name") == run for r in w["metadata"].get("ownerReferences") or [])]
    _expect(len(mine) == 1, f"{len(mine)} Workloads of {run}")
    return mine[0]


def _set_active(case: Case, run: str, active: bool) -> None:
    case.kube.ok(case.kube.patch(f"{KUEUE}/namespaces/{case.ns}/workloads/{_workload(case, run)['metadata']['name']}",
                                 {"spec": {"active": active}}))


def yield_(case: Case) -> str:
    """Queued through Kueue, evicted mid-run (its Workload deactivated): the worker, told stop and
    yield with a stopBy, starts no side effect after one renew interval and exits on its own,
    its last renewal reporting the usage and checkpoint of its steps; the attempt ends Preempted
    (no retry used); admitted again, the next attempt resumes at the checkpoint: every step's
    effect once, charged once."""
    steps = 30
    queue = _queue(case)
    case.create_run("job", {"steps": steps, "stepSeconds": 0.2, "centsPerStep": 1}, stopGraceSeconds=60,
                    labels={"kueue.x-k8s.io/queue-name": queue})
    w1 = _start(case)
    run = case.wait_holder("job", 1, timeout=90)
    fence, holder = _status(run)["fence"], _status(run)["holder"]
    _wait_effects(case, 2)
    _set_active(case, "job", False)
    told = case.signal_time("job", lambda s: bool(s.get("stop")) and bool(s.get("yield")) and bool(s.get("stopBy")))
    bound = R + 0.2 + 1.0 + SLACK
    if w1 is not None:
        took = _exited(case, w1, told, bound, "the yield signal")
        _expect(w1.returncode == 0, f"exit code {w1.returncode} after the yield signal (0 expected)")
    # Its end is the operator's: when the pod exits, or the External worker's closing renewal.
    case.wait(lambda: (_status(case.run("job")).get("attempts") or [{}])[0].get("outcome"), bound + 15,
              "attempt 1 to end")
    if w1 is None:
        took = max((r.at for r in case.worker_requests(holder)), default=told) - told
    _expect(took <= bound + 1.0, f"the worker went on {took:.1f}s after the yield signal (at most {bound:.1f}s)")
    _no_effects_once_heard(case, fence, holder, told, "the yield signal")
    first = (_status(case.run("job")).get("attempts") or [{}])[0]
    _expect(first.get("outcome") == "Preempted", f"attempt 1 ended {first.get('outcome')}, not Preempted")
    done_before = sum(1 for e in case.effects() if e.fence == fence)
    _set_active(case, "job", True)
    case.launch("job")
    run = _succeeded(case, steps, attempt=2, timeout=150)
    _exactly_once(case, steps)
    st = _status(run)
    _expect(st.get("preemptions") == 1 and len(st["attempts"]) == 2, f"attempts {st['attempts']}")
    f2 = _fence_of(run, 2)
    redone = [e for e in case.effects(accepted_only=False) if e.fence == f2 and e.step is not None
              and e.step < done_before]
    _expect(not redone, f"attempt 2 redid steps {[e.step for e in redone]} before its checkpoint")
    _expect((st.get("usage") or {}).get("cents") == steps, f"charged {st.get('usage')} for {steps} steps of 1¢")
    case.judge_safety()
    return f"stopped {took:.1f}s after the yield; {done_before} steps kept; resumed at {done_before}; {steps}¢ charged once"


SCENARIOS = [
    Scenario("happy", happy, summary="result, effects once, usage charged exactly, bad result ≠ lost"),
    Scenario("crash-resume", crash_resume, summary="crash, then resume from the checkpoint"),
    Scenario("partition", partition, summary="cut past the lease, reconnect: all refused or withheld"),
    Scenario("revoked-while-reconnecting", revoked_while_reconnecting, transports=(POD,), operator_behind_proxy=True,
             summary="reconnect between the revocation's two steps"),
    Scenario("stale-publish", stale_publish, operator_behind_proxy=True,
             summary="a publication refused inside the revocation window: taken as lost"),
    Scenario("lost-answer", lost_answer, summary="a publication whose answer is lost: recognised as accepted"),
    Scenario("slow-publication", slow_publication, summary="a publication answered after T: waited for (TP), not resent"),
    Scenario("blip", blip, summary="cut past L − M, healed before the lapse: withhold, keep renewing, carry on"),
    Scenario("long-step", long_step, summary="a step longer than the lease: the heartbeat goes on"),
    Scenario("stop", stop, summary="spec.stop honoured within one renew interval, last usage reported"),
    Scenario("pause", pause, summary="spec.suspend honoured within one renew interval, heartbeat goes on"),
    Scenario("cap", cap, summary="a lowered cap honoured within one renew interval, charged exactly"),
    Scenario("backoff", backoff, summary="429/503 with Retry-After: one renewal per interval, waits as asked"),
    Scenario("proxy-page", proxy_page, summary="renewals answered 200 with a sign-in page or a Status: unconfirmed"),
    Scenario("approval", approval, summary="a mid-run approval request: recorded, decided, the decision in the result"),
    Scenario("spawn", spawn, summary="a child run spawned, found again by the next attempt, its result in the parent's"),
    Scenario("yield", yield_, summary="evicted by Kueue: yield within one renew interval, resume at the checkpoint"),
]
