"""One publication per attempt, in both flavours (docs/protocol.md §5.4): a second complete() or
fail() is refused (AlreadyPublished) once one succeeded, is in flight or may have landed; a
publication cut short (cancelled, timed out) stays in doubt, so leaving publishes no fail() on
top of it and a retry of the same value reads back first. And the asyncio flavour's waits are
bounded: a renewal or a publication try that never answers (an exec credential plugin that hangs
in a thread) counts as no answer, and SIGTERM ends the process even when start() ran in a task of
its own."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from typing import Any

import httpx
import pytest

from tether.api.models import Signals, Usage
from tether.worker import AlreadyPublished, AsyncWorkerRun, OwnershipUnknown, WorkerRun
from tether.worker.transport import Renewal
from tests.unit.worker.test_worker_aio import SIGTERM_CHILD as _AIO_CHILD, sigterm_child

OK = Renewal(ok=True, signals=Signals())


class Blocking:
    """A blocking transport: publications answer when `release` is set (all at once by default)."""

    def __init__(self, landed: bool = True) -> None:
        self.published: list[tuple[str, Any]] = []
        self.recorded_calls = 0
        self.landed = landed
        self.release = threading.Event()
        self.release.set()
        self.started = threading.Event()

    def renew(self, checkpoint: str | None, usage: Usage | None, requests: Any = None) -> Renewal:
        return OK

    def publish(self, field: str, value: dict[str, Any]) -> bool:
        self.published.append((field, value))
        self.started.set()
        assert self.release.wait(10)
        return True

    def recorded(self, field: str, value: dict[str, Any]) -> bool:
        self.recorded_calls += 1
        return self.landed

    def close(self) -> None:
        pass


class Async:
    """An asyncio transport: a publication's answer waits for `answer` (set: at once)."""

    def __init__(self, landed: bool = True) -> None:
        self.published: list[tuple[str, Any]] = []
        self.renewals: list[Usage | None] = []
        self.recorded_calls = 0
        self.landed = landed
        self.answer = asyncio.Event()
        self.answer.set()
        self.hang_renewals = False

    async def renew(self, checkpoint: str | None, usage: Usage | None, requests: Any = None) -> Renewal:
        self.renewals.append(usage)
        if self.hang_renewals:
            await _forever_in_a_thread()
        return OK

    async def publish(self, field: str, value: dict[str, Any]) -> bool:
        self.published.append((field, value))
        await self.answer.wait()
        return True

    async def recorded(self, field: str, value: dict[str, Any]) -> bool:
        self.recorded_calls += 1
        return self.landed

    async def aclose(self) -> None:
        pass


_RELEASE_THREADS = threading.Event()


async def _forever_in_a_thread() -> None:
    """What an exec credential plugin that never exits looks like from the loop: a thread the
    awaiting task cannot be cancelled out of (anyio's run_sync without abandon_on_cancel)."""
    import anyio.to_thread
    await anyio.to_thread.run_sync(lambda: _RELEASE_THREADS.wait(5))


def _blocking(t: Blocking) -> WorkerRun:
    return WorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=30,
                     renew_interval=3600, transport=t)  # type: ignore[arg-type]


def _async(t: Async, lease: float = 30, interval: float = 3600) -> AsyncWorkerRun:
    return AsyncWorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=lease,
                          renew_interval=interval, transport=t)  # type: ignore[arg-type]


# --- 1. one publication per attempt -----------------------------------------------------------


def test_async_concurrent_publications_send_one_and_refuse_the_rest() -> None:
    async def go() -> tuple[Async, list[Any]]:
        t = Async()
        async with _async(t) as run:
            got = await asyncio.gather(run.complete({"ok": 1}), run.fail("Watchdog"), return_exceptions=True)
            with pytest.raises(AlreadyPublished):
                await run.complete({"ok": 2})
        return t, got
    t, got = asyncio.run(go())
    assert t.published == [("result", {"ok": 1})]
    assert got[0] is None and isinstance(got[1], AlreadyPublished)


def test_blocking_concurrent_publications_send_one_and_refuse_the_rest() -> None:
    t = Blocking()
    t.release.clear()
    run = _blocking(t).start()
    outcomes: list[Any] = []
    first = threading.Thread(target=lambda: outcomes.append(run.complete({"ok": 1})))
    first.start()
    assert t.started.wait(10)  # the first one is in flight
    with pytest.raises(AlreadyPublished):
        run.fail("Watchdog")
    t.release.set()
    first.join(10)
    with pytest.raises(AlreadyPublished):
        run.complete({"ok": 2})
    run.stop()
    assert t.published == [("result", {"ok": 1})] and outcomes == [None]


def test_an_exception_after_a_publication_fails_nothing() -> None:
    t = Blocking()
    with pytest.raises(AlreadyPublished):
        with _blocking(t) as run:
            run.complete({"ok": 1})
            run.complete({"ok": 2})
    assert t.published == [("result", {"ok": 1})]


# --- 2. a publication cut short stays in doubt ----------------------------------------------------


def test_a_timed_out_complete_is_not_followed_by_a_fail_on_exit() -> None:
    """wait_for(complete(x), 0.1): the PATCH may have landed (its answer is slow). Leaving with the
    TimeoutError must not publish fail(TimeoutError) on top of the result."""
    async def go() -> Async:
        t = Async()
        t.answer.clear()  # the answer never comes in time
        with pytest.raises(asyncio.TimeoutError):
            async with _async(t) as run:
                await asyncio.wait_for(run.complete({"ok": 1}), 0.1)
        return t
    assert asyncio.run(go()).published == [("result", {"ok": 1})]


@pytest.mark.parametrize("landed", [True, False])
def test_a_retry_after_a_cancelled_complete_reads_back_first_and_a_different_value_is_refused(landed: bool) -> None:
    async def go() -> tuple[Async, AsyncWorkerRun]:
        t = Async(landed=landed)
        t.answer.clear()
        run = await _async(t).start()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(run.complete({"ok": 1}), 0.1)
        with pytest.raises(AlreadyPublished):
            await run.fail("Timeout")  # the result may have landed: nothing else may replace it
        with pytest.raises(AlreadyPublished):
            await run.complete({"ok": 2})
        t.answer.set()
        await run.complete({"ok": 1})  # the same value: read back first, sent again only if absent
        await run.stop()
        return t, run
    t, run = asyncio.run(go())
    assert t.recorded_calls == 1 and run._finished
    assert t.published == [("result", {"ok": 1})] * (1 if landed else 2)


# --- 3. bounded waits (asyncio) --------------------------------------------------------------------


def test_a_renewal_that_never_answers_is_cut_at_t_and_complete_still_publishes() -> None:
    """A renewal stuck in a thread (an exec credential plugin that hangs: httpx's timeout does not
    cover it) counts as unanswered after T, so complete() publishes instead of hanging."""
    async def go() -> tuple[Async, float]:
        t = Async()
        run = await _async(t, interval=0.01).start()  # T = 1 s
        t.hang_renewals = True
        started = time.monotonic()
        await asyncio.wait_for(run.complete({"ok": 1}), 10)
        await asyncio.wait_for(run.stop(), 10)
        return t, time.monotonic() - started
    try:
        t, took = asyncio.run(go())
    finally:
        _RELEASE_THREADS.set()
    assert t.published == [("result", {"ok": 1})] and took < 4.5


def test_stop_does_not_wait_forever_for_the_renewal_lock() -> None:
    async def go() -> float:
        t = Async()
        run = await _async(t, interval=1).start()  # T = 1 s
        await run._renewing.acquire()  # held by something that never lets go
        started = time.monotonic()
        await asyncio.wait_for(run.stop(), 10)
        return time.monotonic() - started
    assert asyncio.run(go()) < 4.5


def test_a_publication_try_that_never_answers_counts_as_unanswered(monkeypatch: pytest.MonkeyPatch) -> None:
    from tether import protocol
    monkeypatch.setattr(protocol, "PUBLICATION_TIMEOUT", 0.2)

    async def go() -> Async:
        t = Async()
        run = await _async(t, lease=8).start()
        t.answer.clear()  # no answer, ever
        clock = [time.monotonic()]
        run._mono = lambda: clock[0]  # type: ignore[method-assign]

        async def hop() -> None:
            while True:
                clock[0] += 1
                await asyncio.sleep(0.05)
        ticking = asyncio.create_task(hop())
        with pytest.raises(OwnershipUnknown):
            await asyncio.wait_for(run.complete({"ok": 1}), 20)
        ticking.cancel()
        return t
    assert len(asyncio.run(go()).published) >= 2  # retried, not stuck on the first try


def test_an_exec_plugin_that_hangs_fails_the_async_request_and_a_cancellation_is_not_held_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """tether.kube.config: the plugin's run on a thread is bounded (EXEC_TIMEOUT) and abandoned when
    the awaiting task is cancelled (the SDK's bound on a renewal), instead of holding it until the
    process exits."""
    from tether.kube import config as kubeconfig
    monkeypatch.setattr(kubeconfig, "EXEC_TIMEOUT", 0.3)
    exits = threading.Event()

    class Hanging:
        """ExecPlugin's contract: past its timeout the plugin is killed and the run raises."""

        def run(self, timeout: float) -> dict[str, Any]:
            if not exits.wait(timeout):
                raise subprocess.TimeoutExpired("plugin", timeout)
            return {"token": "t"}

    cfg = kubeconfig.KubeConfig(server="https://api", ssl_context=None,  # type: ignore[arg-type]
                                credentials=kubeconfig.Credentials(Hanging()))  # type: ignore[arg-type]

    async def go() -> tuple[float, float]:
        async with httpx.AsyncClient(base_url="https://api", auth=cfg.auth(),
                                     transport=httpx.MockTransport(lambda r: httpx.Response(200))) as http:
            started = time.monotonic()
            with pytest.raises(kubeconfig.CredentialError):
                await http.get("/x")  # an httpx.TransportError: a try without an answer
            timed_out = time.monotonic() - started
            started = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(http.get("/x"), 0.05)
            return timed_out, time.monotonic() - started
    try:
        timed_out, cancelled = asyncio.run(go())
    finally:
        exits.set()
    assert timed_out < 2 and cancelled < 0.25


# --- 4. SIGTERM when start() ran in a task of its own --------------------------------------------------

# test_worker_aio's child (a transport that records, printed at exit), with a main of its own.
SIGTERM_CHILD = _AIO_CHILD[:_AIO_CHILD.index("async def main():")] + """
import sys

async def main():
    run = AsyncWorkerRun(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=60,
                         renew_interval=30, transport=t)
    await asyncio.wait_for(run.start(), 30)       # on Python 3.11, start() runs in a task of its own
    try:
        if sys.argv[1] == "with":
            async with run:
                run.report_usage(cents=7)
                print("ready", flush=True)
                await asyncio.sleep(60)
        else:
            run.report_usage(cents=7)
            print("ready", flush=True)
            await asyncio.sleep(60)
    finally:
        await run.stop()

asyncio.run(main())
"""


@pytest.mark.parametrize("shape", ["with", "plain"])
def test_sigterm_ends_the_worker_with_143_when_start_ran_in_another_task(shape: str) -> None:
    report = sigterm_child(SIGTERM_CHILD, shape)
    assert report["renewals"][-1] == 7 and report["publications"] == []
