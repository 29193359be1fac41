"""The work queue's promises (client-go semantics) and the client-side rate limit."""

from __future__ import annotations

import asyncio

import pytest

from tether.controller.workqueue import ExponentialBackoff, WorkQueue
from tether.kube.ratelimit import TokenBucket


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_a_waiting_key_is_queued_once() -> None:
    async def go() -> list[str]:
        q: WorkQueue[str] = WorkQueue()
        for key in ["a", "b", "a", "a"]:
            q.add(key)
        return [await q.get(), await q.get()] + [str(len(q))]  # type: ignore[list-item]
    assert run(go()) == ["a", "b", "0"]


def test_a_key_in_process_is_not_handed_out_twice_but_comes_back_after_done() -> None:
    async def go() -> tuple[object, object]:
        q: WorkQueue[str] = WorkQueue()
        q.add("a")
        first = await q.get()
        q.add("a")  # an event while "a" is being reconciled
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(q.get(), timeout=0.05)
        q.done("a")
        return first, await asyncio.wait_for(q.get(), timeout=1)
    assert run(go()) == ("a", "a")


def test_add_after_keeps_the_earliest_pass() -> None:
    async def go() -> tuple[str | None, int]:
        q: WorkQueue[str] = WorkQueue()
        q.add_after("a", 30)
        q.add_after("a", 0.01)
        q.add_after("a", 60)
        key = await asyncio.wait_for(q.get(), timeout=2)
        return key, q.pending_timers()
    assert run(go()) == ("a", 0)


def test_backoff_doubles_per_key_up_to_a_cap_and_forget_resets_it() -> None:
    b: ExponentialBackoff[str] = ExponentialBackoff(base=0.1, cap=1.0)
    assert [b.when("a") for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert b.when("b") == 0.1  # per key
    b.forget("a")
    assert b.when("a") == 0.1
    for _ in range(2000):
        b.when("c")  # no overflow however often it fails
    assert b.when("c") == 1.0


def test_shutdown_wakes_every_worker() -> None:
    async def go() -> list[object]:
        q: WorkQueue[str] = WorkQueue()
        waiting = [asyncio.create_task(q.get()) for _ in range(3)]
        await asyncio.sleep(0)
        q.shutdown()
        return await asyncio.wait_for(asyncio.gather(*waiting), timeout=1)
    assert run(go()) == [None, None, None]


def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    now = [0.0]
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    async def go() -> None:
        bucket = TokenBucket(qps=10, burst=5, mono=lambda: now[0])
        original = asyncio.sleep
        asyncio.sleep = fake_sleep  # type: ignore[assignment]
        try:
            for _ in range(15):
                await bucket.acquire()
        finally:
            asyncio.sleep = original  # type: ignore[assignment]
    run(go())
    # 5 at once, then 10 more at 10/s: one second of waiting in all.
    assert len(slept) == 10 and sum(slept) == pytest.approx(1.0)
