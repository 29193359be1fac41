"""The worker SDK without a cluster: the heartbeat thread and the gateway transport's tolerance."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from tether.api.models import Signals, Usage
from tether.worker import WorkerRun
from tether.worker.transport import GatewayTransport, Renewal


class FlakyTransport:
    """Renewals that fail with exceptions no one planned for (not httpx errors), then recover."""

    def __init__(self, failures: dict[int, Exception]) -> None:
        self.failures = failures
        self.calls = 0
        self.changed = threading.Condition()

    def renew(self, checkpoint: str | None, usage: Usage | None, requests: Any = None) -> Renewal:
        with self.changed:
            self.calls += 1
            number = self.calls
            self.changed.notify_all()
        if number in self.failures:
            raise self.failures[number]
        return Renewal(ok=True, signals=Signals())

    def publish(self, field: str, value: dict[str, Any]) -> bool:
        return True

    def close(self) -> None:
        pass

    def wait_calls(self, n: int, timeout: float = 10) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.calls >= n, timeout=timeout)


def _run(transport: FlakyTransport, clock: list[float]) -> WorkerRun:
    return WorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=10,
                     renew_interval=0.01, transport=transport, monotonic=lambda: clock[0])


def test_heartbeat_thread_survives_an_unexpected_exception(caplog: pytest.LogCaptureFixture) -> None:
    transport = FlakyTransport({2: ValueError("Expecting value: line 1 column 1"), 3: KeyError("spec")})
    clock = [100.0]
    run = _run(transport, clock).start()
    try:
        # Renewal 1 is start()'s; 2 and 3 blow up; the thread must go on to renew again.
        assert transport.wait_calls(5), f"the heartbeat thread stopped after {transport.calls} renewals"
        assert run.heartbeating and run.owned and not run.lost
        errors = [r for r in caplog.records if getattr(r, "event", None) == "heartbeat_error"]
        assert len(errors) >= 2 and errors[0].levelno == logging.ERROR and errors[0].exc_info
        assert "ValueError" in errors[0].error  # type: ignore[attr-defined]
    finally:
        run.stop()


def test_failed_renewals_let_ownership_turn_unknown_on_schedule() -> None:
    """A renewal that raised confirms nothing: the deadline runs from the last good one."""
    transport = FlakyTransport({n: RuntimeError("boom") for n in range(2, 10**6)})
    clock = [100.0]
    run = _run(transport, clock).start()
    try:
        assert transport.wait_calls(3)
        assert run.owned
        clock[0] += 10  # the whole lease duration later, with no renewal confirmed since start()
        assert run.ownership_unknown and not run.lost and run.heartbeating
    finally:
        run.stop()


def test_a_renewal_that_fails_before_publishing_does_not_stop_the_publication(
        caplog: pytest.LogCaptureFixture) -> None:
    """docs/protocol.md §5.4: the renewal right before publishing is a courtesy; its failure, even
    an unexpected one, must not keep the result from going out (it raised out of complete())."""
    transport = FlakyTransport({2: KeyError("spec")})
    run = _run(transport, [100.0])
    assert run.renew()
    run.complete({"ok": True})  # renewal 2 blows up; the publication still goes out
    assert transport.calls == 2 and not run.lost
    assert [getattr(r, "event", None) for r in caplog.records].count("heartbeat_error") == 1


def test_a_publication_try_that_waited_tp_while_the_heartbeat_confirmed_is_tried_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A try may wait TP (30 s, protocol §3) while the heartbeat confirms ownership: the deadline
    it is judged against is read after the try, not before it (which gave up at once, owning)."""
    clock = [100.0]

    class SlowFirstTry(FlakyTransport):
        tries = 0

        def publish(self, field: str, value: dict[str, Any]) -> bool:
            self.tries += 1
            if self.tries == 1:
                for _ in range(30):  # TP without an answer; the heartbeat confirmed every second
                    clock[0] += 1.0
                    assert run.renew()
                raise httpx.ReadTimeout("no answer within TP")
            return True

    transport = SlowFirstTry({})
    run = _run(transport, clock)
    assert run.renew()
    monkeypatch.setattr("tether.worker.run.time.sleep", lambda seconds: clock.__setitem__(0, clock[0] + seconds))
    run.complete({"ok": True})
    assert transport.tries == 2 and not run.lost


def test_report_usage_refuses_what_the_operator_would_refuse() -> None:
    run = _run(FlakyTransport({}), [0.0])
    run.report_usage(cents=10, tokens=5)
    with pytest.raises(ValueError, match="decreased"):
        run.report_usage(cents=9, tokens=5)
    with pytest.raises(ValueError, match="negative"):
        run.report_usage(cents=-1)
    with pytest.raises(ValueError, match="implausibly"):
        run.report_usage(cents=10**12)
    run.report_usage(cents=10, tokens=6)
    assert run.signals.cap_remaining_cents is None


def _gateway(handler: Any, worker_id: str | None = "w1", run_uid: str | None = None) -> GatewayTransport:
    transport = GatewayTransport("http://gw", "ns", "job", "tok", "job-a1", 1, timeout=5, worker_id=worker_id,
                                 run_uid=run_uid)
    transport._http = httpx.Client(base_url="http://gw", transport=httpx.MockTransport(handler))  # noqa: SLF001
    return transport


def test_gateway_transport_survives_answers_that_are_not_json() -> None:
    """A proxy in front of the gateway answers HTML: that is a refusal, not a crash of the heartbeat,
    and a 200 that is not the gateway's reply (a sign-in page, JSON of another shape) confirms
    nothing (issue 21, defect 7)."""
    status = [502]
    t = _gateway(lambda request: httpx.Response(status[0], text="<html>Bad gateway</html>"))
    refused = t.renew(None, None)
    assert not refused.ok and not refused.lost and "502" in refused.why
    status[0] = 200
    page = t.renew(None, None)
    assert not page.ok and not page.lost and "<html>" in page.why
    status[0] = 404
    gone = t.renew(None, None)
    assert not gone.ok and gone.lost
    listed = _gateway(lambda request: httpx.Response(200, json=[{"stop": False}])).renew(None, None)
    assert not listed.ok and not listed.lost


def test_gateway_transport_sends_the_claimant_and_counts_caps_like_the_pod_path() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        import json
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"holder": "job-a1", "fence": 1, "runUid": "uid-1", "stop": False,
                                         "paused": False, "capRemainingCents": 380, "capRemainingTokens": None,
                                         "leaseExpiresAt": "x", "status": "Running"})

    t = _gateway(handler)
    renewal = t.renew("row-7", Usage(cents=120, tokens=9))
    assert seen == [{"holder": "job-a1", "fence": 1, "workerId": "w1", "checkpoint": "row-7",
                     "usage": {"cents": 120, "tokens": 9}}]
    assert renewal.ok and renewal.signals is not None
    run = _run(FlakyTransport({}), [0.0])
    run._take_signals(renewal.signals)  # noqa: SLF001
    run.report_usage(cents=150)  # 30 more cents after the heartbeat: they count against the cap
    assert run.signals.cap_remaining_cents == 350 and run.signals.cap_remaining_tokens is None


@pytest.mark.parametrize(("status", "code", "outcome"), [
    (200, None, True), (410, "StaleFence", False), (403, "NotClaimant", False), (409, "HeldByAnother", False),
    (503, "Unavailable", "raises"), (403, "Forbidden", "raises")])
def test_gateway_publish_tells_refusal_from_no_answer(status: int, code: str | None, outcome: Any) -> None:
    """Refused for good (not ours) ends the attempt for this worker; 503 or an RBAC hiccup says
    nothing about ownership and is retried until the lease deadline."""
    body = {"status": "Succeeded", "fence": 1} if code is None else {"error": {"code": code, "message": "m"}}
    t = _gateway(lambda request: httpx.Response(status, json=body))
    if outcome == "raises":
        with pytest.raises(httpx.HTTPStatusError):
            t.publish("result", {"ok": True})
    else:
        assert t.publish("result", {"ok": True}) is outcome


def test_a_refusal_by_the_fencing_policy_means_lost_but_rbac_does_not() -> None:
    import httpx

    from tether.worker.transport import fenced_by_policy

    policy = httpx.Response(403, text='workerruns.tether.dev "job" is forbidden: ValidatingAdmissionPolicy '
                                      "'tether-worker-status-fencing' with binding 'tether-worker-status-fencing' "
                                      "denied request: pod job-a1 does not hold WorkerRun job")
    rbac = httpx.Response(403, text='leases.coordination.k8s.io "job" is forbidden: User '
                                    '"system:serviceaccount:ns:job-worker" cannot update resource "leases"')
    assert fenced_by_policy(policy) and not fenced_by_policy(rbac)
    assert not fenced_by_policy(httpx.Response(422, text="ValidatingAdmissionPolicy tether-worker"))


class _MockKube:
    """Stands in for a kubeconfig: hands the transport an httpx client over a mock API."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler

    def sync_client(self, timeout: float) -> httpx.Client:
        return httpx.Client(base_url="http://api", transport=httpx.MockTransport(self.handler), timeout=timeout)


def test_the_pod_transport_never_takes_a_re_created_namesakes_lease_for_its_own() -> None:
    """Seed 378: after its run was deleted and re-created, the old worker's renewal conflicted,
    it re-read the Lease, found holder job-a1 and fence 1 (the new run's first attempt) and
    renewed it. With the run's UID it sees another run's Lease, and stops."""
    from tether.worker.transport import KubeTransport

    def lease(uid: str, rv: str) -> dict[str, Any]:
        return {"metadata": {"name": "job", "resourceVersion": rv,
                             "ownerReferences": [{"kind": "WorkerRun", "uid": uid, "controller": True}]},
                "spec": {"holderIdentity": "job-a1", "leaseTransitions": 1}}

    puts: list[dict[str, Any]] = []

    def api(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json=lease("new-uid", "9"))
        puts.append(request.read().decode())
        return httpx.Response(409, json={"kind": "Status", "code": 409})

    t = KubeTransport("ns", "job", "job-a1", 1, _MockKube(api), timeout=1.0, run_uid="old-uid")  # type: ignore[arg-type]
    t._lease = lease("old-uid", "5")  # what it renewed last, before the run was deleted
    renewal = t.renew(None, None)
    assert renewal.lost and not renewal.ok
    assert len(puts) == 1  # the conflicting PUT only: no renewal of the namesake's Lease
    patches: list[Any] = []
    t2 = KubeTransport("ns", "job", "job-a1", 1, _MockKube(
        lambda r: (patches.append(r.read()), httpx.Response(422, json={"code": 422}))[1]), timeout=1.0,
        run_uid="old-uid")  # type: ignore[arg-type]
    assert not t2.publish("result", {"ok": True})
    assert b'"/metadata/uid"' in patches[0] and b'"old-uid"' in patches[0]


def test_the_blocking_and_the_asyncio_pod_transports_run_the_same_protocol() -> None:
    """The benchmark fleet plays workers with AsyncKubeTransport: its requests and verdicts must be
    the SDK's, request for request (a renewal that conflicts, re-reads, retries; a fenced publish)."""
    from tether.worker.transport import AsyncKubeTransport, KubeTransport

    def script() -> tuple[list[tuple[str, str, bytes]], Any]:
        seen: list[tuple[str, str, bytes]] = []
        rv = [5]

        def api(request: httpx.Request) -> httpx.Response:
            seen.append((request.method, request.url.path, request.read()))
            lease = {"metadata": {"name": "job", "resourceVersion": str(rv[0]),
                                  "ownerReferences": [{"kind": "WorkerRun", "uid": "u", "controller": True}]},
                     "spec": {"holderIdentity": "job-a1", "leaseTransitions": 1}}
            if request.method == "PUT" and len(seen) == 2:
                rv[0] += 1  # the operator wrote the signals in between
                return httpx.Response(409, json={"kind": "Status", "code": 409})
            if request.method == "PATCH":
                return httpx.Response(422, json={"code": 422})
            return httpx.Response(200, json=lease)
        return seen, api

    seen_sync, api = script()
    t = KubeTransport("ns", "job", "job-a1", 1, _MockKube(api), timeout=1.0, run_uid="u")  # type: ignore[arg-type]
    sync = (t.renew("c1", Usage(cents=3)), t.publish("result", {"n": 1}))

    seen_async, api = script()

    async def go() -> tuple[Any, Any]:
        async with httpx.AsyncClient(base_url="http://api", transport=httpx.MockTransport(api)) as http:
            a = AsyncKubeTransport("ns", "job", "job-a1", 1, http, run_uid="u")
            return await a.renew("c1", Usage(cents=3)), await a.publish("result", {"n": 1})

    asynced = asyncio.run(go())
    assert sync[0].ok and sync == asynced
    assert sync[1] is False  # the fence test failed: refused for good
    strip = [(m, p, json.loads(b)["spec"].get("holderIdentity") if m == "PUT" else b) for m, p, b in seen_sync]
    assert [m for m, _, _ in seen_sync] == ["GET", "PUT", "GET", "PUT", "PATCH"]
    assert strip == [(m, p, json.loads(b)["spec"].get("holderIdentity") if m == "PUT" else b)
                     for m, p, b in seen_async]


class LostAnswerTransport:
    """The first publication lands but its answer is lost; the retry is refused (fence moved)."""

    def __init__(self, landed: bool) -> None:
        self.landed = landed
        self.calls: list[str] = []

    def renew(self, checkpoint: str | None, usage: Usage | None, requests: Any = None) -> Renewal:
        return Renewal(ok=True, signals=Signals())

    def publish(self, field: str, value: dict[str, Any]) -> bool:
        self.calls.append("publish")
        if len(self.calls) == 1:
            raise httpx.ReadTimeout("answer lost")
        return False

    def recorded(self, field: str, value: dict[str, Any]) -> bool:
        self.calls.append("recorded")
        return self.landed

    def close(self) -> None:
        pass


@pytest.mark.parametrize("landed", [True, False])
def test_a_result_whose_answer_was_lost_is_not_reported_refused_if_it_landed(landed: bool) -> None:
    from tether.worker.errors import LeaseLost

    transport = LostAnswerTransport(landed)
    clock = [0.0]
    run = WorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=30,
                    renew_interval=10, transport=transport, monotonic=lambda: clock[0])
    run.renew()
    if landed:
        run.complete({"ok": 1})
        assert run.owned or not run.lost
    else:
        with pytest.raises(LeaseLost):
            run.complete({"ok": 1})
    assert transport.calls == ["publish", "publish", "recorded"]


# The API server's two 422s, as kube-apiserver v1.36 answered them (tests/e2e/test_fencing.py
# drives both for real): a JSON-patch `test` that did not hold, and a value the CRD refuses.
TEST_FAILED_422 = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                   "message": "the server rejected our request due to an error in our request",
                   "reason": "Invalid", "details": {}, "code": 422}
SCHEMA_422 = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
              "message": 'WorkerRun.tether.dev "job" is invalid: status.result: Invalid value: "array"',
              "reason": "Invalid", "code": 422,
              "details": {"name": "job", "group": "tether.dev", "kind": "WorkerRun", "causes": [
                  {"reason": "FieldValueTypeInvalid", "message": "Invalid value: \"array\"",
                   "field": "status.result"}]}}


@pytest.mark.parametrize(("body", "outcome"), [(TEST_FAILED_422, "lost"), (SCHEMA_422, "invalid"),
                                               ({"code": 422}, "lost"), ("not json", "lost")])
def test_a_failed_ownership_test_is_told_from_a_refused_value(body: Any, outcome: str) -> None:
    """422 without causes: a `test` on uid, fence or holder failed, the run moved on (lost).
    422 with causes: the schema refused the value; the worker still owns the run."""
    from tether.worker import ResultInvalid
    from tether.worker.transport import KubeTransport

    def api(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, json=body) if not isinstance(body, str) else httpx.Response(422, text=body)

    t = KubeTransport("ns", "job", "job-a1", 1, _MockKube(api), timeout=1.0)  # type: ignore[arg-type]
    if outcome == "lost":
        assert t.publish("result", {"ok": True}) is False
    else:
        with pytest.raises(ResultInvalid) as info:
            t.publish("result", [1])  # type: ignore[arg-type]
        assert info.value.causes[0]["field"] == "status.result"


def test_a_refused_value_leaves_the_worker_owning_the_run() -> None:
    """The SDK raises ResultInvalid, not LeaseLost, and a corrected result is then published."""
    from tether.worker import ResultInvalid

    class Refusing(LostAnswerTransport):
        def publish(self, field: str, value: Any) -> bool:
            self.calls.append("publish")
            if not isinstance(value, dict):
                raise ResultInvalid("status.result must be an object", [{"field": "status.result"}])
            return True

    transport = Refusing(landed=False)
    run = WorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=30,
                    renew_interval=10, transport=transport, monotonic=lambda: 0.0)
    run.renew()
    with pytest.raises(ResultInvalid):
        run.complete([1])  # type: ignore[arg-type]
    assert run.owned and not run.lost
    run.complete({"ok": 1})
    assert transport.calls == ["publish", "publish"]


def test_publication_retries_wait_as_long_as_retry_after_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 429 or 503 with Retry-After: 3 is retried after 3 s, not after the first 0.5 s step."""
    sleeps: list[float] = []
    clock = [0.0]

    class Busy(LostAnswerTransport):
        def publish(self, field: str, value: Any) -> bool:
            self.calls.append("publish")
            if len(self.calls) < 3:
                resp = httpx.Response(429, headers={"Retry-After": "3"}, request=httpx.Request("PATCH", "http://api"))
                raise httpx.HTTPStatusError("busy", request=resp.request, response=resp)
            return True

    def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock[0] += seconds

    transport = Busy(landed=False)
    run = WorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=30,
                    renew_interval=10, transport=transport, monotonic=lambda: clock[0])
    run.renew()
    monkeypatch.setattr("tether.worker.run.time.sleep", fake_sleep)
    run.complete({"ok": 1})
    assert sleeps == [3.0, 3.0] and transport.calls == ["publish"] * 3


def test_leaving_without_a_result_reports_what_was_spent_once() -> None:
    """A worker that stops (told to, or giving up) sends one last renewal with its usage and
    checkpoint, or the run is charged less than it used; a published run sends none."""
    seen: list[tuple[str | None, Usage | None]] = []

    class Recording(LostAnswerTransport):
        def renew(self, checkpoint: str | None, usage: Usage | None, requests: Any = None) -> Renewal:
            seen.append((checkpoint, usage))
            return Renewal(ok=True, signals=Signals())

        def publish(self, field: str, value: Any) -> bool:
            return True

    for publish in (False, True):
        seen.clear()
        run = WorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=30,
                        renew_interval=3600, transport=Recording(landed=False), monotonic=lambda: 0.0).start()
        run.report_usage(cents=7, tokens=3)
        run.checkpoint("c9")
        if publish:
            run.complete({"ok": 1})
        before = len(seen)
        run.stop()
        run.stop()
        assert len(seen) - before == (0 if publish else 1)
        if not publish:
            assert seen[-1] == ("c9", Usage(cents=7, tokens=3))


@pytest.mark.parametrize(("status", "code", "lost"), [
    (410, "StaleFence", True), (403, "NotClaimant", True), (409, "HeldByAnother", True), (404, "NotFound", True),
    (503, "Busy", False), (403, "Forbidden", False), (401, "Unauthorized", False)])
def test_gateway_heartbeat_answers_that_mean_lost(status: int, code: str, lost: bool) -> None:
    """docs/protocol.md §6.3: another claimant or a moved fence is lost; busy or an auth problem is
    only unconfirmed."""
    t = _gateway(lambda request: httpx.Response(status, json={"error": {"code": code, "message": "m"}}))
    renewal = t.renew(None, None)
    assert not renewal.ok and renewal.lost is lost


@pytest.mark.parametrize("kube", [True, False])
def test_a_result_too_large_to_store_is_a_bad_value_not_lost(kube: bool) -> None:
    from tether.worker import ResultInvalid
    from tether.worker.transport import KubeTransport

    answer = httpx.Response(413, json={"kind": "Status", "code": 413, "message": "Request entity too large"})
    t: Any = KubeTransport("ns", "job", "job-a1", 1, _MockKube(lambda r: answer), timeout=1.0) if kube \
        else _gateway(lambda r: answer)  # type: ignore[arg-type]
    with pytest.raises(ResultInvalid):
        t.publish("result", {"big": "x"})


def test_renewals_never_overlap_so_older_progress_cannot_overtake_newer() -> None:
    """Found by review: the heartbeat and a flush renewed at once over the shared Lease, so a
    conflict's retry could carry an older checkpoint and a smaller usage than the one that landed."""
    inside, most = [0], [0]
    gate = threading.Lock()

    class Slow(LostAnswerTransport):
        def renew(self, checkpoint: str | None, usage: Usage | None, requests: Any = None) -> Renewal:
            with gate:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            threading.Event().wait(0.02)
            with gate:
                inside[0] -= 1
            return Renewal(ok=True, signals=Signals())

    run = WorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=30,
                    renew_interval=0.001, transport=Slow(landed=False)).start()
    threads = [threading.Thread(target=run.renew) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.stop()
    assert most[0] == 1


@pytest.mark.parametrize(("call", "args"), [
    ("checkpoint", (5,)), ("checkpoint", ("x" * 1025,)), ("report_usage", (2.9,)), ("report_usage", ("5",)),
    ("report_usage", (True,)), ("report_usage", (1, 0.5))])
def test_reports_the_control_plane_would_not_take_are_refused_at_once(call: str, args: tuple[Any, ...]) -> None:
    run = WorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=30,
                    renew_interval=10, transport=LostAnswerTransport(landed=False), monotonic=lambda: 0.0)
    with pytest.raises(ValueError):
        getattr(run, call)(*args)


SIGTERM_CHILD = """
import atexit, json, sys, time
from tether.api.models import Signals
from tether.worker import WorkerRun
from tether.worker.transport import Renewal

class Recording:
    renewals, publications = [], []
    def renew(self, checkpoint, usage, requests=None):
        self.renewals.append(None if usage is None else usage.cents)
        return Renewal(ok=True, signals=Signals())
    def publish(self, field, value):
        self.publications.append(field)
        return True
    def close(self):
        pass

t = Recording()
atexit.register(lambda: print(json.dumps({"renewals": t.renewals, "publications": t.publications}), flush=True))
with WorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=60,
               renew_interval=30, transport=t) as run:
    run.report_usage(cents=7)
    print("ready", flush=True)
    time.sleep(60)
"""


def test_sigterm_ends_the_worker_with_143_after_reporting_what_it_spent() -> None:
    """In a container the worker is PID 1, which ignores SIGTERM without a handler: the SDK sets one
    (unless the program has its own), so `with` unwinds, the last renewal reports the usage, nothing
    is published as a failure, and the exit status is 143."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    child.terminate()
    try:
        out, _ = child.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        # Seen once in make test (cold cache, 1 of 1650): say what the child was doing, then end it.
        tasks = sorted(Path(f"/proc/{child.pid}/task").iterdir()) if child.poll() is None else []
        threads = [((t / "comm").read_text().strip(), (t / "stat").read_text().rsplit(")", 1)[1].split()[0],
                    (t / "wchan").read_text()) for t in tasks]
        child.kill()
        raise AssertionError(f"no exit 30 s after SIGTERM; its threads (name, state, wchan): {threads}") from None
    assert child.returncode == 143
    report = json.loads(out.strip().splitlines()[-1])
    assert 7 in report["renewals"]  # what it spent was reported (on the way out at the latest)
    assert report["publications"] == []  # a terminated worker is not a failed one


# --- what an answer to a Lease request means (sdk/vectors/leases.json, shared with the TypeScript and Go SDKs) ---

LEASE_VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[3] / "sdk/vectors/leases.json").read_text())


def _vector_body(v: dict[str, Any]) -> bytes:
    return (v["text"] if "text" in v else json.dumps(v["json"])).encode()


@pytest.mark.parametrize("vector", LEASE_VECTORS["parseLease"], ids=lambda v: v["name"])
def test_an_answer_is_a_lease_exactly_when_every_sdk_reads_it_as_one(vector: dict[str, Any]) -> None:
    from tether import protocol

    assert (protocol.parse_lease(_vector_body(vector)) is not None) is vector["lease"]


class VectorApi:
    """The API server of the Lease vectors: one Lease, updated by resourceVersion compare-and-swap;
    `script` replaces its answers, in order, and records which requests came."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.lease: dict[str, Any] = json.loads(json.dumps(LEASE_VECTORS["lease"]))
        self.script = list(answers)
        self.methods: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.methods.append(request.method)
        answer = self.script.pop(0) if self.script else {"method": request.method}
        assert answer["method"] == request.method, f"the worker sent {request.method}, the vector expects {answer}"
        if "status" not in answer or answer.get("landed"):
            own = self._serve(request)
            if "status" not in answer:
                return own
        return httpx.Response(answer["status"], content=_vector_body(answer),
                              headers={"Content-Type": answer.get("contentType", "application/json")})

    def _serve(self, request: httpx.Request) -> httpx.Response:
        if request.method == "PUT":
            sent = json.loads(request.content)
            rv = self.lease["metadata"]["resourceVersion"]
            if sent["metadata"].get("resourceVersion") != rv:
                return httpx.Response(409, json={"kind": "Status", "code": 409, "reason": "Conflict"})
            self.lease = {**sent, "metadata": {**sent["metadata"], "resourceVersion": str(int(rv) + 1)}}
        return httpx.Response(200, json=self.lease)


def _vector_transport(api: Callable[[httpx.Request], httpx.Response]) -> Any:
    from tether.worker.transport import KubeTransport

    w = LEASE_VECTORS["worker"]
    return KubeTransport(w["namespace"], w["name"], w["holder"], w["fence"], _MockKube(api),  # type: ignore[arg-type]
                         timeout=1.0, run_uid=w["runUid"])


def _outcome(renewal: Renewal) -> str:
    return "confirmed" if renewal.ok else "lost" if renewal.lost else "unconfirmed"


@pytest.mark.parametrize("vector", LEASE_VECTORS["renewals"], ids=lambda v: v["name"])
def test_renewal_answers_mean_to_the_python_sdk_what_they_mean_to_every_sdk(vector: dict[str, Any]) -> None:
    """Issue 21, defect 7: a 200 that is not a Lease (a proxy's page, a Status) was read as lost, or
    raised; docs/protocol.md §5.2 says it leaves the renewal unconfirmed, and the next one may confirm."""
    api = VectorApi(vector["answers"])
    t = _vector_transport(api)
    assert _outcome(t.renew(None, None)) == vector["outcome"]
    assert api.methods == [a["method"] for a in vector["answers"]]
    if "then" in vector:
        assert _outcome(t.renew(None, None)) == vector["then"]


def test_a_proxy_page_neither_breaks_start_nor_stops_the_publication(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 21, defect 7: an HTML 200 from a proxy in front of the API server made start() and the
    renewal before publishing raise (a JSONDecodeError). It leaves ownership unknown, like no answer;
    the next renewal confirms it, and a publication still goes out after an unconfirmed renewal."""
    page = [True]
    patches: list[bytes] = []
    lease_api = VectorApi([])

    def api(request: httpx.Request) -> httpx.Response:
        if request.method == "PATCH":
            patches.append(request.content)
            return httpx.Response(200, json={"metadata": {"uid": "uid-1"}})
        if page[0]:
            return httpx.Response(200, text="<html><body>Please sign in</body></html>",
                                  headers={"Content-Type": "text/html"})
        return lease_api(request)

    w = LEASE_VECTORS["worker"]
    clock = [100.0]
    run = WorkerRun(name=w["name"], namespace=w["namespace"], holder=w["holder"], fence=w["fence"], attempt=1,
                    lease_duration=30, renew_interval=3600, monotonic=lambda: clock[0],
                    transport=_vector_transport(api))
    run.start()
    try:
        assert run.ownership_unknown and not run.lost and run.heartbeating
        page[0] = False
        assert run.renew() and run.owned
        page[0] = True
        run.complete({"ok": True})  # its renewal first gets the page: unconfirmed, and the result goes out
        assert len(patches) == 1 and not run.lost
        assert [r for r in caplog.records if getattr(r, "event", None) == "heartbeat_error"] == []
    finally:
        run.stop()


# --- what a gateway answer means (sdk/vectors/gateway-replies.json, shared with the TypeScript and Go SDKs) ---

GATEWAY_VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[3] / "sdk/vectors/gateway-replies.json").read_text())


def _gateway_answer(v: dict[str, Any]) -> httpx.Response:
    return httpx.Response(v.get("status", 200), content=_vector_body(v),
                          headers={"Content-Type": v.get("contentType", "application/json")})


@pytest.mark.parametrize("vector", GATEWAY_VECTORS["heartbeats"], ids=lambda v: v["name"])
def test_a_heartbeat_answer_means_to_the_python_sdk_what_it_means_to_every_sdk(vector: dict[str, Any]) -> None:
    """A proxy (or anything in between) answering 200 with `{}` or another JSON object confirmed
    ownership: only the gateway's reply for this attempt does (docs/protocol.md §6.4); anything
    else leaves the renewal unconfirmed, and hands out no tool credential."""
    w = GATEWAY_VECTORS["worker"]
    t = _gateway(lambda request: _gateway_answer(vector), worker_id=w["workerId"], run_uid=w["runUid"])
    renewal = t.renew(None, None)
    assert _outcome(renewal) == vector["outcome"]
    assert (t.tool_claim is not None) is (renewal.ok and bool(json.loads(_vector_body(vector)).get("toolClaim")))


@pytest.mark.parametrize("vector", GATEWAY_VECTORS["claims"], ids=lambda v: v["name"])
def test_a_claim_answer_is_the_gateways_claim_reply_exactly_when_every_sdk_reads_it_as_one(
        vector: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim answered 200 with something that is not the claim reply is a claim without an answer
    (it may have landed; the same claimant claiming again is answered alike), never a run held with
    whatever the body happened to hold."""
    from tether.worker import ClaimRefused, TetherWorkerError

    client = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **kw: client(
        **kw, transport=httpx.MockTransport(lambda request: _gateway_answer(vector))))
    if vector["claim"]:
        run = WorkerRun.claim("http://gw", "ns", "job", "tok")
        doc = vector["json"]
        assert (run.holder, run.fence, run.attempt, run.idempotency_key) == (
            doc["holder"], doc["fence"], doc["attempt"], doc["idempotencyKey"])
        assert run.payload == (doc.get("payload") or {})
        return
    with pytest.raises(TetherWorkerError, match="not the gateway's claim reply") as raised:
        WorkerRun.claim("http://gw", "ns", "job", "tok")
    assert not isinstance(raised.value, ClaimRefused)


def test_an_eviction_reaches_the_worker_as_a_yield() -> None:
    """Kueue evicted the run: the signals say stop and yield; the SDK tells its code it is a yield
    (checkpoint, then exit: the run resumes from there), with the time the attempt is revoked."""
    import datetime as dt

    from tether import protocol
    from tether.worker import StopRequested

    raw = protocol.signals_annotation(Signals(stop=True, yield_=True, reason="evicted by Kueue (Preempted)",
                                              stop_by=dt.datetime(2026, 12, 3, 12, 0, 30, tzinfo=dt.timezone.utc)))
    parsed = protocol.lease_signals({"metadata": {"annotations": {"tether.dev/signals": raw}}})
    assert parsed is not None
    run = _run(FlakyTransport({}), [0.0])
    run._take_signals(parsed)  # noqa: SLF001
    assert run.signals.stop and run.signals.yielding
    assert run.signals.stop_by == dt.datetime(2026, 12, 3, 12, 0, 30, tzinfo=dt.timezone.utc)
    with pytest.raises(StopRequested) as told:
        run.ensure_owner()
    assert told.value.yielding and "Preempted" in str(told.value)
    plain = protocol.lease_signals({"metadata": {"annotations": {"tether.dev/signals": protocol.signals_annotation(
        Signals(stop=True, reason="spec.stop is set"))}}})
    assert plain is not None and "yield" not in protocol.signals_annotation(plain)
    run._take_signals(plain)  # noqa: SLF001
    assert run.signals.stop and not run.signals.yielding


def test_an_external_worker_hears_the_yield_from_the_gateway() -> None:
    t = _gateway(lambda request: httpx.Response(200, json={
        "holder": "job-a1", "fence": 1, "runUid": "uid-1", "stop": True, "yield": True,
        "stopBy": "2026-12-03T12:00:30Z", "paused": False, "leaseExpiresAt": "x", "status": "Running"}))
    renewal = t.renew(None, None)
    assert renewal.ok and renewal.signals is not None
    run = _run(FlakyTransport({}), [0.0])
    run._take_signals(renewal.signals)  # noqa: SLF001
    assert run.signals.yielding and run.signals.stop_by is not None and run.signals.stop_by.second == 30
