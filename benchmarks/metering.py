"""What metering a model's answers costs the worker (tether.worker.metering), without the network:
the same answers through an httpx client with and without the metered transport, over an
in-memory inner transport. Whole chat completions, and streamed ones of `--chunks` SSE events.

    .venv/bin/python benchmarks/metering.py [--n 2000] [--chunks 200] [--out benchmarks/results/metering-DATE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tether.worker.metering import Meter  # noqa: E402

PRICES = {"gpt-x": {"input": 2.5, "output": 10, "cached_input": 1.25}}
USAGE = {"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100}


class _Reporter:
    """Takes reports as a WorkerRun would (cumulative, never decreasing), without a heartbeat."""

    def __init__(self) -> None:
        self.cents = self.tokens = 0

    def report_usage(self, cents: int, tokens: int = 0) -> None:
        self.cents, self.tokens = cents, tokens


def _whole(_: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"id": "c", "object": "chat.completion", "model": "gpt-x", "usage": USAGE,
                                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]})


def _streamed(chunks: int) -> Callable[[httpx.Request], httpx.Response]:
    events = [json.dumps({"id": "c", "object": "chat.completion.chunk", "model": "gpt-x",
                          "choices": [{"index": 0, "delta": {"content": "tok "}}]}) for _ in range(chunks)]
    events.append(json.dumps({"id": "c", "object": "chat.completion.chunk", "model": "gpt-x", "choices": [],
                              "usage": USAGE}))
    body = "".join(f"data: {e}\n\n" for e in events) + "data: [DONE]\n\n"

    def answer(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())

    return answer


def _sync(handler: Callable[[httpx.Request], httpx.Response], metered: bool, stream: bool, n: int) -> float:
    inner = httpx.MockTransport(handler)
    transport = Meter(_Reporter(), PRICES).transport(inner) if metered else inner
    body = {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    with httpx.Client(transport=transport, base_url="http://model") as client:
        started = time.perf_counter()
        for _ in range(n):
            if stream:
                with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                    for _line in resp.iter_lines():
                        pass
            else:
                client.post("/v1/chat/completions", json=body).json()
        return (time.perf_counter() - started) / n


def _async(handler: Callable[[httpx.Request], httpx.Response], metered: bool, stream: bool, n: int) -> float:
    async def main() -> float:
        inner = httpx.MockTransport(handler)
        transport = Meter(_Reporter(), PRICES).async_transport(inner) if metered else inner
        body = {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        async with httpx.AsyncClient(transport=transport, base_url="http://model") as client:
            started = time.perf_counter()
            for _ in range(n):
                if stream:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                        async for _line in resp.aiter_lines():
                            pass
                else:
                    (await client.post("/v1/chat/completions", json=body)).json()
            return (time.perf_counter() - started) / n

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--chunks", type=int, default=200)
    parser.add_argument("--out", default=f"benchmarks/results/metering-{dt.date.today()}.json")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for flavour, run in (("sync", _sync), ("asyncio", _async)):
        for label, handler, stream in (("whole answer", _whole, False),
                                       (f"stream of {args.chunks} events", _streamed(args.chunks), True)):
            n = args.n if not stream else max(args.n // 10, 50)
            run(handler, True, stream, max(n // 10, 10))  # warm-up
            plain, metered = run(handler, False, stream, n), run(handler, True, stream, n)
            rows.append({"client": flavour, "answer": label, "requests": n, "plain_us": round(plain * 1e6, 1),
                         "metered_us": round(metered * 1e6, 1), "overhead_us": round((metered - plain) * 1e6, 1)})
            print(f"{flavour:8} {label:22} plain {plain * 1e6:8.1f} us  metered {metered * 1e6:8.1f} us  "
                  f"overhead {(metered - plain) * 1e6:8.1f} us", flush=True)
    Path(args.out).write_text(json.dumps({"date": str(dt.date.today()), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
