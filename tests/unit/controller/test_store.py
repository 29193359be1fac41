"""The one store type (controller.store): a watch event is kept only when newer, a read's answer
neither overwrites nor revives what the watch brought meanwhile, our own write's answer is kept
only over the version it replaced, and the named indexes follow every change."""

from __future__ import annotations

from typing import Any

import pytest

from tether.controller.store import Store


def _obj(name: str, rv: str, uid: str = "u", group: str | None = "g") -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": uid, "resourceVersion": rv}, "group": group}


def _store() -> Store[str]:
    return Store(lambda: 0.0, indexes={"group": lambda body: body["group"]})


def test_a_watch_event_is_kept_only_when_not_older() -> None:
    s = _store()
    assert s.put("a", _obj("a", "5"))
    assert not s.put("a", _obj("a", "4"))  # an older event after a newer one (a relist's)
    assert s["a"]["metadata"]["resourceVersion"] == "5"
    assert s.put("a", _obj("a", "3", uid="namesake"))  # another object of the name
    assert s["a"]["metadata"]["uid"] == "namesake"


def test_a_reads_answer_yields_to_what_the_watch_did_since_it_was_sent() -> None:
    s = _store()
    s.put("a", _obj("a", "5"))
    mark = s.stamps.mark()
    s.put("a", _obj("a", "6"))  # the watch, while the read was on its way
    assert not s.read("a", _obj("a", "5"), mark) and s["a"]["metadata"]["resourceVersion"] == "6"
    assert not s.read("a", None, mark) and "a" in s  # a 404 sent before does not drop it
    mark = s.stamps.mark()
    s.remove("a")  # deleted by the watch: a late answer never revives it
    assert not s.read("a", _obj("a", "6"), mark) and "a" not in s
    mark = s.stamps.mark()
    assert s.read("b", _obj("b", "1"), mark) and s.read("b", None, s.stamps.mark()) and "b" not in s


def test_our_writes_answer_is_kept_only_over_the_version_it_replaced() -> None:
    s = _store()
    s.put("a", _obj("a", "5"))
    assert s.written("a", _obj("a", "7"), "5") and s["a"]["metadata"]["resourceVersion"] == "7"
    s.put("a", _obj("a", "9"))  # another writer's, brought by the watch before our next answer
    assert not s.written("a", _obj("a", "8"), "7") and s["a"]["metadata"]["resourceVersion"] == "9"
    s.remove("a")
    assert not s.written("a", _obj("a", "10"), "9") and "a" not in s  # a deletion seen is never undone


def test_indexes_follow_every_change() -> None:
    s = _store()
    s.put("a", _obj("a", "1", group="x"))
    s.put("b", _obj("b", "1", group="x"))
    assert s.by("group", "x") == {"a", "b"}
    s.put("a", _obj("a", "2", group="y"))
    assert (s.by("group", "x"), s.by("group", "y")) == ({"b"}, {"a"})
    s.remove("b")
    s.put("c", _obj("c", "1", group=None))  # indexed under nothing
    assert s.by("group", "x") == frozenset() and len(s) == 2 and s.copy().keys() == {"a", "c"}


def _cached_run() -> tuple[Any, dict[str, Any]]:
    """A run cache whose classes are listed (none), holding one External run."""
    import asyncio
    import datetime as dt

    from tether.controller.cache import RunCache

    cache = RunCache(lambda: dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), lambda: 0.0)

    async def no_classes() -> list[dict[str, Any]]:
        return []

    asyncio.run(cache.classes.sync(no_classes))
    body = {"metadata": {"name": "r", "namespace": "ns", "uid": "u", "resourceVersion": "1", "generation": 1},
            "spec": {"executor": "External"}, "status": {}}
    cache.put_run(body)
    return cache, body


def test_a_run_is_parsed_once_per_resource_version_our_write_produced() -> None:
    """The pass after our own write decides from the parse of its answer; a class change (for a run
    its class still shapes) or another body under the key is parsed afresh."""
    cache, body = _cached_run()
    first = cache.snapshot(("ns", "r"))
    assert first is not None
    written = {**body, "metadata": {**body["metadata"], "resourceVersion": "2"}, "status": {"phase": "Pending"}}
    after_write = cache.written_run(first, written)
    again = cache.snapshot(("ns", "r"))
    assert again is not None and again.run is after_write.run  # not parsed again
    assert cache.snapshot(("ns", "r")).run is not after_write.run  # type: ignore[union-attr]  # taken once
    third = cache.written_run(again, {**written, "metadata": {**written["metadata"], "resourceVersion": "3"}})
    cache.classes.on_event("ADDED", {"metadata": {"name": "c"}, "spec": {}})  # the classes moved
    assert cache.snapshot(("ns", "r")).run is not third.run  # type: ignore[union-attr]


def test_the_watchs_echo_of_our_write_ends_the_parse_kept_for_the_next_pass() -> None:
    """A quiet run (no pass until its next alarm) holds no second copy of itself in parsed form:
    kept until then, that copy cost 75 MB at 5,000 runs (benchmarks/heap_probe.py shows it)."""
    import gc
    import weakref

    cache, body = _cached_run()
    first = cache.snapshot(("ns", "r"))
    assert first is not None
    written = {**body, "metadata": {**body["metadata"], "resourceVersion": "2"}, "status": {"phase": "Pending"}}
    parsed = weakref.ref(cache.written_run(first, written).run)
    gc.collect()
    assert parsed() is not None  # kept for the pass right after the write
    assert not cache.put_run({**written}).stored  # the echo: the same resourceVersion, nothing new to store
    gc.collect()
    assert parsed() is None  # and the parse is gone with it
    assert cache.snapshot(("ns", "r")).run.status.phase == "Pending"  # type: ignore[union-attr]  # parsed afresh


def test_an_index_added_later_covers_what_is_held_and_what_comes() -> None:
    s = _store()
    s.put("a", _obj("a", "1", group="x"))
    s.add_index("name", lambda body: body["metadata"]["name"].upper())
    s.put("b", _obj("b", "1"))
    assert s.by("name", "A") == {"a"} and s.by("name", "B") == {"b"}
    s.remove("a")
    assert s.by("name", "A") == frozenset()
    with pytest.raises(ValueError):
        s.add_index("group", lambda body: None)
