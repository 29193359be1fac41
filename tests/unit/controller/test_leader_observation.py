"""The operator's leader election on a fake clock, with requests that take time (defect 7): two
replicas never both consider themselves the leader at the same instant, whichever of their reads
or writes is slow. The leader counts its renew deadline from before its write; a standby counts
the lease duration of a renewal it saw from after the read that showed it."""

from __future__ import annotations

import asyncio
import copy
from typing import Any, Awaitable, Callable

from tether.controller.leader import LeaderElector
from tether.kube.client import Conflict

NS, NAME = "tether-system", "tether-operator-leader"
STEP = 0.1  # the fake clock's tick: both replicas are judged at every one


class Clock:
    """A monotonic clock that moves only when told, judging the replicas at every tick it passes."""

    def __init__(self) -> None:
        self.now = 0.0
        self.electors: list[LeaderElector] = []
        self.both_leading: list[float] = []  # the instants at which two replicas led at once

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        for _ in range(round(seconds / STEP)):
            self.now = round(self.now + STEP, 6)
            if sum(e.is_leader for e in self.electors) > 1:
                self.both_leading.append(self.now)


class Leases:
    """The API server's one Lease: writes conditional on its resourceVersion, as the real one's."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.rv = 0

    def store(self, body: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        self.lease = {**copy.deepcopy(body), "metadata": {**body["metadata"], "resourceVersion": str(self.rv)}}
        return copy.deepcopy(self.lease)


class Replica:
    """One replica's client of the Lease. `slow_get`, set, runs once while a GET is in flight (the
    server reads the Lease at its end, the worst case); `slow_write` once after a write landed,
    before its answer arrives. Both move the clock."""

    def __init__(self, leases: Leases) -> None:
        self.leases = leases
        self.slow_get: Callable[[], Awaitable[None]] | None = None
        self.slow_write: Callable[[], Awaitable[None]] | None = None

    async def get_lease(self, ns: str, name: str) -> dict[str, Any] | None:
        hook, self.slow_get = self.slow_get, None
        if hook is not None:
            await hook()
        return copy.deepcopy(self.leases.lease)

    async def create_lease(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.leases.lease is not None:
            raise Conflict(409, "exists", "create lease")
        return await self._answered(self.leases.store(body))

    async def replace_lease(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self.leases.lease is not None
        if body["metadata"]["resourceVersion"] != self.leases.lease["metadata"]["resourceVersion"]:
            raise Conflict(409, "the object has been modified", "replace lease")
        return await self._answered(self.leases.store(body))

    async def _answered(self, stored: dict[str, Any]) -> dict[str, Any]:
        hook, self.slow_write = self.slow_write, None
        if hook is not None:
            await hook()
        return stored


def _pair() -> tuple[Clock, LeaderElector, LeaderElector]:
    clock, leases = Clock(), Leases()
    a, b = (LeaderElector(Replica(leases), NS, NAME, who, mono=clock)  # type: ignore[arg-type]
            for who in ("a", "b"))
    clock.electors = [a, b]
    return clock, a, b


async def _standby_takes_over(clock: Clock, standby: LeaderElector) -> float:
    """The standby retries every retry period until it leads (the old leader renews no more); the
    clock then runs on for a while, both replicas judged at each tick."""
    while not await standby.try_acquire_or_renew():
        clock.advance(standby.retry_period)
    took_over = clock.now
    clock.advance(standby.renew_deadline / 2)
    return took_over


def test_a_standbys_slow_get_does_not_let_it_take_over_before_the_leader_stops() -> None:
    """The standby's GET starts at 0 and answers at 9.0; the leader renewed at 8.8, while it was in
    flight, then could renew no more (a partition): it leads until 8.8 + 10. Stamped with the time
    before its GET, the standby took the renewal for one made at 0 and led from 15.0: 3.8 s of two
    leaders."""
    clock, a, b = _pair()

    async def scenario() -> float:
        assert await a.try_acquire_or_renew()

        async def leader_renews_meanwhile() -> None:
            clock.advance(8.8)
            assert await a.try_acquire_or_renew()
            clock.advance(0.2)
        b.kube.slow_get = leader_renews_meanwhile  # type: ignore[attr-defined]
        assert not await b.try_acquire_or_renew()
        return await _standby_takes_over(clock, b)

    took_over = asyncio.run(scenario())
    assert clock.both_leading == [], f"two leaders from {clock.both_leading[0]} to {clock.both_leading[-1]}"
    assert took_over >= 9.0 + b.lease_seconds and not a.is_leader and b.is_leader


def test_a_leaders_slow_write_answer_does_not_extend_its_leadership() -> None:
    """The leader's renewal lands at 5.0 and its answer arrives at 11.0: the standby, which saw it
    at 5.0, takes over from 20.0, so the leader's renew deadline counts from before its write (5.0,
    until 15.0), never from its answer (until 21.0)."""
    clock, a, b = _pair()

    async def scenario() -> float:
        assert await a.try_acquire_or_renew()
        clock.advance(5.0)

        async def standby_reads_meanwhile() -> None:
            assert not await b.try_acquire_or_renew()
            clock.advance(6.0)
        a.kube.slow_write = standby_reads_meanwhile  # type: ignore[attr-defined]
        assert await a.try_acquire_or_renew()
        return await _standby_takes_over(clock, b)

    asyncio.run(scenario())
    assert clock.both_leading == [], f"two leaders from {clock.both_leading[0]} to {clock.both_leading[-1]}"
    assert b.is_leader and not a.is_leader
