"""tether.worker.metering: a request refused as soon as the attempt's own reports use up what the
control plane said was left of the run's cap (the heartbeat woken to tell it at once), and a
non-streamed answer cut by the network faulting the meter as a cut stream does. The `caps` and
`cuts` cases of sdk/vectors/metering.json, which the TypeScript and Go SDKs run too."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tether import protocol
from tether.api.models import Signals, Usage
from tether.worker import AsyncWorkerRun, WorkerRun
from tether.worker.core import RunCore
from tether.worker.metering import Meter, MeteringError, RunStopped
from tether.worker.transport import Renewal
from tether.devcluster.fake_model import FakeModel

VECTORS = json.loads((Path(__file__).resolve().parents[3] / "sdk/vectors/metering.json").read_text())
PRICES = {"gpt-x": {"input": 2.5, "output": 10, "cached_input": 1.25}}


class Reporter:
    def __init__(self) -> None:
        self.reports: list[tuple[int, int]] = []

    def report_usage(self, cents: int, tokens: int = 0) -> None:
        self.reports.append((cents, tokens))

    @property
    def last(self) -> tuple[int, int]:
        return self.reports[-1] if self.reports else (0, 0)


class Run(RunCore):
    """A run that counts how often it was asked to renew at once."""

    def __init__(self) -> None:
        super().__init__(name="r", namespace="ns", holder="w", fence=1, attempt=1, lease_duration=30,
                         renew_interval=10)
        self.wakes = 0

    def _wake_heartbeat(self) -> None:
        self.wakes += 1


def _capped(cents: int | None, tokens: int | None, reported: tuple[int, int] = (0, 0)) -> Run:
    """A run whose control plane said `cents` / `tokens` were left when `reported` was reported
    (the gateway's form; a pod's Lease carries cap and base, the same arithmetic)."""
    run = Run()
    run.report_usage(*reported)
    run._signals = protocol.signals_from_remaining(False, False, None, cents, tokens,
                                                   Usage(cents=reported[0], tokens=reported[1]))
    return run


def _refused(meter: Meter) -> bool:
    try:
        meter._check("gpt-x")
    except RunStopped as exc:
        assert "cap is used up" in str(exc)
        return True
    return False


@pytest.fixture
def fake() -> Iterator[FakeModel]:
    with FakeModel(input_tokens=1000, output_tokens=500) as f:
        yield f


# --- defect 5: a cap the attempt's own reports used up -----------------------------------------------

@pytest.mark.parametrize("case", VECTORS["caps"], ids=lambda c: c["name"])
def test_cap_vectors(case: dict[str, Any]) -> None:
    reported = tuple(case["reported"])
    run = _capped(case["capRemainingCents"], case["capRemainingTokens"], reported)  # type: ignore[arg-type]
    meter = Meter(run, PRICES, base_cents=reported[0], base_tokens=reported[1])
    assert _refused(meter) == case.get("refusedAtStart", False)
    for i, step in enumerate(case["steps"]):
        wakes = run.wakes
        meter.add(*step["add"])
        assert (_refused(meter), run.wakes - wakes) == (step["refused"], int(step["wakes"])), f"step {i}"
    assert meter.fault is None  # refused because the run may not spend, not because of a fault


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_an_answer_that_uses_up_the_cap_refuses_the_next_request_at_once(fake: FakeModel, flavour: str) -> None:
    run = _capped(cents=1, tokens=None)
    meter = Meter(run, PRICES)
    body = {"model": "gpt-x"}

    async def send(n: int) -> list[Any]:
        out: list[Any] = []
        async with httpx.AsyncClient(transport=meter.async_transport(), timeout=10) as http:
            for _ in range(n):
                try:
                    out.append((await http.post(fake.url + "/v1/chat/completions", json=body)).status_code)
                except MeteringError as exc:
                    out.append(exc)
        return out

    def sync_send(n: int) -> list[Any]:
        out: list[Any] = []
        with httpx.Client(transport=meter.transport(), timeout=10) as http:
            for _ in range(n):
                try:
                    out.append(http.post(fake.url + "/v1/chat/completions", json=body).status_code)
                except MeteringError as exc:
                    out.append(exc)
        return out

    got = sync_send(2) if flavour == "sync" else asyncio.run(send(2))
    # 1000 prompt at 2.5 + 500 completion at 10 = 0.75 cent, reported as 1: all that was left.
    assert got[0] == 200
    assert isinstance(got[1], RunStopped) and "cap is used up" in str(got[1]), got[1]
    assert run.signals.cap_remaining_cents == 0 and len(fake.requests) == 1
    assert run.wakes == 1 and meter.fault is None


class SyncTransport:
    """Renewals confirmed; the first says 1 cent is left of the cap."""

    def __init__(self) -> None:
        self.renewals: list[Usage | None] = []
        self.changed = threading.Condition()

    def renew(self, checkpoint: str | None, usage: Usage | None, requests: Any = None) -> Renewal:
        with self.changed:
            self.renewals.append(usage)
            self.changed.notify_all()
        return Renewal(ok=True, signals=Signals(cap_cents=1))

    def publish(self, field: str, value: dict[str, Any]) -> bool:
        return True

    def close(self) -> None:
        pass


class AsyncTransport(SyncTransport):
    async def renew(self, checkpoint: str | None, usage: Usage | None,  # type: ignore[override]
                    requests: Any = None) -> Renewal:
        return SyncTransport.renew(self, checkpoint, usage, requests)

    async def publish(self, field: str, value: dict[str, Any]) -> bool:  # type: ignore[override]
        return True

    async def recorded(self, field: str, value: dict[str, Any]) -> bool:
        return False

    async def aclose(self) -> None:
        pass


def test_both_flavours_renew_at_once_when_a_report_uses_up_the_cap() -> None:
    """The heartbeat (renew interval one hour) carries the report that used the cap up at once."""
    kw = dict(name="job", namespace="ns", holder="job-a1", fence=1, attempt=1, lease_duration=30,
              renew_interval=3600)
    sync_t = SyncTransport()
    run = WorkerRun(transport=sync_t, **kw).start()  # type: ignore[arg-type]
    try:
        with sync_t.changed:  # start()'s renewal, then the heartbeat thread's first
            assert sync_t.changed.wait_for(lambda: len(sync_t.renewals) == 2, timeout=10)
        meter = Meter(run, PRICES)
        meter.add(cents=0, tokens=5)  # not the cap: no renewal
        time.sleep(0.2)
        assert len(sync_t.renewals) == 2
        meter.add(cents=1)
        with sync_t.changed:
            assert sync_t.changed.wait_for(lambda: len(sync_t.renewals) == 3, timeout=10), "not woken"
        assert sync_t.renewals[-1] == Usage(cents=1, tokens=5)
        assert _refused(meter)
    finally:
        run.stop()

    async_t = AsyncTransport()

    async def main() -> None:
        async with AsyncWorkerRun(transport=async_t, **kw) as arun:  # type: ignore[arg-type]
            await asyncio.sleep(0.2)
            before = len(async_t.renewals)  # start()'s, and the heartbeat task's first
            ameter = Meter(arun, PRICES)
            await asyncio.to_thread(ameter.add, 1)  # from another thread, as a metering transport may
            deadline = time.monotonic() + 10
            while len(async_t.renewals) == before:
                assert time.monotonic() < deadline, "the heartbeat was not woken"
                await asyncio.sleep(0.01)
            assert async_t.renewals[-1] == Usage(cents=1, tokens=0) and _refused(ameter)

    asyncio.run(main())


# --- defect 6: a whole answer cut by the network ------------------------------------------------------

class _Cut(httpx.SyncByteStream, httpx.AsyncByteStream):
    """The first bytes of a body, then the read fails as a dropped connection does."""

    def __init__(self, head: bytes) -> None:
        self.head = head

    def __iter__(self) -> Iterator[bytes]:
        if self.head:
            yield self.head
        raise httpx.ReadError("connection reset by peer")

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        if self.head:
            yield self.head
        raise httpx.ReadError("connection reset by peer")


class CutModel(httpx.BaseTransport, httpx.AsyncBaseTransport):
    def __init__(self, case: dict[str, Any]) -> None:
        self.case = case
        self.sent = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        c = self.case
        return httpx.Response(c["status"], headers={"content-type": c["contentType"]},
                              stream=_Cut(c["body"].encode()[: c["cutAt"]]))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return self.handle_request(request)


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("case", VECTORS["cuts"], ids=lambda c: c["name"])
def test_cut_vectors(case: dict[str, Any], flavour: str) -> None:
    reporter = Reporter()
    meter = Meter(reporter, VECTORS["prices"])
    inner = CutModel(case)
    url = "http://model.test" + case["path"]

    def sync_go() -> None:
        with httpx.Client(transport=meter.transport(inner)) as http:
            with pytest.raises(httpx.ReadError):
                with http.stream("POST", url, json=case["request"]) as s:
                    s.read()
            if case["faults"]:
                with pytest.raises(MeteringError):
                    http.post(url, json=case["request"])

    async def async_go() -> None:
        async with httpx.AsyncClient(transport=meter.async_transport(inner)) as http:
            with pytest.raises(httpx.ReadError):
                async with http.stream("POST", url, json=case["request"]) as s:
                    await s.aread()
            if case["faults"]:
                with pytest.raises(MeteringError):
                    await http.post(url, json=case["request"])

    sync_go() if flavour == "sync" else asyncio.run(async_go())
    assert (meter.fault is not None) == case["faults"], meter.fault
    if case["faults"]:
        assert "cut" in meter.fault and inner.sent == 1  # type: ignore[operator]
    assert list(reporter.last) == case["charged"]


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_whole_answer_cut_by_the_network_faults_the_meter(fake: FakeModel, flavour: str) -> None:
    """The model answered (and billed), the connection dropped mid-body: the client's retry must
    not go through on a meter that never counted the first answer."""
    meter = Meter(Reporter(), PRICES)
    url = fake.url + "/v1/chat/completions"
    fake.next(cut_body=40)

    def sync_go() -> list[Any]:
        out: list[Any] = []
        with httpx.Client(transport=meter.transport(), timeout=10) as http:
            for _ in range(2):
                try:
                    out.append(http.post(url, json={"model": "gpt-x"}).status_code)
                except (httpx.HTTPError, MeteringError) as exc:
                    out.append(exc)
        return out

    async def async_go() -> list[Any]:
        out: list[Any] = []
        async with httpx.AsyncClient(transport=meter.async_transport(), timeout=10) as http:
            for _ in range(2):
                try:
                    out.append((await http.post(url, json={"model": "gpt-x"})).status_code)
                except (httpx.HTTPError, MeteringError) as exc:
                    out.append(exc)
        return out

    first, retry = sync_go() if flavour == "sync" else asyncio.run(async_go())
    assert isinstance(first, httpx.TransportError), first
    assert meter.fault is not None and "cut" in meter.fault
    assert isinstance(retry, MeteringError) and not isinstance(retry, RunStopped)
    assert len(fake.requests) == 1
