"""The receiver-side fencing helper: plain function, stores (property-based), ASGI middleware."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.fencing import (Accept, FencingMiddleware, InProgress, MemoryStore, Reject, Replay, SQLiteStore,
                            StoredResponse, check)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _stores(tmp: Path):  # type: ignore[no-untyped-def]
    return [MemoryStore(), SQLiteStore(tmp / "fences.sqlite")]


@pytest.mark.parametrize("kind", [0, 1], ids=["memory", "sqlite"])
def test_stale_fence_is_refused_and_key_is_replayed(tmp_path: Path, kind: int) -> None:
    store = _stores(tmp_path)[kind]
    assert isinstance(check(store, "inv-1", "3", "inv-1:capture"), Accept)
    store.remember("inv-1:capture", StoredResponse(201, b'{"id":1}'))
    stale = check(store, "inv-1", "1", "inv-1:capture")
    assert isinstance(stale, Reject) and stale.status == 409 and stale.highest == 3
    assert "stale" in stale.message
    replay = check(store, "inv-1", "3", "inv-1:capture")
    assert isinstance(replay, Replay) and replay.response.body == b'{"id":1}'
    assert isinstance(check(store, "inv-1", "5", "inv-1:refund"), Accept)
    assert isinstance(check(store, "inv-2", "1", "inv-2:capture"), Accept)  # entities are independent


@pytest.mark.parametrize(("fence", "key"), [(None, "k:op"), ("3", None), ("x", "k:op"), ("-1", "k:op")])
def test_bad_headers_are_a_400(fence: str | None, key: str | None) -> None:
    decision = check(MemoryStore(), "k", fence, key)
    assert isinstance(decision, Reject) and decision.status == 400


requests = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 6), st.sampled_from(["x", "y", "z"]),
                              st.sampled_from(["remember", "release", "leave"])),
                    max_size=40)


@settings(max_examples=60, deadline=None)
@given(requests)
def test_store_properties(tmp_path_factory: pytest.TempPathFactory, reqs: list[tuple[str, int, str, str]]) -> None:
    """For both stores and any request sequence (an accepted effect finishes, fails retryably, or
    is still running): an accepted fence is never below one accepted before for the entity; a key
    is never accepted while it is in flight or after it was remembered; both stores decide alike."""
    memory, sqlite = MemoryStore(), SQLiteStore(tmp_path_factory.mktemp("f") / "s.sqlite")
    highest: dict[str, int] = {}
    in_flight: set[str] = set()
    remembered: set[str] = set()
    for entity, fence, op, then in reqs:
        key = f"{entity}:{op}"
        results = []
        for store in (memory, sqlite):
            d = check(store, entity, fence, key)
            if isinstance(d, Accept) and then == "remember":
                store.remember(key, StoredResponse(200, f"{fence}".encode()))
            elif isinstance(d, Accept) and then == "release":
                store.release(key)
            results.append(type(d))
        assert results[0] == results[1]
        if results[0] is Accept:
            assert fence >= highest.get(entity, -1)
            assert key not in in_flight and key not in remembered
            highest[entity] = fence
            {"remember": remembered, "leave": in_flight}.get(then, set()).add(key)
        elif results[0] is InProgress:
            assert key in in_flight and fence >= highest[entity]
        elif results[0] is Replay:
            assert key in remembered
        else:
            assert fence < highest[entity]
    sqlite.close()


def _load_receiver():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("example_receiver", EXAMPLES / "receiver.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_receiver_behind_the_middleware(tmp_path: Path) -> None:
    fenced, app = _load_receiver().build(str(tmp_path / "r.sqlite"))

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fenced), base_url="http://receiver") as c:
            h = lambda fence: {"Idempotency-Key": "invoice:8f1b:capture", "X-Execution-Fence": fence}  # noqa: E731
            return [
                await c.post("/captures", json={"amount": 100}, headers=h("3")),   # W2: accepted
                await c.post("/captures", json={"amount": 100}, headers=h("3")),   # W2 retry: replayed
                await c.post("/captures", json={"amount": 100}, headers=h("1")),   # W1, too late: refused
                await c.post("/captures", json={"amount": 100}),                   # no headers
            ]

    first, again, stale, bare = asyncio.run(scenario())
    assert first.status_code == 201 and first.json()["fence"] == 3
    assert again.status_code == 201 and again.json() == first.json()
    assert again.headers["idempotent-replayed"] == "true"
    assert stale.status_code == 409 and stale.json()["error"] == "StaleFence" and stale.json()["highestFence"] == 3
    assert bare.status_code == 400
    assert len(app.captures) == 1  # exactly one effect


# --- a repeated key while the first call is still running --------------------------------


@pytest.mark.parametrize("kind", [0, 1], ids=["memory", "sqlite"])
def test_store_answers_in_progress_until_the_effect_is_remembered_or_released(tmp_path: Path, kind: int) -> None:
    store = _stores(tmp_path)[kind]
    assert isinstance(check(store, "inv-1", "2", "inv-1:capture"), Accept)
    duplicate = check(store, "inv-1", "2", "inv-1:capture")
    assert isinstance(duplicate, InProgress) and duplicate.status == 409 and "in progress" in duplicate.message
    # A higher fence with the same key must not run the effect beside the first call either.
    assert isinstance(check(store, "inv-1", "3", "inv-1:capture"), InProgress)
    # The fence is still checked first: a stale owner learns it is stale, not that it is busy.
    stale = check(store, "inv-1", "1", "inv-1:capture")
    assert isinstance(stale, Reject) and not isinstance(stale, InProgress) and stale.highest == 2
    # Another key of the entity is independent.
    assert isinstance(check(store, "inv-1", "2", "inv-1:refund"), Accept)
    store.release("inv-1:capture")  # the effect failed retryably: the next request runs it
    assert isinstance(check(store, "inv-1", "2", "inv-1:capture"), Accept)
    store.remember("inv-1:capture", StoredResponse(201, b'{"id":1}'))
    replay = check(store, "inv-1", "2", "inv-1:capture")
    assert isinstance(replay, Replay) and replay.response.body == b'{"id":1}'


def test_sqlite_in_flight_mark_is_shared_across_processes_and_expires(tmp_path: Path) -> None:
    now = [1000.0]
    one = SQLiteStore(tmp_path / "f.sqlite", in_flight_seconds=60, clock=lambda: now[0])
    two = SQLiteStore(tmp_path / "f.sqlite", in_flight_seconds=60, clock=lambda: now[0])
    assert isinstance(check(one, "e", 1, "e:op"), Accept)
    assert isinstance(check(two, "e", 1, "e:op"), InProgress)  # another process sees the mark
    now[0] += 59
    assert isinstance(check(two, "e", 1, "e:op"), InProgress)
    # Only a process that died mid-effect leaves a mark this old behind: a retry may run it.
    now[0] += 2
    assert isinstance(check(two, "e", 1, "e:op"), Accept)
    forever = SQLiteStore(tmp_path / "g.sqlite", in_flight_seconds=None, clock=lambda: now[0])
    assert isinstance(check(forever, "e", 1, "e:op"), Accept)
    now[0] += 10**9
    assert isinstance(check(forever, "e", 1, "e:op"), InProgress)
    for store in (one, two, forever):
        store.close()


class _SlowEffect:
    """An ASGI side effect whose first call waits until the test lets it finish."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.calls = 0
        self.entered = asyncio.Event()
        self.finish = asyncio.Event()

    async def __call__(self, scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def,type-arg]
        self.calls += 1
        number, status = self.calls, self.statuses[min(self.calls, len(self.statuses)) - 1]
        if number == 1:
            self.entered.set()
            await self.finish.wait()
        if status == 0:
            raise RuntimeError("the effect crashed")
        body = f'{{"call":{number}}}'.encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


HEADERS = {"Idempotency-Key": "invoice:8f1b:capture", "X-Execution-Fence": "3"}


async def _post(app, headers: dict[str, str] = HEADERS) -> httpx.Response:  # type: ignore[no-untyped-def]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://receiver") as c:
        return await c.post("/captures", json={"amount": 100}, headers=headers)


@pytest.mark.parametrize("kind", [0, 1], ids=["memory", "sqlite"])
def test_middleware_refuses_a_retry_during_a_slow_first_call(tmp_path: Path, kind: int) -> None:
    effect = _SlowEffect([201])
    fenced = FencingMiddleware(effect, _stores(tmp_path)[kind])  # type: ignore[arg-type]

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        first = asyncio.create_task(_post(fenced))
        await asyncio.wait_for(effect.entered.wait(), timeout=10)
        retry = await asyncio.wait_for(_post(fenced), timeout=10)  # while the first is still running
        effect.finish.set()
        done = await asyncio.wait_for(first, timeout=10)
        return retry, done, await _post(fenced)

    retry, done, later = asyncio.run(scenario())
    assert retry.status_code == 409, retry.text
    assert retry.json()["error"] == "InProgress" and "in progress" in retry.json()["message"]
    assert retry.headers["retry-after"] == "1"
    assert done.status_code == 201 and done.json() == {"call": 1}
    assert later.status_code == 201 and later.json() == {"call": 1} and later.headers["idempotent-replayed"] == "true"
    assert effect.calls == 1  # the effect ran exactly once


@pytest.mark.parametrize("kind", [0, 1], ids=["memory", "sqlite"])
@pytest.mark.parametrize("failure", [500, 0], ids=["server-error", "exception"])
def test_middleware_frees_the_key_when_the_effect_fails(tmp_path: Path, kind: int, failure: int) -> None:
    """A failed first call must not leave its key in flight forever: the retry runs the effect."""
    effect = _SlowEffect([failure, 201])
    effect.finish.set()
    fenced = FencingMiddleware(effect, _stores(tmp_path)[kind])  # type: ignore[arg-type]

    async def scenario() -> httpx.Response:
        try:
            first = await _post(fenced)
            assert first.status_code == 500
        except RuntimeError:
            assert failure == 0
        return await _post(fenced)

    retry = asyncio.run(scenario())
    assert retry.status_code == 201 and retry.json() == {"call": 2} and effect.calls == 2


def test_middleware_frees_the_key_when_the_request_is_cancelled(tmp_path: Path) -> None:
    effect = _SlowEffect([201])
    store = MemoryStore()
    fenced = FencingMiddleware(effect, store)  # type: ignore[arg-type]

    async def scenario() -> None:
        first = asyncio.create_task(_post(fenced))
        await asyncio.wait_for(effect.entered.wait(), timeout=10)
        first.cancel()  # the client went away; the server cancels the handler
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(scenario())
    assert isinstance(check(store, "invoice:8f1b", 3, "invoice:8f1b:capture"), Accept)
