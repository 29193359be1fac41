"""tether.worker.metering against a local fake model API (tether.devcluster.fake_model): pricing and
parsing (sdk/vectors/metering.json), streamed and whole answers, hostile answers, concurrency."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tether import protocol
from tether.api.models import Usage
from tether.worker.core import RunCore
from tether.worker.metering import (MalformedUsage, Meter, MeteringError, MeteredTransport, PriceTable,
                                    RunStopped, UnpricedModel, cost, read_usage)
from tether.devcluster.fake_model import FakeModel

VECTORS = json.loads((Path(__file__).resolve().parents[3] / "sdk/vectors/metering.json").read_text())
PRICES = {"gpt-x": {"input": 2.5, "output": 10, "cached_input": 1.25},
          "claude-x": {"input": 3, "output": 15, "cached_input": 0.3, "cache_write": 3.75}}


class Reporter:
    """Takes reports the way WorkerRun does: protocol.valid_report refuses a decrease (ValueError)."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def report_usage(self, cents: int, tokens: int = 0) -> None:
        with self._lock:
            last = Usage(cents=self.reports[-1][0], tokens=self.reports[-1][1]) if self.reports else None
            why = protocol.valid_report(Usage(cents=cents, tokens=tokens), last)
            if why is not None:
                raise ValueError(why)
            self.reports.append((cents, tokens))

    @property
    def last(self) -> tuple[int, int]:
        return self.reports[-1] if self.reports else (0, 0)


@pytest.fixture
def fake() -> Iterator[FakeModel]:
    with FakeModel(input_tokens=1000, output_tokens=500) as f:
        yield f


def client(meter: Meter) -> httpx.Client:
    return httpx.Client(transport=meter.transport(), timeout=10)


# --- pricing and parsing: the vectors every SDK runs ---------------------------------------------

@pytest.mark.parametrize("case", VECTORS["lookups"], ids=lambda c: c["model"] or "empty")
def test_price_lookup(case: dict[str, Any]) -> None:
    assert PriceTable(VECTORS["prices"]).key(case["model"]) == case["key"]


@pytest.mark.parametrize("case", VECTORS["usages"], ids=lambda c: c["name"])
def test_usage_priced(case: dict[str, Any]) -> None:
    price = PriceTable(VECTORS["prices"]).lookup(case["model"])
    assert price is not None
    if case.get("malformed"):
        with pytest.raises(MalformedUsage):
            cost(read_usage(case["usage"]), price)
        return
    units, tokens = cost(read_usage(case["usage"]), price)
    assert (units, tokens) == (case["units"], case["tokens"])
    reporter = Reporter()
    meter = Meter(reporter, VECTORS["prices"])
    from tether.worker.metering import _Answer
    _Answer(meter, case["model"]).see(case["usage"], None)
    assert meter.cents == case["cents"] and reporter.last == ((case["cents"], case["tokens"]) if tokens else (0, 0))


@pytest.mark.parametrize("bad", [{}, {"m": {"input": 1}}, {"m": {"input": -1, "output": 1}},
                                 {"m": {"input": "x", "output": 1}}, {"m": {"input": float("nan"), "output": 1}},
                                 {"m": {"input": 1, "output": 1, "typo": 2}}, {"m": {"input": True, "output": 1}},
                                 {"m": {"input": 2e6, "output": 1}}])
def test_bad_price_tables_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Meter(Reporter(), bad)


def test_cents_round_up_on_the_total_not_per_answer() -> None:
    reporter = Reporter()
    meter = Meter(reporter, {"m": {"input": 1, "output": 1}})
    from tether.worker.metering import _Answer
    for _ in range(3):  # 4000 tokens at $1/M = 0.4 cent each: 1, 1, 2 -- never 3
        _Answer(meter, "m").see({"input_tokens": 4000, "output_tokens": 0}, None)
    assert reporter.reports == [(1, 4000), (1, 8000), (2, 12000)]


def test_own_spending_adds_to_the_meter_and_reports_never_decrease(fake: FakeModel) -> None:
    reporter = Reporter()
    reporter.report_usage(7, 100)  # reported before the meter existed
    meter = Meter(reporter, PRICES, base_cents=7, base_tokens=100)
    meter.add(cents=5)
    assert reporter.last == (12, 100)
    client(meter).post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})
    # 1000 prompt at 2.5 + 500 completion at 10 = 0.75 cent, on top of 12 exact cents
    assert reporter.last == (13, 1600)
    with pytest.raises(ValueError):
        meter.add(cents=-1)


def test_a_refused_report_faults_the_meter(fake: FakeModel) -> None:
    reporter = Reporter()
    meter = Meter(reporter, PRICES)
    reporter.report_usage(50, 0)  # someone reported past the meter: its next report would decrease
    http = client(meter)
    http.post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})
    assert meter.fault and "refused" in meter.fault
    with pytest.raises(MeteringError):
        http.post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})


# --- whole answers -------------------------------------------------------------------------------

@pytest.mark.parametrize("path,model,cents,tokens", [
    ("/v1/chat/completions", "gpt-x", 1, 1500),        # 1000*2.5 + 500*10 = 0.75 cent
    ("/v1/responses", "gpt-x", 1, 1500),
    ("/v1/messages", "claude-x", 2, 1500),            # 1000*3 + 500*15 = 1.05 cents
])
def test_whole_answers_are_metered(fake: FakeModel, path: str, model: str, cents: int, tokens: int) -> None:
    reporter = Reporter()
    answer = client(Meter(reporter, PRICES)).post(fake.url + path, json={"model": model})
    assert answer.status_code == 200 and "usage" in answer.json()
    assert reporter.reports == [(cents, tokens)]


def test_cached_and_cache_write_tokens_priced_apart() -> None:
    with FakeModel(input_tokens=1_000_000, output_tokens=0, cached_tokens=1_000_000, cache_write_tokens=1_000_000) as f:
        reporter = Reporter()
        http = client(Meter(reporter, PRICES))
        http.post(f.url + "/v1/messages", json={"model": "claude-x"})  # 300 + 30 + 375 cents
        assert reporter.last == (705, 3_000_000)
        f.next(input_tokens=2_000_000)
        http.post(f.url + "/v1/chat/completions", json={"model": "gpt-x"})  # 1M fresh 250 + 1M cached 125
        assert reporter.last == (705 + 375, 5_000_000)


def test_gzip_answers_reach_the_caller_intact_and_are_metered(fake: FakeModel) -> None:
    reporter = Reporter()
    http = client(Meter(reporter, PRICES))
    fake.next(gzip=True)
    answer = http.post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})
    assert answer.headers["content-encoding"] == "gzip" and answer.json()["usage"]["prompt_tokens"] == 1000
    fake.next(gzip=True)
    with http.stream("POST", fake.url + "/v1/messages", json={"model": "claude-x", "stream": True}) as s:
        events = [line for line in s.iter_lines() if line.startswith("event:")]
    assert events[0] == "event: message_start" and events[-1] == "event: message_stop"
    assert reporter.last == (2, 3000)  # 0.75 + 1.05 cents, rounded up once
    # The meter asks only for encodings it can read.
    assert all(r["acceptEncoding"] == "gzip, deflate" for r in fake.requests)


def test_an_answer_in_an_unreadable_encoding_faults(fake: FakeModel) -> None:
    meter = Meter(Reporter(), PRICES)
    inner = httpx.MockTransport(lambda req: httpx.Response(200, headers={"content-encoding": "br",
                                                                         "content-type": "application/json"},
                                                           content=b"\x8b\x00"))
    httpx.Client(transport=MeteredTransport(meter, inner=inner)).post("http://m/v1/chat/completions",
                                                                     json={"model": "gpt-x"})
    assert meter.fault and "br" in meter.fault


@pytest.mark.parametrize("status", [400, 429, 500])
def test_usage_in_an_error_answer_is_charged(fake: FakeModel, status: int) -> None:
    reporter = Reporter()
    fake.next(status=status, usage={"prompt_tokens": 4000, "completion_tokens": 0})
    answer = client(Meter(reporter, PRICES)).post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})
    assert answer.status_code == status and reporter.reports == [(1, 4000)]


@pytest.mark.parametrize("path,status,body", [("/v1/chat/completions", 502, b"<html>Bad gateway</html>"),
                                              ("/v1/messages", 500, b""), ("/v1/audio/speech", 200, b"\x89PNG"),
                                              ("/v1/embeddings", 200, b'{"data": []}')])
def test_answers_without_usage_charge_nothing_and_do_not_fault(fake: FakeModel, path: str, status: int,
                                                                 body: bytes) -> None:
    """Error answers, and 2xx answers off the generation endpoints (speech, embeddings)."""
    reporter = Reporter()
    meter = Meter(reporter, PRICES)
    fake.next(status=status, body=body)
    answer = client(meter).post(fake.url + path, json={"model": "gpt-x"})
    assert answer.status_code == status and answer.content == body
    assert reporter.reports == [] and meter.fault is None


def test_error_answer_without_usage_and_requests_naming_no_model(fake: FakeModel) -> None:
    reporter = Reporter()
    meter = Meter(reporter, PRICES)
    fake.next(status=401)
    assert client(meter).post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"}).status_code == 401
    assert client(meter).get(fake.url + "/v1/models").json()["data"]
    assert reporter.reports == [] and meter.fault is None


@pytest.mark.parametrize("usage", [{"prompt_tokens": -1, "completion_tokens": 5},
                                   {"prompt_tokens": 10**12, "completion_tokens": 5},
                                   {"prompt_tokens": "lots"}, "garbage",
                                   {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 6}}])
def test_a_malformed_usage_block_is_not_charged_and_stops_further_requests(fake: FakeModel, usage: Any) -> None:
    reporter = Reporter()
    meter = Meter(reporter, PRICES)
    http = client(meter)
    fake.next(usage=usage)
    answer = http.post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})
    assert answer.status_code == 200  # the answer already paid for is delivered
    assert reporter.reports == [] and meter.fault
    sent = len(fake.requests)
    with pytest.raises(MeteringError):
        http.post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})
    assert len(fake.requests) == sent  # refused before it was sent


def test_a_json_answer_that_is_not_json_faults(fake: FakeModel) -> None:
    meter = Meter(Reporter(), PRICES)
    fake.next(body=b'{"usage": {"prompt_tokens": 3', content_type="application/json")
    client(meter).post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})
    assert meter.fault and "not JSON" in meter.fault


def test_an_unpriced_model_is_refused_before_it_is_sent(fake: FakeModel) -> None:
    meter = Meter(Reporter(), PRICES)
    with pytest.raises(UnpricedModel):
        client(meter).post(fake.url + "/v1/chat/completions", json={"model": "gpt-y", "stream": True})
    assert fake.requests == [] and meter.fault is None


def test_the_answers_model_prices_it_else_the_requests(fake: FakeModel) -> None:
    reporter = Reporter()
    meter = Meter(reporter, {**PRICES, "gpt-x-cheap": {"input": 0, "output": 0}})
    http = client(meter)
    fake.next(model="claude-x-20250101")     # priced by what answered: 1.05 cents
    http.post(fake.url + "/v1/chat/completions", json={"model": "gpt-x-cheap"})
    assert reporter.last == (2, 1500)
    inner = httpx.MockTransport(lambda req: httpx.Response(200, json={"usage": {"prompt_tokens": 4000,
                                                                                "completion_tokens": 0}}))
    httpx.Client(transport=MeteredTransport(meter, inner=inner)).post("http://m/v1/chat/completions",
                                                                     json={"model": "gpt-x"})
    assert reporter.last == (3, 5500) and meter.fault is None  # the answer names none: priced as asked


@pytest.mark.parametrize("body", [{"model": "gpt-x-cheap"}, {"messages": []}])
def test_an_answer_naming_an_unpriced_model_faults_even_if_the_request_is_priced(fake: FakeModel,
                                                                                  body: dict[str, Any]) -> None:
    """A router or alias answering with a model the table does not price is not priced at the
    requested (cheaper) model's rate: fail closed."""
    reporter = Reporter()
    meter = Meter(reporter, {**PRICES, "gpt-x-cheap": {"input": 0, "output": 0}})
    fake.next(model="mystery-model")
    assert client(meter).post(fake.url + "/v1/chat/completions", json=body).status_code == 200
    assert reporter.reports == [] and meter.fault and "mystery-model" in meter.fault


# --- streams -------------------------------------------------------------------------------------

def test_a_streamed_chat_completion_is_asked_for_its_usage(fake: FakeModel) -> None:
    reporter = Reporter()
    http = client(Meter(reporter, PRICES))
    body = {"model": "gpt-x", "stream": True, "stream_options": {"include_usage": False, "other": 1}, "messages": []}
    with http.stream("POST", fake.url + "/v1/chat/completions", json=body) as s:
        metered = s.read()
    sent = fake.requests[-1]["body"]
    assert sent["stream_options"] == {"include_usage": True, "other": 1} and sent["messages"] == []
    assert reporter.last == (1, 1500)
    # The caller got exactly the bytes the server sent for that request.
    with httpx.Client() as plain:
        assert plain.post(fake.url + "/v1/chat/completions", json=sent).content == metered


@pytest.mark.parametrize("path,model", [("/v1/chat/completions", "gpt-x"), ("/v1/responses", "gpt-x"),
                                        ("/v1/messages", "claude-x")])
def test_streams_pass_through_unbuffered(fake: FakeModel, path: str, model: str) -> None:
    gate = threading.Event()
    fake.next(gate=gate)
    reporter = Reporter()
    with client(Meter(reporter, PRICES)).stream("POST", fake.url + path, json={"model": model, "stream": True}) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])  # the first event arrived while the server still holds the rest
        gate.set()
        rest = list(lines)
    assert any("[DONE]" in line or "message_stop" in line or "response.completed" in line for line in rest)
    assert reporter.last[1] == 1500


def test_an_abandoned_anthropic_stream_charges_what_message_start_said(fake: FakeModel) -> None:
    gate = threading.Event()
    fake.next(gate=gate, input_tokens=10_000)
    reporter = Reporter()
    try:
        with client(Meter(reporter, PRICES)).stream("POST", fake.url + "/v1/messages",
                                                    json={"model": "claude-x", "stream": True}) as s:
            next(line for line in s.iter_lines() if line.startswith("data:"))
        # left after the first event: input 10000 at $3/M + 1 output token
        assert reporter.reports == [(4, 10_001)]
    finally:
        gate.set()


@pytest.mark.parametrize("path,model,cut,expect,faults", [
    ("/v1/messages", "claude-x", 10, (2, 1500), False),  # cut inside message_stop: every usage seen
    ("/v1/messages", "claude-x", 9, (1, 1001), True),    # cut inside message_delta: message_start's usage only
    ("/v1/messages", "claude-x", 2, (1, 1001), True),    # cut after message_start (the fault trials found it free)
    ("/v1/messages", "claude-x", 0, (0, 0), True),       # cut inside message_start
    ("/v1/chat/completions", "gpt-x", 6, (0, 0), True),  # cut inside the usage chunk: OpenAI's usage never seen
    ("/v1/responses", "gpt-x", 7, (0, 0), True),         # cut inside response.completed
])
def test_a_stream_cut_mid_event_charges_what_it_saw(fake: FakeModel, path: str, model: str, cut: int,
                                                    expect: tuple[int, int], faults: bool) -> None:
    """Cut by the server (not abandoned by the caller): what it saw is charged, and a stream that
    ended without its final usage faults the meter (message_start's opening count is not final: the
    answer's output went uncounted), so later requests are refused."""
    reporter = Reporter()
    meter = Meter(reporter, PRICES)
    fake.next(cut_after=cut)
    with client(meter).stream("POST", fake.url + path, json={"model": model, "stream": True}) as s:
        try:
            s.read()
        except httpx.HTTPError:
            pass
    assert reporter.last == expect
    assert (meter.fault is not None) is faults, meter.fault


def test_a_malformed_usage_event_faults(fake: FakeModel) -> None:
    reporter = Reporter()
    meter = Meter(reporter, PRICES)
    fake.next(usage={"input_tokens": -3, "output_tokens": 1})
    with client(meter).stream("POST", fake.url + "/v1/messages", json={"model": "claude-x", "stream": True}) as s:
        assert b"message_stop" in s.read()
    assert reporter.reports == [] and meter.fault


# --- concurrency ---------------------------------------------------------------------------------

def test_concurrent_requests_through_one_transport_lose_nothing(fake: FakeModel) -> None:
    reporter = Reporter()
    meter = Meter(reporter, PRICES)
    http = client(meter)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(10):
                stream = (i + j) % 2 == 0
                path, model = ("/v1/messages", "claude-x") if j % 3 else ("/v1/chat/completions", "gpt-x")
                with http.stream("POST", fake.url + path, json={"model": model, "stream": stream}) as s:
                    s.read()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and meter.fault is None
    # 80 answers of 1500 tokens: 32 OpenAI (0.75 cent), 48 Anthropic (1.05 cents): 74.4 cents
    assert reporter.last == (75, 80 * 1500)
    assert reporter.reports == sorted(reporter.reports)


def test_concurrent_async_requests_lose_nothing(fake: FakeModel) -> None:
    reporter = Reporter()
    meter = Meter(reporter, PRICES)

    async def main() -> None:
        async with httpx.AsyncClient(transport=meter.async_transport(), timeout=10) as http:
            async def one(i: int) -> None:
                if i % 2:
                    async with http.stream("POST", fake.url + "/v1/messages",
                                           json={"model": "claude-x", "stream": True}) as s:
                        async for _ in s.aiter_bytes():
                            pass
                else:
                    (await http.post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})).raise_for_status()
            await asyncio.gather(*(one(i) for i in range(40)))

    asyncio.run(main())
    assert reporter.last == (-(-(20 * 75 + 20 * 105) // 100), 40 * 1500) and meter.fault is None


def test_async_transport_refuses_unpriced_and_meters_gzip(fake: FakeModel) -> None:
    reporter = Reporter()
    meter = Meter(reporter, PRICES)

    async def main() -> None:
        async with httpx.AsyncClient(transport=meter.async_transport()) as http:
            with pytest.raises(UnpricedModel):
                await http.post(fake.url + "/v1/messages", json={"model": "nope"})
            fake.next(gzip=True)
            answer = await http.post(fake.url + "/v1/messages", json={"model": "claude-x"})
            assert answer.json()["usage"]["output_tokens"] == 500

    asyncio.run(main())
    assert reporter.reports == [(2, 1500)]


def test_deflate_decoding_of_both_kinds() -> None:
    import zlib
    from tether.worker.metering import _Decoder
    doc = b'{"usage": {}}'
    for data in (zlib.compress(doc), zlib.compress(doc)[2:-4], gzip.compress(doc)):
        enc = "gzip" if data[:2] == b"\x1f\x8b" else "deflate"
        assert _Decoder(enc).feed(data) == doc


# --- answers that end without usage (never silently free) -----------------------------------------

def _refused_after(http: httpx.Client, fake: FakeModel) -> None:
    sent = len(fake.requests)
    with pytest.raises(MeteringError):
        http.post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})
    assert len(fake.requests) == sent


@pytest.mark.parametrize("path,model,knobs", [
    ("/v1/chat/completions", "gpt-x", {"usage": None}),
    ("/v1/responses", "gpt-x", {"usage": None}),
    ("/v1/messages", "claude-x", {"usage": None}),
    ("/v1/chat/completions", "gpt-x", {"body": b'{"id": "x", "choices": []}', "content_type": "application/json"}),
    ("/v1/completions", "gpt-x", {"body": b"\x89PNG"}),
    ("/v1/chat/completions", "gpt-x", {"usage": {}}),
])
def test_a_2xx_whole_answer_without_usage_faults(fake: FakeModel, path: str, model: str, knobs: dict[str, Any]) -> None:
    reporter = Reporter()
    meter = Meter(reporter, PRICES)
    http = client(meter)
    fake.next(**knobs)
    assert http.post(fake.url + path, json={"model": model}).status_code == 200  # delivered
    assert reporter.reports == [] and meter.fault and "no usage" in meter.fault
    _refused_after(http, fake)


@pytest.mark.parametrize("path,model", [("/v1/chat/completions", "gpt-x"), ("/v1/responses", "gpt-x"),
                                        ("/v1/messages", "claude-x")])
def test_a_stream_that_completes_without_usage_faults(fake: FakeModel, path: str, model: str) -> None:
    reporter = Reporter()
    meter = Meter(reporter, PRICES)
    http = client(meter)
    fake.next(usage=None)
    with http.stream("POST", fake.url + path, json={"model": model, "stream": True}) as s:
        s.read()
    assert reporter.reports == [] and meter.fault and "no usage" in meter.fault
    _refused_after(http, fake)


def test_done_without_a_usage_chunk_faults_even_if_the_caller_stops_there() -> None:
    """A compatible server that ignores include_usage: [DONE] with no usage chunk before it."""
    meter = Meter(Reporter(), PRICES)
    sse = b'data: {"model": "gpt-x", "choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n'
    inner = httpx.MockTransport(lambda req: httpx.Response(200, headers={"content-type": "text/event-stream"},
                                                           content=iter([sse, b": trailing comment\n\n"])))
    with httpx.Client(transport=MeteredTransport(meter, inner=inner)).stream(
            "POST", "http://m/v1/chat/completions", json={"model": "gpt-x", "stream": True}) as s:
        for line in s.iter_lines():
            if "[DONE]" in line:
                break
    assert meter.fault and "no usage" in meter.fault


def test_a_stream_the_caller_abandons_does_not_fault(fake: FakeModel) -> None:
    gate = threading.Event()
    fake.next(gate=gate)
    reporter = Reporter()
    meter = Meter(reporter, PRICES)
    try:
        with client(meter).stream("POST", fake.url + "/v1/chat/completions",
                                  json={"model": "gpt-x", "stream": True}) as s:
            next(line for line in s.iter_lines() if line.startswith("data:"))
    finally:
        gate.set()
    assert reporter.reports == [] and meter.fault is None  # the documented gap: nothing seen, nothing charged


@pytest.mark.parametrize("ctype", ["text/plain", None])
def test_a_stream_asked_for_is_read_as_sse_whatever_its_content_type(ctype: str | None) -> None:
    """Decided by the request's "stream": true: passed on unbuffered and metered."""
    reporter = Reporter()
    meter = Meter(reporter, PRICES)
    gate, delivered = threading.Event(), []
    events = [b'data: {"model": "gpt-x", "choices": [{"delta": {"content": "hi"}}]}\n\n',
              b'data: {"model": "gpt-x", "choices": [], "usage": {"prompt_tokens": 1000, "completion_tokens": 500}}'
              b'\n\ndata: [DONE]\n\n']

    def body() -> Iterator[bytes]:
        yield events[0]
        gate.wait(5)
        yield events[1]

    headers = {"content-type": ctype} if ctype else {}
    inner = httpx.MockTransport(lambda req: httpx.Response(200, headers=headers, content=body()))
    with httpx.Client(transport=MeteredTransport(meter, inner=inner)).stream(
            "POST", "http://m/v1/chat/completions", json={"model": "gpt-x", "stream": True}) as s:
        for _ in s.iter_raw():
            delivered.append(gate.is_set())
            gate.set()
    assert delivered[0] is False  # the first event reached the caller before the server sent the rest
    assert reporter.reports == [(1, 1500)] and meter.fault is None


def test_groq_usage_under_x_groq_is_charged() -> None:
    reporter = Reporter()
    meter = Meter(reporter, PRICES)
    sse = (b'data: {"model": "gpt-x", "choices": [{"delta": {"content": "hi"}}]}\n\n'
           b'data: {"model": "gpt-x", "choices": [], "x_groq": {"id": "r", "usage": {"prompt_tokens": 1000, '
           b'"completion_tokens": 500}}}\n\ndata: [DONE]\n\n')
    inner = httpx.MockTransport(lambda req: httpx.Response(200, headers={"content-type": "text/event-stream"},
                                                           content=sse))
    with httpx.Client(transport=MeteredTransport(meter, inner=inner)).stream(
            "POST", "http://m/v1/chat/completions", json={"model": "gpt-x", "stream": True}) as s:
        s.read()
    assert reporter.reports == [(1, 1500)] and meter.fault is None


def test_async_stream_completing_without_usage_faults(fake: FakeModel) -> None:
    meter = Meter(Reporter(), PRICES)

    async def main() -> None:
        async with httpx.AsyncClient(transport=meter.async_transport()) as http:
            fake.next(usage=None)
            async with http.stream("POST", fake.url + "/v1/messages", json={"model": "claude-x", "stream": True}) as s:
                await s.aread()

    asyncio.run(main())
    assert meter.fault and "no usage" in meter.fault


# --- a run that may not spend any more --------------------------------------------------------------

def _run() -> RunCore:
    return RunCore(name="r", namespace="ns", holder="w", fence=1, attempt=1, lease_duration=30, renew_interval=10)


@pytest.mark.parametrize("end", ["lost", "finished", "stop"])
def test_a_run_that_may_not_spend_refuses_requests(fake: FakeModel, end: str) -> None:
    run = _run()
    assert run.ownership_unknown  # never renewed: unknown ownership does not refuse
    meter = Meter(run, PRICES)
    http = client(meter)
    http.post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})
    assert meter.cents == 1 and meter.fault is None
    if end == "lost":
        run._mark_lost("test")
    elif end == "finished":
        run._finished = True
    else:
        from tether.api.models import Signals
        run._signals = Signals(stop=True, reason="BudgetExceeded")
    sent = len(fake.requests)
    with pytest.raises(RunStopped) as refused:
        http.post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})
    assert isinstance(refused.value, MeteringError) and len(fake.requests) == sent
    if end == "stop":
        assert "BudgetExceeded" in str(refused.value)


def test_a_reporter_without_run_state_is_taken_to_be_working(fake: FakeModel) -> None:
    class Bare:
        def report_usage(self, cents: int, tokens: int = 0) -> None:
            pass
    client(Meter(Bare(), PRICES)).post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})


def test_a_report_that_raises_anything_faults_the_meter(fake: FakeModel) -> None:
    class Gone:
        def report_usage(self, cents: int, tokens: int = 0) -> None:
            raise RuntimeError("run finished")
    meter = Meter(Gone(), PRICES)
    http = client(meter)
    http.post(fake.url + "/v1/chat/completions", json={"model": "gpt-x"})
    assert meter.fault and "run finished" in meter.fault
    _refused_after(http, fake)
