"""Usage metered from the model's own answers: an httpx transport that reads the `usage` of every
OpenAI-compatible or Anthropic-style answer (streamed or not), prices it from a table you pass, and
reports the attempt's cumulative cents and tokens through `report_usage` on the heartbeat.

    from tether.worker.metering import Meter

    meter = Meter(run, {"gpt-4o-mini": {"input": 0.15, "output": 0.60, "cached_input": 0.075}})
    client = OpenAI(http_client=httpx.Client(transport=meter.transport()))
    aclient = AsyncAnthropic(http_client=httpx.AsyncClient(transport=meter.async_transport()))

Prices are USD per million tokens. The rules (rounding, unknown models, streams without usage,
answers that cannot be read) are in docs/budgets.md, "Metering model spend"; the pricing and
parsing cases every SDK passes are in sdk/vectors/metering.json.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import zlib
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import Any, AsyncIterator, Iterator, Mapping, Protocol

import httpx

from tether.worker.ops import cap_used_up

log = logging.getLogger("tether.worker.metering")

# Money is counted in integer units of 1e-12 USD: a price of P USD per million tokens is P * 1e6
# units per token, and a cent is 1e10 units. Exact: no float ever touches an amount.
UNITS_PER_CENT = 10**10
MICRO = 10**6
MAX_PRICE = 10**6               # USD per million tokens; anything above is a typo
MAX_TOKENS_PER_ANSWER = 10**9   # no answer has a billion tokens: a larger count is malformed
MAX_READ_AHEAD = 64 * 2**20     # a non-streamed answer is read whole to find its usage, up to this
MAX_EVENT = 16 * 2**20          # one SSE event, at most
_DATE_SUFFIX = re.compile(r"^(.+)-(\d{4}-\d{2}-\d{2}|\d{8})$")
# Generation endpoints: a 2xx answer to a request naming a model on one of these carries usage.
_GENERATION = ("/completions", "/responses", "/messages")
_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details.cached_tokens",
           "input_tokens", "output_tokens", "input_tokens_details.cached_tokens",
           "cache_read_input_tokens", "cache_creation_input_tokens")


class UsageReporter(Protocol):
    """What the meter reports to: WorkerRun and AsyncWorkerRun both have this synchronous method.

    Optionally (WorkerRun and AsyncWorkerRun have them all), what says whether the run may still
    spend: `lost` (the lease is lost), `finished` (a result or an error was published),
    `signals.stop` (the control plane told the worker to stop) and `signals.cap_remaining_cents` /
    `cap_remaining_tokens` (what the control plane last said was left of the run's caps, less what
    was reported since). The meter refuses to send a request while any is true or a cap is used up
    (0 or less left); a reporter without them is taken to be working."""

    def report_usage(self, cents: int, tokens: int = 0) -> None: ...


def run_refusal(reporter: Any) -> str | None:
    """Why the run behind `reporter` may not spend any more (its lease lost, its result or error
    published, told to stop, its cap used up by its own reports), or None. Ownership merely unknown
    (a renewal not answered yet) is not a reason: a brief API blip must not break model calls."""
    try:
        if getattr(reporter, "lost", False) is True:
            return "the run's lease is lost"
        if getattr(reporter, "finished", False) is True:
            return "the run has finished (its result or error is published)"
        signals = getattr(reporter, "signals", None)
        if signals is not None and getattr(signals, "stop", False) is True:
            reason = getattr(signals, "reason", None)
            return "the control plane asked this worker to stop" + (f" ({reason})" if reason else "")
        if signals is not None:
            # The run's own arithmetic (cap - base - own reports), not a copy of it: spending is
            # refused as soon as the meter's own report reaches the cap, not a heartbeat or two later.
            used_up = cap_used_up(getattr(signals, "cap_remaining_cents", None),
                                  getattr(signals, "cap_remaining_tokens", None))
            if used_up is not None:
                return used_up
    except Exception:  # noqa: BLE001 - a reporter whose state cannot be read is taken to be working
        return None
    return None


class MeteringError(RuntimeError):
    """A request the meter will not send: it could not price it, or an earlier answer could not be
    metered (the meter is faulted: `Meter.fault` says why) and spending on blind is refused."""


class RunStopped(MeteringError):
    """A request refused because the run may not spend any more: its lease is lost, its result or
    error is published, the control plane told the worker to stop, or the attempt's own reports
    used up what was left of the run's cap. Spend then would be reported to no one, or be past the
    cap. The meter is not faulted: nothing went unmetered."""


class UnpricedModel(MeteringError):
    """The request names a model the price table has no price for."""


class MalformedUsage(ValueError):
    """A usage block that is not the counts the meter can read."""


def _micro(value: Any, what: str) -> int:
    """USD per million tokens -> integer micro-USD per million tokens (= 1e-12 USD per token),
    rounded up past the sixth decimal (never less than the price)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str, Decimal)):
        raise ValueError(f"price {what}: a number of USD per million tokens, not {value!r}")
    try:
        d = Decimal(str(value)) if isinstance(value, float) else Decimal(value)
    except InvalidOperation:
        raise ValueError(f"price {what}: not a number: {value!r}") from None
    if not d.is_finite() or d < 0 or d > MAX_PRICE:
        raise ValueError(f"price {what}: must be 0 to {MAX_PRICE} USD per million tokens, not {value!r}")
    return int((d * MICRO).to_integral_value(rounding=ROUND_CEILING))


@dataclass(frozen=True)
class Price:
    """One model's prices in USD per million tokens. `cached_input` (a prompt-cache read; default:
    the input price) and `cache_write` (an Anthropic cache write; default: twice the input price,
    Anthropic's dearest write) never default to less than the provider could charge."""

    input: int           # all four in micro-USD per million tokens (see _micro)
    output: int
    cached_input: int
    cache_write: int

    @classmethod
    def of(cls, model: str, spec: Any) -> "Price":
        if isinstance(spec, Price):
            return spec
        if not isinstance(spec, Mapping):
            raise ValueError(f"price of {model!r}: a mapping with input and output, not {spec!r}")
        aliases = {"cachedInput": "cached_input", "cacheWrite": "cache_write"}
        spec = {aliases.get(k, k): v for k, v in spec.items()}
        unknown = set(spec) - {"input", "output", "cached_input", "cache_write"}
        if unknown or "input" not in spec or "output" not in spec:
            raise ValueError(f"price of {model!r}: needs input and output (and optionally cached_input, "
                             f"cache_write), got {sorted(spec)}")
        inp = _micro(spec["input"], f"{model}.input")
        return cls(inp, _micro(spec["output"], f"{model}.output"),
                   _micro(spec["cached_input"], f"{model}.cached_input") if spec.get("cached_input") is not None
                   else inp,
                   _micro(spec["cache_write"], f"{model}.cache_write") if spec.get("cache_write") is not None
                   else 2 * inp)


class PriceTable:
    """Model name -> Price. A name is priced by, in order: its exact key; the key it names with a
    date suffix removed (`-2024-08-06`, `-20241022`); the longest key ending in `*` it starts with
    (`"gpt-4o*"`, or `"*"` for every model). Otherwise it is unpriced."""

    def __init__(self, prices: Mapping[str, Any]) -> None:
        if not isinstance(prices, Mapping) or not prices:
            raise ValueError("price table: a non-empty mapping of model name to prices")
        self._prices = {str(k): Price.of(str(k), v) for k, v in prices.items()}
        self._prefixes = sorted((k for k in self._prices if k.endswith("*")), key=len, reverse=True)

    def key(self, model: str | None) -> str | None:
        """The table entry that prices `model`, or None."""
        if not isinstance(model, str) or not model:
            return None
        if model in self._prices and not model.endswith("*"):
            return model
        m = _DATE_SUFFIX.match(model)
        if m and m.group(1) in self._prices and not m.group(1).endswith("*"):
            return m.group(1)
        return next((k for k in self._prefixes if model.startswith(k[:-1])), None)

    def lookup(self, model: str | None) -> Price | None:
        key = self.key(model)
        return None if key is None else self._prices[key]


def read_usage(usage: Any) -> dict[str, int]:
    """The counts the meter prices, from one usage block (nested details flattened with a dot).
    Null counts are absent. Raises MalformedUsage for anything else that is not a count."""
    if not isinstance(usage, Mapping):
        raise MalformedUsage(f"usage is not an object: {str(usage)[:80]}")
    out: dict[str, int] = {}
    for field in _FIELDS:
        head, _, tail = field.partition(".")
        value: Any = usage.get(head)
        if tail:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise MalformedUsage(f"usage.{head} is not an object")
            value = value.get(tail)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS_PER_ANSWER:
            raise MalformedUsage(f"usage.{field} is not a count of 0 to {MAX_TOKENS_PER_ANSWER}: {str(value)[:40]}")
        out[field] = value
    return out


def cost(counts: Mapping[str, int], price: Price) -> tuple[int, int]:
    """(units of 1e-12 USD, tokens) of one answer's counts. OpenAI's prompt/input tokens include
    the cached ones; Anthropic's input_tokens exclude cache reads and writes."""
    def n(key: str) -> int:
        return counts.get(key, 0)

    if "prompt_tokens" in counts or "completion_tokens" in counts:          # chat completions
        total_in, cached, written, out = n("prompt_tokens"), n("prompt_tokens_details.cached_tokens"), 0, \
            n("completion_tokens")
    elif "input_tokens_details.cached_tokens" in counts or "total_tokens" in counts:  # responses API
        total_in, cached, written, out = n("input_tokens"), n("input_tokens_details.cached_tokens"), 0, \
            n("output_tokens")
    else:                                                                     # Anthropic messages
        cached, written, out = n("cache_read_input_tokens"), n("cache_creation_input_tokens"), n("output_tokens")
        total_in = n("input_tokens") + cached + written
    if cached + written > total_in:
        raise MalformedUsage(f"{cached} cached input tokens of {total_in}")
    fresh = total_in - cached - written
    units = fresh * price.input + cached * price.cached_input + written * price.cache_write + out * price.output
    return units, total_in + out


def _cents(units: int) -> int:
    return -(-units // UNITS_PER_CENT)  # up: the cap is never under-charged


class Meter:
    """The attempt's metered spend, reported cumulatively through `reporter.report_usage`.

    The meter is the single source of the attempt's usage reports: report other spending with
    `add()`, never with report_usage directly (a report lower than the meter's would be refused).
    Usage reported before the meter was made goes in `base_cents` / `base_tokens`. One meter per
    run; its transports may be shared by any number of threads and event loops."""

    def __init__(self, reporter: UsageReporter, prices: Mapping[str, Any] | PriceTable, *,
                 base_cents: int = 0, base_tokens: int = 0) -> None:
        self.prices = prices if isinstance(prices, PriceTable) else PriceTable(prices)
        for v in (base_cents, base_tokens):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError("base usage: non-negative integers")
        self._reporter = reporter
        self._lock = threading.Lock()   # held for arithmetic and one in-memory report; never across I/O
        self._units = base_cents * UNITS_PER_CENT
        self._tokens = base_tokens
        self._reported = (base_cents, base_tokens)
        self._fault: str | None = None

    @property
    def cents(self) -> int:
        with self._lock:
            return _cents(self._units)

    @property
    def tokens(self) -> int:
        with self._lock:
            return self._tokens

    @property
    def fault(self) -> str | None:
        """Why the meter refuses new requests (an answer it could not meter), or None."""
        with self._lock:
            return self._fault

    def add(self, cents: int = 0, tokens: int = 0) -> None:
        """Adds spending the meter does not see (a tool's bill, an unmetered API) to the reports."""
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (cents, tokens)):
            raise ValueError("usage added: non-negative integers")
        self._charge(cents * UNITS_PER_CENT, tokens)

    def transport(self, inner: httpx.BaseTransport | None = None) -> "MeteredTransport":
        return MeteredTransport(self, inner=inner)

    def async_transport(self, inner: httpx.AsyncBaseTransport | None = None) -> "AsyncMeteredTransport":
        return AsyncMeteredTransport(self, inner=inner)

    def _charge(self, units: int, tokens: int) -> None:
        if units <= 0 and tokens <= 0:
            return
        with self._lock:
            self._units += units
            self._tokens += tokens
            report = (_cents(self._units), self._tokens)
            if report == self._reported:
                return
            try:
                # Under the lock: two answers ending together report in order, never lower.
                self._reporter.report_usage(cents=report[0], tokens=report[1])
                self._reported = report
            except Exception as exc:  # noqa: BLE001 - refused, lost, finished: the spend went unreported
                self._trip_locked(f"usage report refused: {exc}")

    def _trip(self, why: str) -> None:
        with self._lock:
            self._trip_locked(why)

    def _trip_locked(self, why: str) -> None:
        if self._fault is None:
            self._fault = why
        log.error("model answer not metered; later requests are refused",
                  extra={"event": "metering_fault", "reason": why[:300]})

    def _check(self, model: str | None) -> None:
        with self._lock:
            fault = self._fault
        if fault is not None:
            raise MeteringError(f"request refused: an earlier answer could not be metered ({fault})")
        stopped = run_refusal(self._reporter)
        if stopped is not None:
            raise RunStopped(f"request refused: {stopped}")
        if model is not None and self.prices.lookup(model) is None:
            raise UnpricedModel(f"request refused: no price for model {model!r} in the price table")


class _Answer:
    """One answer's usage as seen so far; charges the meter what is new each time usage appears."""

    def __init__(self, meter: Meter, request_model: str | None, expect_usage: bool = False) -> None:
        self.meter, self.request_model = meter, request_model
        self.expect_usage = expect_usage  # a 2xx answer to a generation request naming a model
        self.model: str | None = None
        self.counts: dict[str, int] = {}
        self.charged = (0, 0)
        self.seen = False    # a usage block with counts was read
        # ... one that is the answer's final count: not only Anthropic's opening count in
        # message_start (output_tokens 1), which message_delta completes.
        self.final = False
        self.closed = False  # the answer ended (check_ended ran)

    def see(self, usage: Any, model: Any, final: bool = True) -> None:
        if self.model is None and isinstance(model, str) and model:
            self.model = model
        if usage is None:
            return
        try:
            counts = read_usage(usage)
            if not counts:
                return
            self.seen = True
            self.final = self.final or final
            # Streams repeat or grow their counts (Anthropic's message_delta): keep the largest.
            merged = dict(self.counts)
            for k, v in counts.items():
                merged[k] = max(merged.get(k, 0), v)
            # Priced by the model that answered (a router or alias may answer with another);
            # by the request's only when the answer names none. Unpriced: fail closed.
            named = self.model if self.model is not None else self.request_model
            price = self.meter.prices.lookup(named)
            if price is None:
                raise MalformedUsage(f"no price for the answer's model {self.model!r} "
                                     f"(asked for {self.request_model!r})")
            units, tokens = cost(merged, price)
        except MalformedUsage as exc:
            self.meter._trip(str(exc))
            return
        self.counts = merged
        du, dt = max(0, units - self.charged[0]), max(0, tokens - self.charged[1])
        self.charged = (max(units, self.charged[0]), max(tokens, self.charged[1]))
        self.meter._charge(du, dt)

    def check_ended(self, cut: BaseException | None = None) -> None:
        """The answer ended (a whole answer read, a stream at its end or its [DONE]), or reading it
        failed (`cut`: the server or the network cut it, streamed or read ahead whole): one that
        should have carried usage and carried none faults the meter -- never silently free."""
        if self.closed:
            return
        self.closed = True
        if self.expect_usage and not self.final and self.meter.fault is None:
            if self.seen:  # a stream that ended after its opening count: the rest of it went uncounted
                how = "was cut" if cut is not None else "ended"
                self.meter._trip(f"a streamed answer to a {self.request_model!r} request {how} before its final "
                                 "usage (only its opening count was read)"
                                 + (f" ({type(cut).__name__}: {str(cut)[:200]})" if cut is not None else ""))
            elif cut is not None:
                self.meter._trip(f"a 2xx answer to a {self.request_model!r} request was cut before its usage "
                                 f"was read ({type(cut).__name__}: {str(cut)[:200]})")
            else:
                self.meter._trip(f"a 2xx answer to a {self.request_model!r} request carried no usage")

    def see_object(self, obj: Any) -> None:
        """A JSON answer or one streamed event: usage at the top (chat, Anthropic's message_delta,
        a whole answer), under `response` (responses API events), `message` (message_start) or
        `x_groq` (Groq's streams)."""
        if not isinstance(obj, Mapping):
            return
        self.see(obj.get("usage"), obj.get("model"))
        for key in ("response", "message", "x_groq"):
            inner = obj.get(key)
            if isinstance(inner, Mapping):
                self.see(inner.get("usage"), inner.get("model"), final=key != "message")


class _Decoder:
    """Undoes Content-Encoding for the meter's own reading; the caller still gets the raw bytes."""

    def __init__(self, encoding: str) -> None:
        self.steps: list[Any] = []
        self.unknown: str | None = None
        for enc in reversed([e.strip().lower() for e in encoding.split(",") if e.strip()]):
            if enc in ("identity", ""):
                continue
            if enc in ("gzip", "x-gzip"):
                self.steps.append(zlib.decompressobj(16 + zlib.MAX_WBITS))
            elif enc == "deflate":
                self.steps.append(None)  # zlib-wrapped or raw: decided on the first bytes
            else:
                self.unknown = enc

    def feed(self, data: bytes) -> bytes:
        for i, step in enumerate(self.steps):
            if step is None:
                step = self.steps[i] = zlib.decompressobj() if data[:1] and data[0] & 0x0F == 8 \
                    and int.from_bytes(data[:2], "big") % 31 == 0 else zlib.decompressobj(-zlib.MAX_WBITS)
            data = step.decompress(data)
        return data


class _Events:
    """An incremental SSE reader: feeds each complete event's data to the answer."""

    def __init__(self, answer: _Answer) -> None:
        self.answer = answer
        self.buf = b""
        self.data: list[bytes] = []
        self.size = 0
        self.overflow = False

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        while True:
            cut = min((i for i in (self.buf.find(b"\n"), self.buf.find(b"\r")) if i >= 0), default=-1)
            if cut < 0:
                break
            if self.buf[cut:cut + 1] == b"\r" and cut + 1 == len(self.buf):
                break  # a \r at the end may be half of \r\n
            line, self.buf = self.buf[:cut], self.buf[cut + (2 if self.buf[cut:cut + 2] == b"\r\n" else 1):]
            self._line(line)
        if len(self.buf) + self.size > MAX_EVENT:
            self.overflow, self.buf, self.data, self.size = True, b"", [], 0

    def _line(self, line: bytes) -> None:
        if not line:
            self._dispatch()
        elif line.startswith(b"data:"):
            value = line[5:]
            value = value[1:] if value.startswith(b" ") else value
            self.data.append(value)
            self.size += len(value)

    def _dispatch(self) -> None:
        data, self.data, self.size = b"\n".join(self.data), [], 0
        if self.overflow:
            self.overflow = False
            self.answer.meter._trip(f"a streamed event over {MAX_EVENT} bytes")
            return
        if data.strip() == b"[DONE]":
            self.answer.check_ended()  # OpenAI's usage chunk comes before [DONE]
            return
        if not data:
            return
        try:
            obj = json.loads(data)
        except ValueError:
            return  # not JSON: no usage in it
        self.answer.see_object(obj)

    def end(self, completed: bool, cut: BaseException | None = None) -> None:
        """The stream ended (`completed`: read to its end, or `cut` by the server or the network) or
        was abandoned: a last event complete but unterminated still counts. Only a stream the caller
        did not abandon must have had usage."""
        if self.buf:
            self._line(self.buf)
            self.buf = b""
        if self.data:
            self._dispatch()
        if completed:
            self.answer.check_ended(cut)


@dataclass(frozen=True)
class _Asked:
    """What the request asked: its model, whether it asked for a stream, and whether it is a
    generation request naming a model (its 2xx answer must carry usage)."""

    model: str | None
    streamed: bool
    generation: bool


def _prepare(meter: Meter, request: httpx.Request) -> tuple[httpx.Request, _Asked]:
    """Refuses what the meter cannot price, or any request once the run may not spend; asks a
    streamed chat completion for its usage; keeps Accept-Encoding to what the meter can read."""
    try:
        body = request.content
    except httpx.RequestNotRead:
        body = b""
    doc: Any = None
    if body[:1] in (b"{", b" ", b"\n", b"\t", b"\r"):
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
    model = doc.get("model") if isinstance(doc, dict) and isinstance(doc.get("model"), str) else None
    meter._check(model)
    headers = request.headers.copy()
    accept = headers.get("accept-encoding")
    if accept is not None:
        kept = [e for e in accept.split(",") if e.split(";")[0].strip().lower() in ("gzip", "deflate", "identity")]
        headers["accept-encoding"] = ", ".join(e.strip() for e in kept) or "identity"
    path = request.url.path.rstrip("/")
    streamed = isinstance(doc, dict) and doc.get("stream") is True
    asked = _Asked(model, streamed, model is not None and path.endswith(_GENERATION))
    if streamed and path.endswith("/completions"):
        opts = doc.get("stream_options")
        if not (isinstance(opts, dict) and opts.get("include_usage") is True):
            # OpenAI sends a streamed answer's usage only when asked: the meter always asks.
            doc = {**doc, "stream_options": {**(opts if isinstance(opts, dict) else {}), "include_usage": True}}
            body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
            headers["content-length"] = str(len(body))
            return httpx.Request(request.method, request.url, headers=headers, content=body,
                                 extensions=request.extensions), asked
    if headers.raw == request.headers.raw:
        return request, asked
    request.headers = headers
    return request, asked


def _whole(answer: _Answer, response: httpx.Response, raw: bytes) -> None:
    decoder = _Decoder(response.headers.get("content-encoding", ""))
    ctype = response.headers.get("content-type", "").lower()
    if decoder.unknown:
        if response.is_success:
            answer.meter._trip(f"an answer in an encoding the meter cannot read ({decoder.unknown})")
        return
    try:
        text = decoder.feed(raw)
        obj = json.loads(text)
    except (zlib.error, ValueError):
        if response.is_success and "json" in ctype:
            answer.meter._trip(f"a {response.status_code} JSON answer that is not JSON")
        answer.check_ended()
        return
    answer.see_object(obj)  # any status: a usage block in an error answer is charged
    answer.check_ended()


class _SyncEvents(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, events: _Events, decoder: _Decoder) -> None:
        self.inner, self.events, self.decoder, self.ended = inner, events, decoder, False
        self.dead = False

    def __iter__(self) -> Iterator[bytes]:
        it = iter(self.inner)
        while True:
            try:
                chunk = next(it)
            except StopIteration:
                break
            except Exception as exc:
                self._end(completed=True, cut=exc)  # cut by the server or the network: not the caller's doing
                raise
            self._feed(chunk)
            yield chunk  # unchanged, as it came (a caller that stops here abandons the stream)
        self._end(completed=True)

    def _feed(self, chunk: bytes) -> None:
        if self.dead:
            return
        try:
            self.events.feed(self.decoder.feed(chunk))
        except zlib.error as exc:
            self.dead = True  # read no more of it; the caller still gets every byte
            self.events.answer.meter._trip(f"a stream that does not decode: {exc}")

    def _end(self, completed: bool = False, cut: BaseException | None = None) -> None:
        if not self.ended and not self.dead:
            self.ended = True
            self.events.end(completed, cut)

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self._end()  # abandoned halfway: what its usage said so far is charged already


class _AsyncEvents(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, events: _Events, decoder: _Decoder) -> None:
        self._sync = _SyncEvents(httpx.ByteStream(b""), events, decoder)
        self.inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        it = self.inner.__aiter__()
        while True:
            try:
                chunk = await it.__anext__()
            except StopAsyncIteration:
                break
            except Exception as exc:
                self._sync._end(completed=True, cut=exc)  # cut by the server or the network
                raise
            self._sync._feed(chunk)
            yield chunk
        self._sync._end(completed=True)

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        finally:
            self._sync._end()


class _Head:
    """What the transport does with one answer: SSE is read as it passes (`events`) -- an answer
    served as text/event-stream, or a 2xx non-JSON answer to a request that asked for a stream,
    whatever its content type says; JSON, and any other answer to a request naming a model, is read
    ahead whole (`whole`, up to MAX_READ_AHEAD)."""

    def __init__(self, meter: Meter, response: httpx.Response, asked: _Asked) -> None:
        self.response = response
        self.answer = _Answer(meter, asked.model, asked.generation and response.is_success)
        self.events: tuple[_Events, _Decoder] | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        ctype = response.headers.get("content-type", "").lower()
        sse = "text/event-stream" in ctype or (asked.streamed and response.is_success and "json" not in ctype)
        self.whole = not sse and ("json" in ctype or asked.model is not None)
        if sse:
            decoder = _Decoder(response.headers.get("content-encoding", ""))
            if decoder.unknown:
                meter._trip(f"a stream in an encoding the meter cannot read ({decoder.unknown})")
            else:
                self.events = (_Events(self.answer), decoder)

    def take(self, chunk: bytes) -> bool:
        """Keeps a chunk; True once the answer is too large to read ahead (it is then not metered)."""
        self.chunks.append(chunk)
        self.size += len(chunk)
        if self.size > MAX_READ_AHEAD:
            self.answer.meter._trip(f"an answer over {MAX_READ_AHEAD} bytes was not read for usage")
            return True
        return False

    def cut(self, exc: BaseException) -> None:
        """Reading the answer ahead failed (the server or the network cut it): as for a cut stream,
        an answer that had to carry usage faults the meter -- none of it was read."""
        self.answer.check_ended(cut=exc)

    def finish(self) -> httpx.Response:
        raw = b"".join(self.chunks)
        _whole(self.answer, self.response, raw)
        return _rebuilt(self.response, httpx.ByteStream(raw))


def _rebuilt(response: httpx.Response, stream: Any) -> httpx.Response:
    return httpx.Response(response.status_code, headers=response.headers, stream=stream,
                          extensions=response.extensions)


class _Chain(httpx.SyncByteStream, httpx.AsyncByteStream):
    """What was read ahead, then the rest of the inner stream."""

    def __init__(self, head: list[bytes], inner: Any) -> None:
        self.head, self.inner = head, inner

    def __iter__(self) -> Iterator[bytes]:
        yield from self.head
        yield from self.inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.head:
            yield chunk
        async for chunk in self.inner:
            yield chunk

    def close(self) -> None:
        self.inner.close()

    async def aclose(self) -> None:
        await self.inner.aclose()


class MeteredTransport(httpx.BaseTransport):
    """httpx transport that meters model answers: `httpx.Client(transport=MeteredTransport(run, prices))`.
    Pass a Meter instead of a run (and no prices) to share one meter between transports."""

    def __init__(self, run: UsageReporter | Meter, prices: Mapping[str, Any] | None = None, *,
                 inner: httpx.BaseTransport | None = None) -> None:
        self.meter = run if isinstance(run, Meter) else Meter(run, prices or {})
        self.inner = inner if inner is not None else httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request, asked = _prepare(self.meter, request)
        response = self.inner.handle_request(request)
        head = _Head(self.meter, response, asked)
        if head.events is not None:
            return _rebuilt(response, _SyncEvents(response.stream, *head.events))  # type: ignore[arg-type]
        if not head.whole:
            return response
        it = iter(response.stream)  # type: ignore[call-overload]
        try:
            for chunk in it:
                if head.take(chunk):
                    return _rebuilt(response, _Chain(head.chunks, _Rest(it, response.stream)))
        except Exception as exc:
            head.cut(exc)  # the model answered (and billed) and the body never arrived whole
            with contextlib.suppress(Exception):
                response.stream.close()  # type: ignore[attr-defined]
            raise
        response.stream.close()  # type: ignore[attr-defined]
        return head.finish()

    def close(self) -> None:
        self.inner.close()


class _Rest(httpx.SyncByteStream):
    def __init__(self, it: Iterator[bytes], stream: Any) -> None:
        self.it, self.stream = it, stream

    def __iter__(self) -> Iterator[bytes]:
        yield from self.it

    def close(self) -> None:
        self.stream.close()


class _AsyncRest(httpx.AsyncByteStream):
    def __init__(self, it: AsyncIterator[bytes], stream: Any) -> None:
        self.it, self.stream = it, stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.it:
            yield chunk

    async def aclose(self) -> None:
        await self.stream.aclose()


class AsyncMeteredTransport(httpx.AsyncBaseTransport):
    """The asyncio form: `httpx.AsyncClient(transport=AsyncMeteredTransport(run, prices))`. It never
    blocks the loop: the meter's lock guards arithmetic and an in-memory report only."""

    def __init__(self, run: UsageReporter | Meter, prices: Mapping[str, Any] | None = None, *,
                 inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.meter = run if isinstance(run, Meter) else Meter(run, prices or {})
        self.inner = inner if inner is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request, asked = _prepare(self.meter, request)
        response = await self.inner.handle_async_request(request)
        head = _Head(self.meter, response, asked)
        if head.events is not None:
            return _rebuilt(response, _AsyncEvents(response.stream, *head.events))  # type: ignore[arg-type]
        if not head.whole:
            return response
        it = response.stream.__aiter__()  # type: ignore[union-attr]
        try:
            async for chunk in it:
                if head.take(chunk):
                    return _rebuilt(response, _Chain(head.chunks, _AsyncRest(it, response.stream)))
        except Exception as exc:
            head.cut(exc)  # the model answered (and billed) and the body never arrived whole
            with contextlib.suppress(Exception):
                await response.stream.aclose()  # type: ignore[union-attr]
            raise
        await response.stream.aclose()  # type: ignore[union-attr]
        return head.finish()

    async def aclose(self) -> None:
        await self.inner.aclose()
