"""The Python SDK's spans (both flavours, one shared core): renewals, publications, checkpoint flushes
and side effects join the attempt's trace from TRACEPARENT; a side effect's receiver gets `traceparent`,
with or without an OpenTelemetry SDK installed."""

from __future__ import annotations

import asyncio
from typing import Any, Iterator

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry import trace as trace_api
from opentelemetry.trace import StatusCode

from tests.unit.worker.test_worker_aio import Fake
from tether.api.models import Signals
from tether.worker import AsyncWorkerRun, LeaseLost, WorkerRun
from tether.worker import tracing as worker_tracing
from tether.worker.ops import claimed, from_env_fields
from tether.worker.transport import Renewal

pytestmark = pytest.mark.unit
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
ATTEMPT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{ATTEMPT_SPAN}-01"


class SyncFake:
    def __init__(self) -> None:
        self.renewals = 0
        self.lose_after: int | None = None

    def renew(self, checkpoint: Any, usage: Any, requests: Any = None) -> Renewal:
        self.renewals += 1
        if self.lose_after is not None and self.renewals > self.lose_after:
            return Renewal(ok=False, lost=True, why="another holder")
        return Renewal(ok=True, signals=Signals())

    def publish(self, field: str, value: Any) -> bool:
        return True

    def recorded(self, field: str, value: Any) -> bool:
        return False

    def close(self) -> None:
        pass


def _sync(t: SyncFake, traceparent: str | None = TRACEPARENT) -> WorkerRun:
    return WorkerRun(name="job", namespace="ns", holder="job-a2", fence=3, attempt=2, lease_duration=30,
                     renew_interval=3600, transport=t, traceparent=traceparent)  # type: ignore[arg-type]


def _receiver(seen: list[httpx.Request]) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={})
    return httpx.MockTransport(answer)


def test_the_traceparent_comes_from_the_pods_environment_and_the_claim_reply() -> None:
    env = {"TETHER_RUN": "job", "TETHER_NAMESPACE": "ns", "TETHER_HOLDER": "job-a1", "TETHER_FENCE": "1",
           "TETHER_ATTEMPT": "1", "TETHER_LEASE_DURATION_SECONDS": "30", "TETHER_RENEW_INTERVAL_SECONDS": "5"}
    assert from_env_fields({**env, "TRACEPARENT": TRACEPARENT})["traceparent"] == TRACEPARENT
    assert from_env_fields(env)["traceparent"] is None
    reply = {"holder": "job-a1", "fence": 1, "attempt": 1, "leaseDurationSeconds": 30, "renewIntervalSeconds": 5,
             "idempotencyKey": "ns/job"}
    assert claimed({**reply, "traceparent": TRACEPARENT})["traceparent"] == TRACEPARENT
    assert claimed(reply)["traceparent"] is None and claimed({**reply, "traceparent": 7})["traceparent"] is None


def test_without_an_sdk_the_receiver_still_gets_the_attempts_context() -> None:
    seen: list[httpx.Request] = []
    with _sync(SyncFake()) as run, run.http_client(transport=_receiver(seen)) as http:
        http.effect("POST", "http://receiver/effects", "charge", json={})
    assert seen[0].headers["traceparent"] == TRACEPARENT and seen[0].headers["X-Execution-Fence"] == "3"


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(worker_tracing, "_tracer", lambda: provider.get_tracer(worker_tracing.SCOPE))
    yield exporter
    provider.shutdown()


def _check(exporter: InMemorySpanExporter, seen: list[httpx.Request]) -> None:
    got = exporter.get_finished_spans()
    by_name: dict[str, list[Any]] = {}
    for s in got:
        assert f"{s.context.trace_id:032x}" == TRACE, s.name
        by_name.setdefault(s.name, []).append(s)
    renew = by_name["tether.renew"]
    assert len(renew) >= 2 and all(f"{s.parent.span_id:016x}" == ATTEMPT_SPAN for s in renew)
    assert renew[0].attributes["tether.renewal"] == "confirmed"
    assert renew[0].attributes["tether.fence"] == 3 and renew[0].attributes["tether.attempt"] == 2
    assert by_name["tether.checkpoint"][0].attributes["tether.run.name"] == "job"
    (effect,) = by_name["tether.effect"]
    assert effect.attributes["http.response.status_code"] == 200 and effect.attributes["tether.operation"] == "charge"
    # The receiver got the effect span's own context, and the fence beside it.
    assert seen[0].headers["traceparent"] == f"00-{TRACE}-{effect.context.span_id:016x}-01"
    (publish,) = by_name["tether.publish"]
    assert publish.attributes["tether.publication"] == "result" and f"{publish.parent.span_id:016x}" == ATTEMPT_SPAN


def test_a_blocking_workers_spans_join_the_attempts_trace(spans: InMemorySpanExporter) -> None:
    seen: list[httpx.Request] = []
    with _sync(SyncFake()) as run, run.http_client(transport=_receiver(seen)) as http:
        run.checkpoint("row-1", flush=True)
        http.effect("POST", "http://receiver/effects", "charge", json={})
        run.complete({"ok": True})
    _check(spans, seen)


def test_an_asyncio_workers_spans_join_the_attempts_trace(spans: InMemorySpanExporter) -> None:
    seen: list[httpx.Request] = []

    async def main() -> None:
        fake = Fake()
        run = AsyncWorkerRun(name="job", namespace="ns", holder="job-a2", fence=3, attempt=2, lease_duration=30,
                             renew_interval=3600, transport=fake, traceparent=TRACEPARENT)  # type: ignore[arg-type]
        async with run, run.http_client(transport=_receiver(seen)) as http:
            run.checkpoint("row-1", flush=True)
            await http.effect("POST", "http://receiver/effects", "charge", json={})
            await run.complete({"ok": True})

    asyncio.run(main())
    _check(spans, seen)


def test_a_lost_renewal_and_a_refused_publication_are_errors_on_their_spans(spans: InMemorySpanExporter) -> None:
    fake = SyncFake()
    run = _sync(fake, traceparent="not a traceparent")  # invalid: spans are roots, work goes on
    run.start()
    fake.lose_after = 1
    with pytest.raises(LeaseLost):
        run.complete({"ok": True})
    run.stop()
    got = spans.get_finished_spans()
    assert all(s.parent is None for s in got)
    # The loss is seen by whichever renews first after it, the heartbeat thread (an outcome: "lost") or
    # complete()'s own renewal (raised: an error span with LeaseLost); in either order it is on a span.
    renews = [dict(s.attributes) for s in got if s.name == "tether.renew"]
    assert any(a.get("tether.renewal") == "lost" or a.get("exception.type") == "LeaseLost" for a in renews), renews
    (publish,) = [s for s in got if s.name == "tether.publish"]
    assert publish.status.status_code is StatusCode.ERROR and publish.attributes["exception.type"] == "LeaseLost"


SECRET_URL = "http://user:password@receiver:8443/effects?api_key=s3cr3t&mode=live&flag#token=t0k"
REDACTED_URL = "http://REDACTED:REDACTED@receiver:8443/effects?api_key=REDACTED&mode=REDACTED&flag"


@pytest.mark.parametrize("url, redacted", [
    (SECRET_URL, REDACTED_URL),  # the same vector as the TypeScript and Go SDKs' tests
    ("https://api.example.com/v1/charge", "https://api.example.com/v1/charge"),
    ("https://api.example.com/v1?a=1&a=2&=x", "https://api.example.com/v1?a=REDACTED&a=REDACTED&=REDACTED"),
    ("https://token@api.example.com/", "https://REDACTED:REDACTED@api.example.com/"),
])
def test_a_urls_credentials_and_query_values_are_redacted(url: str, redacted: str) -> None:
    assert worker_tracing.redact_url(url) == redacted


def test_an_effect_span_carries_no_credentials_of_its_url(spans: InMemorySpanExporter) -> None:
    """url.full must not carry credentials (OpenTelemetry semantic conventions): it carried the raw URL."""
    seen: list[httpx.Request] = []
    with _sync(SyncFake()) as run, run.http_client(transport=_receiver(seen)) as http:
        http.effect("POST", SECRET_URL, "charge", json={})
    (effect,) = [s for s in spans.get_finished_spans() if s.name == "tether.effect"]
    assert effect.attributes["url.full"] == REDACTED_URL
    assert seen[0].url.params["api_key"] == "s3cr3t"  # only the span is redacted, not the request


def test_quiet_renewals_are_not_spans(spans: InMemorySpanExporter) -> None:
    """A span per heartbeat grew the attempt's trace without limit; now only renewals that are news."""
    fake = SyncFake()
    run = _sync(fake)
    run.start()  # the first renewal: news (ownership confirmed)
    for _ in range(5):
        assert run.renew()  # nothing new: no spans
    run.report_usage(cents=3, tokens=10)
    run.checkpoint("row-1")
    assert run.renew()  # carries a checkpoint: a span
    assert run.renew()
    fake.lose_after = fake.renewals
    assert not run.renew()  # lost: a span
    run.stop()
    renew = [s for s in spans.get_finished_spans() if s.name == "tether.renew"]
    assert [s.attributes["tether.renewal"] for s in renew] == ["confirmed", "confirmed", "lost"], renew
    assert renew[1].attributes["tether.renewals.unrecorded"] >= 5  # the heartbeat thread may add one
    assert renew[2].attributes["tether.renewals.unrecorded"] >= 1
    assert all(f"{s.parent.span_id:016x}" == ATTEMPT_SPAN for s in renew)
    assert renew[0].start_time < renew[0].end_time


def test_new_signals_make_a_renewal_a_span(spans: InMemorySpanExporter) -> None:
    fake = SyncFake()
    run = _sync(fake)
    run.start()
    assert run.renew()
    fake.renew = lambda *a, **kw: Renewal(ok=True, signals=Signals(paused=True))  # type: ignore[method-assign]
    assert run.renew()
    assert run.renew()
    run.stop()
    renew = [s for s in spans.get_finished_spans() if s.name == "tether.renew"]
    assert len(renew) == 2


def test_a_callers_traceparent_in_another_case_is_replaced_not_doubled() -> None:
    """Headers merged as case-sensitive dicts sent the caller's `Traceparent` beside the SDK's
    `traceparent`; now one of each name: the SDK's traceparent, the SDK's fence headers."""
    seen: list[httpx.Request] = []
    mine = {"Traceparent": f"00-{'1' * 32}-{'2' * 16}-01", "IDEMPOTENCY-KEY": "forged", "x-execution-fence": "99",
            "X-Other": "kept"}
    with _sync(SyncFake()) as run, run.http_client(transport=_receiver(seen)) as http:
        http.effect("POST", "http://receiver/effects", "charge", json={}, headers=mine)
    names = [k.lower() for k, _ in seen[0].headers.multi_items()]
    assert names.count("traceparent") == 1 and names.count("idempotency-key") == 1
    assert names.count("x-execution-fence") == 1
    assert seen[0].headers["traceparent"] == TRACEPARENT
    assert seen[0].headers["x-execution-fence"] == "3" and seen[0].headers["x-other"] == "kept"
    assert seen[0].headers["idempotency-key"].endswith(":charge")


def test_an_abandoned_renewal_makes_no_span_in_whatever_tracer_is_current_when_it_is_collected(
        spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch) -> None:
    """A renewal whose generator was dropped unfinished (its thread hung past a test's or a worker's
    end) made an error span when the garbage collector closed it, with the tracer of that moment: in
    make test it landed, as a trace of its own, in a later test's exporter."""
    def steps() -> Any:
        yield "renew"  # waits for an answer that never comes
        return True

    attempt = worker_tracing.AttemptTrace(None, {})
    abandoned = attempt.renewal(steps(), None, lambda: None, outcome=lambda ok: "confirmed")
    assert next(abandoned) == "renew"
    later = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(later))
    monkeypatch.setattr(worker_tracing, "_tracer", lambda: provider.get_tracer(worker_tracing.SCOPE))
    abandoned.close()
    assert later.get_finished_spans() == () and spans.get_finished_spans() == ()
    # One that ends does make its span, in the tracer of its start.
    ended = attempt.renewal(steps(), None, lambda: None, outcome=lambda ok: "confirmed")
    assert next(ended) == "renew"
    monkeypatch.setattr(worker_tracing, "_tracer", lambda: trace_api.NoOpTracer())
    with pytest.raises(StopIteration):
        ended.send("answer")
    assert [s.name for s in later.get_finished_spans()] == ["tether.renew"]
