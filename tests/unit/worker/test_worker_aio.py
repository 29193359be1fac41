"""The asyncio worker SDK (tether.worker.aio) without a cluster: the same rules as WorkerRun, driven
with awaits, and what lands between an await and the next step (a cancelled renewal, a publication
racing a renewal that finds the lease lost, the program's task cancelled, SIGTERM)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from typing import Any, Awaitable, Callable

import httpx
import pytest

from tether.api import constants as c
from tether.api.models import GateDecision, Signals, Usage
from tether.worker import AsyncWorkerRun, LeaseLost, OwnershipUnknown, WorkerRun
from tether.worker.aio import load_payload_async
from tether.worker.transport import AsyncGatewayTransport, GatewayTransport, Renewal

OK = Renewal(ok=True, signals=Signals())


class Fake:
    """An async transport whose answers the test scripts; records what each call carried."""

    def __init__(self) -> None:
        self.renewals: list[tuple[str | None, Usage | None]] = []
        self.publications: list[tuple[str, Any]] = []
        self.closed = False
        self.renew_with: Callable[[int], Awaitable[Renewal]] | None = None
        self.publish_with: Callable[[int], Awaitable[bool]] | None = None

    async def renew(self, checkpoint: str | None, usage: Usage | None, requests: Any = None) -> Renewal:
        self.renewals.append((checkpoint, usage))
        return OK if self.renew_with is None else await self.renew_with(len(self.renewals))

    async def publish(self, field: str, value: dict[str, Any]) -> bool:
        self.publications.append((field, value))
        return True if self.publish_with is None else await self.publish_with(len(self.publications))

    async def recorded(self, field: str, value: dict[str, Any]) -> bool:
        return False

    async def aclose(self) -> None:
        self.closed = True


def _run(t: Fake, lease: float = 30, interval: float = 3600, **kw: Any) -> AsyncWorkerRun:
    return AsyncWorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=lease,
                          renew_interval=interval, transport=t, **kw)  # type: ignore[arg-type]


async def _until(cond: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.005)


def test_a_run_renews_before_work_heartbeats_and_publishes() -> None:
    async def go() -> Fake:
        t = Fake()
        async with _run(t, interval=0.01) as run:
            assert t.renewals and run.owned and run.heartbeating
            run.report_usage(cents=4, tokens=2)
            run.checkpoint("c1")
            await _until(lambda: t.renewals[-1] == ("c1", Usage(cents=4, tokens=2)))
            await run.complete({"ok": True})
        assert not run.heartbeating and t.closed
        return t
    t = asyncio.run(go())
    assert t.publications == [("result", {"ok": True})]


def test_the_heartbeat_task_survives_an_unexpected_exception() -> None:
    async def go() -> None:
        t = Fake()

        async def flaky(n: int) -> Renewal:
            if n in (2, 3):
                raise KeyError("spec")
            return OK
        t.renew_with = flaky
        async with _run(t, interval=0.01) as run:
            await _until(lambda: len(t.renewals) >= 5)
            assert run.heartbeating and run.owned
    asyncio.run(go())


def test_a_renewal_cancelled_mid_flight_confirms_nothing_and_frees_the_next_one() -> None:
    """stop() or the program may cancel the heartbeat while its renewal waits for an answer: the
    renewal counts neither way, and the lock that keeps renewals apart is free again."""
    clock = [100.0]

    async def go() -> None:
        t, answered = Fake(), asyncio.Event()

        async def hangs(n: int) -> Renewal:
            if n == 2:
                clock[0] += 5
                await answered.wait()  # never set: the answer does not come
            return OK
        t.renew_with = hangs
        run = _run(t, lease=10, interval=0.01, monotonic=lambda: clock[0])
        await run.start()
        confirmed = run._confirmed_at
        await _until(lambda: len(t.renewals) == 2)
        assert run._task is not None
        run._task.cancel()
        await _until(lambda: run._task is not None and run._task.done())
        assert run._confirmed_at == confirmed and not run.lost
        assert await asyncio.wait_for(run.renew(), timeout=5)  # not stuck behind the cancelled one
        assert run._confirmed_at == 105.0
        await run.stop()
    asyncio.run(go())


def test_a_publication_waiting_for_a_renewal_that_finds_the_lease_lost_publishes_nothing() -> None:
    async def go() -> Fake:
        t, release = Fake(), asyncio.Event()

        async def lost_later(n: int) -> Renewal:
            if n == 2:
                await release.wait()
                return Renewal(ok=False, lost=True, why="another holder")
            return OK
        t.renew_with = lost_later
        run = await _run(t, interval=0.01).start()
        await _until(lambda: len(t.renewals) == 2)  # the heartbeat's renewal is in flight
        publishing = asyncio.create_task(run.complete({"ok": True}))
        await asyncio.sleep(0.05)
        assert not publishing.done() and t.publications == []  # it waits for the renewal in flight
        release.set()
        with pytest.raises(LeaseLost):
            await publishing
        assert run.lost
        await run.stop()
        return t
    t = asyncio.run(go())
    assert t.publications == [] and len(t.renewals) == 2  # no last renewal once lost either


def test_a_refused_publication_is_lost_not_retried() -> None:
    async def go() -> Fake:
        t = Fake()

        async def refused(n: int) -> bool:
            return False
        t.publish_with = refused
        run = await _run(t).start()
        with pytest.raises(LeaseLost):
            await run.complete({"ok": True})
        assert run.lost
        await run.stop()
        return t
    assert len(asyncio.run(go()).publications) == 1


def test_publication_retries_wait_on_the_loop_and_give_up_at_the_lease_deadline() -> None:
    """No answer: retried after 0.5 s, 1 s, ... while other tasks keep running (the loop is never
    blocked); past confirmedAt + L it gives up as OwnershipUnknown, not lost."""
    clock = [0.0]

    async def go() -> tuple[int, int]:
        t, ticks = Fake(), [0]

        async def no_answer(n: int) -> bool:
            raise httpx.ConnectError("refused")

        async def unconfirmed(n: int) -> Renewal:
            return OK if n == 1 else Renewal(ok=False, why="503")

        async def ticker() -> None:
            while True:
                ticks[0] += 1
                clock[0] += 0.25  # time passes for the run's clock as the loop turns
                await asyncio.sleep(0.01)
        t.publish_with, t.renew_with = no_answer, unconfirmed
        run = await _run(t, lease=8, monotonic=lambda: clock[0]).start()
        tick = asyncio.create_task(ticker())
        with pytest.raises(OwnershipUnknown):
            await run.complete({"ok": True})
        tick.cancel()
        await run.stop()
        return len(t.publications), ticks[0]
    tries, ticks = asyncio.run(go())
    assert 2 <= tries <= 5 and ticks > 10


def test_an_exception_inside_async_with_fails_the_run_and_a_cancellation_does_not() -> None:
    async def raising() -> Fake:
        t = Fake()
        with pytest.raises(ZeroDivisionError):
            async with _run(t):
                raise ZeroDivisionError("boom")
        return t
    t = asyncio.run(raising())
    assert t.publications == [("error", {"code": "ZeroDivisionError", "message": "boom"})] and t.closed

    async def lost() -> Fake:
        t = Fake()
        with pytest.raises(LeaseLost):
            async with _run(t):
                raise LeaseLost("gone")
        return t
    assert asyncio.run(lost()).publications == []

    async def cancelled() -> Fake:
        t, inside = Fake(), asyncio.Event()

        async def worker() -> None:
            async with _run(t, interval=3600) as run:
                run.report_usage(cents=9)
                run.checkpoint("c3")
                inside.set()
                await asyncio.sleep(3600)
        task = asyncio.create_task(worker())
        await inside.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return t
    t = asyncio.run(cancelled())
    assert t.publications == [] and t.closed
    assert t.renewals[-1] == ("c3", Usage(cents=9))  # the last renewal reported what was spent


def test_leaving_after_a_result_sends_no_last_renewal() -> None:
    async def go() -> tuple[int, int]:
        t = Fake()
        async with _run(t) as run:
            # The heartbeat's first renewal first: one in flight during the publication is not a last one.
            await _until(lambda: len(t.renewals) == 2)
            await run.complete({"ok": 1})
            before = len(t.renewals)
        return before, len(t.renewals)
    before, after = asyncio.run(go())
    assert before == after


def test_an_approval_decision_arriving_on_the_heartbeat_ends_the_wait() -> None:
    async def go() -> Any:
        t = Fake()
        decided = Signals(decisions={"ship": GateDecision(decision="Approve", reason="ok", approver="ann")})

        async def decides(n: int) -> Renewal:
            return OK if n < 4 else Renewal(ok=True, signals=decided)
        t.renew_with = decides
        async with _run(t, interval=0.01) as run:
            return await asyncio.wait_for(run.request_approval("ship", "deploy", poll=3600), timeout=10)
    got = asyncio.run(go())
    assert got.approved and got.approver == "ann"


def test_a_flush_from_another_thread_wakes_the_heartbeat() -> None:
    """checkpoint(flush=True) from a thread (a metering wrapper) must wake the loop's heartbeat
    safely: an asyncio.Event is not thread-safe."""
    async def go() -> Fake:
        t = Fake()
        async with _run(t, interval=3600) as run:
            await asyncio.to_thread(run.checkpoint, "c7", True)
            await _until(lambda: t.renewals[-1][0] == "c7")
        return t
    asyncio.run(go())


@pytest.mark.parametrize("flavour", [WorkerRun, AsyncWorkerRun])
@pytest.mark.parametrize(("call", "args"), [("checkpoint", ("x" * 1025,)), ("checkpoint", (7,)),
                                            ("report_usage", (-1,)), ("report_usage", (True,))])
def test_both_flavours_refuse_what_the_control_plane_would_not_take(flavour: type, call: str,
                                                                    args: tuple[Any, ...]) -> None:
    run = flavour(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=30,
                  renew_interval=5, transport=Fake())
    with pytest.raises(ValueError):
        getattr(run, call)(*args)


def test_the_blocking_and_the_asyncio_gateway_transports_run_the_same_steps() -> None:
    seen: list[list[tuple[str, str, Any]]] = [[], []]

    def api(n: int) -> Callable[[httpx.Request], httpx.Response]:
        def answer(request: httpx.Request) -> httpx.Response:
            seen[n].append((request.method, request.url.path, json.loads(request.read())))
            if request.url.path.endswith("/heartbeat"):
                return httpx.Response(200, json={"holder": "job-a1", "fence": 1, "runUid": "u", "stop": True,
                                                 "paused": False, "capRemainingCents": 5, "capRemainingTokens": None,
                                                 "leaseExpiresAt": "x", "status": "Running"})
            return httpx.Response(410, json={"error": {"code": "StaleFence", "message": "moved on"}})
        return answer

    blocking = GatewayTransport("http://gw", "ns", "job", "tok", "job-a1", 1, timeout=5, worker_id="w", run_uid="u")
    blocking._http = httpx.Client(base_url="http://gw", transport=httpx.MockTransport(api(0)))
    got = (blocking.renew("c", Usage(cents=1)), blocking.publish("result", {"n": 1}))

    async def go() -> tuple[Renewal, bool]:
        t = AsyncGatewayTransport("http://gw", "ns", "job", "tok", "job-a1", 1, timeout=5, worker_id="w", run_uid="u")
        t._http = httpx.AsyncClient(base_url="http://gw", transport=httpx.MockTransport(api(1)))
        try:
            return await t.renew("c", Usage(cents=1)), await t.publish("result", {"n": 1})
        finally:
            await t.aclose()
    assert asyncio.run(go()) == got and got[0].ok and got[0].signals.stop and got[1] is False  # type: ignore[union-attr]
    assert seen[0] == seen[1] and [p for _, p, _ in seen[0]][-1].endswith("/complete")


def test_from_env_does_no_io_and_the_large_payload_is_read_in_start() -> None:
    env = {c.ENV_RUN: "job", c.ENV_NAMESPACE: "ns", c.ENV_HOLDER: "job-a1", c.ENV_FENCE: "1", c.ENV_ATTEMPT: "1",
           c.ENV_LEASE_DURATION: "30", c.ENV_RENEW_INTERVAL: "5", c.ENV_PAYLOAD_FROM: "spec.payload",
           c.ENV_RUN_UID: "u"}
    paths: list[str] = []

    class Kube:
        """A KubeConfig stand-in: every request is answered with the run (a Lease read gets no Lease)."""

        def async_client(self, timeout: float = 10.0) -> httpx.AsyncClient:
            def answer(request: httpx.Request) -> httpx.Response:
                paths.append(request.url.path)
                return httpx.Response(200, json={"metadata": {"uid": "u"}, "spec": {"payload": {"big": "y" * 50_000}}})
            return httpx.AsyncClient(base_url="https://api", transport=httpx.MockTransport(answer))

    async def go() -> AsyncWorkerRun:
        run = AsyncWorkerRun.from_env(env, kube=Kube())
        assert run.payload == {} and paths == []  # constructing it read nothing
        async with run:
            assert run.payload == {"big": "y" * 50_000} and not run.owned  # read; the renewal got no Lease
        return run
    asyncio.run(go())
    assert paths[0] == "/apis/tether.dev/v1alpha1/namespaces/ns/workerruns/job"
    assert paths[1] == "/apis/coordination.k8s.io/v1/namespaces/ns/leases/job"

    async def read() -> dict[str, Any]:
        return await load_payload_async({**env, c.ENV_RUN_UID: "other"}, Kube())  # type: ignore[arg-type]
    with pytest.raises(LeaseLost):
        asyncio.run(read())  # a re-created namesake's payload is not ours


SIGTERM_CHILD = """
import asyncio, atexit, json
from tether.api.models import Signals
from tether.worker import AsyncWorkerRun
from tether.worker.transport import Renewal

class Recording:
    renewals, publications = [], []
    async def renew(self, checkpoint, usage, requests=None):
        self.renewals.append(None if usage is None else usage.cents)
        return Renewal(ok=True, signals=Signals())
    async def publish(self, field, value):
        self.publications.append(field)
        return True
    async def recorded(self, field, value):
        return False
    async def aclose(self):
        pass

t = Recording()
atexit.register(lambda: print(json.dumps({"renewals": t.renewals, "publications": t.publications}), flush=True))

async def main():
    async with AsyncWorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=60,
                              renew_interval=30, transport=t) as run:
        run.report_usage(cents=7)
        print("ready", flush=True)
        await asyncio.sleep(60)

asyncio.run(main())
"""


def sigterm_child(script: str, *args: str) -> dict[str, Any]:
    """Runs `script` until it prints "ready", sends it SIGTERM, checks it exits 143, and returns what
    its transport recorded (printed at exit)."""
    child = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    child.terminate()
    out, err = child.communicate(timeout=30)
    assert child.returncode == 143, err
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_sigterm_ends_an_asyncio_worker_with_143_after_reporting_what_it_spent() -> None:
    report = sigterm_child(SIGTERM_CHILD)
    assert report["renewals"][-1] == 7  # the last renewal reported what was spent
    assert report["publications"] == []  # a terminated worker is not a failed one


def test_report_usage_never_waits_for_a_renewal_in_flight() -> None:
    """The metering wrapper calls report_usage from anywhere, synchronously: a renewal that hangs
    must not hold it up (the state's lock is never held across I/O)."""
    async def go() -> float:
        t, never = Fake(), asyncio.Event()

        async def hangs(n: int) -> Renewal:
            if n >= 2:
                await never.wait()
            return OK
        t.renew_with = hangs
        run = await _run(t, interval=0.01).start()
        await _until(lambda: len(t.renewals) == 2)
        started = time.monotonic()
        done = threading.Event()
        threading.Thread(target=lambda: (run.report_usage(cents=3), done.set())).start()
        await asyncio.to_thread(done.wait, 5)
        took = time.monotonic() - started
        never.set()  # the renewal in flight is answered; stop()'s last one too
        await run.stop()
        return took
    assert asyncio.run(go()) < 1


def test_the_example_worker_checkpoints_each_step_and_publishes(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/async-worker/worker.py, on a transport that records: it resumes from the checkpoint,
    records each later step, and publishes once."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "async-worker" / "worker.py"
    spec = importlib.util.spec_from_file_location("example_async_worker", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    t = Fake()
    monkeypatch.setattr(example.AsyncWorkerRun, "from_env", classmethod(
        lambda cls: _run(t, interval=3600, payload={"steps": 4, "stepSeconds": 0}, checkpoint="1")))
    assert asyncio.run(example.main()) == 0
    assert t.publications == [("result", {"steps": 4, "attempt": 1})]
    assert [cp for cp, _ in t.renewals if cp is not None][-1] == "4" and "1" not in [cp for cp, _ in t.renewals]


def test_stopping_twice_sends_one_last_renewal() -> None:
    """The program's own stop() and `async with`'s may both run: one last renewal, not two."""
    async def go() -> tuple[int, int]:
        t = Fake()
        run = await _run(t).start()
        await _until(lambda: len(t.renewals) == 2)  # start()'s renewal, then the heartbeat's first
        run.report_usage(cents=2)
        before = len(t.renewals)
        await asyncio.gather(run.stop(), run.stop())
        await run.stop()
        return before, len(t.renewals)
    before, after = asyncio.run(go())
    assert after == before + 1
