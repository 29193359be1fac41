"""The receiver-side fencing helper: plain function, stores (property-based), ASGI middleware."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.fencing import Accept, MemoryStore, Reject, Replay, SQLiteStore, StoredResponse, check

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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


requests = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 6), st.sampled_from(["x", "y", "z"])),
                    max_size=40)


@settings(max_examples=60, deadline=None)
@given(requests)
def test_store_properties(tmp_path_factory: pytest.TempPathFactory, reqs: list[tuple[str, int, str]]) -> None:
    """For both stores and any request sequence: an accepted fence is never below one accepted
    before for the entity; a key is accepted at most once; both stores decide alike."""
    memory, sqlite = MemoryStore(), SQLiteStore(tmp_path_factory.mktemp("f") / "s.sqlite")
    highest: dict[str, int] = {}
    accepted_keys: set[str] = set()
    for entity, fence, op in reqs:
        key = f"{entity}:{op}"
        results = []
        for store in (memory, sqlite):
            d = check(store, entity, fence, key)
            if isinstance(d, Accept):
                store.remember(key, StoredResponse(200, f"{fence}".encode()))
            results.append(type(d))
        assert results[0] == results[1]
        if results[0] is Accept:
            assert fence >= highest.get(entity, -1)
            assert key not in accepted_keys
            accepted_keys.add(key)
            highest[entity] = fence
        elif results[0] is Reject:
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
